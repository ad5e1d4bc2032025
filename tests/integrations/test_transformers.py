"""shardwise.integrations.transformers: Hugging Face Trainer and TRL's SFTTrainer on a sharded model, against
the same Trainer's own DDP run on the same data (gloo, CPU).

- ShardwiseTrainer from a model directory, fp32, gradient accumulation and clipping active: losses, gradient
  norms, evaluation and predictions, the saved model (``from_pretrained`` in one process) and every
  checkpoint's model DDP's (bit for bit at 2 ranks, to 1e-6 at 3); ``resume_from_checkpoint`` equal to the
  run it continues, at the same world size and at another one (the DDP run resumed there from its own
  checkpoint); a ``save_only_model=True`` checkpoint (weights alone) resumes as DDP's Trainer resumes it.
- peft LoRA (``peft_config``, SGD with momentum): the saved adapter DDP's to 1e-6 (``get_peft_model`` after the
  same seed: the same initial adapters).
- TRL's SFTTrainer with its defaults (bf16 autocast, gradient checkpointing, lr 2e-5) behind the mixin: within
  BF16_RTOL of DDP's (losses and weight updates).
- TRL's DPOTrainer (whose __init__ takes ref_model second, args third) and RewardTrainer from a causal LM's
  directory (TRL's sequence classifier, its new score head drawn as TRL draws it), fp32: DDP's losses and
  saved model;
  a bf16 directory read in the dtype TRL reads it in (float32 unless model_init_kwargs says otherwise).
- QLoRA: ``BitsAndBytesConfig(load_in_4bit=True)`` becomes shardwise's 4-bit base (bitsandbytes never imported).
- Every private Trainer method the mixin replaces still exists with the parameters it was written for.

One spawn per world size runs the scenarios (``run_scenarios``); each scenario runs DDP's Trainer and then
ours in the same processes.
"""

from __future__ import annotations

import inspect
import json
import os
import sys

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("peft")

from harness import run_distributed
from hf_dirs import make_model_dir
from parity_utils import run_scenarios, scenario, spawn_once

SEQ, VOCAB_USED = 16, 300
BF16_DIR = "llama-bf16"  # beside the fp32 model directory: the same model stored in bf16, as most checkpoints are
STEPS, SAVE_AT = 4, 2
# TRL's defaults compute every matmul in bf16 (autocast) from the same fp32 weights in both runs: the losses
# come out bitwise, the weight updates (3 AdamW steps at lr 2e-5, clipped at 1.0) 1.5e-6 apart, relative to
# the update (the gradient norm sums the ranks' pieces in another order than torch's norm of whole
# gradients). The bound leaves room for bf16 activations to round such a difference up.
BF16_RTOL = 1e-4


class TokenRows(torch.utils.data.Dataset):
    """Fixed-length rows of token ids, labels = inputs (the model shifts them)."""

    def __init__(self, n: int, seed: int = 0):
        self.rows = torch.randint(2, VOCAB_USED, (n, SEQ), generator=torch.Generator().manual_seed(seed))

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.rows[i], "labels": self.rows[i]}


def _args(out: str, **overrides):
    from transformers import TrainingArguments

    kw = dict(output_dir=out, per_device_train_batch_size=2, per_device_eval_batch_size=2, gradient_accumulation_steps=2,
              max_steps=STEPS, learning_rate=1e-3, max_grad_norm=0.5, logging_steps=1, save_steps=SAVE_AT,
              eval_strategy="steps", eval_steps=SAVE_AT, report_to=[], seed=0, use_cpu=True, disable_tqdm=True,
              dataloader_num_workers=0)
    kw.update(overrides)
    return TrainingArguments(**kw)


def _history(trainer) -> list:
    return [{k: v for k, v in h.items() if k in ("loss", "grad_norm", "eval_loss", "step")}
            for h in trainer.state.log_history if "loss" in h or "eval_loss" in h]


def _ddp_model(model_dir: str, peft_config=None, seed: int = 0):
    """What a DDP user writes: from_pretrained, then (as TRL does) the seed and get_peft_model."""
    from transformers import AutoModelForCausalLM, set_seed

    model = AutoModelForCausalLM.from_pretrained(model_dir)
    if peft_config is not None:
        from peft import get_peft_model

        set_seed(seed)
        model = get_peft_model(model, peft_config)
    return model


