"""Run directories (commit protocol, ``latest``, pruning, resume) and damaged or foreign checkpoints: each
damage gives one clear error, naming the file, on every rank."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import struct
from pathlib import Path

import torch

from ckpt_workers import build
from harness import run_distributed


def test_manager_commit_latest_prune_resume(run_dir):
    path, results = run_dir
    steps_before, resumed, same, steps_after, listing, _, decoy_error = results[0]
    assert steps_before == [2, 3]  # keep_last=2 pruned step 1 only after step 3 was complete
    # The newest step-* directory is not a checkpoint: resume names it instead of going back to step 3.
    assert decoy_error is not None and "step-00000009" in decoy_error and "commit.json" in decoy_error
    assert results[1][6] == decoy_error  # every rank raised the same error
    assert resumed == (3, {"step": 3, "rank": 0}) and results[1][1] == (3, {"step": 3, "rank": 1})
    assert same
    assert steps_after == [3, 4]
    # The stale temporary directory was replaced by the step-4 save and is gone.
    assert listing == ["latest", "step-00000003", "step-00000004"]
    assert (path / "latest").read_text().strip() == "step-00000004"


# ---- damage ---------------------------------------------------------------------------------------------


def resign(ckpt: Path, manifest: dict) -> None:
    """Write ``manifest`` and a commit record that vouches for it: what someone who edits a checkpoint on
    purpose does, so that the checks behind the commit record are the ones tested."""
    from shardwise.checkpoint.commit import commit_record

    data = json.dumps(manifest).encode()
    (ckpt / "manifest.json").write_bytes(data)
    (ckpt / "commit.json").write_text(json.dumps(commit_record(data)))


def _rewrite_with_renamed_tensor(ckpt: Path, file: str, old: str, new: str) -> None:
    """Rename a tensor inside a safetensors file and re-record the file in the manifest, so that only the
    name, not a checksum, gives it away."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(ckpt / file)
    tensors[new] = tensors.pop(old)
    save_file(tensors, ckpt / file)
    manifest = json.loads((ckpt / "manifest.json").read_text())
    data = (ckpt / file).read_bytes()
    manifest["files"][file].update(bytes=len(data), sha256=hashlib.sha256(data).hexdigest())
    resign(ckpt, manifest)


def _damaged_copies(src: Path, root: Path) -> dict[str, Path]:
    r0, r1 = "rank-00000-of-00002.safetensors", "rank-00001-of-00002.safetensors"
    cases = {}

    def copy(name):
        dst = root / name
        shutil.copytree(src, dst)
        cases[name] = dst
        return dst

    d = copy("truncated")
    with open(d / r1, "r+b") as f:
        f.truncate((d / r1).stat().st_size - 100)
    d = copy("flipped")
    with open(d / r0, "r+b") as f:
        header = struct.unpack("<Q", f.read(8))[0]
        f.seek(8 + header + 64)
        b = f.read(1)
        f.seek(8 + header + 64)
        f.write(bytes([b[0] ^ 0x01]))
    d = copy("missing")
    os.remove(d / r1)
    d = copy("renamed")
    _rewrite_with_renamed_tensor(d, r0, "param/wte.weight", "param/wte.weight_renamed")
    d = copy("edited_manifest")  # one value changed, the commit record not updated
    manifest = json.loads((d / "manifest.json").read_text())
    manifest["optimizer"]["param_groups"][0]["options"]["lr"] = 0.5
    (d / "manifest.json").write_text(json.dumps(manifest))
    d = copy("lost_piece")  # the same edit with the commit record rewritten: the schema catches it
    manifest = json.loads((d / "manifest.json").read_text())
    manifest["params"]["wpe.weight"]["pieces"] = []
    resign(d, manifest)
    d = copy("missing_commit")
    os.remove(d / "commit.json")
    d = copy("foreign_json")
    (d / "manifest.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 64}))
    d = copy("torn_manifest")
    text = (d / "manifest.json").read_text()
    (d / "manifest.json").write_text(text[: len(text) // 2])
    d = root / "dcp"
    d.mkdir()
    (d / ".metadata").write_bytes(b"\x80\x04not ours")
    (d / "__0_0.distcp").write_bytes(b"")
    cases["dcp"] = d
    return cases


def _load_each(rank, world_size, cases, good):
    import pickle

    from shardwise.checkpoint import load_checkpoint
    from shardwise.errors import ShardwiseError
    from shardwise.models import GPT

    # Loading must never unpickle: make any attempt fail loudly.
    def refuse(*a, **k):
        raise AssertionError("a checkpoint load tried to unpickle")

    build()  # import everything torch imports lazily before the trap is set
    pickle.loads = pickle.load = torch.load = refuse
    out = {}
    for name, path in cases.items():
        model, opt = build()
        try:
            load_checkpoint(path, model, opt)
            out[name] = "loaded"
        except ShardwiseError as e:
            out[name] = str(e)
    import shardwise

    for name, preset in (("fewer_layers", dict(n_layer=1)), ("wider", dict(n_embd=96, n_head=2))):
        model = shardwise.shard(GPT.from_preset("gpt-tiny", tie_weights=True, **preset))
        try:
            load_checkpoint(good, model)
            out[name] = "loaded"
        except ShardwiseError as e:
            out[name] = str(e)
    model, opt = build()
    load_checkpoint(good, model, opt)  # and the undamaged one still loads, without pickle
    return out


EXPECTED = {
    "truncated": ["rank-00001-of-00002.safetensors", "truncated"],
    "flipped": ["rank-00000-of-00002.safetensors", "checksum mismatch"],
    "missing": ["rank-00001-of-00002.safetensors", "missing"],
    "renamed": ["rank-00000-of-00002.safetensors", "has no tensor 'param/wte.weight'"],
    "edited_manifest": ["manifest.json: does not match commit.json", "changed or damaged after"],
    "lost_piece": ["manifest.json: params['wpe.weight'].pieces: no values for elements [0, ", "parameter 'wpe.weight'"],
    "missing_commit": ["commit.json: missing", "not a complete checkpoint"],
    "foreign_json": ["manifest.json", "not a shardwise checkpoint"],
    "torn_manifest": ["manifest.json", "not valid JSON"],
    "dcp": ["not a shardwise checkpoint", "torch.distributed.checkpoint"],
    "fewer_layers": ["different model", "not in the model: blocks.1."],
    "wider": ["different model", "blocks.0.ln_1.weight: shape (64,) in the checkpoint, (96,) in the model", "more differences"],
}


def test_damaged_checkpoints_raise_clear_errors_on_every_rank(run_dir, tmp_path):
    path, _ = run_dir
    good = path / "step-00000004"
    cases = _damaged_copies(good, tmp_path)
    results = run_distributed(_load_each, 2, cases, good)
    assert results[0] == results[1], "ranks disagree on the error"
    for name, needles in EXPECTED.items():
        message = results[0][name]
        for needle in needles:
            assert needle in message, f"{name}: {needle!r} not in {message!r}"
