"""The public entry points: ``shard`` and ``no_sync`` (ddp_idioms.py, with DDP's other idioms; ``clip_grad_norm_``
is in grad_norm.py)."""

from __future__ import annotations

import dataclasses
import inspect
import warnings
import weakref
from typing import Callable, Optional, Union

import torch
import torch.distributed as dist
import torch.nn as nn

from shardwise.engine.base import device as devices
from shardwise.engine import ddp_idioms, initial_weights, registration_guard
from shardwise.engine.ddp_idioms import no_sync  # noqa: F401 (public: shardwise.no_sync)
from shardwise.engine.surface import optimizer_guard, optimizer_swap, state_dict_pieces, whole_model_saves
from shardwise.engine.surface.grad_sink import PieceGradSink
from shardwise.engine.surface.wrapper_refusal import refuse_wrappers
from shardwise.engine.rewrite_refusal import refuse_rebuilding_methods, refuse_rewriting_modules
from shardwise.engine.buffer_broadcast import BufferBroadcast
from shardwise.engine.activation_checkpoint import checkpoint_unit
from shardwise.engine.checks.fingerprint import check_same_plan, checks_enabled
from shardwise.errors import ShardwiseError
from shardwise.engine.core.flat_group import FlatGroup
from shardwise.engine.base.mixed_precision import MixedPrecision
from shardwise.engine.base.cpu_offload import CPUOffload
from shardwise.engine.offload_transfers import OffloadTransfers
from shardwise.engine.surface.param_hooks import adopt_tensor_hooks
from shardwise.engine.base.plan import AUTO, AUTO_WITH_HEAD, UnitsSpec, build_plan, entry_modules
from shardwise.engine.core.runtime import STATE_ATTR, ModelRuntime, Unit
from shardwise.engine.surface.shard_param import ShardParamFactory, warn_if_backward_inputs_unseen
from shardwise.engine.base.strategy import Strategy, resolve_groups

