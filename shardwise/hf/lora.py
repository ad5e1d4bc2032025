"""LoRA through ``peft``: wrap a Hugging Face model before ``shardwise.shard``, train only the adapters, and
write them out as peft writes them (or merged into the base).

Why it works with no special case in the engine: ``peft.get_peft_model`` freezes the base and adds small
``lora_A`` / ``lora_B`` linears next to each target module. The sharding plan makes one flat group per
unit x dtype x requires_grad (plan.py), so inside every transformer block the frozen base (possibly kept
in bf16) and the fp32 adapters are separate groups of the same unit: gathered together, but only the
adapters' group gets gradients, reduce-scatters and optimizer state.

A meta-built model (big models, or a base streamed from safetensors afterwards) is initialised inside
``shard`` per module; ``lora_param_init_fn`` adds peft's own adapter init (A: Kaiming-uniform, B: zeros, so
the wrapped model starts out equal to its base) on top of the model's init.
"""

from __future__ import annotations

import contextlib
import os
import warnings
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Union

import torch
import torch.distributed as dist
from torch import nn

from shardwise.errors import ShardwiseError
from shardwise.hf.quantization import has_quantised, register_with_peft
from shardwise.quant.linear import QuantLinear

ADAPTER_NAME = "default"  # peft's name for the one adapter get_peft_model adds
ADAPTER_WEIGHTS = "adapter_model.safetensors"  # the file names PeftModel.from_pretrained looks for
ADAPTER_CONFIG = "adapter_config.json"


@dataclass(frozen=True)
class LoraSettings:
    r: int
    alpha: float = 16.0
    dropout: float = 0.0
    target_modules: tuple[str, ...] = ()  # () -> peft's default for the architecture (Llama: q_proj, v_proj)
    base_dtype: torch.dtype | None = None  # the frozen base's dtype (None: leave it as built)

    def peft_config(self):
        try:
            from peft import LoraConfig
        except ImportError as e:  # pragma: no cover - depends on the environment
            raise ShardwiseError("LoRA needs the peft package: pip install peft") from e
        if self.r < 1:
            raise ShardwiseError(f"lora r={self.r}: the adapter rank must be >= 1")
        if not 0.0 <= self.dropout < 1.0:
            raise ShardwiseError(f"lora dropout={self.dropout}: must be in [0, 1)")
        return LoraConfig(r=self.r, lora_alpha=self.alpha, lora_dropout=self.dropout,
                          target_modules=list(self.target_modules) or None, task_type="CAUSAL_LM")


