"""What the Lightning tests train, and the runs themselves (each runs inside one spawned rank).

One model: three residual blocks (the units) and a head (the root unit), whose ``training_step`` applies the
head's weights directly (``F.linear``), so it needs the root unit gathered around the step, not only around
forward. The data: fixed random regression pairs. Every run records, per rank, each micro-batch's loss and
each optimizer step's gradient norm before clipping; the Trainer runs also the metrics of validate / test and
the predictions. A baseline is the same framework's DDP, on the same process group (ProcessGroupEnvironment,
so neither starts processes).
"""

from __future__ import annotations

from pathlib import Path

import lightning as L
import torch
import torch.nn as nn
import torch.nn.functional as F
from lightning.fabric.strategies import DDPStrategy as FabricDDPStrategy
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.strategies import DDPStrategy
from torch.utils.data import DataLoader, TensorDataset

from harness import error_of
from parity_utils import assert_engine_clean, is_sharded
from shardwise.integrations import lightning_checkpoint as ckpt
from shardwise.integrations.lightning import ProcessGroupEnvironment, ShardwiseFabricStrategy, ShardwiseStrategy

DIM, DEPTH = 8, 3
N_TRAIN, N_EVAL = 24, 12
GLOBAL_BATCH = 6  # per optimizer step: 4 micro-batches per epoch, 2 steps per epoch with accumulation 2
ACCUMULATE = 2
CLIP = 0.05  # below every step's gradient norm: clipping acts on every step
LR = 0.5


def dataset(n: int, seed: int) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randn(n, DIM, generator=g), torch.randn(n, 1, generator=g))


