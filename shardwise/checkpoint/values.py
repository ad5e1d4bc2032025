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
MAX_DEPTH = 64


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


def check_encoded(value: Any, where: str, tensors_allowed: bool, _depth: int = 0) -> list[str]:
    """Check that ``value`` is something ``encode`` could have produced (so ``decode`` cannot fail on it),
    and return the tensor keys it refers to. Raises ShardwiseError naming ``where``."""
    if _depth > MAX_DEPTH:
        raise ShardwiseError(f"{where}: nested more than {MAX_DEPTH} levels deep")
    if value is None or isinstance(value, (bool, int, float, str)):
        return []
    if isinstance(value, list):
        return [k for i, v in enumerate(value) for k in check_encoded(v, f"{where}[{i}]", tensors_allowed, _depth + 1)]
    if not isinstance(value, dict):  # pragma: no cover - JSON has no other types
        raise ShardwiseError(f"{where}: {type(value).__name__} is not a JSON value")
    marked = [k for k in value if k.startswith("__")]
    if not marked:
        return [k for key, v in value.items() for k in check_encoded(v, f"{where}.{key}", tensors_allowed, _depth + 1)]
    if len(value) != 1 or marked[0] not in _MARKERS:
        raise ShardwiseError(f"{where}: an object with key {marked[0][:40]!r} must be one of the markers "
                             f"{', '.join(_MARKERS)}, alone")
    (marker, inner), = value.items()
    if marker in ("__tensor__", "__ndarray__"):
        if not tensors_allowed:
            raise ShardwiseError(f"{where}: refers to a tensor, which is not allowed here")
        if not isinstance(inner, str):
            raise ShardwiseError(f"{where}: {marker} must name a tensor key")
        return [inner]
    if not isinstance(inner, list):
        raise ShardwiseError(f"{where}: {marker} must hold a JSON array")
    if marker == "__tuple__":
        return check_encoded(inner, where, tensors_allowed, _depth + 1)
    keys = []
    for i, pair in enumerate(inner):
        if not isinstance(pair, list) or len(pair) != 2:
            raise ShardwiseError(f"{where}.__dict__[{i}]: expected a [key, value] pair")
        _check_hashable(pair[0], f"{where}.__dict__[{i}][0]")
        keys += check_encoded(pair[1], f"{where}.__dict__[{i}][1]", tensors_allowed, _depth + 1)
    return keys


def _check_hashable(key: Any, where: str, depth: int = 0) -> None:
    """A dict key must decode to something hashable: a scalar, or tuples and lists of scalars."""
    if depth > MAX_DEPTH:
        raise ShardwiseError(f"{where}: nested more than {MAX_DEPTH} levels deep")
    if key is None or isinstance(key, (bool, int, float, str)):
        return
    items = key["__tuple__"] if isinstance(key, dict) and set(key) == {"__tuple__"} else key
    if not isinstance(items, list):
        raise ShardwiseError(f"{where}: a dictionary key must be a scalar or a tuple of scalars")
    for i, item in enumerate(items):
        _check_hashable(item, f"{where}[{i}]", depth + 1)


def decode(value: Any, source: TensorSource) -> Any:
    """The inverse of ``encode``; checkpoints run ``check_encoded`` first, so this cannot fail on them."""
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
                t = source(inner)
                try:
                    return t.numpy()
                except TypeError:  # bfloat16 and friends: only a hand-edited checkpoint gets here
                    raise ShardwiseError(f"tensor {inner!r} is {t.dtype}, which a numpy array cannot hold") from None
        return {k: decode(v, source) for k, v in value.items()}
    return value


def _hashable(key: Any) -> Any:
    return tuple(_hashable(k) for k in key) if isinstance(key, list) else key


def encode_scalar_tensor(t: torch.Tensor) -> dict:
    """A 0-d tensor as JSON: exact for every dtype (float32 -> Python float -> float32 is lossless)."""
    from shardwise.checkpoint.format import dtype_name

    return {"dtype": dtype_name(t.dtype), "value": t.item()}


def decode_scalar_tensor(entry: dict, where: str) -> torch.Tensor:
    """The inverse of ``encode_scalar_tensor`` (the schema has checked that the value fits the dtype)."""
    from shardwise.checkpoint.format import dtype_from_name

    return torch.tensor(entry["value"], dtype=dtype_from_name(entry["dtype"], where))
