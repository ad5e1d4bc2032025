"""Lightning's ``Trainer`` and ``Fabric`` on a sharded model: ``strategy="shardwise"``.

    import shardwise.integrations.lightning      # registers "shardwise" with the Trainer's and Fabric's registries
    trainer = L.Trainer(strategy="shardwise")   # or strategy=ShardwiseStrategy(units={Block}, ...)
    fabric = L.Fabric(strategy="shardwise")     # or strategy=ShardwiseFabricStrategy(units={Block}, ...)

Both take ``shardwise.shard``'s options as keywords (``sharding_strategy=`` is its ``strategy``). They start no
processes: launch with ``torchrun --nproc-per-node N train.py``, under SLURM, or from code that already called
``torch.distributed.init_process_group`` (then ``ProcessGroupEnvironment`` reads ranks from that group).

Where Lightning's DDP strategy wraps the module, these shard it in place and keep it as it is (shardwise refuses
a DDP wrapper around its pieces, and the strategies never build one):
- ``shardwise.shard`` with the strategy's options, on the compute device. An eagerly built model takes rank
  0's weights (``sync_module_states``), as DDP broadcasts them; a model built on the meta device (the Trainer's
  ``configure_model``, ``Trainer.init_module()``, ``Fabric.init_module(empty_init=True)``) is materialised one
  module at a time by ``param_init_fn`` (default ``reset_parameters``), consuming the RNG as an eager build
  would: seed every rank alike (``seed_everything``).
- Lightning calls ``training_step`` (validation, test, predict) on the module itself, not through forward, so
  the root unit gathers around those methods too (``shardwise.register_forward_method``), as around forward;
  an optimizer stepped inside ``training_step`` (manual optimisation) gathers it again after the step (the
  engine's step hook does, as for any method registered so).
- Gradient accumulation runs under ``shardwise.no_sync`` (the Trainer's ``accumulate_grad_batches``, Fabric's
  ``no_backward_sync``); Lightning's own norm and value clipping call torch's ``clip_grad_norm_`` /
  ``clip_grad_value_``, exact on shard parameters.
- Precision plugins are Lightning's own, unchanged (``bf16-true`` converts the model before it is sharded).
- validate / test / predict outside ``fit`` shard the model they are given (rank 0's weights), instead of
  broadcasting rank 0's weights into it as Lightning's DDP does.
- Checkpoints: a file with the whole model that one process loads, plus a sidecar directory of every rank's
  pieces and optimizer state that resumes at any world size (``lightning_checkpoint.py``);
  ``state_dict_type="sharded"`` keeps the model in the sidecar too, for models rank 0's memory cannot hold.

What the two strategies share, the process group, the collectives and sharding, is ``ShardwiseParallel``
(``lightning_strategy_base.py``), which also spells every private Lightning name this integration needs.
"""

from __future__ import annotations

import contextlib
import os
from datetime import timedelta
from typing import Any, Callable, Iterator, Optional

import torch
import torch.nn as nn

try:
    import lightning.pytorch as pl
    from lightning.fabric.plugins import CheckpointIO
    from lightning.fabric.plugins.environments import ClusterEnvironment
    from lightning.fabric.strategies import STRATEGY_REGISTRY
    from lightning.fabric.strategies import ParallelStrategy as FabricParallelStrategy
    from lightning.pytorch.strategies import ParallelStrategy, StrategyRegistry
    from lightning.pytorch.trainer.states import TrainerFn
except ImportError as e:  # pragma: no cover - the message is the point
    raise ImportError("shardwise.integrations.lightning needs Lightning: pip install 'shardwise[lightning]'") from e

import shardwise
from shardwise.errors import ShardwiseError
from shardwise.integrations import lightning_checkpoint as ckpt
from shardwise.integrations.lightning_strategy_base import (BACKWARD_SYNC_ATTR, LAYER_SYNC_ATTR, NAME,
                                                            ProcessGroupEnvironment, ShardwiseParallel,
                                                            default_environment, is_sharded)

__all__ = ["ShardwiseStrategy", "ShardwiseFabricStrategy", "ProcessGroupEnvironment", "consolidate_checkpoint"]

consolidate_checkpoint = ckpt.consolidate_checkpoint


