"""Adapters for the frameworks people already train with. Each module imports its framework, so import the
one you use (``shardwise.integrations.lightning`` for Lightning's Trainer and Fabric); nothing here is
imported by ``import shardwise``."""