def _train(kind: str, root: str, model_dir: str, name: str, resume: str | None = None, peft_config=None,
           **arg_overrides) -> dict:
    """One Trainer run (``kind`` ddp or shardwise) into ``root/name``: its history, eval and predictions."""
    from transformers import Trainer

    from shardwise.integrations.transformers import ShardwiseTrainer

    args = _args(os.path.join(root, name), **arg_overrides)
    data = dict(train_dataset=TokenRows(64), eval_dataset=TokenRows(6, seed=1))
    if kind == "ddp":
        trainer = Trainer(model=_ddp_model(model_dir, peft_config), args=args, **data)
    else:
        trainer = ShardwiseTrainer(model=model_dir, args=args, peft_config=peft_config, **data)
    trainer.train(resume_from_checkpoint=resume)
    trainer.save_model(os.path.join(root, name, "final"))
    predictions = trainer.predict(TokenRows(3, seed=2)).predictions
    return {"history": _history(trainer), "eval": trainer.evaluate()["eval_loss"],
            "predictions": torch.as_tensor(predictions), "wrapper": type(trainer.model_wrapped).__name__}


def _tensors(directory: str) -> dict:
    from safetensors.torch import load_file

    return {k: v for n in sorted(os.listdir(directory)) if n.endswith(".safetensors")
            for k, v in load_file(os.path.join(directory, n)).items()}


def _same_files(a: str, b: str) -> bool:
    x, y = _tensors(a), _tensors(b)
    return x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)


def _files_rel(a: str, b: str) -> float:
    """The largest relative difference, tensor by tensor, between the safetensors of two directories (1.0 when
    they do not hold the same names)."""
    x, y = _tensors(a), _tensors(b)
    if x.keys() != y.keys():
        return 1.0
    return max(((x[k].double() - y[k].double()).norm() / y[k].double().norm()).item() for k in y)


def _trainer_vs_ddp(rank: int, world: int, root: str, model_dir: str) -> dict:
    from transformers import AutoModelForCausalLM

    runs = {kind: _train(kind, root, model_dir, f"{kind}-{world}") for kind in ("ddp", "shardwise")}
    resumed = _train("shardwise", root, model_dir, f"shardwise-{world}-resumed",
                     resume=os.path.join(root, f"shardwise-{world}", f"checkpoint-{SAVE_AT}"))
    ddp, ours = runs["ddp"], runs["shardwise"]
    out = {"wrappers": (ddp["wrapper"], ours["wrapper"]),
           "history_rel": _history_rel(ddp["history"], ours["history"]),
           "eval_rel": abs(ddp["eval"] - ours["eval"]) / ddp["eval"],
           "predictions_rel": ((ddp["predictions"] - ours["predictions"]).abs().max()
                               / ddp["predictions"].abs().max()).item(),
           "resumed": resumed["history"] == ours["history"]}  # the first steps from trainer_state.json
    if rank == 0:
        mine, theirs = (os.path.join(root, f"{kind}-{world}") for kind in ("shardwise", "ddp"))
        out["saved_rel"] = max(_files_rel(f"{mine}/final", f"{theirs}/final"),
                               _files_rel(f"{mine}/checkpoint-{SAVE_AT}", f"{theirs}/checkpoint-{SAVE_AT}"))
        loaded = AutoModelForCausalLM.from_pretrained(f"{mine}/final").state_dict()
        saved = _tensors(f"{mine}/final")
        out["loaded"] = loaded.keys() == saved.keys() and all(torch.equal(loaded[k], saved[k]) for k in saved)
        out["files"] = sorted(os.listdir(f"{mine}/checkpoint-{SAVE_AT}"))
    return out


def _history_rel(a: list, b: list) -> float:
    """The largest relative difference of two histories' losses, gradient norms and eval losses (their steps
    equal)."""
    assert [h["step"] for h in a] == [h["step"] for h in b], (a, b)
    return max(abs(x[k] - y[k]) / abs(x[k]) for x, y in zip(a, b) for k in ("loss", "grad_norm", "eval_loss") if k in x)


def _lora_config():
    from peft import LoraConfig

    return LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"], task_type="CAUSAL_LM")


