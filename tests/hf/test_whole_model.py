"""shardwise.save_whole_model: a sharded model written whole is what the unsharded model's save_pretrained
writes (same files, same names, same bytes), loads with from_pretrained in one process, holds one flat
group at a time while streaming, is atomic (a failed save leaves the directory as it was and every rank
raises), refuses a call made on one rank only by name, and writes a peft model's adapter as peft does.

One spawn per world size; the scenarios inside it are independent (``run_scenarios``)."""

from __future__ import annotations

import json
import os
import weakref

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("peft")

from harness import run_distributed
from hf_dirs import tiny_config
from parity_utils import run_scenarios, scenario, spawn_once

VOCAB = 97


def _model(family: str, seed: int = 0):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(tiny_config(family, VOCAB, bos_token_id=0, eos_token_id=0,
                                                        pad_token_id=1))


def _tensors(directory: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out = {}
    for name in sorted(os.listdir(directory)):
        if name.endswith(".safetensors"):
            out.update(load_file(os.path.join(directory, name)))
    return out


def _same_tensors(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a)


def _matches_save_pretrained(rank: int, root: str, family: str) -> dict:
    """The files save_pretrained writes for the same weights, and from_pretrained of ours equal to them."""
    import shardwise
    from transformers import AutoModelForCausalLM

    ref = _model(family)
    model = shardwise.shard(_model(family), units="auto")
    ours, theirs = os.path.join(root, f"{family}-ours"), os.path.join(root, f"{family}-theirs")
    written = shardwise.save_whole_model(model, ours)
    if rank != 0:
        return {"written": written}
    ref.save_pretrained(theirs)
    loaded = AutoModelForCausalLM.from_pretrained(ours)
    config = json.loads(open(os.path.join(ours, "config.json")).read())
    return {"written": [os.path.basename(p) for p in written],
            "files": sorted(os.listdir(ours)) == sorted(os.listdir(theirs)),
            "tensors": _same_tensors(_tensors(ours), _tensors(theirs)),
            "loaded": _same_tensors(loaded.state_dict(), ref.state_dict()),
            "dtype": config["dtype"], "architectures": config["architectures"]}


def _split_and_cast(rank: int, root: str) -> dict:
    """max_shard_size splits as save_pretrained does (an index); dtype casts; a later single-file save into
    the same directory removes the old shards, and other files in it stay."""
    import shardwise
    from transformers import AutoModelForCausalLM

    ref = _model("llama")
    model = shardwise.shard(_model("llama"), units="auto")
    out = os.path.join(root, "split")
    if rank == 0:
        os.makedirs(out)
        open(os.path.join(out, "trainer_state.json"), "w").write("{}")
    shardwise.save_whole_model(model, out, max_shard_size="40KB", dtype=torch.bfloat16)
    result = {}
    if rank == 0:
        index = json.loads(open(os.path.join(out, "model.safetensors.index.json")).read())
        loaded = AutoModelForCausalLM.from_pretrained(out)
        result = {"files": len({f for f in index["weight_map"].values()}),
                  "loaded": all(torch.equal(v, ref.state_dict()[k].to(torch.bfloat16))
                                for k, v in loaded.state_dict().items()),
                  "loaded_dtype": str(loaded.dtype)}
    shardwise.save_whole_model(model, out)
    if rank == 0:
        result["after"] = sorted(os.listdir(out))
    return result


def _one_group_at_a_time(rank: int, root: str) -> dict:
    """While saving, a gathered flat group's memory is freed before the next one is gathered, on every rank."""
    import shardwise
    from shardwise.engine.core.flat_group import FlatGroup

    model = shardwise.shard(_model("llama"), units="auto")
    alive_at_gather, refs = [], []
    original = FlatGroup.gather_full

    def tracked(self):  # the engine may keep a finished collective's tensor object, but not its memory
        alive_at_gather.append(sum(r() is not None and r().untyped_storage().nbytes() > 0 for r in refs))
        full = original(self)
        refs.append(weakref.ref(full._base if full._base is not None else full))
        return full

    FlatGroup.gather_full = tracked
    try:
        shardwise.save_whole_model(model, os.path.join(root, "streamed"))
    finally:
        FlatGroup.gather_full = original
    return {"gathers": len(alive_at_gather), "most_alive": max(alive_at_gather)}


def _failed_write(rank: int, root: str) -> dict:
    """A write that fails on rank 0 after its first file: every rank raises naming the file, the directory is
    as it was, no temporary directory is left, and the model trains on."""
    import errno

    import shardwise
    from shardwise.checkpoint import export

    model = shardwise.shard(_model("llama"), units="auto")
    out = os.path.join(root, "full-disk")
    shardwise.save_whole_model(model, out)
    before = {n: open(os.path.join(out, n), "rb").read() for n in sorted(os.listdir(out))}
    original, calls = export.write_safetensors_streamed, []

    def failing(path, *args, **kwargs):
        calls.append(path)
        if len(calls) == 2:
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        return original(path, *args, **kwargs)

    export.write_safetensors_streamed = failing
    try:
        shardwise.save_whole_model(model, out, max_shard_size="40KB")
        error = None
    except shardwise.ShardwiseError as e:
        error = str(e)
    finally:
        export.write_safetensors_streamed = original
    x = torch.randint(0, VOCAB, (2, 8))
    model(input_ids=x, labels=x).loss.backward()  # the process group is still usable
    after = {n: open(os.path.join(out, n), "rb").read() for n in sorted(os.listdir(out))}
    return {"message": error, "unchanged": before == after,
            "leftovers": [n for n in os.listdir(root) if ".save-tmp-" in n]}


def _adapter(rank: int, root: str) -> dict:
    """A peft model: the adapter, as PeftModel.save_pretrained writes it."""
    from peft import LoraConfig, get_peft_model

    import shardwise

    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    torch.manual_seed(0)
    ref = get_peft_model(_model("llama"), config)
    torch.manual_seed(0)
    model = shardwise.shard(get_peft_model(_model("llama"), config), units="auto")
    with torch.no_grad():  # B is zero at init: give the adapter values a save could get wrong
        for name, p in ref.named_parameters():
            if "lora_B" in name:
                p.fill_(0.25)
        shardwise.load_full_state_dict(model, ref.state_dict() if rank == 0 else {})
    ours, theirs = os.path.join(root, "adapter-ours"), os.path.join(root, "adapter-theirs")
    shardwise.save_whole_model(model, ours)
    # a Trainer's save_model of a peft model: the tokenizer beside the adapter, as the Trainer writes it
    from hf_dirs import make_tokenizer

    tokenizer = make_tokenizer(os.path.join(root, f"tokenizer-{rank}"))
    with_tokenizer = os.path.join(root, "adapter-tokenizer")
    shardwise.save_whole_model(model, with_tokenizer, processing_class=tokenizer)
    if rank != 0:
        return {}
    ref.save_pretrained(theirs)
    cfg = lambda d: {k: v for k, v in json.loads(open(os.path.join(d, "adapter_config.json")).read()).items()
                     if k != "inference_mode"}
    return {"files": sorted(os.listdir(ours)), "tensors": _same_tensors(_tensors(ours), _tensors(theirs)),
            "config": cfg(ours) == cfg(theirs), "with_tokenizer": sorted(os.listdir(with_tokenizer))}


def _save_pretrained(rank: int, root: str) -> dict:
    """``model.save_pretrained(dir, is_main_process=rank == 0)`` on every rank, as transformers' no-trainer
    examples call it, is save_whole_model: the files the unsharded model's save_pretrained writes; a peft
    model's writes its adapter; an argument the streamed writer cannot honour is refused by name."""
    from peft import LoraConfig, get_peft_model

    import shardwise

    ref = _model("llama")
    model = shardwise.shard(_model("llama"), units="auto")
    ours, theirs = os.path.join(root, "pretrained-ours"), os.path.join(root, "pretrained-theirs")
    model.save_pretrained(ours, is_main_process=rank == 0)
    try:
        model.save_pretrained(os.path.join(root, "pretrained-refused"), state_dict={})
        refused = None
    except shardwise.ShardwiseError as e:
        refused = str(e)
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    torch.manual_seed(0)
    peft_model = shardwise.shard(get_peft_model(_model("llama"), config), units="auto")
    adapter = os.path.join(root, "pretrained-adapter")
    peft_model.save_pretrained(adapter)
    if rank != 0:
        return {"refused": refused}
    ref.save_pretrained(theirs)
    return {"files": sorted(os.listdir(ours)) == sorted(os.listdir(theirs)),
            "tensors": _same_tensors(_tensors(ours), _tensors(theirs)), "refused": refused,
            "adapter": sorted(os.listdir(adapter))}


def _peft_configs() -> dict:
    """What peft's save_pretrained writes beyond one LoRA adapter named "default": adapters under other
    names (each in its own directory), one of them frozen; modules_to_save and trainable tokens; prompt
    learning (the saved prompt is the prompt encoder's output, a forward every rank makes)."""
    from peft import LoraConfig, PromptEncoderConfig, PromptTuningConfig

    lora = lambda **kw: LoraConfig(r=4, lora_alpha=8, task_type="CAUSAL_LM", **{"target_modules": ["q_proj"], **kw})
    return {
        "named_adapters": ([("sft", lora()), ("dpo", lora(target_modules=["v_proj", "o_proj"]))], {}),
        "selected_adapter": ([("sft", lora()), ("dpo", lora(target_modules=["v_proj"]))],
                             {"selected_adapters": ["dpo"]}),
        "modules_to_save_and_tokens": ([("default", lora(modules_to_save=["lm_head"],
                                                         trainable_token_indices={"embed_tokens": [3, 5]}))], {}),
        "embeddings_targeted": ([("default", lora(target_modules=["embed_tokens", "q_proj"]))], {}),
        "prompt_tuning": ([("default", PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=3))], {}),
        "p_tuning": ([("default", PromptEncoderConfig(task_type="CAUSAL_LM", num_virtual_tokens=3,
                                                      encoder_hidden_size=8))], {}),
    }


