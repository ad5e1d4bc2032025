"""``shardwise generate``'s sampler: the KV-cached path (one position per new token) samples exactly what the
uncached path (the whole context every token) samples, also once the context outgrows the model's positions
and the sampler falls back to a recomputed sliding window."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from hf_dirs import make_model_dir


@pytest.fixture(scope="module")
def export_dir(tmp_path_factory) -> Path:
    return Path(make_model_dir(str(tmp_path_factory.mktemp("gen") / "llama"), "llama", seed=3))


@pytest.mark.parametrize("temperature,max_positions", [(0.0, None), (0.9, None), (0.0, 12)],
                         ids=["greedy", "sampled", "window"])
def test_kv_cached_sampling_equals_recomputing_the_context(export_dir, temperature, max_positions):
    from shardwise.trainer.generate import from_export, sample

    gen = from_export(export_dir, "", chat=False)
    assert gen.cached is not None, "a Hugging Face model must sample with its KV cache"
    gen = dataclasses.replace(gen, eos_token_id=None,  # a random model may stop at once: keep sampling
                              max_positions=max_positions or gen.max_positions)
    prompt = gen.encode("The quick brown fox")
    assert len(prompt) + 20 > gen.max_positions > len(prompt) or max_positions is None  # window: both paths run
    cached = sample(gen, prompt, 20, temperature, 20, seed=7)
    uncached = sample(dataclasses.replace(gen, cached=None), prompt, 20, temperature, 20, seed=7)
    assert len(cached) == 20
    assert cached == uncached


def test_a_model_that_returns_no_cache_is_given_the_whole_context_each_time(export_dir):
    from shardwise.trainer.generate import from_export, sample

    gen = dataclasses.replace(from_export(export_dir, "", chat=False), eos_token_id=None)
    seen = []

    def forgetful(ids, cache):
        seen.append(ids.shape[1])
        return gen.cached(ids, None)[0], None

    prompt = gen.encode("The quick brown fox")
    got = sample(dataclasses.replace(gen, cached=forgetful), prompt, 5, 0.0, 0, seed=0)
    assert seen == [len(prompt) + i for i in range(5)]  # never only the newest token without its context
    assert got == sample(dataclasses.replace(gen, cached=None), prompt, 5, 0.0, 0, seed=0)
