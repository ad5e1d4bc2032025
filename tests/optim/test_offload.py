"""``shardwise.offload_optimizer`` and the offload pipeline under it (shardwise/offload_transfers.py).

On the CPU the pipeline runs its one code path with host stand-ins for streams and events (shardwise/
streams.py): these tests hold it to exactness (the same bits as the run without offload, with a plain torch
optimizer and ``shardwise.clip_grad_norm_``) and read its bookkeeping: pinned host buffers made once per group
and reused, every device->host copy's event waited before the gradient is handed out, each unit's optimizer
step taken before the backward of the units before it ends, each shard's copy back issued before its next
unshard and waited by it, nothing left over between steps. A CUDA run overlaps these; a CPU run cannot show
that (bench/gpu_offload.py measures it when a GPU is lent).
"""

from __future__ import annotations

import contextlib
import tempfile

import pytest
import torch

from harness import run_distributed
from models import GPT, Block, gpt_loss, tiny_gpt_config
from parity_utils import (ADAMW, SGD, assert_engine_clean, local_slice, make_batches, run_scenarios, scenario,
                          sharded_param_errors, spawn_once, worst)

STEPS, MICRO, CLIP, VOCAB = 3, 2, 0.05, 62
OPTIMIZERS = {"sgd": (torch.optim.SGD, SGD), "adamw": (torch.optim.AdamW, ADAMW)}


def _model():
    torch.manual_seed(0)
    return GPT(tiny_gpt_config())


def _train(rank, ws, model, opt, *, micro=MICRO, clip=None, steps=STEPS, on_step=None, synced=False,
           set_to_none=True):
    """``steps`` steps of ``micro`` micro-batches (all but the last under no_sync unless ``synced``); the loss
    of each step and a copy of every shard parameter after it."""
    import shardwise

    sharded = hasattr(model, "_shardwise")
    batches = make_batches(steps * micro, VOCAB)
    losses, params = [], []
    for s in range(steps):
        for i in range(micro):
            x, y = batches[s * micro + i]
            if sharded:
                x, y = local_slice(x, rank, ws), local_slice(y, rank, ws)
            quiet = shardwise.no_sync(model) if sharded and i < micro - 1 and not synced else contextlib.nullcontext()
            with quiet:
                loss = gpt_loss(model, x, y) / micro
                loss.backward()
        if sharded:
            assert_engine_clean(model, f"after step {s}'s backward")
        if clip is not None:
            if sharded:
                shardwise.clip_grad_norm_(model, clip)
            else:
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad(set_to_none=set_to_none)
        if sharded:
            assert_engine_clean(model, f"after step {s}")
        if on_step is not None:
            on_step(s)
        losses.append(loss.detach().clone())
        params.append([p.detach().clone() for p in model.parameters()])
    return losses, params


def _offloaded(strategy, optimizer, clip, worker_thread=None, step_in_backward=True):
    import shardwise

    model = shardwise.shard(_model(), units={Block}, strategy=strategy,
                            offload=shardwise.CPUOffload(worker_thread=worker_thread))
    cls, kw = OPTIMIZERS[optimizer]
    opt = shardwise.offload_optimizer(model, cls, max_grad_norm=clip, step_in_backward=step_in_backward, **kw)
    return model, opt


