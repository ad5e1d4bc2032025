"""What a Hugging Face ``TrainingArguments``' FSDP settings become under shardwise: ``shard()`` options, a
copy of the arguments without them (the Trainer must not build its own FSDP plugin), and one line saying
what each setting became.

transformers 5 turns ``fsdp="full_shard auto_wrap offload"`` into ``fsdp=True`` plus ``fsdp_config`` keys in
``TrainingArguments.__post_init__``; older versions keep the words. Both are read here; the words mean
what ``shardwise train --fsdp`` makes of them (trainer/hf_args.py: one decision for both).

| setting | becomes |
|---|---|
| ``reshard_after_forward`` True / False, or an FSDP1 strategy name | ``strategy`` full_shard / shard_grad_op / that name |
| ``cpu_offload`` (``offload``) | ``offload=CPUOffload()`` |
| ``auto_wrap_policy`` TRANSFORMER_BASED_WRAP (default) | one unit per ``transformer_layer_cls_to_wrap`` class, else per ``_no_split_modules`` block |
| ``auto_wrap_policy`` NO_WRAP | the whole model one unit |
| ``activation_checkpointing`` | ``activation_checkpointing=True`` |
| ``cpu_ram_efficient_loading`` | always: a model directory is read by each rank for its own pieces |
| ``state_dict_type`` | the model is saved whole (``save_whole_model``), optimizer state per rank (shardwise checkpoints) |
| ``bf16`` / ``fp16`` | Accelerate's autocast, as under DDP (fp32 shards, gathers and gradient reductions) |

``SIZE_BASED_WRAP`` and XLA FSDP are refused by name. Options given to the Trainer in ``shard_options``
win over the translation.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

from shardwise.errors import ShardwiseError
from shardwise.trainer.hf_args import parse_fsdp_words
from shardwise.usage import ConfigError

_IGNORED = ("version", "min_num_params", "sync_module_states", "use_orig_params", "forward_prefetch",
            "backward_prefetch", "limit_all_gathers", "xla", "xla_fsdp_v2", "xla_fsdp_grad_ckpt")


@dataclass
class Translation:
    shard_options: dict[str, Any]
    hf_args: Any  # the TrainingArguments the Trainer gets: FSDP settings removed
    said: list[str] = field(default_factory=list)  # "setting -> what it became", for the one line
    fsdp_given: bool = False  # the arguments had FSDP settings
    explicit: dict[str, Any] = field(default_factory=dict)  # the shard_options given

    def line(self, units: str) -> str:
        """The one line rank 0 prints: what each setting became, and the units the model got."""
        return "shardwise: " + "; ".join(self.said + [f"units: {units}"])


def translate(args: Any, explicit: dict[str, Any]) -> Translation:
    """``args`` (TrainingArguments, or None) and the ``shard_options`` given explicitly -> Translation."""
    options: dict[str, Any] = {"units": "auto", "strategy": "full_shard"}
    said: list[str] = []
    if args is not None and args.fsdp:
        config = dict(args.fsdp_config or {})
        if config.get("xla") or config.get("xla_fsdp_v2"):
            raise ShardwiseError("TrainingArguments fsdp_config xla: XLA FSDP shards on its own; drop it to train "
                                 "with shardwise")
        words = _words(args.fsdp)
        said += _strategy(options, config, words) + _wrap(options, config, words) + _offload(options, config, words)
        if _true(config.get("activation_checkpointing")):
            options["activation_checkpointing"] = True
            said.append("fsdp_config activation_checkpointing -> activation_checkpointing=True")
        if "cpu_ram_efficient_loading" in config:
            said.append("cpu_ram_efficient_loading -> always (each rank reads only its own pieces of a model "
                        "directory)")
        if "state_dict_type" in config:
            said.append(f"state_dict_type {config['state_dict_type']} -> save_model writes the whole model, "
                        f"checkpoints keep optimizer state per rank (any world size resumes)")
        ignored = sorted(k for k in config if k in _IGNORED and k != "version" and config[k] not in (False, None, 0))
        if ignored:
            said.append(f"{', '.join(ignored)}: no meaning here")
        hf_args = copy.copy(args)
        hf_args.fsdp, hf_args.fsdp_config, hf_args.fsdp_plugin_args = None, None, None
    else:
        said.append("no fsdp settings -> shardwise's defaults (full_shard, one unit per transformer block)")
        hf_args = args
    if args is not None and (args.bf16 or args.fp16):
        said.append(f"{'bf16' if args.bf16 else 'fp16'} -> Accelerate's autocast, as under DDP (fp32 shards, "
                    f"gathers and gradient reductions)")
    for key, value in explicit.items():
        options[key] = value
        said.append(f"shard_options {key}={_text(value)} (given)")
    return Translation(options, hf_args, said, bool(args is not None and args.fsdp), dict(explicit))


def _words(fsdp: Any) -> str | None:
    """The FSDP words of an older transformers (a list of FSDPOption, or a string); None when transformers
    has already turned them into fsdp_config (5.x: ``fsdp`` is then True)."""
    if isinstance(fsdp, str):
        return fsdp
    if isinstance(fsdp, (list, tuple)):
        return " ".join(str(getattr(w, "value", w)) for w in fsdp)
    return None


def _strategy(options: dict, config: dict, words: str | None) -> list[str]:
    reshard = config.get("reshard_after_forward")
    if words is not None:
        options["strategy"] = _parsed(words, "TrainingArguments fsdp").strategy
        return [f"fsdp {words!r} -> strategy {options['strategy']}"]
    if isinstance(reshard, str) and reshard.lower() not in ("true", "false"):
        options["strategy"] = _parsed(reshard, "fsdp_config reshard_after_forward").strategy
    else:
        options["strategy"] = "full_shard" if reshard is None or _true(reshard) else "shard_grad_op"
    return [f"fsdp_config reshard_after_forward={reshard if reshard is not None else True} -> "
            f"strategy {options['strategy']}"]


def _wrap(options: dict, config: dict, words: str | None) -> list[str]:
    if words is not None:
        policy = "TRANSFORMER_BASED_WRAP" if _parsed(words, "TrainingArguments fsdp").auto_wrap else "NO_WRAP"
    else:
        policy = str(config.get("auto_wrap_policy", "TRANSFORMER_BASED_WRAP")).upper()
    if policy == "NO_WRAP":
        options["units"] = None
        return ["auto_wrap_policy NO_WRAP -> the whole model one unit"]
    if policy != "TRANSFORMER_BASED_WRAP":
        raise ShardwiseError(f"TrainingArguments fsdp_config auto_wrap_policy {policy}: not supported by shardwise; "
                             f"use TRANSFORMER_BASED_WRAP (one unit per transformer block, the default) or NO_WRAP")
    names = config.get("transformer_layer_cls_to_wrap")
    if names:
        options["units"] = [names] if isinstance(names, str) else list(names)
        return [f"transformer_layer_cls_to_wrap {','.join(options['units'])} -> one unit each"]
    return ["auto_wrap_policy TRANSFORMER_BASED_WRAP -> one unit per _no_split_modules block"]


def _offload(options: dict, config: dict, words: str | None) -> list[str]:
    offload = _parsed(words, "TrainingArguments fsdp").offload if words is not None else _true(config.get("cpu_offload"))
    if not offload:
        return []
    import shardwise

    options["offload"] = shardwise.CPUOffload()
    return ["cpu_offload -> offload=CPUOffload()"]


def _parsed(words: str, label: str):
    try:
        return parse_fsdp_words(words, label)
    except ConfigError as e:
        raise ShardwiseError(str(e)) from None


def _true(value: Any) -> bool:
    return str(value).lower() in ("1", "true", "yes", "on")


def _text(value: Any) -> str:
    if isinstance(value, (set, frozenset, list, tuple)):
        return ",".join(sorted(getattr(v, "__name__", str(v)) for v in value))
    if isinstance(value, str):
        return value
    return getattr(value, "__name__", None) or repr(value)
