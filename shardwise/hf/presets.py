"""Offline shape presets of well-known Hugging Face architectures, for ``estimate-memory --model llama-2-70b``.

Each entry is the part of the model's public ``config.json`` that decides its shapes (hidden size, MLP
width, layers, attention heads, key/value heads, vocabulary, tied embeddings), copied from the model
cards' configs; nothing is downloaded. Rotary scaling (Llama-3.1's ``rope_scaling``) and sliding windows
change no tensor shape and are left out. The presets are built exactly like a user's config.json: on the
meta device through ``AutoConfig.for_model``, so parameter counts come from the real modules (Llama-2-7B:
6,738,415,616 parameters).
"""

from __future__ import annotations


def _llama(hidden, inter, layers, heads, kv, vocab, max_pos, tied=False, eps=1e-5):
    return dict(model_type="llama", hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                num_attention_heads=heads, num_key_value_heads=kv, vocab_size=vocab,
                max_position_embeddings=max_pos, tie_word_embeddings=tied, rms_norm_eps=eps)


def _qwen2(hidden, inter, layers, heads, kv, vocab, tied):
    return dict(model_type="qwen2", hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                num_attention_heads=heads, num_key_value_heads=kv, vocab_size=vocab,
                max_position_embeddings=32768, tie_word_embeddings=tied, rms_norm_eps=1e-6)


ARCH_PRESETS: dict[str, dict] = {
    "llama-2-7b": _llama(4096, 11008, 32, 32, 32, 32000, 4096),
    "llama-2-13b": _llama(5120, 13824, 40, 40, 40, 32000, 4096),
    "llama-2-70b": _llama(8192, 28672, 80, 64, 8, 32000, 4096),
    "llama-3-8b": _llama(4096, 14336, 32, 32, 8, 128256, 8192),
    "llama-3-70b": _llama(8192, 28672, 80, 64, 8, 128256, 8192),
    "llama-3.1-8b": _llama(4096, 14336, 32, 32, 8, 128256, 131072),
    "llama-3.1-70b": _llama(8192, 28672, 80, 64, 8, 128256, 131072),
    "llama-3.2-1b": _llama(2048, 8192, 16, 32, 8, 128256, 131072, tied=True),
    "llama-3.2-3b": _llama(3072, 8192, 28, 24, 8, 128256, 131072, tied=True),
    "mistral-7b": dict(_llama(4096, 14336, 32, 32, 8, 32000, 32768), model_type="mistral"),
    "qwen2.5-0.5b": _qwen2(896, 4864, 24, 14, 2, 151936, tied=True),
    "qwen2.5-1.5b": _qwen2(1536, 8960, 28, 12, 2, 151936, tied=True),
    "qwen2.5-7b": _qwen2(3584, 18944, 28, 28, 4, 152064, tied=False),
    "qwen2.5-14b": _qwen2(5120, 13824, 48, 40, 8, 152064, tied=False),
    "qwen2.5-72b": _qwen2(8192, 29568, 80, 64, 8, 152064, tied=False),
}
