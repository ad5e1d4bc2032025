"""Tiny Hugging Face model directories the tests build themselves: nothing is downloaded, ever.

``make_tokenizer(dir)`` trains a byte-level BPE tokenizer on a few lines of text with the ``tokenizers``
library and saves it (with a chat template) the way a Hub model directory holds it.
``make_model_dir(dir, family)`` saves a randomly initialised tiny causal LM of that family next to it, as
one ``model.safetensors`` or, with ``shards=True``, as ``model-0000k-of-0000n.safetensors`` plus
``model.safetensors.index.json``: the two layouts ``from_pretrained`` reads.
"""

from __future__ import annotations

import os

import torch

FAMILIES = ("llama", "qwen2", "gpt2", "qwen3_moe")

# Enough text for a few hundred merges; the SFT tests render chats and prompts in these words.
CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Sharded data parallel training keeps one shard of every parameter on each rank.",
    "def add(a, b):\n    return a + b\n",
    "Question: what is two plus two? Answer: four.",
    "The user asks a question and the assistant answers it politely.",
    "Gradients are reduce-scattered and parameters are all-gathered before each block runs.",
] * 8

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}<|end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|pad|>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]


def make_tokenizer(directory: str, vocab_size: int = 320):
    """Train a byte-level BPE tokenizer locally, save it into ``directory`` and return it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(CORPUS, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|endoftext|>", eos_token="<|endoftext|>",
                                   pad_token="<|pad|>")
    fast.chat_template = CHAT_TEMPLATE
    os.makedirs(directory, exist_ok=True)
    fast.save_pretrained(directory)
    return fast


def tiny_config(family: str, vocab_size: int, **overrides):
    """A config of ``family`` small enough for a 2-core test, with uneven sizes so shards split mid-tensor."""
    from transformers import GPT2Config, LlamaConfig, Qwen2Config

    if family == "llama":
        kw = {"vocab_size": vocab_size, "hidden_size": 48, "intermediate_size": 88, "num_hidden_layers": 2,
                  "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64,
                  "tie_word_embeddings": False}
        cls = LlamaConfig
    elif family == "qwen2":
        kw = {"vocab_size": vocab_size, "hidden_size": 48, "intermediate_size": 88, "num_hidden_layers": 2,
                  "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64,
                  "tie_word_embeddings": True}
        cls = Qwen2Config
    elif family == "qwen3_moe":  # 2 layers, 4 experts (top 2), every layer sparse
        from transformers import Qwen3MoeConfig

        kw = {"vocab_size": vocab_size, "hidden_size": 48, "intermediate_size": 72, "moe_intermediate_size": 40,
              "num_experts": 4, "num_experts_per_tok": 2, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 2, "head_dim": 12, "max_position_embeddings": 64, "tie_word_embeddings": False}
        cls = Qwen3MoeConfig
    elif family == "gpt2":
        kw = {"vocab_size": vocab_size, "n_embd": 48, "n_layer": 2, "n_head": 4, "n_positions": 64}
        cls = GPT2Config
    else:
        raise ValueError(f"family={family!r}; one of {FAMILIES}")
    kw.update(overrides)
    return cls(**kw)


def make_model_dir(directory: str, family: str = "llama", *, shards: bool = False, seed: int = 0,
                   dtype: torch.dtype | None = None, tokenizer: bool = True, **overrides) -> str:
    """Save a random tiny ``family`` causal LM (and, by default, a tokenizer) into ``directory``.

    ``shards=True`` splits the weights over several safetensors files with an index; ``dtype`` is the dtype
    the weights are stored in (default fp32)."""
    from transformers import AutoModelForCausalLM

    ids: dict = {"bos_token_id": 0, "eos_token_id": 0, "pad_token_id": 1}  # SPECIAL_TOKENS' order
    vocab = 320
    if tokenizer:
        tok = make_tokenizer(directory)
        vocab = len(tok)
        ids = {"bos_token_id": tok.bos_token_id, "eos_token_id": tok.eos_token_id, "pad_token_id": tok.pad_token_id}
    config = tiny_config(family, vocab, **{**ids, **overrides})
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    if dtype is not None:
        model = model.to(dtype)
    model.save_pretrained(directory, max_shard_size="40KB" if shards else "10GB")
    return directory


def make_base_and_other(root) -> tuple[str, str]:
    """What the LoRA resume tests train over: ``root/llama`` (bf16, seed 0), ``root/llama-other`` (another
    base, seed 1) and ``root/text.txt`` (the corpus). Returns the two model directories."""
    model_dir = make_model_dir(str(root / "llama"), "llama", dtype=torch.bfloat16)
    other_dir = make_model_dir(str(root / "llama-other"), "llama", seed=1, dtype=torch.bfloat16)
    (root / "text.txt").write_text(" ".join(CORPUS) * 4)
    return model_dir, other_dir