class _NoSync:
    """What Fabric's ``no_backward_sync`` asks the strategy for."""

    def no_backward_sync(self, module: nn.Module, enabled: bool) -> contextlib.AbstractContextManager:
        return shardwise.no_sync(module) if enabled else contextlib.nullcontext()


class ShardwiseStrategy(ShardwiseParallel, ParallelStrategy):
    """Lightning ``Trainer`` strategy: the LightningModule sharded in place by ``shardwise.shard``.

    ``ShardwiseStrategy(units={Block}, sharding_strategy="full_shard", mixed_precision=..., offload=...,
    activation_checkpointing=True, param_init_fn=..., ...)`` takes ``shard()``'s options;
    ``sync_module_states`` defaults to rank 0's weights for an eagerly built model. ``configure_model`` and
    ``Trainer.init_module()`` build on the meta device (``empty_init=False``: real tensors, on the CPU).
    ``state_dict_type``: ``"full"`` (the checkpoint file holds the whole model, gathered on rank 0) or
    ``"sharded"`` (every rank writes its pieces to the sidecar directory; ``consolidate_checkpoint`` makes the
    one-process file).
    """

    strategy_name = NAME

    def __init__(self, accelerator: Optional["pl.accelerators.Accelerator"] = None,
                 parallel_devices: Optional[list[torch.device]] = None,
                 cluster_environment: Optional[ClusterEnvironment] = None, checkpoint_io: Optional[CheckpointIO] = None,
                 precision_plugin: Optional["pl.plugins.Precision"] = None, process_group_backend: Optional[str] = None,
                 timeout: Optional[timedelta] = None, state_dict_type: str = "full", **shard_options: Any) -> None:
        super().__init__(accelerator=accelerator, parallel_devices=parallel_devices,
                         cluster_environment=default_environment(cluster_environment), checkpoint_io=checkpoint_io,
                         precision_plugin=precision_plugin)
        self._init_shardwise(shard_options, process_group_backend, timeout, state_dict_type)

    @property
    def is_distributed(self) -> bool:  # the Trainer reads it: distributed samplers, sync_dist logging
        return True

    def setup(self, trainer: "pl.Trainer") -> None:
        self.accelerator.setup(trainer)
        fitting = trainer.state.fn == TrainerFn.FITTING
        layer_sync = getattr(self, LAYER_SYNC_ATTR, None)
        if fitting and layer_sync is not None and not is_sharded(self.model):
            self.model = layer_sync.apply(self.model)
        self.model = self._shard(self.precision_plugin.convert_module(self.model))
        if fitting:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()

    def model_to_device(self) -> None:
        pass  # shard() places the shards on the compute device

    @contextlib.contextmanager
    def tensor_init_context(self, empty_init: Optional[bool] = None) -> Iterator[None]:
        device = torch.device("meta") if empty_init is not False else contextlib.nullcontext()
        with device, self.precision_plugin.tensor_init_context():
            yield

    @contextlib.contextmanager
    def block_backward_sync(self) -> Iterator[None]:
        with shardwise.no_sync(self.model):
            yield

    def reduce(self, tensor: Any, group: Optional[Any] = None, reduce_op: Any = "mean") -> Any:
        return self._all_reduce(tensor, group, reduce_op)

    def teardown(self) -> None:
        # Not Strategy.teardown: it moves the LightningModule to the CPU, which would move the shards out from
        # under the engine's buffers.
        self.cluster_environment.teardown()
        self.precision_plugin.teardown()
        self.accelerator.teardown()
        self.checkpoint_io.teardown()

    # ---- checkpoints (lightning_checkpoint.py) ------------------------------------------------------------------

    @property
    def restore_checkpoint_after_setup(self) -> bool:
        return True  # into the sharded model and its optimizers

    @property
    def lightning_restore_optimizer(self) -> bool:
        return False  # load_checkpoint restores them from the sidecar

    def lightning_module_state_dict(self) -> dict[str, Any]:
        if self.state_dict_type == "sharded":
            return ckpt.sharded_placeholder()  # save_checkpoint names the sidecar directory holding the model
        return self._whole_model_state_dict(self.model)

    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict:
        return ckpt.placeholder()

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Optional[Any] = None) -> None:
        path, token = self._where_to_save(filepath)
        markers, pairs = [], [(self.model, o) for o in self.optimizers]
        if checkpoint.get("optimizer_states"):
            markers = ckpt.write_sidecar(path, token, pairs, checkpoint.get("global_step"))
            checkpoint["optimizer_states"] = markers
        named = list(markers)
        if ckpt.is_sharded_placeholder(checkpoint.get("state_dict")):
            entry = ckpt.model_marker(self.model, pairs, markers) or ckpt.write_model_sidecar(
                path, token, self.model, step=checkpoint.get("global_step"))
            checkpoint["state_dict"] = entry
            named.append(entry)
        self._write(checkpoint, path, named, storage_options)

    def load_checkpoint(self, checkpoint_path: Any, weights_only: Optional[bool] = None) -> dict[str, Any]:
        path = ckpt.local_path(self.broadcast(os.fspath(checkpoint_path)))
        checkpoint = self._read(path, weights_only)
        module = self.lightning_module
        entries = checkpoint.get("optimizer_states")
        if module.trainer.state.fn == TrainerFn.FITTING and self.optimizers:
            names = ckpt.sidecar_names(path, entries, len(self.optimizers))
            ckpt.restore_optimizers(path, names, [(self.model, o) for o in self.optimizers])
        else:
            ckpt.restore_model(path, self.model, ckpt.names_in(entries), checkpoint.get("state_dict"),
                               module.strict_loading)
        return checkpoint

    def load_model_state_dict(self, checkpoint: Any, strict: bool = True) -> None:
        pass  # load_checkpoint loaded it, into the shards

    def load_optimizer_state_dict(self, checkpoint: Any) -> None:
        pass  # load_checkpoint loaded them from the sidecar

    def remove_checkpoint(self, filepath: Any) -> None:
        if self.is_global_zero:
            self.checkpoint_io.remove_checkpoint(filepath)
            ckpt.remove(ckpt.local_path(filepath))


