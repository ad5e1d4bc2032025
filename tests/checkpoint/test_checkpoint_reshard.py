"""Save at one (world size, strategy), load at another: parameters and optimizer state come back bitwise,
and the next training step matches the run that never stopped."""

from __future__ import annotations

import pytest
import torch

from ckpt_workers import assert_same_contents, build, contents, full_params, train_step
from harness import run_distributed


def _save_at_4(rank, world_size, root):
    from shardwise.checkpoint import save_checkpoint
    out = {}
    for tag, strategy, mesh in (("full", "full_shard", None), ("hybrid", "hybrid_shard", (2, 2)),
                                ("zero2", "shard_optim_grad", None)):
        model, opt = build(strategy, mesh)
        for step in (1, 2):
            train_step(model, opt, step, rank, world_size)
        save_checkpoint(f"{root}/{tag}", model, opt, step=2, extra={"rank": rank, "tag": tag})
        saved = full_params(model)
        out[tag] = (saved, [train_step(model, opt, step, rank, world_size) for step in (3, 4)])
    return out


def _load_and_continue(rank, world_size, root, src, strategy, mesh):
    from shardwise.checkpoint import load_checkpoint, save_checkpoint
    model, opt = build(strategy, mesh, seed=123)  # different init: everything must come from the checkpoint
    extra = load_checkpoint(f"{root}/{src}", model, opt)
    loaded = full_params(model)
    dst = f"{root}/{src}-as-{world_size}-{strategy}"
    save_checkpoint(dst, model, opt, step=2)
    return extra, loaded, dst, [train_step(model, opt, step, rank, world_size) for step in (3, 4)]


@pytest.fixture(scope="module")
def saved_at_4(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("ckpt4"))
    return root, run_distributed(_save_at_4, 4, root)[0]


@pytest.mark.parametrize("world_size, src, strategy, mesh", [
    (3, "full", "full_shard", None),  # uneven shards
    (2, "hybrid", "full_shard", None),
    (2, "full", "hybrid_shard", (2, 1)),  # replicas: only replicate index 0 writes on re-save
    (1, "hybrid", "no_shard", None),
    (3, "zero2", "shard_optim", None),  # ZeRO-2 -> ZeRO-1, uneven
    pytest.param(2, "full", "shard_optim_grad", None, marks=pytest.mark.slow),  # ZeRO-3 -> ZeRO-2
])
def test_reshard_on_load(saved_at_4, world_size, src, strategy, mesh):
    root, ref = saved_at_4
    ref_saved, ref_losses = ref[src]
    results = run_distributed(_load_and_continue, world_size, root, src, strategy, mesh)
    extra, loaded, dst, losses = results[0]
    assert extra == {"rank": 0, "tag": src}  # another world size: every rank gets rank 0's extra
    assert all(r[0] == extra for r in results)
    for k in ref_saved:
        assert torch.equal(loaded[k], ref_saved[k]), k
    # Parameters and every optimizer state tensor, re-saved under the new layout, are bitwise the originals.
    assert_same_contents(contents(f"{root}/{src}"), contents(dst))
    # Training goes on as at 4 ranks. Parameters themselves are not compared after a step: the summation
    # order of gradients differs between world sizes, and Adam turns the rounding noise of gradients that
    # are exactly zero in theory (the key bias of attention) into full-size updates. The loss is immune.
    torch.testing.assert_close(losses, ref_losses, rtol=1e-5, atol=0)


def _resume_bitwise(rank, world_size, root):
    from shardwise.checkpoint import load_checkpoint, save_checkpoint
    model, opt = build()
    for step in (1, 2):
        train_step(model, opt, step, rank, world_size)
    torch.manual_seed(77 + rank)
    save_checkpoint(f"{root}/ck", model, opt, step=2, extra={"rng": torch.get_rng_state(), "rank": rank})
    saved_state = _state_reads(model, opt)
    expected_noise = torch.rand(3)
    train_step(model, opt, 3, rank, world_size)
    train_step(model, opt, 4, rank, world_size)
    uninterrupted = full_params(model)

    model2, opt2 = build(seed=5)
    extra = load_checkpoint(f"{root}/ck", model2, opt2)
    loaded_state = _state_reads(model2, opt2)  # before the first step, as a loop that logs them reads them
    torch.set_rng_state(extra["rng"])
    assert torch.equal(torch.rand(3), expected_noise)
    train_step(model2, opt2, 3, rank, world_size)
    train_step(model2, opt2, 4, rank, world_size)
    resumed = full_params(model2)
    return (extra["rank"], all(torch.equal(uninterrupted[k], resumed[k]) for k in uninterrupted), saved_state,
            loaded_state)


def _state_reads(model, opt) -> list:
    """What user code reads of ``optimizer.state``: each state tensor's shape (as its parameter's?) and norm."""
    return [(tuple(t.shape) == tuple(p.shape), float(t.norm()))
            for p in model.parameters() for t in opt.state[p].values() if t.dim() > 0]


def test_same_world_size_resume_is_bitwise(tmp_path):
    """Also: ``optimizer.state`` reads as the whole state before the save and right after the load (each
    tensor its parameter's shape, its norm the same on every rank), not as this rank's elements."""
    results = run_distributed(_resume_bitwise, 2, str(tmp_path))
    assert [r[0] for r in results] == [0, 1]  # each rank got its own extra back
    assert results[0][1], "parameters after resume differ from the uninterrupted run"
    for _rank, _same, saved, loaded in results:
        assert saved and all(whole for whole, _ in saved) and all(whole for whole, _ in loaded), (saved, loaded)
        assert loaded == saved == results[0][2], "the loaded state reads as the saved whole state on every rank"


def _optimizer_built_before_shard(rank, world_size, root):
    """nanoGPT's order (optimizer, then the wrapper), and a checkpoint saved before the first step: the
    optimizer holds the shard parameters once checkpointed, and trains as one built after shard()."""
    import shardwise
    from shardwise.checkpoint import save_checkpoint
    from shardwise.models import GPT

    torch.manual_seed(0)
    model = GPT.from_preset("gpt-tiny", tie_weights=True)  # as build() makes it
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.8, 0.95), weight_decay=0.1)
    shardwise.shard(model)
    save_checkpoint(f"{root}/before", model, opt, step=0)
    ref_model, ref_opt = build()
    for step in (1, 2):
        train_step(model, opt, step, rank, world_size)
        train_step(ref_model, ref_opt, step, rank, world_size)
    ours, ref = full_params(model), full_params(ref_model)
    return {k: (ours[k] - ref[k]).abs().max().item() for k in ref if not torch.equal(ours[k], ref[k])}


def test_an_optimizer_built_before_shard_checkpoints_and_trains_as_one_built_after(tmp_path):
    for rank, differ in enumerate(run_distributed(_optimizer_built_before_shard, 2, str(tmp_path))):
        assert not differ, f"rank {rank}: parameters differ from the optimizer built after shard(): {differ}"
