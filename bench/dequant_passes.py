"""One 4-bit matrix's dequantisation on a device, four ways: the block multiply writing the weight's dtype
(``fused=True``) or multiplying the fp32 products in place and copying them (``fused=False``), in groups of
2^22 or 2^24 elements; each checked bit for bit against the whole-tensor reference first.

    python bench/dequant_passes.py            # CUDA
    python bench/dequant_passes.py cpu        # the same on a CPU (one thread)
"""
import sys
import time

import torch

from shardwise.quant import format as F

dev = torch.device(sys.argv[1] if len(sys.argv) > 1 else "cuda")
if dev.type == "cpu":
    torch.set_num_threads(1)


def synchronize():
    if dev.type == "cuda":
        torch.cuda.synchronize()


torch.manual_seed(0)
for shape in [(2048, 2048), (2048, 5632)]:
    w = torch.randn(shape) * 0.02
    q = F.quantize_4bit(w)
    lay = F.Layout4bit(shape, torch.bfloat16)
    st = {k: v.to(dev) for k, v in lay.to_bytes(q).items()}
    ref = q.dequantize(torch.bfloat16).to(dev)
    absmax = lay.absmax_fp32(st["absmax"], st["nested_absmax"], st["offset"])
    pairs = F.byte_pairs("nf4", dev)
    n = lay.numel
    def run(fused, step):
        index = torch.empty(step // 2, dtype=torch.int32, device=dev)
        values = torch.empty(step // 2, dtype=torch.int64, device=dev)
        out = torch.empty(n, dtype=torch.bfloat16, device=dev)
        a = lay.absmax_fp32(st["absmax"], st["nested_absmax"], st["offset"])
        for lo in range(0, n, step):
            hi = min(lo + step, n)
            g = (st["weight"][lo // 2: hi // 2], a[lo // 64:], pairs, hi - lo, 64, index, values)
            if fused:
                F.dequantize_blocks(*g, out=out[lo:hi])
            else:
                out[lo:hi] = F.dequantize_blocks(*g)
        return out.view(shape)
    print(shape, "layout.dequantize bits equal:", torch.equal(lay.dequantize(st, torch.bfloat16).view(torch.int16), ref.view(torch.int16)))
    for fused in (False, True):
        for step in (1 << 22, 1 << 24):
            assert torch.equal(run(fused, step).view(torch.int16), ref.view(torch.int16))
            for _ in range(5): run(fused, step)
            synchronize()
            t = time.perf_counter()
            for _ in range(50): run(fused, step)
            synchronize()
            ms = (time.perf_counter() - t) / 50 * 1e3
            print(f"  fused={fused} chunk=2^{step.bit_length()-1}: {ms:.3f} ms per matrix (wall, synchronised)")
