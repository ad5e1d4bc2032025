""".jsonl training data: records -> token ids plus a loss mask, with a Hugging Face tokenizer.

Three record kinds, one JSON object per line (blank lines are skipped):

- ``{"text": "..."}``: language modelling, every token in the loss;
- ``{"prompt": "...", "completion": "..."}``: supervised fine-tuning, only the completion's tokens (and the
  EOS that ends it) in the loss;
- ``{"messages": [{"role": ..., "content": ...}, ...]}``: a chat, rendered with the tokenizer's chat template
  (``apply_chat_template``); only the assistant turns are in the loss (their content and whatever the template
  writes after it up to the next turn, e.g. ``<|end|>``), not the ``<|assistant|>`` header before it.

Every document is followed by the tokenizer's EOS token, so packed documents are joined by EOS.

[Note: masking by segments] A record is split into segments of text that are in the loss or not (prompt |
completion; for chats: everything up to the assistant's generation prompt | the assistant turn | ...), and
each segment is tokenised on its own with ``add_special_tokens=False``. So the mask boundaries are exact for
any tokenizer (no offset mapping, no token straddling a boundary). The segments of a chat come from rendering
its prefixes: ``render(messages[:i], add_generation_prompt=True)`` ends where assistant turn i starts and
``render(messages[:i + 1])`` where it ends; a template that rewrites earlier turns when later ones are added
(is not prefix-stable) is refused with the line named, since no such split exists.
"""

from __future__ import annotations

import json
import os
from typing import Any, Callable, Iterator, Optional

from shardwise.trainer.data import DataError

# Files in a model directory that make up its tokenizer (what the cache key hashes).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja", "chat_template.json")
KINDS = ("text", "prompt_completion", "messages")


def is_jsonl_source(source: str) -> bool:
    """A ``.jsonl`` file, or a directory holding at least one (its other files are then ignored)."""
    if os.path.isdir(source):
        return bool(jsonl_files(source))
    return source.endswith(".jsonl")


def jsonl_files(source: str) -> list[str]:
    """The .jsonl files of a source, in sorted path order."""
    if os.path.isdir(source):
        return sorted(os.path.join(d, f) for d, _, files in os.walk(source) for f in files if f.endswith(".jsonl"))
    return [source]


def check_files(source: str) -> list[str]:
    """The .jsonl files of a source, or DataError if one is missing."""
    files = jsonl_files(source)
    for path in files:
        if not os.path.isfile(path):
            raise DataError(f"--data {source}: no such file")
    return files


def tokenizer_dir(model: str) -> str:
    """Where ``--model`` keeps its tokenizer: the directory itself, or the one holding its config.json."""
    return model if os.path.isdir(model) else os.path.dirname(os.path.abspath(model))


def tokenizer_file_paths(model: str) -> list[str]:
    directory = tokenizer_dir(model)
    return [os.path.join(directory, n) for n in TOKENIZER_FILES if os.path.isfile(os.path.join(directory, n))]


def load_tokenizer(model: str, data: str):
    """``AutoTokenizer`` from the model directory (local files only), or DataError saying what is missing."""
    if not (os.path.isdir(model) or model.endswith(".json")) or not tokenizer_file_paths(model):
        raise DataError(f"--data {data}: .jsonl data is tokenised with the model's tokenizer, and --model {model} "
                        f"holds none; pass --model DIR, a Hugging Face model directory with tokenizer files "
                        f"({', '.join(TOKENIZER_FILES[:3])}, ...)")
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(tokenizer_dir(model), local_files_only=True)
    except Exception as e:  # a damaged tokenizer.json, a tokenizer class transformers lacks, ...
        raise DataError(f"--model {model}: cannot load its tokenizer: {type(e).__name__}: "
                        f"{str(e).splitlines()[0][:200] if str(e) else ''}") from None
    if tok.eos_token_id is None:
        raise DataError(f"--model {model}: its tokenizer has no eos_token, which joins packed documents")
    return tok