def _lora_vs_ddp(rank: int, world: int, root: str, model_dir: str) -> dict:
    runs = {kind: _train(kind, root, model_dir, f"lora-{kind}-{world}", peft_config=_lora_config(),
                         eval_strategy="no", max_grad_norm=0.02, optim="sgd", optim_args="momentum=0.9",
                         learning_rate=0.5) for kind in ("ddp", "shardwise")}
    out = {"history_rel": _history_rel(runs["ddp"]["history"], runs["shardwise"]["history"]),
           "wrappers": (runs["ddp"]["wrapper"], runs["shardwise"]["wrapper"]),
           "clipped": min(h["grad_norm"] for h in runs["ddp"]["history"]) > 0.02}
    if rank == 0:
        ours, theirs = (os.path.join(root, f"lora-{kind}-{world}", "final") for kind in ("shardwise", "ddp"))
        out["adapter_rel"] = _files_rel(ours, theirs)
        out["files"] = sorted(n for n in os.listdir(ours) if n.startswith("adapter"))
    return out


def _sft(kind: str, root: str, model_dir: str, name: str) -> dict:
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    from shardwise.integrations.transformers import ShardwiseTrainerMixin

    class ShardwiseSFTTrainer(ShardwiseTrainerMixin, SFTTrainer):
        pass

    from hf_dirs import CORPUS

    data = Dataset.from_dict({"text": CORPUS[:16]})
    args = SFTConfig(output_dir=os.path.join(root, name), max_steps=3, per_device_train_batch_size=2, report_to=[],
                     use_cpu=True, disable_tqdm=True, logging_steps=1, save_strategy="no", seed=0,
                     dataloader_num_workers=0, max_length=32)  # everything else: TRL's defaults
    cls = SFTTrainer if kind == "ddp" else ShardwiseSFTTrainer
    trainer = cls(model=model_dir, args=args, train_dataset=data)
    trainer.train()
    trainer.save_model(os.path.join(root, name, "final"))
    return {"history": _history(trainer), "bf16": trainer.args.bf16,
            "checkpointing": trainer.args.gradient_checkpointing, "wrapper": type(trainer.model_wrapped).__name__}


def _sft_vs_ddp(rank: int, world: int, root: str, model_dir: str) -> dict:
    runs = {kind: _sft(kind, root, model_dir, f"sft-{kind}-{world}") for kind in ("ddp", "shardwise")}
    losses = [(a["loss"], b["loss"]) for a, b in zip(runs["ddp"]["history"], runs["shardwise"]["history"])]
    out = {"loss_rel": max(abs(a - b) / abs(a) for a, b in losses), "steps": len(losses),
           "defaults": (runs["shardwise"]["bf16"], runs["shardwise"]["checkpointing"]),
           "wrappers": (runs["ddp"]["wrapper"], runs["shardwise"]["wrapper"])}
    if rank == 0:
        x, y = (_tensors(os.path.join(root, f"sft-{kind}-{world}", "final")) for kind in ("shardwise", "ddp"))
        start = _tensors(model_dir)
        # what training changed, in both runs: the weights themselves barely move at lr 2e-5
        out["update_rel"] = (sum((x[k] - y[k]).norm() ** 2 for k in y) ** 0.5
                             / sum((y[k] - start[k]).norm() ** 2 for k in y) ** 0.5).item()
        out["names"] = x.keys() == y.keys()
    return out


def _dpo(kind: str, root: str, model_dir: str, name: str) -> dict:
    """TRL's DPOTrainer called as its docs call it (model=, args=; its __init__ takes ref_model second, args
    third): ref_model None, so TRL builds the reference from the model's directory."""
    from datasets import Dataset
    from transformers import AutoTokenizer
    from trl import DPOConfig, DPOTrainer

    from shardwise.integrations.transformers import ShardwiseTrainerMixin

    class ShardwiseDPOTrainer(ShardwiseTrainerMixin, DPOTrainer):
        pass

    data = Dataset.from_dict(_preferences())
    # SGD with momentum: AdamW's first steps move embedding rows whose gradient is reduction-order noise by
    # a fraction of lr (1e-4 apart at 3 ranks), which would hide what this compares
    args = DPOConfig(output_dir=os.path.join(root, name), max_steps=2, per_device_train_batch_size=2, report_to=[],
                     use_cpu=True, disable_tqdm=True, logging_steps=1, save_strategy="no", seed=0, bf16=False,
                     dataloader_num_workers=0, max_length=24, optim="sgd", optim_args="momentum=0.9",
                     learning_rate=0.5)
    cls = DPOTrainer if kind == "ddp" else ShardwiseDPOTrainer
    trainer = cls(model=model_dir, args=args, train_dataset=data,
                  processing_class=AutoTokenizer.from_pretrained(model_dir))
    trainer.train()
    trainer.save_model(os.path.join(root, name, "final"))
    return {"history": _history(trainer), "wrapper": type(trainer.model_wrapped).__name__,
            "ref": type(trainer.ref_model).__name__}


