"""Mixed precision: fp32 master shards, gather and compute in ``param_dtype``, reduce in ``reduce_dtype``.

The cast happens on the shard *before* the all-gather (1/N of the bytes cast, half the bytes sent for bf16),
and gradients are cast up to ``reduce_dtype`` as they are packed for the reduce-scatter, so the sum over
ranks runs in full precision when asked to.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch

from shardwise.engine.base.nested import map_tensors


@dataclass(frozen=True)
class MixedPrecision:
    param_dtype: Optional[torch.dtype] = None
    """dtype parameters are gathered and computed in; None keeps each parameter's own dtype."""
    reduce_dtype: Optional[torch.dtype] = None
    """dtype gradients are summed across ranks in; None uses param_dtype (or the parameter's dtype)."""
    cast_forward_inputs: bool = True
    """Cast floating-point tensors passed to each unit's forward to param_dtype, so that fp32 inputs meet
    bf16 weights without a dtype error."""

    def compute_dtype(self, dtype: torch.dtype) -> torch.dtype:
        return self.param_dtype if (self.param_dtype is not None and dtype.is_floating_point) else dtype

    def grad_reduce_dtype(self, dtype: torch.dtype) -> torch.dtype:
        if self.reduce_dtype is not None and dtype.is_floating_point:
            return self.reduce_dtype
        return self.compute_dtype(dtype)


# The names the trainer's --mixed-precision and the planner take, and the policy each one means: gather and
# compute in the named dtype, reduce gradients in fp32 (a bf16 sum over many ranks loses the small terms).
NAMED_DTYPES: dict[str, Optional[torch.dtype]] = {"no": None, "bf16": torch.bfloat16, "fp16": torch.float16}


def named_policy(name: str) -> Optional[MixedPrecision]:
    """The policy ``--mixed-precision NAME`` means; None for "no" (every parameter computes in its own dtype)."""
    dtype = NAMED_DTYPES[name]
    return None if dtype is None else MixedPrecision(param_dtype=dtype, reduce_dtype=torch.float32)


def cast_floating(obj: Any, dtype: torch.dtype) -> Any:
    return map_tensors(obj, lambda t: t.to(dtype) if t.is_floating_point() and t.dtype != dtype else t)
