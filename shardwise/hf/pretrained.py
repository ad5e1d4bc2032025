"""Pretrained Hugging Face weights into a sharded model: each rank reads only the bytes of its own shards.

Usage (the model is built on the meta device, so no rank ever holds it whole)::

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(DIR), dtype=torch.float32)
    shardwise.shard(model, param_init_fn=shardwise.skip_weight_init(model))   # no random init to overwrite
    shardwise.load_pretrained(model, DIR)

Three steps, every rank alike:

1. *Match* (no tensor data read): the files' tensor names are mapped to the model's as ``from_pretrained``
   maps them (transformers' own renaming rules: ``base_model_prefix`` stripped or added, legacy
   ``gamma``/``beta``, per-model renamings; see ``_hf_key_mapping``). A name that needs a weight *conversion*
   (fusing experts, splitting qkv) is refused: that needs whole tensors. (4-bit MoE experts keep the files'
   per-expert layout, so their names need none: ``quantized_load``.) Each parameter must come from the
   file with the exact shape; a tied parameter (GPT-2's and Qwen2's ``lm_head``) from any one of its names.
   A missing parameter is an error naming it; file tensors the model has no place for are named in a warning,
   as ``from_pretrained`` does.
2. *Read*: for every flat group, each parameter's local piece ``[lo, hi)`` of its flattened tensor is read
   with ``pread`` at its offset in the file, in the file's dtype, straight into the shard when the dtypes
   agree, else into a temporary of that piece's size and cast. Persistent buffers found in the file are read
   whole (buffers are not sharded); non-persistent ones (rotary ``inv_freq``) are what ``shard()``'s init
   computed, as in ``from_pretrained``.
3. *Agree*: every rank learns whether any rank failed (``checkpoint.agree``), so all raise together.

Peak extra memory per rank: one local piece of one tensor, and only when the file's dtype differs from the
master dtype (a bf16 file into fp32 masters).

[Note: skipping the random init] ``shard()`` on a meta model fills every shard, module by module, by running
the init on fresh full-size tensors of that module. ``skip_weight_init`` is a ``param_init_fn`` that leaves
parameters unwritten (``load_pretrained`` overwrites every one of them, or raises) and only initialises
modules that hold buffers, so that non-persistent buffers such as RoPE ``inv_freq`` come out as the model
computes them. The full-size temporaries are still allocated one module at a time, but never written, so
their pages are never touched.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from shardwise.engine.core.runtime import STATE_ATTR
from shardwise.engine.checks import agree
from shardwise.engine.base.device import on_host
from shardwise.engine.base.host_memory import release_freed_host_memory
from shardwise.errors import ShardwiseError
from shardwise.engine.hf_init import hf_param_init_fn, is_hf_model
from shardwise.hf.quantized_load import (COMPANIONS, QuantTarget, gather_absmax, load_prequantised, local_absmax,
                                         match_quantised, quant_targets, quantise_pieces, unsharded_quant_targets)
from shardwise.quant.experts import QUANT_MODULE_TYPES
from shardwise.hf.quantization import QuantSettings, check_quantised_model
from shardwise.engine.state_dict import persistent_buffers as engine_persistent_buffers
from shardwise.hf.weight_files import PretrainedWeights

Rename = Callable[[str], str | None]


@dataclass
class Target:
    """One tensor of the model to fill: a parameter (all its tied names) or a persistent buffer."""

    names: list[str]
    shape: tuple[int, ...]
    dtype: torch.dtype
    is_buffer: bool
    key: str | None = None  # the file tensor it is read from, once matched


def load_pretrained(model: nn.Module, directory: os.PathLike | str, *, rename: Rename | None = None,
                    quantization: "QuantSettings | None" = None) -> nn.Module:
    """Fill a ``shardwise.shard()``-ed model with the weights of Hugging Face model directory ``directory``
    (``model.safetensors``, or ``model-*.safetensors`` with ``model.safetensors.index.json``). Collective:
    call it on every rank, right after ``shard()`` and before training. Returns ``model``.

    ``rename`` maps a model name to the name it has in the checkpoint's model (before Hugging Face's own
    renaming rules), or None for a parameter the file does not hold and that keeps its ``shard()`` init
    (adapters added by peft, say). Default: none, and for a peft-wrapped model
    ``lora.pretrained_name``. Raises ShardwiseError on every rank, naming the file or tensor, for a
    directory without safetensors weights, a damaged file, a hostile index, a missing or misshapen weight.
    """
    runtime = getattr(model, STATE_ATTR, None)
    if runtime is None or getattr(runtime, "plan", None) is None:
        raise ShardwiseError(f"load_pretrained: {type(model).__name__} is not sharded; call shardwise.shard(model, "
                             f"param_init_fn=shardwise.skip_weight_init(model)) on the meta-built model first")
    if quantization is not None:
        check_quantised_model(model, quantization)
    what = f"loading weights from {directory}"
    unexpected, to_quantise = agree.agreed(lambda: _load(model, runtime, directory, rename), what)
    if to_quantise:  # 4-bit weights stored in high precision: see quantized_load.py
        gather_absmax(to_quantise)
        agree.agreed(lambda: _quantise_on_load(directory, to_quantise), what)
    release_freed_host_memory()  # the reads' and the quantiser's freed temporaries (engine/base/host_memory.py)
    runtime.shards_written()  # the reads move no version counter: ZeRO-1/2 refill their kept copies
    if unexpected and agree.rank() == 0:
        warnings.warn(f"{directory}: {len(unexpected)} tensor(s) in the files are not used by "
                      f"{type(model).__name__}: {', '.join(unexpected[:8])}{' ...' if len(unexpected) > 8 else ''}",
                      stacklevel=2)
    return model


def _load(model: nn.Module, runtime, directory, rename: Rename | None) -> tuple[list[str], list[QuantTarget]]:
    """Read every piece this rank owns; returns the unused file tensors and the 4-bit weights that still
    have to be quantised (after their absmax vectors are gathered)."""
    hf, prefix = _hf_model(model)
    rename = rename if rename is not None else _default_rename(model)
    quantised, covered = quant_targets(runtime, prefix, rename)
    specs = [spec for spec in runtime.plan.params() if id(spec) not in covered]
    params = [Target([r.fqn for r in spec.refs], tuple(spec.shape), spec.dtype, False) for spec in specs]
    targets = params + persistent_buffers(model)
    with PretrainedWeights(directory) as weights:
        unexpected = match(model, targets, weights, rename, claimed_names(quantised))
        if quantised:
            used = match_quantised(quantised, weights, _hf_key_mapping(hf, {t.name + ".weight" for t in quantised})[0])
            unexpected = [k for k in unexpected if k not in used]
        by_spec = {id(spec): t for spec, t in zip(specs, params)}
        with torch.no_grad():
            for unit in runtime.units:
                for group in unit.flat_groups:
                    for spec, (lo, hi, at) in zip(group.plan.params, group.local_slices):
                        target = by_spec.get(id(spec))
                        if target is None or target.key is None or hi <= lo:
                            continue
                        _read_piece(weights, target, lo, group.shard.narrow(0, at, hi - lo))
            for target in targets[len(params):]:
                if target.key is not None:
                    buf = model.get_buffer(target.names[0])
                    buf.copy_(weights.read(target.key).reshape(buf.shape))
            to_quantise = [t for t in quantised if not t.prequantised]
            for t in quantised:
                load_prequantised(weights, t) if t.prequantised else local_absmax(weights, t)
    return unexpected, to_quantise


@torch.no_grad()
def _quantise_on_load(directory, targets: list[QuantTarget]) -> None:
    with PretrainedWeights(directory) as weights:
        for t in targets:
            quantise_pieces(weights, t)


def _read_piece(weights: PretrainedWeights, target: Target, lo: int, dst: torch.Tensor) -> None:
    """Elements ``[lo, lo + dst.numel())`` of the target's file tensor into ``dst`` (a piece of a shard)."""
    info = weights.info(target.key)
    if dst.dtype == info.dtype and on_host(dst) and dst.is_contiguous():
        weights.read_into(target.key, lo, dst)  # no temporary at all
    else:
        tmp = torch.empty(dst.numel(), dtype=info.dtype)
        weights.read_into(target.key, lo, tmp)
        dst.copy_(tmp)