def _dpo_vs_ddp(rank: int, world: int, root: str, model_dir: str) -> dict:
    runs = {kind: _dpo(kind, root, model_dir, f"dpo-{kind}-{world}") for kind in ("ddp", "shardwise")}
    out = {"history_rel": _history_rel(runs["ddp"]["history"], runs["shardwise"]["history"]),
           "steps": len(runs["shardwise"]["history"]), "ref": runs["shardwise"]["ref"],
           "wrappers": (runs["ddp"]["wrapper"], runs["shardwise"]["wrapper"])}
    if rank == 0:
        out["saved_rel"] = _files_rel(*(os.path.join(root, f"dpo-{kind}-{world}", "final") for kind in ("shardwise", "ddp")))
    return out


def _save_only_model_resumed(rank: int, world: int, root: str, model_dir: str) -> dict:
    """``save_only_model=True`` checkpoints hold the weights alone (the same files from either run): each kind
    resumed from its own, the optimizer and scheduler starting afresh, as the DDP Trainer starts them."""
    for kind in ("ddp", "shardwise"):
        _train(kind, root, model_dir, f"only-{kind}-{world}", eval_strategy="no", save_only_model=True)
    runs = {kind: _train(kind, root, model_dir, f"only-{kind}-{world}-resumed", eval_strategy="no", save_only_model=True,
                         resume=os.path.join(root, f"only-{kind}-{world}", f"checkpoint-{SAVE_AT}"))
            for kind in ("ddp", "shardwise")}
    a, b = ([h for h in runs[k]["history"] if h["step"] > SAVE_AT] for k in ("ddp", "shardwise"))
    return {"steps": [h["step"] for h in b], "history_rel": _history_rel(a, b),
            "files": sorted(os.listdir(os.path.join(root, f"only-shardwise-{world}", f"checkpoint-{SAVE_AT}")))}


def _preferences(n: int = 16) -> dict:
    """Prompts, chosen and rejected answers in the corpus's words."""
    from hf_dirs import CORPUS

    words = " ".join(CORPUS).split()
    rows = [" ".join(words[(7 * i + k) % len(words)] for k in range(m)) for i in range(n) for m in (4, 5, 6)]
    return {"prompt": rows[0::3], "chosen": rows[1::3], "rejected": rows[2::3]}


def _reward(kind: str, root: str, model_dir: str, name: str) -> dict:
    """TRL's RewardTrainer from a causal LM's directory: TRL builds a sequence classifier (num_labels=1, a new
    score head drawn after set_seed(args.seed))."""
    from datasets import Dataset
    from transformers import AutoTokenizer
    from trl import RewardConfig, RewardTrainer

    from shardwise.integrations.transformers import ShardwiseTrainerMixin

    class ShardwiseRewardTrainer(ShardwiseTrainerMixin, RewardTrainer):
        pass

    rows = _preferences()
    data = Dataset.from_dict({k: [p + " " + a for p, a in zip(rows["prompt"], rows[k])] for k in ("chosen", "rejected")})
    args = RewardConfig(output_dir=os.path.join(root, name), max_steps=2, per_device_train_batch_size=2, report_to=[],
                        use_cpu=True, disable_tqdm=True, logging_steps=1, save_strategy="no", seed=0, bf16=False,
                        dataloader_num_workers=0, max_length=24, learning_rate=1e-3)
    cls = RewardTrainer if kind == "ddp" else ShardwiseRewardTrainer
    trainer = cls(model=model_dir, args=args, train_dataset=data, processing_class=AutoTokenizer.from_pretrained(model_dir))
    trainer.train()
    trainer.save_model(os.path.join(root, name, "final"))
    return {"history": _history(trainer), "model": type(trainer.accelerator.unwrap_model(trainer.model)).__name__}


