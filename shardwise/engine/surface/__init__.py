"""The torch-API surface of a sharded model: what a parameter and its gradient are to user code (pieces,
``ShardParam``), the parameter factory and gradient sink ``shard()`` hands the core, tensor hooks, direct
gradients, the optimizer checks, and what users put around the model (DDP, state dicts, DCP)."""
