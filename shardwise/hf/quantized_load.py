"""Loading a 4-bit base (``QuantLinear`` modules) from a Hugging Face directory, each rank touching only the
bytes it owns. Two kinds of file tensor feed a QuantLinear at prefix ``P``:

* **Pre-quantised** (transformers + bitsandbytes ``save_pretrained``): ``P.weight`` (packed, any storage
  dtype, read as bytes), ``P.weight.absmax``, ``P.weight.quant_map``, with double quantisation
  ``P.weight.nested_absmax``, ``P.weight.nested_quant_map``, and ``P.weight.quant_state.bitsandbytes__nf4``
  (or ``__fp4``: a JSON blob). Checked against the module's layout (quant type, block size, shape, double
  quantisation, every tensor's length and the code tables) before any data is read; then each rank copies
  its byte range of each stored tensor. The offset comes from the JSON's ``nested_offset``.
* **High precision** (``P.weight`` floating point, ``[out, in]``): quantised on load with
  ``shardwise.quant.format``. Double quantisation's offset is the mean of the *whole* tensor's absmax, so
  each rank first computes the absmax of 1/N of the blocks from its rows of the file, the vectors are
  all-gathered (1/64 of the weight's element count, fp32), and then every rank quantises just the blocks
  behind its own byte ranges. The values quantised are the file's, as stored (no cast first).

The quantised bytes equal what bitsandbytes 0.50.2 on CPU makes of the same values, so both paths give the
same bytes (tests/hf/test_quantized_load.py).

A ``QuantExperts`` module (4-bit MoE experts) is one target per expert and projection, named as the files
name it (``P.{e}.gate_proj``; see quant/experts.py): its stored tensors are ``[experts, bytes]``, so expert
``e``'s bytes are row ``e`` and a rank's byte range is split at the row boundaries.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import torch
from shardwise.engine.checks import agree
from shardwise.errors import ShardwiseError
from shardwise.hf.weight_files import PretrainedWeights
from shardwise.quant.codebooks import code_table, dynamic_map
from shardwise.quant.format import (BLOCKSIZE, NESTED_BLOCKSIZE, Layout4bit, absmax_offset, block_absmax,
                                    num_blocks, pack_nibbles, quantize_absmax, quantize_blocks)
from shardwise.quant.experts import QUANT_MODULE_TYPES, QuantExpertMatrices
from shardwise.quant.linear import QuantLinear

STATE_KEY = ".quant_state.bitsandbytes__"
COMPANIONS = (".absmax", ".quant_map", ".nested_absmax", ".nested_quant_map", STATE_KEY + "nf4", STATE_KEY + "fp4")


@dataclass
class QuantTarget:
    """One 4-bit weight to fill: its HF name (``...q_proj``), file key, and this rank's byte ranges (of the
    module's stored tensors, or of row ``expert`` of them)."""

    module: QuantLinear | QuantExpertMatrices
    name: str
    pieces: list = field(default_factory=list)  # (stored tensor name, lo, hi, destination bytes)
    key: str | None = None
    prequantised: bool = False
    offset: torch.Tensor | None = None  # pre-quantised: fp32 from the JSON
    absmax: torch.Tensor | None = None  # quantise-on-load: this rank's part, then the whole vector


def quant_targets(runtime, prefix: str, rename) -> tuple[list[QuantTarget], set[int]]:
    """The 4-bit weights of a sharded model with this rank's byte ranges of their stored tensors, and the ids
    of the plan's ParamSpecs they cover (which the plain loader skips). Every rank lists every weight, in the
    same order, whether it owns bytes of it or not (quantising on load gathers per weight)."""
    by_weight: dict[tuple[int, int], QuantTarget] = {}
    covered: set[int] = set()
    for unit in runtime.units:
        for group in unit.flat_groups:
            for spec, (lo, hi, at) in zip(group.plan.params, group.local_slices):
                ref = spec.refs[0]
                if not isinstance(ref.module, QUANT_MODULE_TYPES) or ref.name == "bias":
                    continue
                covered.add(id(spec))
                module_name = ref.fqn[: -len(ref.name) - 1]
                module_name = module_name[len(prefix):] if module_name.startswith(prefix) else module_name
                per = ref.module.layout.nbytes()[ref.name]  # bytes of one weight's tensor (one expert's row)
                for e in range(getattr(ref.module, "num_experts", 1)):
                    t = by_weight.get((id(ref.module), e))
                    if t is None:
                        t = by_weight[id(ref.module), e] = QuantTarget(
                            ref.module, _file_name(module_name, ref.module, e, rename))
                    a, b = max(lo, e * per), min(hi, (e + 1) * per)
                    if b > a:
                        t.pieces.append((ref.name, a - e * per, b - e * per, group.shard.narrow(0, at + a - lo, b - a)))
    return sorted(by_weight.values(), key=lambda t: t.name), covered


