"""Scenarios ported from FSDP2's ``test_fully_shard_frozen.py`` (pytorch/pytorch,
``test/distributed/_composable/fsdp/``): parameters frozen before or after sharding, inside a unit (BitFit) and
across units, called with and without gradients. Registered in ``fsdp2_cases.CASES``; run and asserted by
``test_fsdp2_suite.py``."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from fsdp2_cases import (Case, STRATEGIES, WORLD_SIZES, add_case, assert_eq, bwd, count_reduce_scatters, mean_sq_step,
                         mlp_stack, randn_batches, unit, unit_of)


def _freeze_non_bias(model):
    for n, p in model.named_parameters():
        if "bias" not in n:
            p.requires_grad_(False)


def _bitfit(strategy: str, freeze_after: bool, ac: bool):
    def build(ws):
        def make():
            torch.manual_seed(0)
            m = mlp_stack(8)
            if not freeze_after:
                _freeze_non_bias(m)
            return m

        def step(ctx, model, x):
            with count_reduce_scatters(ctx) as c:
                loss = model(ctx.take(x)).pow(2).mean()
                bwd(ctx, model, loss)
            ctx.rec.setdefault("reduced_numel", []).append(c.numel)
            return loss

        # Per unit the biases are 32 + 8 elements: ours pads the unit's trainable flat group to a multiple
        # of ws, FSDP2 pads each bias to a multiple of ws. Both must send nothing for the frozen weights.
        expected = {"shardwise": 3 * -(-40 // ws) * ws, "fsdp2": 3 * (-(-32 // ws) + -(-8 // ws)) * ws}
        if freeze_after:
            # Frozen after shard(): ours keeps the unit's one flat layout (each rank's optimizer state is
            # shaped by it), so the frozen weights' zero gradients still ride in the reduce-scatter, with a
            # warning that says to freeze before shard(). The numbers stay exact (parity is checked above).
            expected["shardwise"] = 3 * -(-552 // ws) * ws
        kw = unit_of(strategy)
        if ac:
            kw["ours"]["activation_checkpointing"] = True

        def pre_wrap(ctx, model):
            if ac and ctx.side == "fsdp2":
                from torch.distributed._composable import checkpoint

                for mlp in model:
                    checkpoint(mlp)

        return Case(make, step, randn_batches(4, 8), pre_wrap=pre_wrap, **kw,
                    prepare=(lambda ctx, model: _freeze_non_bias(model)) if freeze_after else None,
                    check=lambda extra, side, ws: assert_eq(extra["reduced_numel"], [expected[side]] * 4),
                    doc="test_train_mixed_requires_grad_per_group: only biases train (BitFit), frozen "
                        f"{'after' if freeze_after else 'before'} sharding, activation checkpointing {ac}; "
                        "reduce-scatters carry the biases only")

    return build


for _s, _fa, _ac, _slow_at in (("full_shard", False, False, None), ("full_shard", True, False, None),
                               ("full_shard", False, True, WORLD_SIZES), ("full_shard", True, True, None),
                               ("shard_grad_op", True, False, WORLD_SIZES)):
    add_case(f"bitfit_{_s}{'_freeze_after_shard' if _fa else ''}{'_ac' if _ac else ''}", _bitfit(_s, _fa, _ac),
             slow_at=_slow_at)


def _set_requires_grad_every_other(model, requires_grad: bool):
    for i, lin in enumerate(m for m in model if isinstance(m, nn.Linear)):
        if i % 2 == 0:
            lin.requires_grad_(requires_grad)


def _frozen_across(unfreeze: bool):
    def build(ws):
        def make():
            torch.manual_seed(0)
            layers = []
            for _ in range(6):
                layers += [unit(nn.Linear(12, 12)), nn.ReLU()]
            m = nn.Sequential(*layers)
            _set_requires_grad_every_other(m, False)
            return m

        def step(ctx, model, x):
            if unfreeze and ctx.i == 2:
                _set_requires_grad_every_other(model, True)  # fine-tuning: unfreeze on the last step
            if ctx.i == 1:
                with torch.no_grad():  # an evaluation step in the middle
                    return model(ctx.take(x)).pow(2).mean()
            loss = model(ctx.take(x)).pow(2).mean()
            bwd(ctx, model, loss)
            return loss

        return Case(make, step, randn_batches(3, 12),
                    doc="test_train_mixed_requires_grad_across_groups: every other Linear unit frozen, a no_grad "
                        f"step in the middle{', all unfrozen after sharding at the last step' if unfreeze else ''}")

    return build


for _u in (False, True):
    add_case(f"frozen_across_units{'_unfreeze_after_shard' if _u else ''}", _frozen_across(_u))


class MultiForwardMixed(nn.Module):
    def __init__(self):
        super().__init__()
        self.layer_0 = unit(nn.Linear(5, 5))
        self.layer_no_grad = unit(nn.Linear(5, 5))
        self.layer_with_grad = unit(nn.Linear(5, 5))
        self.layer_no_grad.requires_grad_(False)

    def forward(self, x):
        x = self.layer_0(x)
        for _ in range(3):
            x = self.layer_no_grad(F.relu(self.layer_with_grad(x)))
            with torch.no_grad():  # the same unit again, without gradients, inside the same forward
                x += F.relu(self.layer_with_grad(x))
        return x


for _s in STRATEGIES:
    def _mfm(ws, _s=_s):
        def make():
            torch.manual_seed(0)
            return MultiForwardMixed()

        return Case(make, mean_sq_step, randn_batches(4, 5), **unit_of(_s),
                    doc="test_multi_forward_mixed_requires_grad: trainable and frozen units called several times, "
                        "with and without gradients, in one forward")

    add_case(f"multi_forward_mixed_requires_grad_{_s}", _mfm, slow_at=WORLD_SIZES if _s == "shard_grad_op" else None)
