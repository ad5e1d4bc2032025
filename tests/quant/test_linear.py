"""``QuantLinear``'s matmul: each 4-bit weight is dequantised at most twice per step, with or without
activation checkpointing (forward once; the recompute's weight serves its own backward, else backward
dequantises once), gradients bit for bit those of the uncheckpointed model, the recompute's weights freed
with their unit's backward; and the dequantisation itself, in block groups of any size, gives the bits of
the whole-tensor reference (bitsandbytes' ``dequantize_4bit`` when installed), from tables built once."""

from __future__ import annotations

import copy
import gc
import weakref

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from bnb_oracle import bnb_quantize, require_bnb
from test_format import CASES
from shardwise.quant.experts import dequantization_counts, reset_dequantization_counts
from shardwise.quant.format import Layout4bit, byte_pairs, dequantize_blocks, quantize_4bit
from shardwise.quant.linear import QuantLinear, quantize_linears


class Block(nn.Module):
    """Two 4-bit Linears and a trainable adapter beside the first, as LoRA puts one."""

    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(64, 96), nn.Linear(96, 64, bias=False)
        self.adapter = nn.Linear(64, 96, bias=False)

    def forward(self, x):
        return self.down(torch.relu(self.up(x) + self.adapter(x)))


class Stack(nn.Module):
    """Three blocks, each checkpointed as ``mode`` says: None (not), "reentrant" or "non-reentrant"."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(3))
        self.mode = None

    def forward(self, x):
        for block in self.blocks:
            x = block(x) if self.mode is None else checkpoint(block, x, use_reentrant=self.mode == "reentrant")
        return x


def quantised_stack() -> Stack:
    torch.manual_seed(0)
    model = Stack()
    quantize_linears(model, skip=("adapter",))
    return model


MODES = [None, "reentrant", "non-reentrant"]


@pytest.mark.parametrize("mode", MODES)
def test_each_weight_is_dequantised_twice_per_step_and_the_gradient_is_unchanged(mode):
    reference, model = quantised_stack(), quantised_stack()
    model.mode = mode
    grads = []
    for m in (reference, model):
        x = torch.randn(5, 64, generator=torch.Generator().manual_seed(1), requires_grad=True)
        reset_dequantization_counts(m)
        m(x).square().sum().backward()
        grads.append(x.grad)
        assert dequantization_counts(m) == {f"blocks.{i}.{n}": 2 for i in range(3) for n in ("up", "down")}, mode
    assert torch.equal(grads[0], grads[1])


@pytest.mark.parametrize("mode", [None, "non-reentrant"])  # reentrant: no gradient without an input needing one
def test_a_weight_whose_input_needs_no_gradient_is_dequantised_only_to_compute(mode):
    model = quantised_stack()
    model.mode = mode
    reset_dequantization_counts(model)
    model(torch.randn(5, 64)).square().sum().backward()  # only the adapters need gradients
    counts = dequantization_counts(model)
    assert counts.pop("blocks.0.up") == (1 if mode is None else 2), counts  # forward (+ recompute), no backward
    assert set(counts.values()) == {2}, counts


@pytest.mark.parametrize("mode", MODES)
def test_no_weight_outlives_its_matmul_but_a_recomputed_one_its_blocks_backward(mode, monkeypatch):
    made = []
    dequantize = Layout4bit.dequantize

    def tracked(self, *args, **kwargs):
        w = dequantize(self, *args, **kwargs)
        made.append(weakref.ref(w))
        return w

    monkeypatch.setattr(Layout4bit, "dequantize", tracked)
    model = quantised_stack()
    alive = []
    x = torch.randn(5, 64, requires_grad=True)
    for block in model.blocks:  # checkpointed by hand so a hook sees each block's output gradient
        x = block(x) if mode is None else checkpoint(block, x, use_reentrant=mode == "reentrant")
        x.register_hook(lambda g: alive.append(sum(r() is not None for r in made)))
    x.sum().backward()
    gc.collect()
    # before each block's backward (its output's gradient hook), every weight dequantised so far is gone:
    # the forward's at once, the later block's recompute with its backward
    assert alive == [0, 0, 0] and all(r() is None for r in made)
    assert len(made) == 12  # forward 6, then the recomputes' 6 (none in their backward) or backward's 6


def test_a_forward_without_grad_saves_nothing_and_counts_once():
    model = quantised_stack()
    reset_dequantization_counts(model)
    with torch.no_grad():
        model(torch.randn(2, 64))
    assert set(dequantization_counts(model).values()) == {1}


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("chunk", [64, 192, 4096, None])
def test_dequantisation_in_block_groups_equals_the_whole_tensor_reference(case, chunk):
    torch.manual_seed(2)
    w = CASES[case]()
    for quant_type in ("nf4", "fp4"):
        for double_quant in (True, False):
            q = quantize_4bit(w, quant_type, double_quant)
            layout = Layout4bit(tuple(w.shape), w.dtype, quant_type, double_quant)
            stored = layout.to_bytes(q)
            for dtype in (torch.bfloat16, torch.float32):
                got = layout.dequantize(stored, dtype, chunk=chunk)
                assert torch.equal(got, q.dequantize(dtype)), (case, chunk, quant_type, double_quant, dtype)


@pytest.mark.parametrize("case", sorted(CASES))
def test_rounding_inside_the_multiply_gives_the_bits_of_rounding_afterwards(case):
    """Accelerators let the block multiply write the weight's dtype (one pass fewer); a CPU multiplies in fp32
    and converts. Both give the same bits, checked here on the CPU kernels of both ways."""
    torch.manual_seed(4)
    w = CASES[case]()
    q = quantize_4bit(w, "nf4", True)
    layout = Layout4bit(tuple(w.shape), w.dtype, "nf4", True)
    stored = layout.to_bytes(q)
    absmax = layout.absmax_fp32(stored["absmax"], stored["nested_absmax"], stored["offset"])
    pairs = byte_pairs("nf4", torch.device("cpu"))
    fp32 = dequantize_blocks(stored["weight"], absmax, pairs, layout.numel)
    for dtype in (torch.bfloat16, torch.float16):
        rounded = torch.empty(layout.numel, dtype=dtype)
        dequantize_blocks(stored["weight"], absmax, pairs, layout.numel, out=rounded)
        assert torch.equal(rounded.view(torch.int16), fp32.to(dtype).view(torch.int16)), (case, dtype)


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_matmul_weight_equals_bitsandbytes_dequantize_bit_for_bit(case):
    require_bnb()
    torch.manual_seed(3)
    w = CASES[case]().to(torch.bfloat16)
    for quant_type in ("nf4", "fp4"):
        layout = Layout4bit(tuple(w.shape), w.dtype, quant_type, True)
        got = layout.dequantize(layout.to_bytes(quantize_4bit(w, quant_type, True)), torch.bfloat16, chunk=128)
        theirs = bnb_quantize(w, quant_type, True)["dequantized"]
        if quant_type == "fp4" and w.shape[-1] % 2:
            got, theirs = got + 0.0, theirs + 0.0  # bitsandbytes' odd-width fallback: -0.0 as +0.0 (test_format)
        assert torch.equal(got.view(torch.int16), theirs.view(torch.int16)), (case, quant_type)


def test_dequantisation_builds_no_table_once_warm(monkeypatch):
    """The lookup tables are built once per device: a warm dequantisation never calls their builders."""
    import shardwise.quant.format as fmt

    q = QuantLinear.from_linear(nn.Linear(64, 32))
    for quant_type in ("nf4", "fp4"):
        q.layout.__class__(q.layout.shape, q.layout.dtype, quant_type).dequantize(q.stored(), torch.float32)
    want = q.dequantized_weight(torch.float32)

    def refuse(*_):
        raise AssertionError("a table was built for a warm dequantisation")

    monkeypatch.setattr(fmt, "decode_table", refuse)
    monkeypatch.setattr(fmt, "dynamic_map", refuse)
    assert torch.equal(q.dequantized_weight(torch.float32), want)


def test_counts_follow_a_deep_copy_apart():
    model = quantised_stack()
    other = copy.deepcopy(model)
    reset_dequantization_counts(model)
    with torch.no_grad():
        model(torch.randn(2, 64))
    assert set(dequantization_counts(model).values()) == {1}
    assert set(dequantization_counts(other).values()) == {0}


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@needs_cuda
def test_on_cuda_the_bits_are_the_cpus_and_no_table_is_built_once_warm(monkeypatch):
    _device_bits_and_tables(torch.device("cuda", torch.cuda.current_device()), monkeypatch)


def _device_bits_and_tables(device: torch.device, monkeypatch) -> None:
    import shardwise.quant.format as fmt

    torch.manual_seed(4)
    cases = []
    for case in sorted(CASES):
        w = CASES[case]().to(torch.bfloat16)
        for quant_type in ("nf4", "fp4"):
            layout = Layout4bit(tuple(w.shape), w.dtype, quant_type, True)
            stored = layout.to_bytes(quantize_4bit(w, quant_type))
            on_device = {k: v.to(device) for k, v in stored.items()}
            layout.dequantize(on_device, torch.bfloat16)  # warm: this type's tables now live on the device
            cases.append((layout, on_device, layout.dequantize(stored, torch.bfloat16)))
    monkeypatch.setattr(fmt, "decode_table", lambda *_: pytest.fail("a table was built for a warm dequantisation"))
    monkeypatch.setattr(fmt, "dynamic_map", lambda *_: pytest.fail("a table was built for a warm dequantisation"))
    for layout, on_device, on_cpu in cases:
        got = layout.dequantize(on_device, torch.bfloat16)
        assert got.device == device
        assert torch.equal(got.cpu().view(torch.int16), on_cpu.view(torch.int16))


@needs_cuda
@pytest.mark.parametrize("mode", MODES)
def test_on_cuda_each_weight_is_dequantised_twice_per_step_and_the_gradient_is_unchanged(mode):
    reference, model = quantised_stack().cuda(), quantised_stack().cuda()
    model.mode = mode
    grads = []
    for m in (reference, model):
        x = torch.randn(5, 64, generator=torch.Generator().manual_seed(1)).cuda().requires_grad_()
        reset_dequantization_counts(m)
        m(x).square().sum().backward()
        grads.append(x.grad)
        assert set(dequantization_counts(m).values()) == {2}, mode
    assert torch.equal(grads[0], grads[1])
