"""bitsandbytes' 4-bit weight format (NF4 / FP4, block size 64, optional double quantisation), in PyTorch.

This is shardwise's source of truth for the bytes of a quantised base: loading quantises with it, the
engine dequantises with it, and tests compare it byte for byte with bitsandbytes 0.50.2 on CPU. The layout
is bitsandbytes' own, so a Hugging Face pre-quantised checkpoint loads by copy:

* ``packed``: uint8 ``[ceil(n / 2)]``, the weight flattened row-major, element ``2i`` in the high nibble of
  byte ``i`` (a zero nibble pads an odd ``n``).
* ``absmax``: one scale per block of 64 elements (the last block may be partial). With double quantisation
  it is uint8 ``[blocks]``: ``absmax - offset`` quantised to the 8-bit dynamic map in blocks of 256, with
  ``nested_absmax`` fp32 ``[ceil(blocks / 256)]`` and ``offset`` (the fp32 mean of all first-level absmax
  values, a tensor-global scalar). Without it, fp32 ``[blocks]``.

Quantisation follows bitsandbytes 0.50.2 on CPU exactly (where its output is deterministic):

* First level (its pure-PyTorch "default" op): scale full blocks by the fp32 reciprocal of the block absmax
  (clamped to >= 1e-38, so an all-zero block gets NF4 code 7, which dequantises to +0.0), the partial last
  block by dividing by its absmax, clamp to [-1, 1], code = number of midpoints strictly below the value.
* Double quantisation (its C++ CPU kernel): a 65,536-entry table from the scaled value to the nearest
  dynamic-map entry; the table index is ``trunc(fma(((v + 1) * 0.5), 65535, 0.5))`` in fp32 (the kernel is
  built with FMA contraction), and an all-zero 256-block gets code 0 with nested absmax 0.
  bitsandbytes' CUDA kernels differ in places (approximate reciprocals, zero blocks, binary search): bytes
  quantised on a GPU load fine, they are just not reproduced here.

NaN or inf weights are refused: bitsandbytes would encode them as garbage scales for their whole block.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Optional

import torch

from shardwise.errors import ShardwiseError
from shardwise.quant.codebooks import (check_quant_type, code_bounds, code_table, decode_table, dynamic_map,
                                      sorted_code_index)

BLOCKSIZE = 64
NESTED_BLOCKSIZE = 256
_LUT_SIZE = 65536
_TINY_ABSMAX = 1e-38  # bitsandbytes' clamp before taking the reciprocal
# Elements Layout4bit.dequantize decodes per pass: on a CPU few enough that the pass's temporaries (12 bytes
# per two elements) stay in cache, on an accelerator enough that kernel launches are few (one H100: a
# [2048, 5632] bf16 matrix took 0.58 ms in 2^22-element passes, 0.25 ms in one 2^24 pass writing bf16;
# 96 MiB of temporaries at most).
DEQUANT_CHUNK = 1 << 16
ACCELERATOR_DEQUANT_CHUNK = 1 << 24


@dataclass
class Quantized4bit:
    """One quantised weight: bitsandbytes' tensors and the fields of its ``quant_state`` JSON."""

    packed: torch.Tensor
    absmax: torch.Tensor
    quant_map: torch.Tensor
    shape: torch.Size
    dtype: torch.dtype  # what dequantisation returns (bitsandbytes' quant_state "dtype")
    quant_type: str = "nf4"
    blocksize: int = BLOCKSIZE
    nested_absmax: Optional[torch.Tensor] = None
    nested_quant_map: Optional[torch.Tensor] = None
    offset: Optional[torch.Tensor] = None  # fp32 scalar
    nested_blocksize: int = NESTED_BLOCKSIZE

    @property
    def double_quant(self) -> bool:
        return self.nested_absmax is not None

    @property
    def numel(self) -> int:
        return self.shape.numel()

    def absmax_fp32(self) -> torch.Tensor:
        if not self.double_quant:
            return self.absmax
        return dequantize_absmax(self.absmax, self.nested_absmax, self.offset, self.nested_quant_map,
                                 self.nested_blocksize)

    def dequantize(self, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        flat = dequantize_blocks(self.packed, self.absmax_fp32(), byte_pairs(self.quant_type, self.packed.device),
                                 self.numel, self.blocksize)
        return flat.reshape(self.shape).to(dtype or self.dtype)


def dequant_chunk(device_type: str) -> int:
    """Elements ``Layout4bit.dequantize`` decodes per pass on a device of this type."""
    return DEQUANT_CHUNK if device_type == "cpu" else ACCELERATOR_DEQUANT_CHUNK


@lru_cache(maxsize=None)
def byte_pairs(quant_type: str, device: torch.device) -> torch.Tensor:
    """int64 ``[256]``: byte ``b`` -> the fp32 values of its two codes, ``(t[b >> 4], t[b & 15])``, side by
    side in one 8-byte element (``t``: ``decode_table``), so one 1-D gather per byte yields both values (4x
    faster on a CPU than gathering rows of a ``[256, 2]`` table). Built once per quant type and device: on
    CUDA one host-to-device copy in all, none per dequantisation. Shared: never written."""
    table = decode_table(quant_type)
    pairs = torch.stack([table.repeat_interleave(16), table.repeat(16)], dim=1).contiguous()
    return pairs.view(torch.int64).view(-1).to(device)


@lru_cache(maxsize=None)
def dynamic_map_on(device: torch.device) -> torch.Tensor:
    """``dynamic_map()`` on ``device``, built once per device. Shared: never written."""
    return dynamic_map().to(device)


def num_blocks(numel: int, blocksize: int = BLOCKSIZE) -> int:
    return -(-numel // blocksize)


def check_finite(w: torch.Tensor, name: str) -> None:
    if not bool(torch.isfinite(w).all()):
        raise ShardwiseError(f"{name}: cannot quantise to 4 bits: the tensor holds NaN or inf")


def block_absmax(w: torch.Tensor, blocksize: int = BLOCKSIZE) -> torch.Tensor:
    """fp32 ``[blocks]``: each block's largest magnitude (``w`` flattened). A partial last block's is clamped
    to >= 1e-38 as bitsandbytes stores it (a full block's is stored unclamped, 0.0 for an all-zero block)."""
    flat = w.reshape(-1).float()
    full = flat.numel() - flat.numel() % blocksize
    absmax = flat[:full].view(-1, blocksize).abs().amax(dim=-1)
    if full < flat.numel():
        absmax = torch.cat([absmax, flat[full:].abs().amax().clamp(min=_TINY_ABSMAX).unsqueeze(0)])
    return absmax


def quantize_blocks(w: torch.Tensor, quant_type: str = "nf4", blocksize: int = BLOCKSIZE,
                    absmax: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """First-level quantisation of ``w`` (any shape, flattened): (4-bit codes uint8 ``[n]``, ``n`` rounded up
    to even with the code of 0.0 as bitsandbytes pads; fp32 absmax ``[blocks]``). Blocks start at element 0
    of ``w``, so a slice starting on a block boundary quantises to the same codes and scales as the same
    elements inside the whole tensor. ``absmax``: the blocks' ``block_absmax`` when already known (loading
    computes it first for double quantisation's offset)."""
    flat = w.reshape(-1).float()
    n = flat.numel()
    full = n - n % blocksize
    absmax = block_absmax(flat, blocksize) if absmax is None else absmax
    # clamp(min=1e-38) as bitsandbytes does before the reciprocal; no clamp of the scaled values to [-1, 1]
    # is needed: every midpoint lies inside, so the code of a value past +-1 is that of +-1.
    scaled = (flat[:full].view(-1, blocksize) * (1.0 / absmax[: full // blocksize].clamp(min=_TINY_ABSMAX))
              .view(-1, 1)).view(-1)
    if full < n:
        scaled = torch.cat([scaled, flat[full:] / absmax[-1]])
    if n % 2:
        scaled = torch.nn.functional.pad(scaled, (0, 1))
    codes = sorted_code_index(scaled, quant_type)
    if quant_type != "nf4":
        codes = code_bounds(quant_type)[1].to(torch.uint8).index_select(0, codes.to(torch.int32))
    return codes, absmax


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes ``[2m]`` -> bytes ``[m]``, element 2i in the high nibble."""
    return (codes[::2] << 4) | codes[1::2]


def unpack_nibbles(packed: torch.Tensor, numel: int) -> torch.Tensor:
    out = torch.empty(packed.numel() * 2, dtype=torch.int32, device=packed.device)
    out[::2] = packed >> 4
    out[1::2] = packed & 0xF
    return out[:numel]


def absmax_offset(absmax: torch.Tensor) -> torch.Tensor:
    """Double quantisation's ``offset``: the fp32 mean of the *whole* tensor's first-level absmax, computed by
    the same torch reduction bitsandbytes uses (so a sharded loader must gather the vector first)."""
    return absmax.mean()


@lru_cache(maxsize=None)
def _dynamic_lut() -> tuple[torch.Tensor, torch.Tensor]:
    """bitsandbytes' CPU table (cpu_ops.cpp ``build_quantize_lut``): index i stands for the fp32 value
    ``-1 + (2i) / 65535`` and holds the number of dynamic-map midpoints strictly below it."""
    code = dynamic_map()
    midpoints = 0.5 * (code[:-1] + code[1:])
    values = -1.0 + (2.0 * torch.arange(_LUT_SIZE, dtype=torch.float32)) / float(_LUT_SIZE - 1)
    return code, torch.bucketize(values, midpoints, right=False).to(torch.uint8)


def _lut_index(scaled: torch.Tensor) -> torch.Tensor:
    """``(uint16)((v + 1) * 0.5 * 65535 + 0.5)`` with the last multiply-add fused (one fp32 rounding): the
    float64 product and sum are exact here (a 24-bit by 16-bit product, >= 2^-9 when non-zero), so rounding
    them once to fp32 is the FMA's result."""
    half = (scaled.clamp(-1.0, 1.0) + 1.0) * 0.5
    fused = (half.double() * float(_LUT_SIZE - 1) + 0.5).float()
    return fused.to(torch.int64)  # non-negative: truncation is floor


def quantize_absmax(absmax: torch.Tensor, offset: torch.Tensor, nested_blocksize: int = NESTED_BLOCKSIZE
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """Double quantisation: (uint8 codes ``[blocks]``, fp32 nested absmax ``[ceil(blocks / 256)]``) of
    ``absmax - offset``. Nested blocks start at absmax element 0, so whole 256-blocks quantise alone."""
    _, lut = _dynamic_lut()
    shifted = absmax.float() - offset
    n = shifted.numel()
    padded = torch.nn.functional.pad(shifted, (0, num_blocks(n, nested_blocksize) * nested_blocksize - n))
    blocks = padded.view(-1, nested_blocksize)
    nested = blocks.abs().amax(dim=-1)
    scaled = blocks * (1.0 / nested.clamp(min=_TINY_ABSMAX)).view(-1, 1)
    codes = lut[_lut_index(scaled)]
    codes[nested == 0] = 0  # the kernel skips an all-zero block: codes 0, nested absmax 0
    return codes.reshape(-1)[:n].contiguous(), nested


def dequantize_absmax(codes: torch.Tensor, nested_absmax: torch.Tensor, offset: torch.Tensor,
                      nested_quant_map: torch.Tensor, nested_blocksize: int = NESTED_BLOCKSIZE) -> torch.Tensor:
    """fp32 first-level absmax back from double quantisation: ``map[code] * nested_absmax[b // 256] + offset``."""
    values = nested_quant_map.index_select(0, codes.to(torch.int32))
    return _scale_blocks(values, nested_absmax, nested_blocksize) + offset


def dequantize_blocks(packed: torch.Tensor, absmax: torch.Tensor, pairs: torch.Tensor, numel: int,
                      blocksize: int = BLOCKSIZE, index: Optional[torch.Tensor] = None,
                      values: Optional[torch.Tensor] = None, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``[numel]``: ``table[code] * absmax[block]`` computed in fp32 for the bytes ``packed`` (``pairs``:
    ``byte_pairs``). One gather per byte (half the index work of unpacking the nibbles first), one multiply
    per block. ``index`` (int32) and ``values`` (int64), at least ``packed.numel()`` long: buffers to work in.
    ``out``: where the products go, in any floating dtype (each fp32 product rounded to nearest even, the
    bits of ``.to(dtype)`` afterwards, without the extra pass); without it, fp32 in place in ``values``."""
    m = packed.numel()
    index = packed.to(torch.int32) if index is None else index[:m].copy_(packed)
    values = pairs.index_select(0, index) if values is None else torch.index_select(pairs, 0, index, out=values[:m])
    products = values.view(torch.float32)[:numel]
    return _scale_blocks(products, absmax, blocksize, products if out is None else out)


def _scale_blocks(values: torch.Tensor, scales: torch.Tensor, blocksize: int,
                  out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``out[i] = values[i] * scales[i // blocksize]`` (``out`` defaults to ``values``: in place), without
    materialising the repeated scales."""
    out = values if out is None else out
    n = values.numel()
    full = n - n % blocksize
    if full:
        torch.mul(values[:full].view(-1, blocksize), scales[: full // blocksize].view(-1, 1),
                  out=out[:full].view(-1, blocksize))
    if full < n:
        torch.mul(values[full:], scales[full // blocksize], out=out[full:])
    return out


def quantize_4bit(w: torch.Tensor, quant_type: str = "nf4", double_quant: bool = True,
                  blocksize: int = BLOCKSIZE, name: str = "tensor") -> Quantized4bit:
    """Quantise a floating-point weight to bitsandbytes' 4-bit format (the dequantisation dtype is ``w``'s)."""
    check_quant_type(quant_type, name)
    if not w.is_floating_point() or w.numel() == 0:
        raise ShardwiseError(f"{name}: only non-empty floating-point tensors quantise to 4 bits, got "
                             f"{w.dtype} {list(w.shape)}")
    check_finite(w, name)
    codes, absmax = quantize_blocks(w.detach().cpu(), quant_type, blocksize)
    q = Quantized4bit(pack_nibbles(codes), absmax, code_table(quant_type), w.shape, w.dtype, quant_type,
                      blocksize)
    if double_quant:
        q.offset = absmax_offset(absmax)
        q.absmax, q.nested_absmax = quantize_absmax(absmax, q.offset)
        q.nested_quant_map = dynamic_map()
    return q


# ---- the byte layout a sharded module stores ----------------------------------------------------------------


@dataclass(frozen=True)
class Layout4bit:
    """What a quantised weight's stored bytes mean (replicated metadata; the bytes themselves are sharded).
    Every tensor is kept as uint8 so that no float cast can ever reach it: ``packed`` (the nibbles),
    ``absmax`` (uint8 codes with double quantisation, else the fp32 scales' bytes), ``nested_absmax`` (fp32
    bytes) and ``offset`` (4 fp32 bytes); the last two are empty without double quantisation."""

    shape: tuple[int, ...]
    dtype: torch.dtype  # the original weight's dtype (bitsandbytes' quant_state "dtype")
    quant_type: str = "nf4"
    double_quant: bool = True
    blocksize: int = BLOCKSIZE

    @property
    def numel(self) -> int:
        return int(torch.Size(self.shape).numel())

    @property
    def blocks(self) -> int:
        return num_blocks(self.numel, self.blocksize)

    def nbytes(self) -> dict[str, int]:
        """Byte count of each stored tensor, by parameter name."""
        if not self.double_quant:
            return {"weight": -(-self.numel // 2), "absmax": 4 * self.blocks, "nested_absmax": 0, "offset": 0}
        return {"weight": -(-self.numel // 2), "absmax": self.blocks,
                "nested_absmax": 4 * num_blocks(self.blocks, NESTED_BLOCKSIZE), "offset": 4}

    def to_bytes(self, q: Quantized4bit) -> dict[str, torch.Tensor]:
        """The stored uint8 tensors of a quantised weight (checked against this layout)."""
        if (tuple(q.shape), q.quant_type, q.double_quant, q.blocksize) != \
                (self.shape, self.quant_type, self.double_quant, self.blocksize):
            raise ShardwiseError(f"quantised weight {list(q.shape)} {q.quant_type} double_quant={q.double_quant} "
                                 f"does not fit layout {list(self.shape)} {self.quant_type} "
                                 f"double_quant={self.double_quant}")
        out = {"weight": q.packed, "absmax": _as_bytes(q.absmax)}
        out["nested_absmax"] = _as_bytes(q.nested_absmax) if q.double_quant else torch.empty(0, dtype=torch.uint8)
        out["offset"] = _as_bytes(q.offset.reshape(1)) if q.double_quant else torch.empty(0, dtype=torch.uint8)
        return out

    def absmax_fp32(self, absmax: torch.Tensor, nested_absmax: torch.Tensor, offset: torch.Tensor) -> torch.Tensor:
        if not self.double_quant:
            return _fp32(absmax)
        return dequantize_absmax(absmax, _fp32(nested_absmax), _fp32(offset), dynamic_map_on(absmax.device))

    def dequantize(self, stored: dict[str, torch.Tensor], dtype: torch.dtype,
                   chunk: Optional[int] = None) -> torch.Tensor:
        """The weight in ``dtype`` from its stored bytes: fp32 ``code * absmax`` rounded to nearest even, the
        same bits as bitsandbytes' ``dequantize_4bit``. One pass of a few whole-tensor operations per group of
        ``chunk`` elements (``dequant_chunk`` of the device by default; whole blocks, no Python per block),
        in two buffers reused from group to group, so the fp32 transients stay small next to the result even
        for a 28,672 x 8,192 matrix. Nothing waits on the device: the tables are cached there."""
        weight = stored["weight"]
        if weight.is_meta:  # shapes only (the memory planner's forward)
            return torch.empty(self.shape, dtype=dtype, device="meta")
        absmax = self.absmax_fp32(stored["absmax"], stored["nested_absmax"], stored["offset"])
        pairs = byte_pairs(self.quant_type, weight.device)
        n, blocksize = self.numel, self.blocksize
        chunk = chunk or dequant_chunk(weight.device.type)
        step = max(blocksize, chunk - chunk % blocksize)  # whole blocks, so every group starts on a byte
        round_in_multiply = weight.device.type != "cpu"
        index = values = None  # one group: nothing to reuse, dequantize_blocks allocates its own
        if n > step:
            index = torch.empty(-(-step // 2), dtype=torch.int32, device=weight.device)
            values = torch.empty(-(-step // 2), dtype=torch.int64, device=weight.device)
        out = torch.empty(n, dtype=dtype, device=weight.device)
        for lo in range(0, n, step):
            hi = min(lo + step, n)
            group = (weight[lo // 2: -(-hi // 2)], absmax[lo // blocksize:], pairs, hi - lo, blocksize, index, values)
            if round_in_multiply:  # one pass fewer over the fp32 products (H100, [2048, 5632]: 0.32 -> 0.25 ms)
                dequantize_blocks(*group, out=out[lo:hi])
            else:  # a CPU's multiply into a narrower dtype is slower than in place + copy (8.2 vs 7.9 ms, one core)
                out[lo:hi] = dequantize_blocks(*group)
        return out.view(self.shape)


def _fp32(stored: torch.Tensor) -> torch.Tensor:
    """fp32 values from stored bytes: a view where they start 4-byte aligned, else a copy (a parameter's bytes
    inside a gathered flat buffer can start at any byte offset; the scales are 1/64 of the weight or less).
    Read at once by the dequantisation, never kept."""
    if stored.storage_offset() % 4 == 0 and stored.is_contiguous():
        return stored.view(torch.float32)
    return stored.clone().view(torch.float32)


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)
