"""Activation memory, measured: the model's real forward and loss run on meta tensors under
``saved_tensors_hooks``, counting every distinct storage autograd keeps for backward, so any architecture
(GPT presets, Llama, Qwen2, GPT-2 ...) is measured rather than guessed at. A forward that cannot run on
meta falls back to the textbook formula.

The forward runs with two process-wide patches, installed only for its duration (``_meta_friendly_forward``):
``F.scaled_dot_product_attention`` as the memory-efficient kernels run it, and Hugging Face's
``masking_utils.is_tracing`` answering True. Third-party warnings raised meanwhile are silenced for the
same span (``quiet_libraries``): the command's output is the plan.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import warnings
from dataclasses import dataclass
from typing import Optional, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

# Libraries that log (rather than warn) about optional kernels on import: bitsandbytes, imported by peft.
_CHATTY_LOGGERS = ("bitsandbytes",)


@contextlib.contextmanager
def quiet_libraries():
    """Silence the deprecation warnings and optional-kernel notices transformers, peft and bitsandbytes
    raise while a meta model is built and run; they concern those libraries, not the plan."""
    loggers = [logging.getLogger(name) for name in _CHATTY_LOGGERS]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)


def _flash_like_sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    """SDPA as the memory-efficient kernels run it (saving q, k, v, output and logsumexp). On meta, plain
    SDPA takes the math path and would count a (T x T) attention matrix no fused kernel ever stores.
    Private op ``aten._scaled_dot_product_flash_attention_for_cpu`` (checked on torch 2.11 and 2.13): the
    one public-API-free way to get the fused kernel's saved tensors on meta."""
    if key.size(-3) != query.size(-3):  # grouped-query attention: kernels see the repeated heads
        rep = query.size(-3) // key.size(-3)
        key, value = key.repeat_interleave(rep, dim=-3), value.repeat_interleave(rep, dim=-3)
    out = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        query, key, value, dropout_p, is_causal or attn_mask is not None, scale=scale)
    return out[0]


@contextlib.contextmanager
def _meta_friendly_forward():
    """Patches for the duration of the meta forward: memory-efficient SDPA, and Hugging Face's mask helpers
    told they are being traced, so they skip data-dependent checks (``.all()`` on a meta tensor has no value)."""
    patches = [(F, "scaled_dot_product_attention", _flash_like_sdpa)]
    masking = sys.modules.get("transformers.masking_utils")
    if masking is not None and hasattr(masking, "is_tracing"):
        patches.append((masking, "is_tracing", lambda *args, **kwargs: True))
    originals = [(obj, name, getattr(obj, name)) for obj, name, _ in patches]
    for obj, name, value in patches:
        setattr(obj, name, value)
    try:
        yield
    finally:
        for obj, name, value in originals:
            setattr(obj, name, value)


@dataclass
class ActivationProfile:
    saved_bytes: int  # everything autograd keeps from one forward
    largest_saved: int  # the largest single saved storage (sizes the backward working set)
    unit_saved: list[int]  # per checkpointed unit (the blocks): bytes saved inside it
    unit_input: list[int]  # per checkpointed unit: bytes of its tensor inputs (what checkpointing keeps)
    method: str = "measured: forward on meta tensors"

    def peak(self, checkpointing: bool, transient: int = 0, recomputed: Sequence[int] = ()) -> int:
        """Activation bytes at their peak, backward working set included.

        Without checkpointing: everything saved by the end of the forward, plus the gradient flowing into
        the widest saved activation and the one flowing out of it. With checkpointing, the larger of the
        end of the forward (each unit's inputs + what is saved outside units + that working set) and the
        recompute of the largest unit in backward (every unit's input + that unit's saved tensors; the
        loss and head tensors are gone by then, and the unit's own backward frees as it goes).
        ``transient``: bytes briefly alive beside them in forward and backward (a 4-bit matrix dequantised
        for its matmul); ``recomputed``: per unit, bytes its recompute keeps for its backward instead (its
        dequantised 4-bit weights), beside its saved tensors."""
        return max(self.phases(checkpointing, transient, recomputed))

    def phases(self, checkpointing: bool, transient: int = 0, recomputed: Sequence[int] = ()) -> tuple[int, int]:
        """``peak``'s two candidates apart: (the end of the forward, the largest unit's recompute; 0 without
        checkpointing). They come at different times, beside different gathered units: the end of the forward
        beside the last units of the forward (a head unit among them), a recompute beside two blocks."""
        working = 2 * self.largest_saved
        if not (checkpointing and self.unit_saved):
            return self.saved_bytes + working + transient, 0
        outside = self.saved_bytes - sum(self.unit_saved)
        inputs = sum(self.unit_input)
        recompute = max(saved + (recomputed[i] if recomputed else 0) for i, saved in enumerate(self.unit_saved))
        return outside + inputs + working + transient, inputs + recompute


