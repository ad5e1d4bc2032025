"""A Hugging Face causal LM's input embedding is a unit of its own under ``units="auto"``, and its output head
too under ``"auto+head"`` (the trainer's default), as torchtitan shards ``tok_embeddings`` and ``output`` apart
from the layers, unless they are tied (``edge_unit_modules`` in shardwise/engine/base/plan.py):

* untied Llama under "auto+head", fp32, SGD with momentum and AdamW: parity with one process at world sizes 2
  and 3 (uneven shards; the other rows run at 2); the embedding is resharded right after its lookup (no byte
  of it gathered during any layer's forward), the head is gathered from the last layer's forward (prefetched)
  to its own backward, and released then;
* with activation checkpointing the layers are recomputed, the embedding and the head are not;
* LoRA (frozen embedding): the embedding's backward never comes, so no layer's backward prefetches it;
* a fused loss that reads ``lm_head.weight`` inside the model's forward without calling the head (TRL's
  SFTTrainer by default): trains in parity under "auto", where the head stays in the root; under
  "auto+head" the weight read there is a shard, refused by name;
* tied Llama (``tie_word_embeddings``): the shared weight stays in the root, one unit at both ends; parity;
* a checkpoint written with the units of before (the decoder layers only, the root holding embedding and head)
  loads into the new units and the other way round: the format records each parameter's element ranges,
  not the units (checkpoint/load.py, [Note: resharding by element ranges]).

One spawn per world size runs its scenarios.
"""

from __future__ import annotations

import copy
import types

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("peft")

import shardwise  # noqa: E402
from harness import run_distributed  # noqa: E402
from hf_dirs import tiny_config  # noqa: E402
from parity_utils import (assert_parity, global_mean, local_slice, make_batches, run_scenarios,  # noqa: E402
                          scenario, spawn_once, train_pair)

VOCAB, STEPS, LAYERS = 101, 3, 3  # 101 x 48 embedding elements: uneven at 2 and 3 ranks


def _llama(tie: bool = False, seed: int = 0):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(
        tiny_config("llama", VOCAB, num_hidden_layers=LAYERS, tie_word_embeddings=tie), attn_implementation="sdpa")
    model.config.use_cache = False
    return model


def _loss(model, x, y):
    logits = model(input_ids=x, use_cache=False).logits
    return torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.size(-1)), y.reshape(-1))


def _fuse_head(model) -> None:
    """The model's forward as TRL's fused LM head runs it: the backbone, then ``lm_head.weight`` read
    directly (the head module is never called)."""
    def forward(self, input_ids, use_cache=False):
        hidden = self.model(input_ids=input_ids).last_hidden_state
        return types.SimpleNamespace(logits=hidden @ self.get_output_embeddings().weight.t())

    model.forward = types.MethodType(forward, model)


def _unit_of(model, module):
    from shardwise.engine.core.runtime import runtime_of

    return next((u for u in runtime_of(model).units if u.plan.module is module), None)


def _gathered(unit) -> int:
    return 0 if unit is None else sum(g.gathered.untyped_storage().nbytes() for g in unit.flat_groups)


def _train(rank, world, initial, optimizer="sgd", units="auto+head", fused=False, **shard_kwargs) -> dict:
    """Train a sharded copy of ``initial`` beside one process; record, at every layer's forward, between the
    forward and the backward, and at every layer's MLP's backward (after the layer's own pre-backward, which
    prefetches), the embedding unit's and the head unit's gathered bytes."""
    from shardwise.engine.core.runtime import runtime_of
    from shardwise.integrations.transformers import _units_text

    model, ref = shardwise.shard(copy.deepcopy(initial), units=units, **shard_kwargs), copy.deepcopy(initial)
    if fused:
        _fuse_head(model), _fuse_head(ref)
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    embed, head = _unit_of(model, base.get_input_embeddings()), _unit_of(model, base.get_output_embeddings())
    seen = {"forward": [], "backward": [], "between": []}
    for layer in base.model.layers:
        layer.register_forward_pre_hook(lambda *_: seen["forward"].append((_gathered(embed), _gathered(head))))
        layer.mlp.register_full_backward_pre_hook(
            lambda *_: seen["backward"].append((_gathered(embed), _gathered(head))))

    def loss_step(m, batch, _step, take):
        loss = _loss(m, take(batch[0]), take(batch[1]))
        if m is model:
            seen["between"].append((_gathered(embed), _gathered(head)))
        loss.backward()
        return loss.detach()

    metrics = train_pair(model, ref, loss_step, make_batches(STEPS, VOCAB), rank, world, optimizer=optimizer)
    units = runtime_of(model).units
    return {"metrics": metrics, "seen": seen, "units": [(u.label, u.plan.edge) for u in units],
            "said": _units_text(model), "recomputed": [u.label for u in units if "forward" in vars(u.plan.module)]}