def loader(n: int, seed: int, world_size: int) -> DataLoader:
    """Each rank's share of a global batch of GLOBAL_BATCH (the frameworks add the DistributedSampler)."""
    return DataLoader(dataset(n, seed), batch_size=GLOBAL_BATCH // world_size)


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(DIM, DIM)

    def forward(self, x):
        return x + torch.tanh(self.lin(x))


class Tower(nn.Module):
    """The model without Lightning (Fabric trains it)."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(DEPTH))
        self.head = nn.Linear(DIM, 1)

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return self.head(x)


class Net(L.LightningModule):
    """``lazy=True`` builds the layers in ``configure_model`` (the meta device under ShardwiseStrategy)."""

    def __init__(self, lazy: bool = True):
        super().__init__()
        self.save_hyperparameters()
        self.blocks = self.head = None
        self.record: dict[str, list] = {"loss": [], "grad_norm": [], "deferred": []}
        if not lazy:
            self.configure_model()

    def configure_model(self):
        if self.blocks is None:
            self.blocks = nn.ModuleList(Block() for _ in range(DEPTH))
            self.head = nn.Linear(DIM, 1)
            self.record["built_on"] = str(self.head.weight.device)

    def features(self, x):
        for b in self.blocks:
            x = b(x)
        return x

    def forward(self, x):
        return self.head(self.features(x))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.mse_loss(F.linear(self.features(x), self.head.weight, self.head.bias), y)
        self.record["loss"].append(loss.item())
        return loss

    def on_after_backward(self):  # under shardwise.no_sync p.grad stays zeros until the synced backward
        if is_sharded(self):
            assert_engine_clean(self)
        self.record["deferred"].append(all(not p.grad.any() for p in self.parameters()))

    def on_before_optimizer_step(self, optimizer):
        norms = [p.grad.norm() for p in self.parameters() if p.grad is not None]  # whole-tensor norms, every rank
        self.record["grad_norm"].append(torch.stack(norms).norm().item())

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", F.mse_loss(self(batch[0]), batch[1]), sync_dist=True)

    def test_step(self, batch, batch_idx):
        self.log("test_loss", F.mse_loss(self(batch[0]), batch[1]), sync_dist=True)

    def predict_step(self, batch, batch_idx):
        return self(batch[0])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=LR, momentum=0.9)


class TiedNet(L.LightningModule):
    """Input and output projections that share one weight, as a language model's embedding and head do."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(DIM, DIM, bias=False)
        self.blocks = nn.ModuleList(Block() for _ in range(DEPTH))
        self.out = nn.Linear(DIM, DIM, bias=False)
        self.out.weight = self.inp.weight

    def forward(self, x):
        x = self.inp(x)
        for b in self.blocks:
            x = b(x)
        return self.out(x)

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", self(batch[0]).pow(2).mean(), sync_dist=True)


def trainer_strategy(kind):
    if not isinstance(kind, str):
        return kind  # a strategy object
    if kind == "ddp":
        return DDPStrategy(cluster_environment=ProcessGroupEnvironment())
    return ShardwiseStrategy() if kind == "shardwise" else kind  # "shardwise" by name goes through the registry


def trainer(kind: str, world_size: int, root: Path, **overrides) -> L.Trainer:
    options = dict(accelerator="cpu", devices=world_size, max_epochs=2, accumulate_grad_batches=ACCUMULATE,
                   gradient_clip_val=CLIP, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                   enable_model_summary=False, default_root_dir=str(root))
    return L.Trainer(strategy=trainer_strategy(kind), **{**options, **overrides})


def fit(kind: str, world_size: int, root: Path, ckpt_path=None, **overrides) -> tuple[Net, L.Trainer, float]:
    """A fit from the same seed (and, with ckpt_path, a resumed one); returns the model, its trainer and the
    validation loss the fit's last validation logged."""
    L.seed_everything(0, verbose=False)
    model = Net()
    t = trainer(kind, world_size, root, **overrides)
    t.fit(model, loader(N_TRAIN, 1, world_size), loader(N_EVAL, 2, world_size), ckpt_path=ckpt_path)
    return model, t, t.callback_metrics["val_loss"].item()


def evaluate(kind: str, world_size: int, root: Path, model: Net, ckpt_path=None) -> dict:
    """validate, test and predict outside fit, with a new Trainer (each a new setup of ``model``)."""
    t = trainer(kind, world_size, root)
    data = lambda: loader(N_EVAL, 2, world_size)  # noqa: E731
    out = {"val_loss": t.validate(model, data(), ckpt_path=ckpt_path, verbose=False)[0]["val_loss"],
           "test_loss": t.test(model, data(), ckpt_path=ckpt_path, verbose=False)[0]["test_loss"]}
    out["predictions"] = torch.cat(t.predict(model, data(), ckpt_path=ckpt_path)).flatten().tolist()
    return out


def trainer_runs(rank: int, world_size: int, root: str) -> dict:
    """The Trainer at ``world_size``: DDP's fit and ours (gradient accumulation, norm clipping, validation
    inside fit), checkpoints of both, ours resumed after the first epoch, validate / test / predict outside fit
    on the fitted model and on a fresh model with ckpt_path, a model with tied weights saved, checkpoints of other
    kinds, ModelCheckpoint's pruning, precision plugins."""
    root = Path(root)
    out = {}
    for kind in ("ddp", "shardwise"):
        model, t, val = fit(kind, world_size, root)
        t.save_checkpoint(root / f"{kind}.ckpt")
        t.save_checkpoint(root / f"{kind}-weights.ckpt", weights_only=True)
        out[kind] = {"record": model.record, "val_loss": val,
                     "fitted": evaluate(kind, world_size, root, model),
                     "from_ckpt": evaluate(kind, world_size, root, Net(lazy=False), root / f"{kind}.ckpt")}
    model, t, _ = fit("shardwise", world_size, root, max_epochs=1)
    t.save_checkpoint(root / "epoch1.ckpt")
    resumed, _, val = fit("shardwise", world_size, root, ckpt_path=root / "epoch1.ckpt")
    out["resumed"] = {"record": resumed.record, "first_epoch": model.record, "val_loss": val}
    L.seed_everything(0, verbose=False)
    tied = trainer("shardwise", world_size, root)
    tied.validate(TiedNet(), loader(N_EVAL, 2, world_size), verbose=False)
    tied.save_checkpoint(root / "tied.ckpt")
    out["other_files"] = other_files(world_size, root)
    out["top_k"] = top_k_checkpoints(root)
    out["precision"] = {precision: {kind: fit(kind, world_size, root, precision=precision)[0].record
                                    for kind in ("ddp", "shardwise")}
                        for precision in ("bf16-mixed", "bf16-true")}
    return out


def resume_runs(rank: int, world_size: int, root: str) -> dict:
    """Ours resumed at ``world_size`` from the first epoch another world size saved (``epoch1.ckpt``)."""
    root = Path(root)
    model, t, val = fit("shardwise", world_size, root, ckpt_path=root / "epoch1.ckpt")
    t.save_checkpoint(root / f"resumed-at-{world_size}.ckpt")
    return {"record": model.record, "val_loss": val}


def fabric_loop(kind: str, world_size: int, root: Path, name: str, *, epochs: int = 2, resume_from: str = "",
                meta: bool = False, **shard_options) -> dict:
    """A Fabric loop as its docs write one: the optimizer built before ``setup``, gradient accumulation under
    ``no_backward_sync``, ``clip_gradients``. Saves ``{name}-epoch1.ckpt`` (unless it resumes from
    ``{resume_from}-epoch1.ckpt``) and ``{name}.ckpt`` at the end."""
    strategy = (FabricDDPStrategy(cluster_environment=ProcessGroupEnvironment()) if kind == "ddp"
                else ShardwiseFabricStrategy(**shard_options))
    fabric = L.Fabric(accelerator="cpu", devices=world_size, strategy=strategy)
    fabric.launch()
    L.seed_everything(0, verbose=False)
    with fabric.init_module(empty_init=meta):
        model = Tower()
    record = {"loss": [], "grad_norm": [], "deferred": [], "built_on": str(model.head.weight.device)}
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    model, optimizer = fabric.setup(model, optimizer)
    data = fabric.setup_dataloaders(loader(N_TRAIN, 1, world_size))
    first_epoch = 0
    if resume_from:
        first_epoch = fabric.load(root / f"{resume_from}-epoch1.ckpt", {"model": model, "optimizer": optimizer})["epoch"]
    for epoch in range(first_epoch, epochs):
        for i, (x, y) in enumerate(data):
            step = (i + 1) % ACCUMULATE == 0
            with fabric.no_backward_sync(model, enabled=not step):
                loss = F.mse_loss(model(x), y)
                fabric.backward(loss / ACCUMULATE)
                if kind != "ddp":
                    assert_engine_clean(model.module)
            record["loss"].append(loss.item())
            if not step:  # shardwise keeps the micro-batch's gradients unreduced: p.grad is zeros until the synced backward
                record["deferred"].append(all(not p.grad.any() for p in model.parameters()))
                continue
            record["grad_norm"].append(fabric.clip_gradients(model, optimizer, max_norm=CLIP).item())
            optimizer.step()
            optimizer.zero_grad()
        if epoch == 0 and not resume_from:
            fabric.save(root / f"{name}-epoch1.ckpt", {"model": model, "optimizer": optimizer, "epoch": 1})
    fabric.save(root / f"{name}.ckpt", {"model": model, "optimizer": optimizer, "epoch": epochs})
    return record


def fabric_runs(rank: int, world_size: int, root: str) -> dict:
    """Fabric at ``world_size``: DDP's loop and ours (eager; on the meta device with other shard options; hybrid
    over a mesh given as sizes), ours resumed from its first epoch, the model reloaded alone."""
    root = Path(root)
    return {"ddp": fabric_loop("ddp", world_size, root, "fabric-ddp"),
            "shardwise": fabric_loop("shardwise", world_size, root, "fabric"),
            "resumed": fabric_loop("shardwise", world_size, root, "fabric-resumed", resume_from="fabric"),
            "meta": fabric_loop("shardwise", world_size, root, "fabric-meta", meta=True,
                                sharding_strategy="shard_grad_op", activation_checkpointing=True),
            "hybrid": fabric_loop("shardwise", world_size, root, "fabric-hybrid", sharding_strategy="hybrid_shard",
                                  mesh=(world_size, 1)),
            "reloaded": fabric_reload(world_size, root)}


def fabric_reload(world_size: int, root: Path) -> list:
    """The model alone (no optimizer, so from the file's whole state dict, strict and not) into a new sharded
    Tower, saved again; and what ``fabric.load`` leaves of the file."""
    fabric = L.Fabric(accelerator="cpu", devices=world_size, strategy=ShardwiseFabricStrategy())
    fabric.launch()
    model = fabric.setup(Tower())
    remainders = []
    for strict in (True, False):
        remainder = fabric.load(root / "fabric.ckpt", {"model": model}, strict=strict)
        remainders.append(sorted(remainder))
        fabric.save(root / f"fabric-reloaded-{strict}.ckpt", {"model": model})
    return remainders


def other_files(world_size: int, root: Path) -> dict:
    """Checkpoints without a sidecar of ours: a weights-only one and DDP's evaluate from their whole state dict;
    resuming from them, or from our file moved away from its sidecar, fails on every rank with what to do."""
    validate = lambda path: trainer("shardwise", world_size, root).validate(  # noqa: E731
        Net(lazy=False), loader(N_EVAL, 2, world_size), ckpt_path=path, verbose=False)[0]["val_loss"]
    resume = lambda path: fit("shardwise", world_size, root, ckpt_path=path)  # noqa: E731
    moved = root / "moved" / "shardwise.ckpt"
    if torch.distributed.get_rank() == 0:
        moved.parent.mkdir(exist_ok=True)
        moved.write_bytes((root / "shardwise.ckpt").read_bytes())
    torch.distributed.barrier()
    return {"weights_only": validate(root / "shardwise-weights.ckpt"), "ddp": validate(root / "ddp.ckpt"),
            "resume_weights_only": error_of(lambda: resume(root / "shardwise-weights.ckpt")),
            "resume_ddp": error_of(lambda: resume(root / "ddp.ckpt")),
            "moved": error_of(lambda: validate(moved))}


def top_k_checkpoints(root: Path) -> list[str]:
    """ModelCheckpoint(save_top_k=1) over two epochs: what is left in its directory."""
    directory = root / "top-k"
    callback = ModelCheckpoint(dirpath=directory, monitor="val_loss", save_top_k=1, every_n_epochs=1)
    fit("shardwise", torch.distributed.get_world_size(), root, enable_checkpointing=True, callbacks=[callback])
    torch.distributed.barrier()  # rank 0 removes the worse checkpoint
    return sorted(p.name for p in directory.iterdir())


class Gan(L.LightningModule):
    """Lightning's manual-optimisation GAN as its docs write one: two optimizers stepped inside
    ``training_step``, each between ``toggle_optimizer`` and ``untoggle_optimizer``; the generator's pass runs
    through the discriminator the step before changed. Both heads live in the root unit, gathered around
    ``training_step``."""

    def __init__(self):
        super().__init__()
        self.automatic_optimization = False
        self.generator = nn.Sequential(*(Block() for _ in range(DEPTH)), nn.Linear(DIM, DIM))
        self.discriminator = Tower()
        self.record: dict[str, list] = {"loss": []}

    def training_step(self, batch, batch_idx):
        x, _ = batch
        g_opt, d_opt = self.optimizers()
        z = x.flip(1)  # the same noise under both strategies
        self.toggle_optimizer(d_opt)
        d_loss = (F.softplus(-self.discriminator(x)).mean()
                  + F.softplus(self.discriminator(self.generator(z).detach())).mean())
        self.manual_backward(d_loss)
        d_opt.step()
        d_opt.zero_grad()
        self.untoggle_optimizer(d_opt)
        self.toggle_optimizer(g_opt)
        g_loss = F.softplus(-self.discriminator(self.generator(z))).mean()
        self.manual_backward(g_loss)
        g_opt.step()
        g_opt.zero_grad()
        self.untoggle_optimizer(g_opt)
        self.record["loss"] += [d_loss.item(), g_loss.item()]

    def configure_optimizers(self):
        return [torch.optim.Adam(self.generator.parameters(), lr=0.01, betas=(0.5, 0.999)),
                torch.optim.Adam(self.discriminator.parameters(), lr=0.01, betas=(0.5, 0.999))]


def gan_runs(rank: int, world_size: int, root: str) -> dict:
    """The GAN under DDP (``find_unused_parameters``, as Lightning's docs ask for toggled optimizers) and ours:
    each one's losses and its whole model at the end."""
    out = {}
    for kind in ("ddp", "shardwise"):
        L.seed_everything(0, verbose=False)
        model = Gan()
        strategy = (DDPStrategy(cluster_environment=ProcessGroupEnvironment(), find_unused_parameters=True)
                    if kind == "ddp" else ShardwiseStrategy())
        L.Trainer(strategy=strategy, accelerator="cpu", devices=world_size, max_epochs=2, logger=False,
                  enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                  default_root_dir=root).fit(model, loader(N_TRAIN, 1, world_size))
        whole = {k: v.clone() for k, v in model.state_dict().items()} if kind == "ddp" else \
            ckpt.whole_model_state_dict(model)
        out[kind] = {"loss": model.record["loss"], "state_dict": whole}
    return out


def sharded_runs(rank: int, world_size: int, root: str) -> dict:
    """``state_dict_type="sharded"``: the Trainer's fit saved (with and without optimizer state) and resumed
    after its first epoch; validate from those files on a fresh model; Fabric's loop saved and resumed; and a
    "full" save whose whole model rank 0's memory could not hold (``available_host_memory`` made small on rank
    0 only)."""
    from shardwise.integrations import lightning_checkpoint

    root = Path(root)
    sharded = lambda: ShardwiseStrategy(state_dict_type="sharded")  # noqa: E731
    model, t, val = fit(sharded(), world_size, root)
    t.save_checkpoint(root / "sharded.ckpt")
    t.save_checkpoint(root / "sharded-weights.ckpt", weights_only=True)
    out = {"record": model.record, "val_loss": val}
    out["from_ckpt"] = {name: trainer(sharded(), world_size, root).validate(
        Net(lazy=False), loader(N_EVAL, 2, world_size), ckpt_path=root / name, verbose=False)[0]["val_loss"]
        for name in ("sharded.ckpt", "sharded-weights.ckpt")}
    first, t, _ = fit(sharded(), world_size, root, max_epochs=1)
    t.save_checkpoint(root / "sharded-epoch1.ckpt")
    resumed, _, val = fit(sharded(), world_size, root, ckpt_path=root / "sharded-epoch1.ckpt")
    out["resumed"] = {"record": resumed.record, "first_epoch": first.record, "val_loss": val}
    out["fabric"] = fabric_loop("shardwise", world_size, root, "fabric-sharded", state_dict_type="sharded")
    out["fabric_resumed"] = fabric_loop("shardwise", world_size, root, "fabric-sharded-resumed",
                                        resume_from="fabric-sharded", state_dict_type="sharded")
    full = trainer("shardwise", world_size, root)
    full.validate(Net(lazy=False), loader(N_EVAL, 2, world_size), verbose=False)
    real = lightning_checkpoint.available_host_memory
    if rank == 0:
        lightning_checkpoint.available_host_memory = lambda: 1799  # bytes: the whole model is 900, held twice
    try:
        out["too_big"] = error_of(lambda: full.save_checkpoint(root / "too-big.ckpt"))
    finally:
        lightning_checkpoint.available_host_memory = real
    torch.distributed.barrier()
    out["too_big_written"] = sorted(p.name for p in root.iterdir() if p.name.startswith("too-big"))
    return out
