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
import math
import os
import tomllib
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

from shardwise.engine.base.strategy import ALIASES as STRATEGY_ALIASES, STRATEGY_NAMES
from shardwise.trainer.defaults import with_defaults
from shardwise.usage import ConfigError


@dataclass
class TrainConfig:
    # ---- what to train on -----------------------------------------------------------------------------
    model: str = "gpt-small"
    """A Hugging Face model directory (config.json + model.safetensors or model-*.safetensors with their index):
    its pretrained weights, each rank reading only its own shards, and its tokenizer; a config.json (or a
    directory with no weights): that architecture with random weights; or a GPT preset (gpt-tiny, gpt-small,
    gpt-34m, gpt-170m, gpt-480m, gpt-1b, gpt-1.5b) or architecture preset (llama-3.2-1b, ...), random weights."""
    data: str = "stdlib"
    """'stdlib' (this Python's own standard-library .py sources, byte-level, nothing downloaded), a text file,
    a directory of text files, a .bin file of uint16 token ids (nanoGPT format), or a .jsonl file (or a
    directory of them) of {"text"}, {"prompt", "completion"} or {"messages"} records, tokenised with --model
    DIR's tokenizer, loss on completions / assistant turns only."""
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
    """The cosine or linear schedule decays to lr x min_lr_ratio at the last step."""
    warmup_steps: int = 10
    """Linear warmup from 0 to lr over this many steps."""
    lr_schedule: str = "cosine"
    """cosine (warmup then cosine decay), linear (warmup then linear decay, Hugging Face's default) or constant
    (warmup then flat)."""
    weight_decay: float = 0.1
    """AdamW weight decay, applied to matrices only (not to biases, norms or 1-element shards)."""
    adam_beta1: float = 0.9
    """AdamW beta1."""
    adam_beta2: float = 0.95
    """AdamW beta2."""
    optimizer: str = "adamw"
    """adamw, or muon: shardwise.optim.Muon for the blocks' matrices (exact on shards; adjust_lr_fn
    match_rms_adamw, so lr and weight_decay carry over from AdamW), AdamW for embeddings, head, norms, biases."""
    max_grad_norm: float = 1.0
    """Clip the global gradient norm to this (0 disables clipping; the norm is still logged)."""
    seed: int = 0
    """Seeds weights, data order and dropout; the same seed gives the same run."""
    defaults: str = "auto"
    """Whose defaults the options not given take: shardwise (lr 3e-3, cosine to 10% after 10 warm-up steps,
    weight decay 0.1, beta2 0.95, batch 16, seq-len 128), huggingface (the Trainer's and run_clm.py's: lr 5e-5,
    linear to 0, no warm-up, weight decay 0, beta2 0.999, batch 8, seq-len the model's positions up to 1024), or
    auto: huggingface when the command line spells an option the Hugging Face way (--learning_rate, --fsdp,
    --bf16 ...), else shardwise. Options given always win; the run's first line says which defaults it used."""

    # ---- sharding (Accelerate's fsdp_config names) ------------------------------------------------------
    sharding_strategy: str = "full_shard"
    """full_shard (ZeRO-3), shard_grad_op (FSDP's ZeRO-2), shard_optim_grad (DeepSpeed's ZeRO-2: full
    parameters kept), shard_optim (ZeRO-1), no_shard (DDP), hybrid_shard, hybrid_shard_zero2; aliases zero1,
    zero2, zero3, ddp."""
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

    # ---- LoRA through peft (Hugging Face models) --------------------------------------------------------
    lora_r: int = 0
    """LoRA adapter rank; 0 trains the whole model. > 0: peft wraps the model before sharding, the base is frozen (no gradients, no optimizer state) and only adapters train."""
    lora_alpha: float = 16.0
    """LoRA scaling numerator (the update is scaled by lora_alpha / lora_r)."""
    lora_dropout: float = 0.0
    """Dropout on the adapters' input."""
    lora_target_modules: list[str] = field(default_factory=list)
    """Module names that get adapters (e.g. q_proj,v_proj); empty: peft's default for the architecture."""
    lora_base_dtype: str = "fp32"
    """fp32 or bf16: the dtype the frozen base is kept in (adapters keep fp32 masters)."""
    load_in_4bit: bool = False
    """QLoRA (needs lora_r and --model DIR with weights): the base's Linears in bitsandbytes' 4-bit layout, sharded (~0.52 bytes per weight, scales included) and dequantised one matrix at a time; a bf16/fp32 DIR is quantised on load, a pre-quantised one read by copy."""
    bnb_4bit_quant_type: str = "nf4"
    """nf4 or fp4 (with load_in_4bit)."""
    bnb_4bit_use_double_quant: bool = True
    """Quantise the per-block scales too (bitsandbytes' double quantisation, TRL's --use_bnb_nested_quant)."""
    bnb_4bit_quant_storage: str = "uint8"
    """Accepted for TRL/HF command lines; the 4-bit bytes are always stored as uint8, never viewed as floats."""

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
    "sharding_strategy": STRATEGY_NAMES + tuple(STRATEGY_ALIASES),
    "auto_wrap": ("transformer_based_wrap", "no_wrap"),
    "mixed_precision": ("no", "bf16", "fp16"),
    "lr_schedule": ("cosine", "linear", "constant"),
    "defaults": ("auto", "shardwise", "huggingface"),
    "optimizer": ("adamw", "muon"),
    "backend": ("auto", "gloo", "nccl"),
    "lora_base_dtype": ("fp32", "bf16"),
    "bnb_4bit_quant_type": ("nf4", "fp4"),
    "bnb_4bit_quant_storage": ("uint8", "int8", "bfloat16", "float16", "float32", "float64"),
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
    # HF run_clm.py / TRL (``--fsdp``, ``--bf16``, ``--fp16`` are rewritten by ``hf_args``)
    "model_name_or_path": "model",
    "model_name": "model",
    "train_file": "data",
    "dataset": "data",
    "use_bnb_nested_quant": "bnb_4bit_use_double_quant",
}

