"""The training configuration: one dataclass whose field docstrings double as ``--help``.

Sources, later ones win: the defaults below, a TOML file (``--config run.toml``, keys with underscores),
then command-line overrides (``--save-every 4``, keys with dashes). Key names follow what Hugging Face
Accelerate / Trainer users already type; their spellings (``fsdp_offload_params``, ``learning_rate``,
``per_device_train_batch_size``...) are accepted as aliases. An unknown key or a bad value is rejected with
the list of valid ones, before any process is started.
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import inspect
import json
import os
import tomllib
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence


class ConfigError(ValueError):
    """A configuration that cannot run; the message says what is valid."""


@dataclass
class TrainConfig:
    # ---- what to train on -----------------------------------------------------------------------------
    model: str = "gpt-small"
    """GPT preset (gpt-tiny, gpt-small, gpt-34m, gpt-170m, gpt-480m, gpt-1b, gpt-1.5b) or a path to a Hugging
    Face causal-LM config.json (Llama, Qwen2, Mistral, GPT-2, ...), built with random weights."""
    data: str = "stdlib"
    """'stdlib' (this Python's own standard-library .py sources, byte-level, nothing downloaded), a text file,
    a directory of text files, or a .bin file of uint16 token ids (nanoGPT format)."""
    val_fraction: float = 0.05
    """Share of the data held out for validation (whole files for 'stdlib' and directories)."""

    # ---- optimisation -----------------------------------------------------------------------------------
    steps: int = 100
    """Optimizer steps to train for (in total, counting steps done before a resume)."""
    batch_size: int = 16
    """Sequences per micro-batch per rank; the global batch is batch_size x world size x accumulation steps."""
    seq_len: int = 128
    """Tokens per sequence."""
    gradient_accumulation_steps: int = 1
    """Micro-batches per optimizer step; all but the last run under shardwise.no_sync (no communication)."""
    lr: float = 3e-3
    """Peak learning rate (AdamW)."""
    min_lr_ratio: float = 0.1
    """The cosine schedule decays to lr x min_lr_ratio at the last step."""
    warmup_steps: int = 10
    """Linear warmup from 0 to lr over this many steps."""
    lr_schedule: str = "cosine"
    """cosine (warmup then cosine decay) or constant (warmup then flat)."""
    weight_decay: float = 0.1
    """AdamW weight decay, applied to matrices only (not to biases, norms or 1-element shards)."""
    adam_beta1: float = 0.9
    """AdamW beta1."""
    adam_beta2: float = 0.95
    """AdamW beta2."""
    max_grad_norm: float = 1.0
    """Clip the global gradient norm to this (0 disables clipping; the norm is still logged)."""
    seed: int = 0
    """Seeds weights, data order and dropout; the same seed gives the same run."""

    # ---- sharding (Accelerate's fsdp_config names) ------------------------------------------------------
    sharding_strategy: str = "full_shard"
    """full_shard (ZeRO-3), shard_grad_op (ZeRO-2), no_shard (DDP), hybrid_shard, hybrid_shard_zero2."""
    auto_wrap: str = "transformer_based_wrap"
    """transformer_based_wrap: one unit per transformer block (transformer_layer_cls_to_wrap, else the
    model's own block class); no_wrap: the whole model is one unit."""
    transformer_layer_cls_to_wrap: list[str] = field(default_factory=list)
    """Class names of the blocks that become units (e.g. LlamaDecoderLayer); empty: detected."""
    mixed_precision: str = "no"
    """no, bf16 or fp16: the dtype parameters are gathered and computed in (masters and reductions stay fp32; fp16 adds dynamic loss scaling, agreed across ranks)."""
    cpu_offload: bool = False
    """Keep parameter, gradient and optimizer shards in CPU memory (matters on GPU)."""
    activation_checkpointing: bool = False
    """Recompute each unit's forward during backward instead of keeping its activations."""

    # ---- run directory, logging, checkpoints ------------------------------------------------------------
    out: str = "runs/train"
    """Run directory: config.toml, metrics.jsonl, metrics.png and checkpoints go here."""
    log_every: int = 10
    """Print one metrics line and append to metrics.jsonl every this many steps."""
    eval_every: int = 25
    """Measure validation loss every this many steps (and at the first and last step); 0: never."""
    eval_batches: int = 4
    """Validation micro-batches per rank per evaluation (always the same ones, so the curve is comparable)."""
    save_every: int = 0
    """Save a checkpoint every this many steps (0: only the final one)."""
    resume: str = ""
    """'' starts fresh; 'latest' continues from the newest checkpoint in out; or a checkpoint path."""
    progress: bool = True
    """Show a progress bar on rank 0."""

    # ---- processes --------------------------------------------------------------------------------------
    nproc: int = 2
    """Local ranks to start when not launched by torchrun (ignored under torchrun)."""
    backend: str = "auto"
    """auto (nccl when CUDA is available, else gloo), gloo or nccl."""
    threads_per_rank: int = 0
    """CPU threads per rank; 0: the machine's cores divided by the local ranks."""
    timeout_s: int = 600
    """Collective timeout in seconds: a rank stuck this long fails instead of hanging."""
    peak_tflops: float = 0.0
    """Peak TFLOP/s per rank for the mfu figure; 0: a nominal figure for the device."""


# Values a key may take, for the keys that are enumerations.
CHOICES: dict[str, tuple[str, ...]] = {
    "sharding_strategy": ("full_shard", "shard_grad_op", "no_shard", "hybrid_shard", "hybrid_shard_zero2"),
    "auto_wrap": ("transformer_based_wrap", "no_wrap"),
    "mixed_precision": ("no", "bf16", "fp16"),
    "lr_schedule": ("cosine", "constant"),
    "backend": ("auto", "gloo", "nccl"),
}

# Accelerate fsdp_config / HF TrainingArguments spellings -> our key.
ALIASES: dict[str, str] = {
    "fsdp_sharding_strategy": "sharding_strategy",
    "fsdp_auto_wrap_policy": "auto_wrap",
    "fsdp_transformer_layer_cls_to_wrap": "transformer_layer_cls_to_wrap",
    "fsdp_offload_params": "cpu_offload",
    "fsdp_activation_checkpointing": "activation_checkpointing",
    "gradient_checkpointing": "activation_checkpointing",
    "learning_rate": "lr",
    "max_steps": "steps",
    "per_device_train_batch_size": "batch_size",
    "output_dir": "out",
    "logging_steps": "log_every",
    "save_steps": "save_every",
    "eval_steps": "eval_every",
    "resume_from_checkpoint": "resume",
    "warmup": "warmup_steps",
    "nproc_per_node": "nproc",
}

_MIN_ONE = ("steps", "batch_size", "seq_len", "gradient_accumulation_steps", "nproc", "log_every", "eval_batches")
_NON_NEGATIVE = ("warmup_steps", "weight_decay", "max_grad_norm", "eval_every", "save_every", "threads_per_rank",
                 "peak_tflops", "lr")


def field_help() -> dict[str, str]:
    """Each field's docstring (the string literal right after it in the class body), by field name."""
    tree = ast.parse(inspect.getsource(TrainConfig))
    body = tree.body[0].body
    out: dict[str, str] = {}
    for node, nxt in zip(body, body[1:] + [None]):
        if isinstance(node, ast.AnnAssign) and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant):
            out[node.target.id] = " ".join(str(nxt.value.value).split())
    return out


def _fields() -> dict[str, dataclasses.Field]:
    return {f.name: f for f in dataclasses.fields(TrainConfig)}


def canonical_key(key: str) -> str:
    """``--save-every`` / ``save-every`` / ``fsdp_offload_params`` -> the field name, or ConfigError."""
    k = key.lstrip("-").replace("-", "_").lower()
    k = ALIASES.get(k, k)
    names = _fields()
    if k not in names:
        # Answer in the spelling the user wrote in: --dashes on the command line, underscores in TOML.
        spell = (lambda n: "--" + n.replace("_", "-")) if key.startswith("--") else (lambda n: n)
        close = difflib.get_close_matches(k, list(names), n=1)
        hint = f" (did you mean {spell(close[0])!r}?)" if close else ""
        raise ConfigError(f"unknown config key {key!r}{hint}; valid keys: {', '.join(spell(n) for n in names)}")
    return k


def coerce(key: str, value: Any) -> Any:
    """Turn a TOML value or a command-line string into the field's type, or raise ConfigError."""
    f = _fields()[key]
    kind = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
    try:
        if kind == "bool":
            if isinstance(value, bool):
                return value
            text = str(value).strip().lower()
            if text in ("1", "true", "yes", "on"):
                return True
            if text in ("0", "false", "no", "off"):
                return False
            raise ValueError
        if kind == "int":
            if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
                raise ValueError
            return int(value)
        if kind == "float":
            if isinstance(value, bool):
                raise ValueError
            return float(value)
        if kind.startswith("list"):
            if isinstance(value, str):
                return [v.strip() for v in value.split(",") if v.strip()]
            if isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value):
                return list(value)
            raise ValueError
        if isinstance(value, (dict, list)):
            raise ValueError
        text = str(value)
        if key in CHOICES:
            text = text.strip().lower()
            if text not in CHOICES[key]:
                raise ConfigError(f"{key}={value!r} is not valid; valid: {', '.join(CHOICES[key])}")
        return text
    except ConfigError:
        raise
    except (TypeError, ValueError):
        expected = {"bool": "true or false", "int": "an integer", "float": "a number",
                    "list[str]": "a list of names (comma-separated on the command line)"}.get(kind, kind)
        raise ConfigError(f"{key}={value!r} is not valid; expected {expected}") from None


