"""Fuzz: seeded random damage to a real trainer checkpoint, each case loaded three ways (the trainer's
resume, ``load_checkpoint`` and ``export``). Every load must end either bitwise identical to the undamaged
checkpoint's or in a one-line ShardwiseError naming a file of the damaged checkpoint, within seconds.
While the loads run, an audit hook records every file opened (none may lie outside the checkpoint), the
address space is capped at 2 GiB above what the process already holds (a load that allocated what a
hostile shape declares would fail with a non-ShardwiseError), and a failed ``load_checkpoint`` must
leave the model and optimizer as they were.

Accidental damage (bit flips, truncation, appended bytes, deleted and renamed files, edited JSON, foreign
files) leaves the commit record as it was. Deliberate edits (huge shapes, path traversal, structural and
type edits) rewrite the manifest *and* its commit record, as someone editing a checkpoint on purpose
would, so the checks behind the commit chain are what must catch them. Deliberate edits that yield a
checkpoint indistinguishable from a genuine one (another learning rate, other weights) are not damage:
docs/CHECKPOINTS.md's trust model says so, and they are not generated here.

The default run is 173 cases at world size 1 (well under a minute); ``-m slow`` runs 480 more at world
size 2, where one rank's bad file must make both ranks raise the same error.
"""

from __future__ import annotations

import collections
import copy
import json
import math
import os
import random
import resource
import shutil
import struct
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from harness import run_distributed

KINDS = ("bitflip", "truncate", "append", "delete", "rename", "json_edit", "commit_edit", "foreign_file",
         "huge_shape", "path_traversal", "signed_structural", "signed_type_edit")
STEP = 2
TRAIN_TOKENS = 1000
SECONDS_PER_LOAD = 10.0
HEADROOM = 2 << 30  # address space a load may add


# ---- the checkpoints ----------------------------------------------------------------------------------------


def _trainer_objects(seed: int):
    from shardwise.trainer.config import TrainConfig
    from shardwise.trainer.loop import build_optimizer, build_sharded_model
    from shardwise.hf.model_spec import resolve_model

    cfg = TrainConfig(model="gpt-tiny", seed=seed)
    spec = resolve_model(cfg.model)
    model = build_sharded_model(cfg, spec, torch.device("cpu"))
    return spec, model, build_optimizer(model, cfg)


