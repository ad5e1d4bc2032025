"""Hugging Face models built on the meta device, initialised the way ``from_config`` would have.

[Note: HF init on meta] ``shard`` calls ``param_init_fn(module)`` for every module that owns parameters
(or meta buffers), with that module's parameters swapped for fresh full tensors. HF initialises from the
*model*: ``model._init_weights(m)`` for every module, children before parents, and a parent may re-init a
child's weight (GPT-2 scales ``c_proj`` from ``GPT2Attention``). So for a module we call ``_init_weights``
on it and on each of its ancestors, in that order: the module's own tensors see the same sequence of
writes as in HF's own pass. Writes to other modules' parameters land on meta tensors and cost nothing.
Buffers such as rotary ``inv_freq`` are recomputed by ``_init_weights`` too; plain tensor attributes still
on meta (``original_inv_freq``) are allocated first.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.nn as nn


def is_hf_model(model: nn.Module) -> bool:
    return callable(getattr(model, "_init_weights", None)) and hasattr(model, "config")


def hf_param_init_fn(model: nn.Module, device: torch.device) -> Callable[[nn.Module], None]:
    """``param_init_fn`` for ``shardwise.shard`` on a meta-built HF model; see the Note at the top."""
    parents: dict[int, Optional[nn.Module]] = {id(model): None}
    for m in model.modules():
        for child in m.children():
            parents.setdefault(id(child), m)
    init_weights = getattr(model, "_init_weights")

    @torch.no_grad()
    def init(module: nn.Module) -> None:
        for name, value in list(vars(module).items()):
            if isinstance(value, torch.Tensor) and value.is_meta and not isinstance(value, nn.Parameter):
                setattr(module, name, torch.empty_like(value, device=device))
        chain = [module]
        while parents.get(id(chain[-1])) is not None:
            chain.append(parents[id(chain[-1])])
        for m in chain:
            init_weights(m)

    return init