def shard(
    model: nn.Module,
    units: Optional[UnitsSpec] = "auto",
    strategy: Union[str, Strategy] = "full_shard",
    mesh=None,
    mixed_precision: Optional[MixedPrecision] = None,
    offload: Optional[CPUOffload] = None,
    *,
    sync_module_states: Optional[bool] = None,
    param_init_fn: Optional[Callable[[nn.Module], None]] = None,
    device: Optional[Union[str, torch.device]] = None,
    prefetch: bool = True,
    activation_checkpointing: bool = False,
    broadcast_buffers: bool = True,
) -> nn.Module:
    """Shard ``model`` in place across the ranks of ``mesh`` (default: the whole world) and return it.

    Args:
        units: what becomes a unit (one all-gather / reduce-scatter each): a set of module classes, the
            modules themselves (``list(model.layers)``, as FSDP2 users call ``fully_shard`` on each layer; a
            module or classes and modules mixed), a callable ``(module) -> bool``, ``"auto"`` (Hugging Face
            ``_no_split_modules``, else the children of the largest ``nn.ModuleList``; a model with neither, a
            CNN or an MLP, becomes one unit, with a warning; and a Hugging Face model's input embedding, a unit
            of its own unless it is tied to the head), ``"auto+head"`` (the same, and the untied output head a unit too: for code whose loss calls
            the head, not a fused loss reading its weight; ``plan.edge_unit_modules``), or ``None`` (one unit:
            the whole model). Parameters outside every unit form the root unit.
        strategy: full_shard (ZeRO-3), shard_grad_op (FSDP's ZeRO-2: parameters gathered once per step),
            shard_optim_grad (DeepSpeed's ZeRO-2: full parameters kept across steps, gradients and optimizer
            state sharded), shard_optim (ZeRO-1: only optimizer state and masters sharded), no_shard (DDP),
            hybrid_shard, hybrid_shard_zero2; aliases zero1/zero2/zero3/ddp and FSDP1's upper-case names
            are accepted (see strategy.py for what each keeps and sends).
        mesh: a 1-D ``DeviceMesh``, or 2-D ``("replicate", "shard")`` for the hybrid strategies.
        mixed_precision: gather/compute dtype and gradient-reduction dtype; masters stay in their dtype.
        offload: ``CPUOffload()`` keeps shards, gradients and the optimizer step on the CPU.
        sync_module_states: ``True`` takes rank 0's parameters and buffers (other ranks may be on the meta
            device). Not given, every rank's initial weights are compared (one checksum per tensor, one small
            all-gather) and rank 0's are taken where they differ, as DistributedDataParallel does, with a
            warning; ``False`` refuses ranks that differ instead (initial_weights.py).
        param_init_fn: initialises a module's own parameters when the model is on the meta device
            (default: ``module.reset_parameters()``); every rank runs it from rank 0's RNG state.
        device: compute device; default: the parameters' accelerator, else ``cuda:<current>`` when the
            process group moves CUDA tensors over NCCL, else CPU (``shardwise.engine.base.device.compute_device``).
        prefetch: start the next unit's all-gather before the current one computes.
        activation_checkpointing: recompute each block unit's activations in backward instead of keeping
            them (not the root's, nor those of the embedding and head units ``"auto"`` and ``"auto+head"``
            make).
        broadcast_buffers: before every forward, give every rank rank 0's buffers (BatchNorm running
            statistics, ...), as DDP does by default, so that ranks evaluate alike and checkpoints hold what
            every rank used. ``False`` keeps each rank's own buffers.

    After this call ``model.parameters()`` are the model's parameters, each holding this rank's elements and
    showing the whole parameter's shape to user code (README, "what a parameter is"; names unchanged); build
    the optimizer from them (one built before takes them when this returns). During a unit's forward its
    parameters are full-shape views of a gathered buffer. The model answers DDP's and FSDP's idioms itself
    (ddp_idioms.py): ``model.no_sync()``, ``model.require_backward_grad_sync``,
    ``model.set_requires_gradient_sync()``, ``model.clip_grad_norm_()``; ``model.module`` is a named error
    (there is no wrapper: use the model).
    """
    if hasattr(model, STATE_ATTR):
        raise ShardwiseError(f"shardwise.shard() was already called on this {type(model).__name__} (or on a model "
                             f"that contains it); call it once, on the whole model")
    inner = next((name for name, m in model.named_modules() if name and hasattr(m, STATE_ATTR)), None)
    if inner is not None:
        raise ShardwiseError(f"shardwise.shard(): submodule {inner!r} of this {type(model).__name__} is already "
                             f"sharded (shard() was called on it); call shard() once, on the whole model, and "
                             f"choose the units with units=")
    refuse_rewriting_modules(model)  # nn.Embedding(max_norm=...): before anything is allocated
    strategy = Strategy.parse(strategy)
    mp = mixed_precision or MixedPrecision()
    pgs = resolve_groups(strategy, mesh)
    compute_device = _resolve_device(model, device, pgs)
    plan = build_plan(model, units, pgs.shard_size)
    if checks_enabled():  # first: every collective after it is sized by the plan
        check_same_plan(_describe_plan(plan, strategy, pgs))
    # Our own groups over the same ranks: a user's collective can never meet ours at the wire (device.py).
    world = dist.group.WORLD if dist.get_world_size() > 1 else None
    shard_group, replicate_group, world_group = devices.own_groups([pgs.shard, pgs.replicate, world])
    pgs = dataclasses.replace(pgs, shard=shard_group, replicate=replicate_group, world=world_group)
    # (Blocks, not units: an untied embedding or head is a unit of its own without any block around it.)
    if units in (AUTO, AUTO_WITH_HEAD) and not any(u.checkpointed for u in plan.units) and dist.get_rank() == 0:
        edges = " and ".join(f"its {u.edge}" for u in plan.units if u.edge is not None)
        warnings.warn(f"shardwise.shard(units={units!r}): {type(model).__name__} has no repeated blocks (no Hugging Face "
                      f"_no_split_modules, no nn.ModuleList), so the whole model{f' but {edges}' if edges else ''} "
                      f"is one unit, gathered whole for its forward and backward; pass units={{SomeBlock, ...}} "
                      f"(module classes) to shard it finer, or units=None to say one unit is meant", UserWarning,
                      stacklevel=2)
    state_dict_keys = list(model.state_dict(keep_vars=True).keys())
    transfers = OffloadTransfers(compute_device, offload) if offload is not None else None
    runtime = ModelRuntime(strategy, pgs, mp, prefetch, plan=plan, state_dict_keys=state_dict_keys,
                           device=compute_device, transfers=transfers, check_collectives=checks_enabled())
    # The core's two seams (core/seams.py): parameters from the surface's factory, gradients to its sinks.
    factory = ShardParamFactory(pgs.shard, compute_device, runtime.checker)
    flat_groups = {
        id(gp): FlatGroup(gp, pgs, compute_device, mp, offload, strategy, factory=factory, transfers=transfers,
                          sink=PieceGradSink(transfers, on_direct_grad=runtime.begin_backward),
                          checker=runtime.checker, ids=(ui, gi))
        for ui, up in enumerate(plan.units) for gi, gp in enumerate(up.groups)}
    warn_if_backward_inputs_unseen()  # a torch that cannot show us backward(inputs=...) says so once
    groups = list(flat_groups.values())
    initial_weights.fill(model, groups, compute_device, sync_module_states, param_init_fn, runtime.checker)
    retired = _retire_originals(groups)
    runtime.units = [Unit(up, [flat_groups[id(gp)] for gp in up.groups], runtime) for up in plan.units]
    _install_hooks(model, runtime, activation_checkpointing)
    refuse_wrappers(model)  # DDP (Accelerate's prepare), fully_shard would redo the sharding on the pieces
    refuse_rebuilding_methods(model)  # resize_token_embeddings after shard()
    registration_guard.install()  # a module with new parameters attached after shard() (get_peft_model)
    state_dict_pieces.install(model, runtime)  # model.load_state_dict() marks the shards written
    runtime.before_forward.append(optimizer_swap.restore_all)  # a step that raised left its swap (optimizer_swap.py)
    whole_model_saves.install(model)  # model.save_pretrained(dir) writes the whole model, streamed
    ddp_idioms.install(model)  # model.no_sync(), require_backward_grad_sync, FSDP's idioms, model.module
    optimizer_guard.adopt_in_live_optimizers(retired)  # an optimizer built before shard() holds them now
    if broadcast_buffers and pgs.data_parallel_size > 1:
        sync = BufferBroadcast(model, runtime)
        if sync.buffers:
            runtime.buffers = sync
    return model