# Inclusive integer ranges. The upper bounds are where a value stops making sense on any machine (and, for
# the seed, where numpy's 32-bit seeding would reject it inside the workers).
INT_RANGES: dict[str, tuple[int, int]] = {
    "steps": (1, 2**31 - 1), "batch_size": (1, 2**20), "seq_len": (1, 2**24), "gradient_accumulation_steps": (1, 2**20),
    "warmup_steps": (0, 2**31 - 1), "log_every": (1, 2**31 - 1), "eval_every": (0, 2**31 - 1),
    "eval_batches": (1, 2**20), "save_every": (0, 2**31 - 1), "nproc": (1, 2**20), "threads_per_rank": (0, 4096),
    "timeout_s": (1, 7 * 24 * 3600), "seed": (0, 2**32 - 1), "lora_r": (0, 2**16),
}
_NON_NEGATIVE = ("lr", "weight_decay", "max_grad_norm", "peak_tflops")


def option_label(key: str) -> str:
    """How a key is spelled on the command line, for messages."""
    return "--" + key.replace("_", "-")


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
        from shardwise.trainer.hf_args import NO_MEANING

        if k in NO_MEANING and key.startswith("--"):
            raise ConfigError(f"{key}: a Hugging Face Trainer flag with no meaning here ({NO_MEANING[k]}); drop it")
        if not key.startswith("--"):  # a TOML file: no --help at hand, so the keys themselves
            raise ConfigError(f"unknown config key {key!r}{suggestion(key)}; valid keys: {', '.join(names)}")
        raise ConfigError(f"unknown option {key!r}{suggestion(key)}; `shardwise train --help` lists every option "
                          f"and its Hugging Face spellings")
    return k


def suggestion(key: str) -> str:
    """`` (did you mean '--lr'?)`` for a misspelled key, among our keys and their aliases (``--learning-rat`` ->
    ``--learning-rate``), in the spelling the user wrote in: --dashes or --underscores on the command line, plain
    underscores in TOML; '' when nothing is close."""
    from shardwise.trainer.hf_args import HF_ONLY_FLAGS

    k = key.lstrip("-").replace("-", "_").lower()
    candidates = list(_fields()) + list(ALIASES) + list(HF_ONLY_FLAGS)
    close = difflib.get_close_matches(k, candidates, n=1, cutoff=0.75)
    if not close:
        return ""
    if not key.startswith("--"):
        return f" (did you mean {close[0]!r}?)"
    dashes = "_" not in key.lstrip("-")
    return f" (did you mean {'--' + (close[0].replace('_', '-') if dashes else close[0])!r}?)"


def coerce(key: str, value: Any, label: Optional[str] = None) -> Any:
    """Turn a TOML value or a command-line string into the field's type, or raise ConfigError naming
    ``label`` (how the user spelled the key: ``--lr``, or ``lr in run.toml``)."""
    label = label or option_label(key)
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
            number = float(value)
            if not math.isfinite(number):  # nan or inf: every comparison with them is False
                raise ConfigError(f"{label}={value!r} is not valid; expected a finite number")
            return number
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
                raise ConfigError(f"{label}={value!r} is not valid; valid: {', '.join(CHOICES[key])}")
            if key == "sharding_strategy":
                text = STRATEGY_ALIASES.get(text, text)  # zero2 -> shard_optim_grad: one name in logs and config.toml
        return text
    except ConfigError:
        raise
    except (TypeError, ValueError, OverflowError):
        expected = {"bool": "true or false", "int": "an integer", "float": "a number",
                    "list[str]": "a list of names (comma-separated on the command line)"}.get(kind, kind)
        raise ConfigError(f"{label}={value!r} is not valid; expected {expected}") from None


