"""The fixed value tables of bitsandbytes' 4-bit formats, and the bucket boundaries quantisation uses.

The 16-entry NF4 and FP4 tables are hard-coded fp32 values (bitsandbytes 0.50 ``get_4bit_type``), not
regenerated: recomputing NF4's normal quantiles with scipy gives -0.69619304 for entry 1 where bitsandbytes
stores -0.6961928. The 256-entry signed dynamic map of double quantisation is rebuilt with the exact float
operations of ``bitsandbytes.functional.create_dynamic_map`` (fp32 linspace, fp32 means, a Python-float scale),
so it equals the ``nested_quant_map`` bitsandbytes writes; the golden fixture in tests/quant pins it.
"""

from __future__ import annotations

from functools import lru_cache

import torch

from shardwise.errors import ShardwiseError

QUANT_TYPES = ("nf4", "fp4")

_NF4 = (
    -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
    -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
    0.07958029955625534, 0.16093020141124725, 0.24611230194568634, 0.33791524171829224,
    0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0,
)
# FP4 (e2m1 with bitsandbytes' scaling): index bit 3 is the sign, so the table is not sorted and holds 0 twice.
_FP4 = (
    0.0, 0.0052083334885537624, 0.6666666865348816, 1.0, 0.3333333432674408, 0.5, 0.1666666716337204, 0.25,
    0.0, -0.0052083334885537624, -0.6666666865348816, -1.0, -0.3333333432674408, -0.5, -0.1666666716337204,
    -0.25,
)


def check_quant_type(quant_type: str, what: str = "quant_type") -> str:
    if quant_type not in QUANT_TYPES:
        raise ShardwiseError(f"{what}: 4-bit quant_type must be 'nf4' or 'fp4', got {quant_type!r}")
    return quant_type


def code_table(quant_type: str) -> torch.Tensor:
    """The 16 fp32 values a 4-bit code stands for (a fresh tensor: callers may store it)."""
    return torch.tensor(_NF4 if check_quant_type(quant_type) == "nf4" else _FP4, dtype=torch.float32)


def decode_table(quant_type: str) -> torch.Tensor:
    """The values dequantisation multiplies by. Equal to ``code_table`` except FP4 code 8 (sign bit set,
    magnitude 0), which bitsandbytes' CPU and CUDA kernels decode as -0.0 although its table holds +0.0."""
    table = code_table(quant_type)
    if quant_type == "fp4":
        table[8] = -0.0
    return table


@lru_cache(maxsize=None)
def _code_bounds(quant_type: str) -> tuple[torch.Tensor, torch.Tensor]:
    code = code_table(quant_type)
    # torch.argsort exactly as bitsandbytes calls it, so FP4's two zeros are ordered the same way.
    order = torch.argsort(code)
    return (code[order[:-1]] + code[order[1:]]) / 2, order


def code_bounds(quant_type: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(midpoints between consecutive sorted codes, sort order): a scaled value takes the sorted index
    ``count(midpoints < value)`` (ties go to the lower code), then ``order`` maps it back to the code."""
    return _code_bounds(check_quant_type(quant_type))


CODE_CELLS = 1 << 12  # cells of the quantiser's look-up over [-1, 1]: each holds at most one midpoint


def code_cell(scaled: torch.Tensor) -> torch.Tensor:
    """int32 ``trunc((v + 1) * CODE_CELLS / 2)``: a monotone (non-decreasing) function of the scaled value
    (fp32 add rounds monotonically, the multiply by a power of two is exact), so ``v <= m`` implies
    ``cell(v) <= cell(m)``. Values past [-1, 1] land in cell 0 or ``CODE_CELLS``."""
    return (scaled + 1.0).mul_(CODE_CELLS // 2).to(torch.int32)


@lru_cache(maxsize=None)
def _code_search(quant_type: str) -> tuple[torch.Tensor, torch.Tensor]:
    bounds, _ = _code_bounds(quant_type)
    cells = code_cell(bounds).tolist()
    if len(set(cells)) != len(cells):
        raise AssertionError(f"{quant_type}: two code midpoints share a look-up cell; raise CODE_CELLS")
    below = torch.zeros(CODE_CELLS + 1, dtype=torch.uint8)
    midpoint = torch.full((CODE_CELLS + 1,), float("inf"))
    for j, c in enumerate(cells):
        below[c + 1:] += 1
        midpoint[c] = bounds[j]
    return below, midpoint


def sorted_code_index(scaled: torch.Tensor, quant_type: str) -> torch.Tensor:
    """uint8 ``count(midpoints < v)`` for fp32 ``scaled`` (``torch.bucketize(scaled, midpoints)``, exactly,
    at a tenth of its cost): a midpoint in a lower cell than ``v``'s is below ``v`` and one in a higher cell
    above it (``code_cell`` is monotone), so only the at most one midpoint in ``v``'s own cell needs a
    compare: ``below[cell] + (v > midpoint[cell])`` (``midpoint`` is +inf in cells without one)."""
    below, midpoint = _code_search(check_quant_type(quant_type))
    cell = code_cell(scaled)
    return below.index_select(0, cell).add_(scaled > midpoint.index_select(0, cell))


def dynamic_map() -> torch.Tensor:
    """bitsandbytes' signed 8-bit dynamic map (``create_dynamic_map(signed=True)``): 256 sorted fp32 values."""
    data: list[float] = []
    non_sign_bits, max_exponent_bits = 7, 7
    for i in range(max_exponent_bits):
        boundaries = torch.linspace(0.1, 1, 2 ** (i + non_sign_bits - max_exponent_bits) + 1, dtype=torch.float32)
        means = (boundaries[:-1] + boundaries[1:]) / 2.0
        scale = 10 ** (-(max_exponent_bits - 1) + i)
        data += (scale * means).tolist()
        data += (-scale * means).tolist()
    data += [0.0, 1.0]
    return torch.tensor(sorted(data), dtype=torch.float32)
