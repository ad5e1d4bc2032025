"""Reference models used by the trainer, the tests and the benchmarks."""

from shardwise.models.gpt import GPT, GPTConfig, GPTOutput, Block, PRESETS

__all__ = ["GPT", "GPTConfig", "GPTOutput", "Block", "PRESETS"]