def _peft_saves(rank: int, root: str) -> dict:
    """``save_pretrained`` of each peft model of _peft_configs on every rank: the files (paths, tensors,
    configs) that the unsharded peft model's save_pretrained writes."""
    from peft import get_peft_model

    import shardwise

    out = {}
    for case, (adapters, kwargs) in _peft_configs().items():
        def build():
            torch.manual_seed(0)
            model = get_peft_model(_model("llama"), adapters[0][1], adapter_name=adapters[0][0])
            for name, config in adapters[1:]:
                model.add_adapter(name, config)
            return model

        ref, model = build(), shardwise.shard(build(), units="auto")
        with torch.no_grad():  # LoRA's B is zero at init: give every tensor a save could get wrong a value
            for p in ref.parameters():
                if not p.any():
                    p.fill_(0.25)
            shardwise.load_full_state_dict(model, ref.state_dict() if rank == 0 else {})
        ours, theirs = os.path.join(root, f"{case}-ours"), os.path.join(root, f"{case}-theirs")
        model.save_pretrained(ours, is_main_process=rank == 0, **kwargs)
        if rank != 0:
            continue
        ref.save_pretrained(theirs, **kwargs)
        walk = lambda d: sorted(os.path.relpath(os.path.join(w, f), d) for w, _, fs in os.walk(d) for f in fs
                                if f != "README.md")  # peft's model card, not written here
        cfg = lambda d: {k: v for k, v in json.loads(open(os.path.join(d, "adapter_config.json")).read()).items()
                         if k != "inference_mode"}
        dirs = sorted({os.path.dirname(f) for f in walk(theirs)})
        out[case] = {"files": walk(ours) == walk(theirs), "listing": walk(ours),
                     "tensors": all(_same_tensors(_tensors(os.path.join(ours, d)), _tensors(os.path.join(theirs, d)))
                                    for d in dirs),
                     "config": all(cfg(os.path.join(ours, d)) == cfg(os.path.join(theirs, d)) for d in dirs)}
    return out


