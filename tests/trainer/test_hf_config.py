"""--model PATH/config.json: Hugging Face causal LMs (Llama, GPT-2) from a config alone, random init, sharded
with units="auto+head" (their own block class, and an untied embedding and head, as units); big ones built on
meta and initialised shard by shard."""

import json
import math

import pytest

pytest.importorskip("transformers")

import torch  # noqa: E402

from harness import run_distributed  # noqa: E402
from shardwise.engine.base.plan import build_plan  # noqa: E402
from shardwise.hf.model_spec import ModelError, resolve_model  # noqa: E402
from shardwise.models.gpt import Block  # noqa: E402

LLAMA = dict(model_type="llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=320, max_position_embeddings=128, rms_norm_eps=1e-5)
GPT2 = dict(model_type="gpt2", n_embd=64, n_layer=3, n_head=4, vocab_size=320, n_positions=128)


def write(tmp_path, name, cfg):
    path = tmp_path / name
    path.write_text(json.dumps(cfg))
    return str(path)


def test_resolve_llama_and_gpt2(tmp_path):
    llama = resolve_model(write(tmp_path, "llama.json", LLAMA))
    assert llama.kind == "hf" and llama.vocab_size == 320 and llama.n_layer == 2 and llama.max_seq_len == 128
    model = llama.build("meta")
    assert all(p.is_meta for p in model.parameters())
    # the default is units="auto+head": the decoder layers, and Llama's untied embedding and head each a unit
    assert llama.units(model, "transformer_based_wrap", []) == "auto+head"
    assert [type(u.module).__name__ for u in build_plan(model, "auto+head", 2).units] == [
        "Embedding", "LlamaDecoderLayer", "LlamaDecoderLayer", "Linear", type(model).__name__]
    assert {c.__name__ for c in llama.units(model, "transformer_based_wrap", ["LlamaDecoderLayer"])} == {
        "LlamaDecoderLayer"}
    assert llama.units(model, "no_wrap", []) is None
    gpt2 = resolve_model(write(tmp_path, "gpt2.json", GPT2))
    assert gpt2.units(gpt2.build("meta"), "transformer_based_wrap", []) == "auto+head"
    assert resolve_model("gpt-tiny").units(None, "transformer_based_wrap", []) == {Block}
    with pytest.raises(ModelError, match="NotALayer not in"):
        gpt2.units(gpt2.build("meta"), "transformer_based_wrap", ["NotALayer"])


def test_bad_configs_rejected(tmp_path):
    with pytest.raises(ModelError, match="no 'model_type'"):
        resolve_model(write(tmp_path, "a.json", {"hidden_size": 4}))
    with pytest.raises(ModelError, match="does not know model_type"):
        resolve_model(write(tmp_path, "b.json", {"model_type": "no-such-arch"}))
    with pytest.raises(ModelError, match="does not exist"):
        resolve_model(str(tmp_path / "missing" / "config.json"))


def _meta_init_worker(rank, world, path):
    import shardwise
    from shardwise.hf.model_spec import lm_loss

    spec = resolve_model(path)
    torch.manual_seed(0)
    eager_buffers = {k: v.clone() for k, v in spec.build("cpu").named_buffers()}
    model = spec.build("meta")
    units = spec.units(model, "transformer_based_wrap", [])
    model = shardwise.shard(model, units=units, param_init_fn=spec.param_init_fn(model, torch.device("cpu")),
                            device="cpu")
    buffers_ok = all(torch.equal(b, eager_buffers[k]) for k, b in model.named_buffers() if k in eager_buffers)
    sd = shardwise.full_state_dict(model)
    stats = {k: (float(v.float().mean()), float(v.float().std()) if v.numel() > 1 else 0.0) for k, v in sd.items()}
    torch.manual_seed(1 + rank)
    x = torch.randint(0, spec.vocab_size, (2, 16))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for _ in range(2):
        loss = lm_loss(spec, model, x, x.roll(-1, 1))
        loss.backward()
        shardwise.clip_grad_norm_(model, 1.0)
        opt.step()
        opt.zero_grad()
        losses.append(float(loss))
    return buffers_ok, stats, losses


@pytest.mark.parametrize("name, cfg", [("llama", LLAMA), ("gpt2", GPT2)])
def test_meta_build_is_initialised_like_hf_and_trains(tmp_path, name, cfg):
    path = write(tmp_path, f"{name}.json", cfg)
    results = run_distributed(_meta_init_worker, 2, path)
    buffers_ok, stats, losses = results[0]
    assert buffers_ok  # e.g. rotary inv_freq recomputed, not left as uninitialised memory
    for k, (mean, std) in stats.items():
        if "norm" in k or k.endswith(("ln_1.weight", "ln_2.weight", "ln_f.weight")):
            assert mean == 1.0, k  # norms start at one
        elif k.endswith(("embed_tokens.weight", "q_proj.weight", "wte.weight", "c_fc.weight")):
            assert abs(std - 0.02) < 0.004, (k, std)
    if name == "gpt2":  # GPT-2's residual projections are scaled by 1/sqrt(2 * n_layer) from the parent module
        std = stats["transformer.h.0.attn.c_proj.weight"][1]
        assert abs(std - 0.02 / math.sqrt(2 * cfg["n_layer"])) < 0.002, std
    assert all(math.isfinite(v) for v in losses)
    assert abs(losses[0] - math.log(cfg["vocab_size"])) < 0.5  # random init: about uniform predictions
    assert results[1][2] == pytest.approx(results[1][2])  # both ranks ran


def _train_worker(rank, world, cfg_values):
    from shardwise.trainer.config import TrainConfig
    from shardwise.trainer.loop import train

    return train(TrainConfig(**cfg_values))


def test_trainer_runs_a_hf_config(tmp_path):
    import dataclasses

    from shardwise.trainer.config import TrainConfig

    cfg = TrainConfig(model=write(tmp_path, "llama.json", LLAMA), steps=3, batch_size=2, seq_len=32, eval_every=3,
                      eval_batches=1, log_every=1, warmup_steps=1, progress=False, out=str(tmp_path / "run"),
                      mixed_precision="bf16")
    results = run_distributed(_train_worker, 2, dataclasses.asdict(cfg))
    vals = results[0]["val_losses"]
    assert [s for s, _ in vals] == [0, 3] and vals[-1][1] < vals[0][1]
    assert (tmp_path / "run" / "step-00000003").is_dir()