def measure_activations(spec, model: nn.Module, unit_modules: list[nn.Module], batch_size: int, seq_len: int,
                        cast_to: Optional[torch.dtype], itemsize: int) -> ActivationProfile:
    """The activation profile of one forward + loss with the floating parameters cast to ``cast_to`` (None:
    each keeps its own dtype): measured on meta, or the formula at ``itemsize`` bytes per element when the
    model's forward cannot run there (data-dependent code)."""
    try:
        with quiet_libraries(), _cast_for_forward(model, cast_to):
            return _profile(spec, model, unit_modules, batch_size, seq_len)
    except Exception:  # noqa: BLE001 -- any failure of a third-party forward on meta means "use the formula"
        return formula_activations(spec, len(unit_modules), batch_size, seq_len, itemsize)


@contextlib.contextmanager
def _cast_for_forward(model: nn.Module, dtype: Optional[torch.dtype]):
    """Floating parameters in the compute dtype for the forward, then back: the meta model is cached and
    planned again, and its dtypes are part of the plan (peft keeps LoRA adapters in fp32 beside a bf16 base)."""
    originals = [(p, p.dtype) for p in model.parameters() if dtype is not None and p.is_floating_point()]
    for p, _ in originals:
        p.data = p.data.to(dtype)
    try:
        yield
    finally:
        for p, original in originals:
            p.data = p.data.to(original)


def _profile(spec, model: nn.Module, unit_modules: list[nn.Module], batch_size: int, seq_len: int) -> ActivationProfile:
    from shardwise.hf.model_spec import lm_loss

    param_storages = {p.untyped_storage()._cdata for p in model.parameters()}
    seen: dict[int, int] = {}
    unit_seen: list[dict[int, int]] = [dict() for _ in unit_modules]
    unit_input = [0 for _ in unit_modules]
    active: list[int] = []

    def pack(t: torch.Tensor):
        s = t.untyped_storage()
        key = s._cdata
        if key not in param_storages:
            seen[key] = s.nbytes()
            if active:
                unit_seen[active[-1]][key] = s.nbytes()
        return t

    hooks = []
    for i, m in enumerate(unit_modules):
        def pre(mod, args, kwargs, i=i):
            active.append(i)
            unit_input[i] += sum(a.untyped_storage().nbytes() for a in list(args) + list(kwargs.values())
                                 if isinstance(a, torch.Tensor) and a.is_floating_point())

        def post(mod, args, kwargs, out, i=i):
            active.pop()

        hooks.append(m.register_forward_pre_hook(pre, with_kwargs=True))
        hooks.append(m.register_forward_hook(post, with_kwargs=True))
    idx = torch.zeros(batch_size, seq_len, dtype=torch.long, device="meta")
    try:
        with _meta_friendly_forward(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            lm_loss(spec, model, idx, idx)
    finally:
        for h in hooks:
            h.remove()
    return ActivationProfile(sum(seen.values()), max(seen.values(), default=0),
                             [sum(d.values()) for d in unit_seen], unit_input)


def formula_activations(spec, num_units: int, batch_size: int, seq_len: int, itemsize: int) -> ActivationProfile:
    """The textbook count (Korthikanti et al. 2022, without the attention matrix that fused kernels never
    store): about 34·b·s·h bytes per layer at 2 bytes per element, i.e. 17 elements per token and hidden
    unit, plus the fp32 log-softmax of the logits."""
    per_layer = 17 * batch_size * seq_len * spec.hidden * itemsize
    logits = batch_size * seq_len * spec.vocab_size * 4
    layer_input = batch_size * seq_len * spec.hidden * itemsize
    n = max(num_units, 1)
    return ActivationProfile(per_layer * spec.n_layer + logits, max(logits, 4 * layer_input),
                             [per_layer * spec.n_layer // n] * num_units, [layer_input] * num_units,
                             method="formula: 34·b·s·h bytes per layer (the forward could not run on meta)")