def _reward_vs_ddp(rank: int, world: int, root: str, model_dir: str) -> dict:
    runs = {kind: _reward(kind, root, model_dir, f"reward-{kind}-{world}") for kind in ("ddp", "shardwise")}
    out = {"history_rel": _history_rel(runs["ddp"]["history"], runs["shardwise"]["history"]),
           "steps": len(runs["shardwise"]["history"]), "models": (runs["ddp"]["model"], runs["shardwise"]["model"])}
    if rank == 0:
        out["saved_rel"] = _files_rel(*(os.path.join(root, f"reward-{kind}-{world}", "final")
                                        for kind in ("shardwise", "ddp")))
    return out


def _trl_dtypes(rank: int, world: int, root: str, model_dir: str) -> dict:
    """The dtype each TRL trainer reads a bf16 model directory in, ours and TRL's own (construction only)."""
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    from shardwise.integrations.transformers import ShardwiseTrainerMixin

    class ShardwiseSFTTrainer(ShardwiseTrainerMixin, SFTTrainer):
        pass

    out = {}
    for cls in (SFTTrainer, ShardwiseSFTTrainer):
        for init_kwargs in (None, {"dtype": "bfloat16"}):
            args = SFTConfig(output_dir=os.path.join(root, f"dtype-{world}"), report_to=[], use_cpu=True, bf16=False,
                             model_init_kwargs=init_kwargs)
            trainer = cls(model=os.path.join(root, BF16_DIR), args=args, train_dataset=Dataset.from_dict({"text": ["a b"]}))
            out[f"{cls.__name__} {init_kwargs}"] = sorted({str(p.dtype) for p in trainer.model.parameters()})
    return out


def _qlora(rank: int, world: int, root: str, model_dir: str) -> dict:
    from transformers import BitsAndBytesConfig

    from shardwise.integrations.transformers import ShardwiseTrainer
    from shardwise.quant.linear import QuantLinear

    trainer = ShardwiseTrainer(model=model_dir, args=_args(os.path.join(root, f"qlora-{world}"), eval_strategy="no",
                                                           max_steps=2, save_steps=1),
                               train_dataset=TokenRows(32), peft_config=_lora_config(),
                               quantization_config=BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                                                      bnb_4bit_use_double_quant=True))
    trainer.train()
    losses = [h["loss"] for h in _history(trainer)]
    trainer.save_model(os.path.join(root, f"qlora-{world}", "final"))
    manifest = json.loads(open(os.path.join(root, f"qlora-{world}", "checkpoint-2", "shardwise_state",
                                            "manifest.json")).read())
    return {"quant_linears": sum(isinstance(m, QuantLinear) for m in trainer.model.modules()),
            "bitsandbytes_importable": _importable("bitsandbytes"), "losses": losses,
            "adapter": sorted(os.listdir(os.path.join(root, f"qlora-{world}", "final"))),
            "frozen_base": manifest["frozen_base"]["quantization"]}


def _refusals(rank: int, world: int, root: str, model_dir: str) -> dict:
    """A DDP Trainer checkpoint to resume from, model_init, and FSDP settings for a model sharded already are
    refused by name on every rank."""
    from shardwise.errors import ShardwiseError
    from shardwise.integrations.transformers import ShardwiseTrainer

    out = {}
    try:
        ShardwiseTrainer(model=model_dir, args=_args(os.path.join(root, f"refused-{world}"), eval_strategy="no"),
                         train_dataset=TokenRows(16)).train(
            resume_from_checkpoint=os.path.join(root, f"ddp-{world}", f"checkpoint-{SAVE_AT}"))
    except ShardwiseError as e:
        out["ddp_checkpoint"] = str(e)
    try:
        ShardwiseTrainer(model_init=lambda: None, args=_args(os.path.join(root, f"refused-{world}")))
    except ShardwiseError as e:
        out["model_init"] = str(e)
    import shardwise

    try:
        ShardwiseTrainer(model=shardwise.shard(_ddp_model(model_dir)), train_dataset=TokenRows(8),
                         args=_args(os.path.join(root, f"refused-{world}"), fsdp="full_shard", eval_strategy="no"))
    except ShardwiseError as e:
        out["sharded_and_fsdp"] = str(e)
    return out