def _fused_head_unit_refused(rank, world) -> str:
    model = shardwise.shard(_llama(), units="auto+head")
    _fuse_head(model)
    try:
        _loss(model, *(local_slice(t, rank, world) for t in make_batches(1, VOCAB)[0]))
    except shardwise.ShardwiseError as e:
        return str(e)
    return "no error"


def _lora(seed: int = 0):
    from shardwise.hf.lora import LoraSettings, apply_lora

    model = _llama(seed=seed)
    torch.manual_seed(1)  # peft's adapter init draws from the global generator: the same on every rank
    model = apply_lora(model, LoraSettings(r=4, alpha=8.0, target_modules=("q_proj", "v_proj")))
    with torch.no_grad():  # init_lora_weights=True leaves B = 0; give it values so that A's gradient is not zero
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.05)
    return model


def _lora_inputs_require_grad(hf_checkpointing: bool = False):
    """As peft's ``prepare_model_for_kbit_training`` and transformers' ``gradient_checkpointing_enable`` leave
    a LoRA model before it is wrapped: a forward hook on the input embedding makes its output a leaf that
    requires grad (so reentrant checkpointing sees an input that needs one); with ``hf_checkpointing`` the
    layers are checkpointed by transformers itself, reentrant, as that recipe does."""
    model = _lora()
    if hf_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
        model.train()
    model.enable_input_require_grads()
    return model


def _checkpoint_across_units(rank, world, root, saved_units, loaded_units) -> dict:
    """Train 2 steps under ``saved_units``, save; load into a model of ``loaded_units`` built from another
    seed; both go on for a step. The parameters loaded and the losses after it must be the same."""
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    from shardwise.checkpoint import load_checkpoint, save_checkpoint
    from shardwise.engine.core.runtime import runtime_of

    units = {"blocks": {LlamaDecoderLayer}, "auto+head": "auto+head"}
    batches = make_batches(3, VOCAB)

    def step(model, opt, batch):
        x, y = (local_slice(t, rank, world) for t in batch)
        loss = _loss(model, x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return global_mean(loss.detach())

    def build(which, seed):
        model = shardwise.shard(_llama(seed=seed), units=units[which])
        return model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)

    model, opt = build(saved_units, 0)
    for batch in batches[:2]:
        step(model, opt, batch)
    path = f"{root}/{saved_units}-to-{loaded_units}"
    save_checkpoint(path, model, opt, step=2)
    saved = {k: v.clone() for k, v in shardwise.full_state_dict(model).items()}
    other, other_opt = build(loaded_units, 7)
    load_checkpoint(path, other, other_opt)
    loaded = shardwise.full_state_dict(other)
    return {"units": [len(runtime_of(m).units) for m in (model, other)],
            "equal": sorted(k for k in saved if torch.equal(saved[k], loaded[k])), "keys": sorted(saved),
            "losses": [step(model, opt, batches[2]), step(other, other_opt, batches[2])]}


def _scenarios(root, world):
    out = {}
    for opt in ("sgd", "adamw"):
        out[f"untied {opt}"] = lambda r, w, opt=opt: _train(r, w, _llama(), opt)
    if world != 2:
        return out  # (the parity rows at 3 ranks; the rest needs no uneven shards)
    out["untied checkpointed"] = lambda r, w: _train(r, w, _llama(), activation_checkpointing=True)
    out["lora"] = lambda r, w: _train(r, w, _lora(), units="auto")
    out["lora, input embeddings require grad"] = lambda r, w: _train(r, w, _lora_inputs_require_grad(), units="auto")
    out["lora, transformers' reentrant checkpointing"] = (
        lambda r, w: _train(r, w, _lora_inputs_require_grad(hf_checkpointing=True), units="auto"))
    out["fused head, auto"] = lambda r, w: _train(r, w, _llama(), units="auto", fused=True)
    out["fused head, auto+head"] = _fused_head_unit_refused
    out["tied"] = lambda r, w: _train(r, w, _llama(tie=True))
    for saved, loaded in (("blocks", "auto+head"), ("auto+head", "blocks")):
        out[f"checkpoint {saved} to {loaded}"] = (
            lambda r, w, saved=saved, loaded=loaded: _checkpoint_across_units(r, w, root, saved, loaded))
    return out


