"""Helpers shared by the parity tests: data, slicing, the single-process reference loop and error metrics.

The parity recipe (see shared/REFERENCE.md, "Testing distributed code on CPU"): every rank builds the same
model from the same seed, draws the same *global* batches, and trains on its own contiguous slice of each;
the reference trains an unsharded copy on the whole global batch. With a mean-reduced loss and equal slices
the mean of the ranks' gradients is the global-batch gradient, so the two runs agree up to float rounding.

Error metric: ``rel_err(a, b) = ||a - b|| / ||b||`` per tensor (2-norm over all elements, in float64). It is
scale-free, and unlike an element-wise max it is not dominated by entries that are zero in theory.
"""

from __future__ import annotations

import contextlib
import copy
import math
from typing import Callable, Iterable, Optional, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn

from shardwise.engine.surface.pieces import local_of

GLOBAL_BATCH = 12  # divisible by every world size tested: 1, 2, 3, 4
SEQ_LEN = 8

LossFn = Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor]

# SGD with momentum is the sharp test: any mis-scaled or misplaced gradient moves the parameters by a
# visible, non-normalised amount (Adam divides scale errors away).
SGD = dict(lr=0.2, momentum=0.9)
ADAMW = dict(lr=1e-2, weight_decay=0.1)


def make_optimizer(name: str, params: Iterable[torch.Tensor]) -> torch.optim.Optimizer:
    if name == "sgd":
        return torch.optim.SGD(params, **SGD)
    if name == "adamw":
        return torch.optim.AdamW(params, **ADAMW)
    raise ValueError(name)


def make_batches(steps: int, vocab: int, global_batch: int = GLOBAL_BATCH, seq_len: int = SEQ_LEN,
                 seed: int = 1234) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``steps`` global (inputs, targets) batches of token ids, the same on every rank."""
    g = torch.Generator().manual_seed(seed)
    return [
        (torch.randint(0, vocab, (global_batch, seq_len), generator=g),
         torch.randint(0, vocab, (global_batch, seq_len), generator=g))
        for _ in range(steps)
    ]


def local_slice(t: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    """Rank ``rank``'s contiguous share of a global batch (dim 0)."""
    n = t.shape[0] // world_size
    assert n * world_size == t.shape[0], "global batch must divide by the world size"
    return t[rank * n:(rank + 1) * n]


def global_mean(value: torch.Tensor) -> float:
    """Mean over all ranks of a per-rank scalar (the global loss when local batches are equal-sized)."""
    t = value.detach().clone().to(torch.float64)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(t)
        t /= dist.get_world_size()
    return t.item()


def max_over_ranks(x: float) -> float:
    t = torch.tensor([float(x)], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def gather_objects(obj) -> list:
    """Every rank's ``obj``, in rank order, on every rank."""
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def routed_batches(steps: int, vocab: int, world_size: int, seq_len: int = SEQ_LEN,
                   global_batch: int = GLOBAL_BATCH) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Batches for mixture-of-experts routing: rank r's rows draw their tokens from {30r + 2, 30r + 3}, so a
    router sends each rank's tokens to a few experts, different ones on different ranks (a test checks
    that, it does not assume it)."""
    g = torch.Generator().manual_seed(5)
    out = []
    for _ in range(steps):
        rows = [torch.randint(0, 2, (seq_len,), generator=g) + 30 * (i * world_size // global_batch) + 2
                for i in range(global_batch)]
        out.append((torch.stack(rows), torch.randint(0, vocab, (global_batch, seq_len), generator=g)))
    return out


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| in float64; the absolute error when ``b`` is all zeros."""
    a = a.detach().to("cpu", torch.float64).reshape(-1)
    b = b.detach().to("cpu", torch.float64).reshape(-1)
    num, den = (a - b).norm().item(), b.norm().item()
    return num / den if den > 0 else num


def scalar_rel_err(a: float, b: float) -> float:
    return abs(a - b) / abs(b) if b != 0 else abs(a - b)


def state_errors(sd: dict[str, torch.Tensor], ref_sd: dict[str, torch.Tensor]) -> dict[str, float]:
    """Per-key relative error of ``sd`` against ``ref_sd`` (keys must be the same)."""
    assert list(sd) == list(ref_sd), f"keys differ: {sorted(set(sd) ^ set(ref_sd))}"
    return {k: rel_err(sd[k], ref_sd[k]) for k in ref_sd}


