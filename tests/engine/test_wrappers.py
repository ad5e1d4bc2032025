"""What users put around a sharded model, written as they write it: each row gives the single-process
result or raises ``ShardwiseError`` on every rank.

A row's ``run(rank, ws)`` shards the tiny GPT, does what a user would (wrap it, save and load its state
dict, re-parametrize it, ...) and returns ``(sharded_model, reference_model)``: the unsharded model that
one process doing the same on the whole batch ends with; the test compares every parameter. A row whose
``expect`` is text must raise ``ShardwiseError`` containing it on every rank instead. The next wrapper is
one more row.

All rows run in one spawn at world size 2 (default) and 3 (uneven pieces, ``-m slow``).
"""

from __future__ import annotations

import copy
import io
from dataclasses import dataclass
from typing import Callable, Optional, Union

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint
import torch.nn as nn
import torch.nn.utils.parametrize

import shardwise
from harness import run_distributed
from models import GPT, Block, gpt_loss, tiny_gpt_config
from parity_utils import local_slice, make_batches, sharded_param_errors, spawn_once, worst
from shardwise import ShardwiseError

STEPS = 2
VOCAB = tiny_gpt_config().vocab_size
RTOL = 2e-6


def _gpt() -> GPT:
    torch.manual_seed(0)
    return GPT(tiny_gpt_config())


def _sharded(strategy: str = "full_shard") -> GPT:
    return shardwise.shard(_gpt(), units={Block}, strategy=strategy)


def _sgd(params):
    return torch.optim.SGD(params, lr=0.2, momentum=0.9)


def _train(model, rank, ws, opt=None, steps=STEPS, backward=None):
    """``steps`` SGD steps on this rank's slice of each global batch (ws=1: the whole batch)."""
    opt = opt or _sgd(model.parameters())
    for x, y in make_batches(steps, VOCAB):
        loss = model(local_slice(x, rank, ws), local_slice(y, rank, ws)).loss
        (backward or torch.Tensor.backward)(loss)
        opt.step()
        opt.zero_grad()
    return model


def _reference(prepare: Optional[Callable[[nn.Module], None]] = None) -> GPT:
    """One process, the whole batch: what every row must end with (the same prepare, the same steps)."""
    model = _gpt()
    if prepare is not None:
        prepare(model)
    return _train(model, 0, 1)


def _broadcast_bytes(obj) -> io.BytesIO:
    """What rank 0 wrote with ``torch.save``, as every rank reads it back."""
    buf = io.BytesIO()
    if dist.get_rank() == 0:
        torch.save(obj, buf)
    box = [buf.getvalue()]
    dist.broadcast_object_list(box, src=0)
    return io.BytesIO(box[0])


# ---- the user code of the rows ----------------------------------------------------------------------------
def ddp(rank, ws):
    model = _sharded()
    _train(torch.nn.parallel.DistributedDataParallel(model), rank, ws, opt=_sgd(model.parameters()))
    return model, _reference()


class EqualPieces(nn.Module):
    """Two 8x8 linears: at world size 2 every rank's pieces have the same sizes, so DDP's broadcast of rank
    0's pieces would succeed silently."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 8, bias=False), nn.Linear(8, 8, bias=False)


def ddp_equal_pieces(rank, ws):
    torch.manual_seed(0)
    model = shardwise.shard(EqualPieces(), units={nn.Linear})
    before = [p.detach().clone() for p in model.parameters()]
    try:
        torch.nn.parallel.DistributedDataParallel(model)
    finally:
        assert all(torch.equal(a, p) for a, p in zip(before, model.parameters())), "DDP wrote the pieces"


def fully_shard(rank, ws):
    from torch.distributed.fsdp import fully_shard as fsdp2
    _train(fsdp2(_sharded()), rank, ws)


def dcp_get_model_state_dict(rank, ws):
    """torch.distributed.checkpoint's state-dict helper would hand DCP the pieces as if whole."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict
    get_model_state_dict(_sharded())