def validate(cfg: TrainConfig) -> TrainConfig:
    """Cross-field checks that need no model or process; raises ConfigError."""
    for k in _MIN_ONE:
        if getattr(cfg, k) < 1:
            raise ConfigError(f"{k}={getattr(cfg, k)} is not valid; it must be >= 1")
    for k in _NON_NEGATIVE:
        if getattr(cfg, k) < 0:
            raise ConfigError(f"{k}={getattr(cfg, k)} is not valid; it must be >= 0")
    if not 0.0 <= cfg.min_lr_ratio <= 1.0:
        raise ConfigError(f"min_lr_ratio={cfg.min_lr_ratio} is not valid; it must be between 0 and 1")
    if not 0.0 < cfg.val_fraction < 1.0:
        raise ConfigError(f"val_fraction={cfg.val_fraction} is not valid; it must be between 0 and 1 (exclusive)")
    for k in ("adam_beta1", "adam_beta2"):
        if not 0.0 <= getattr(cfg, k) < 1.0:
            raise ConfigError(f"{k}={getattr(cfg, k)} is not valid; it must be in [0, 1)")
    for k, choices in CHOICES.items():
        if getattr(cfg, k) not in choices:
            raise ConfigError(f"{k}={getattr(cfg, k)!r} is not valid; valid: {', '.join(choices)}")
    return cfg