@contextlib.contextmanager
def quiet_peft() -> Iterator[None]:
    """peft (0.21) reads ``model.is_gradient_checkpointing``, which transformers 5 deprecated with a
    FutureWarning: printed by every LoRA run, about nothing the user did or can change."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
        yield


def apply_lora(model: nn.Module, settings: LoraSettings) -> nn.Module:
    """``peft.get_peft_model(model, ...)`` with the frozen base cast to ``settings.base_dtype``; works on a
    meta model too. Call it before ``shardwise.shard`` (freezing after shard() costs traffic, see README)."""
    peft_model = apply_peft_config(model, settings.peft_config(),
                                   f"lora target_modules {','.join(settings.target_modules) or '(peft default)'}")
    if settings.base_dtype is not None:
        with torch.no_grad():
            for p in peft_model.parameters():
                if not p.requires_grad and p.is_floating_point():
                    p.data = p.data.to(settings.base_dtype)
    return peft_model


def apply_peft_config(model: nn.Module, config, what: str = "peft_config target_modules") -> nn.Module:
    """``peft.get_peft_model(model, config)`` for a peft ``LoraConfig`` (a 4-bit base's ``QuantLinear``
    included), on a meta model too; a target module that is not in the model is a ShardwiseError naming
    ``what`` and listing the module names LoRA can target."""
    from peft import get_peft_model

    quantised = has_quantised(model)
    if quantised:  # a 4-bit base: peft wraps QuantLinear through its custom-module hook
        register_with_peft(config)
    on_meta = any(p.is_meta for p in model.parameters())
    if on_meta:
        _refuse_base_dependent_init(config)
    real_before = {id(p) for p in model.parameters() if not p.is_meta}
    try:
        with quiet_peft(), warnings.catch_warnings(), _cpu_stand_ins(model) if on_meta else contextlib.nullcontext():
            if quantised:  # peft: "Unsupported layer type ... proceed at your own risk", once per QuantLinear
                warnings.filterwarnings("ignore", message="Unsupported layer type")
            peft_model = get_peft_model(model, config)
    except ValueError as e:  # peft's "Target modules {...} not found in the base model"
        raise ShardwiseError(f"{what}: {str(e).splitlines()[0]}; {_module_names_hint(model)}") from None
    if on_meta:
        _keep_drawn_adapters(peft_model, real_before)
    return peft_model


# Adapter module -> its parameters as peft drew them beside a meta base ({name: CPU tensor}), until
# lora_param_init_fn puts them into the shards; the module itself goes to meta with the rest of the model.
_DRAWN: "weakref.WeakKeyDictionary[nn.Module, dict[str, torch.Tensor]]" = weakref.WeakKeyDictionary()


def _keep_drawn_adapters(model: nn.Module, real_before: set[int]) -> None:
    """Keep the values of the parameters peft created for real (beside the stand-ins) and put their modules
    on meta with the rest of the model; parameters that were real before stay as they are."""
    for module in model.modules():
        drawn = {n: p.detach() for n, p in module._parameters.items()
                 if p is not None and not p.is_meta and id(p) not in real_before}
        if drawn:
            _DRAWN[module] = drawn
            for n in drawn:
                module._parameters[n] = nn.Parameter(module._parameters[n].to("meta"),
                                                     requires_grad=module._parameters[n].requires_grad)


@contextlib.contextmanager
def _cpu_stand_ins(model: nn.Module) -> Iterator[None]:
    """While peft wraps a meta-built model: its meta parameters replaced by CPU stand-ins of the same shape
    and dtype that hold one element (expanded), then put back. peft creates each adapter on the CPU,
    initialises it (drawing from the random generator: the adapter Linears' own init, then its LoRA init)
    and moves it to its base layer's device and dtype, read from the base's ``weight``: onto meta the values
    would be lost. Beside CPU stand-ins the adapters keep them, drawn in the order ``get_peft_model`` draws
    on a real model, and ``lora_param_init_fn`` puts exactly those values into the shards. What peft sets on
    a base parameter (``requires_grad=False``) is carried over to it."""
    stand_ins: dict[int, tuple[nn.Parameter, nn.Parameter]] = {}
    owners = []
    for module in model.modules():
        for name, p in module._parameters.items():
            if p is not None and p.is_meta:
                if id(p) not in stand_ins:
                    stand_in = nn.Parameter(torch.zeros((), dtype=p.dtype).expand(p.shape), requires_grad=p.requires_grad)
                    stand_ins[id(p)] = (p, stand_in)
                module._parameters[name] = stand_ins[id(p)][1]
                owners.append((module, name, id(p)))
    try:
        yield
    finally:
        for module, name, key in owners:
            original, stand_in = stand_ins[key]
            if module._parameters.get(name) is stand_in:
                original.requires_grad_(stand_in.requires_grad)
                module._parameters[name] = original


def _refuse_base_dependent_init(config) -> None:
    """LoRA inits that read the base weights (DoRA, PiSSA, OLoRA, CorDA, LoftQ, EVA, ...) cannot run on a
    meta-built model, whose weights are read only after ``shard()``."""
    init = getattr(config, "init_lora_weights", True)
    if getattr(config, "use_dora", False) or (isinstance(init, str) and init not in ("gaussian", "orthogonal")):
        what = "use_dora=True" if getattr(config, "use_dora", False) else f"init_lora_weights={init!r}"
        raise ShardwiseError(f"peft_config {what}: this initialisation reads the base weights, which a model loaded "
                             f"by shardwise (built on the meta device, each rank reading its own pieces) does not "
                             f"hold whole; use init_lora_weights=True or 'gaussian'")


def _module_names_hint(model: nn.Module) -> str:
    """The names LoRA can target in ``model``: the last name part of every linear-like leaf module, a 4-bit
    base's ``QuantLinear`` included."""
    targetable = (nn.Linear, nn.Embedding, nn.Conv1d, QuantLinear)
    names = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules()
                    if n and not list(m.children())
                    and (isinstance(m, targetable) or type(m).__name__ == "Conv1D")})
    return f"module names in {type(model).__name__}: {', '.join(names)}" if names else "the model has no linear modules"


def is_peft_model(model: nn.Module) -> bool:
    return hasattr(model, "peft_config") and hasattr(model, "get_base_model")


def _adapter_owners(model: nn.Module) -> dict[int, tuple[nn.Module, str, object]]:
    """id(adapter linear) -> (its peft LoRA layer, adapter name, that adapter's init setting)."""
    from peft.tuners.lora import LoraLayer

    init = {name: cfg.init_lora_weights for name, cfg in model.peft_config.items()}
    owners = {}
    for layer in model.modules():
        if isinstance(layer, LoraLayer):
            for table in (layer.lora_A, layer.lora_B):
                for name, linear in table.items():
                    owners[id(linear)] = (layer, name, init.get(name, True))
    return owners


