"""``shardwise export`` of a LoRA run (a checkpoint whose model description holds a ``peft_config``).

Two outputs, both loadable without shardwise:

* the adapter directory (default): ``adapter_config.json`` + ``adapter_model.safetensors`` under the names
  peft saves, which ``PeftModel.from_pretrained(base, OUT)`` loads onto the base;
* with ``--merge``, the full model with every adapter merged in, ``W + scaling * B @ A`` (fp32), which
  ``AutoModelForCausalLM.from_pretrained(OUT)`` loads.

The base of a merge is the one the adapters trained over: the checkpoint's own frozen parameters when it
stores them (a run over a random base), else the weights of the directory its ``frozen_base`` record names
(or ``--base DIR``), checked against the recorded identity and cast to the dtype the run held them in
(``--lora-base-dtype bf16``: the bf16-rounded base), so the merged model is the trained one. Tensors are
produced one at a time, as the writer asks for them: memory holds one base tensor and its adapter pair.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from torch import nn

from shardwise.checkpoint.format import dtype_from_name
from shardwise.checkpoint.match import alias_map
from shardwise.hf.quantization import QuantSettings
from shardwise.hf.rebuild import rebuild_on_meta
from shardwise.checkpoint.safetensors_file import SafetensorsFile
from shardwise.errors import ShardwiseError

Layout = list[tuple[str, torch.dtype, tuple[int, ...]]]


def is_lora(manifest: dict) -> bool:
    return "peft_config" in manifest["model"]


def _peft_on_meta(manifest: dict) -> nn.Module:
    model = rebuild_on_meta(manifest)
    if model is None:
        raise ShardwiseError("exporting a LoRA run needs transformers and peft to rebuild its model; install them")
    return model


def _read_param(manifest: dict, files: dict[str, SafetensorsFile], names: list[str]) -> torch.Tensor | None:
    """A parameter (any of its tied ``names``) assembled from the checkpoint's verified pieces; None if the
    checkpoint does not store it."""
    from shardwise.checkpoint.export import assemble

    alias_of = alias_map(manifest)
    for name in names:
        saved = name if name in manifest["params"] else alias_of.get(name)
        if saved is not None:
            return assemble(manifest, files, saved)
    return None


def write_adapter(manifest: dict, files: dict[str, SafetensorsFile], tmp: Path) -> list[str]:
    """The peft adapter directory into ``tmp``: what ``save_pretrained`` of the trained peft model writes."""
    from peft import get_peft_model_state_dict

    from shardwise.hf.lora import ADAPTER_NAME, ADAPTER_WEIGHTS, write_adapter_files

    model = _peft_on_meta(manifest)
    trainable = {name: _read_param(manifest, files, [name]) for name, p in model.named_parameters() if p.requires_grad}
    missing = [n for n, t in trainable.items() if t is None]
    if missing:  # description_problem compared the names already: only a hand-made manifest gets here
        raise ShardwiseError(f"the checkpoint holds no {missing[0]}, an adapter of its LoRA model")
    tensors = {k: v.contiguous() for k, v in get_peft_model_state_dict(model, state_dict=trainable).items()}
    # a run over a random base (config.json only) has no base directory: its base is in the checkpoint
    write_adapter_files(tmp, tensors, model.peft_config[ADAPTER_NAME], manifest.get("frozen_base", {}).get("source"))
    return [ADAPTER_WEIGHTS]


@contextlib.contextmanager
def merged_source(ckpt: Path, manifest: dict, files: dict[str, SafetensorsFile], base: os.PathLike | None,
                  dtype: torch.dtype | None) -> Iterator[tuple[Layout, Callable[[str], torch.Tensor]]]:
    """(layout, produce) of the merged model under the base model's own names, in fp32 unless ``dtype``
    says otherwise. Keeps the base directory open while the caller writes."""
    from shardwise.hf.lora import ADAPTER_NAME, lora_layers, merge_delta, pretrained_name
    from shardwise.hf.pretrained import match, unsharded_targets
    from shardwise.hf.weight_files import PretrainedWeights

    model = _peft_on_meta(manifest)
    config = model.peft_config[ADAPTER_NAME]
    if getattr(config, "use_dora", False) or getattr(config, "lora_bias", False):
        raise ShardwiseError(f"--merge: {ckpt} trained DoRA or LoRA biases; export merges plain LoRA only")
    out_dtype = dtype or torch.float32
    targets = [t for t in unsharded_targets(model) if pretrained_name(t.names[0]) is not None]
    adapters = {f"{name}.base_layer.weight": (layer, f"{name}.lora_A.{ADAPTER_NAME}.weight",
                                               f"{name}.lora_B.{ADAPTER_NAME}.weight")
                for name, layer in lora_layers(model).items()}
    record = manifest.get("frozen_base")
    with contextlib.ExitStack() as stack:
        if record is None:  # the checkpoint stores its base
            base_dtype = None

            def read_base(t) -> torch.Tensor | None:
                if t.is_buffer:
                    entry = manifest["buffers"].get(t.names[0])
                    return None if entry is None else files[entry["file"]].read(entry["key"])
                return _read_param(manifest, files, t.names)
        else:
            weights = stack.enter_context(PretrainedWeights(_checked_base_dir(ckpt, record, base)))
            match(model, targets, weights, pretrained_name)
            base_dtype = dtype_from_name(record["dtype"], "frozen_base.dtype") if record["dtype"] else None

            def read_base(t) -> torch.Tensor | None:
                return None if t.key is None else weights.read(t.key).reshape(t.shape)

        by_name: dict[str, object] = {}
        layout: Layout = []
        for t in targets:
            if t.is_buffer and record is not None and t.key is None:
                continue  # a buffer the directory does not hold: from_pretrained computes it
            if t.is_buffer and record is None and t.names[0] not in manifest["buffers"]:
                continue
            name = pretrained_name(t.names[0])
            by_name[name] = t
            layout.append((name, out_dtype if t.dtype.is_floating_point else t.dtype, t.shape))

        def produce(name: str) -> torch.Tensor:
            t = by_name[name]
            w = read_base(t)
            if w is None:
                raise ShardwiseError(f"--merge: no weights for {name} in {ckpt}")
            if base_dtype is not None and w.is_floating_point() and not t.is_buffer:
                w = w.to(base_dtype)  # the base as the run held it
            pair = next((adapters[n] for n in t.names if n in adapters), None)
            if pair is not None:
                layer, a_name, b_name = pair
                a, b = (_read_param(manifest, files, [n]) for n in (a_name, b_name))
                w = merge_delta(w, a, b, layer, ADAPTER_NAME)
            return w.to(out_dtype) if w.is_floating_point() else w

        yield layout, produce


def _base_dir(record: dict, base: os.PathLike | None) -> Path:
    """The base directory --merge reads: ``--base`` if given, else the one the run recorded."""
    return Path(base) if base is not None else Path(record["source"])


def merge_base_description(ckpt: Path, manifest: dict, base: os.PathLike | None) -> str:
    """Which weights ``--merge`` adds the adapters to, for the command's output: the base the checkpoint
    stores, or the high-precision weights of the base directory (a 4-bit run's base included: its
    quantised copy is never what is merged)."""
    record = manifest.get("frozen_base")
    if record is None:
        return f"the base weights stored in {ckpt}"
    directory = _base_dir(record, base)
    held = f", in {record['dtype']} as the run held them" if record.get("dtype") else ""
    quantised = " (the run trained over their 4-bit quantisation)" if record.get("quantization") else ""
    return f"the high-precision weights of {directory}{held}{quantised}"


def _checked_base_dir(ckpt: Path, record: dict, base: os.PathLike | None) -> Path:
    """The base directory of an adapter-only checkpoint, its weights' identity checked against the record."""
    from shardwise.hf.weight_files import identity_for

    directory = _base_dir(record, base)
    option = "--base" if base is not None else f"{ckpt}'s base (pass --base DIR if it moved)"
    if not directory.is_dir():
        raise ShardwiseError(f"{option}: {directory} is not a directory; --merge of an adapter-only checkpoint reads "
                             f"the base weights from it")
    if (directory / "config.json").is_file() and QuantSettings.from_pretrained(directory) is not None:
        raise ShardwiseError(f"{option}: {directory} holds only 4-bit (bitsandbytes) weights; --merge adds the "
                             f"adapters to the high-precision weights: pass --base DIR with the bf16/fp32 original, "
                             f"or export the adapter alone")
    identity = identity_for(directory, record["weights_sha256"])
    if identity != record["weights_sha256"]:
        raise ShardwiseError(f"{option}: the weights in {directory} (identity {identity[:12]}...) are not the base "
                             f"{ckpt} was trained over ({record['source']}, identity "
                             f"{record['weights_sha256'][:12]}...)")
    return directory