def persistent_buffers(model: nn.Module) -> list[Target]:
    """One target per persistent buffer tensor, under all of its names (a shared module's buffer once)."""
    by_id: dict[int, Target] = {}
    for name, b in engine_persistent_buffers(model):
        if id(b) in by_id:
            by_id[id(b)].names.append(name)
        else:
            by_id[id(b)] = Target([name], tuple(b.shape), b.dtype, True)
    return list(by_id.values())


def unsharded_targets(model: nn.Module) -> list[Target]:
    """The targets of a model that is not sharded (the launcher checks a meta model before workers start)."""
    by_id: dict[int, Target] = {}
    quantised = {id(p) for m in model.modules() if isinstance(m, QUANT_MODULE_TYPES) for n, p in m.named_parameters()
                 if n != "bias"}  # checked by check_loadable through quantized_load
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in quantised:
            continue
        if id(p) in by_id:
            by_id[id(p)].names.append(name)
        else:
            by_id[id(p)] = Target([name], tuple(p.shape), p.dtype, False)
    return list(by_id.values()) + persistent_buffers(model)


def check_loadable(model: nn.Module, directory: os.PathLike | str) -> None:
    """Everything ``load_pretrained`` checks before reading data, on an unsharded (meta) model: headers,
    index, names, shapes, dtypes. Raises ShardwiseError naming what is wrong."""
    with PretrainedWeights(directory) as weights:
        hf, prefix = _hf_model(model)
        targets = unsharded_quant_targets(model, prefix)
        match(model, unsharded_targets(model), weights, None, claimed_names(targets))
        if targets:
            match_quantised(targets, weights, _hf_key_mapping(hf, {t.name + ".weight" for t in targets})[0])