def _stepped() -> tuple:
    """A sharded model and its AdamW after one step (its state exists), as checkpoint helpers meet them."""
    model = _sharded()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x = torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(0))
    gpt_loss(model, x, x).backward()
    opt.step()
    return model, opt


# torchtitan's and torchtune's checkpointers, and FSDP1 scripts, call these on the model they trained.
def dcp_get_state_dict(rank, ws):
    from torch.distributed.checkpoint.state_dict import get_state_dict
    get_state_dict(*_stepped())


def dcp_get_optimizer_state_dict(rank, ws):
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict
    get_optimizer_state_dict(*_stepped(), options=StateDictOptions(flatten_optimizer_state_dict=True))


def dcp_set_model_state_dict(rank, ws):
    from torch.distributed.checkpoint.state_dict import set_model_state_dict
    set_model_state_dict(_sharded(), _reference().state_dict())


def fsdp1_summon_full_params(rank, ws):
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    model = _sharded()
    with FSDP.summon_full_params(model, writeback=True):
        model.lm_head.weight.data.mul_(2.0)


def fsdp1_full_state_dict_type(rank, ws):
    from torch.distributed.fsdp import FullStateDictConfig, StateDictType
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    model = _sharded()
    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, FullStateDictConfig(rank0_only=True)):
        model.state_dict()


def fsdp1_optim_state_dict(rank, ws):
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    FSDP.optim_state_dict(*_stepped())


def fsdp1_wrapper(rank, ws):
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    FSDP(_sharded(), use_orig_params=True)


def dcp_round_trip(strategy: str):
    """torch.distributed.checkpoint's save and load of ``model.state_dict()``, then training on."""
    def run(rank, ws):
        import tempfile
        import torch.distributed.checkpoint as dcp
        model = _train(_sharded(strategy), rank, ws)
        where = tempfile.mkdtemp() if rank == 0 else None
        box = [where]
        dist.broadcast_object_list(box, src=0)
        dcp.save({"model": model.state_dict()}, checkpoint_id=box[0])
        fresh = _sharded(strategy)
        state = {"model": fresh.state_dict()}
        dcp.load(state, checkpoint_id=box[0])
        fresh.load_state_dict(state["model"])
        return _train(fresh, rank, ws), _train(_reference(), 0, 1)
    return run


def dcp_load_whole_checkpoint(rank, ws):
    """torch.distributed.checkpoint's load of a checkpoint of whole tensors (one process wrote it; torchtitan's
    FSDP2 model state reads the same) into ``model.state_dict()`` and ``optimizer.state_dict()``: each rank
    takes its elements, and training goes on as the writer's would."""
    import tempfile
    import torch.distributed.checkpoint as dcp
    ref = _gpt()
    ref_opt = _sgd(ref.parameters())  # (its momentum is the state; AdamW's first steps amplify rounding)
    _train(ref, 0, 1, opt=ref_opt)
    box = [tempfile.mkdtemp() if rank == 0 else None]
    dist.broadcast_object_list(box, src=0)
    if rank == 0:
        dcp.save({"model": ref.state_dict(), "optim": ref_opt.state_dict()}, checkpoint_id=box[0], no_dist=True)
    dist.barrier()
    model = _sharded()
    opt = _sgd(model.parameters())
    _train(model, rank, ws, opt=opt, steps=1)  # a state of its own, which the load must replace
    state = {"model": model.state_dict(), "optim": opt.state_dict()}
    dcp.load(state, checkpoint_id=box[0])
    model.load_state_dict(state["model"])
    opt.load_state_dict(state["optim"])
    return _train(model, rank, ws, opt=opt), _train(ref, 0, 1, opt=ref_opt)