def _train_and_save(root: Path, rank: int) -> None:
    """step-1 in root/other (a second checkpoint to swap files with), step-2 in root/pristine/run."""
    import shardwise
    from shardwise.trainer import state
    from shardwise.trainer.loop import seed_everything
    from shardwise.hf.model_spec import lm_loss

    seed_everything(0)
    spec, model, opt = _trainer_objects(0)
    for step in (1, STEP):
        g = torch.Generator().manual_seed(100 * step + rank)
        x = torch.randint(0, 256, (2, 17), generator=g)
        lm_loss(spec, model, x[:, :-1], x[:, 1:]).backward()
        shardwise.clip_grad_norm_(model, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        out = root / ("other" if step == 1 else "pristine") / "run"
        state.save_training_state(str(out), model, opt, step=step, seed=0, train_tokens=TRAIN_TOKENS)


# ---- damage ---------------------------------------------------------------------------------------------------


def _resign(ckpt: Path, manifest) -> None:
    from shardwise.checkpoint.commit import commit_record

    data = json.dumps(manifest).encode()
    (ckpt / "manifest.json").write_bytes(data)
    (ckpt / "commit.json").write_text(json.dumps(commit_record(data)))


def _manifest(ckpt: Path) -> dict:
    return json.loads((ckpt / "manifest.json").read_text())


def _rank_files(ckpt: Path) -> list[str]:
    return sorted(p.name for p in ckpt.iterdir() if p.name.endswith(".safetensors"))


def _all_files(ckpt: Path) -> list[str]:
    return sorted(p.name for p in ckpt.iterdir())


def _leaves(obj, path=()):
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from _leaves(v, path + (k,))
    elif isinstance(obj, list) and obj:
        for i, v in enumerate(obj):
            yield from _leaves(v, path + (i,))
    else:
        yield path, obj


def _set(obj, path, value) -> None:
    for key in path[:-1]:
        obj = obj[key]
    obj[path[-1]] = value


def _kind_of(value) -> str:
    if value is None or isinstance(value, bool):
        return "flag"  # torch's optimizer flags are None until chosen: null and bool are one kind
    if isinstance(value, (int, float)):
        return "number"
    return type(value).__name__


_REPLACEMENTS = [None, True, 7, -1, 2.5, float("nan"), float("inf"), "x", "../../etc/passwd", [], [1, 2], {}, {"a": 1}]


ALL, OPTIMIZER, EXPORT, NONE = frozenset({"load", "resume", "export"}), frozenset({"load", "resume"}), \
    frozenset({"export"}), frozenset()


def _damage(kind: str, variant: int, rng: random.Random, ckpt: Path, env: dict) -> tuple[str, frozenset]:
    """Damage ``ckpt`` in place. Returns (what was done, the loaders that must refuse it; the others may
    also load it, as long as what they restore is bitwise the undamaged checkpoint's). ``variant`` counts
    the cases of this kind so far: kinds with several variants go through all of them in turn."""
    files = _all_files(ckpt)
    rank_files = _rank_files(ckpt)
    if kind == "bitflip":
        name = rng.choice(files)
        data = bytearray((ckpt / name).read_bytes())
        at, bit = rng.randrange(len(data)), rng.randrange(8)
        data[at] ^= 1 << bit
        (ckpt / name).write_bytes(bytes(data))
        return f"flip bit {bit} of byte {at} of {name}", ALL
    if kind == "truncate":
        name = rng.choice(files)
        size = (ckpt / name).stat().st_size
        keep = rng.choice([0, 7, 8, rng.randrange(size), size - 1])
        with open(ckpt / name, "r+b") as f:
            f.truncate(keep)
        return f"truncate {name} to {keep} of {size} bytes", ALL
    if kind == "append":
        name = rng.choice(files)
        with open(ckpt / name, "ab") as f:
            f.write(bytes(rng.randrange(256) for _ in range(rng.randrange(1, 64))))
        return f"append junk to {name}", ALL
    if kind == "delete":
        name = rng.choice(files)
        os.remove(ckpt / name)
        return f"delete {name}", ALL
    if kind == "rename":
        choice = variant % 3
        if choice == 0:
            name = rng.choice(files)
            os.rename(ckpt / name, ckpt / (name + rng.choice([".bak", "~", ".tmp"])))
            return f"rename {name}", ALL
        if choice == 1:
            os.rename(ckpt / "manifest.json", ckpt / "swap")
            os.rename(ckpt / "commit.json", ckpt / "manifest.json")
            os.rename(ckpt / "swap", ckpt / "commit.json")
            return "swap manifest.json and commit.json", ALL
        os.rename(ckpt, ckpt.parent / "step-00000009")
        return "rename the checkpoint directory to step-00000009", ALL
    if kind == "json_edit":  # accidental: the commit record is not updated
        m = _manifest(ckpt)
        path, value = rng.choice(list(_leaves(m)))
        new = rng.choice([r for r in _REPLACEMENTS if repr(r) != repr(value)])
        _set(m, path, new)
        (ckpt / "manifest.json").write_text(json.dumps(m, indent=1))
        return f"manifest {'.'.join(map(str, path))}: {value!r} -> {new!r} (commit record not updated)", ALL
    if kind == "commit_edit":
        c = json.loads((ckpt / "commit.json").read_text())
        edit = variant % 7
        if edit == 0:
            c["manifest_sha256"] = "%064x" % rng.getrandbits(256)
        elif edit == 1:
            c["manifest_bytes"] += rng.choice([-1, 1])
        elif edit == 2:
            c["format_version"] = rng.choice([1, 3, "2", None])
        elif edit == 3:
            del c[rng.choice(sorted(c))]
        elif edit == 4:
            c["extra"] = 1
        elif edit == 5:
            c = [c]
        else:
            c = {"format": "shardwise-checkpoint-commit", "manifest_bytes": 10**30, "format_version": 2,
                 "manifest_sha256": "0" * 64}
        (ckpt / "commit.json").write_text(json.dumps(c))
        return f"commit.json edit {edit}", ALL
    if kind == "foreign_file":
        return _foreign(variant % 8, rng, ckpt, env, rank_files)
    if kind == "huge_shape":
        return _huge(variant % 3, rng, ckpt, rank_files)
    if kind == "path_traversal":
        return _traversal(rng, ckpt, env)
    if kind == "signed_structural":
        return _structural(variant, rng, ckpt)
    if kind == "signed_type_edit":
        m = _manifest(ckpt)
        leaves = [(p, v) for p, v in _leaves(m) if not (p[0] == "extra" and len(p) > 2 and p[2] == "value")]
        path, value = rng.choice(leaves)
        options = [r for r in _REPLACEMENTS if _kind_of(r) != _kind_of(value)]
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            options += [float("nan"), float("-inf"), -abs(value) - 1]
        new = rng.choice(options)
        _set(m, path, new)
        _resign(ckpt, m)
        return f"manifest {'.'.join(map(str, path))}: {value!r} -> {new!r} (re-signed)", NONE
    raise AssertionError(kind)


def _foreign(choice: int, rng: random.Random, ckpt: Path, env: dict, rank_files: list[str]) -> tuple[str, frozenset]:
    name = rng.choice(rank_files)
    pristine = env["pristine_ckpt"]
    if choice == 0:  # files the manifest does not list: never opened, so the load is unchanged
        for extra_name in ("evil.safetensors", "rank-00007-of-00008.safetensors", ".hidden", "manifest.json.bak"):
            shutil.copy(pristine / name, ckpt / extra_name)
        os.symlink("/etc/passwd", ckpt / "passwd-link")
        return "add unlisted files and a link", NONE
    if choice == 1:
        os.remove(ckpt / name)
        os.symlink(pristine / name, ckpt / name)  # the same bytes, but through a link out of the directory
        return f"{name} -> symlink to the pristine copy", ALL
    if choice == 2:
        target = rng.choice(["manifest.json", "commit.json"])
        os.remove(ckpt / target)
        os.symlink(pristine / target, ckpt / target)
        return f"{target} -> symlink to the pristine copy", ALL
    if choice == 3:
        os.remove(ckpt / name)
        os.mkfifo(ckpt / name)  # opening it for reading would block forever
        return f"{name} -> FIFO", ALL
    if choice == 4:
        os.remove(ckpt / name)
        os.mkdir(ckpt / name)
        return f"{name} -> directory", ALL
    if choice == 5:
        shutil.copy(env["other_ckpt"] / name, ckpt / name)
        return f"{name} from another checkpoint", ALL
    if choice == 6:
        for target in ("manifest.json", "commit.json"):
            shutil.copy(env["other_ckpt"] / target, ckpt / target)
        return "manifest and commit record from another checkpoint", ALL
    os.remove(ckpt / "commit.json")
    os.mkdir(ckpt / "commit.json")
    return "commit.json -> directory", ALL


def _huge(choice: int, rng: random.Random, ckpt: Path, rank_files: list[str]) -> tuple[str, frozenset]:
    m = _manifest(ckpt)
    name = rng.choice(sorted(m["params"]))
    p = m["params"][name]
    if choice == 0:  # a declared shape of 10**12 elements whose pieces tile it: only the files can refute it
        p["shape"] = [10**6, 10**6]
        p["pieces"][-1]["stop"] = 10**12
        _resign(ckpt, m)
        return f"{name}: shape [10**6, 10**6] (re-signed)", ALL
    if choice == 1:
        p["shape"] = [2**62]
        p["pieces"][-1]["stop"] = 2**62
        _resign(ckpt, m)
        return f"{name}: shape [2**62] (re-signed)", ALL
    # The rank file's own header declares a huge tensor; file size and checksum re-recorded.
    file = rng.choice(rank_files)
    data = (ckpt / file).read_bytes()
    n = struct.unpack("<Q", data[:8])[0]
    header = json.loads(data[8:8 + n])
    key = rng.choice([k for k in header if k != "__metadata__"])
    header[key]["shape"] = [10**12]
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    data = struct.pack("<Q", len(text)) + text + data[8 + n:]
    (ckpt / file).write_bytes(data)
    import hashlib

    m["files"][file].update(bytes=len(data), sha256=hashlib.sha256(data).hexdigest())
    _resign(ckpt, m)
    return f"{file}: header declares {key} of shape [10**12] (file re-recorded, re-signed)", ALL


def _traversal(rng: random.Random, ckpt: Path, env: dict) -> tuple[str, frozenset]:
    m = _manifest(ckpt)
    name = rng.choice(sorted(m["files"]))
    real = env["pristine_ckpt"] / name  # a valid file with the right checksum, outside this checkpoint
    relative = os.path.relpath(real, ckpt)
    target = rng.choice([relative, str(real), "/etc/passwd", f"{name}/../{relative}", f"./{name}",
                         f"{name}\x00.txt", "", ".."])
    where = rng.randrange(4)
    if where == 0:  # rename the file everywhere the manifest names it
        m["files"][target] = m["files"].pop(name)
        for p in m["params"].values():
            for piece in p["pieces"]:
                if piece["file"] == name:
                    piece["file"] = target
        for e in m["extra"]:
            if e["file"] == name:
                e["file"] = target
        for b in m["buffers"].values():
            if b["file"] == name:
                b["file"] = target
    elif where == 1:
        pieces = [piece for p in m["params"].values() for piece in p["pieces"]]
        rng.choice(pieces)["file"] = target
    elif where == 2:
        m["extra"][0]["file"] = target
    else:
        m["files"][target] = copy.deepcopy(m["files"][name])
    signed = rng.random() < 0.75
    if signed:
        _resign(ckpt, m)
    else:
        (ckpt / "manifest.json").write_text(json.dumps(m))
    return f"file name {target!r} at place {where}{' (re-signed)' if signed else ''}", ALL


def _structural(variant: int, rng: random.Random, ckpt: Path) -> tuple[str, frozenset]:
    """Deliberate edits that keep the JSON well-formed but contradict the files, the model or the
    schema's ranges; the commit record is rewritten each time. Some leave every restored value as it
    was (a renamed library version): those may load."""
    m = _manifest(ckpt)
    names = sorted(m["params"])
    name = rng.choice(names)
    p = m["params"][name]
    opt = m["optimizer"]
    group = opt["param_groups"][0]["options"]
    state = opt["state"][next(iter(opt["state"]))]
    two_d = [n for n in names if len(m["params"][n]["shape"]) == 2 and len(set(m["params"][n]["shape"])) == 2]
    edits = {
        "dtype": lambda: p.update(dtype=rng.choice(["bfloat16", "float64", "int64", "float16"])),
        "transpose": lambda: m["params"][t].update(shape=m["params"][t]["shape"][::-1]) if (t := rng.choice(two_d)) else None,
        "piece_shift": lambda: p["pieces"][-1].update(stop=p["pieces"][-1]["stop"] - 1),
        "piece_key": lambda: p["pieces"][0].update(key=f"param/{rng.choice([n for n in names if n != name])}"),
        "state_dtype": lambda: state["tensors"].update(exp_avg="float64"),
        "adam_step": lambda: state["scalars"]["step"].update(value=rng.choice([-3.0, float("nan"), "2"])),
        "lr": lambda: group.update(lr=rng.choice([-0.1, float("nan"), float("inf"), "fast", None])),
        "betas": lambda: group.update(betas={"__tuple__": [0.9, rng.choice([1.5, -0.1, "x"])]}),
        "weight_decay": lambda: group.update(weight_decay=-1.0),
        "eps": lambda: group.update(eps=-1e-8),
        "option_removed": lambda: group.pop("eps"),
        "option_added": lambda: group.update(turbo=True),
        "file_bytes": lambda: m["files"][rng.choice(sorted(m["files"]))].update(bytes=rng.choice([8, 10**15])),
        "file_sha": lambda: m["files"][rng.choice(sorted(m["files"]))].update(sha256="0" * 64),
        "world_size": lambda: m.update(world_size=m["world_size"] + 1),
        "strategy": lambda: m.update(strategy="zero3"),
        "top_key_removed": lambda: m.pop(rng.choice(["buffers", "extra", "files", "params", "model"])),
        "top_key_added": lambda: m.update(evil={"run": "rm -rf /"}),
        "extra_tensor_key": lambda: m["extra"][0]["value"]["rng"].update(
            torch=rng.choice([{"__tensor__": f"param/{name}"}, {"__tensor__": "extra/999"}, {"__tensor__": 7},
                              {"__evil__": 1}])),
        "alias_added": lambda: p["aliases"].append(rng.choice([n for n in names if n != name]) + ".alias"),
        "tie_claimed": lambda: (m["params"]["wte.weight"]["aliases"].append("lm_head.weight"),
                                m["params"].pop("lm_head.weight")),
        "buffer_added": lambda: m["buffers"].update({"fake": {"file": sorted(m["files"])[0], "key": "buffer/fake",
                                                              "shape": [4], "dtype": "float32"}}),
        "param_added": lambda: m["params"].update({"ghost.weight": copy.deepcopy(p)}),
        "param_dropped": lambda: m["params"].pop(name),
        "optimizer_class": lambda: opt.update({"class": "SGD"}),
        "optimizer_dropped": lambda: m.update(optimizer=None),
        "group_moved": lambda: (opt["param_groups"][0]["params"].remove(g := opt["param_groups"][0]["params"][0]),
                                opt["param_groups"][1]["params"].append(g)),
        "requires_grad": lambda: p.update(requires_grad=not p["requires_grad"]),
        "library_version": lambda: m.update(library_version="9.9.9"),
        "model_config": lambda: m["model"]["config"].update(n_layer=m["model"]["config"]["n_layer"] + 1),
    }
    # Who must refuse each edit: export does not read the optimizer, load and resume not the model
    # description, and two edits change nothing that any of them restores.
    must_fail = {"requires_grad": NONE, "library_version": NONE, "model_config": EXPORT,
                 **{k: OPTIMIZER for k in ("adam_step", "lr", "betas", "weight_decay", "eps", "option_removed",
                                           "option_added", "optimizer_class", "group_moved")}}
    which = sorted(edits)[variant % len(edits)]
    edits[which]()
    _resign(ckpt, m)
    return f"{which} on {name} (re-signed)", must_fail.get(which, ALL)


# ---- the three loaders and the oracle ------------------------------------------------------------------------


class Watch:
    """Records every file opened (sys.audit 'open') under ``root`` but outside the allowed prefixes."""

    def __init__(self, root: Path):
        self.root = os.path.normpath(str(root))
        self.allowed: tuple[str, ...] = ()
        self.outside: list[str] = []
        self.active = False
        sys.addaudithook(self._hook)

    def _hook(self, event, args):
        if not self.active or event != "open" or not args or not isinstance(args[0], (str, bytes, os.PathLike)):
            return
        path = os.path.normpath(os.path.abspath(os.fsdecode(args[0])))
        if path in ("/etc/passwd", "/etc/shadow") or (
                (path + os.sep).startswith(self.root + os.sep)
                and not any((path + os.sep).startswith(a + os.sep) for a in self.allowed)):
            self.outside.append(path)


def _snapshot(model, opt) -> dict:
    return {"params": [p.detach().clone() for p in model.parameters()],
            "optim": copy.deepcopy(opt.state_dict())}


def _restore(model, opt, snap) -> None:
    with torch.no_grad():
        for p, b in zip(model.parameters(), snap["params"]):
            p.copy_(b)
    opt.load_state_dict(copy.deepcopy(snap["optim"]))


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype
                and a.shape == b.shape and torch.equal(a, b))
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return isinstance(a, np.ndarray) and isinstance(b, np.ndarray) and a.dtype == b.dtype and np.array_equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    return type(a) is type(b) and a == b