def _fsdp_args(rank: int, world: int, root: str, model_dir: str) -> dict:
    """TrainingArguments' FSDP settings, as a Trainer user writes them, shard the model as they say, and rank 0
    prints what each became in one line."""
    import contextlib
    import io

    from shardwise.engine.core.runtime import runtime_of
    from shardwise.integrations.transformers import ShardwiseTrainer

    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        trainer = ShardwiseTrainer(model=model_dir, args=_args(
            os.path.join(root, f"fsdp-{world}"), fsdp="shard_grad_op auto_wrap", eval_strategy="no",
            fsdp_config={"transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"]}), train_dataset=TokenRows(8))
    rt = runtime_of(trainer.model)
    return {"strategy": rt.strategy.value, "units": len(rt.units), "printed": printed.getvalue()}


def _importable(name: str) -> bool:
    try:
        __import__(name)
    except ImportError:
        return False
    return True


def _scenarios(rank: int, world: int, root: str, model_dir: str) -> dict:
    # bitsandbytes as not installed (an entry of None makes find_spec answer None and import raise), before
    # transformers and peft look: the QLoRA scenario needs none of it.
    sys.modules["bitsandbytes"] = None
    return run_scenarios({
        "trainer": lambda r, w: _trainer_vs_ddp(r, w, root, model_dir),
        "lora": lambda r, w: _lora_vs_ddp(r, w, root, model_dir),
        "sft": lambda r, w: _sft_vs_ddp(r, w, root, model_dir),
        "dpo": lambda r, w: _dpo_vs_ddp(r, w, root, model_dir),
        "save_only_model": lambda r, w: _save_only_model_resumed(r, w, root, model_dir),
        "reward": lambda r, w: _reward_vs_ddp(r, w, root, model_dir),
        "trl_dtypes": lambda r, w: _trl_dtypes(r, w, root, model_dir),
        "qlora": lambda r, w: _qlora(r, w, root, model_dir),
        "refusals": lambda r, w: _refusals(r, w, root, model_dir),
        "fsdp_args": lambda r, w: _fsdp_args(r, w, root, model_dir),
    }, rank, world)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("trainer")
    make_model_dir(str(root / BF16_DIR), "llama", dtype=torch.bfloat16)
    return str(root), make_model_dir(str(root / "llama"), "llama")


@spawn_once
def _report(world: int, root: str, model_dir: str) -> list:
    return run_distributed(_scenarios, world, root, model_dir, timeout_s=180)


WORLDS = [2, pytest.param(3, marks=pytest.mark.slow)]


# At 2 ranks every sum of the ranks' gradients has two terms and one order: the runs agree bit for bit. At 3
# DDP's bucketed all-reduce and the reduce-scatter add the three in other orders.
FP32_RTOL = {2: 0.0, 3: 1e-6}


@pytest.mark.parametrize("world", WORLDS)
def test_trainer_is_ddps_trainer_and_resumes(world, dirs):
    for rank, report in enumerate(_report(world, *dirs)):
        r = scenario(report, "trainer")
        assert r["wrappers"] == ("DistributedDataParallel", "LlamaForCausalLM"), "DDP's run is DDP; ours unwrapped"
        # losses, gradient norms (clipped at 0.5, accumulating 2), eval losses; evaluate(), predict()
        assert max(r["history_rel"], r["eval_rel"], r["predictions_rel"]) <= FP32_RTOL[world], r
        assert r["resumed"], "resume_from_checkpoint continues exactly as the uninterrupted run"
        if rank == 0:
            assert r["saved_rel"] <= FP32_RTOL[world], "save_model and the checkpoint's model are DDP's"
            assert r["loaded"], "from_pretrained in one process loads what was saved"
            assert "shardwise_state" in r["files"] and "optimizer.pt" not in r["files"], r["files"]