def _scenarios(rank: int, world: int, root: str) -> dict:
    return run_scenarios({
        "llama": lambda r, w: _matches_save_pretrained(r, root, "llama"),
        "qwen2_tied": lambda r, w: _matches_save_pretrained(r, root, "qwen2"),
        "split_and_cast": lambda r, w: _split_and_cast(r, root),
        "streamed": lambda r, w: _one_group_at_a_time(r, root),
        "failed_write": lambda r, w: _failed_write(r, root),
        "adapter": lambda r, w: _adapter(r, root),
        "save_pretrained": lambda r, w: _save_pretrained(r, root),
        "peft_saves": lambda r, w: _peft_saves(r, root),
    }, rank, world)


@spawn_once
def _report(world: int, root: str) -> list:
    return run_distributed(_scenarios, world, root, timeout_s=120)


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return str(tmp_path_factory.mktemp("whole"))


WORLDS = [2, pytest.param(3, marks=pytest.mark.slow)]


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("family", ["llama", "qwen2_tied"])
def test_whole_model_is_what_save_pretrained_writes_and_loads_in_one_process(world, family, root):
    ours = scenario(_report(world, f"{root}/{world}")[0], family)
    assert ours["written"] == ["model.safetensors"]
    assert ours["files"], "the same files as save_pretrained (config, generation config, weights)"
    assert ours["tensors"], "the same names and bytes as save_pretrained (a tied weight once)"
    assert ours["loaded"], "from_pretrained of the save equals the model"
    assert ours["dtype"] == "float32" and ours["architectures"] == ["LlamaForCausalLM" if family == "llama"
                                                                     else "Qwen2ForCausalLM"]


