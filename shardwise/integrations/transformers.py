"""Hugging Face ``Trainer`` and TRL's ``SFTTrainer`` on a sharded model.

    from shardwise.integrations.transformers import ShardwiseTrainer
    trainer = ShardwiseTrainer(model="path/to/model", args=TrainingArguments(..., fsdp="full_shard auto_wrap"),
                               train_dataset=ds)
    trainer.train()                       # resume_from_checkpoint=True works, at another world size too
    trainer.save_model("out/")            # from_pretrained("out/") in one process

    class ShardwiseSFTTrainer(ShardwiseTrainerMixin, SFTTrainer): ...   # TRL: the mixin in front

What the mixin changes in the Trainer's own DDP run, and why:

- **The model.** A model directory (a path) is built on the meta device and each rank reads only its own
  bytes (``hf/sharded_load.py``: no rank holds a full copy, the usual complaint about FSDP in these
  frameworks), in the dtype the trainer would read it in (TRL's: float32 unless ``model_init_kwargs`` names
  one); TRL's RewardTrainer builds a sequence classifier whose score head is in no file: read whole, as TRL
  reads it, then sharded (``_whole_reward_model``). A model object is sharded (each rank keeps its slices); a
  sharded model is taken as it is.
  ``peft_config`` (a peft ``LoraConfig``) wraps the model before it is sharded; ``quantization_config``
  (``BitsAndBytesConfig(load_in_4bit=True)``, or TRL's ``model_init_kwargs``) makes the base shardwise's
  4-bit ``QuantLinear`` (bitsandbytes is not needed). ``TrainingArguments``' FSDP settings become
  ``shard()`` options (``training_args.py``), said in one line on rank 0.
- **No wrapper.** The model is handed to the Trainer's ``Accelerator`` through ``integrations.accelerate.
  prepare_model`` (Accelerate's autocast kept, no DDP), so the Trainer's ``prepare(model, optimizer)``
  takes it as it is. Gradient accumulation goes through ``shardwise.no_sync``; clipping through torch's
  ``clip_grad_norm_``, exact on shard parameters.
- **Saving.** ``save_model`` (and every checkpoint's model) is ``shardwise.save_whole_model``: every rank
  takes part, rank 0 writes the whole model, or a peft model's adapter. The optimizer state, which is per
  rank, goes into ``checkpoint-N/shardwise_state/`` (a shardwise checkpoint, weights included: an adapter-
  only one when the adapters sit over a base read from a directory), so ``resume_from_checkpoint`` resumes
  exactly, at any world size; a ``save_only_model=True`` checkpoint (weights alone) resumes as under DDP,
  the optimizer afresh. ``evaluate`` and ``predict`` run as they do.

The Trainer's private methods this replaces are named in one place, ``_private_trainer_methods``.
"""

from __future__ import annotations

import inspect
import os
import sys
import warnings
from pathlib import Path
from typing import Any, Optional

import torch
import torch.nn as nn
from transformers import Trainer

import shardwise
from shardwise.engine.checks import agree
from shardwise.errors import ShardwiseError
from shardwise.integrations.accelerate import is_sharded, prepare_model
from shardwise.integrations.training_args import translate

STATE_DIR = "shardwise_state"  # in checkpoint-N/: the shardwise checkpoint (weights + per-rank optimizer state)
SCHEDULER_FILE = "scheduler.pt"  # the Trainer's name for the scheduler state (transformers.trainer.SCHEDULER_NAME)
OPTIMIZER_FILE = "optimizer.pt"  # and for a DDP run's optimizer state (OPTIMIZER_NAME)
TRAINING_ARGS_FILE = "training_args.bin"  # and for the arguments saved beside a model (TRAINING_ARGS_NAME)


