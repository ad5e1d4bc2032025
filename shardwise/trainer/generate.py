"""``shardwise generate RUN_DIR|CHECKPOINT|EXPORT_DIR --prompt "..."``: sample from a trained model in one
process, so that a run's result can be seen, not only its loss curve.

- A run directory (or one of its ``step-*`` checkpoints): the model is rebuilt from the run's
  ``config.toml`` and sharded at world size 1 in a private one-process gloo group, and the checkpoint is
  loaded into it with ``load_checkpoint`` (checkpoints reshard to any world size). Computation in fp32.
- An export (``shardwise export``): ``config.json`` -> ``AutoModelForCausalLM.from_pretrained``;
  ``shardwise_model.json`` (a GPT preset) -> the GPT with its safetensors weights.

Text goes in and out through the model's tokenizer (the run's ``--model`` directory, the export directory,
or ``--tokenizer DIR``), or as UTF-8 bytes for shardwise's byte-level GPT models. Sampling: temperature
(0: greedy), top-k, and a seeded generator, so the same command prints the same text.
"""

from __future__ import annotations

import argparse
import json
import os
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Optional, Sequence

import torch
import torch.nn as nn

from shardwise.errors import ShardwiseError
from shardwise.trainer.data import BYTE_VOCAB


@dataclass
class Generator:
    """What sampling needs: logits of a (1, T) id tensor, the context length, and text <-> ids.
    ``cached``, where the model keeps a KV cache (Hugging Face models): ``(new ids, cache) -> (logits,
    cache)``, so each sampled token costs one position's forward instead of the whole context's."""

    logits: Callable[[torch.Tensor], torch.Tensor]
    max_positions: Optional[int]
    encode: Callable[[str], list[int]]
    decode: Callable[[list[int]], str]
    eos_token_id: Optional[int]
    cached: Optional[Callable[[torch.Tensor, Any], tuple[torch.Tensor, Any]]] = None


def hf_cached_logits(model: nn.Module) -> Callable[[torch.Tensor, Any], tuple[torch.Tensor, Any]]:
    """A Hugging Face causal LM's forward over the ids not yet in ``cache`` (its ``past_key_values``)."""

    import inspect

    # transformers 5.24 renamed past_key_values to cache (the old name warns); older versions know only the old
    forward = getattr(model, "get_base_model", lambda: model)().forward
    name = "cache" if "cache" in inspect.signature(forward).parameters else "past_key_values"

    def step(ids: torch.Tensor, cache: Any) -> tuple[torch.Tensor, Any]:
        out = model(input_ids=ids, use_cache=True, **{name: cache})
        return out.logits, getattr(out, name)

    return step


def make_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="shardwise generate", description=__doc__.split("\n\n")[0])
    p.add_argument("path", help="a run directory, a checkpoint, or an exported model directory")
    p.add_argument("--prompt", required=True, help="the text to continue")
    p.add_argument("--max-new-tokens", type=int, default=200, help="tokens to sample at most (default 200)")
    p.add_argument("--temperature", type=float, default=0.8, help="softmax temperature; 0: greedy (default 0.8)")
    p.add_argument("--top-k", type=int, default=50, help="sample among the k likeliest tokens; 0: all (default 50)")
    p.add_argument("--seed", type=int, default=0, help="seed of the sampling generator (default 0)")
    p.add_argument("--tokenizer", default="", help="a directory holding the tokenizer (default: the model's)")
    p.add_argument("--chat", action="store_true", help="wrap the prompt as a user turn with the chat template")
    p.add_argument("--base", default="", metavar="DIR",
                   help="a LoRA adapter export's base model directory (default: its adapter_config.json's "
                        "base_model_name_or_path)")
    return p


