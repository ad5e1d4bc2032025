"""What this thread's autograd engine is doing, for the layers that must tell a forward inside a backward
(a recompute: activation checkpointing of any kind) from an ordinary one: the engine (through
``engine/base/torch_internals.py``) and ``quant/``. A leaf: imports only torch."""

from __future__ import annotations

import torch


def autograd_engine_running() -> bool:
    """Whether this thread is executing a backward pass (a forward now is a recompute).

    Private API, isolated here: ``torch._C._current_graph_task_id()`` is -1 outside the autograd engine
    (checked on torch 2.11 and 2.13)."""
    return torch._C._current_graph_task_id() != -1