def _worker(rank, world, root):
    return run_scenarios(_scenarios(root, world), rank, world)


@spawn_once
def _report(world: int, root: str) -> list:
    return run_distributed(_worker, world, root)


@pytest.fixture(scope="module")
def roots(tmp_path_factory):
    return {world: str(tmp_path_factory.mktemp(f"edge{world}")) for world in (2, 3)}


@pytest.fixture(scope="module", params=[2, 3])
def reports(request, roots):
    """Every rank's report at 2 and at 3 ranks (the parity rows)."""
    return _report(request.param, roots[request.param])


@pytest.fixture(scope="module")
def reports_at_2(roots):
    return _report(2, roots[2])


LAYER_UNITS = [(f"model.layers.{i}", None) for i in range(LAYERS)]
EDGES = [("model.embed_tokens", "embedding"), *LAYER_UNITS, ("lm_head", "head"), ("<root>", None)]


def test_untied_embedding_and_head_are_units_of_their_own():
    """The plan alone (no processes): "auto+head" puts the embedding first, the head after the layers and the
    final norm in the root; only the layers are checkpointed, only the head and the root kept gathered after
    their forward. "auto" leaves the head in the root."""
    from shardwise.engine.base.plan import build_plan

    plan = build_plan(_llama(), "auto+head", 2)
    assert [(u.label, u.edge) for u in plan.units] == EDGES
    assert [u.label for u in plan.units if u.checkpointed] == [label for label, _ in LAYER_UNITS]
    assert [u.label for u in plan.units if u.kept_after_forward] == ["lm_head", "<root>"]
    assert [p.fqn for p in plan.root.params()] == ["model.norm.weight"]
    auto = build_plan(_llama(), "auto", 2)
    assert [(u.label, u.edge) for u in auto.units] == EDGES[:-2] + [("<root>", None)]
    assert [p.fqn for p in auto.root.params()] == ["model.norm.weight", "lm_head.weight"]


@pytest.mark.parametrize("units", ["auto", "auto+head"])
def test_tied_embedding_and_head_stay_in_the_root(units):
    from shardwise.engine.base.plan import build_plan

    plan = build_plan(_llama(tie=True), units, 2)
    assert [(u.label, u.edge) for u in plan.units] == LAYER_UNITS + [("<root>", None)]
    assert plan.root.groups[0].params[0].refs[0].fqn == "model.embed_tokens.weight"


def test_explicit_units_get_no_edge_units():
    """units given as classes are taken as given: the embedding and head stay in the root."""
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    from shardwise.engine.base.plan import build_plan

    plan = build_plan(_llama(), {LlamaDecoderLayer}, 2)
    assert all(u.edge is None for u in plan.units) and len(plan.units) == LAYERS + 1


