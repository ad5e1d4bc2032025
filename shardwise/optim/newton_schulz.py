"""Newton–Schulz orthogonalisation of a batch of same-shaped matrices, operation for operation as
``torch.optim.Muon`` does it for one matrix (torch 2.11 and 2.13, ``torch/optim/_muon.py``:
``_zeropower_via_newtonschulz`` with addmm), so a batched call gives each matrix bitwise the result of
torch's per-matrix call in the same dtype (checked for square, wide and tall shapes in fp32 and bf16):

    X = G.to(dtype); transpose if rows > cols; X /= max(||X||_F, eps)
    repeat steps:  A = X X^T;  B = b A + c A A;  X = a X + B X
"""

from __future__ import annotations

import torch

DEFAULT_COEFFICIENTS = (3.4445, -4.7750, 2.0315)  # Keller Jordan's, torch.optim.Muon's defaults
DEFAULT_STEPS = 5
DEFAULT_EPS = 1e-7


def orthogonalize(matrices: list[torch.Tensor], coefficients: tuple[float, float, float], steps: int,
                  eps: float, dtype: torch.dtype) -> list[torch.Tensor]:
    """NS(G) in ``dtype`` for every G in ``matrices`` (2-D, all of one shape), in one batched matmul chain."""
    tall = matrices[0].shape[0] > matrices[0].shape[1]
    # Tall matrices run as transposed *views*, as torch's do: matmul kernels sum in another order for a
    # transposed operand than for a contiguous copy of it, and we want torch's rounding exactly.
    x = torch.stack([m.to(dtype) for m in matrices])
    if tall:
        x = x.mT
    # The norm matrix by matrix with the same call as torch's (a batched reduction may sum in another order).
    norms = torch.stack([xi.norm() for xi in x]).clamp(min=eps)
    x.div_(norms.view(-1, 1, 1))
    a, b, c = coefficients
    for _ in range(steps):
        gram = x @ x.mT
        update = torch.baddbmm(gram, gram, gram, beta=b, alpha=c)
        x = torch.baddbmm(x, update, x, beta=a)
    return list(x.mT if tall else x)
