"""The step: flat groups (gather, free, reduce), units (hooks, entries), the model-wide runtime. It takes its
user-facing parameters from one factory and hands gradients to one sink, both given by ``shard()``
(seams.py says what it asks of them), and imports nothing of ``engine.surface``."""