@pytest.mark.parametrize("world", WORLDS)
def test_whole_model_splits_casts_and_replaces_only_its_own_files(world, root):
    r = scenario(_report(world, f"{root}/{world}")[0], "split_and_cast")
    assert r["files"] > 1 and r["loaded"] and r["loaded_dtype"] == "torch.bfloat16"
    assert r["after"] == ["config.json", "generation_config.json", "model.safetensors", "trainer_state.json"]


@pytest.mark.parametrize("world", WORLDS)
def test_whole_model_holds_one_flat_group_at_a_time(world, root):
    for rank_report in _report(world, f"{root}/{world}"):
        r = scenario(rank_report, "streamed")
        assert r["gathers"] > 2 and r["most_alive"] == 0, r


@pytest.mark.parametrize("world", WORLDS)
def test_whole_model_failed_write_raises_everywhere_and_leaves_the_directory(world, root):
    for rank_report in _report(world, f"{root}/{world}"):
        r = scenario(rank_report, "failed_write")
        assert r["message"] and "No space left on device" in r["message"] and "model-00002-of-" in r["message"], r
        assert r["unchanged"] and not r["leftovers"], r


@pytest.mark.parametrize("world", WORLDS)
def test_whole_model_of_a_peft_model_is_its_adapter(world, root):
    r = scenario(_report(world, f"{root}/{world}")[0], "adapter")
    assert r["files"] == ["adapter_config.json", "adapter_model.safetensors"]
    assert r["tensors"] and r["config"], r
    assert r["with_tokenizer"] == ["adapter_config.json", "adapter_model.safetensors", "chat_template.jinja",
                                   "tokenizer.json", "tokenizer_config.json"], r


@pytest.mark.parametrize("world", WORLDS)
def test_save_pretrained_of_a_sharded_model_is_the_whole_model(world, root):
    reports = _report(world, f"{root}/{world}")
    r = scenario(reports[0], "save_pretrained")
    assert r["files"] and r["tensors"], r
    assert r["adapter"] == ["adapter_config.json", "adapter_model.safetensors"], r
    for rank_report in reports:
        refused = scenario(rank_report, "save_pretrained")["refused"]
        assert refused and "save_pretrained(..., state_dict={})" in refused, refused


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("case", list(_peft_configs()))
def test_save_pretrained_of_a_sharded_peft_model_writes_what_peft_writes(world, case, root):
    """Adapters under any name (each but "default" in its own directory, a frozen one too, or the
    selected_adapters only), modules_to_save, trainable tokens, targeted embeddings, and prompt learning's
    prompt: the unsharded peft model's files, paths and bytes."""
    r = scenario(_report(world, f"{root}/{world}")[0], "peft_saves")[case]
    assert r["files"] and r["tensors"] and r["config"], r


def _alone(rank: int, world: int, root: str, how: str) -> str | None:
    import shardwise

    model = shardwise.shard(_model("llama"), units="auto")
    x = torch.randint(0, VOCAB, (2, 8))
    try:
        if rank == 0:
            if how == "save_pretrained":  # (the DDP habit: guarded by the rank, not is_main_process)
                model.save_pretrained(os.path.join(root, "alone"))
            else:
                shardwise.save_whole_model(model, os.path.join(root, "alone"))
        model(input_ids=x, labels=x).loss.backward()
    except shardwise.ShardwiseError as e:
        return str(e)
    return None


@pytest.mark.parametrize("how", ["save_whole_model", "save_pretrained"])
def test_whole_model_saved_on_one_rank_only_is_named_on_every_rank(tmp_path, how):
    errors = run_distributed(_alone, 2, str(tmp_path), how, timeout_s=60,
                             env={"SHARDWISE_GLOO_NATIVE_COLLECTIVES": "1"})
    for e in errors:
        assert e and "ranks [0] are at save_whole_model" in e, errors
    assert not (tmp_path / "alone").exists()
