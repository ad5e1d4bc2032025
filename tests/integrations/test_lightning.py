"""``shardwise.integrations.lightning``: the Trainer's and Fabric's ``strategy="shardwise"`` against the same
framework's DDP on the same process group (gloo, CPU; world size 2 here, 3 in the slow tests).

Every run has gradient accumulation (2 micro-batches per step) and norm clipping acting on every step. Until
the first clip acts, losses are DDP's bit for bit; afterwards they agree within 1e-6: clipping's global norm
sums the ranks' pieces of a gradient, DDP one whole tensor, which rounds differently in the last bit. Runs of
our own at the same world size (resumed against uninterrupted, loaded against fitted, other shard options)
agree bit for bit. The runs themselves are in ``lightning_runs.py``.
"""

from __future__ import annotations

import atexit
import shutil
import tempfile
from pathlib import Path

import pytest

pytest.importorskip("lightning")

import lightning as L  # noqa: E402
import torch  # noqa: E402

import lightning_runs as runs  # noqa: E402
from harness import run_distributed  # noqa: E402
from parity_utils import rel_err, scalar_rel_err, spawn_once  # noqa: E402
from shardwise.errors import ShardwiseError  # noqa: E402
from shardwise.integrations import lightning_checkpoint as ckpt  # noqa: E402
from shardwise.integrations.lightning import (LAYER_SYNC_ATTR, ShardwiseFabricStrategy,  # noqa: E402
                                              ShardwiseStrategy)

RTOL = 1e-6
_ROOTS: dict[str, Path] = {}


def _root(name: str) -> Path:
    if name not in _ROOTS:
        _ROOTS[name] = Path(tempfile.mkdtemp(prefix=f"lightning-{name}-"))
        atexit.register(shutil.rmtree, _ROOTS[name], True)
    return _ROOTS[name]


@spawn_once
def _trainer(ws: int) -> list:
    return run_distributed(runs.trainer_runs, ws, str(_root(f"trainer{ws}")))


@spawn_once
def _resumed_at(ws: int, saved_at: int) -> list:
    _trainer(saved_at)  # its epoch1.ckpt
    return run_distributed(runs.resume_runs, ws, str(_root(f"trainer{saved_at}")))


@spawn_once
def _fabric(ws: int) -> list:
    return run_distributed(runs.fabric_runs, ws, str(_root(f"fabric{ws}")))


def _close(a, b) -> float:
    """The relative difference of two scalars, two lists of them, or two tensors."""
    if isinstance(a, list):
        return max((scalar_rel_err(x, y) for x, y in zip(a, b, strict=True)), default=0.0)
    if isinstance(a, torch.Tensor):
        return rel_err(a, b)
    return scalar_rel_err(a, b)


def _state_dict(path: Path) -> dict:
    return runs.Net.load_from_checkpoint(path, map_location="cpu").state_dict()


def _assert_like_ddp(ours: dict, ddp: dict, label: str, ws: int = 2) -> None:
    """The first step's losses bit for bit (the same initial weights); at 2 ranks its gradient norm too (halving
    is exact; at 3, dividing before or after the sum rounds differently); the rest within RTOL."""
    first_step = runs.ACCUMULATE
    assert ours["loss"][:first_step] == ddp["loss"][:first_step], f"{label}: the first step's losses differ"
    if ws == 2:
        assert ours["grad_norm"][0] == ddp["grad_norm"][0], f"{label}: the first gradient norm differs"
    assert _close(ours["loss"], ddp["loss"]) <= RTOL, f"{label}: losses {ours['loss']} vs DDP {ddp['loss']}"
    assert _close(ours["grad_norm"], ddp["grad_norm"]) <= RTOL, f"{label}: grad norms"
    assert min(ddp["grad_norm"]) > runs.CLIP, "clipping must act on every step for this test to mean anything"


# ---- the Trainer -----------------------------------------------------------------------------------------------


def _trainer_case(ws: int, rank: int) -> dict:
    return _trainer(ws)[rank]