def _parity(rank, ws, strategy="full_shard", optimizer="adamw", clip=None, micro=MICRO, torch_optimizer=False,
            **offload_kw):
    """The offloaded run against shardwise without offload (bitwise) and the single-process reference.
    ``torch_optimizer``: plain ``CPUOffload()`` with a torch optimizer, every micro-batch's backward synced
    and ``zero_grad(set_to_none=False)`` (gradients added into ``.grad`` from the second landing on)."""
    import shardwise

    cls, kw = OPTIMIZERS[optimizer]
    how = dict(micro=micro, synced=torch_optimizer, set_to_none=not torch_optimizer)
    plain = shardwise.shard(_model(), units={Block}, strategy=strategy)
    want_losses, want_params = _train(rank, ws, plain, cls(plain.parameters(), **kw), clip=clip, **how)
    if torch_optimizer:
        model = shardwise.shard(_model(), units={Block}, strategy=strategy, offload=shardwise.CPUOffload())
        losses, params = _train(rank, ws, model, cls(model.parameters(), **kw), clip=clip, **how)
    else:
        model, opt = _offloaded(strategy, optimizer, clip, **offload_kw)
        losses, params = _train(rank, ws, model, opt, **how)
    different = [f"step {s} param {i}" for s in range(STEPS) for i, (a, b) in enumerate(zip(params[s], want_params[s]))
                 if not torch.equal(a, b)]
    different += [f"step {s} loss" for s in range(STEPS) if not torch.equal(losses[s], want_losses[s])]
    if optimizer != "sgd":
        return {"different": different}
    # SGD with momentum is the sharp test against the reference (AdamW amplifies the rounding of tiny
    # gradients: its parity is the plain run's, which equals this one bit for bit).
    ref = _model()
    _train(rank, ws, ref, cls(ref.parameters(), **kw), clip=clip, **how)
    return {"different": different, "reference": worst(sharded_param_errors(model, ref))}


def _bookkeeping(rank, ws):
    """Three steps of the offload pipeline with its trace on: what each step did, in order."""
    from shardwise.engine.core.runtime import runtime_of

    model, opt = _offloaded("full_shard", "adamw", None)
    transfers = runtime_of(model).transfers
    events = []
    make_event = transfers.streams.new_event

    def new_event():
        events.append(make_event())
        return events[-1]

    transfers.streams.new_event = new_event
    transfers.trace = []
    per_step = []

    def on_step(s):
        buffers = {(g.ids, kind): v.data_ptr() for (g, kind), v in transfers.host_buffers.items()}
        per_step.append(dict(trace=list(transfers.trace), allocations=transfers.allocations, buffers=buffers,
                             ahead=len(transfers._ahead), unwaited=sum(e.waits == 0 for e in events),
                             unrecorded=sum(not e.recorded for e in events)))
        transfers.trace.clear()

    _train(rank, ws, model, opt, micro=1, on_step=on_step)
    units = {u.flat_groups[0].ids: u.label for u in runtime_of(model).units}
    groups = len([g for g in runtime_of(model).flat_groups()])
    return {"steps": per_step, "units": units, "groups": groups, "window": transfers.window}


def _misuse(rank, ws):
    import shardwise
    from shardwise.errors import ShardwiseError

    out = {}
    model, _opt = _offloaded("full_shard", "sgd", None)
    x, y = (local_slice(t, rank, ws) for t in make_batches(1, VOCAB)[0])
    gpt_loss(model, x, y).backward()
    try:
        shardwise.clip_grad_norm_(model, 1.0)
    except ShardwiseError as e:
        out["clip"] = str(e)
    try:
        gpt_loss(model, x, y).backward()  # a second synced backward before step()
    except ShardwiseError as e:
        out["second_backward"] = str(e)
    plain = shardwise.shard(_model(), units={Block})
    try:
        shardwise.offload_optimizer(plain, torch.optim.SGD, lr=0.1)
    except ShardwiseError as e:
        out["no_offload"] = str(e)
    return out


def _checkpoint(rank, ws, ckpt_dir):
    """Two steps, save; a fresh model and offload optimizer load it; one more step on both: same bits."""
    import shardwise

    model, opt = _offloaded("full_shard", "adamw", CLIP)
    _train(rank, ws, model, opt, steps=2)
    shardwise.save_checkpoint(f"{ckpt_dir}/step2", model, opt, step=2)
    resumed, resumed_opt = _offloaded("full_shard", "adamw", CLIP)
    shardwise.load_checkpoint(f"{ckpt_dir}/step2", resumed, resumed_opt)
    same_state = all(torch.equal(opt.state[a][k], resumed_opt.state[b][k])
                     for a, b in zip(model.parameters(), resumed.parameters()) for k in opt.state[a])
    _, after = _train(rank, ws, model, opt, steps=1)
    _, resumed_after = _train(rank, ws, resumed, resumed_opt, steps=1)
    return {"state": same_state and len(resumed_opt.state) == len(opt.state),
            "params": all(torch.equal(a, b) for a, b in zip(after[0], resumed_after[0]))}


