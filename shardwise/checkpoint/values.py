"""Pickle-free encoding of the plain Python values a trainer keeps beside the model (``extra``) and of
optimizer hyperparameters: JSON for the structure and the scalars, safetensors for every tensor.

Encoded forms (anything else is refused at save time, naming where it sits in the structure)::

    None, bool, int, float, str     as themselves (floats round-trip exactly; nan/inf allowed)
    list                            JSON array
    tuple                           {"__tuple__": [...]}          so random.getstate() comes back as a tuple
    dict with str keys              JSON object                   ({"__dict__": [[k, v], ...]} when a key is
                                                                   not a str or starts with "__")
    torch.Tensor                    {"__tensor__": KEY}           bytes in the rank's safetensors file
    numpy.ndarray                   {"__ndarray__": KEY}          stored as a tensor (np.random.get_state())
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from shardwise.errors import ShardwiseError

TensorSink = Callable[[str, torch.Tensor], str]  # (path in the structure, tensor) -> storage key
TensorSource = Callable[[str], torch.Tensor]  # storage key -> tensor

_MARKERS = ("__tuple__", "__dict__", "__tensor__", "__ndarray__")


def encode(value: Any, sink: TensorSink, path: str = "extra") -> Any:
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, torch.Tensor):
        return {"__tensor__": sink(path, value)}
    try:
        import numpy as np
    except ImportError:  # pragma: no cover - numpy is a dependency
        np = None
    if np is not None:
        if isinstance(value, np.ndarray):
            return {"__ndarray__": sink(path, torch.from_numpy(value.copy()))}
        if isinstance(value, np.generic):
            return value.item()
    if isinstance(value, list):
        return [encode(v, sink, f"{path}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, tuple):
        return {"__tuple__": [encode(v, sink, f"{path}[{i}]") for i, v in enumerate(value)]}
    if isinstance(value, dict):
        if all(isinstance(k, str) and not k.startswith("__") for k in value):
            return {k: encode(v, sink, f"{path}.{k}") for k, v in value.items()}
        return {"__dict__": [[encode(k, sink, f"{path}<key>"), encode(v, sink, f"{path}[{k!r}]")]
                             for k, v in value.items()]}
    raise ShardwiseError(
        f"cannot store {path} of type {type(value).__name__} in a checkpoint: only None, bool, int, float, str, "
        f"list, tuple, dict, torch.Tensor and numpy.ndarray are kept (no pickle); convert it first"
    )


def decode(value: Any, source: TensorSource) -> Any:
    if isinstance(value, list):
        return [decode(v, source) for v in value]
    if isinstance(value, dict):
        if len(value) == 1:
            (marker, inner), = value.items()
            if marker == "__tuple__":
                return tuple(decode(v, source) for v in inner)
            if marker == "__dict__":
                return {_hashable(decode(k, source)): decode(v, source) for k, v in inner}
            if marker == "__tensor__":
                return source(inner)
            if marker == "__ndarray__":
                return source(inner).numpy()
        return {k: decode(v, source) for k, v in value.items()}
    return value


def _hashable(key: Any) -> Any:
    return tuple(_hashable(k) for k in key) if isinstance(key, list) else key


def tensor_refs(value: Any) -> list[str]:
    """Every storage key an encoded value refers to."""
    out: list[str] = []

    def walk(v: Any) -> None:
        if isinstance(v, list):
            for x in v:
                walk(x)
        elif isinstance(v, dict):
            if len(v) == 1 and next(iter(v)) in ("__tensor__", "__ndarray__"):
                out.append(next(iter(v.values())))
            else:
                for x in v.values():
                    walk(x)

    walk(value)
    return out


def encode_scalar_tensor(t: torch.Tensor) -> dict:
    """A 0-d tensor as JSON: exact for every dtype (float32 -> Python float -> float32 is lossless)."""
    from shardwise.checkpoint.format import dtype_name

    return {"dtype": dtype_name(t.dtype), "value": t.item()}


def decode_scalar_tensor(entry: dict, where: str) -> torch.Tensor:
    from shardwise.checkpoint.format import dtype_from_name

    return torch.tensor(entry["value"], dtype=dtype_from_name(entry["dtype"], where))