def accelerate_prepare_model(rank, ws):
    from accelerate import Accelerator
    accelerator = Accelerator(cpu=True)
    model = _sharded()
    model, opt = accelerator.prepare(model, _sgd(model.parameters()))
    _train(model, rank, ws, opt=opt, backward=accelerator.backward)


def accelerate_prepare_optimizer(rank, ws):
    """The recipe the refusal gives: Accelerate prepares the optimizer (and loaders), not the model."""
    from accelerate import Accelerator
    accelerator = Accelerator(cpu=True)
    model = _sharded()
    opt = accelerator.prepare(_sgd(model.parameters()))

    def backward(loss):
        accelerator.backward(loss)
        accelerator.clip_grad_norm_(model.parameters(), 0.05)

    def clipped(loss):
        loss.backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05)

    ref = _gpt()
    _train(ref, 0, 1, backward=clipped)
    return _train(model, rank, ws, opt=opt, backward=backward), ref


def state_dict_per_rank(rank, ws):
    """Every rank saves ``model.state_dict()`` (whole tensors) and loads it into a fresh sharded model."""
    model = _train(_sharded(), rank, ws)
    buf = io.BytesIO()
    torch.save(model.state_dict(), buf)
    fresh = _sharded()
    fresh.load_state_dict(torch.load(io.BytesIO(buf.getvalue()), weights_only=True))
    return _train(fresh, rank, ws, steps=1), _train(_reference(), 0, 1, steps=1)


def state_dict_saved_by_rank0(rank, ws):
    """The DDP habit: rank 0 alone saves ``model.state_dict()``, every rank trains on. Pickling a piece
    gathers the whole tensor, a collective on one rank: every rank raises naming it at the next compare."""
    model = _train(_sharded(), rank, ws)
    if rank == 0:
        torch.save(model.state_dict(), io.BytesIO())
    _train(model, rank, ws, steps=1)


def state_dict_copied(rank, ws):
    """``model.state_dict()`` copied into a plain dict (clones: pieces of the same layout), loaded back."""
    model = _train(_sharded(), rank, ws)
    model.load_state_dict({k: v.clone() for k, v in model.state_dict().items()})
    return _train(model, rank, ws, steps=1), _train(_reference(), 0, 1, steps=1)


def state_dict_other_world(rank, ws):
    """The state dict of the same model sharded otherwise (hybrid_shard over groups of one rank: whole
    tensors), loaded into a full_shard model."""
    from torch.distributed.device_mesh import init_device_mesh
    other = shardwise.shard(_gpt(), units={Block}, strategy="hybrid_shard",
                            mesh=init_device_mesh("cpu", (ws, 1), mesh_dim_names=("replicate", "shard")))
    model = _sharded()
    model.load_state_dict(_train(other, rank, ws).state_dict())
    return _train(model, rank, ws, steps=1), _train(_reference(), 0, 1, steps=1)


def single_process_checkpoint(rank, ws):
    """A checkpoint of the unsharded model (``torch.save(model.state_dict())`` in one process), loaded on
    every rank with ``load_state_dict``: each rank takes its piece."""
    trained = _reference()
    model = _sharded()
    model.load_state_dict(torch.load(_broadcast_bytes(trained.state_dict()), weights_only=True))
    return _train(model, rank, ws), _train(trained, 0, 1)


def full_state_dict_round_trip(rank, ws):
    """``shardwise.full_state_dict`` on rank 0, saved, loaded on every rank with ``load_state_dict``."""
    model = _train(_sharded(), rank, ws)
    fresh = _sharded("shard_optim")
    fresh.load_state_dict(torch.load(_broadcast_bytes(shardwise.full_state_dict(model)), weights_only=True))
    return _train(fresh, rank, ws), _train(_reference(), 0, 1)


def after_shard(fn):
    """``fn(model)`` applied to the sharded model before training (a re-parametrization, ...)."""
    def run(rank, ws):
        model = _sharded()
        fn(model)
        return _train(model, rank, ws), _reference(fn)
    return run


