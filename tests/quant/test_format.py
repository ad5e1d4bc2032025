"""shardwise's 4-bit format is bitsandbytes' own: quantisation equal to bitsandbytes 0.50.2 on CPU byte for
byte, dequantisation bit for bit, including the corner cases where implementations differ (partial blocks,
odd element counts, all-zero blocks, values on and one ulp either side of every code midpoint)."""

from __future__ import annotations

import os

import pytest
import torch
from safetensors.torch import load_file

from bnb_oracle import bnb_quantize, require_bnb
from shardwise.errors import ShardwiseError
from shardwise.quant.codebooks import code_bounds, sorted_code_index
from shardwise.quant.format import (absmax_offset, quantize_4bit, quantize_absmax, quantize_blocks,
                                    pack_nibbles)

GOLDEN = os.path.join(os.path.dirname(__file__), "golden_nf4.safetensors")


def _ulps_around(values: torch.Tensor) -> torch.Tensor:
    up, down = torch.nextafter(values, torch.tensor(2.0)), torch.nextafter(values, torch.tensor(-2.0))
    return torch.stack([down, values, up], dim=1).reshape(-1)


def midpoint_weight(quant_type: str) -> torch.Tensor:
    """Every code midpoint and one ulp either side, in blocks whose absmax is exactly 1 (so the scaled value
    is the value itself), plus a partial last block that scales by division."""
    mids = _ulps_around(code_bounds(quant_type)[0])  # 45 values
    block = torch.cat([torch.tensor([1.0]), mids, torch.zeros(18)])
    neg = torch.cat([torch.tensor([-1.0]), -mids, torch.zeros(18)])
    return torch.cat([block, neg, block[:50] * 0.75]).reshape(1, -1)


def corner_weight() -> torch.Tensor:
    """Partial last block, odd element count, an all-zero block, denormals, and more than 256 blocks (so
    double quantisation has a partial nested block)."""
    torch.manual_seed(0)
    w = torch.randn(3, 64 * 200 + 13)
    w.view(-1)[64 * 5: 64 * 6] = 0.0
    w.view(-1)[64 * 7: 64 * 7 + 3] = torch.tensor([1e-40, -3e-39, 2e-45])
    return w


def constant_absmax_weight() -> torch.Tensor:
    """Every block's absmax equals the mean, so every double-quantised value is 0: all-zero nested blocks."""
    return torch.sign(torch.randn(64 * 300 + 64)).reshape(-1, 64)


CASES = {
    "odd_numel": lambda: torch.randn(37, 65),
    "corners": corner_weight,
    "constant_absmax": constant_absmax_weight,
    "midpoints_nf4": lambda: midpoint_weight("nf4"),
    "midpoints_fp4": lambda: midpoint_weight("fp4"),
    "zero_partial_block": lambda: torch.cat([torch.randn(64 * 3), torch.zeros(10)]).reshape(2, -1),
}


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}[t.dtype])


def assert_same_bytes(ours, theirs: dict, label: str) -> None:
    assert torch.equal(ours.packed, theirs["packed"]), f"{label}: packed bytes differ"
    assert torch.equal(ours.absmax, theirs["absmax"]), f"{label}: absmax differs"
    assert torch.equal(ours.quant_map, theirs["quant_map"]), f"{label}: quant_map differs"
    if "offset" in theirs:
        assert torch.equal(ours.nested_absmax, theirs["nested_absmax"]), f"{label}: nested_absmax differs"
        assert torch.equal(ours.nested_quant_map, theirs["nested_quant_map"]), f"{label}: nested map differs"
        assert torch.equal(_bits(ours.offset), _bits(theirs["offset"])), f"{label}: offset differs"
    ours_dq, theirs_dq = ours.dequantize(), theirs["dequantized"]
    if ours.quant_type == "fp4" and ours.shape[-1] % 2:
        # FP4 code 8 decodes to -0.0 in bitsandbytes' C++ and CUDA kernels (and here); its PyTorch fallback,
        # taken for an odd last dimension, gives +0.0. Every other bit must agree.
        ours_dq, theirs_dq = ours_dq + 0.0, theirs_dq + 0.0
    assert torch.equal(_bits(ours_dq), _bits(theirs_dq)), f"{label}: dequantised bits differ"


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_nf4_and_fp4_equal_bitsandbytes_byte_for_byte(case, dtype):
    require_bnb()
    torch.manual_seed(1)
    w = CASES[case]().to(dtype)
    for quant_type in ("nf4", "fp4"):
        for double_quant in (True, False):
            label = f"{case} {dtype} {quant_type} double_quant={double_quant}"
            assert_same_bytes(quantize_4bit(w, quant_type, double_quant), bnb_quantize(w, quant_type, double_quant),
                              label)


