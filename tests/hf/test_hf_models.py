"""Hugging Face ``transformers`` models built from tiny configs (no download), sharded with ``units="auto"``.

``units="auto"`` reads ``_no_split_modules`` (LlamaDecoderLayer, GPT2Block) and makes Llama's untied embedding
a unit of its own. The models return
``ModelOutput`` (a dict subclass) holding non-tensor values (a KV cache), which the hooks must pass through
untouched. Parity as in ``test_parity``: fp32 SGD+momentum, losses and every parameter to 1e-6 relative
against a single-process reference on the global batch, at world size 2. GPT-2 ties its head to the token
embedding, so this also covers tied weights in a third-party model.
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from harness import run_distributed  # noqa: E402
from parity_utils import (assert_parity, is_sharded, make_batches, parity_check, run_scenarios,  # noqa: E402
                          scenario, spawn_once)
from shardwise.engine.core.runtime import runtime_of  # noqa: E402

WORLD_SIZE = 2
STEPS = 3
VOCAB = 101

CONFIGS = {
    "llama": lambda: transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=30, intermediate_size=37, num_hidden_layers=2, num_attention_heads=3,
        num_key_value_heads=1, max_position_embeddings=32, bos_token_id=0, eos_token_id=1, pad_token_id=None),
    "gpt2": lambda: transformers.GPT2Config(
        vocab_size=VOCAB, n_embd=27, n_layer=2, n_head=3, n_positions=32, resid_pdrop=0.0, embd_pdrop=0.0,
        attn_pdrop=0.0, bos_token_id=0, eos_token_id=1),
}


def _build(name: str):
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(CONFIGS[name]())


def _hf_step(model, batch, step, take):
    x, y = batch
    out = model(input_ids=take(x), labels=take(y))
    _OUTPUT_TYPES.append((is_sharded(model), type(out).__name__))
    out.loss.backward()
    return out.loss.detach()


_OUTPUT_TYPES: list = []


def _scenario(name):
    def run(rank, ws):
        _OUTPUT_TYPES.clear()
        metrics, model, _ = parity_check(_build(name), _hf_step, make_batches(STEPS, VOCAB), rank, ws,
                                         shard_kwargs=dict(units="auto"))
        return dict(metrics=metrics, units=[u.label for u in runtime_of(model).units],
                    output_types={kind: sorted({t for s, t in _OUTPUT_TYPES if s == (kind == "sharded")})
                                  for kind in ("sharded", "reference")})

    return run


def _hf_worker(rank, ws):
    return run_scenarios({name: _scenario(name) for name in CONFIGS}, rank, ws)


@spawn_once
def report() -> dict:
    return run_distributed(_hf_worker, WORLD_SIZE)[0]


@pytest.mark.parametrize("name,units", [
    ("llama", ["model.embed_tokens", "model.layers.0", "model.layers.1", "<root>"]),
    ("gpt2", ["transformer.h.0", "transformer.h.1", "<root>"]),
])
def test_units_auto_shards_hugging_face_decoder_layers(name, units):
    """units='auto' makes each decoder layer (from _no_split_modules) a unit and Llama's untied embedding a
    unit, and leaves GPT-2's tied one (wte is lm_head) in the root, with the head."""
    r = scenario(report(), name)
    assert r["units"] == units


@pytest.mark.parametrize("name", list(CONFIGS))
def test_hugging_face_causal_lm_trains_in_parity_with_single_process_reference(name):
    """AutoModelForCausalLM.from_config (Llama, GPT-2): losses and parameters equal the reference to 1e-6."""
    r = scenario(report(), name)
    assert_parity(r["metrics"], label=name)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_model_output_dict_survives_the_hooks(name):
    """The root's ModelOutput reaches the caller as the same class (loss attribute intact), sharded or not."""
    types = scenario(report(), name)["output_types"]
    assert len(types["reference"]) == 1 and types["reference"][0].startswith("CausalLMOutput")
    assert types["sharded"] == types["reference"]
