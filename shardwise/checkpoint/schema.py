"""The manifest's schema, checked strictly before any of it is used: every key known, every value of its
type and in its range, every file name one that ``save`` would have written, every element range
consistent with its parameter's shape.

Nothing here touches the disk; ``verify.py`` then checks what the manifest says against the files (sizes,
checksums, safetensors headers) and ``load.py`` against the model being loaded into. The checks are
written against what ``save.py`` produces, not against what a reader could tolerate: a manifest that
``save`` could not have written is damaged, or written by someone else, and is refused with the JSON
path of the first thing wrong.
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any, Iterable, Optional

from shardwise.checkpoint.format import _DTYPE_NAMES, FORMAT_NAME, FORMAT_VERSION, rank_file_name
from shardwise.checkpoint.frozen_base import check_record
from shardwise.checkpoint.values import check_encoded
from shardwise.errors import ShardwiseError
from shardwise.engine.base.strategy import STRATEGY_NAMES

MAX_WORLD_SIZE = 2**20
MAX_DIMS = 16
MAX_NUMEL = 2**62  # a bound on the arithmetic only; what a file really holds is bounded by verify.py
MAX_FILE_BYTES = 2**50
STRATEGIES = STRATEGY_NAMES
_SHA256 = re.compile(r"^[0-9a-f]{64}$")
_EXTRA_KEY = re.compile(r"^extra/\d{1,9}$")
_STATE_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,127}$")
_CLASS_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_.]{0,255}$")
_ARCH_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,127}$")

TOP_LEVEL = ("format", "format_version", "library_version", "created_unix", "step", "world_size", "strategy",
             "shard_size", "replicate_size", "model", "files", "params", "buffers", "optimizer", "extra")


def short(value: Any, limit: int = 60) -> str:
    """A value for an error message: its repr (control characters escaped), cut to ``limit`` characters."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def numel_of(shape: Iterable[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


class _Checker:
    """Type and range checks whose failures name the manifest and the JSON path."""

    def __init__(self, path: Path):
        self.path = path

    def fail(self, where: str, what: str) -> ShardwiseError:
        return ShardwiseError(f"{self.path}: {where}: {what}; the manifest is damaged or was not written by "
                              f"shardwise")

    def obj(self, value: Any, where: str, required: Iterable[str], optional: Iterable[str] = ()) -> dict:
        required, optional = set(required), set(optional)
        self.map(value, where)
        missing = sorted(required - set(value))
        if missing:
            raise self.fail(where, f"missing {', '.join(repr(k) for k in missing)}")
        unknown = sorted(set(value) - required - optional)
        if unknown:
            raise self.fail(where, f"unknown key {short(unknown[0])}")
        return value

    def map(self, value: Any, where: str) -> dict:
        if not isinstance(value, dict):
            raise self.fail(where, f"expected a JSON object, found {type(value).__name__}")
        return value

    def list(self, value: Any, where: str, max_len: int = 10**7) -> list:
        if not isinstance(value, list):
            raise self.fail(where, f"expected a JSON array, found {type(value).__name__}")
        if len(value) > max_len:
            raise self.fail(where, f"{len(value)} entries, more than {max_len}")
        return value

    def int(self, value: Any, where: str, lo: int, hi: int) -> int:
        if type(value) is not int:
            raise self.fail(where, f"expected an integer, found {short(value)}")
        if not lo <= value <= hi:
            raise self.fail(where, f"{short(value)} is out of range [{lo}, {hi}]")
        return value

    def str(self, value: Any, where: str, pattern: Optional[re.Pattern] = None, max_len: int = 1024) -> str:
        if not isinstance(value, str) or not value or len(value) > max_len:
            raise self.fail(where, f"expected a non-empty string of at most {max_len} characters, found {short(value)}")
        if pattern is not None and not pattern.match(value):
            raise self.fail(where, f"{short(value)} is not of the form {pattern.pattern}")
        return value

    def name(self, value: Any, where: str) -> str:
        """A parameter, buffer or state name: printable, no whitespace (they end up in error messages)."""
        self.str(value, where)
        if not value.isprintable() or any(c.isspace() for c in value):
            raise self.fail(where, f"name {short(value)} has whitespace or unprintable characters")
        return value

    def dtype(self, value: Any, where: str) -> str:
        if not isinstance(value, str) or value not in _DTYPE_NAMES:
            raise self.fail(where, f"unknown dtype {short(value)}; valid: {', '.join(_DTYPE_NAMES)}")
        return value

    def number(self, value: Any, where: str) -> float:
        if type(value) not in (int, float) or not math.isfinite(value):
            raise self.fail(where, f"expected a finite number, found {short(value)}")
        return value

    def shape(self, value: Any, where: str) -> list[int]:
        self.list(value, where, MAX_DIMS)
        for i, d in enumerate(value):
            self.int(d, f"{where}[{i}]", 0, MAX_NUMEL)
        if numel_of(value) > MAX_NUMEL:
            raise self.fail(where, f"shape {short(value)} has more than 2**62 elements")
        return value