def _retire_originals(groups: list[FlatGroup]) -> list[nn.Parameter]:
    """Retire the original parameter objects once the shards are filled: their memory is released, and an
    optimizer that still holds them (built before shard, as nanoGPT builds it before wrapping in DDP) takes
    their shard parameters at the end of shard(), or at its first step where it holds state for them
    (optimizer_guard.py), instead of silently doing nothing. Returns the retired parameters."""
    retired = []
    for g in groups:
        for spec, shard_param in zip(g.plan.params, g.shard_params):
            old = spec.refs[0].module._parameters[spec.refs[0].name]
            adopt_tensor_hooks(old, shard_param)  # p.register_hook before shard() keeps working
            old.data = torch.empty(0, dtype=old.dtype, device=old.device)
            old._shardwise_retired = spec.fqn
            old._shardwise_successor = weakref.ref(shard_param)
            retired.append(old)
    optimizer_guard.install()  # retired parameters, optimizer classes, whose state (optimizer_guard.py)
    return retired


_EAGER_REASON = ("shardwise.shard()'s unit entries and exits (collectives, storage resizes) run between compiled "
                 "graphs: compile a sharded model or its blocks with fullgraph=False")


def _eager(hook: Callable) -> Callable:
    """``hook`` as torch.compile leaves it: run as Python between compiled graphs, never traced (the engine's
    entry and exit issue collectives, resize storages and register autograd hooks, which inductor cannot
    lower; the modules' own code is still compiled). Public ``torch.compiler.disable``; ~0.5 us a call. Its
    ``reason`` (where this torch has it) is what ``torch.compile(..., fullgraph=True)`` raises with."""
    if "reason" in inspect.signature(torch.compiler.disable).parameters:
        return torch.compiler.disable(hook, recursive=True, reason=_EAGER_REASON)
    return torch.compiler.disable(hook, recursive=True)


