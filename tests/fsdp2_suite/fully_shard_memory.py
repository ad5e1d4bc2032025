"""Scenarios ported from FSDP2's ``test_fully_shard_memory.py`` (pytorch/pytorch,
``test/distributed/_composable/fsdp/``): the gathered parameter bytes inside forward and backward and after them;
gradients and optimizer state at 1/N. Registered in ``fsdp2_cases.CASES``; run and asserted by
``test_fsdp2_suite.py``."""

from __future__ import annotations

import torch
import torch.distributed as dist

from fsdp2_cases import Case, STRATEGIES, WORLD_SIZES, add_case, assert_eq, bwd, gpt, token_batches, unit_of
from models import Block, GPT, tiny_gpt_config

from shardwise.engine.surface.pieces import local_of


def gathered_bytes(ctx, model) -> int:
    """Bytes of full (unsharded) parameter storage alive now. Ours: every flat group's gathered buffer.
    FSDP2: every distinct storage behind its all-gather outputs and unsharded parameters."""
    if ctx.side == "shardwise":
        from shardwise.engine.core.runtime import runtime_of

        return sum(g.gathered.untyped_storage().nbytes() for g in runtime_of(model).flat_groups())
    seen, total = set(), 0
    for m in model.modules():
        state = m._get_fsdp_state() if hasattr(m, "_get_fsdp_state") else None
        pg = getattr(state, "_fsdp_param_group", None)
        if pg is None:
            continue
        tensors = [getattr(pg, "_all_gather_output", None)]
        for fp in pg.fsdp_params:
            tensors += list(fp.all_gather_outputs) + [getattr(fp, "_unsharded_param", None)]
        for t in tensors:
            if t is None:
                continue
            st = t.untyped_storage()
            if st.nbytes() and st.data_ptr() not in seen:
                seen.add(st.data_ptr())
                total += st.nbytes()
    return total


def _local(t: torch.Tensor) -> torch.Tensor:
    return t._local_tensor if hasattr(t, "_local_tensor") else local_of(t)  # (a DTensor's, a piece's)


MEMORY_LAYERS = 6  # deep enough that "3 blocks + root" is well below the whole model


def _memory(strategy: str):
    def build(ws):
        def step(ctx, model, batch):
            x, y = (ctx.take(t) for t in batch)
            samples = []

            def sample(t):
                samples.append(gathered_bytes(ctx, model))
                return t

            # Sampled at every tensor autograd saves in forward and unpacks in backward: inside every unit's
            # forward and backward, where its parameters must be gathered.
            with torch.autograd.graph.saved_tensors_hooks(sample, sample):
                loss = model(x, y).loss
                after_forward = gathered_bytes(ctx, model)
                bwd(ctx, model, loss)
            local_numel = sum(_local(p).numel() for p in model.parameters())
            rec = ctx.rec
            rec.setdefault("peak", []).append(max(samples))
            rec.setdefault("after_forward", []).append(after_forward)
            rec.setdefault("after_backward", []).append(gathered_bytes(ctx, model))
            rec.setdefault("grad_numel_is_local_numel", []).append(
                sum(_local(p.grad).numel() for p in model.parameters()) == local_numel)
            return loss

        def finish(ctx, model):
            local = sum(_local(p).numel() for p in model.parameters())
            state = sum(_local(t).numel() for st in ctx.opt.state.values() for t in st.values()
                        if isinstance(t, torch.Tensor) and t.dim() > 0)
            total = torch.tensor([local])
            if ctx.side != "reference":
                dist.all_reduce(total)
            return {"optimizer_state_is_local": state == local,
                    "shards_add_up": total.item() == sum(p.numel() for p in ctx.initial.parameters())}

        cfg = tiny_gpt_config(n_layer=MEMORY_LAYERS)
        block = sum(p.numel() for p in Block(cfg).parameters()) * 4
        total = sum(p.numel() for p in GPT(cfg).parameters()) * 4
        root = total - cfg.n_layer * block

        def check(extra, side, ws):
            # FSDP2's own bounds (test_fully_shard_training_memory), parameter terms only: full_shard holds at
            # most 3 blocks (current all-gather + copy-out + next) and the root; shard_grad_op everything
            # plus one block. Ours is held to them too.
            # Both pad what they gather to a multiple of the world size: up to ws - 1 elements per buffer.
            pad = (ws - 1) * 4
            bound = 3 * (block + pad) + root + pad if strategy == "full_shard" else total + (cfg.n_layer + 2) * pad + block
            assert max(extra["peak"]) <= bound, f"peak gathered {max(extra['peak'])} bytes > {bound}"
            assert min(extra["peak"]) > 0, "sampling saw nothing gathered: the probe is broken"
            if strategy == "full_shard":
                assert max(extra["after_forward"]) <= root + pad, extra["after_forward"]
            assert_eq(extra["after_backward"], [0] * 3)
            assert_eq(extra["grad_numel_is_local_numel"], [True] * 3)
            assert extra["optimizer_state_is_local"] and extra["shards_add_up"], extra

        return Case(lambda: gpt(n_layer=MEMORY_LAYERS), step, token_batches(3, 62), finish=finish, check=check,
                    **unit_of(strategy), doc="test_fully_shard_training_memory: gathered parameter bytes inside "
                                             "forward and backward (every step, the first included), after "
                                             "each; grads and optimizer state are 1/N")

    return build


for _s in STRATEGIES:
    add_case(f"memory_{_s}", _memory(_s), slow_at=WORLD_SIZES if _s == "shard_grad_op" else None)
