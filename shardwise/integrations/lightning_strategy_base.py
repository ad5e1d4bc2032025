"""The part of a shardwise strategy that Lightning's Trainer and Fabric share (``lightning.py`` holds the two
strategies): the process group and the environment that finds one already started, the collectives Lightning
asks a strategy for, sharding a module where DDP would wrap it, optimizers built before that, and the one
place that spells a private Lightning name (``_private_lightning_names``)."""

from __future__ import annotations

import os
import weakref
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
import torch.nn as nn

try:
    from lightning.fabric.plugins import TorchCheckpointIO
    from lightning.fabric.plugins.environments import ClusterEnvironment
    from lightning.fabric.utilities.seed import reset_seed
    from lightning.pytorch.utilities.rank_zero import rank_zero_only
except ImportError as e:  # pragma: no cover - the message is the point
    raise ImportError("shardwise.integrations.lightning needs Lightning: pip install 'shardwise[lightning]'") from e

import shardwise
from shardwise.errors import ShardwiseError
from shardwise.integrations import lightning_checkpoint as ckpt

NAME = "shardwise"
STEP_METHODS = ("training_step", "validation_step", "test_step", "predict_step")
# shard()'s keyword arguments the strategies take, with their defaults; ``sharding_strategy`` is shard()'s
# ``strategy`` (``strategy=`` is the Trainer's own argument).
SHARD_OPTIONS = dict(units="auto", sharding_strategy="full_shard", mesh=None, mixed_precision=None, offload=None,
                     activation_checkpointing=False, param_init_fn=None, prefetch=True, broadcast_buffers=True,
                     sync_module_states=None)


def _private_lightning_names() -> tuple[str, str, str]:
    """The private Lightning names the integration touches, and the only place it spells them: attribute names of a
    strategy that Lightning reads or writes. Checked on lightning 2.6.6 (``tests/integrations/test_lightning.py``
    fails when one of them changes):

    - ``"_backward_sync_control"``: where ``Fabric.no_backward_sync`` asks the strategy for the context that
      skips gradient synchronisation (any object with ``no_backward_sync(module, enabled)``); where it is
      missing, Fabric warns and synchronises every micro-batch.
    - ``"_layer_sync"``: where the Trainer's connector puts ``sync_batchnorm=True``'s ``LayerSync`` on a strategy
      that has the attribute (``ParallelStrategy.__init__`` creates it); the strategy applies it before wrapping.
    - ``"_num_nodes"``: where Fabric's connector writes ``num_nodes=`` on a strategy that has ``num_nodes`` (the
      Trainer's writes ``num_nodes`` itself).
    """
    return "_backward_sync_control", "_layer_sync", "_num_nodes"


BACKWARD_SYNC_ATTR, LAYER_SYNC_ATTR, NUM_NODES_ATTR = _private_lightning_names()


class ProcessGroupEnvironment(ClusterEnvironment):
    """The processes exist already: ranks and world size come from the default process group once it is
    initialised, before that from torchrun's ``RANK`` / ``WORLD_SIZE`` / ``LOCAL_RANK``. Lightning starts no
    process under it. The strategies use it by default when ``torch.distributed`` is already initialised."""

    @property
    def creates_processes_externally(self) -> bool:
        return True

    @property
    def main_address(self) -> str:
        return os.environ.get("MASTER_ADDR", "127.0.0.1")

    @property
    def main_port(self) -> int:
        return int(os.environ.get("MASTER_PORT", "29500"))

    @staticmethod
    def detect() -> bool:
        return dist.is_available() and dist.is_initialized()

    def world_size(self) -> int:
        return dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", "1"))

    def set_world_size(self, size: int) -> None:
        pass  # the process group decides

    def global_rank(self) -> int:
        return dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", "0"))

    def set_global_rank(self, rank: int) -> None:
        pass  # the process group decides

    def local_rank(self) -> int:
        return int(os.environ.get("LOCAL_RANK", "0"))

    def node_rank(self) -> int:
        return int(os.environ.get("GROUP_RANK", os.environ.get("NODE_RANK", "0")))