def _install_hooks(model: nn.Module, runtime: ModelRuntime, activation_checkpointing: bool) -> None:
    """Bind every unit's shards and register its entry and exit hooks; mark every module as sharded. Entry
    hooks go first (``prepend``) and exit hooks after those registered before ``shard()``: a user's hook
    sees whole parameters (legacy ``weight_norm`` computes ``weight`` from ``weight_g`` and ``weight_v`` in a
    pre-forward hook)."""
    for unit in runtime.units:
        up = unit.plan
        unit.bind_sharded()
        up.module.register_forward_pre_hook(_eager(unit.pre_forward), with_kwargs=True, prepend=True)
        up.module.register_forward_hook(_eager(unit.post_forward), with_kwargs=True, always_call=True)
        if activation_checkpointing and up.checkpointed:
            checkpoint_unit(unit)
    # Modules that hold a unit's parameters enter the unit when called on their own (see unit.py,
    # [Note: entries]): an encoder called by generate(), a head called directly, a recompute.
    for module, ui in entry_modules(runtime.plan):
        unit = runtime.units[ui]
        module.register_forward_pre_hook(_eager(unit.pre_submodule), with_kwargs=True, prepend=True)
        module.register_forward_hook(_eager(unit.post_forward), with_kwargs=True, always_call=True)
    for m in model.modules():
        setattr(m, STATE_ATTR, runtime)  # runtime_of(any submodule): summon_full_params(model.encoder)
        # transformers' generate() keeps ranks stepping together (synced_gpus) for models it sees as
        # FSDP-managed: otherwise a rank that reaches EOS first stops calling forward and the others hang.
        m._is_fsdp_managed_module = True
        # torch.compile (dynamo) traces an FSDP-managed module only when it also says use_orig_params, as
        # FSDP2's fully_shard sets both: its parameters are then read as graph inputs at every call (a unit
        # binds new views each forward). Without it dynamo refuses every module ("FSDP with
        # use_orig_params=False"): fullgraph=True fails, and otherwise none of a module's own code compiles.
        m._fsdp_use_orig_params = True


def _describe_plan(plan, strategy: Strategy, pgs) -> str:
    lines = [f"{strategy.value} shard={pgs.shard_size} replicate={pgs.replicate_size}"]
    for u in plan.units:
        for g in u.groups:
            lines.append(f"unit {u.label} {g.dtype} rg={g.requires_grad}")
            lines.extend(f"  {p.fqn} {tuple(p.shape)}" for p in g.params)
    return "\n".join(lines)


def _resolve_device(model: nn.Module, device, pgs) -> torch.device:
    real: dict[torch.device, str] = {}
    meta_name = None
    for name, p in model.named_parameters():
        if p.is_meta:
            meta_name = meta_name or name
        else:
            real.setdefault(p.device, name)
    if len(real) > 1:
        listing = ", ".join(f"{n!r} on {d}" for d, n in real.items())
        raise ShardwiseError(f"parameters are on different devices ({listing}); move the model to one device first")
    if real and meta_name is not None:
        (d, n), = real.items()
        raise ShardwiseError(
            f"parameters are on different devices: {meta_name!r} on meta and {n!r} on {d}; build the whole "
            f"model on the meta device (shard() then materialises it) or none of it"
        )
    return devices.compute_device(real, pgs.shard or pgs.replicate, explicit=device)