def composable_checkpoint(model):  # torch.distributed._composable.checkpoint composes (not a sharding API)
    from torch.distributed._composable import checkpoint
    for block in model.blocks:
        checkpoint(block)


class Doubled(nn.Module):
    """A parametrization without right_inverse: registering it computes nothing on the piece."""

    def forward(self, w):
        return 2 * w


def parametrize_head(model):
    torch.nn.utils.parametrize.register_parametrization(model.lm_head, "weight", Doubled())


def prune_head(model):
    import torch.nn.utils.prune as prune
    prune.l1_unstructured(model.lm_head, "weight", amount=0.3)


def deterministic_init(model):  # model.apply(init) with inits that do not draw random numbers
    def init(m):
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)
        if isinstance(m, nn.LayerNorm):
            nn.init.ones_(m.weight)
            nn.init.constant_(m.bias, 0.1)
    model.apply(init)


def random_init(model):  # model.apply(init) drawing random numbers: the HF _init_weights habit
    def init(m):
        if isinstance(m, nn.Linear):
            nn.init.trunc_normal_(m.weight, std=0.02)
    model.apply(init)


def eval_then_train(model):
    model.eval()
    with torch.no_grad():
        x, _ = make_batches(1, VOCAB)[0]
        model(x[:2])
    model.train()


def ema_by_deepcopy(rank, ws):
    copy.deepcopy(_sharded())


def pickle_whole_model(rank, ws):
    torch.save(_sharded(), io.BytesIO())


def averaged_model(rank, ws):
    torch.optim.swa_utils.AveragedModel(_sharded())


def hf_trainer(rank, ws):
    """Hugging Face Trainer given a sharded model: it prepares the model with Accelerate, i.e. DDP."""
    from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=2)
    model = shardwise.shard(LlamaForCausalLM(config))
    data = [{"input_ids": torch.randint(0, 64, (8,)), "labels": torch.randint(0, 64, (8,))} for _ in range(4)]
    import tempfile
    with tempfile.TemporaryDirectory() as out:
        args = TrainingArguments(output_dir=out, per_device_train_batch_size=2, max_steps=1, report_to=[],
                                 use_cpu=True, save_strategy="no")
        Trainer(model=model, args=args, train_dataset=data).train()


def compiled(rank, ws):
    model = _sharded()
    _train(torch.compile(model), rank, ws, opt=_sgd(model.parameters()))
    return model, _reference()


@dataclass
class Row:
    name: str
    run: Callable
    expect: Union[str, tuple, None] = None  # None: exact; text (or one of several): the ShardwiseError on every rank
    wrapped_by: Optional[str] = None  # the exception type a library raises with our error's text inside


DDP = "DistributedDataParallel around this"
ONE_RANK_GATHER = "ranks [0] are at torch.save of a sharded model's state_dict() pieces"
DEEPCOPY = "copy.deepcopy() of a sharded model"
COMPOSABLE = "which shardwise.shard() already shards: they would shard its parameters again"

