"""``shardwise train``: config -> launch -> data -> sharded model -> loop -> metrics and checkpoints.

Modules, one job each: ``config`` (TrainConfig, TOML + CLI parsing), ``hf_args`` (Hugging Face Trainer
flags), ``preflight`` (checks before workers start), ``launch`` (torchrun or self-launch), ``data`` (token
streams, per-rank step-indexed batches), ``jsonl_data`` (records -> ids + loss mask), ``token_cache``
(tokenised once per run directory), ``sources`` (which sampler), ``loss`` (masked loss across ranks),
``lora_model`` (``--lora-r``), ``schedule`` (learning rate), ``state`` (checkpoint save/restore),
``metrics`` (progress bar, log line, metrics.jsonl), ``plot`` (metrics.png), ``failures`` (one-line worker
errors), ``generate`` (sampling), ``loop`` (the training loop). ``--model`` is resolved by hf/model_spec.py.
"""

from shardwise.trainer.config import TrainConfig

__all__ = ["TrainConfig"]
