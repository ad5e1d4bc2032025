"""Modules and methods that rewrite parameters behind the engine's back are refused by name, on every rank
(engine/rewrite_refusal.py): ``nn.Embedding(max_norm=...)`` at ``shard()``, ``resize_token_embeddings`` after
it; and a module with parameters no flat group holds attached after it (engine/registration_guard.py: a new
head, peft's ``get_peft_model`` on a sharded model), while re-attaching or wrapping the model's own modules
passes. One spawn at world size 2."""

from __future__ import annotations

import torch.nn as nn

import shardwise
from harness import error_of, run_distributed
from parity_utils import run_scenarios, scenario, spawn_once


class RenormedEmbedding(nn.Module):
    def __init__(self, bag: bool = False):
        super().__init__()
        self.tokens = (nn.EmbeddingBag if bag else nn.Embedding)(13, 5, max_norm=1.0)
        self.head = nn.Linear(5, 13)


class Resizable(nn.Module):
    """Duck-typed like a Hugging Face model: it has resize_token_embeddings (which would build a new embedding
    from the old weight)."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(13, 5)

    def resize_token_embeddings(self, n: int):
        old = self.embed
        rows, dim = old.weight.size()
        self.embed = nn.Embedding(n, dim)
        self.embed.weight.data[:rows] = old.weight.data
        return self.embed


def _refusals(rank, ws):
    model = Resizable()
    shardwise.shard(model, units=None)
    return dict(embedding=error_of(lambda: shardwise.shard(RenormedEmbedding())),
                bag=error_of(lambda: shardwise.shard(RenormedEmbedding(bag=True))),
                resize=error_of(lambda: model.resize_token_embeddings(20)),
                untouched=isinstance(model.embed, nn.Embedding) and model.embed.num_embeddings == 13)


def _attached(rank, ws):
    model = Resizable()
    model.head = nn.Linear(5, 13)
    shardwise.shard(model, units=None)

    def rewrap():
        model.head = model.head
        model.head = nn.Sequential(model.head)  # a wrapper of the module it replaces (a checkpoint wrapper)
        model.act = nn.GELU()  # no parameters

    return dict(new_head=error_of(lambda: setattr(model, "head", nn.Linear(5, 13))), rewrap=error_of(rewrap))


def _worker(rank, ws):
    return run_scenarios({"refusals": _refusals, "attached": _attached}, rank, ws)


@spawn_once
def report() -> list:
    return run_distributed(_worker, 2)


def test_embedding_with_max_norm_is_refused_at_shard_by_name():
    for res in report():
        r = scenario(res, "refusals")
        assert r["embedding"].startswith("ShardwiseError: module 'tokens' is Embedding(max_norm=1.0)"), r["embedding"]
        assert r["bag"].startswith("ShardwiseError: module 'tokens' is EmbeddingBag(max_norm=1.0)"), r["bag"]


def test_resize_token_embeddings_after_shard_is_refused_by_name():
    for res in report():
        r = scenario(res, "refusals")
        assert r["resize"].startswith("ShardwiseError: Resizable.resize_token_embeddings() after shardwise.shard()")
        assert "before shard()" in r["resize"] and r["untouched"]


def test_a_module_with_new_parameters_attached_after_shard_is_refused_by_name():
    for res in report():
        r = scenario(res, "attached")
        assert r["new_head"].startswith("ShardwiseError: module Linear attached as 'head' to Resizable after "
                                        "shardwise.shard() holds parameters no flat group holds (weight, bias)"), r
        assert r["rewrap"] == "no error", r