PARITY = {
    f"{strategy}_{optimizer}_{'clip' if clip else 'noclip'}": dict(strategy=strategy, optimizer=optimizer, clip=clip)
    for strategy in ("full_shard", "shard_grad_op") for optimizer in OPTIMIZERS for clip in (None, CLIP)
}
PARITY["full_shard_adamw_noclip_worker_thread"] = dict(optimizer="adamw", worker_thread=True)
PARITY["full_shard_sgd_clip_worker_thread"] = dict(optimizer="sgd", clip=CLIP, worker_thread=True)
PARITY["full_shard_sgd_noclip_step_in_step"] = dict(optimizer="sgd", step_in_backward=False)
PARITY["full_shard_sgd_noclip_no_accumulation"] = dict(optimizer="sgd", micro=1)
PARITY["torch_optimizer_sgd_clip_synced_accumulation"] = dict(optimizer="sgd", clip=CLIP, torch_optimizer=True)
DEFAULT_WS2 = ["full_shard_sgd_noclip", "full_shard_sgd_clip", "full_shard_adamw_noclip", "full_shard_adamw_clip",
               "shard_grad_op_sgd_clip", "shard_grad_op_adamw_noclip", "full_shard_adamw_noclip_worker_thread",
               "full_shard_sgd_noclip_step_in_step", "full_shard_sgd_noclip_no_accumulation",
               "torch_optimizer_sgd_clip_synced_accumulation"]
DEFAULT_WS3 = ["full_shard_adamw_clip", "shard_grad_op_sgd_noclip"]


def _worker(rank, ws, ckpt_dir, cases):
    scenarios = {name: (lambda r, w, kw=PARITY[name]: _parity(r, w, **kw)) for name in cases}
    if ws == 2:
        scenarios.update(bookkeeping=_bookkeeping, misuse=_misuse,
                         checkpoint=lambda r, w: _checkpoint(r, w, ckpt_dir))
    return run_scenarios(scenarios, rank, ws)


@spawn_once
def _report(ws: int, slow: bool) -> dict:
    cases = list(PARITY) if slow else {2: DEFAULT_WS2, 3: DEFAULT_WS3}[ws]
    with tempfile.TemporaryDirectory() as ckpt_dir:
        return run_distributed(_worker, ws, ckpt_dir, cases)[0]


def _check_parity(r: dict, label: str) -> None:
    assert not r["different"], f"{label}: offloaded run differs from the run without offload at {r['different'][:4]}"
    where, err = r.get("reference", ("", 0.0))
    assert err <= 1e-6, f"{label}: {where} off the single-process reference by {err:.2e}"


@pytest.mark.parametrize("case", DEFAULT_WS2)
def test_offloaded_training_equals_the_run_without_offload_at_two_ranks(case):
    """SGD+momentum and AdamW, with and without max_grad_norm, no_sync accumulation, full_shard and
    shard_grad_op, inline and on the worker thread: the same bits as a plain optimizer without offload."""
    _check_parity(scenario(_report(2, False), case), case)


@pytest.mark.slow
@pytest.mark.parametrize("case", DEFAULT_WS3)
def test_offloaded_training_equals_the_run_without_offload_at_three_ranks(case):
    """Uneven shards (3 ranks): the same bits as without offload."""
    _check_parity(scenario(_report(3, False), case), case)


@pytest.mark.slow
@pytest.mark.parametrize("ws", [2, 3])
@pytest.mark.parametrize("case", list(PARITY))
def test_offloaded_training_equals_the_run_without_offload_every_case(ws, case):
    _check_parity(scenario(_report(ws, True), case), case)