def worst(errors: dict[str, float]) -> tuple[str, float]:
    """The key with the largest error and that error (("", 0.0) for an empty dict)."""
    if not errors:
        return "", 0.0
    k = max(errors, key=lambda k: errors[k])
    return k, errors[k]


def sharded_param_errors(model: nn.Module, reference: nn.Module) -> dict[str, float]:
    """Relative error of every parameter of a sharded ``model`` against ``reference``, measured on the shards
    themselves (no gather): each rank compares its local pieces with the same slices of the reference, and
    the squared norms are summed over the world. Checks the shard layout as well as the values."""
    from shardwise.engine.core.runtime import runtime_of

    rt = runtime_of(model)
    names, sq = [], []
    for unit in rt.units:
        for g in unit.flat_groups:
            for spec, p, (lo, hi, _) in zip(g.plan.params, g.shard_params, g.local_slices):
                ref = reference.get_parameter(spec.fqn).detach().reshape(-1)[lo:hi].to(torch.float64)
                mine = local_of(p).detach().to(torch.float64)  # this rank's elements, as they are
                assert mine.numel() == hi - lo, f"{spec.fqn}: shard piece has {mine.numel()} != {hi - lo} elements"
                names.append(spec.fqn)
                sq.append(torch.stack([(mine - ref).pow(2).sum(), ref.pow(2).sum()]))
    if not sq:
        return {}
    sums = torch.stack(sq)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(sums)  # replicas are counted once each: the ratio is a mean over them
    out = {}
    for n, (d, r) in zip(names, sums.tolist()):
        out[n] = math.sqrt(d / r) if r > 0 else math.sqrt(d)
    return out


def train_step(model: nn.Module, opt: torch.optim.Optimizer, loss_fn: LossFn, x: torch.Tensor, y: torch.Tensor,
               clip: Optional[Callable[[], torch.Tensor]] = None) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """One forward/backward/(clip)/step/zero_grad; returns the loss and the clip norm (if clipping)."""
    loss = loss_fn(model, x, y)
    loss.backward()
    norm = clip() if clip is not None else None
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.detach(), norm


def reference_run(model: nn.Module, optimizer: str, loss_fn: LossFn, batches: Sequence, *,
                  max_norm: float | None = None,
                  snapshot_every_step: bool = False) -> dict:
    """Train an unsharded ``model`` (in place) on the whole global batches.

    Returns ``{"losses": [...], "norms": [...], "states": [model copy after each step] (if asked)}``."""
    opt = make_optimizer(optimizer, model.parameters())
    losses, norms, states = [], [], []
    for x, y in batches:
        clip = (lambda: torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)) if max_norm is not None else None
        loss, norm = train_step(model, opt, loss_fn, x, y, clip)
        losses.append(loss.item())
        norms.append(None if norm is None else norm.item())
        if snapshot_every_step:
            states.append(copy.deepcopy(model))
    return {"losses": losses, "norms": norms, "states": states}


def low_precision_copy(model: nn.Module, dtype: torch.dtype) -> nn.Module:
    """A copy of ``model`` whose floating-point *parameters* are in ``dtype`` (what a mixed-precision policy
    gathers and computes with); buffers and integer parameters (4-bit bytes) are left as they are, as the
    engine leaves them."""
    low = copy.deepcopy(model)
    for p in low.parameters():
        if p.is_floating_point():
            p.data = p.data.to(dtype)
    return low