def check_manifest(m: Any, path: Path) -> None:
    """Raise a ShardwiseError naming ``path`` and the JSON path of the first violation; None if sound."""
    c = _Checker(Path(path))
    c.obj(m, "manifest", TOP_LEVEL, ["frozen_base"])
    if m["format"] != FORMAT_NAME or m["format_version"] != FORMAT_VERSION:
        raise c.fail("format", f"expected {FORMAT_NAME!r} version {FORMAT_VERSION}")
    c.str(m["library_version"], "library_version", max_len=64)
    c.number(m["created_unix"], "created_unix")
    if m["step"] is not None:
        c.int(m["step"], "step", 0, 2**63 - 1)
    world = c.int(m["world_size"], "world_size", 1, MAX_WORLD_SIZE)
    if m["strategy"] not in STRATEGIES:
        raise c.fail("strategy", f"{short(m['strategy'])} is not one of {', '.join(STRATEGIES)}")
    shard = c.int(m["shard_size"], "shard_size", 1, world)
    replicate = c.int(m["replicate_size"], "replicate_size", 1, world)
    if shard * replicate != world:
        raise c.fail("shard_size", f"shard_size {shard} x replicate_size {replicate} is not world_size {world}")
    _check_model(c, m["model"])
    _check_files(c, m["files"], world)
    _check_params(c, m["params"], m["files"])
    _check_buffers(c, m["buffers"], world)
    _check_optimizer(c, m["optimizer"], m["params"])
    _check_extra(c, m["extra"], world)
    if "frozen_base" in m:
        try:
            check_record(m["frozen_base"], "frozen_base", saved=True)
        except ShardwiseError as e:
            raise c.fail("frozen_base", str(e)) from None
        if m["frozen_base"]["dtype"] is not None:
            c.dtype(m["frozen_base"]["dtype"], "frozen_base.dtype")


def _check_model(c: _Checker, model: Any) -> None:
    c.obj(model, "model", ["class"], ["config", "hf_config", "hf_architectures", "peft_config"])
    c.str(model["class"], "model.class", _CLASS_NAME)
    for key in ("config", "hf_config", "peft_config"):
        if key in model:
            c.map(model[key], f"model.{key}")
    if "hf_architectures" in model:
        for i, arch in enumerate(c.list(model["hf_architectures"], "model.hf_architectures", 16)):
            c.str(arch, f"model.hf_architectures[{i}]", _ARCH_NAME)


def _check_files(c: _Checker, files: Any, world: int) -> None:
    c.map(files, "files")
    # The names are not free text: save writes exactly one file per rank, named by rank and world size. A
    # manifest naming anything else (another path, '..', an absolute name) is refused before any open.
    expected = {rank_file_name(r, world): r for r in range(world)}
    for name in files:
        if name not in expected:
            raise c.fail("files", f"unexpected file name {short(name)}; a checkpoint of world size {world} has "
                                  f"exactly {rank_file_name(0, world)} ... {rank_file_name(world - 1, world)}")
    if len(files) != world:
        missing = next(n for n in expected if n not in files)
        raise c.fail("files", f"{missing} is not listed (every rank writes one file)")
    for name, entry in files.items():
        where = f"files[{name!r}]"
        c.obj(entry, where, ["rank", "bytes", "sha256"])
        if type(entry["rank"]) is not int or entry["rank"] != expected[name]:
            raise c.fail(f"{where}.rank", f"{short(entry['rank'])} does not match the file name")
        c.int(entry["bytes"], f"{where}.bytes", 8, MAX_FILE_BYTES)
        c.str(entry["sha256"], f"{where}.sha256", _SHA256)