class ShardwiseTrainerMixin:
    """Put it first among the bases: ``class T(ShardwiseTrainerMixin, Trainer)``; ``ShardwiseTrainer`` is
    that with ``Trainer``. Takes the Trainer's arguments plus ``shard_options`` (``shardwise.shard``'s:
    units, strategy, mixed_precision, offload, activation_checkpointing; they win over the translation of
    ``args.fsdp`` / ``fsdp_config``), ``peft_config`` and ``quantization_config`` (as TRL's SFTTrainer takes
    them; the mixin applies them itself, before sharding)."""

    def __init__(self, *given: Any, shard_options: Optional[dict] = None, peft_config: Any = None,
                 quantization_config: Any = None, **kwargs: Any):
        # By name, as the trainer takes them: TRL's DPOTrainer and KTOTrainer take ref_model second, args third.
        bound = _trainer_arguments(type(self), given, kwargs)
        if bound.arguments.get("model_init") is not None:
            raise ShardwiseError("model_init: a ShardwiseTrainer shards its model once; pass the model, or its "
                                 "directory, as model=")
        args = bound.arguments.get("args")
        translation = translate(args, dict(shard_options or {}))
        self._shardwise_base = None  # (directory, QuantSettings) of a model read from a directory
        # Applied here, before sharding: TRL's trainers, which take them too, must not apply them again.
        peft_config = bound.arguments.pop("peft_config", None) or peft_config
        quantization_config = bound.arguments.pop("quantization_config", None) or quantization_config
        bound.arguments["model"] = self._shardwise_model(bound.arguments.get("model"), args, translation, peft_config,
                                                         quantization_config)
        bound.arguments["args"] = translation.hf_args
        super().__init__(*bound.args, **bound.kwargs)
        prepare_model(self.accelerator, self.model)  # refuses an Accelerate set up for FSDP or DeepSpeed
        if agree.rank() == 0:
            print(translation.line(_units_text(self.model)), flush=True)

    # ---- the model ---------------------------------------------------------------------------------------

    def _shardwise_model(self, model: Any, args: Any, translation, peft_config: Any, quantization_config: Any):
        """The sharded model the Trainer gets (see the module docstring)."""
        from transformers import set_seed

        from shardwise.hf.lora import apply_peft_config
        from shardwise.hf.sharded_load import load_sharded, quant_settings_of, units_of

        options = translation.shard_options
        init_kwargs = dict(getattr(args, "model_init_kwargs", None) or {})  # TRL's SFTConfig
        if quantization_config is None:
            quantization_config = init_kwargs.pop("quantization_config", None)
        if args is not None:
            options.setdefault("device", args.device)
        # As TRL does before it builds the model: peft draws the adapters' init from the seeded generator.
        set_seed(args.seed if args is not None else 42)
        if isinstance(model, (str, os.PathLike)):
            # TRL's trainers (their configs carry model_init_kwargs) read a directory in float32 unless told
            # otherwise (trl's create_model_from_path); a Trainer user's from_pretrained reads "auto".
            default_dtype = "float32" if hasattr(args, "model_init_kwargs") else "auto"
            dtype = init_kwargs.pop("dtype", init_kwargs.pop("torch_dtype", default_dtype))
            attn = init_kwargs.pop("attn_implementation", None)
            _refuse_unknown_init_kwargs(init_kwargs)
            if _builds_reward_model(type(self)):
                model = _whole_reward_model(model, dtype, attn, quantization_config)
                quantization_config = None
            else:
                loaded = load_sharded(model, peft_config=peft_config, quantization_config=quantization_config,
                                      dtype=dtype, attn_implementation=attn, **options)
                self._shardwise_base = (str(model), quant_settings_of(model, quantization_config))
                return loaded
        if not isinstance(model, nn.Module):
            raise ShardwiseError(f"model: expected a model, its directory or a sharded model, got {type(model).__name__}")
        if getattr(model, "hf_quantizer", None) is not None or getattr(model, "is_loaded_in_4bit", False):
            raise ShardwiseError("model: loaded quantised by transformers (bitsandbytes), which cannot be sharded; "
                                 "pass the model directory with quantization_config=BitsAndBytesConfig(load_in_4bit="
                                 "True) instead: shardwise builds its own 4-bit base, sharded")
        if quantization_config is not None:
            raise ShardwiseError("quantization_config: applies when the model is given as its directory (the 4-bit "
                                 "base is built while loading); this model is already built")
        if is_sharded(model):
            given = [name for name, value in (("peft_config", peft_config), ("args.fsdp", translation.fsdp_given),
                                              ("shard_options", translation.explicit)) if value]
            if given:
                raise ShardwiseError(f"{', '.join(given)}: this model is already sharded, and would not follow them; "
                                     f"pass the model unsharded (or its directory), or drop them")
            return model
        if peft_config is not None:
            model = apply_peft_config(model, peft_config)
        options["units"] = units_of(model, options.get("units", "auto"))
        return shardwise.shard(model, **options)

    def _shardwise_frozen_base(self, recorded: Optional[dict] = None) -> Optional[dict]:
        """The ``frozen_base`` record of adapters over a base read from a directory (their checkpoints then
        hold the adapters only); None otherwise (checkpoints hold the whole model)."""
        from shardwise.hf.lora import is_peft_model
        from shardwise.hf.sharded_load import base_record_of

        if self._shardwise_base is None or not is_peft_model(self.model):
            return None
        directory, quant = self._shardwise_base
        return base_record_of(directory, quant, recorded)

    # ---- saving (public Trainer methods) -------------------------------------------------------------------

    def save_model(self, output_dir: Optional[str] = None, _internal_call: bool = False) -> None:
        """The whole model (a peft model: its adapter) into ``output_dir``, as the Trainer writes it, from
        every rank (``shardwise.save_whole_model``); the tokenizer and ``training_args.bin`` beside it."""
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        tokenizer = self.processing_class or getattr(self.data_collator, "tokenizer", None)
        shardwise.save_whole_model(self.model, output_dir, processing_class=tokenizer)
        if self.args.should_save:
            torch.save(self.args, os.path.join(output_dir, TRAINING_ARGS_FILE))
        if self.args.push_to_hub and not _internal_call:
            self.push_to_hub(commit_message="Model save", revision=self.args.hub_revision)