def _book():
    return scenario(_report(2, False), "bookkeeping")


def test_pinned_host_buffers_are_made_once_per_group_and_reused_every_step():
    r = _book()
    first = r["steps"][0]
    assert first["allocations"] == r["groups"], "one host gradient buffer per trainable flat group"
    for s in r["steps"][1:]:
        assert s["allocations"] == first["allocations"] and s["buffers"] == first["buffers"], "buffers reallocated"


def test_every_copy_records_an_event_that_is_waited_before_its_data_is_read():
    for s, step in enumerate(_book()["steps"]):
        # Waited: all but the copies step() just issued for the next forward (waited by its unshards).
        assert step["unrecorded"] == 0 and step["unwaited"] == step["ahead"], f"step {s}: {step}"
        trace = step["trace"]
        for i, (what, group) in enumerate(trace):
            if what == "d2h":  # its gradient is handed out (event waited) before the group steps
                landed = trace.index(("landed", group), i)
                assert ("step", group) not in trace[i:landed], f"step {s}: {group} stepped before its gradient landed"
                assert trace.index(("step", group), landed) > landed


def test_each_unit_steps_before_the_backward_of_the_units_before_it_ends():
    """Backward runs the units in reverse: the last block's optimizer step is taken before the root's
    gradient is even copied to the host, i.e. while backward is still running."""
    r = _book()
    root = next(ids for ids, label in r["units"].items() if label == "<root>")
    for s, step in enumerate(r["steps"]):
        trace = step["trace"]
        d2h = [g for what, g in trace if what == "d2h"]
        assert d2h[-1] == root, f"step {s}: the root's gradient is the last to land: {d2h}"
        assert trace.index(("step", d2h[0])) < trace.index(("d2h", root)), f"step {s}: no step during backward"


def test_each_shard_is_copied_to_the_device_before_its_unshard_and_waited_by_it():
    r = _book()
    issued = set()  # copies issued and not yet waited; those step() issues are waited in the next step
    for s, step in enumerate(r["steps"]):
        for what, group in step["trace"]:
            if what == "h2d":
                issued.add(group)
            elif what == "h2d_wait":
                assert group in issued, f"step {s}: {group} unsharded without a copy issued for it"
                issued.discard(group)
    # From the second step on, step() issues the copies of the first shards the next forward asks for, and
    # each unshard issues the copies of the ones after it: every copy is issued one request ahead or more.
    for s in range(1, len(r["steps"])):
        prev, now = r["steps"][s - 1]["trace"], r["steps"][s]["trace"]
        first = next(g for what, g in now if what == "h2d_wait")
        last_step = max(i for i, (what, _) in enumerate(prev) if what == "step")
        assert ("h2d", first) in prev[last_step:], f"step {s}: the first unshard's copy was not issued in step()"
        # A copy issued only when its unshard asks is traced right before that unshard's wait.
        late = [g for (what, g), nxt in zip(now, now[1:]) if what == "h2d" and nxt == ("h2d_wait", g)]
        assert not late, f"step {s}: {late} copied only when their unshard asked"


def test_nothing_is_left_in_flight_between_steps():
    r = _book()
    for s, step in enumerate(r["steps"]):
        assert step["ahead"] <= r["window"], f"step {s}: {step['ahead']} copies ahead"


def test_misuse_of_the_in_backward_steps_is_refused_by_name():
    r = scenario(_report(2, False), "misuse")
    assert "max_grad_norm" in r["clip"]
    assert "no_sync" in r["second_backward"] and "step_in_backward=False" in r["second_backward"]
    assert "CPUOffload" in r["no_offload"]


def test_a_checkpoint_of_the_offload_optimizer_reloads_and_training_continues_identically():
    r = scenario(_report(2, False), "checkpoint")
    assert r["state"], "optimizer state differs after the reload"
    assert r["params"], "the step after the reload differs from the uninterrupted run"