def _check_params(c: _Checker, params: Any, files: dict) -> None:
    c.map(params, "params")
    taken: dict[str, str] = {}  # every name and alias, so two parameters can never claim one name
    for name, p in params.items():
        where = f"params[{name!r}]"
        c.name(name, where)
        c.obj(p, where, ["shape", "dtype", "requires_grad", "aliases", "pieces"])
        c.shape(p["shape"], f"{where}.shape")
        c.dtype(p["dtype"], f"{where}.dtype")
        if not isinstance(p["requires_grad"], bool):
            raise c.fail(f"{where}.requires_grad", f"expected true or false, found {short(p['requires_grad'])}")
        for i, alias in enumerate(c.list(p["aliases"], f"{where}.aliases", 1024)):
            c.name(alias, f"{where}.aliases[{i}]")
        for n in [name] + p["aliases"]:
            if n in taken:
                raise c.fail(where, f"name {n!r} is also used by parameter {taken[n]!r}")
            taken[n] = name
        _check_pieces(c, p["pieces"], where, name, numel_of(p["shape"]), files)


def _check_pieces(c: _Checker, pieces: Any, where: str, name: str, numel: int, files: dict) -> None:
    """The pieces tile [0, numel) in order, each from a listed file under the key save gives it."""
    covered, seen_files = 0, set()
    for i, piece in enumerate(c.list(pieces, f"{where}.pieces", MAX_WORLD_SIZE)):
        pw = f"{where}.pieces[{i}]"
        c.obj(piece, pw, ["file", "start", "stop", "key", "optim"])
        if not isinstance(piece["file"], str) or piece["file"] not in files:
            raise c.fail(f"{pw}.file", f"{short(piece['file'])} is not one of the files the manifest lists")
        if piece["file"] in seen_files:
            raise c.fail(f"{pw}.file", f"a second piece from {piece['file']}")
        seen_files.add(piece["file"])
        c.int(piece["start"], f"{pw}.start", 0, MAX_NUMEL)
        c.int(piece["stop"], f"{pw}.stop", 0, MAX_NUMEL)
        if piece["start"] != covered or piece["stop"] <= piece["start"] or piece["stop"] > numel:
            raise c.fail(pw, f"elements [{piece['start']}, {piece['stop']}) do not continue at element {covered} "
                             f"of the parameter's {numel}")
        covered = piece["stop"]
        if piece["key"] != f"param/{name}":
            raise c.fail(f"{pw}.key", f"{short(piece['key'])} is not 'param/{name}'")
        for state, key in c.map(piece["optim"], f"{pw}.optim").items():
            c.str(state, f"{pw}.optim", _STATE_NAME)
            if key != f"optim/{name}/{state}":
                raise c.fail(f"{pw}.optim[{state!r}]", f"{short(key)} is not 'optim/{name}/{state}'")
    if covered != numel:
        raise c.fail(f"{where}.pieces", f"no values for elements [{covered}, {numel}) of parameter {name!r}")


def _check_buffers(c: _Checker, buffers: Any, world: int) -> None:
    rank0 = rank_file_name(0, world)
    for name, b in c.map(buffers, "buffers").items():
        where = f"buffers[{name!r}]"
        c.name(name, where)
        c.obj(b, where, ["file", "key", "shape", "dtype"])
        if b["file"] != rank0:
            raise c.fail(f"{where}.file", f"{short(b['file'])}, but buffers are written by rank 0 into {rank0}")
        if b["key"] != f"buffer/{name}":
            raise c.fail(f"{where}.key", f"{short(b['key'])} is not 'buffer/{name}'")
        c.shape(b["shape"], f"{where}.shape")
        c.dtype(b["dtype"], f"{where}.dtype")


