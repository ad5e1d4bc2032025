"""4-bit quantised frozen bases (QLoRA): bitsandbytes' NF4/FP4 format in PyTorch, and the Linear that computes
with it. A leaf layer: imports only torch and shardwise.errors."""