ROWS = [
    Row("DistributedDataParallel(model)", ddp, DDP),
    Row("DistributedDataParallel, pieces of equal sizes", ddp_equal_pieces, DDP),
    Row("fully_shard(model)", fully_shard, COMPOSABLE),
    Row("DCP get_model_state_dict(model)", dcp_get_model_state_dict, COMPOSABLE),
    # (each refusal names shardwise's counterpart of the helper called)
    Row("DCP get_state_dict(model, optimizer)", dcp_get_state_dict,
        "get_optimizer_state_dict -> optimizer.state_dict()"),
    Row("DCP get_optimizer_state_dict, flattened", dcp_get_optimizer_state_dict,
        "get_optimizer_state_dict -> optimizer.state_dict()"),
    Row("DCP set_model_state_dict", dcp_set_model_state_dict,
        "set_model_state_dict -> model.state_dict() and model.load_state_dict()"),
    Row("FSDP.summon_full_params(model)", fsdp1_summon_full_params,
        "FSDP.summon_full_params -> shardwise.summon_full_params(model)"),
    Row("FSDP.state_dict_type(model, FULL_STATE_DICT)", fsdp1_full_state_dict_type, "shardwise.full_state_dict(model)"),
    Row("FSDP.optim_state_dict(model, optimizer)", fsdp1_optim_state_dict,
        "FSDP.optim_state_dict / get_optimizer_state_dict ->"),
    Row("FullyShardedDataParallel(model)", fsdp1_wrapper, COMPOSABLE),
    # DCP gathers every rank's planning error into its own CheckpointException, raised on every rank.
    Row("DCP save of model.state_dict()", dcp_round_trip("full_shard"), "torch.distributed.checkpoint of",
        wrapped_by="CheckpointException"),
    Row("DCP save and load of model.state_dict(), no_shard", dcp_round_trip("no_shard")),
    Row("DCP load of a whole checkpoint into model and optimizer state_dict()", dcp_load_whole_checkpoint),
    Row("accelerate prepare(model, optimizer)", accelerate_prepare_model, DDP),
    Row("accelerate prepare(optimizer) + clip_grad_norm_", accelerate_prepare_optimizer),
    Row("state_dict per rank, load_state_dict", state_dict_per_rank),
    Row("state_dict pieces in a plain dict", state_dict_copied),
    Row("state_dict from another shard size", state_dict_other_world),
    Row("load_state_dict of a single-process checkpoint", single_process_checkpoint),
    Row("load_state_dict of full_state_dict, another strategy", full_state_dict_round_trip),
    Row("spectral_norm after shard", after_shard(lambda m: torch.nn.utils.parametrizations.spectral_norm(m.lm_head)),
        "reorders or selects positions"),  # (its power iteration transposes the weight)
    # L1 pruning ranks the parameter's elements: its topk of a piece is refused at the call.
    Row("prune after shard", after_shard(prune_head), "depends on positions in the whole tensor"),
    Row("register_parametrization after shard", after_shard(parametrize_head), "changes the tensor's storage"),
    Row("composable checkpoint(block) after shard", after_shard(composable_checkpoint)),
    Row("model.apply(zeros_/ones_/constant_ init) after shard", after_shard(deterministic_init)),
    Row("model.apply(trunc_normal_ init) after shard", after_shard(random_init), "a random fill draws this rank's"),
    Row("eval() forward, then train()", after_shard(eval_then_train)),
    Row("copy.deepcopy (EMA)", ema_by_deepcopy, DEEPCOPY),
    Row("swa_utils.AveragedModel", averaged_model, DEEPCOPY),
    Row("torch.save(model) (the whole module)", pickle_whole_model, "torch.save(model) / pickle of a sharded model"),
    # Last: the disagreement leaves the other rank in an in-band collective (gloo's default), found by the
    # stall watchdog; the process group is unusable after it.
    Row("torch.save(model.state_dict()) on rank 0 alone", state_dict_saved_by_rank0, ONE_RANK_GATHER),
]
# Compiling costs ~20 s of CPU per rank, importing Trainer a few seconds.
def sharded_after_compile(rank, ws):
    """nanoGPT's order: torch.compile(model), then the wrapper around the compiled module."""
    compiled_model = torch.compile(_gpt())
    shardwise.shard(compiled_model, units={Block})
    _train(compiled_model, rank, ws)
    return compiled_model, torch.compile(_reference())  # (the same "_orig_mod." names; never called)


def _compile_blocks(model: GPT, fullgraph: bool = False) -> GPT:
    """torchtitan's apply_compile: each block compiled on its own and registered in its place."""
    for i, block in enumerate(model.blocks):
        model.blocks[i] = torch.compile(block, fullgraph=fullgraph)
    return model


