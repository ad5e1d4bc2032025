"""Tensors inside the nested values that flow through forward: arguments and outputs of any shape.

One place that knows how to look inside a value, for casting inputs (mixed precision) and for finding the
output tensors whose gradients start a unit's backward. Outputs come as tensors, tuples, named tuples,
dicts (Hugging Face ``ModelOutput``), dataclasses or plain objects holding tensors in attributes.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Iterator, Optional

import torch
import torch.nn as nn

_MAX_DEPTH = 16  # an output is a few levels deep; a cycle or a huge object graph stops here

_LEAVES = (str, bytes, int, float, bool, complex, type, nn.Module)


def _children(obj: Any) -> Optional[list]:
    if isinstance(obj, dict):
        return list(obj.values())
    if isinstance(obj, (list, tuple, set, frozenset)):
        return list(obj)
    if dataclasses.is_dataclass(obj):
        return [getattr(obj, f.name, None) for f in dataclasses.fields(obj)]
    if hasattr(obj, "__dict__"):
        return list(vars(obj).values())
    slots = getattr(type(obj), "__slots__", None)
    if slots:
        return [getattr(obj, s, None) for s in ((slots,) if isinstance(slots, str) else slots)]
    return None


def iter_tensors(obj: Any) -> Iterator[torch.Tensor]:
    """Every tensor reachable from ``obj`` (each container visited once)."""
    seen: set[int] = set()
    stack = [(obj, 0)]
    while stack:
        x, depth = stack.pop()
        if isinstance(x, torch.Tensor):
            yield x
            continue
        if x is None or isinstance(x, _LEAVES) or depth >= _MAX_DEPTH or id(x) in seen:
            continue
        seen.add(id(x))
        children = _children(x)
        if children:
            stack.extend((c, depth + 1) for c in reversed(children))


def map_tensors(obj: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """Apply ``fn`` to every tensor in nested tuples/lists/dicts (named tuples and dict subclasses kept);
    other objects are passed through as they are."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        return type(obj)(*(map_tensors(x, fn) for x in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(map_tensors(x, fn) for x in obj)
    if isinstance(obj, dict):
        out = {k: map_tensors(v, fn) for k, v in obj.items()}
        try:
            return type(obj)(**out) if type(obj) is not dict else out
        except TypeError:
            return out
    return obj
