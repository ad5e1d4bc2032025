"""shardwise: fully sharded data parallel training for PyTorch."""

from shardwise.engine.api import no_sync, shard
from shardwise.engine.grad_norm import clip_grad_norm_
from shardwise.checkpoint import CheckpointManager, load_checkpoint, save_checkpoint
from shardwise.errors import ShardwiseError
from shardwise.engine.full_params import register_forward_method, summon_full_params
from shardwise.engine.grad_scaler import ShardedGradScaler
from shardwise.engine.base.mixed_precision import MixedPrecision
from shardwise.engine.base.cpu_offload import CPUOffload
from shardwise.engine.surface.optimizer_guard import allow_optimizer
from shardwise.optim.offload_optimizer import OffloadOptimizer, offload_optimizer
from shardwise.engine.logical_shapes import ParamInfo, named_param_infos, num_parameters, param_info
from shardwise.hf.export import export_checkpoint
from shardwise.hf.pretrained import load_pretrained, skip_weight_init
from shardwise.hf.whole_model import save_whole_model
from shardwise.hf.quantization import QuantSettings, quantize_model
from shardwise.engine.state_dict import full_state_dict, load_full_state_dict
from shardwise.engine.base.strategy import Strategy

from shardwise.version import __version__

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
    "save_whole_model",
    "load_pretrained",
    "skip_weight_init",
    "QuantSettings",
    "quantize_model",
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
