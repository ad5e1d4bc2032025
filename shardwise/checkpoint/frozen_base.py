"""Checkpoints without their frozen parameters (LoRA: only the adapters, their optimizer state and
``extra``): the manifest's ``frozen_base`` records whose frozen parameters they are, so that a load can
refuse a model whose frozen parameters came from anywhere else.

The record is what the caller gives ``save_checkpoint(frozen_base=...)``: ``source`` (where the weights
are read from, for messages and for ``export --merge``) and ``weights_sha256`` (their identity, e.g.
``shardwise.hf.weight_files.weights_identity``), plus the dtype the frozen parameters had when saved,
which save adds. A 4-bit base adds ``quantization``: how the weights were quantised (a JSON object the
caller chooses, e.g. ``QuantSettings.to_dict()``), since the same file quantised otherwise is another base;
a record without it is of a base held in high precision. A load is given the same kind of record for the
model it loads into, after the caller has filled the frozen parameters itself (``shardwise.load_pretrained``);
only ``weights_sha256``, ``quantization`` and the dtype must agree (a moved directory is the same base).
"""

from __future__ import annotations

import re
from typing import Any

from shardwise.errors import ShardwiseError

_SHA256 = re.compile(r"^[0-9a-f]{64}$")
KEYS = ("source", "weights_sha256")
OPTIONAL = ("quantization",)


def base_record(source: str, weights_sha256: str, quantization: dict | None = None) -> dict:
    """What ``save_checkpoint(frozen_base=...)`` and ``load_checkpoint(frozen_base=...)`` take;
    ``quantization``: a 4-bit base's settings (None: held in high precision)."""
    record = {"source": str(source), "weights_sha256": weights_sha256}
    if quantization is not None:
        record["quantization"] = dict(quantization)
    check_record(record, "frozen_base")
    return record


def quantization_of(record: dict) -> dict | None:
    """The quantisation settings a record names (None: a high-precision base, or a record older than 4-bit
    bases, which were all high precision)."""
    return record.get("quantization")


def check_record(record: Any, where: str, saved: bool = False) -> None:
    """Raise ShardwiseError naming ``where`` unless ``record`` is a record of this form (``saved``: as stored
    in a manifest, with the dtype save adds)."""
    keys = set(KEYS) | ({"dtype"} if saved else set())
    if not isinstance(record, dict) or not keys <= set(record) <= keys | set(OPTIONAL):
        raise ShardwiseError(f"{where}: expected an object with exactly {', '.join(sorted(keys))} (and optionally "
                             f"{', '.join(OPTIONAL)})")
    if not isinstance(record.get("quantization", {}), dict):
        raise ShardwiseError(f"{where}.quantization: expected an object")
    if not isinstance(record["source"], str) or not 0 < len(record["source"]) <= 4096:
        raise ShardwiseError(f"{where}.source: expected a path of at most 4096 characters")
    if not isinstance(record["weights_sha256"], str) or not _SHA256.match(record["weights_sha256"]):
        raise ShardwiseError(f"{where}.weights_sha256: expected 64 lowercase hex digits")
    if saved and record["dtype"] is not None and not isinstance(record["dtype"], str):
        raise ShardwiseError(f"{where}.dtype: expected a dtype name or null")


def mismatch(saved: dict, given: dict | None, model_dtype: str | None) -> str | None:
    """Why a model whose frozen parameters are ``given`` (in ``model_dtype``) cannot take a checkpoint that
    omits the frozen parameters of ``saved``; None if it can."""
    short = saved["weights_sha256"][:12]
    if given is None:
        return (f"holds only the trainable parameters; its frozen ones are the weights of {saved['source']} "
                f"(identity {short}...), and this load was given no frozen base: load that base into the model "
                f"first and pass its record as frozen_base")
    if given["weights_sha256"] != saved["weights_sha256"]:
        return (f"holds only the trainable parameters, trained over the weights of {saved['source']} (identity "
                f"{short}...); the model's frozen weights come from {given['source']} (identity "
                f"{given['weights_sha256'][:12]}...), another base")
    if quantization_of(saved) != quantization_of(given):
        return (f"its frozen base was quantised as {_quantization_text(saved)}, the model's as "
                f"{_quantization_text(given)}; the trained adapters belong to the base as it was quantised")
    if saved["dtype"] is not None and model_dtype is not None and saved["dtype"] != model_dtype:
        return (f"its frozen base was held in {saved['dtype']}, the model holds it in {model_dtype}; the "
                f"trained adapters belong to the base in {saved['dtype']}")
    return None


def _quantization_text(record: dict) -> str:
    q = quantization_of(record)
    return "none (high precision)" if q is None else ", ".join(f"{k}={v}" for k, v in sorted(q.items()))