def _file_name(module_name: str, module, expert: int, rename=None) -> str:
    """The HF name of a 4-bit weight's module: a QuantLinear's own (``...q_proj``, after ``rename``), or
    expert ``expert``'s matrix of a QuantExpertMatrices (``...mlp.experts.3.gate_proj``)."""
    if isinstance(module, QuantExpertMatrices):
        module_name = f"{module_name.rsplit('.', 1)[0]}.{expert}.{module.file_name}"
    if rename is not None:
        renamed = rename(module_name + ".weight")
        module_name = renamed[: -len(".weight")] if renamed else module_name
    return module_name


def unsharded_quant_targets(model, prefix: str) -> list[QuantTarget]:
    """The 4-bit weights of a model that is not sharded (the trainer's preflight check on a meta model),
    named as in the checkpoint: ``prefix`` and peft's ``.base_layer`` dropped."""
    out = []
    for name, m in model.named_modules():
        if isinstance(m, QUANT_MODULE_TYPES):
            name = name[len(prefix):] if name.startswith(prefix) else name
            name = name.replace(".base_layer", "")
            out += [QuantTarget(m, _file_name(name, m, e)) for e in range(getattr(m, "num_experts", 1))]
    return sorted(out, key=lambda t: t.name)


def match_quantised(targets: list[QuantTarget], weights: PretrainedWeights, to_model) -> set[str]:
    """Set each target's file key and kind, checking what the file declares; returns the file keys used."""
    _check_config(weights, targets)
    by_name = {t.name + ".weight": t for t in targets}
    used: set[str] = set()
    for key in weights.where:
        if key.endswith(COMPANIONS) or STATE_KEY in key:
            continue
        t = by_name.get(to_model(key))
        if t is not None:
            t.key = key
    for t in targets:
        if t.key is None:
            raise ShardwiseError(f"{weights.directory}: no tensor for the 4-bit weight {t.name}.weight")
        used.add(t.key)
        used.update(k for k in (t.key + c for c in COMPANIONS) if k in weights.where)
        t.prequantised = not weights.info(t.key).dtype.is_floating_point or (t.key + ".absmax") in weights.where
        if t.prequantised:
            t.offset = _check_prequantised(weights, t.key, t.module.layout)
        else:
            _check_high_precision(weights, t.key, t.module.layout)
    return used


def _check_config(weights: PretrainedWeights, targets: list[QuantTarget]) -> None:
    """A directory whose config.json declares a ``quantization_config`` must declare the model's 4-bit settings:
    its tensors are checked against the model next, so a config that disagrees with them is refused either way,
    and here by the file that says it."""
    from shardwise.hf.quantization import QuantSettings

    path = weights.directory / "config.json"
    declared = QuantSettings.from_pretrained(weights.directory) if targets and path.is_file() else None
    if declared is None:
        return
    layout = targets[0].module.layout
    for option, says, built in (("bnb_4bit_quant_type", declared.quant_type, layout.quant_type),
                                ("bnb_4bit_use_double_quant", declared.double_quant, layout.double_quant)):
        if says != built:
            raise ShardwiseError(f"{path}: quantization_config {option}={says!r}, but the model's 4-bit modules are "
                                 f"{built!r}; the directory's tensors must be what its config says")


def _check_high_precision(weights: PretrainedWeights, key: str, layout: Layout4bit) -> None:
    info = weights.info(key)
    if tuple(info.shape) != layout.shape:
        raise ShardwiseError(f"{weights.directory}: tensor {key!r} has shape {list(info.shape)}, the 4-bit "
                             f"module expects {list(layout.shape)}; a checkpoint of another config?")