def blocks_compiled_then_sharded(rank, ws):
    """torchtitan's order: compile each block, then shard (fully_shard there)."""
    model = shardwise.shard(_compile_blocks(_gpt()), units={Block})
    _train(model, rank, ws)
    return model, _compile_blocks(_reference())


def blocks_compiled_fullgraph(rank, ws):
    """torchtitan compiles blocks with fullgraph=True: the unit entries cannot be traced, and the error says
    so (dynamo's own error, with our reason; it named FSDP's use_orig_params before)."""
    torch._dynamo.reset()  # the rows before compiled Block.forward without fullgraph: dynamo would reuse it
    model = shardwise.shard(_compile_blocks(_gpt(), fullgraph=True), units={Block})
    try:
        _train(model, rank, ws, steps=1)
    except Exception as e:  # noqa: BLE001 - dynamo's Unsupported, re-raised as the error the table reads
        if "fullgraph=False" in str(e) and "shardwise.shard()" in str(e):
            raise ShardwiseError(f"compiled with fullgraph=True: {type(e).__name__}") from e
        raise


SLOW_ROWS = [Row("torch.compile(model)", compiled), Row("shard(torch.compile(model))", sharded_after_compile),
             Row("torch.compile(block) per block, then shard", blocks_compiled_then_sharded),
             Row("torch.compile(block, fullgraph=True) per block", blocks_compiled_fullgraph,
                 "compiled with fullgraph=True: Unsupported"),
             Row("Hugging Face Trainer(model)", hf_trainer, DDP)]


# ---- running the table ------------------------------------------------------------------------------------
def _attempt(row: Row, rank: int, ws: int) -> dict:
    try:
        out = row.run(rank, ws)
    except ShardwiseError as e:
        return {"shardwise_error": str(e)}
    except (Exception, torch.distributed.checkpoint.api.CheckpointException) as e:  # noqa: BLE001 - compared
        # by the test (DCP's CheckpointException is a BaseException)
        return {"other_error": f"{type(e).__name__}: {e}"}
    if out is None:
        return {}
    model, ref = out
    return {"param_err": worst(sharded_param_errors(model, ref))}


def _table(rank: int, ws: int, slow: bool) -> dict:
    return {row.name: _attempt(row, rank, ws) for row in (SLOW_ROWS if slow else ROWS)}


@spawn_once
def _report(ws: int, slow: bool = False) -> list:
    return run_distributed(_table, ws, slow, timeout_s=30)


def _check(results: list, row: Row) -> None:
    for rank, out in enumerate(r[row.name] for r in results):
        if row.wrapped_by is not None:
            text = out.get("other_error", "")
            assert text.startswith(row.wrapped_by) and f"ShardwiseError: {row.expect}" in text, (
                f"rank {rank}: expected {row.wrapped_by} around ShardwiseError {row.expect!r}, got {out}")
            continue
        if row.expect is not None:
            text = out.get("shardwise_error")
            alternatives = row.expect if isinstance(row.expect, tuple) else (row.expect,)
            assert text is not None and any(e in text for e in alternatives), (
                f"rank {rank}: expected ShardwiseError containing {row.expect!r}, got {out}")
            continue
        assert "shardwise_error" not in out and "other_error" not in out, f"rank {rank}: {out}"
        if "param_err" in out:
            name, err = out["param_err"]
            assert err <= RTOL, f"rank {rank}: parameter {name!r} off by {err:.2e}"


@pytest.mark.parametrize("row", ROWS, ids=lambda r: r.name)
def test_ws2(row):
    _check(_report(2), row)


@pytest.mark.slow
@pytest.mark.parametrize("row", ROWS, ids=lambda r: r.name)
def test_ws3(row):
    _check(_report(3), row)


@pytest.mark.slow
@pytest.mark.parametrize("row", SLOW_ROWS, ids=lambda r: r.name)
def test_compile_ws2(row):
    _check(_report(2, True), row)