def cast_step(master: nn.Module, x: torch.Tensor, y: torch.Tensor, world_size: int,
              reduce_dtype: Optional[torch.dtype], loss_fn: LossFn, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Set the gradients of ``master``'s trainable parameters as a mixed-precision run computes them from a
    ``dtype`` copy (``low_precision_copy``); return the loss. ``reduce_dtype=None``: the copy runs the whole
    global batch. Otherwise it runs each rank's slice separately, and the slices' gradients are averaged in
    ``reduce_dtype`` exactly as a mixed-precision policy promises (sums in rank order; low-precision sums
    are divided first): the reference then rounds where the sharded run rounds. Frozen parameters get no
    gradient, as in the sharded run."""
    slices = [(x, y)] if reduce_dtype is None else [(local_slice(x, r, world_size), local_slice(y, r, world_size))
                                                      for r in range(world_size)]
    grads, loss = None, 0.0
    for xs, ys in slices:
        low = low_precision_copy(master, dtype)
        part = loss_fn(low, xs, ys)
        part.backward()
        g = [q.grad.to(reduce_dtype or torch.float32) for q in low.parameters() if q.requires_grad]
        if reduce_dtype is not None and reduce_dtype.itemsize < 4:
            g = [t / world_size for t in g]
        grads = g if grads is None else [a + b for a, b in zip(grads, g)]
        loss = loss + part.detach() / len(slices)
    if reduce_dtype is not None and reduce_dtype.itemsize >= 4:
        grads = [t / world_size for t in grads]
    for p, g in zip([p for p in master.parameters() if p.requires_grad], grads):
        p.grad = g.float()
    return loss


def cast_reference(initial: nn.Module, batches: Sequence, world_size: int, reduce_dtype: Optional[torch.dtype],
                   loss_fn: LossFn, *, optimizer: str = "sgd", dtype: torch.dtype = torch.bfloat16) -> tuple:
    """Train an fp32 master on ``cast_step``'s gradients; returns (losses, master after each step)."""
    master = copy.deepcopy(initial)
    opt = make_optimizer(optimizer, [p for p in master.parameters() if p.requires_grad])
    losses, states = [], []
    for x, y in batches:
        loss = cast_step(master, x, y, world_size, reduce_dtype, loss_fn, dtype)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss))
        states.append(copy.deepcopy(master))
    return losses, states


def sharded_run(model: nn.Module, optimizer: str, loss_fn: LossFn, batches: Sequence, rank: int, world_size: int,
                *, reference_states: Sequence[nn.Module] = (), max_norm: float | None = None) -> dict:
    """Train a sharded ``model`` on this rank's slice of each global batch.

    Returns global mean losses per step, the clip norms (if clipping), and, when ``reference_states`` (the
    reference after each step) are given, the worst per-parameter shard error after each step."""
    import shardwise

    opt = make_optimizer(optimizer, model.parameters())
    losses, norms, param_errs = [], [], []
    for step, (x, y) in enumerate(batches):
        clip = (lambda: shardwise.clip_grad_norm_(model, max_norm)) if max_norm is not None else None
        x, y = local_slice(x, rank, world_size), local_slice(y, rank, world_size)
        loss, norm = train_step(model, opt, loss_fn, x, y, clip)
        losses.append(global_mean(loss))
        norms.append(None if norm is None else norm.item())
        if step < len(reference_states):
            param_errs.append(worst(sharded_param_errors(model, reference_states[step])))
    return {"losses": losses, "norms": norms, "param_errs": param_errs}


def loss_errors(losses: Sequence[float], ref_losses: Sequence[float]) -> float:
    assert len(losses) == len(ref_losses)
    return max(scalar_rel_err(a, b) for a, b in zip(losses, ref_losses))


def format_worst(label: str, errs: dict[str, float]) -> str:
    k, v = worst(errs)
    return f"{label}: worst {v:.2e} at {k!r}"


def parity_check(initial: nn.Module, loss_step: Callable, batches: Sequence, rank: int, world_size: int, *,
                 optimizer: str = "sgd", shard_kwargs: dict, unsettled_steps: Sequence[int] = ()) -> dict:
    """Train a sharded copy and an unsharded reference copy of ``initial`` side by side and measure them.

    ``loss_step(model, batch, step, take)`` runs forward *and* backward for one step and returns the loss;
    ``take(t)`` is the identity for the reference and the rank's slice for the sharded model, so one
    function describes both runs (several forwards, no_sync, skipped units...). Returns ``(metrics, model,
    reference)``: metrics are the worst loss error, the worst per-parameter shard error over all steps, and
    the worst ``full_state_dict`` error at the end (rank 0; see ``assert_parity``)."""
    import shardwise

    ref = copy.deepcopy(initial)
    model = shardwise.shard(copy.deepcopy(initial), **shard_kwargs)
    assert_engine_clean(model, "right after shard()")  # nothing gathered before the first forward
    return train_pair(model, ref, loss_step, batches, rank, world_size, optimizer=optimizer,
                      unsettled_steps=unsettled_steps), model, ref