@pytest.mark.parametrize("quant_type", ["nf4", "fp4"])
def test_the_cell_lookup_finds_the_same_code_as_a_search_over_the_midpoints(quant_type):
    """The quantiser's look-up (``sorted_code_index``) against ``torch.bucketize`` over the midpoints, what
    bitsandbytes runs: every fp32 value within 2,048 ulps of each midpoint, each cell edge, +-1, +-0 and
    values just past +-1, and a million uniform values."""
    bounds = code_bounds(quant_type)[0]
    near = [bounds]
    up = down = bounds
    for _ in range(2048):
        up, down = torch.nextafter(up, torch.tensor(2.0)), torch.nextafter(down, torch.tensor(-2.0))
        near += [up, down]
    edges = torch.linspace(-1, 1, 4097)
    edges = torch.cat([edges, torch.nextafter(edges, torch.tensor(2.0)), torch.nextafter(edges, torch.tensor(-2.0))])
    special = torch.tensor([1.0, -1.0, 0.0, -0.0, 1.0000001, -1.0000001, 1e-38, -1e-38])
    values = torch.cat(near + [edges, special, torch.empty(1 << 20).uniform_(-1, 1)])
    expected = torch.bucketize(values, bounds, out_int32=True).to(torch.uint8)
    assert torch.equal(sorted_code_index(values, quant_type), expected)


def test_double_quantisation_equals_bitsandbytes_cpu_kernel_on_table_boundaries():
    """The nested absmax goes through bitsandbytes' C++ 65,536-entry table: values on every table step where
    the code changes, and 16 ulps either side, in blocks scaled by exactly 1."""
    require_bnb()
    from shardwise.quant.format import _dynamic_lut

    code, lut = _dynamic_lut()
    steps = (torch.nonzero(lut[1:] != lut[:-1]).flatten() + 1).double()
    centre = ((steps - 0.5) / 65535 * 2 - 1).float()
    values = [centre]
    up = down = centre
    for _ in range(16):
        up, down = torch.nextafter(up, torch.tensor(2.0)), torch.nextafter(down, torch.tensor(-2.0))
        values += [up, down]
    values = torch.cat(values).clamp(-1, 1)
    rows = -(-values.numel() // 255)
    body = torch.cat([values, torch.zeros(rows * 255 - values.numel())]).view(rows, 255)
    blocks = torch.cat([torch.ones(rows, 1), body], dim=1)
    theirs, their_absmax = torch.ops.bitsandbytes.quantize_blockwise(blocks.view(-1), code, 256)
    ours, our_absmax = quantize_absmax(blocks.view(-1), torch.tensor(0.0))
    assert torch.equal(our_absmax, their_absmax)
    assert torch.equal(ours, theirs)


def test_golden_fixture_without_bitsandbytes():
    """Bytes bitsandbytes 0.50.2 wrote for fixed inputs (make_golden.py), checked with or without it."""
    golden = load_file(GOLDEN)
    for prefix in sorted({k.split("/")[0] for k in golden}):
        w = golden[f"{prefix}/input"]
        quant_type, dq = prefix.split("_")[1], prefix.endswith("dq")
        theirs = {k.split("/")[1]: v for k, v in golden.items() if k.startswith(prefix + "/") and k != f"{prefix}/input"}
        theirs["offset"] = theirs["offset"].reshape(()) if "offset" in theirs else None
        if theirs["offset"] is None:
            del theirs["offset"]
        assert_same_bytes(quantize_4bit(w, quant_type, dq), theirs, prefix)


def test_a_slice_on_block_boundaries_quantises_to_the_same_bytes_as_in_the_whole_tensor():
    """What lets each rank quantise only what it owns: first-level blocks of 64 and nested blocks of 256
    start at element 0, so whole blocks quantise alone (given the tensor-global offset)."""
    w = corner_weight().view(-1)
    codes, absmax = quantize_blocks(w)
    record = 64 * 256
    part_codes, part_absmax = quantize_blocks(w[record: 2 * record + 640])
    assert torch.equal(pack_nibbles(part_codes), pack_nibbles(codes)[record // 2: (2 * record + 640) // 2])
    assert torch.equal(part_absmax, absmax[256: 256 * 2 + 10])
    offset = absmax_offset(absmax)
    q_all, nested_all = quantize_absmax(absmax, offset)
    q_part, nested_part = quantize_absmax(absmax[256:512], offset)
    assert torch.equal(q_part, q_all[256:512]) and torch.equal(nested_part, nested_all[1:2])


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_weights_are_refused_naming_the_tensor(bad):
    w = torch.randn(4, 64)
    w[2, 3] = bad
    with pytest.raises(ShardwiseError, match=r"^layers\.0\.q_proj\.weight: cannot quantise .*NaN or inf"):
        quantize_4bit(w, name="layers.0.q_proj.weight")


def test_unknown_quant_type_is_refused():
    with pytest.raises(ShardwiseError, match="quant_type must be 'nf4' or 'fp4', got 'int4'"):
        quantize_4bit(torch.randn(64), "int4")