def _check_optimizer(c: _Checker, opt: Any, params: dict) -> None:
    if opt is None:
        for name, p in params.items():
            if any(piece["optim"] for piece in p["pieces"]):
                raise c.fail(f"params[{name!r}]", "optimizer state pieces, but the manifest has no optimizer")
        return
    c.obj(opt, "optimizer", ["class", "param_groups", "state"])
    c.str(opt["class"], "optimizer.class", _CLASS_NAME)
    in_groups: set[str] = set()
    for gi, group in enumerate(c.list(opt["param_groups"], "optimizer.param_groups", 10**5)):
        where = f"optimizer.param_groups[{gi}]"
        c.obj(group, where, ["params", "options"])
        for i, name in enumerate(c.list(group["params"], f"{where}.params")):
            if not isinstance(name, str) or name not in params:
                raise c.fail(f"{where}.params[{i}]", f"{short(name)} is not a parameter of the manifest")
            if name in in_groups:
                raise c.fail(f"{where}.params[{i}]", f"{name!r} is in more than one param group")
            in_groups.add(name)
        for key, value in c.map(group["options"], f"{where}.options").items():
            c.str(key, f"{where}.options", _STATE_NAME)
            if isinstance(value, dict) and set(value) == {"__scalar_tensor__"}:
                _check_scalar(c, value["__scalar_tensor__"], f"{where}.options[{key!r}]")
            else:
                _check_value(c, value, f"{where}.options[{key!r}]", tensors=False)
    state = c.map(opt["state"], "optimizer.state")
    for name, entry in state.items():
        where = f"optimizer.state[{name!r}]"
        if name not in in_groups:
            raise c.fail(where, "state for a parameter that no param group holds")
        c.obj(entry, where, ["tensors", "scalars"])
        for sname, dtype in c.map(entry["tensors"], f"{where}.tensors").items():
            c.str(sname, f"{where}.tensors", _STATE_NAME)
            c.dtype(dtype, f"{where}.tensors[{sname!r}]")
        for sname, scalar in c.map(entry["scalars"], f"{where}.scalars").items():
            c.str(sname, f"{where}.scalars", _STATE_NAME)
            if sname in entry["tensors"]:
                raise c.fail(f"{where}.scalars[{sname!r}]", "also listed as a tensor")
            if isinstance(scalar, dict) and set(scalar) == {"python"}:
                _check_plain_scalar(c, scalar["python"], f"{where}.scalars[{sname!r}].python")
            else:
                _check_scalar(c, scalar, f"{where}.scalars[{sname!r}]")
                if sname == "step" and scalar["value"] < 0:  # a step count; torch's optimizers count from 0
                    raise c.fail(f"{where}.scalars['step'].value", f"{short(scalar['value'])} is negative")
    # Every piece of a parameter carries exactly the per-element state its entry lists: state cannot vanish
    # from one piece, or appear for a parameter the optimizer kept none for, without this failing.
    for name, p in params.items():
        expected = set(state[name]["tensors"]) if name in state else set()
        for i, piece in enumerate(p["pieces"]):
            if set(piece["optim"]) != expected:
                raise c.fail(f"params[{name!r}].pieces[{i}].optim",
                             f"state {sorted(piece['optim'])}, but optimizer.state lists {sorted(expected)}")


def _check_scalar(c: _Checker, scalar: Any, where: str) -> None:
    """A 0-d tensor as {"dtype", "value"}: the value must be what that dtype holds, and finite."""
    c.obj(scalar, where, ["dtype", "value"])
    dtype, value = c.dtype(scalar["dtype"], f"{where}.dtype"), scalar["value"]
    if dtype == "bool":
        ok = isinstance(value, bool)
    elif dtype.startswith(("int", "uint")):
        ok = type(value) is int and -(2**63) <= value < 2**64
    else:
        ok = type(value) in (int, float) and math.isfinite(value)
    if not ok:
        raise c.fail(f"{where}.value", f"{short(value)} is not a finite {dtype} value")


def _check_plain_scalar(c: _Checker, value: Any, where: str) -> None:
    if value is None or isinstance(value, (bool, str)) or type(value) is int:
        return
    if type(value) is float and math.isfinite(value):
        return
    raise c.fail(where, f"{short(value)} is not a finite number, bool, string or null")


def _check_value(c: _Checker, value: Any, where: str, tensors: bool) -> list[str]:
    try:
        return check_encoded(value, where, tensors_allowed=tensors)
    except ShardwiseError as e:  # its message starts with the JSON path already
        raise ShardwiseError(f"{c.path}: {e}; the manifest is damaged or was not written by shardwise") from None


def _check_extra(c: _Checker, extra: Any, world: int) -> None:
    c.list(extra, "extra", MAX_WORLD_SIZE)
    if len(extra) != world:
        raise c.fail("extra", f"{len(extra)} entries for world size {world} (one per rank)")
    for r, entry in enumerate(extra):
        where = f"extra[{r}]"
        c.obj(entry, where, ["file", "value"])
        if entry["file"] != rank_file_name(r, world):
            raise c.fail(f"{where}.file", f"{short(entry['file'])} is not rank {r}'s file {rank_file_name(r, world)}")
        keys = _check_value(c, entry["value"], f"{where}.value", tensors=True)
        for key in keys:
            if not _EXTRA_KEY.match(key):
                raise c.fail(f"{where}.value", f"tensor key {short(key)} is not of the form extra/<n>")
        if len(set(keys)) != len(keys):
            raise c.fail(f"{where}.value", "a tensor key is used twice")


def extra_tensor_keys(value: Any) -> list[str]:
    """The tensor keys an (already checked) extra value refers to."""
    return check_encoded(value, "extra", tensors_allowed=True)