@pytest.mark.parametrize("ws", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_trainer_fit_trains_as_ddp(ws):
    """accumulate_grad_batches=2, gradient_clip_val, validation inside fit, a model built in configure_model
    (the meta device under ours, eagerly under DDP): every rank's losses and gradient norms are DDP's."""
    for rank in range(ws):
        r = _trainer_case(ws, rank)
        _assert_like_ddp(r["shardwise"]["record"], r["ddp"]["record"], f"rank {rank}", ws)
        assert (r["shardwise"]["record"]["built_on"], r["ddp"]["record"]["built_on"]) == ("meta", "cpu")
        assert _close(r["shardwise"]["val_loss"], r["ddp"]["val_loss"]) <= RTOL


def test_trainer_accumulates_under_no_sync():
    """accumulate_grad_batches reaches shardwise.no_sync (the strategy's block_backward_sync): after each
    micro-batch but the last of a step the gradients are still zeros, kept unreduced."""
    for rank in range(2):
        deferred = _trainer_case(2, rank)["shardwise"]["record"]["deferred"]
        assert deferred == [True, False] * (len(deferred) // 2), deferred
        assert not any(_trainer_case(2, rank)["ddp"]["record"]["deferred"]), "DDP's no_sync keeps local gradients"


@pytest.mark.parametrize("ws", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_trainer_checkpoint_loads_in_one_process_as_ddps_does(ws):
    """The .ckpt holds the whole model: LightningModule.load_from_checkpoint in this (non-distributed) process
    gives DDP's weights, under the same names, dtypes and shapes."""
    root = _root(f"trainer{ws}")
    _trainer(ws)
    ours, ddp = _state_dict(root / "shardwise.ckpt"), _state_dict(root / "ddp.ckpt")
    assert list(ours) == list(ddp)
    for name in ddp:
        assert ours[name].dtype == ddp[name].dtype and ours[name].shape == ddp[name].shape, name
        assert _close(ours[name], ddp[name]) <= RTOL, name
    raw = torch.load(root / "shardwise.ckpt", map_location="cpu", weights_only=False)
    assert [entry[ckpt.MARKER] for entry in raw["optimizer_states"]] == [
        p.name for p in ckpt.sidecar_of(root / "shardwise.ckpt").iterdir()], "the file names its one sidecar directory"


def test_tied_weights_are_saved_under_each_name():
    """A weight shared by two modules is whole in the .ckpt under both names (as nn.Module.state_dict gives
    it), so load_from_checkpoint in one process loads strictly: the weights the model was built with."""
    _trainer(2)
    L.seed_everything(0, verbose=False)
    built = runs.TiedNet().state_dict()
    loaded = runs.TiedNet.load_from_checkpoint(_root("trainer2") / "tied.ckpt", map_location="cpu")
    assert loaded.out.weight is loaded.inp.weight
    saved = torch.load(_root("trainer2") / "tied.ckpt", map_location="cpu", weights_only=True)["state_dict"]
    assert sorted(saved) == sorted(built) and all(torch.equal(saved[k], built[k]) for k in built)


@pytest.mark.parametrize("ws", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_trainer_resumes_at_the_same_world_size_bit_for_bit(ws):
    """fit(max_epochs=1), save, then fit(ckpt_path=...) to epoch 2 in a new Trainer with a new model: the same
    bits as the uninterrupted fit (optimizer state and weights from the sidecar, loops from the file)."""
    for rank in range(ws):
        r = _trainer_case(ws, rank)
        whole, resumed = r["shardwise"]["record"], r["resumed"]
        for key in ("loss", "grad_norm"):
            assert resumed["first_epoch"][key] + resumed["record"][key] == whole[key], f"rank {rank}: {key}"
        assert resumed["val_loss"] == r["shardwise"]["val_loss"]


@pytest.mark.parametrize("saved_at, ws", [(2, 1), pytest.param(2, 3, marks=pytest.mark.slow)])
def test_trainer_resumes_at_another_world_size(saved_at, ws):
    """The first epoch saved at 2 ranks, resumed at ``ws`` with the same global batch: each step's global
    loss and gradient norm, the validation loss and the final weights are those of the uninterrupted run."""
    saved, resumed = _trainer(saved_at), _resumed_at(ws, saved_at)
    per_step = runs.N_TRAIN // runs.GLOBAL_BATCH
    global_loss = lambda results: [sum(r[i] for r in results) / len(results)  # noqa: E731 - equal rank batches
                                   for i in range(len(results[0]))]
    uninterrupted = global_loss([r["shardwise"]["record"]["loss"][per_step:] for r in saved])
    assert _close(global_loss([r["record"]["loss"] for r in resumed]), uninterrupted) <= RTOL
    assert _close(resumed[0]["record"]["grad_norm"], saved[0]["shardwise"]["record"]["grad_norm"][per_step // 2:]) <= RTOL
    assert _close(resumed[0]["val_loss"], saved[0]["shardwise"]["val_loss"]) <= RTOL
    root = _root(f"trainer{saved_at}")
    final, uninterrupted_sd = _state_dict(root / f"resumed-at-{ws}.ckpt"), _state_dict(root / "shardwise.ckpt")
    for name, t in uninterrupted_sd.items():
        assert _close(final[name], t) <= RTOL, name


@pytest.mark.parametrize("ws", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_validate_test_predict_inside_and_outside_fit(ws):
    """Validation inside fit, then validate / test / predict with new Trainers: on the fitted (sharded) model,
    and on a new eagerly built model with ckpt_path (sharded with rank 0's weights, then loaded from the
    sidecar). Each rank's metrics and predictions are DDP's; the checkpoint gives the fitted model's bits."""
    for rank in range(ws):
        ours, ddp = _trainer_case(ws, rank)["shardwise"], _trainer_case(ws, rank)["ddp"]
        assert ours["from_ckpt"] == ours["fitted"], f"rank {rank}: the checkpoint is not the fitted model"
        for key in ("val_loss", "test_loss"):
            assert _close(ours["fitted"][key], ddp["fitted"][key]) <= RTOL, f"rank {rank}: {key}"
        assert _close(torch.tensor(ours["fitted"]["predictions"]),
                      torch.tensor(ddp["fitted"]["predictions"])) <= RTOL, f"rank {rank}: predictions"
        assert ddp["from_ckpt"] == ddp["fitted"]
        assert ours["fitted"]["val_loss"] == ours["val_loss"], "the last validation inside fit saw the same model"


def test_checkpoints_without_our_sidecar_evaluate_and_refuse_to_resume_by_name():
    """A weights-only checkpoint and DDP's: validate loads their whole state dict (rank 0's, broadcast) and
    gives the fitted model's loss. Resuming a fit from them, or validating our file moved without its
    sidecar, raises on every rank saying what to do."""
    for rank in range(2):
        r = _trainer_case(2, rank)
        other = r["other_files"]
        assert other["weights_only"] == r["shardwise"]["fitted"]["val_loss"]
        assert other["ddp"] == r["ddp"]["fitted"]["val_loss"]
        assert "holds no optimizer state (saved with weights only)" in other["resume_weights_only"]
        assert "holds whole-tensor optimizer state" in other["resume_ddp"]
        assert "shardwise.ckpt.shardwise" in other["moved"] and "copy or move them together" in other["moved"]


def test_model_checkpoint_top_k_removes_the_sidecar_with_its_file():
    """ModelCheckpoint(save_top_k=1) over two epochs: one .ckpt and its sidecar remain."""
    left = _trainer_case(2, 0)["top_k"]
    assert len(left) == 2 and left[1] == left[0] + ckpt.SIDECAR_SUFFIX, left


@pytest.mark.parametrize("precision", ["bf16-mixed", "bf16-true"])
def test_precision_plugins_as_lightning_gives_them(precision):
    """Lightning's precision plugins, unchanged: autocast (bf16-mixed) and a bf16 model built in bf16 on the
    meta device (bf16-true), each against DDP with the same plugin."""
    for rank in range(2):
        ours, ddp = (_trainer_case(2, rank)["precision"][precision][k] for k in ("shardwise", "ddp"))
        _assert_like_ddp(ours, ddp, f"{precision}, rank {rank}")


# ---- Fabric ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("ws", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_fabric_loop_trains_as_ddp(ws):
    """The optimizer built before fabric.setup, no_backward_sync accumulation, clip_gradients: DDP's losses and
    gradient norms on every rank; also with sharding_strategy="hybrid_shard" over a mesh given as its sizes."""
    for rank, r in enumerate(_fabric(ws)):
        _assert_like_ddp(r["shardwise"], r["ddp"], f"rank {rank}", ws)
        _assert_like_ddp(r["hybrid"], r["ddp"], f"hybrid_shard over mesh=({ws}, 1), rank {rank}", ws)


def test_fabric_no_backward_sync_holds_the_gradients():
    """Fabric finds our no_sync (through the private attribute named in _private_lightning_names): after a
    backward under no_backward_sync every gradient is still zeros, the micro-batch kept unreduced."""
    for r in _fabric(2):
        assert r["shardwise"]["deferred"] and all(r["shardwise"]["deferred"])


@pytest.mark.parametrize("ws", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_fabric_resumes_and_other_shard_options_give_the_same_bits(ws):
    """fabric.load of the first epoch's checkpoint continues bit for bit; the meta-device build with
    sharding_strategy="shard_grad_op" and activation checkpointing trains bit for bit as the eager full_shard."""
    for rank, r in enumerate(_fabric(ws)):
        half = len(r["shardwise"]["loss"]) // 2
        assert r["resumed"]["loss"] == r["shardwise"]["loss"][half:], f"rank {rank}"
        assert r["resumed"]["grad_norm"] == r["shardwise"]["grad_norm"][len(r["shardwise"]["grad_norm"]) // 2:]
        assert (r["meta"]["built_on"], r["shardwise"]["built_on"]) == ("meta", "cpu")
        for key in ("loss", "grad_norm", "deferred"):
            assert r["meta"][key] == r["shardwise"][key], f"rank {rank}: {key}"


def test_fabric_loads_a_model_alone_from_the_whole_state_dict():
    """fabric.load(path, {"model": model}) with no optimizer (strict, and strict=False) gives the saved weights
    bit for bit and hands back the rest of the file."""
    root = _root("fabric2")
    assert _fabric(2)[0]["reloaded"] == [["epoch", "optimizer"]] * 2
    saved = torch.load(root / "fabric.ckpt", map_location="cpu", weights_only=True)["model"]
    for strict in (True, False):
        again = torch.load(root / f"fabric-reloaded-{strict}.ckpt", map_location="cpu", weights_only=True)["model"]
        assert again.keys() == saved.keys() and all(torch.equal(again[k], saved[k]) for k in saved), strict


def test_fabric_checkpoint_holds_the_whole_model_for_one_process():
    """fabric.save writes the whole model: torch.load in this process gives DDP's weights, and a plain Tower
    loads them."""
    root = _root("fabric2")
    _fabric(2)
    ours = torch.load(root / "fabric.ckpt", map_location="cpu", weights_only=True)
    ddp = torch.load(root / "fabric-ddp.ckpt", map_location="cpu", weights_only=True)
    assert ours["epoch"] == ddp["epoch"] == 2 and list(ours["model"]) == list(ddp["model"])
    for name, t in ddp["model"].items():
        assert _close(ours["model"][name], t) <= RTOL, name
    runs.Tower().load_state_dict(ours["model"])


# ---- in this process: registration, options, Lightning's private names ----------------------------------------


def test_strategy_name_selects_the_strategies():
    """``import shardwise.integrations.lightning`` registers "shardwise" with the Trainer and with Fabric."""
    trainer = L.Trainer(strategy="shardwise", accelerator="cpu", devices=1, logger=False)
    assert isinstance(trainer.strategy, ShardwiseStrategy)
    assert isinstance(L.Fabric(strategy="shardwise", accelerator="cpu", devices=1).strategy, ShardwiseFabricStrategy)


@pytest.mark.parametrize("cls", [ShardwiseStrategy, ShardwiseFabricStrategy])
def test_options_are_shards_and_an_unknown_one_is_named(cls):
    s = cls(units={runs.Block}, sharding_strategy="shard_grad_op", activation_checkpointing=True)
    assert s.shard_options["units"] == {runs.Block} and s.shard_options["sharding_strategy"] == "shard_grad_op"
    with pytest.raises(ShardwiseError, match="unknown option.*strategy_name.*sharding_strategy is shard"):
        cls(strategy_name="full_shard")


def test_trainer_hands_sync_batchnorm_to_the_strategy_under_the_private_name():
    """The Trainer's connector still puts sync_batchnorm's LayerSync where ``_private_lightning_names`` says."""
    from lightning.pytorch.plugins import LayerSync

    def layer_sync(**kw):
        return getattr(L.Trainer(strategy=ShardwiseStrategy(), accelerator="cpu", devices=1, logger=False,
                                 **kw).strategy, LAYER_SYNC_ATTR)

    assert isinstance(layer_sync(sync_batchnorm=True), LayerSync)
    assert layer_sync() is None


def test_num_nodes_reaches_the_strategy_from_the_trainer_and_from_fabric():
    """The Trainer sets ``num_nodes``; Fabric's connector writes it under the private name in
    ``_private_lightning_names``."""
    assert L.Trainer(strategy="shardwise", accelerator="cpu", devices=1, num_nodes=2, logger=False).strategy.num_nodes == 2
    assert L.Fabric(strategy="shardwise", accelerator="cpu", devices=1, num_nodes=2).strategy.num_nodes == 2


def test_several_processes_without_a_launcher_are_refused_with_the_torchrun_line():
    """The strategies start no processes: devices=2 in a plain ``python train.py`` names torchrun."""
    trainer = L.Trainer(strategy="shardwise", accelerator="cpu", devices=2, logger=False, max_epochs=1)
    with pytest.raises(ShardwiseError, match="torchrun --nproc-per-node 2 train.py"):
        trainer.fit(runs.Net(lazy=False), runs.loader(runs.N_TRAIN, 1, 2))
    assert not torch.distributed.is_initialized()


def test_fabric_load_raw_of_an_optimizer_is_refused(tmp_path):
    """A sharded optimizer's state is per rank: fabric.load_raw(path, optimizer) names fabric.save instead."""
    torch.save({"state": {}, "param_groups": []}, tmp_path / "opt.pt")
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    with pytest.raises(ShardwiseError, match="per rank.*fabric.save"):
        ShardwiseFabricStrategy().load_checkpoint(tmp_path / "opt.pt", optimizer)


def test_a_checkpoint_path_must_be_local():
    with pytest.raises(ShardwiseError, match="s3://bucket/x.ckpt.*local"):
        ckpt.local_path("s3://bucket/x.ckpt")


@spawn_once
def _gan(ws: int) -> list:
    return run_distributed(runs.gan_runs, ws, str(_root(f"gan{ws}")))


@pytest.mark.parametrize("ws", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_manual_optimization_gan_steps_inside_training_step_as_ddp(ws):
    """Two optimizers stepped inside training_step with toggle_optimizer (Lightning's GAN): the generator's
    pass after the discriminator's step reads the stepped discriminator (the root unit, gathered around
    training_step, is gathered again after each step), and a parameter toggled back on after the step gets its
    gradient. DDP's losses and model, to RTOL (Adam's update divides by the root of a second moment that
    sums the ranks' gradients in another order than DDP's bucket)."""
    for rank, r in enumerate(_gan(ws)):
        ours, ddp = r["shardwise"], r["ddp"]
        assert len(ours["loss"]) == len(ddp["loss"]) == 2 * 2 * runs.N_TRAIN // runs.GLOBAL_BATCH, rank
        assert _close(ours["loss"], ddp["loss"]) <= RTOL, (rank, ours["loss"], ddp["loss"])
        if rank == 0:
            assert ours["state_dict"].keys() == ddp["state_dict"].keys()
            for name, value in ddp["state_dict"].items():
                assert _close(ours["state_dict"][name], value) <= RTOL, name


def test_a_save_onto_a_link_writes_its_own_file_and_keeps_the_targets_sidecar(tmp_path):
    """ModelCheckpoint(save_last="link") leaves last.ckpt a link to the newest top-k file; a later save to
    last.ckpt (the first one after a resume, or a weights-only one) writes a file of its own there, as
    Lightning's atomic save does, with its sidecar beside it; the target keeps its file and its sidecar."""
    target, link = tmp_path / "epoch=1.ckpt", tmp_path / "last.ckpt"
    target.write_bytes(b"epoch 1")
    kept = tmp_path / ("epoch=1.ckpt" + ckpt.SIDECAR_SUFFIX) / "optimizer-0-0123456789ab"
    kept.mkdir(parents=True)
    link.symlink_to(target.name)
    strategy = ShardwiseStrategy()
    path, _ = strategy._where_to_save(link)  # where every rank writes its pieces (before rank 0 writes the file)
    assert ckpt.sidecar_of(path) == tmp_path / ("last.ckpt" + ckpt.SIDECAR_SUFFIX), ckpt.sidecar_of(path)
    strategy.save_checkpoint({"state_dict": {}, "epoch": 4}, link)
    assert not link.is_symlink() and torch.load(link)["epoch"] == 4
    assert target.read_bytes() == b"epoch 1" and kept.is_dir(), "the link's target and its sidecar are left alone"


# ---- state_dict_type="sharded" ---------------------------------------------------------------------------------


@spawn_once
def _sharded(ws: int) -> list:
    return run_distributed(runs.sharded_runs, ws, str(_root(f"sharded{ws}")))


def test_sharded_checkpoints_train_resume_and_evaluate_as_full_ones():
    """state_dict_type="sharded" trains the bits "full" trains; its file holds no tensor of the model (a marker
    naming the sidecar directory that does); a fresh model validated from it, with or without optimizer state,
    gives the fitted model's loss; a resumed fit gives the uninterrupted fit's bits; Fabric's loop too."""
    full = _trainer(2)
    for rank, r in enumerate(_sharded(2)):
        assert r["record"] == full[rank]["shardwise"]["record"], f"rank {rank}: sharded fit differs from full"
        v = full[rank]["shardwise"]["fitted"]["val_loss"]  # validate() on the model "full" trained
        assert r["from_ckpt"] == {"sharded.ckpt": v, "sharded-weights.ckpt": v}, (rank, r["from_ckpt"], v)
        for key in ("loss", "grad_norm"):
            assert r["resumed"]["first_epoch"][key] + r["resumed"]["record"][key] == r["record"][key], (rank, key)
        assert r["fabric_resumed"]["loss"] == r["fabric"]["loss"][len(r["fabric"]["loss"]) // 2:], rank
    root = _root("sharded2")
    for name in ("sharded.ckpt", "sharded-weights.ckpt"):
        raw = torch.load(root / name, map_location="cpu", weights_only=True)
        directory = raw["state_dict"][ckpt.MODEL_MARKER]
        assert (ckpt.sidecar_of(root / name) / directory).is_dir(), name
        assert not any(isinstance(v, torch.Tensor) for v in raw["state_dict"].values())
    fabric = torch.load(root / "fabric-sharded.ckpt", map_location="cpu", weights_only=True)
    assert fabric["model"] == {ckpt.MODEL_MARKER: fabric["optimizer"][ckpt.MARKER]}, "the optimizer's directory holds the model"


def test_a_sharded_checkpoint_consolidated_loads_in_one_process_as_the_full_one():
    """consolidate_checkpoint(PATH, OUT) in this process (no process group): OUT's state dict is, bit for bit,
    the "full" file's of the same training; PATH itself is refused by load_from_checkpoint, naming the marker."""
    from shardwise.integrations.lightning import consolidate_checkpoint

    _sharded(2)
    root = _root("sharded2")
    for name, full in (("sharded.ckpt", "shardwise.ckpt"), ("sharded-weights.ckpt", "shardwise-weights.ckpt")):
        out = consolidate_checkpoint(root / name, root / f"consolidated-{name}")
        ours, theirs = _state_dict(out), _state_dict(_root("trainer2") / full)
        assert list(ours) == list(theirs) and all(torch.equal(ours[k], theirs[k]) for k in theirs), name
        assert "optimizer_states" not in torch.load(out, map_location="cpu", weights_only=True)
    with pytest.raises(RuntimeError, match=ckpt.MODEL_MARKER):
        runs.Net.load_from_checkpoint(root / "sharded.ckpt", map_location="cpu")
    with pytest.raises(ShardwiseError, match="not saved with state_dict_type='sharded'"):
        consolidate_checkpoint(_root("trainer2") / "shardwise.ckpt", root / "x.ckpt")


def test_a_full_save_rank_0_cannot_hold_is_refused_on_every_rank_before_gathering():
    for rank, r in enumerate(_sharded(2)):
        assert "state_dict_type='sharded'" in r["too_big"] and "rank 0's host memory" in r["too_big"], (rank, r["too_big"])
        assert r["too_big_written"] == [], rank


@pytest.mark.parametrize("cls", [ShardwiseStrategy, ShardwiseFabricStrategy])
def test_an_unknown_state_dict_type_is_named(cls):
    with pytest.raises(ShardwiseError, match="state_dict_type='whole'.*'full', 'sharded'"):
        cls(state_dict_type="whole")


@pytest.mark.parametrize("entry", [{ckpt.MODEL_MARKER: "../../outside"}, {ckpt.MODEL_MARKER: "model-0-/etc"}])
def test_a_file_naming_a_directory_outside_its_sidecar_is_refused(tmp_path, entry):
    """A hostile (or hand-edited) file whose model or optimizer entry names a path out of its sidecar: refused
    by name before anything there is read, by consolidation and by a restore alike."""
    path = tmp_path / "run.ckpt"
    torch.save({"state_dict": entry}, path)
    with pytest.raises(ShardwiseError, match="not a name a shardwise save writes"):
        ckpt.consolidate_checkpoint(path, tmp_path / "out.ckpt")
    assert not (tmp_path / "out.ckpt").exists()
    with pytest.raises(ShardwiseError, match="not a name a shardwise save writes"):
        ckpt.names_in([{ckpt.MARKER: "../optimizer-0-0123456789ab"}])
    assert ckpt.names_in([{ckpt.MARKER: "optimizer-0-0123456789ab"}]) == ["optimizer-0-0123456789ab"]