@pytest.mark.parametrize("opt", ["sgd", "adamw"])
def test_untied_llama_trains_in_parity_with_the_embedding_resharded_after_its_lookup(reports, opt):
    for rank_report in reports:
        r = scenario(rank_report, f"untied {opt}")
        assert r["units"] == EDGES
        assert r["said"] == f"{LAYERS} LlamaDecoderLayer + the embedding + the head + the root"  # (HF Trainer's line)
        # AdamW's first step moves an element whose gradient is rounding noise by a full lr: the last down_proj
        # ends 4e-5 off, with the units of before and with units=None alike (measured); the loss is immune
        assert_parity(r["metrics"], label=f"untied {opt}", param_rtol=1e-4 if opt == "adamw" else None)
        forward, backward = r["seen"]["forward"], r["seen"]["backward"]
        assert len(forward) == len(backward) == STEPS * LAYERS, r["seen"]
        # forward: never the embedding during a layer; the head only once the last layer prefetches it (from
        # the second step on: prefetch follows the order the last forward recorded)
        assert [e for e, _ in forward] == [0] * len(forward), forward
        assert [h > 0 for _, h in forward] == [False] * LAYERS + ([False] * (LAYERS - 1) + [True]) * (STEPS - 1), \
            forward
        # between forward and backward: the head kept gathered for its backward, which comes first
        assert [(e, h > 0) for e, h in r["seen"]["between"]] == [(0, True)] * STEPS, r["seen"]["between"]
        # backward: the head released after its own backward; the embedding (trainable) prefetched by the
        # first layer's backward, the last in backward order
        assert [h for _, h in backward] == [0] * len(backward), backward
        assert [e > 0 for e, _ in backward] == ([False] * (LAYERS - 1) + [True]) * STEPS, backward


def test_activation_checkpointing_recomputes_the_layers_not_the_embedding_or_head(reports_at_2):
    for rank_report in reports_at_2:
        r = scenario(rank_report, "untied checkpointed")
        assert r["recomputed"] == [label for label, _ in LAYER_UNITS]
        assert_parity(r["metrics"], label="checkpointed")


def test_lora_frozen_embedding_is_never_gathered_in_backward(reports_at_2):
    """Its output needs no gradient: its backward never comes, so the first layer's backward does not
    prefetch it (it would stay gathered, for nothing, to the end of backward)."""
    for rank_report in reports_at_2:
        r = scenario(rank_report, "lora")
        assert [label for label, edge in r["units"] if edge] == ["base_model.model.model.embed_tokens"]
        assert_parity(r["metrics"], label="lora")
        assert [e for e, _ in r["seen"]["forward"] + r["seen"]["backward"]] == [0] * (2 * STEPS * LAYERS), r["seen"]


def test_an_embedding_output_made_a_leaf_that_requires_grad_is_not_gathered_in_backward(reports_at_2):
    """peft's ``enable_input_require_grads`` hook (registered before ``shard()``, so it runs before the unit's
    exit) makes the frozen embedding's output a graph leaf that requires grad: the gradient stops there,
    nothing in backward reads the embedding, so backward neither prefetches nor gathers it."""
    for rank_report in reports_at_2:
        for row in ("lora, input embeddings require grad", "lora, transformers' reentrant checkpointing"):
            r = scenario(rank_report, row)
            assert_parity(r["metrics"], label=row)
            assert [e for e, _ in r["seen"]["forward"] + r["seen"]["backward"]] == [0] * (2 * STEPS * LAYERS), \
                (row, r["seen"])


def test_a_fused_loss_reading_the_heads_weight_trains_under_auto_and_is_refused_under_auto_plus_head(reports_at_2):
    for rank_report in reports_at_2:
        r = scenario(rank_report, "fused head, auto")
        assert r["said"] == f"{LAYERS} LlamaDecoderLayer + the embedding + the root"
        assert_parity(r["metrics"], label="fused head")
        refused = scenario(rank_report, "fused head, auto+head")
        assert refused.startswith("torch.Tensor.t (aten.t.default) on sharded parameter 'lm_head.weight'"), refused


def test_tied_llama_trains_in_parity_with_one_root(reports_at_2):
    for rank_report in reports_at_2:
        r = scenario(rank_report, "tied")
        assert r["units"] == LAYER_UNITS + [("<root>", None)]
        assert r["said"] == f"{LAYERS} LlamaDecoderLayer + the root"
        assert_parity(r["metrics"], label="tied")


@pytest.mark.parametrize("saved,loaded", [("blocks", "auto+head"), ("auto+head", "blocks")])
def test_checkpoints_load_across_the_old_and_new_units(reports_at_2, saved, loaded):
    for rank_report in reports_at_2:
        r = scenario(rank_report, f"checkpoint {saved} to {loaded}")
        assert r["units"] == ([LAYERS + 1, LAYERS + 3] if saved == "blocks" else [LAYERS + 3, LAYERS + 1])
        assert r["equal"] == r["keys"]
        # the same parameters and AdamW state: the next step's loss is the same (bitwise, summed alike)
        assert r["losses"][0] == r["losses"][1], r["losses"]
