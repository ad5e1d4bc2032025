"""shardwise: fully sharded data parallel training for PyTorch."""

from shardwise.api import clip_grad_norm_, no_sync, shard
from shardwise.checkpoint import CheckpointManager, export_checkpoint, load_checkpoint, save_checkpoint
from shardwise.errors import ShardwiseError
from shardwise.full_params import register_forward_method, summon_full_params
from shardwise.grad_scaler import ShardedGradScaler
from shardwise.mixed_precision import MixedPrecision
from shardwise.offload import CPUOffload
from shardwise.optimizer_guard import allow_optimizer
from shardwise.optim.offload import OffloadOptimizer, offload_optimizer
from shardwise.logical_shapes import ParamInfo, named_param_infos, num_parameters, param_info
from shardwise.pretrained import load_pretrained, skip_weight_init
from shardwise.state_dict import full_state_dict, load_full_state_dict
from shardwise.strategy import Strategy

__version__ = "0.1.0"

__all__ = [
    "shard",
    "no_sync",
    "clip_grad_norm_",
    "summon_full_params",
    "register_forward_method",
    "full_state_dict",
    "load_full_state_dict",
    "save_checkpoint",
    "load_checkpoint",
    "CheckpointManager",
    "export_checkpoint",
    "load_pretrained",
    "skip_weight_init",
    "MixedPrecision",
    "ShardedGradScaler",
    "CPUOffload",
    "offload_optimizer",
    "allow_optimizer",
    "OffloadOptimizer",
    "Strategy",
    "ShardwiseError",
    "ParamInfo",
    "param_info",
    "named_param_infos",
    "num_parameters",
    "__version__",
]
