"""``shardwise train``: config -> launch -> data -> sharded model -> loop -> metrics and checkpoints.

Modules, one job each: ``config`` (TrainConfig, TOML + CLI parsing), ``launch`` (torchrun or self-launch),
``data`` (token streams, per-rank step-indexed batches), ``model_factory`` / ``hf_model`` (presets and
Hugging Face configs), ``schedule`` (learning rate), ``state`` (checkpoint save/restore), ``metrics``
(progress bar, log line, metrics.jsonl), ``plot`` (metrics.png), ``loop`` (the training loop).
"""

from shardwise.trainer.config import TrainConfig

__all__ = ["TrainConfig"]