def lora_param_init_fn(model: nn.Module, base_init: Callable[[nn.Module], None] | None
                       ) -> Callable[[nn.Module], None]:
    """``param_init_fn`` for ``shard`` on a meta-built peft model: ``base_init`` (the model's own, e.g.
    ``shardwise.engine.hf_init``), then the adapters: the values peft drew for them when ``apply_peft_config``
    wrapped the meta model, else peft's init (``reset_lora_parameters`` writes A and B of the adapter;
    whichever of them is still on meta costs nothing)."""
    owners = _adapter_owners(model)
    # Adapters peft initialised for real beside the meta base (apply_peft_config): their values, as drawn.
    drawn = {id(m): _DRAWN.pop(m) for m in list(model.modules()) if m in _DRAWN}

    @torch.no_grad()
    def init(module: nn.Module) -> None:
        if base_init is not None:
            base_init(module)
        elif callable(getattr(module, "reset_parameters", None)):
            module.reset_parameters()
        owner = owners.get(id(module))
        if id(module) in drawn:
            for n, value in drawn[id(module)].items():
                module._parameters[n].copy_(value)
        elif owner is not None:
            layer, name, how = owner
            layer.reset_lora_parameters(name, how)

    # The base's init may leave the base unwritten on purpose (skip_weight_init: load_pretrained follows);
    # shard() must know, or its meta init refuses those parameters as never initialised.
    init.leaves_parameters_unwritten = getattr(base_init, "leaves_parameters_unwritten", False)
    return init


# ---- writing adapters out ------------------------------------------------------------------------------


def adapter_state_dict(model: nn.Module, adapter_name: str = ADAPTER_NAME,
                       save_embedding_layers: Union[bool, str] = "auto") -> dict[str, torch.Tensor]:
    """Rank 0: what ``PeftModel.save_pretrained`` writes for ``adapter_name`` (``get_peft_model_state_dict``'s
    names and values: the adapter's weights under peft's saved names, its ``modules_to_save`` and trainable
    tokens, the embeddings peft chooses to save, a prompt-learning adapter's prompt), whole; ``{}`` elsewhere.
    peft chooses the tensors by name, so every rank runs it over a skeleton of the state dict (empty tensors
    under the model's names; a prompt-learning adapter runs its prompt encoder, as a forward every rank
    makes), and only the flat groups holding the chosen names are gathered. Collective."""
    from peft import get_peft_model_state_dict

    from shardwise.engine.core.runtime import runtime_of
    from shardwise.engine.state_dict import full_state_dict

    _check_peft(model)
    if adapter_name not in model.peft_config:
        raise ShardwiseError(f"adapter {adapter_name!r}: the peft model has adapters {sorted(model.peft_config)}")
    skeleton = {k: torch.empty(0) for k in runtime_of(model).state_dict_keys}
    name_of = {id(v): k for k, v in skeleton.items()}
    chosen = get_peft_model_state_dict(model, state_dict=skeleton, adapter_name=adapter_name,
                                       save_embedding_layers=save_embedding_layers)
    source = {k: name_of[id(v)] for k, v in chosen.items() if id(v) in name_of}
    whole = full_state_dict(model, keys=set(source.values()))
    if dist.get_rank() != 0:
        return {}
    return {k: (whole[source[k]] if k in source else v.detach().cpu()).contiguous() for k, v in chosen.items()}


def save_adapter(model: nn.Module, out: str | os.PathLike, base: str | None = None) -> Path | None:
    """Write ``out/adapter_config.json`` + ``out/adapter_model.safetensors`` (what ``PeftModel.from_pretrained
    (base, out)`` loads) from a sharded peft model. ``base``: the base model directory, recorded as the
    config's ``base_model_name_or_path``. Collective; rank 0 writes and returns ``out``."""
    sd = adapter_state_dict(model)
    if dist.get_rank() != 0:
        return None
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    write_adapter_files(out, sd, model.peft_config[ADAPTER_NAME], base)
    return out


def write_adapter_files(out: Path, tensors: dict[str, torch.Tensor], config, base: str | None) -> None:
    """The two files of a peft adapter directory, as ``save_pretrained`` of the peft model writes them, with
    the base's directory as ``base_model_name_or_path`` (where ``PeftModel.from_pretrained`` users and
    ``shardwise generate`` look for it)."""
    import copy

    from safetensors.torch import save_file

    path = out / ADAPTER_WEIGHTS
    save_file(tensors, str(path), metadata={"format": "pt"})
    mask = os.umask(0)
    os.umask(mask)
    os.chmod(path, 0o666 & ~mask)  # safetensors writes 0600; the directory's other files are the umask's
    config = copy.copy(config)
    config.base_model_name_or_path = base
    config.inference_mode = True  # as peft's save_pretrained writes it
    config.save_pretrained(str(out))