def _rng_states():
    return (torch.get_rng_state(), np.random.get_state(), random.getstate())


def _dir_bytes(path: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(path.iterdir())}


def _fuzz(rank: int, world_size: int, root: str, first_seed: int, schedule: list[str]):
    import torch.distributed as dist

    from shardwise import export_checkpoint, load_checkpoint
    from shardwise.errors import ShardwiseError
    from shardwise.trainer import state

    root = Path(root)
    _train_and_save(root, rank)
    dist.barrier()
    pristine_run = root / "pristine" / "run"
    pristine = pristine_run / f"step-{STEP:08d}"
    env = {"pristine_ckpt": pristine, "other_ckpt": root / "other" / "run" / "step-00000001"}
    _, model, opt = _trainer_objects(5)  # another init: everything must come from the checkpoint
    blank = _snapshot(model, opt)

    # What the undamaged checkpoint restores, three ways.
    ref_extra = load_checkpoint(pristine, model, opt)
    ref_load = _snapshot(model, opt)
    _restore(model, opt, blank)
    ref_step, _ = state.restore_training_state(str(pristine_run), "auto", model, opt, seed=0, train_tokens=TRAIN_TOKENS)
    ref_resume = (_snapshot(model, opt), _rng_states())
    ref_export = None
    if rank == 0:
        export_checkpoint(pristine, root / "ref-export")
        ref_export = _dir_bytes(root / "ref-export")

    watch = Watch(root)
    status = Path(f"/proc/{os.getpid()}/status").read_text()
    vm_kb = int(next(line.split()[1] for line in status.splitlines() if line.startswith("VmSize:")))
    resource.setrlimit(resource.RLIMIT_AS, (vm_kb * 1024 + HEADROOM, resource.RLIM_INFINITY))

    counts: dict = collections.defaultdict(collections.Counter)
    failures: list[str] = []
    slowest = 0.0
    variants: collections.Counter = collections.Counter()
    for i, kind in enumerate(schedule):
        seed = first_seed + i
        variant = variants[kind]
        variants[kind] += 1
        case_run = root / "cases" / str(i) / "run"
        ckpt = case_run / f"step-{STEP:08d}"
        if rank == 0:
            shutil.copytree(pristine_run, case_run, symlinks=True)
            what, must_fail = _damage(kind, variant, random.Random(seed), ckpt, env)
        dist.barrier()
        watch.allowed = (str(case_run), str(root / "exports" / str(i)))

        def run(loader: str, fn, check_same):
            nonlocal slowest
            if loader == "load":
                _restore(model, opt, blank)
            watch.active = True
            start = time.monotonic()
            try:
                result, error = fn(), None
            except ShardwiseError as e:
                result, error = None, str(e)
            except BaseException as e:  # noqa: BLE001 - every other exception is a finding
                result, error = None, f"NOT A ShardwiseError: {type(e).__name__}: {str(e)[:300]}"
            finally:
                watch.active = False
                elapsed = time.monotonic() - start
                slowest = max(slowest, elapsed)
            tag = f"case {i} ({kind}: {what if rank == 0 else ''}) {loader}"
            if elapsed > SECONDS_PER_LOAD:
                failures.append(f"{tag}: took {elapsed:.1f}s")
            if error is None:
                if not check_same(result):
                    failures.append(f"{tag}: loaded WITHOUT an error but restored different values")
                elif loader in must_fail:
                    failures.append(f"{tag}: loaded, but this damage must be refused")
                counts[kind][f"{loader}: identical"] += 1
                return "identical"
            counts[kind][f"{loader}: ShardwiseError"] += 1
            if os.environ.get("FUZZ_VERBOSE"):  # FUZZ_VERBOSE=1 pytest -s: every error message, to read them
                print(f"{tag}: {error}", flush=True)
            if error.startswith("NOT A") or " failed on rank " in error:  # the latter: agree.attempt's wrapping
                failures.append(f"{tag}: an internal error, not a verdict on the checkpoint: {error}")
            elif str(case_run) not in error or "\n" in error or not any(
                    t in error for t in ("commit.json", "manifest.json", ".safetensors", "step-")):
                failures.append(f"{tag}: the error does not name a file of the checkpoint in one line: {error!r}")
            if loader == "load" and not _same(_snapshot(model, opt), blank):
                failures.append(f"{tag}: failed, but changed the model or optimizer first")
            return error

        must_fail = must_fail if rank == 0 else NONE
        what = what if rank == 0 else ""
        outcomes = [
            run("load", lambda: (load_checkpoint(ckpt, model, opt), _snapshot(model, opt)),
                lambda r: _same(r[0], ref_extra) and _same(r[1], ref_load)),
            run("resume", lambda: (state.restore_training_state(str(case_run), "auto", model, opt, seed=0,
                                                               train_tokens=TRAIN_TOKENS)[0],
                                   _snapshot(model, opt), _rng_states()),
                lambda r: r[0] == ref_step and _same(r[1], ref_resume[0]) and _same(r[2], ref_resume[1])),
        ]
        if rank == 0:
            out = root / "exports" / str(i) / "out"
            out.parent.mkdir(parents=True)
            outcomes.append(run("export", lambda: (export_checkpoint(ckpt, out), _dir_bytes(out))[1],
                                lambda r: r == ref_export))
            if watch.outside:
                failures.append(f"case {i} ({kind}: {what}): opened files outside the checkpoint: {watch.outside[:3]}")
                watch.outside.clear()
            shutil.rmtree(root / "cases" / str(i), ignore_errors=True)
            shutil.rmtree(root / "exports" / str(i), ignore_errors=True)
        dist.barrier()
    return {"counts": {k: dict(v) for k, v in counts.items()}, "failures": failures, "slowest": slowest}