# ---- the Trainer's private methods, replaced -------------------------------------------------------------------


def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
    """Every rank: the model and its own optimizer pieces as a shardwise checkpoint; rank 0: the scheduler."""
    shardwise.save_checkpoint(os.path.join(output_dir, STATE_DIR), self.model, _torch_optimizer(self.optimizer),
                              step=self.state.global_step, frozen_base=self._shardwise_frozen_base())
    if self.args.should_save:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # torch's "save the optimizer too" reminder
            torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, SCHEDULER_FILE))


def _load_optimizer_and_scheduler(self, checkpoint: Optional[str]) -> None:
    """The shardwise checkpoint of ``checkpoint`` (weights and optimizer state, resharded to this world
    size), and the scheduler. A ``save_only_model`` checkpoint has neither: the optimizer and scheduler start
    afresh, as the Trainer's own method leaves them when their files are missing."""
    if checkpoint is None or _weights_only(checkpoint):
        return
    from shardwise.checkpoint.verify import read_manifest

    state = Path(checkpoint) / STATE_DIR
    recorded = agree.agreed(lambda: read_manifest(state).get("frozen_base"), f"reading {state}")
    shardwise.load_checkpoint(state, self.model, _torch_optimizer(self.optimizer),
                              frozen_base=self._shardwise_frozen_base(recorded) if recorded else None)
    self.lr_scheduler.load_state_dict(torch.load(os.path.join(checkpoint, SCHEDULER_FILE), weights_only=True))


def _load_from_checkpoint(self, resume_from_checkpoint: str, model: Optional[nn.Module] = None) -> None:
    """A ShardwiseTrainer checkpoint: nothing here, its weights come back with the optimizer state
    (``_load_optimizer_and_scheduler``), each rank reading its own pieces, not the whole model.safetensors
    on every rank. A ``save_only_model=True`` checkpoint (weights alone, written by any run): the Trainer's
    own load, as under DDP (each rank reads the whole file; ``load_state_dict`` keeps its pieces). A checkpoint
    with a DDP run's optimizer.pt is refused: that holds one process's optimizer state."""
    if _weights_only(resume_from_checkpoint):
        Trainer._load_from_checkpoint(self, resume_from_checkpoint, model)
        return
    state = Path(resume_from_checkpoint) / STATE_DIR

    def check() -> None:
        if not state.is_dir():
            raise ShardwiseError(f"resume_from_checkpoint {resume_from_checkpoint}: has no {STATE_DIR}/, so it is not "
                                 f"a checkpoint of a ShardwiseTrainer run (a DDP run's optimizer.pt holds one "
                                 f"process's optimizer state); to start from its weights, pass the directory as "
                                 f"model= instead")

    agree.agreed(check, f"checking {resume_from_checkpoint}")


def _weights_only(checkpoint: str) -> bool:
    """Whether ``checkpoint`` was written with ``save_only_model=True``: no optimizer state of either kind
    (the same files from a DDP run and from ours). Every rank gets rank 0's answer."""
    mine = not (Path(checkpoint) / STATE_DIR).is_dir() and not (Path(checkpoint) / OPTIMIZER_FILE).is_file()
    return bool(agree.broadcast_json(mine))


def _move_model_to_device(self, model: nn.Module, device: torch.device) -> None:
    """Nothing: the model was sharded on its device. The Trainer's ``model.to(args.device)`` would move the
    shard parameters off their flat shards, even on the CPU (torch copies on ``.to("cpu:0")``)."""


