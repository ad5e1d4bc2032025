"""Masked loss: one step's loss is the mean over every loss target of the global batch, whatever share of
them each rank and micro-batch holds, so training matches a single process on the same global batch."""

from contextlib import nullcontext

import torch
from harness import run_distributed


def _masked_parity_worker(rank, world):
    from parity_utils import assert_parity, is_sharded, parity_check

    import shardwise
    from shardwise.models.gpt import GPT, Block, GPTConfig
    from shardwise.trainer.data import IGNORE_INDEX
    from shardwise.trainer.loss import (
        global_loss_targets,
        loss_targets,
        micro_batch_loss,
    )
    from shardwise.hf.model_spec import ModelSpec

    # No biases: the attention key bias has a gradient that is zero in theory, which AdamW turns from
    # rounding noise into visible steps (tests/test_parity.py excludes it the same way).
    cfg = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=16, bias=False)
    spec = ModelSpec("tiny", "gpt", cfg, cfg.vocab_size, cfg.block_size, cfg.n_layer, cfg.n_embd)
    g = torch.Generator().manual_seed(1)
    # Rows 0-5 (rank 0 at world size 2) keep few targets, rows 6-11 many; the second micro-batch of the last
    # step keeps none on rank 0: per-rank or per-micro-batch means would weight these wrongly.
    density = torch.linspace(0.05, 0.95, 12)[:, None]
    batches = []
    for step in range(3):
        micro = []
        for m in range(2):
            x, y = torch.randint(0, 64, (12, 8), generator=g), torch.randint(0, 64, (12, 8), generator=g)
            keep = torch.rand(12, 8, generator=g) < density
            if step == 2 and m == 1:
                keep[:6] = False
            micro.append((x, torch.where(keep, y, IGNORE_INDEX)))
        batches.append(micro)

    counts = []

    def loss_step(model, batch, step, take):
        sharded = is_sharded(model)
        parts = [(take(x), take(y)) for x, y in batch]
        targets = [y for _, y in parts]
        n = global_loss_targets(targets, torch.device("cpu")) if sharded else loss_targets(targets)
        if sharded:
            counts.append(loss_targets(targets))
        total = torch.zeros(())
        for i, (x, y) in enumerate(parts):
            with shardwise.no_sync(model) if sharded and i < len(parts) - 1 else nullcontext():
                loss = micro_batch_loss(spec, model, x, y, accumulation_steps=len(parts), global_targets=n,
                                        world_size=world if sharded else 1)
                loss.backward()
            total += loss.detach()
        return total

    for optimizer in ("sgd", "adamw"):
        torch.manual_seed(0)
        metrics, _, _ = parity_check(GPT(cfg), loss_step, batches, rank, world, optimizer=optimizer,
                                     shard_kwargs={"units": {Block}})
        assert_parity(metrics, rtol=1e-6 if optimizer == "sgd" else 1e-5, label=f"masked loss, {optimizer}")
    return counts


def test_masked_loss_matches_a_single_process_on_the_global_batch():
    counts = run_distributed(_masked_parity_worker, 2)
    assert counts[0] != counts[1]  # the ranks really held different numbers of loss targets
