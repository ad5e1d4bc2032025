"""Sharded checkpoints: every rank writes its own pieces (safetensors + JSON, never pickle), any world size
and strategy can load them, a commit protocol makes crashes lose nothing, every load verifies the whole
checkpoint first (``verify``), and ``export`` writes a full model (the command and the model checks:
hf/export.py). See
docs/CHECKPOINTS.md, which also states the trust model."""

from shardwise.checkpoint.load import CheckpointInfo, checkpoint_info, load_checkpoint
from shardwise.checkpoint.manager import CheckpointManager, find_latest, list_checkpoints
from shardwise.checkpoint.save import save_checkpoint
from shardwise.checkpoint.verify import verify_checkpoint

__all__ = [
    "save_checkpoint",
    "load_checkpoint",
    "verify_checkpoint",
    "checkpoint_info",
    "CheckpointInfo",
    "CheckpointManager",
    "find_latest",
    "list_checkpoints",
]