@pytest.mark.parametrize("world", WORLDS)
def test_trainer_lora_adapter_is_ddps(world, dirs):
    r = scenario(_report(world, *dirs)[0], "lora")
    assert r["clipped"], "every step clips (max_grad_norm 0.02)"
    assert r["wrappers"] == ("DistributedDataParallel", "PeftModelForCausalLM"), r
    # SGD with momentum (the plain run above is AdamW). The losses come out bitwise; the gradient norm sums
    # the ranks' pieces in another order than torch's norm of whole gradients (1e-7 apart), and the clipping
    # coefficient carries that into the adapters.
    assert r["history_rel"] <= 1e-6 and r["adapter_rel"] <= 1e-6, r
    assert r["files"] == ["adapter_config.json", "adapter_model.safetensors"]


@pytest.mark.parametrize("world", WORLDS)
def test_sft_trainer_with_trls_defaults_is_ddps_within_bf16(world, dirs):
    r = scenario(_report(world, *dirs)[0], "sft")
    assert r["defaults"] == (True, True), "TRL's defaults: bf16 autocast, gradient checkpointing"
    assert r["wrappers"] == ("DistributedDataParallel", "LlamaForCausalLM"), r
    assert r["steps"] == 3 and r["names"], r
    assert r["loss_rel"] <= BF16_RTOL and r["update_rel"] <= BF16_RTOL, r


@pytest.mark.parametrize("world", WORLDS)
def test_trainer_resumes_a_save_only_model_checkpoint_as_ddps_trainer(world, dirs):
    r = scenario(_report(world, *dirs)[0], "save_only_model")
    assert "shardwise_state" not in r["files"] and "model.safetensors" in r["files"], r
    assert r["steps"] == [3, 4] and r["history_rel"] <= 1e-6, r


@pytest.mark.parametrize("world", WORLDS)
def test_dpo_trainer_is_ddps(world, dirs):
    """DPOTrainer takes ref_model second and args third: the mixin passes each on by name (it once handed
    args= to DPOTrainer as ref_model, and DPOTrainer built its default DPOConfig)."""
    r = scenario(_report(world, *dirs)[0], "dpo")
    assert r["wrappers"] == ("DistributedDataParallel", "LlamaForCausalLM") and r["ref"] == "LlamaForCausalLM", r
    # the gradient norm sums the ranks' pieces in another order than torch's norm of whole gradients (2e-7)
    assert r["steps"] == 2 and r["history_rel"] <= 1e-6 and r["saved_rel"] <= FP32_RTOL[world], r


@pytest.mark.parametrize("world", WORLDS)
def test_reward_trainer_from_a_directory_builds_trls_sequence_classifier_and_is_ddps(world, dirs):
    r = scenario(_report(world, *dirs)[0], "reward")
    assert r["models"] == ("LlamaForSequenceClassification",) * 2, r
    assert r["steps"] == 2 and r["history_rel"] <= 1e-6 and r["saved_rel"] <= FP32_RTOL[world], r


@pytest.mark.parametrize("world", WORLDS)
def test_trl_trainers_read_a_directory_in_the_dtype_trl_reads_it(world, dirs):
    """TRL reads a directory in float32 unless model_init_kwargs names a dtype (from_pretrained's "auto" would
    train a bf16 checkpoint's weights in bf16)."""
    r = scenario(_report(world, *dirs)[0], "trl_dtypes")
    assert r["SFTTrainer None"] == r["ShardwiseSFTTrainer None"] == ["torch.float32"], r
    assert r["SFTTrainer {'dtype': 'bfloat16'}"] == r["ShardwiseSFTTrainer {'dtype': 'bfloat16'}"] == ["torch.bfloat16"], r


@pytest.mark.parametrize("world", WORLDS)
def test_qlora_through_bitsandbytes_config_is_shardwises_4bit_base(world, dirs):
    r = scenario(_report(world, *dirs)[0], "qlora")
    assert r["quant_linears"] == 14 and not r["bitsandbytes_importable"], r
    assert len(r["losses"]) == 2 and all(l == l for l in r["losses"]), r
    assert r["adapter"][:2] == ["adapter_config.json", "adapter_model.safetensors"], r
    assert r["frozen_base"]["quant_type"] == "nf4" and r["frozen_base"]["double_quant"], r