def load_toml(path: str) -> dict[str, Any]:
    """A TOML file's keys as field names. Tables (``[fsdp]``...) are flattened: their keys are ours too."""
    try:
        with open(path, "rb") as f:
            raw = tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError(f"config file {path!r} does not exist") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"config file {path!r} is not valid TOML: {e}") from None
    flat: dict[str, Any] = {}

    def walk(table: dict[str, Any]) -> None:
        for k, v in table.items():
            if isinstance(v, dict):
                walk(v)
            else:
                flat[canonical_key(k)] = coerce(canonical_key(k), v)

    walk(raw)
    return flat


def parse_overrides(argv: Sequence[str]) -> tuple[Optional[str], dict[str, Any]]:
    """``--config F --key value --flag --no-flag --key=value`` -> (config path, {field: value})."""
    fields = _fields()
    config_path: Optional[str] = None
    values: dict[str, Any] = {}
    i = 0
    argv = list(argv)
    while i < len(argv):
        arg = argv[i]
        if not arg.startswith("--") or arg == "--":
            raise ConfigError(f"unexpected argument {arg!r}: options look like --key value; see --help")
        name, eq, inline = arg[2:].partition("=")
        if name == "config":
            if not eq:
                if i + 1 >= len(argv):
                    raise ConfigError("--config needs a path to a TOML file")
                i += 1
                inline = argv[i]
            config_path = inline
            i += 1
            continue
        negated = False
        try:
            key = canonical_key("--" + name)
        except ConfigError:
            if name.startswith("no-") and not eq:
                key, negated = canonical_key("--" + name[3:]), True
            else:
                raise
        is_bool = str(fields[key].type) == "bool"
        if negated:
            if not is_bool:
                raise ConfigError(f"--no-{key.replace('_', '-')}: {key} is not a true/false option")
            values[key] = False
        elif eq:
            values[key] = coerce(key, inline)
        elif is_bool and (i + 1 >= len(argv) or argv[i + 1].startswith("--")):
            values[key] = True  # a bare flag
        else:
            if i + 1 >= len(argv):
                raise ConfigError(f"--{name} needs a value")
            i += 1
            values[key] = coerce(key, argv[i])
        i += 1
    return config_path, values


def resolve(argv: Sequence[str]) -> TrainConfig:
    """Defaults <- TOML file <- command-line overrides, validated."""
    config_path, overrides = parse_overrides(argv)
    values = load_toml(config_path) if config_path else {}
    values.update(overrides)
    return validate(TrainConfig(**values))


def to_toml(cfg: TrainConfig) -> str:
    """The resolved config as TOML (flat: strings, numbers, booleans, lists of strings)."""
    lines = ["# Resolved shardwise train configuration (rerun with: shardwise train --config this-file)"]
    for k, v in dataclasses.asdict(cfg).items():
        if isinstance(v, bool):
            text = "true" if v else "false"
        elif isinstance(v, (int, float)):
            text = repr(v)
        elif isinstance(v, list):
            text = "[" + ", ".join(json.dumps(x) for x in v) + "]"
        else:
            text = json.dumps(v)  # a JSON string is a valid TOML basic string
        lines.append(f"{k} = {text}")
    return "\n".join(lines) + "\n"


def save(cfg: TrainConfig, run_dir: str) -> str:
    os.makedirs(run_dir, exist_ok=True)
    path = os.path.join(run_dir, "config.toml")
    with open(path, "w") as f:
        f.write(to_toml(cfg))
    return path


def help_text() -> str:
    helps = field_help()
    defaults = dataclasses.asdict(TrainConfig())
    rows = ["usage: shardwise train [--config FILE.toml] [--key value ...]", "",
            "Keys (dashes on the command line, underscores in TOML; booleans also as --flag / --no-flag):"]
    for name, text in helps.items():
        rows.append(f"  --{name.replace('_', '-'):<34} {text} [default: {defaults[name]!r}]")
    return "\n".join(rows)
