"""Scenarios ported from FSDP2's ``test_fully_shard_clip_grad_norm_.py`` (pytorch/pytorch,
``test/distributed/_composable/fsdp/``): clip_grad_norm_ with every norm type, clipping active. Registered in
``fsdp2_cases.CASES``; run and asserted by ``test_fsdp2_suite.py``."""

from __future__ import annotations

import torch

import shardwise
from fsdp2_cases import Case, RTOL, WORLD_SIZES, add_case, gpt, gpt_step, token_batches


MAX_NORM = 0.05

for _nt in (2.0, 1.0, float("inf"), 3.0):
    def _clip(ws, _nt=_nt):
        def step(ctx, model, batch):
            loss = gpt_step(ctx, model, batch)
            if ctx.side == "shardwise":
                norm = shardwise.clip_grad_norm_(model, MAX_NORM, norm_type=_nt)
            else:
                norm = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM, norm_type=_nt, foreach=True)
                norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
            ctx.rec.setdefault("norms", []).append(norm.item())
            return loss

        # The 1- and 3-norms sum ~45k fp32 powers in a different order on each side (~5e-7 apart, measured),
        # and every clipped update inherits that relative error.
        return Case(gpt, step, token_batches(3, 62), rtol=RTOL if _nt in (2.0, float("inf")) else 2e-6,
                    compare_extra=("norms",), check=lambda extra, side, ws: _assert_clipped(extra["norms"]),
                    doc=f"test_clip_grad_norm_1d: norm type {_nt}, max_norm {MAX_NORM} (clipping active)")

    add_case(f"clip_grad_norm_{_nt}", _clip, slow_at=None if _nt == 2.0 else WORLD_SIZES)


def _assert_clipped(norms):
    assert len(norms) == 3 and all(n > MAX_NORM for n in norms), f"clipping would be vacuous: {norms}"
