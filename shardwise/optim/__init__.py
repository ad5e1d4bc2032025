"""Optimizers that need more than the local shard of a parameter: ``Muon`` (whole matrices)."""

from shardwise.optim.muon import Muon, adjusted_lr, default_use_muon

__all__ = ["Muon", "default_use_muon", "adjusted_lr"]