def default_environment(given: Optional[ClusterEnvironment]) -> Optional[ClusterEnvironment]:
    """The environment a strategy starts with: the one given, else ProcessGroupEnvironment when the process
    group exists already, else None (Lightning then picks torchrun's, SLURM's, ...)."""
    if given is not None:
        return given
    return ProcessGroupEnvironment() if ProcessGroupEnvironment.detect() else None


def is_sharded(module: nn.Module) -> bool:
    first = next(module.parameters(), None)
    if first is None:
        return False
    try:
        shardwise.param_info(first)
    except ShardwiseError:
        return False
    return True


def _gather_around_steps(module: nn.Module) -> None:
    """Lightning calls the step methods on the module itself: make each gather the root unit, as forward does
    (once: a module that comes back for another fit keeps its wrapped methods)."""
    for name in STEP_METHODS:
        if callable(getattr(type(module), name, None)) and name not in vars(module):
            shardwise.register_forward_method(module, name)


class ShardwiseParallel:
    """What the Trainer's and Fabric's strategies share: the process group, the collectives Lightning asks a
    strategy for, sharding a module. Mixed in before each framework's ``ParallelStrategy``."""

    def _init_shardwise(self, shard_options: dict, process_group_backend: Optional[str],
                        timeout: Optional[timedelta], state_dict_type: str) -> None:
        self.state_dict_type = ckpt.check_state_dict_type(state_dict_type, type(self).__name__)
        unknown = sorted(set(shard_options) - set(SHARD_OPTIONS))
        if unknown:
            raise ShardwiseError(f"{type(self).__name__}: unknown option(s) {', '.join(unknown)}; it takes "
                                 f"shardwise.shard's options {', '.join(SHARD_OPTIONS)} (sharding_strategy is "
                                 f"shard()'s strategy)")
        self.shard_options = {**SHARD_OPTIONS, **shard_options}
        self._process_group_backend = process_group_backend
        self._timeout = timeout
        self._mesh = None
        # Parameters shard() retired -> their shard parameters, for optimizers built before setup (Fabric). The
        # old object is kept so that its id is not reused.
        self._replaced: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._sharded: "weakref.WeakSet[nn.Module]" = weakref.WeakSet()

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register(NAME, cls, description="shardwise: fully sharded data parallel (ZeRO-3)")

    def setup_environment(self) -> None:
        super().setup_environment()  # Lightning's: the accelerator's device
        self._start_process_group()

    # ---- where this process is ---------------------------------------------------------------------------------

    @property
    def root_device(self) -> torch.device:
        devices = self.parallel_devices or [torch.device("cpu")]
        if devices[0].type == "cpu":
            return devices[0]
        if self.local_rank >= len(devices):
            raise ShardwiseError(f"local rank {self.local_rank} has no device among {devices}: pass devices= the "
                                 f"number of processes per node")
        return devices[self.local_rank]

    @property
    def num_nodes(self) -> int:
        return getattr(self, NUM_NODES_ATTR, 1)

    @num_nodes.setter
    def num_nodes(self, n: int) -> None:
        setattr(self, NUM_NODES_ATTR, n)

    @property
    def num_processes(self) -> int:
        return len(self.parallel_devices) if self.parallel_devices else 1

    @property
    def distributed_sampler_kwargs(self) -> dict[str, int]:
        return {"num_replicas": self.world_size, "rank": self.global_rank}

    def set_world_ranks(self) -> None:
        """As Lightning's DDP: an environment that takes ranks from Lightning gets them (ProcessGroupEnvironment
        and torchrun's ignore it), and rank_zero_only learns this rank."""
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        rank_zero_only.rank = self.global_rank

    def _start_process_group(self) -> None:
        reset_seed()  # as Lightning's DDP does here: every rank from seed_everything's seed
        self.set_world_ranks()
        if not dist.is_initialized():
            env = self.cluster_environment
            if not env.creates_processes_externally and self.num_processes * self.num_nodes > 1:
                raise ShardwiseError(
                    f"the shardwise strategies start no processes, and {self.num_processes * self.num_nodes} were "
                    f"asked for: launch the script with `torchrun --nproc-per-node {self.num_processes} train.py` "
                    f"(or under SLURM), or call torch.distributed.init_process_group before fit")
            os.environ["MASTER_ADDR"] = env.main_address
            os.environ["MASTER_PORT"] = str(env.main_port)
            backend = self._process_group_backend or ("nccl" if self.root_device.type == "cuda" else "gloo")
            extra = {"timeout": self._timeout} if self._timeout is not None else {}
            dist.init_process_group(backend, rank=env.global_rank(), world_size=env.world_size(), **extra)
        mesh = self.shard_options["mesh"]
        if not isinstance(mesh, tuple):
            self._mesh = mesh
        elif self._mesh is None:  # (replicate, shard) sizes: a mesh needs the process group, so built here, once
            from torch.distributed.device_mesh import init_device_mesh

            self._mesh = init_device_mesh(self.root_device.type, mesh, mesh_dim_names=("replicate", "shard"))

    # ---- the collectives Lightning asks for -----------------------------------------------------------------------

    def barrier(self, name: Optional[str] = None) -> None:
        if not dist.is_initialized():
            return
        if dist.get_backend() == "nccl":
            dist.barrier(device_ids=[self.root_device.index])
        else:
            dist.barrier()

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        if not dist.is_initialized():
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src)
        return box[0]

    def _all_reduce(self, tensor: Any, group: Optional[Any] = None, reduce_op: Any = "mean") -> Any:
        """Lightning's reduction (``self.log(..., sync_dist=True)``): in place; "mean" is a sum divided by the
        world size, as Lightning's DDP computes it on gloo."""
        if not isinstance(tensor, torch.Tensor) or not dist.is_initialized():
            return tensor
        group = dist.group.WORLD if group is None else group
        op, mean = reduce_op, False
        if op is None:
            op = dist.ReduceOp.SUM
        elif isinstance(op, str):
            mean = op.lower() in ("mean", "avg")
            op = dist.ReduceOp.SUM if mean else getattr(dist.ReduceOp, op.upper())
        dist.all_reduce(tensor, op=op, group=group)
        if not mean:
            return tensor
        n = dist.get_world_size(group)
        return tensor.div_(n) if torch.is_floating_point(tensor) else tensor.copy_(tensor / n)

    def _agreed(self, fn: Callable[[], Any], what: str) -> Any:
        """``fn()`` on every rank; if it raised anywhere, a ShardwiseError naming the rank on every rank (a
        checkpoint file one rank cannot read or write must not leave the others waiting)."""
        try:
            result, error = fn(), None
        except Exception as e:  # noqa: BLE001 - reported on every rank
            result, error = None, f"{type(e).__name__}: {e}"
        if dist.is_initialized():
            errors: list = [None] * dist.get_world_size()
            dist.all_gather_object(errors, error)
        else:
            errors = [error]
        failed = [(rank, text) for rank, text in enumerate(errors) if text is not None]
        if failed:
            rank, text = failed[0]
            raise ShardwiseError(f"{what} failed on rank {rank}: {text}")
        return result

    # ---- sharding --------------------------------------------------------------------------------------------------

    def _shard(self, module: nn.Module) -> nn.Module:
        """Shard ``module`` in place with this strategy's options (once: a sharded module comes back as it is)."""
        if not is_sharded(module):
            o = self.shard_options
            sync = o["sync_module_states"]
            if sync is None:  # rank 0's eager weights, as DDP broadcasts them; a meta build is initialised everywhere
                sync = not self.broadcast(any(p.is_meta for p in module.parameters()))
            before = dict(module.named_parameters())
            shardwise.shard(module, o["units"], o["sharding_strategy"], self._mesh, o["mixed_precision"], o["offload"],
                            sync_module_states=sync, param_init_fn=o["param_init_fn"], device=self.root_device,
                            prefetch=o["prefetch"], activation_checkpointing=o["activation_checkpointing"],
                            broadcast_buffers=o["broadcast_buffers"])
            after = dict(module.named_parameters())
            self._replaced.update({id(p): (p, after[n]) for n, p in before.items() if n in after})
        _gather_around_steps(module)
        self._sharded.add(module)
        return module

    def _rebind(self, optimizer: torch.optim.Optimizer) -> None:
        """An optimizer built before its model was sharded holds the parameters ``shard()`` retired: point it at
        their shard parameters (only before its first step: its state would belong to the old ones)."""
        swapped = False
        for group in optimizer.param_groups:
            new = []
            for p in group["params"]:
                old, shard_param = self._replaced.get(id(p), (None, None))
                new.append(shard_param if old is p else p)
                swapped |= old is p
            group["params"] = new
        if swapped and optimizer.state:
            raise ShardwiseError(f"{type(optimizer).__name__} was built before its model was sharded and has "
                                 f"already stepped (or loaded a state): set up the model first, then build, load "
                                 f"and set up the optimizer")

    def _owner(self, optimizer: torch.optim.Optimizer, candidates: list) -> nn.Module:
        """The sharded model among ``candidates`` (then those this strategy sharded) whose parameters
        ``optimizer`` steps."""
        first = next((p for g in optimizer.param_groups for p in g["params"]), None)
        for module in [m for m in candidates if isinstance(m, nn.Module)] + list(self._sharded):
            if is_sharded(module) and any(p is first for p in module.parameters()):
                return module
        raise ShardwiseError(f"{type(optimizer).__name__} steps no parameter of a model sharded by "
                             f"{type(self).__name__}: set the model up with this strategy first, and build the "
                             f"optimizer from its parameters")

    def _read(self, path: Path, weights_only: Optional[bool]) -> dict:
        """PATH's dict on every rank (memory-mapped through torch.load unless a custom CheckpointIO reads it)."""
        if type(self.checkpoint_io) is TorchCheckpointIO:
            return self._agreed(lambda: ckpt.read(path, weights_only), f"reading {path}")
        return self._agreed(lambda: self.checkpoint_io.load_checkpoint(path, weights_only=weights_only),
                            f"reading {path}")

    def _write(self, checkpoint: dict, path: Path, markers: list, storage_options: Any) -> None:
        """Rank 0 writes PATH through the CheckpointIO, then prunes its sidecar; every rank learns how it went."""

        def write() -> None:
            if self.is_global_zero:
                self.checkpoint_io.save_checkpoint(checkpoint, path, storage_options=storage_options)
                ckpt.prune_sidecar(path, markers)

        self._agreed(write, f"writing {path}")

    def _whole_model_state_dict(self, module: nn.Module) -> dict:
        """``state_dict_type="full"``: the whole model on rank 0 ({} elsewhere), refused by name on every rank
        first when rank 0's available host memory cannot hold it."""
        ckpt.check_whole_model_fits(module, "a checkpoint", self.broadcast(ckpt.available_host_memory()))
        return ckpt.whole_model_state_dict(module)

    def _where_to_save(self, filepath: Any) -> tuple[Path, str]:
        """Rank 0's path (every rank writes its pieces beside the same file) and a token for this save. A path
        that is a symbolic link (``ModelCheckpoint(save_last="link")`` leaves ``last.ckpt`` one) is unlinked
        first: the save writes a file of its own there, as Lightning's atomic save replaces the link, so its
        sidecar goes beside it and the link's target keeps its file and sidecar."""
        path, token = self.broadcast((os.fspath(filepath), ckpt.new_token()))
        path = ckpt.local_path(path)
        self._agreed(lambda: ckpt.unlink_link(path) if self.is_global_zero else None, f"replacing the link {path}")
        return path, token