def _check_prequantised(weights: PretrainedWeights, key: str, layout: Layout4bit) -> torch.Tensor | None:
    """Everything a pre-quantised weight declares must agree with its tensors and with the module (quant
    type, block size, shape, double quantisation, lengths, code tables): one line naming file and tensor
    otherwise. Returns the fp32 offset (double quantisation) from the JSON."""
    where = f"{weights.where[key][0].path}: {key!r}"
    states = [k for k in (key + STATE_KEY + "nf4", key + STATE_KEY + "fp4") if k in weights.where]
    if len(states) != 1:
        raise ShardwiseError(f"{where}: a 4-bit weight needs exactly one quant_state.bitsandbytes__nf4/__fp4 "
                             f"tensor beside it, found {len(states)}")
    state = _read_state(weights, states[0])
    file_type = states[0].rsplit("__", 1)[1]
    expect = {"quant_type": layout.quant_type, "blocksize": layout.blocksize, "shape": list(layout.shape)}
    got = {"quant_type": state.get("quant_type"), "blocksize": state.get("blocksize"), "shape": state.get("shape")}
    if file_type != state.get("quant_type"):
        raise ShardwiseError(f"{where}: quant_state tensor says {file_type}, its JSON says {state.get('quant_type')!r}")
    if got != expect:
        bad = next(k for k in expect if got[k] != expect[k])
        raise ShardwiseError(f"{where}: quant_state {bad}={got[bad]!r}, the model's 4-bit module needs "
                             f"{expect[bad]!r} (nf4/fp4, block size and shape must match)")
    double = "nested_offset" in state
    if double != layout.double_quant:
        raise ShardwiseError(f"{where}: {'has' if double else 'has no'} double quantisation, the model was built "
                             f"{'with' if layout.double_quant else 'without'} it")
    sizes = {"": (-(-layout.numel // 2), None), ".absmax": (layout.blocks, torch.uint8 if double else torch.float32),
             ".quant_map": (16, torch.float32)}
    if double:
        sizes.update({".nested_absmax": (num_blocks(layout.blocks, NESTED_BLOCKSIZE), torch.float32),
                      ".nested_quant_map": (256, torch.float32)})
    for suffix, (nbytes_or_numel, dtype) in sizes.items():
        k = key + suffix
        if k not in weights.where:
            raise ShardwiseError(f"{where}: {k!r} is missing")
        info = weights.info(k)
        numel = int(torch.Size(info.shape).numel())
        size = numel * info.dtype.itemsize if dtype is None else numel
        if size != nbytes_or_numel or (dtype is not None and info.dtype != dtype):
            raise ShardwiseError(f"{where}: {k!r} is {info.dtype} {list(info.shape)}, but the quant_state's shape "
                                 f"{list(layout.shape)} needs {nbytes_or_numel} {'bytes' if dtype is None else dtype}")
    _check_table(weights, key + ".quant_map", code_table(layout.quant_type), where)
    if not double:
        return None
    _check_table(weights, key + ".nested_quant_map", dynamic_map(), where)
    if state.get("nested_blocksize") != NESTED_BLOCKSIZE or state.get("nested_dtype", "float32") != "float32":
        raise ShardwiseError(f"{where}: nested_blocksize {state.get('nested_blocksize')!r} / nested_dtype "
                             f"{state.get('nested_dtype')!r}: only 256 / float32 are bitsandbytes' layout")
    offset = state["nested_offset"]
    if not isinstance(offset, (int, float)):
        raise ShardwiseError(f"{where}: quant_state nested_offset is {offset!r}, not a number")
    return torch.tensor(float(offset), dtype=torch.float32)


def _read_state(weights: PretrainedWeights, key: str) -> dict:
    info = weights.info(key)
    if info.dtype != torch.uint8 or len(info.shape) != 1 or info.shape[0] > 1 << 16:
        raise ShardwiseError(f"{weights.directory}: {key!r} is {info.dtype} {list(info.shape)}, not a uint8 JSON blob")
    try:
        state = json.loads(bytes(weights.read(key).tolist()).decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise ShardwiseError(f"{weights.directory}: {key!r} is not valid JSON ({type(e).__name__})") from None
    if not isinstance(state, dict):
        raise ShardwiseError(f"{weights.directory}: {key!r} holds {type(state).__name__}, not a JSON object")
    return state


def _check_table(weights: PretrainedWeights, key: str, expected: torch.Tensor, where: str) -> None:
    if not torch.equal(weights.read(key).reshape(-1), expected):
        raise ShardwiseError(f"{where}: {key!r} is not bitsandbytes' table for this quant type; refusing to guess "
                             f"what its codes mean")


# ---- reading ----------------------------------------------------------------------------------------------------


def read_bytes(weights: PretrainedWeights, key: str, lo: int, hi: int) -> torch.Tensor:
    """Bytes ``[lo, hi)`` of tensor ``key``'s data, whatever its dtype (a packed weight saved with bf16
    storage is read as the bytes it holds, never as floats)."""
    info = weights.info(key)
    size = info.dtype.itemsize
    first, last = lo // size, -(-hi // size)
    tmp = torch.empty(last - first, dtype=info.dtype)
    weights.read_into(key, first, tmp)
    return tmp.view(torch.uint8)[lo - first * size: hi - first * size]


def load_prequantised(weights: PretrainedWeights, t: QuantTarget) -> None:
    sources = {"weight": t.key, "absmax": t.key + ".absmax", "nested_absmax": t.key + ".nested_absmax"}
    for name, lo, hi, dst in t.pieces:
        if name == "offset":
            dst.copy_(t.offset.reshape(1).view(torch.uint8)[lo:hi])
        else:
            dst.copy_(read_bytes(weights, sources[name], lo, hi))


def local_absmax(weights: PretrainedWeights, t: QuantTarget) -> None:
    """This rank's share of the first-level absmax (an even split of the blocks), from the file's rows."""
    layout = t.module.layout
    n, rank, world = layout.blocks, agree.rank(), agree.world_size()
    per = -(-n // world)
    lo, hi = min(rank * per, n), min((rank + 1) * per, n)
    t.absmax = torch.zeros(per, dtype=torch.float32)
    for start, stop, values in _chunks(weights, t.key, lo * BLOCKSIZE, min(hi * BLOCKSIZE, layout.numel)):
        t.absmax[(start - lo * BLOCKSIZE) // BLOCKSIZE:][: num_blocks(stop - start)] = block_absmax(values)


def gather_absmax(targets: list[QuantTarget]) -> None:
    """Every rank gets every quantise-on-load target's whole absmax vector (collective; same order everywhere)."""
    for t in targets:
        if agree.is_distributed():  # host values read from the files: control traffic (engine/base/device.py)
            whole = torch.empty(t.absmax.numel() * agree.world_size(), dtype=torch.float32)
            agree.all_gather_host(whole, t.absmax, what=f"gathering the absmax of {t.name} to quantise it on load")
            t.absmax = whole
        t.absmax = t.absmax[: t.module.layout.blocks]


def quantise_pieces(weights: PretrainedWeights, t: QuantTarget) -> None:
    """Fill this rank's byte ranges of a quantise-on-load target (its whole absmax already gathered)."""
    layout = t.module.layout
    offset = absmax_offset(t.absmax) if layout.double_quant else None
    for name, lo, hi, dst in t.pieces:
        if name == "weight":  # bytes [lo, hi) are elements [2lo, 2hi): quantise the blocks around them
            first = (2 * lo) // BLOCKSIZE * BLOCKSIZE
            last = min(-(-2 * hi // BLOCKSIZE) * BLOCKSIZE, layout.numel)
            for start, stop, values in _chunks(weights, t.key, first, last):
                absmax = t.absmax[start // BLOCKSIZE: num_blocks(stop)]  # known: no second abs-max pass
                packed = pack_nibbles(quantize_blocks(values, layout.quant_type, absmax=absmax)[0])
                a, b = max(lo, start // 2), min(hi, -(-stop // 2))
                dst[a - lo: b - lo].copy_(packed[a - start // 2: b - start // 2])
        elif name == "absmax" and not layout.double_quant:
            dst.copy_(t.absmax.view(torch.uint8)[lo:hi])
        elif name == "absmax":
            b0, b1 = lo // NESTED_BLOCKSIZE * NESTED_BLOCKSIZE, -(-hi // NESTED_BLOCKSIZE) * NESTED_BLOCKSIZE
            codes = quantize_absmax(t.absmax[b0:b1], offset)[0]
            dst.copy_(codes[lo - b0: hi - b0])
        elif name == "nested_absmax":
            dst.copy_(quantize_absmax(t.absmax, offset)[1].view(torch.uint8)[lo:hi])
        else:
            dst.copy_(offset.reshape(1).view(torch.uint8)[lo:hi])


def _chunks(weights: PretrainedWeights, key: str, lo: int, hi: int, chunk: int = 1 << 20):
    """(start, stop, values) over elements [lo, hi) of a file tensor in whole-block chunks (``lo`` on a block
    boundary), so quantising a rank's share of a 28,672 x 8,192 matrix keeps ~20 bytes per element of
    temporaries for one chunk only."""
    for start in range(lo, hi, chunk):
        stop = min(start + chunk, hi)
        yield start, stop, _read_elements(weights, key, start, stop)


def _read_elements(weights: PretrainedWeights, key: str, lo: int, hi: int) -> torch.Tensor:
    out = torch.empty(max(hi - lo, 0), dtype=weights.info(key).dtype)
    if hi > lo:
        weights.read_into(key, lo, out)
    return out