def train_pair(model: nn.Module, ref: nn.Module, loss_step: Callable, batches: Sequence, rank: int,
               world_size: int, *, optimizer: str = "sgd", unsettled_steps: Sequence[int] = ()) -> dict:
    """``parity_check``'s loop for a sharded ``model`` and its unsharded reference ``ref`` built by the
    caller (a meta-built model, one used before training). Returns the metrics ``assert_parity`` reads."""
    import shardwise

    ref_opt, opt = make_optimizer(optimizer, ref.parameters()), make_optimizer(optimizer, model.parameters())
    loss_err, param_err = 0.0, ("", 0.0)
    for step, batch in enumerate(batches):
        ref_loss = loss_step(ref, batch, step, lambda t: t)
        loss = loss_step(model, batch, step, lambda t: local_slice(t, rank, world_size))
        if step not in unsettled_steps:  # a step whose backward raised settles at the next forward
            assert_engine_clean(model, f"after step {step}'s backward")
        ref_opt.step()
        opt.step()
        ref_opt.zero_grad(set_to_none=True)
        opt.zero_grad(set_to_none=True)
        loss_err = max(loss_err, scalar_rel_err(global_mean(loss), ref_loss.item()))
        name, err = worst(sharded_param_errors(model, ref))
        if err >= param_err[1]:
            param_err = (f"step {step}: {name}", err)
    sd = shardwise.full_state_dict(model)
    final = worst(state_errors(sd, ref.state_dict())) if rank == 0 else None
    return {"loss": loss_err, "param": param_err, "final": final}


def assert_engine_clean(model: nn.Module, when: str = "after backward") -> None:
    """The engine's state between steps: runtime idle, nothing in flight, every module parameter its 1-D
    shard ``nn.Parameter`` (still a view of the flat shard), nothing left gathered, no entry still open, no
    unreduced gradient outside ``no_sync``. Every parity run asserts it after every backward."""
    from shardwise.engine.core.runtime import runtime_of

    problems = runtime_of(model).invariant_violations()
    assert not problems, f"engine not clean {when}: " + "; ".join(problems)


def assert_parity(metrics: dict, rtol: float = 1e-6, label: str = "", param_rtol: float | None = None) -> None:
    """Fail unless the loss errors in ``parity_check``'s metrics are at most ``rtol`` and the parameter
    errors at most ``param_rtol`` (default: ``rtol``)."""
    param_rtol = rtol if param_rtol is None else param_rtol
    assert metrics["loss"] <= rtol, f"{label} loss off by {metrics['loss']:.2e}"
    where, err = metrics["param"]
    assert err <= param_rtol, f"{label} shard of {where} off by {err:.2e}"
    if metrics["final"] is not None:
        name, err = metrics["final"]
        assert err <= param_rtol, f"{label} full_state_dict[{name!r}] off by {err:.2e}"


def is_sharded(model: nn.Module) -> bool:
    from shardwise.engine.core.runtime import STATE_ATTR as _STATE_ATTR

    return getattr(model, _STATE_ATTR, None) is not None


def simple_step(loss_fn: LossFn) -> Callable:
    """The ``loss_step`` for plain training: one forward on the (sliced) batch, one backward."""

    def step(model, batch, _step, take):
        x, y = batch
        loss = loss_fn(model, take(x), take(y))
        loss.backward()
        return loss.detach()

    return step


def run_scenarios(scenarios: dict[str, Callable[[int, int], dict]], rank: int, world_size: int) -> dict:
    """Run several checks in one spawn (each spawn costs seconds). Every rank runs every scenario in the same
    order; an exception becomes that scenario's result (``{"error": text}``) so one broken behaviour fails
    one test, not all of them."""
    import traceback

    out = {}
    for name, fn in scenarios.items():
        try:
            out[name] = fn(rank, world_size)
        except Exception as e:  # noqa: BLE001 - reported to the test that reads this scenario
            out[name] = {"error": f"rank {rank}: {type(e).__name__}: {e}\n{traceback.format_exc()}"}
    return out


def scenario(report: dict, name: str) -> dict:
    """The result of one scenario from ``run_scenarios``, failing the calling test if it raised."""
    r = report[name]
    if isinstance(r, dict) and "error" in r:
        raise AssertionError(f"scenario {name!r} raised:\n{r['error']}")
    return r