def check_args(args: argparse.Namespace) -> None:
    if not 1 <= args.max_new_tokens <= 1 << 20:
        raise ShardwiseError(f"--max-new-tokens {args.max_new_tokens}: must be between 1 and {1 << 20}")
    if not args.temperature >= 0 or args.temperature == float("inf"):
        raise ShardwiseError(f"--temperature {args.temperature}: must be a finite number >= 0")
    if args.top_k < 0:
        raise ShardwiseError(f"--top-k {args.top_k}: must be >= 0")
    if not 0 <= args.seed < 2**63:
        raise ShardwiseError(f"--seed {args.seed}: must be between 0 and 2**63 - 1")


@torch.no_grad()
def sample(gen: Generator, prompt_ids: list[int], max_new_tokens: int, temperature: float, top_k: int,
           seed: int) -> list[int]:
    """The sampled continuation's ids (stops after EOS)."""
    if not prompt_ids:
        raise ShardwiseError("--prompt: encodes to no tokens; give some text")
    rng = torch.Generator().manual_seed(seed)
    ids = list(prompt_ids)
    new: list[int] = []
    cache, in_cache = None, 0  # the KV cache holds ids[:in_cache]
    for _ in range(max_new_tokens):
        if gen.cached is not None and not (gen.max_positions and len(ids) > gen.max_positions):
            logits, cache = gen.cached(torch.tensor([ids[in_cache:]], dtype=torch.int64), cache)
            # a model that returns no cache gets the whole context again next time: slower, never wrong
            logits, in_cache = logits[0, -1].float(), len(ids) if cache is not None else 0
        else:  # no cache, or the context outgrew the model's positions: a sliding window, recomputed
            context = ids[-gen.max_positions:] if gen.max_positions else ids
            logits = gen.logits(torch.tensor([context], dtype=torch.int64))[0, -1].float()
        if temperature == 0:
            token = int(logits.argmax())
        else:
            logits = logits / temperature
            if 0 < top_k < logits.numel():
                kth = torch.topk(logits, top_k).values[-1]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            token = int(torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=rng))
        ids.append(token)
        new.append(token)
        if token == gen.eos_token_id:
            break
    return new


def _tokenizer_text(tokenizer_dir: str, chat: bool):
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(tokenizer_dir, local_files_only=True)
    except (OSError, ValueError) as e:
        raise ShardwiseError(f"{tokenizer_dir}: cannot load a tokenizer from it ({str(e).splitlines()[0][:150]}); "
                             f"pass --tokenizer DIR") from None

    def encode(text: str) -> list[int]:
        if chat:
            if not getattr(tok, "chat_template", None):
                raise ShardwiseError(f"--chat: the tokenizer in {tokenizer_dir} has no chat template")
            text = tok.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                           add_generation_prompt=True)
            return tok(text, add_special_tokens=False)["input_ids"]
        return tok(text)["input_ids"]

    # a chat reply is shown without the template's markers (end of turn...); plain text shows what was sampled
    return encode, (lambda ids: tok.decode(ids, skip_special_tokens=chat)), tok.eos_token_id


def _text_codec(vocab_size: int, tokenizer_dir: str, chat: bool, where: str):
    """(encode, decode, eos id): the tokenizer when there is one, else bytes for a byte-level model."""
    from shardwise.trainer.jsonl_data import TOKENIZER_FILES

    if tokenizer_dir and any(os.path.isfile(os.path.join(tokenizer_dir, n)) for n in TOKENIZER_FILES):
        return _tokenizer_text(tokenizer_dir, chat)
    if vocab_size != BYTE_VOCAB:
        raise ShardwiseError(f"{where}: no tokenizer found{' in ' + tokenizer_dir if tokenizer_dir else ''} and the "
                             f"model's vocabulary ({vocab_size}) is not bytes; pass --tokenizer DIR")
    if chat:
        raise ShardwiseError("--chat needs a tokenizer with a chat template; this is a byte-level model")
    return (lambda text: list(text.encode("utf-8"))), (lambda ids: bytes(ids).decode("utf-8", "replace")), None


@contextmanager
def one_process_group() -> Iterator[None]:
    """A world of one (gloo, in-process store) for ``shard`` and ``load_checkpoint``, unless one is up."""
    import torch.distributed as dist

    if dist.is_initialized():
        yield
        return
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _run_config_dir(path: Path) -> Optional[Path]:
    """The run directory of a run directory or of one of its checkpoints (where config.toml is)."""
    for d in (path, path.parent):
        if (d / "config.toml").is_file():
            return d
    return None