# ---- matching names -----------------------------------------------------------------------------------------


def claimed_names(quantised: list[QuantTarget]) -> set[str]:
    """The file names the 4-bit weights read (weights and their bitsandbytes companions): ``match`` leaves
    them to ``match_quantised``, even where transformers would convert them (per-expert MoE weights)."""
    return {t.name + ".weight" + suffix for t in quantised for suffix in ("",) + COMPANIONS}


def match(model: nn.Module, targets: list[Target], weights: PretrainedWeights, rename: Rename | None,
          claimed: set[str] = frozenset()) -> list[str]:
    """Set ``target.key`` for every target the file holds; raise for a missing parameter or a mismatch.
    Returns the file tensors nothing uses (after Hugging Face's ignore rules), ``claimed`` ones included."""
    hf, prefix = _hf_model(model)
    rename = rename if rename is not None else _default_rename(model)
    local: dict[str, Target] = {}  # the name in the HF model (after ``rename``) -> target
    for t in targets:
        for name in t.names:
            n = name[len(prefix):] if name.startswith(prefix) else None
            n = rename(n) if rename is not None and n is not None else n
            if n is not None:
                local[n] = t
    to_model, ignored = _hf_key_mapping(hf, set(local) | claimed)
    found: dict[int, list[str]] = {}
    unexpected = []
    for key in weights.where:
        model_key = to_model(key)
        if model_key not in local:
            if not ignored(model_key):  # from_pretrained matches its ignore patterns against renamed names
                unexpected.append(key)
            continue
        found.setdefault(id(local[model_key]), []).append(key)
    missing = []
    d = weights.directory
    for t in targets:
        keys = found.get(id(t), [])
        if not keys:
            if not t.is_buffer and any(n.startswith(prefix) and (rename is None or rename(n[len(prefix):]) is not None)
                                       for n in t.names):
                missing.append(" = ".join(t.names))
            continue
        for key in keys:
            info = weights.info(key)
            if info.shape != t.shape:
                raise ShardwiseError(f"{d}: tensor {key!r} has shape {list(info.shape)}, but {t.names[0]} of "
                                     f"{type(model).__name__} has {list(t.shape)}; a checkpoint of another config?")
            if info.dtype.is_floating_point != t.dtype.is_floating_point:
                raise ShardwiseError(f"{d}: tensor {key!r} is {info.dtype}, {t.names[0]} is {t.dtype}; refusing to "
                                     f"convert between floating-point and other dtypes")
        if len(keys) > 1:
            _check_tied_equal(weights, t, keys)
        t.key = keys[0]
    if missing:
        raise ShardwiseError(f"{d}: {len(missing)} weight(s) of {type(model).__name__} are not in the files: "
                             f"{', '.join(missing[:6])}{' ...' if len(missing) > 6 else ''}; a checkpoint of "
                             f"another architecture or config?")
    return sorted(unexpected)


def _default_rename(model: nn.Module) -> Rename | None:
    """A peft-wrapped model's base is read under the base model's names (``lora.pretrained_name``); its
    adapters are not in the files and keep their init."""
    from shardwise.hf.lora import is_peft_model, pretrained_name

    return pretrained_name if is_peft_model(model) else None


def _check_tied_equal(weights: PretrainedWeights, t: Target, keys: list[str], chunk: int = 1 << 20) -> None:
    """A tied parameter found under several names must hold the same values under each: ``from_pretrained``
    would untie them otherwise, which a model built with them tied cannot represent. Compared in chunks."""
    numel = 1
    for s in t.shape:
        numel *= s
    for start in range(0, numel, chunk):
        stop = min(numel, start + chunk)
        first = weights.read(keys[0], start, stop)
        for other in keys[1:]:
            if not torch.equal(first.to(torch.float64), weights.read(other, start, stop).to(torch.float64)):
                raise ShardwiseError(f"{weights.directory}: {keys[0]!r} and {other!r} hold different values, but the "
                                     f"model ties {' and '.join(t.names)}; set tie_word_embeddings=False in "
                                     f"config.json to train them apart")