class ShardwiseFabricStrategy(ShardwiseParallel, FabricParallelStrategy):
    """Lightning ``Fabric`` strategy: ``fabric.setup(model, optimizer)`` shards the model in place.

    Takes ``shard()``'s options as ``ShardwiseStrategy`` does. An optimizer built before ``setup`` is pointed
    at the shard parameters (before its first step). ``fabric.init_module(empty_init=True)`` builds on the meta
    device. ``fabric.save(path, {"model": model, "optimizer": optimizer, ...})`` writes the whole model to
    ``path`` and each optimizer, with its model's pieces, to the sidecar; ``fabric.load`` restores both.
    ``state_dict_type="sharded"``: the model's entry in ``path`` names a sidecar directory too (as the Trainer's).
    """

    def __init__(self, accelerator: Optional[Any] = None, parallel_devices: Optional[list[torch.device]] = None,
                 cluster_environment: Optional[ClusterEnvironment] = None, checkpoint_io: Optional[CheckpointIO] = None,
                 precision: Optional[Any] = None, process_group_backend: Optional[str] = None,
                 timeout: Optional[timedelta] = None, state_dict_type: str = "full", **shard_options: Any) -> None:
        super().__init__(accelerator=accelerator, parallel_devices=parallel_devices,
                         cluster_environment=default_environment(cluster_environment), checkpoint_io=checkpoint_io,
                         precision=precision)
        self._init_shardwise(shard_options, process_group_backend, timeout, state_dict_type)
        setattr(self, BACKWARD_SYNC_ATTR, _NoSync())

    def setup_module(self, module: nn.Module) -> nn.Module:
        return self._shard(module)

    def setup_module_and_optimizers(self, module: nn.Module, optimizers: list, scheduler: Optional[Any] = None
                                    ) -> tuple[nn.Module, list, Optional[Any]]:
        module = self._shard(module)
        return module, [self.setup_optimizer(o) for o in optimizers], scheduler

    def setup_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        self._rebind(optimizer)
        return optimizer

    def module_to_device(self, module: nn.Module) -> None:
        pass  # shard() places the shards on the compute device

    def module_init_context(self, empty_init: Optional[bool] = None) -> contextlib.AbstractContextManager:
        stack = contextlib.ExitStack()
        if empty_init:
            stack.enter_context(torch.device("meta"))
        stack.enter_context(self.precision.module_init_context())
        return stack

    def all_reduce(self, tensor: Any, group: Optional[Any] = None, reduce_op: Any = "mean") -> Any:
        return self._all_reduce(tensor, group, reduce_op)

    # ---- checkpoints (lightning_checkpoint.py) ------------------------------------------------------------------

    def get_module_state_dict(self, module: nn.Module) -> dict[str, Any]:
        if not is_sharded(module):
            return module.state_dict()
        if self.state_dict_type == "sharded":
            return ckpt.sharded_placeholder()  # save_checkpoint names the sidecar directory holding the model
        return self._whole_model_state_dict(module)

    def load_module_state_dict(self, module: nn.Module, state_dict: dict[str, Any], strict: bool = True) -> None:
        if is_sharded(module):
            ckpt.load_whole_state_dict(module, state_dict, strict)
        else:
            module.load_state_dict(state_dict, strict=strict)

    def get_optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict:
        return ckpt.placeholder()

    def save_checkpoint(self, path: Any, state: dict[str, Any], storage_options: Optional[Any] = None,
                        filter: Optional[dict[str, Callable[[str, Any], bool]]] = None) -> None:
        path, token = self._where_to_save(path)
        optimizer_keys = [k for k, v in state.items() if isinstance(v, torch.optim.Optimizer)]
        pairs = [(self._owner(state[k], list(state.values())), state[k]) for k in optimizer_keys]
        markers = ckpt.write_sidecar(path, token, pairs, None)
        marker_of = dict(zip(optimizer_keys, markers))
        named, converted = list(markers), {}
        for index, (key, obj) in enumerate(state.items()):
            if key in marker_of:
                value = marker_of[key]
            elif isinstance(obj, nn.Module):
                value = self.get_module_state_dict(obj)
                if ckpt.is_sharded_placeholder(value):
                    value = ckpt.model_marker(obj, pairs, markers) or ckpt.write_model_sidecar(path, token, obj, index)
                    named.append(value)
            elif _is_stateful(obj):
                value = obj.state_dict()
            else:
                value = obj
            if filter and key in filter and isinstance(value, dict):
                value = {k: v for k, v in value.items() if filter[key](k, v)}
            converted[key] = value
        self._write(converted, path, named, storage_options)

    def load_checkpoint(self, path: Any, state: Optional[Any] = None, strict: bool = True,
                        weights_only: Optional[bool] = None) -> dict[str, Any]:
        path = ckpt.local_path(self.broadcast(os.fspath(path)))
        checkpoint = self._read(path, weights_only)
        if not state:
            return checkpoint
        if isinstance(state, nn.Module):
            self.load_module_state_dict(state, checkpoint, strict)
            return {}
        if isinstance(state, torch.optim.Optimizer):
            raise ShardwiseError(f"fabric.load_raw({path}, optimizer): a sharded optimizer's state is per rank; "
                                 f"save it with fabric.save(path, {{'optimizer': optimizer, ...}}) and load it the "
                                 f"same way")
        missing = [k for k in state if k not in checkpoint]
        if strict and missing:
            raise ShardwiseError(f"{path} has no {missing[0]!r}, which the state to load asks for (strict=False "
                                 f"loads what is there)")
        optimizer_keys = [k for k, v in state.items() if isinstance(v, torch.optim.Optimizer) and k in checkpoint]
        names = ckpt.sidecar_names(path, [checkpoint[k] for k in optimizer_keys], len(optimizer_keys))
        pairs = [(self._owner(state[k], list(state.values())), state[k]) for k in optimizer_keys]
        ckpt.restore_optimizers(path, names, pairs)
        restored = {id(model) for model, _ in pairs}
        for key, obj in list(state.items()):
            if key not in checkpoint:
                continue
            value = checkpoint.pop(key)
            if isinstance(obj, torch.optim.Optimizer):
                continue
            if isinstance(obj, nn.Module):
                if id(obj) in restored:
                    continue
                if is_sharded(obj) and ckpt.marked_name(value) is not None:
                    ckpt.restore_model(path, obj, [], value, strict)
                else:
                    self.load_module_state_dict(obj, value, strict)
            elif _is_stateful(obj):
                obj.load_state_dict(value)
            else:
                state[key] = value
        return checkpoint


def _is_stateful(obj: Any) -> bool:
    return callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))


def _register() -> None:
    """``strategy="shardwise"`` for the Trainer and for Fabric, from the moment this module is imported."""
    for registry, cls in ((StrategyRegistry, ShardwiseStrategy), (STRATEGY_REGISTRY, ShardwiseFabricStrategy)):
        if NAME not in registry:
            cls.register_strategies(registry)


_register()
