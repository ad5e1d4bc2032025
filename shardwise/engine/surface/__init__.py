"""The torch-API surface of a sharded model: what a parameter and its gradient are to user code (``Piece``:
the whole tensor, this rank's elements inside, and its closed table of operations), the parameter factory
and gradient sink ``shard()`` hands the core, tensor hooks, direct gradients, the optimizer checks and the
swap to local parameters for the step, and what users put around the model (DDP, state dicts, saves, DCP)."""