def from_run(path: Path, tokenizer: str, chat: bool) -> Generator:
    """Rebuild the run's model at world size 1 and load the checkpoint (call inside one_process_group)."""
    import dataclasses

    from shardwise.checkpoint import load_checkpoint
    from shardwise.checkpoint.export import resolve_checkpoint
    from shardwise.checkpoint.verify import read_manifest
    from shardwise.trainer.config import TrainConfig, load_toml
    from shardwise.trainer.jsonl_data import tokenizer_dir
    from shardwise.trainer.lora_model import run_frozen_base
    from shardwise.trainer.loop import build_sharded_model
    from shardwise.hf.model_spec import ModelError, lm_logits, resolve_model

    run_dir = _run_config_dir(path)
    values, _ = load_toml(str(run_dir / "config.toml"))
    cfg = dataclasses.replace(TrainConfig(**values), mixed_precision="no", cpu_offload=False,
                              activation_checkpointing=False, sharding_strategy="full_shard")
    try:
        spec = resolve_model(cfg.model)
    except ModelError as e:
        hint = "" if os.path.isabs(cfg.model) else (" (a relative path in config.toml is relative to the directory "
                                                    "`shardwise train` ran in: run generate from there)")
        raise ShardwiseError(f"{run_dir / 'config.toml'}: model {cfg.model!r}: {e}{hint}") from None
    checkpoint = resolve_checkpoint(path)
    model = build_sharded_model(cfg, spec, torch.device("cpu"))
    # a LoRA run's adapter-only checkpoint goes over the base build_sharded_model read from --model DIR
    recorded = read_manifest(checkpoint).get("frozen_base")
    load_checkpoint(checkpoint, model, frozen_base=run_frozen_base(cfg, spec, recorded))
    model.eval()
    tok_dir = tokenizer or (tokenizer_dir(cfg.model) if spec.kind == "hf" else "")
    encode, decode, eos = _text_codec(spec.vocab_size, tok_dir, chat, str(path))
    return Generator(lambda ids: lm_logits(spec, model, ids), spec.max_seq_len, encode, decode, eos,
                     cached=hf_cached_logits(model) if spec.kind == "hf" else None)


def _hf_generator(model: nn.Module, tokenizer_dir: str, chat: bool, where: str) -> Generator:
    from shardwise.hf.config_model import hf_max_positions

    model.eval()
    vocab = int(model.get_output_embeddings().weight.shape[0])
    encode, decode, eos = _text_codec(vocab, tokenizer_dir, chat, where)
    return Generator(lambda ids: model(input_ids=ids, use_cache=False).logits, hf_max_positions(model.config),
                     encode, decode, eos, cached=hf_cached_logits(model))


def from_adapter(path: Path, tokenizer: str, chat: bool, base: str) -> Generator:
    """A LoRA adapter export: ``PeftModel.from_pretrained`` over its base (``--base``, else the directory its
    ``adapter_config.json`` names), the tokenizer from the export or the base."""
    from transformers import AutoModelForCausalLM

    from shardwise.hf.lora import ADAPTER_CONFIG

    try:
        with open(path / ADAPTER_CONFIG) as f:
            recorded = json.load(f).get("base_model_name_or_path")
    except (OSError, ValueError, AttributeError) as e:
        raise ShardwiseError(f"{path / ADAPTER_CONFIG}: cannot be read as a peft adapter config ({e})") from None
    base_dir = base or recorded
    if not base_dir or not os.path.isdir(base_dir):
        said = f"names {recorded!r}, not a directory here" if recorded else "names no base"
        raise ShardwiseError(f"{path}: a LoRA adapter; its {ADAPTER_CONFIG} {said}: pass --base DIR (the model "
                             f"directory it was trained over)")
    from peft import PeftModel

    from shardwise.hf.lora import quiet_peft

    with quiet_peft():
        model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_dir, local_files_only=True),
                                          str(path))
    own = any((path / n).is_file() for n in ("tokenizer.json", "tokenizer_config.json"))
    return _hf_generator(model, tokenizer or (str(path) if own else base_dir), chat, str(path))