def _private_trainer_methods() -> dict[str, Any]:
    """The ``transformers.Trainer`` private methods the mixin replaces, the one place their names live.
    Checked on transformers 5.24; ``tests/integrations/test_transformers.py`` fails when one is renamed or
    its parameters change. Why each: the Trainer saves ``optimizer.state_dict()`` from rank 0 alone, loads
    that one file into every rank, and reads the whole ``model.safetensors`` on every rank to resume
    (shardwise's optimizer state is per rank and its checkpoints reshard); and it moves the model to
    ``args.device`` in ``__init__``."""
    return {"_save_optimizer_and_scheduler": _save_optimizer_and_scheduler,
            "_load_optimizer_and_scheduler": _load_optimizer_and_scheduler,
            "_load_from_checkpoint": _load_from_checkpoint,
            "_move_model_to_device": _move_model_to_device}


for _name, _method in _private_trainer_methods().items():
    setattr(ShardwiseTrainerMixin, _name, _method)


class ShardwiseTrainer(ShardwiseTrainerMixin, Trainer):
    """Hugging Face ``Trainer`` on a sharded model (see ``ShardwiseTrainerMixin``)."""


def _trainer_arguments(cls: type, given: tuple, kwargs: dict) -> inspect.BoundArguments:
    """The arguments of a ``ShardwiseTrainerMixin`` subclass's construction, bound by name to the ``__init__``
    of the first class after the mixin that names both ``model`` and ``args`` (the trainer itself; a subclass
    in between that passes ``*args, **kwargs`` on is looked through)."""
    after = cls.__mro__[cls.__mro__.index(ShardwiseTrainerMixin) + 1:]
    for base in after:
        signature = inspect.signature(base.__init__)
        if {"model", "args"} <= set(signature.parameters):
            break
    else:
        raise ShardwiseError(f"{cls.__name__}: ShardwiseTrainerMixin goes first among the bases of a transformers "
                             f"Trainer (a class whose __init__ takes model= and args=); found none after it")
    signature = signature.replace(parameters=list(signature.parameters.values())[1:])  # without self
    return signature.bind_partial(*given, **kwargs)


def _torch_optimizer(optimizer: Any) -> torch.optim.Optimizer:
    """The torch optimizer inside Accelerate's ``AcceleratedOptimizer`` (its public ``optimizer``)."""
    return getattr(optimizer, "optimizer", optimizer)


def _builds_reward_model(cls: type) -> bool:
    """Whether ``cls`` is TRL's RewardTrainer, which reads a model directory as a sequence classifier."""
    trl = sys.modules.get("trl")  # not imported: cls cannot be one of its trainers
    return trl is not None and issubclass(cls, trl.RewardTrainer)


def _whole_reward_model(directory: Any, dtype: Any, attn: Optional[str], quantization_config: Any) -> nn.Module:
    """What TRL's RewardTrainer builds from a directory: ``AutoModelForSequenceClassification`` with
    ``num_labels=1``, its score head new (drawn from the generator seeded with ``args.seed``, as TRL draws it),
    read whole by every rank as under DDP, then sharded by the caller. ``load_sharded`` cannot build it: the
    head is in no file."""
    from transformers import AutoModelForSequenceClassification

    if quantization_config is not None:
        raise ShardwiseError("quantization_config: shardwise's 4-bit base is built for causal LMs read from a "
                             "directory; a RewardTrainer's sequence classifier is read whole: drop quantization_config")
    if isinstance(dtype, str) and dtype != "auto":
        dtype = getattr(torch, dtype)
    kwargs = {} if attn is None else {"attn_implementation": attn}
    return AutoModelForSequenceClassification.from_pretrained(directory, num_labels=1, dtype=dtype, **kwargs)


def _refuse_unknown_init_kwargs(init_kwargs: dict) -> None:
    harmless = {k for k, v in init_kwargs.items() if (k, v) in (("device_map", None), ("trust_remote_code", False))}
    unknown = sorted(set(init_kwargs) - harmless)
    if unknown:
        raise ShardwiseError(f"model_init_kwargs {', '.join(unknown)}: not supported when shardwise loads the model "
                             f"(it takes dtype, attn_implementation and quantization_config)")


def _units_text(model: nn.Module) -> str:
    from collections import Counter

    from shardwise.engine.core.runtime import runtime_of

    units = runtime_of(model).units
    kinds = Counter(type(u.plan.module).__name__ for u in units if not u.plan.is_root and u.plan.edge is None)
    edges = [f"the {u.plan.edge}" for u in units if u.plan.edge is not None]
    return " + ".join([f"{count} {name}" for name, count in sorted(kinds.items())] + edges + ["the root"])