def merged_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """Rank 0: the base model's state dict (its own key names, as ``save_pretrained`` of the unwrapped model
    writes them) with every adapter merged in: ``W + scaling * B @ A``, computed in fp32 and stored in
    W's dtype, as peft's ``merge_and_unload`` does. Gathers the whole model on rank 0. Collective."""
    from peft.tuners.lora import LoraLayer

    from shardwise.engine.state_dict import full_state_dict

    _check_peft(model)
    full = full_state_dict(model)
    if not full:
        return {}
    names = {id(m): n for n, m in model.named_modules()}
    for layer in model.modules():
        if not isinstance(layer, LoraLayer):
            continue
        prefix = names[id(layer)]
        weight_key = f"{prefix}.base_layer.weight"
        for name in layer.lora_A:
            a = full.pop(f"{prefix}.lora_A.{name}.weight")
            b = full.pop(f"{prefix}.lora_B.{name}.weight")
            w = full[weight_key]
            full[weight_key] = merge_delta(w, a, b, layer, name).to(w.dtype)
    base_prefix = "base_model.model."
    out = {}
    for k, v in full.items():
        out[k.removeprefix(base_prefix).replace(".base_layer.", ".")] = v
    return out


def save_merged(model: nn.Module, out: str | os.PathLike, dtype: torch.dtype | None = None) -> Path | None:
    """A full Hugging Face model directory (config.json + safetensors) with the adapters merged, loadable by
    ``AutoModelForCausalLM.from_pretrained(out)``. Collective; rank 0 writes. Memory: the whole model on
    rank 0's CPU, once."""
    from transformers import AutoModelForCausalLM

    sd = merged_state_dict(model)
    if dist.get_rank() != 0:
        return None
    config = model.get_base_model().config
    with torch.device("meta"):
        base = AutoModelForCausalLM.from_config(config)
    if dtype is not None:
        sd = {k: v.to(dtype) if v.is_floating_point() else v for k, v in sd.items()}
    base.load_state_dict(sd, strict=False, assign=True)
    # what save_pretrained writes must all be there (non-persistent buffers such as rotary tables are not
    # written: from_pretrained recomputes them)
    missing = [n for n, t in base.state_dict().items() if t.is_meta]
    if missing:
        raise ShardwiseError(f"merged LoRA export to {out}: no weights for {', '.join(missing[:5])}")
    base.save_pretrained(str(out))
    return Path(out)


def _check_peft(model: nn.Module) -> None:
    if not is_peft_model(model):
        raise ShardwiseError(f"{type(model).__name__} is not a peft model: wrap it with shardwise.hf.lora.apply_lora "
                             f"(or peft.get_peft_model) before shardwise.shard")


def peft_model_from_dict(model: nn.Module, config: dict) -> nn.Module:
    """``get_peft_model(model, LoraConfig(**config))`` for a manifest's ``peft_config`` (checkpoint/model_description.py; keys this peft does not know
    are dropped: a config written by another peft version). Works on a meta model."""
    import dataclasses

    from peft import LoraConfig, get_peft_model

    known = {f.name for f in dataclasses.fields(LoraConfig)}
    try:
        lora_config = LoraConfig(**{k: v for k, v in config.items() if k in known})
        with quiet_peft():
            return get_peft_model(model, lora_config)
    except (TypeError, ValueError) as e:
        raise ShardwiseError(f"peft_config: not a LoRA config this peft accepts: {str(e).splitlines()[0][:200]}") from None


def lora_layers(model: nn.Module) -> dict[str, nn.Module]:
    """name -> peft LoRA layer (the wrapped module: its ``base_layer``, ``lora_A``/``lora_B`` and ``scaling``)."""
    from peft.tuners.lora import LoraLayer

    return {name: m for name, m in model.named_modules() if isinstance(m, LoraLayer)}


def merge_delta(weight: torch.Tensor, a: torch.Tensor, b: torch.Tensor, layer: nn.Module, adapter: str) -> torch.Tensor:
    """``W + scaling * B @ A`` in fp32, as peft's ``merge_and_unload`` computes it (transposed for
    ``fan_in_fan_out`` layers); the caller chooses the dtype to store it in."""
    delta = (b.float() @ a.float()) * layer.scaling[adapter]
    return weight.float() + (delta.T if getattr(layer, "fan_in_fan_out", False) else delta)


def pretrained_name(name: str) -> "str | None":
    """The name a peft-wrapped model's parameter has in the base model's checkpoint, for
    ``shardwise.load_pretrained(..., rename=pretrained_name)``: peft's ``base_model.model.`` prefix and
    ``.base_layer`` dropped; None for the adapters, which the checkpoint does not hold (they keep their init)."""
    if ".lora_" in name or name.startswith("lora_"):
        return None
    if name.startswith("base_model.model."):
        name = name[len("base_model.model."):]
    return name.replace(".base_layer.", ".")