def read_records(path: str, on_bytes: Optional[Callable[[int], None]] = None) -> Iterator[tuple[int, dict[str, Any]]]:
    """(line number, record) for every non-blank line; DataError naming ``path:line`` for anything else.
    ``on_bytes(n)`` is told the size of every line read (a progress bar)."""
    with open(path, "rb") as f:
        for number, raw in enumerate(f, start=1):
            if on_bytes is not None:
                on_bytes(len(raw))
            if not raw.strip():
                continue
            try:
                record = json.loads(raw)
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise DataError(f"{path}:{number}: not a JSON object ({e})") from None
            if not isinstance(record, dict):
                raise DataError(f"{path}:{number}: expected a JSON object, found {type(record).__name__}")
            yield number, record


def record_kind(record: dict[str, Any], where: str) -> str:
    """Which of ``KINDS`` a record is, with its fields checked."""
    def need_str(key: str) -> None:
        if not isinstance(record[key], str):
            raise DataError(f"{where}: {key!r} must be a string, found {type(record[key]).__name__}")

    if "messages" in record:
        messages = record["messages"]
        if not isinstance(messages, list) or not messages:
            raise DataError(f"{where}: 'messages' must be a non-empty list of {{\"role\", \"content\"}} objects")
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
                raise DataError(f"{where}: messages[{i}] must be an object with string 'role' and 'content'")
        if not any(m["role"] == "assistant" for m in messages):
            raise DataError(f"{where}: 'messages' has no assistant turn, so nothing would be trained on")
        return "messages"
    if "prompt" in record or "completion" in record:
        for key in ("prompt", "completion"):
            if key not in record:
                raise DataError(f"{where}: a record with 'prompt' or 'completion' needs both")
            need_str(key)
        return "prompt_completion"
    if "text" in record:
        need_str("text")
        return "text"
    raise DataError(f"{where}: a record needs 'text', 'prompt' and 'completion', or 'messages'; found keys "
                    f"{', '.join(sorted(record)) or 'none'}")


def segments(tok, record: dict[str, Any], kind: str, where: str) -> list[tuple[str, bool]]:
    """The record as (text, in the loss) pieces, in order ([Note: masking by segments])."""
    if kind == "text":
        return [(record["text"], True)]
    if kind == "prompt_completion":
        return [(record["prompt"], False), (record["completion"], True)]
    return chat_segments(tok, record["messages"], where)


def chat_segments(tok, messages: list[dict], where: str) -> list[tuple[str, bool]]:
    if not getattr(tok, "chat_template", None):
        raise DataError(f"{where}: 'messages' records are rendered with the tokenizer's chat template, and this "
                        f"tokenizer has none")

    def render(prefix: list[dict], generation_prompt: bool) -> str:
        if not prefix and not generation_prompt:
            return ""
        try:
            return tok.apply_chat_template(prefix, tokenize=False, add_generation_prompt=generation_prompt)
        except Exception as e:  # the template's own checks (role order, system placement, ...)
            raise DataError(f"{where}: the chat template refuses these messages: {type(e).__name__}: "
                            f"{str(e).splitlines()[0][:200] if str(e) else ''}") from None

    full = render(messages, False)
    out, pos = [], 0
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        start, end = render(messages[:i], True), render(messages[: i + 1], False)
        if not (full.startswith(end) and end.startswith(start) and len(start) >= pos):
            raise DataError(f"{where}: the chat template is not prefix-stable (rendering the first {i + 1} "
                            f"messages is not a prefix of rendering them all), so assistant turn {i} cannot be "
                            f"located for the loss mask")
        out += [(full[pos:len(start)], False), (end[len(start):], True)]
        pos = len(end)
    out.append((full[pos:], False))
    return [(text, train) for text, train in out if text]


def encode_record(tok, record: dict[str, Any], where: str) -> tuple[list[int], list[int]]:
    """(token ids, loss mask) of one document, EOS appended (in the loss when the last segment is)."""
    kind = record_kind(record, where)
    ids: list[int] = []
    mask: list[int] = []
    last = True
    for text, train in segments(tok, record, kind, where):
        piece = tok(text, add_special_tokens=False)["input_ids"]
        ids += piece
        mask += [int(train)] * len(piece)
        last = train
    ids.append(tok.eos_token_id)
    mask.append(int(last if kind == "messages" else True))
    return ids, mask