@pytest.mark.parametrize("world", WORLDS)
def test_trainer_refuses_ddp_checkpoints_and_model_init_by_name(world, dirs):
    for report in _report(world, *dirs):
        r = scenario(report, "refusals")
        assert "has no shardwise_state/" in r["ddp_checkpoint"], r
        assert r["model_init"].startswith("model_init:"), r
        assert r["sharded_and_fsdp"].startswith("args.fsdp: this model is already sharded"), r


@pytest.mark.parametrize("world", WORLDS)
def test_trainer_shards_as_fsdp_settings_say_and_says_so_in_one_line_on_rank_0(world, dirs):
    reports = [scenario(report, "fsdp_args") for report in _report(world, *dirs)]
    assert all(r["strategy"] == "shard_grad_op" and r["units"] == 3 for r in reports), reports
    assert reports[0]["printed"] == ("shardwise: fsdp_config reshard_after_forward=False -> strategy shard_grad_op; "
                                     "transformer_layer_cls_to_wrap LlamaDecoderLayer -> one unit each; units: 2 "
                                     "LlamaDecoderLayer + the root\n")
    assert all(r["printed"] == "" for r in reports[1:]), reports


def _resume_elsewhere(rank: int, world: int, root: str, model_dir: str, saved_at: int) -> dict:
    """Each kind resumed at this world size from its own checkpoint written at ``saved_at`` ranks."""
    runs = {kind: _train(kind, root, model_dir, f"{kind}-{saved_at}-at-{world}", eval_strategy="no",
                         resume=os.path.join(root, f"{kind}-{saved_at}", f"checkpoint-{SAVE_AT}"))
            for kind in ("ddp", "shardwise")}
    a, b = ([h for h in runs[k]["history"] if h["step"] > SAVE_AT and "loss" in h] for k in ("ddp", "shardwise"))
    return {"steps": [h["step"] for h in b],
            "loss_rel": max(abs(x["loss"] - y["loss"]) / x["loss"] for x, y in zip(a, b)),
            "grad_norm_rel": max(abs(x["grad_norm"] - y["grad_norm"]) / x["grad_norm"] for x, y in zip(a, b))}


@pytest.mark.parametrize("world", [1, pytest.param(3, marks=pytest.mark.slow)])
def test_trainer_resumes_a_checkpoint_of_2_ranks_at_another_world_size(world, dirs):
    _report(2, *dirs)  # writes both runs' checkpoints at 2 ranks
    results = run_distributed(_resume_elsewhere, world, *dirs, 2, timeout_s=180)
    for r in results:
        assert r["steps"] == [3, 4], r
        # The same optimizer state resharded, the same data order: DDP's result to reduction order (fp32).
        assert r["loss_rel"] <= 1e-6 and r["grad_norm_rel"] <= 1e-6, r


def test_the_trainer_methods_the_mixin_replaces_still_exist_as_written():
    """Fails when transformers renames one of them or changes its parameters (transformers 5.24 checked)."""
    from transformers import Trainer

    from shardwise.integrations.transformers import _private_trainer_methods

    for name, ours in _private_trainer_methods().items():
        theirs = getattr(Trainer, name, None)
        assert theirs is not None, f"transformers.Trainer.{name} is gone: shardwise.integrations.transformers replaces it"
        assert list(inspect.signature(theirs).parameters) == list(inspect.signature(ours).parameters), name


def test_the_mixin_passes_a_trainers_arguments_on_by_name():
    """DPOTrainer(model, ref_model, args, ...): positional or by keyword, args is args (transformers' Trainer takes
    it second); a subclass in between that passes ``*args, **kwargs`` on is looked through."""
    pytest.importorskip("trl")
    from trl import DPOTrainer

    from shardwise.integrations.transformers import ShardwiseTrainerMixin, _trainer_arguments

    class ShardwiseDPOTrainer(ShardwiseTrainerMixin, DPOTrainer):
        pass

    class Passing(DPOTrainer):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)

    class ShardwisePassing(ShardwiseTrainerMixin, Passing):
        pass

    for cls in (ShardwiseDPOTrainer, ShardwisePassing):
        for given, kwargs in ((("m", "ref", "cfg"), {}), (("m",), {"args": "cfg"}), ((), {"model": "m", "args": "cfg"})):
            arguments = _trainer_arguments(cls, given, kwargs).arguments
            assert (arguments["model"], arguments["args"]) == ("m", "cfg"), (cls, given, kwargs)