def validate(cfg: TrainConfig, labels: Optional[dict[str, str]] = None) -> TrainConfig:
    """Cross-field and range checks that need no model or process; raises ConfigError naming the option
    as the user wrote it (``labels``: key -> ``--lr`` or ``lr in run.toml``)."""
    labels = labels or {}

    def bad(key: str, why: str) -> ConfigError:
        return ConfigError(f"{labels.get(key, option_label(key))}={getattr(cfg, key)!r} is not valid; {why}")

    for key, (lo, hi) in INT_RANGES.items():
        value = getattr(cfg, key)
        if isinstance(value, bool) or not isinstance(value, int):
            raise bad(key, "expected an integer")
        if value < lo:
            raise bad(key, f"it must be >= {lo}")
        if value > hi:
            raise bad(key, f"it must be <= {hi}" + (" (numpy seeds are 32-bit)" if key == "seed" else ""))
    for key in ("lr", "weight_decay", "max_grad_norm", "peak_tflops", "min_lr_ratio", "val_fraction",
                "adam_beta1", "adam_beta2", "lora_alpha", "lora_dropout"):
        value = getattr(cfg, key)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise bad(key, "expected a finite number")
    for key in _NON_NEGATIVE:
        if getattr(cfg, key) < 0:
            raise bad(key, "it must be >= 0")
    if not 0.0 <= cfg.min_lr_ratio <= 1.0:
        raise bad("min_lr_ratio", "it must be between 0 and 1")
    if not 0.0 < cfg.val_fraction < 1.0:
        raise bad("val_fraction", "it must be between 0 and 1 (exclusive)")
    for key in ("adam_beta1", "adam_beta2", "lora_dropout"):
        if not 0.0 <= getattr(cfg, key) < 1.0:
            raise bad(key, "it must be in [0, 1)")
    for key, choices in CHOICES.items():
        if getattr(cfg, key) not in choices:
            raise bad(key, f"valid: {', '.join(choices)}")
    for key in ("model", "data", "out"):
        if not getattr(cfg, key).strip():
            raise bad(key, "it must not be empty")
    if cfg.load_in_4bit and not cfg.lora_r:
        raise bad("load_in_4bit", "a 4-bit base is frozen, so only LoRA adapters can train: give --lora-r too")
    return cfg


def load_toml(path: str) -> tuple[dict[str, Any], dict[str, str]]:
    """A TOML file's keys as field names, and how to name each in messages. Tables (``[fsdp]``...) are
    flattened: their keys are ours too."""
    where = f"--config {path}"
    if os.path.isdir(path):
        raise ConfigError(f"{where}: is a directory; --config names a TOML file")
    try:
        with open(path, "rb") as f:
            raw = tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError(f"config file {path!r} does not exist ({where})") from None
    except OSError as e:
        raise ConfigError(f"{where}: cannot be read ({e.strerror})") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"config file {path!r} is not valid TOML: {e}") from None
    flat: dict[str, Any] = {}
    labels: dict[str, str] = {}

    def walk(table: dict[str, Any]) -> None:
        for k, v in table.items():
            if isinstance(v, dict):
                walk(v)
            else:
                key = canonical_key(k)
                labels[key] = f"{k} in {path}"
                flat[key] = coerce(key, v, labels[key])

    walk(raw)
    return flat, labels


def parse_overrides(argv: Sequence[str]) -> tuple[Optional[str], dict[str, Any]]:
    """``--config F --key value --flag --no-flag --key=value`` -> (config path, {field: value}). Hugging Face
    Trainer spellings (``--fsdp 'full_shard auto_wrap'``, ``--bf16``) are translated first (``hf_args``)."""
    from shardwise.trainer.hf_args import translate

    fields = _fields()
    config_path: Optional[str] = None
    values: dict[str, Any] = {}
    i = 0
    argv = translate(argv)
    while i < len(argv):
        arg = argv[i]
        if not arg.startswith("--") or arg == "--":
            raise ConfigError(f"unexpected argument {arg!r}: options look like --key value; see --help")
        name, eq, inline = arg[2:].partition("=")
        if name == "config":
            if not eq:
                if i + 1 >= len(argv) or argv[i + 1].startswith("--"):
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
        label = "--" + name
        is_bool = str(fields[key].type) == "bool"
        if negated:
            if not is_bool:
                raise ConfigError(f"--no-{key.replace('_', '-')}: {key} is not a true/false option")
            values[key] = False
        elif eq:
            values[key] = coerce(key, inline, label)
        elif is_bool and (i + 1 >= len(argv) or argv[i + 1].startswith("--")):
            values[key] = True  # a bare flag
        else:
            if i + 1 >= len(argv):
                raise ConfigError(f"--{name} needs a value")
            i += 1
            values[key] = coerce(key, argv[i], label)
        i += 1
    return config_path, values


def resolve(argv: Sequence[str]) -> TrainConfig:
    """Defaults (shardwise's or Hugging Face's, see ``TrainConfig.defaults``) <- TOML file <- command-line
    overrides, validated. ``defaults`` is recorded resolved (shardwise or huggingface) in config.toml."""
    config_path, overrides = parse_overrides(argv)
    values, labels = load_toml(config_path) if config_path else ({}, {})
    values.update(overrides)
    labels.update({k: option_label(k) for k in overrides})
    values = with_defaults(values, argv, TrainConfig.model, TrainConfig.seq_len)
    return validate(TrainConfig(**values), labels)


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