def _hf_model(model: nn.Module) -> tuple[nn.Module, str]:
    """The Hugging Face model inside ``model`` (itself, or the first submodule that is one) and its name prefix.

    The class must define ``base_model_prefix`` itself: peft's wrappers forward unknown attributes to the model
    they wrap, so a ``PeftModelForCausalLM`` answers ``_init_weights`` and ``base_model_prefix`` too, and taking
    it for the Hugging Face model would ask the files for peft's names (``base_model.model.model...``)."""
    for name, m in model.named_modules():
        if is_hf_model(m) and hasattr(type(m), "base_model_prefix"):
            return m, f"{name}." if name else ""
    raise ShardwiseError(f"load_pretrained: {type(model).__name__} holds no Hugging Face model "
                         f"(transformers PreTrainedModel); it loads Hugging Face model directories only")


def _hf_key_mapping(hf: nn.Module, model_keys: set[str]) -> tuple[Callable[[str], str], Callable[[str], bool]]:
    """(file name -> model name, "is this unused file name one from_pretrained ignores silently").

    Uses transformers' own rules (checked with transformers 5.23: ``conversion_mapping.get_model_conversion_mapping``,
    ``core_model_loading.rename_source_key``, and the ignore patterns of ``_adjust_missing_and_unexpected_keys``),
    so the names come out exactly as ``from_pretrained`` maps them. Without them (older transformers) only the
    ``base_model_prefix`` rule applies."""
    import re

    prefix = getattr(hf, "base_model_prefix", "") or ""
    present = dict.fromkeys(model_keys, True)
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import (
            WeightConverter,
            WeightRenaming,
            rename_source_key,
        )
    except ImportError:
        get_model_conversion_mapping = None

    if get_model_conversion_mapping is not None:
        mapping = get_model_conversion_mapping(hf)
        renamings = [m for m in mapping if isinstance(m, WeightRenaming)]
        converters = [m for m in mapping if isinstance(m, WeightConverter)]

        def to_model(key: str) -> str:
            renamed, pattern = rename_source_key(key, renamings, converters, prefix or None, present)
            if renamed not in present and key in present:  # as from_pretrained: the key needed no renaming
                renamed, pattern = key, None
            if pattern is not None:  # a model that keeps the files' layout (4-bit MoE experts) needs no conversion
                kept = key
                for renaming in renamings:
                    kept = renaming.rename_source_key(kept)[0]
                renamed, pattern = (kept, None) if kept in present else (renamed, pattern)
            if pattern is not None:
                raise ShardwiseError(f"tensor {key!r} needs transformers' weight conversion {pattern!r} (fusing or "
                                     f"splitting tensors) to load into {type(hf).__name__}; load_pretrained reads "
                                     f"tensors as stored and does not support that")
            return renamed
    else:
        def to_model(key: str) -> str:
            if prefix and key.startswith(prefix + ".") and key[len(prefix) + 1:] in present:
                return key[len(prefix) + 1:]
            if prefix and f"{prefix}.{key}" in present:
                return f"{prefix}.{key}"
            return key

    patterns = set(getattr(hf, "_keys_to_ignore_on_load_unexpected", None) or [])
    if any(k.endswith("rotary_emb.inv_freq") for k in model_keys) or any(
            n.endswith("rotary_emb.inv_freq") for n, _ in hf.named_buffers()):
        patterns.add(r"rotary_emb\.inv_freq")
    if any(n.endswith("position_ids") for n, _ in hf.named_buffers()):
        patterns.add(r"(^|\.)position_ids$")
    regex = re.compile("|".join(f"({p})" for p in patterns)) if patterns else None
    return to_model, (lambda key: regex is not None and regex.search(key) is not None)


# ---- shard() without a random init --------------------------------------------------------------------------


def skip_weight_init(model: nn.Module) -> Callable[[nn.Module], None]:
    """``param_init_fn`` for ``shardwise.shard`` when ``load_pretrained`` follows: see [Note: skipping the random
    init]. Modules holding buffers are initialised as usual (HF ``_init_weights``, else ``reset_parameters``)."""
    inits: dict[torch.device, Callable[[nn.Module], None]] = {}

    def init(module: nn.Module) -> None:
        if not any(b is not None for b in module._buffers.values()):
            return  # parameters only: load_pretrained writes every one of them
        device = next((b.device for b in module._buffers.values() if b is not None and not b.is_meta),
                      torch.device("cpu"))
        if is_hf_model(model):
            if device not in inits:
                inits[device] = hf_param_init_fn(model, device)
            inits[device](module)
        elif hasattr(module, "reset_parameters"):
            module.reset_parameters()

    init.leaves_parameters_unwritten = True  # shard()'s meta init does not refuse the parameters it skips
    return init
