""".jsonl data: each record kind becomes the tokenizer's ids with the loss mask on exactly the completion /
assistant tokens; the token cache is built once, reused, rebuilt when its inputs change, and written whole;
packed batches are a pure function of (seed, step, micro-batch, rank); malformed input names file and line."""

import json
import os
import re
import shutil

import numpy as np
import pytest
import torch
from hf_dirs import make_tokenizer

from shardwise.trainer import jsonl_data, token_cache
from shardwise.trainer.data import (
    IGNORE_INDEX,
    DataError,
    PackedSampler,
    Piece,
    TokenStream,
)

CHAT = [{"role": "system", "content": "Be polite."}, {"role": "user", "content": "what is two plus two?"},
        {"role": "assistant", "content": "four."}, {"role": "user", "content": "and the fox?"},
        {"role": "assistant", "content": "The quick brown fox jumps."}]


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tok")
    make_tokenizer(str(d))
    return str(d)


@pytest.fixture(scope="module")
def tok(tok_dir):
    return jsonl_data.load_tokenizer(tok_dir, "x.jsonl")


def _ids(tok, text):
    return tok(text, add_special_tokens=False)["input_ids"]


def test_text_record_is_all_in_the_loss(tok):
    text = "The quick brown fox jumps over the lazy dog."
    ids, mask = jsonl_data.encode_record(tok, {"text": text}, "x:1")
    assert ids == _ids(tok, text) + [tok.eos_token_id]
    assert mask == [1] * len(ids)


def test_prompt_completion_masks_the_prompt(tok):
    prompt, completion = "Question: what is two plus two?", " Answer: four."
    ids, mask = jsonl_data.encode_record(tok, {"prompt": prompt, "completion": completion}, "x:1")
    n = len(_ids(tok, prompt))
    assert ids == _ids(tok, prompt) + _ids(tok, completion) + [tok.eos_token_id]
    assert mask == [0] * n + [1] * (len(ids) - n)  # the completion and the EOS that ends it


def test_messages_mask_only_assistant_turns(tok):
    ids, mask = jsonl_data.encode_record(tok, {"messages": CHAT}, "x:1")
    full = tok.apply_chat_template(CHAT, tokenize=False)
    # The same ids the whole rendered chat tokenises to (segments split at special tokens) ...
    assert ids == _ids(tok, full) + [tok.eos_token_id]
    # ... and the loss covers exactly each assistant turn's content and its end marker, not its header.
    runs, current = [], []
    for i, m in zip(ids, mask):
        if m:
            current.append(i)
        elif current:
            runs.append(current)
            current = []
    runs.append(current)
    assert [tok.decode(r) for r in runs] == ["four.<|end|>\n", "The quick brown fox jumps.<|end|>\n<|endoftext|>"]
    assert tok.decode([i for i, m in zip(ids, mask) if not m]).endswith("<|assistant|>\n")
    # A chat ending in a user turn trains on its assistant turn only, not the EOS after the user.
    ids, mask = jsonl_data.encode_record(tok, {"messages": CHAT[:4]}, "x:1")
    assert mask[-1] == 0 and sum(mask) == len(_ids(tok, "four.<|end|>\n"))


@pytest.mark.parametrize("line, message", [
    ('{"text": "ok"', "not a JSON object"),
    ('[1, 2]', "expected a JSON object, found list"),
    ('{"txt": "a"}', "a record needs 'text', 'prompt' and 'completion', or 'messages'; found keys txt"),
    ('{"prompt": "a"}', "a record with 'prompt' or 'completion' needs both"),
    ('{"text": 3}', "'text' must be a string, found int"),
    ('{"messages": [{"role": "user", "content": "hi"}]}', "'messages' has no assistant turn"),
    ('{"messages": [{"role": "user"}]}', "messages[0] must be an object with string 'role' and 'content'"),
])
def test_malformed_lines_name_file_and_line(tmp_path, tok_dir, line, message):
    path = tmp_path / "x.jsonl"
    path.write_text('{"text": "fine"}\n\n' + line + "\n")  # line 3: blank lines count
    with pytest.raises(DataError, match=re.escape(f"{path}:3: {message}")):
        token_cache.ensure_cache(str(path), tok_dir, 0.5, str(tmp_path / "run"), progress=False)
    assert os.listdir(tmp_path / "run" / token_cache.CACHE_DIR) == []  # no cache, no temporary left