def _schedule(rounds: int) -> list[str]:
    """``rounds`` cases of every kind, plus enough structural edits to make each of them at least once."""
    return [kind for _ in range(rounds) for kind in KINDS] + ["signed_structural"] * max(0, STRUCTURAL_EDITS - rounds)


STRUCTURAL_EDITS = 30


def _report(result: dict, count: int) -> str:
    lines = [f"{count} corruptions; slowest single load {result['slowest']:.2f}s"]
    for kind in KINDS:
        c = result["counts"].get(kind, {})
        lines.append(f"  {kind:<18} " + "  ".join(f"{k} {v}" for k, v in sorted(c.items())))
    return "\n".join(lines)


def _check(results: list, count: int) -> None:
    print("\n" + _report(results[0], count))
    failures = [f for r in results for f in r["failures"]]
    assert not failures, f"{len(failures)} findings:\n" + "\n".join(failures[:40])
    if len(results) > 1:  # every rank saw the same outcome classes (an error on one rank raised on all)
        for kind, c in results[0]["counts"].items():
            mine = {k: v for k, v in c.items() if not k.startswith("export")}
            assert mine == results[1]["counts"][kind], kind


def test_fuzzed_checkpoints_load_identically_or_raise_naming_the_file(tmp_path):
    schedule = _schedule(13)  # 173 cases
    _check(run_distributed(_fuzz, 1, str(tmp_path), 0, schedule, timeout_s=300), len(schedule))


@pytest.mark.slow
def test_fuzzed_checkpoints_at_two_ranks(tmp_path):
    schedule = _schedule(40)  # 480 cases, other seeds
    _check(run_distributed(_fuzz, 2, str(tmp_path), 10_000, schedule, timeout_s=600), len(schedule))
