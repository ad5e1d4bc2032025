"""shardwise.hf.quantization around the 4-bit base: what a QLoRA user sees first and how the model is counted.

- ``num_weights`` counts a 4-bit model's weights as its unquantised self has them (the run banner's
  parameter count), not its packed bytes and scales.
- bitsandbytes' "Failed to load CPU gemm_4bit_forward ... pip install kernels" line, which transformers and
  peft make it print on import, is not printed once shardwise is imported (shardwise never runs its kernels).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("transformers")

from hf_dirs import tiny_config

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.parametrize("family", ["llama", "qwen3_moe"])
def test_num_weights_counts_a_4bit_base_as_the_weights_it_encodes(family):
    from transformers import AutoModelForCausalLM

    import shardwise
    from shardwise.hf.quantization import num_weights

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(tiny_config(family, 64))
    unquantised = sum(p.numel() for p in model.parameters())
    packed_before = num_weights(model)
    shardwise.quantize_model(model, shardwise.QuantSettings("nf4", double_quant=True))
    assert packed_before == unquantised
    assert num_weights(model) == unquantised
    assert sum(p.numel() for p in model.parameters()) < 0.7 * unquantised  # what the banner used to count


def test_bitsandbytes_kernel_hint_is_dropped_and_nothing_else():
    """The filter drops that one message from that logger; the message and logger are still bitsandbytes'
    (its source is read, not imported: a change there fails here)."""
    import importlib.util
    import logging

    import shardwise  # noqa: F401 - installs the filter
    from shardwise.hf.quantization import KERNEL_HINT_LOGGER

    seen = []
    handler = logging.Handler()
    handler.emit = seen.append
    logger = logging.getLogger(KERNEL_HINT_LOGGER)
    logger.addHandler(handler)
    try:
        logger.warning("Failed to load CPU gemm_4bit_forward from kernels-community: %s. Please make sure ...", "x")
        logger.warning("something else")
    finally:
        logger.removeHandler(handler)
    assert [r.getMessage() for r in seen] == ["something else"]
    spec = importlib.util.find_spec("bitsandbytes")
    if spec is None:
        pytest.skip("bitsandbytes is not installed")
    source = open(os.path.join(os.path.dirname(spec.origin), "backends", "cpu", "ops.py")).read()
    assert '"Failed to load CPU gemm_4bit_forward' in source and "logging.getLogger(__name__)" in source


def _stderr_of(code: str) -> str:
    env = {**os.environ, "PYTHONPATH": REPO}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300).stderr


@pytest.mark.slow  # two fresh interpreters importing transformers
def test_bitsandbytes_kernel_hint_is_not_the_first_line_a_qlora_user_sees():
    pytest.importorskip("bitsandbytes")
    imports = "from transformers import Trainer; import peft"
    if "gemm_4bit_forward" not in _stderr_of(imports):
        pytest.skip("bitsandbytes prints no kernel hint on this machine (no AVX512-BF16, or kernels installed)")
    assert "gemm_4bit_forward" not in _stderr_of("import shardwise; " + imports)