class CollectiveCounter:
    """Counts the elements shardwise sends through each collective while active (patches ``shardwise.engine.base.collectives``,
    which every other module calls through)."""

    NAMES = ("all_gather_into", "reduce_scatter_into", "all_reduce_sum")

    def __init__(self):
        self.numel = {n: 0 for n in self.NAMES}
        self.calls = {n: 0 for n in self.NAMES}
        self._saved = {}

    def __enter__(self) -> "CollectiveCounter":
        from shardwise.engine.base import collectives
        from shardwise.engine.base.device import control_group
        for name in self.NAMES:
            original = getattr(collectives, name)
            self._saved[name] = original

            def counted(*args, _name=name, _orig=original, **kwargs):
                # all_gather/reduce_scatter: (output, input, group, ...); all_reduce: (tensor, group, ...); the
                # group may come by keyword (collectives.run_agreed), so the arguments are passed on as they came
                group = kwargs["group"] if "group" in kwargs else args[2 if _name != "all_reduce_sum" else 1]
                if group is None or group is not control_group():  # the ranks' agreements are not data
                    sent = args[1] if _name == "reduce_scatter_into" else args[0]
                    self.calls[_name] += 1
                    self.numel[_name] += sent.numel()
                return _orig(*args, **kwargs)

            setattr(collectives, name, counted)
        return self

    def __exit__(self, *exc) -> None:
        from shardwise.engine.base import collectives
        for name, original in self._saved.items():
            setattr(collectives, name, original)


def whole_model_rel_err(model: nn.Module, reference: nn.Module) -> float:
    """``||theta - theta_ref|| / ||theta_ref||`` over all parameters together, from the shards (see
    ``sharded_param_errors``): the metric for runs whose per-tensor errors are legitimately large on small
    tensors (bf16 rounding of near-cancelling sums)."""
    from shardwise.engine.core.runtime import runtime_of

    diff = torch.zeros(2, dtype=torch.float64)
    for unit in runtime_of(model).units:
        for g in unit.flat_groups:
            for spec, p, (lo, hi, _) in zip(g.plan.params, g.shard_params, g.local_slices):
                ref = reference.get_parameter(spec.fqn).detach().reshape(-1)[lo:hi].to(torch.float64)
                mine = local_of(p).detach().to(torch.float64)  # (see sharded_param_errors)
                diff += torch.stack([(mine - ref).pow(2).sum(), ref.pow(2).sum()])
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(diff)
    return math.sqrt(diff[0].item() / diff[1].item())


def spawn_once(fn: Callable) -> Callable:
    """Cache a report-producing spawn per argument tuple, *including its failure*: when the core is broken, every
    test reading the report fails at once with the same error instead of re-spawning (and maybe timing out)
    once per test."""
    import functools

    results: dict = {}

    @functools.wraps(fn)
    def wrapper(*args):
        if args not in results:
            try:
                results[args] = (True, fn(*args))
            except Exception as e:  # noqa: BLE001 - re-raised below for every reader
                results[args] = (False, e)
        ok, value = results[args]
        if not ok:
            raise AssertionError(f"{fn.__name__}{args} failed:\n{value}") from value
        return value

    return wrapper


def assembled_checkpoint(ckpt) -> dict:
    """Every parameter and optimizer-state tensor a shardwise checkpoint directory stores, whole (its
    pieces concatenated in order), keyed ``"param:NAME"`` / ``"STATE:NAME"``: what a reshard must keep."""
    import json
    import pathlib

    from safetensors import safe_open

    ckpt = pathlib.Path(ckpt)
    manifest = json.loads((ckpt / "manifest.json").read_text())
    out = {}
    for name, p in manifest["params"].items():
        for label, key_of in [("param", lambda piece: piece["key"])] + [
                (s, lambda piece, s=s: piece["optim"][s]) for s in manifest["optimizer"]["state"][name]["tensors"]]:
            parts = []
            for piece in p["pieces"]:
                with safe_open(str(ckpt / piece["file"]), "pt") as f:
                    parts.append(f.get_tensor(key_of(piece)))
            out[f"{label}:{name}"] = torch.cat(parts)
    return out


@contextlib.contextmanager
def gradient_sync_off(model):
    """FSDP2's own accumulation switch, ``model.set_requires_gradient_sync``, off for the block and on after it
    (shardwise's sharded root answers it as FSDP2's ``FSDPModule`` does)."""
    model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)
