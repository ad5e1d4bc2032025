"""The memory planner behind ``shardwise estimate-memory``: what each rank holds at its peak, from the engine's
own sharding plan built on meta tensors (no processes, no memory)."""