def test_model_without_tokenizer_is_refused(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(DataError, match="tokenised with the model's tokenizer, and --model .* holds none"):
        jsonl_data.load_tokenizer(str(tmp_path), "x.jsonl")
    with pytest.raises(DataError, match="--model gpt-tiny holds none"):
        jsonl_data.load_tokenizer("gpt-tiny", "x.jsonl")


def _write(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


def test_cache_is_reused_and_rebuilt_when_inputs_change(tmp_path, tok_dir, tok):
    data = tmp_path / "d.jsonl"
    records = [{"text": f"The fox {i}."} if i % 2 else {"prompt": "Question:", "completion": f" {i}"}
               for i in range(9)]
    _write(data, records)
    run = str(tmp_path / "run")
    first = token_cache.ensure_cache(str(data), tok_dir, 0.25, run, progress=False)
    stamp = os.stat(first / "train.tokens").st_mtime_ns
    assert token_cache.ensure_cache(str(data), tok_dir, 0.25, run, progress=False) == first
    assert os.stat(first / "train.tokens").st_mtime_ns == stamp  # reused, not rewritten
    # Contents: records 3 and 7 (every 4th) are validation; each split is its records' ids joined.
    encoded = [jsonl_data.encode_record(tok, r, "") for r in records]
    splits = token_cache.open_cache(first)
    for name, picked in (("train", [0, 1, 2, 4, 5, 6, 8]), ("val", [3, 7])):
        tokens, mask = splits[name]
        assert tokens.read(0, len(tokens)).tolist() == [t for i in picked for t in encoded[i][0]]
        assert mask.read(0, len(mask)).tolist() == [m for i in picked for m in encoded[i][1]]
    # Another split, other data, another tokenizer: another cache directory; nothing half-written left.
    other_split = token_cache.ensure_cache(str(data), tok_dir, 0.5, run, progress=False)
    _write(data, records[:-1])
    other_data = token_cache.ensure_cache(str(data), tok_dir, 0.25, run, progress=False)
    tok2 = tmp_path / "tok2"  # the same tokenizer with another chat template
    shutil.copytree(tok_dir, tok2)
    (tok2 / "chat_template.jinja").write_text((tok2 / "chat_template.jinja").read_text().replace("\n", "\n\n"))
    other_tok = token_cache.ensure_cache(str(data), str(tok2), 0.25, run, progress=False)
    assert len({first, other_split, other_data, other_tok}) == 4
    assert sorted(os.listdir(first.parent)) == sorted(p.name for p in (first, other_split, other_data, other_tok))


def _packed(tmp_path, n=103, seq_len=8, **kw):
    tokens = np.arange(n, dtype=np.uint16)
    mask = (np.arange(n) % 3 != 0).astype(np.uint8)  # every 3rd token outside the loss
    tokens.tofile(tmp_path / "t.tokens")
    mask.tofile(tmp_path / "t.mask")
    streams = (TokenStream([Piece(str(tmp_path / "t.tokens"), 0, n)], np.uint16),
               TokenStream([Piece(str(tmp_path / "t.mask"), 0, n)], np.uint8))
    return lambda rank, world, **more: PackedSampler(*streams, seq_len, kw.get("batch_size", 3), rank, world,
                                                     seed=kw.get("seed", 5), micro_batches=2, **more)


def test_packing_masks_targets_and_covers_each_chunk_once_per_epoch(tmp_path):
    make = _packed(tmp_path)  # 103 tokens: 12 chunks of 8 (+1 target), 6 per rank at world size 2
    seen = []
    for rank in range(2):
        s = make(rank, 2)
        assert s.num_chunks == 6
        starts = []
        for step in (1, 2, 3):  # 3 steps x 2 micro-batches x 3 sequences = 3 epochs of 6 chunks
            for micro in (0, 1):
                x, y = s.batch(step, micro)
                assert x.shape == y.shape == (3, 8)
                for row_x, row_y in zip(x.tolist(), y.tolist()):
                    assert row_x == list(range(row_x[0], row_x[0] + 8)) and row_x[0] % 8 == 0
                    want = [t + 1 if (t + 1) % 3 else IGNORE_INDEX for t in row_x]
                    assert row_y == want
                    starts.append(row_x[0] // 8)
        for epoch in range(3):
            assert sorted(starts[6 * epoch: 6 * epoch + 6]) == list(range(rank * 6, rank * 6 + 6))
        assert starts[:6] != starts[6:12]  # a new order each epoch
        seen += starts[:6]
    assert sorted(seen) == list(range(12))


def test_packed_batches_are_a_pure_function_of_seed_step_micro_rank(tmp_path):
    make = _packed(tmp_path)
    a, b = make(1, 2), make(1, 2)
    for step, micro in [(3, 1), (1, 0), (3, 1), (2, 1)]:  # any order, a fresh sampler: the same batch
        assert all(torch.equal(u, v) for u, v in zip(a.batch(step, micro), b.batch(step, micro)))
    assert not torch.equal(make(0, 2).batch(1, 0)[0], a.batch(1, 0)[0])
    c = _packed(tmp_path, seed=6)(1, 2)
    assert not all(torch.equal(c.batch(s, 0)[0], a.batch(s, 0)[0]) for s in (1, 2, 3))
    fixed = [x for x, _ in a.fixed_batches(2)]
    assert all(torch.equal(u, v) for u, v in zip(fixed, [x for x, _ in a.fixed_batches(2)]))


def test_too_little_data_for_the_ranks_is_named(tmp_path):
    make = _packed(tmp_path, n=20)  # 2 chunks of 8: rank 0 of 3 gets none
    assert make(2, 3).num_chunks == 1
    with pytest.raises(DataError, match="has 20 tokens in all, less than one sequence of --seq-len \\+ 1 = 9 per rank"):
        make(0, 3)