def from_export(path: Path, tokenizer: str, chat: bool) -> Generator:
    if (path / "config.json").is_file():
        from transformers import AutoModelForCausalLM

        model: nn.Module = AutoModelForCausalLM.from_pretrained(str(path), local_files_only=True)
        return _hf_generator(model, tokenizer or str(path), chat, str(path))
    from safetensors.torch import load_file

    from shardwise.checkpoint.export import INDEX_FILE, SINGLE_FILE
    from shardwise.models.gpt import GPT, GPTConfig

    with open(path / "shardwise_model.json") as f:
        config = GPTConfig(**json.load(f)["config"])
    gpt = GPT(config)
    if (path / INDEX_FILE).is_file():
        with open(path / INDEX_FILE) as f:
            names = sorted(set(json.load(f)["weight_map"].values()))
    else:
        names = [SINGLE_FILE]
    state = {}
    for name in names:
        state.update(load_file(str(path / name)))
    missing, unexpected = gpt.load_state_dict(state, strict=False)
    tied = {"lm_head.weight"} if config.tie_weights else set()
    if set(missing) - tied or unexpected:
        raise ShardwiseError(f"{path}: weights do not match the GPT in shardwise_model.json (missing "
                             f"{sorted(set(missing) - tied)[:3]}, unexpected {sorted(unexpected)[:3]})")
    gpt.eval()
    encode, decode, eos = _text_codec(config.vocab_size, tokenizer, chat, str(path))
    return Generator(lambda ids: gpt(ids).logits, config.block_size, encode, decode, eos)


def generate_text(path: str, prompt: str, *, max_new_tokens: int = 200, temperature: float = 0.8, top_k: int = 50,
                  seed: int = 0, tokenizer: str = "", chat: bool = False, base: str = "") -> str:
    """The continuation of ``prompt`` sampled from the model at ``path`` (see the module docstring)."""
    from shardwise.hf.lora import ADAPTER_CONFIG

    p = Path(path)
    if not p.is_dir():
        raise ShardwiseError(f"{path}: no such directory; expected a run directory, a checkpoint or an export")
    is_run = _run_config_dir(p) is not None
    is_adapter = not is_run and (p / ADAPTER_CONFIG).is_file()
    if not (is_run or is_adapter) and not ((p / "config.json").is_file() or (p / "shardwise_model.json").is_file()):
        raise ShardwiseError(f"{path}: neither a run directory (config.toml) nor an export (config.json, "
                             f"shardwise_model.json, or a LoRA adapter's {ADAPTER_CONFIG})")
    if base and not is_adapter:
        raise ShardwiseError(f"--base: {path} is not a LoRA adapter export; --base names an adapter's base model")
    with one_process_group() if is_run else nullcontext():
        if is_run:
            gen = from_run(p, tokenizer, chat)
        else:
            gen = from_adapter(p, tokenizer, chat, base) if is_adapter else from_export(p, tokenizer, chat)
        new = sample(gen, gen.encode(prompt), max_new_tokens, temperature, top_k, seed)
        if new and new[-1] == gen.eos_token_id:
            new = new[:-1]  # the stop token ends the text; it is not part of it
        return gen.decode(new)

def generate_main(argv: Sequence[str], parser: Optional[argparse.ArgumentParser] = None) -> int:
    args = (parser or make_parser()).parse_args(list(argv))
    check_args(args)
    text = generate_text(args.path, args.prompt, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                         top_k=args.top_k, seed=args.seed, tokenizer=args.tokenizer, chat=args.chat, base=args.base)
    # a chat reply is the assistant's turn, not a continuation of the prompt's text
    print(f"{args.prompt}\n\n{text.strip()}" if args.chat else args.prompt + text, flush=True)
    return 0
