"""The single-process reference for shardwise.optim.Muon: torch.optim.Muon's algorithm on the unsharded
model, written matrix by matrix as torch writes it (``torch/optim/_muon.py``) but with the Newton–Schulz
dtype as a parameter, plus torch.optim.AdamW for the parameters Muon leaves alone."""

from __future__ import annotations

import math

import torch


def newton_schulz(g: torch.Tensor, coefficients, steps: int, eps: float, dtype: torch.dtype) -> torch.Tensor:
    a, b, c = coefficients
    x = g.to(dtype, copy=True)  # never the momentum buffer itself (nesterov=False, same dtype)
    if g.size(0) > g.size(1):
        x = x.T
    x.div_(x.norm().clamp(min=eps))
    for _ in range(steps):
        gram = x @ x.T
        update = torch.addmm(gram, gram, gram, beta=b, alpha=c)
        x = torch.addmm(x, update, x, beta=a)
    return x.T if g.size(0) > g.size(1) else x


class ReferenceMuon:
    """Muon on the named matrices of ``model`` (``muon_names``), AdamW on its other trainable parameters."""

    def __init__(self, model: torch.nn.Module, muon_names: set[str], *, lr=0.02, weight_decay=0.1, momentum=0.95,
                 nesterov=True, ns_coefficients=(3.4445, -4.7750, 2.0315), eps=1e-7, ns_steps=5,
                 adjust_lr_fn=None, ns_dtype=torch.bfloat16, adamw_lr=3e-4, adamw_betas=(0.9, 0.95),
                 adamw_eps=1e-8, adamw_weight_decay=0.0):
        named = dict(model.named_parameters())
        self.matrices = [(n, p) for n, p in named.items() if n in muon_names]
        others = [p for n, p in named.items() if n not in muon_names]
        self.adamw = torch.optim.AdamW(others, lr=adamw_lr, betas=adamw_betas, eps=adamw_eps,
                                       weight_decay=adamw_weight_decay)
        self.opts = dict(lr=lr, weight_decay=weight_decay, momentum=momentum, nesterov=nesterov,
                         ns_coefficients=ns_coefficients, eps=eps, ns_steps=ns_steps, adjust_lr_fn=adjust_lr_fn,
                         ns_dtype=ns_dtype)
        self.buffers: dict[str, torch.Tensor] = {}

    @torch.no_grad()
    def step(self) -> None:
        o = self.opts
        for name, p in self.matrices:
            if p.grad is None:
                continue
            buf = self.buffers.setdefault(name, torch.zeros_like(p.grad))
            buf.lerp_(p.grad, 1 - o["momentum"])
            update = p.grad.lerp(buf, o["momentum"]) if o["nesterov"] else buf
            g = update.reshape(update.shape[0], -1)
            ortho = newton_schulz(g, o["ns_coefficients"], o["ns_steps"], o["eps"], o["ns_dtype"])
            a, b = g.shape
            ratio = 0.2 * math.sqrt(max(a, b)) if o["adjust_lr_fn"] == "match_rms_adamw" else math.sqrt(max(1, a / b))
            p.mul_(1 - o["lr"] * o["weight_decay"])
            p.add_(ortho.reshape(p.shape), alpha=-o["lr"] * ratio)
        self.adamw.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for _, p in self.matrices:
            p.grad = None
        self.adamw.zero_grad(set_to_none=set_to_none)
