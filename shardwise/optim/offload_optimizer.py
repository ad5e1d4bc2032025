"""``offload_optimizer``: the CPU optimizer of an offloaded model, stepped one flat group at a time as soon
as that group's gradients have landed on the host.

It is a ``torch.optim.Optimizer`` (param groups, ``state``, ``state_dict``, ``zero_grad``, LR schedulers and
shardwise checkpoints work as with any torch optimizer) that owns one ``optimizer_cls`` instance per flat
group of the model, over the host shards of that group's parameters. The per-group instances share this
optimizer's ``state`` dict and take their hyperparameters from its param groups before every step, so a
scheduler that sets ``lr`` here reaches them. torch's optimizers update each parameter tensor on its own
(single-tensor, foreach or fused CPU kernels alike), so stepping the groups separately gives the same bits
as one optimizer over all of them.

When each group steps (``offload_transfers.py`` delivers the landings):

* without ``max_grad_norm`` (and ``step_in_backward=True``): during backward, right after the group's
  last gradient of the backward is on the host, on the offload worker thread under CUDA. ``backward()``
  returns with every such step done; ``step()`` then steps the groups that received no gradient in the
  backward's own course (units backward never reached, ...) and copies the first shards of the next
  forward to the device.
* with ``max_grad_norm``: the global norm needs every group's gradient, so each group's part of it (its
  per-tensor norms) is computed as it lands, during backward; ``step()`` sums them in model order (the
  order ``shardwise.clip_grad_norm_`` sums in: the same bits), all-reduces once, then scales and steps the
  groups one by one, each group's copy to the device issued as soon as it is stepped, overlapping the
  steps of the rest.

Contract of stepping in backward: one synced backward per ``step()`` (accumulate with ``shardwise.no_sync``)
and no change to gradients between backward and ``step()`` other than ``max_grad_norm``. A gradient that
arrives for a group already stepped, and ``shardwise.clip_grad_norm_``, raise ``ShardwiseError``; pass
``step_in_backward=False`` to step everything in ``step()`` instead (still pipelined with the copies).
"""

from __future__ import annotations

from typing import Iterable, Optional

import torch
import torch.nn as nn

from shardwise.engine.surface import optimizer_guard
from shardwise.engine.grad_norm import clip_coefficient, global_grad_norm, grad_norm_terms, group_grads, scale_grads
from shardwise.engine.core.runtime import runtime_of
from shardwise.errors import ShardwiseError
from shardwise.engine.surface.param_hooks import post_accumulate_grad_hooks


def offload_optimizer(model: nn.Module, optimizer_cls: type, params: Optional[Iterable] = None, *,
                      max_grad_norm: Optional[float] = None, norm_type: float = 2.0,
                      step_in_backward: bool = True, **defaults) -> "OffloadOptimizer":
    """``optimizer_cls(params, **defaults)`` (default params: ``model.parameters()``) for a model sharded with
    ``offload=shardwise.CPUOffload()``, stepped per flat group as gradients land (see the module docstring).
    ``max_grad_norm`` clips by the global ``norm_type`` norm exactly as ``shardwise.clip_grad_norm_``."""
    return OffloadOptimizer(model, optimizer_cls, params, max_grad_norm=max_grad_norm, norm_type=norm_type,
                            step_in_backward=step_in_backward, **defaults)


class OffloadOptimizer(torch.optim.Optimizer):
    def __init__(self, model: nn.Module, optimizer_cls: type, params: Optional[Iterable] = None, *,
                 max_grad_norm: Optional[float] = None, norm_type: float = 2.0, step_in_backward: bool = True,
                 **defaults):
        rt = runtime_of(model)
        if rt.transfers is None:
            raise ShardwiseError("shardwise.offload_optimizer needs a model sharded with "
                                 "offload=shardwise.CPUOffload(); use a plain torch optimizer otherwise")
        if rt.transfers.consumer is not None:
            raise ShardwiseError("this model already has an offload_optimizer; build one per model")
        template = optimizer_cls(list(model.parameters()) if params is None else params, **defaults)
        super().__init__(template.param_groups, template.defaults)
        self.optimizer_cls = optimizer_cls
        self.max_grad_norm = max_grad_norm
        self.norm_type = float(norm_type)
        self.steps_in_backward = step_in_backward and max_grad_norm is None
        self.last_grad_norm: Optional[torch.Tensor] = None  # the global norm before clipping, at the last step
        self._runtime = rt
        self._transfers = rt.transfers
        self._model_groups = [g for g in rt.flat_groups()]  # model order: the norm's summation order
        owner = {id(p): g for g in self._model_groups for p in g.shard_params}
        members: dict = {}  # flat group -> [(index of our param group, its params in that group)]
        for j, pg in enumerate(self.param_groups):
            by_group: dict = {}
            for p in pg["params"]:
                g = owner.get(id(p))
                if g is None:
                    raise ShardwiseError(f"offload_optimizer: param_groups[{j}] holds a tensor of shape "
                                         f"{tuple(p.shape)} that is not a shard parameter of this model")
                if post_accumulate_grad_hooks(p):
                    raise ShardwiseError("offload_optimizer: a parameter has a post-accumulate-grad hook (an "
                                         "optimizer in backward); both would step it: use one of the two")
                by_group.setdefault(g, []).append(p)
            for g, ps in by_group.items():
                members.setdefault(g, []).append((j, ps))
        # One optimizer per flat group, in model order, built with the same keyword arguments as the template
        # (an optimizer that routes parameters by them, like Muon's use_muon, routes them alike);
        # ``_option_source[g][i]`` is the index of our param group whose hyperparameters its param group i
        # takes, found by the parameters it holds (an optimizer may split or reorder the groups it is given).
        self._inner: dict = {}
        self._option_source: dict = {}
        source = {id(p): j for j, pg in enumerate(self.param_groups) for p in pg["params"]}
        for g in self._model_groups:
            if g not in members:
                continue
            groups = [{**_options(self.param_groups[j]), "params": ps} for j, ps in members[g]]
            self._inner[g] = inner = optimizer_cls(groups, **defaults)
            self._option_source[g] = [source[id(ig["params"][0])] for ig in inner.param_groups]
            optimizer_guard.examine(inner)  # an optimizer class that is not elementwise: refused now
            inner.__dict__["_shardwise_inner"] = True  # its state is ours: checked by our step and load
        self._stepped: set = set()  # groups stepped since the last step() (during backward)
        self._norm_terms: dict = {}  # group -> its part of the global norm, from its last landing
        self._wire()
        rt.transfers.consumer = self

    def _wire(self) -> None:
        for inner in self._inner.values():
            inner.state = self.state  # one state dict: checkpoints and state_dict() see every group's state

    def load_state_dict(self, state_dict: dict) -> None:
        super().load_state_dict(state_dict)  # replaces self.state and the param group dicts
        self._wire()
        # Checked now, not at the first step: the inner optimizers may step during the next backward.
        optimizer_guard.verify_loaded(self)

    # ---- called by offload_transfers as each gradient shard lands (worker thread under CUDA) ----------
    def take_landing(self, landing) -> None:
        group = landing.group
        if group in self._stepped:
            raise ShardwiseError(
                f"a gradient of unit {group.plan.unit_fqn or '<root>'!r} arrived after offload_optimizer stepped it "
                f"during backward and before optimizer.step(): its parameters already moved. Accumulate "
                f"micro-batches under shardwise.no_sync (one synced backward per step) or build the optimizer "
                f"with step_in_backward=False")
        self._transfers.hand_out(landing)
        self._norm_terms.pop(group, None)  # the group's gradient changed: its part of the norm too
        if not landing.final:
            return
        if self.max_grad_norm is not None:
            self._norm_terms[group] = grad_norm_terms(group_grads(group), self.norm_type)
        elif self.steps_in_backward and group in self._inner:
            # Every collective that produced this gradient was agreed before it was issued (fingerprint.py):
            # the group may step now.
            self._step_group(group)
            self._stepped.add(group)

    def _step_group(self, group) -> None:
        inner = self._inner[group]
        for inner_group, j in zip(inner.param_groups, self._option_source[group]):
            inner_group.update(_options(self.param_groups[j]))  # lr set by a scheduler, loaded options
        inner.step()
        self._transfers.note("step", group)

    @torch.no_grad()
    def step(self, closure=None):
        """Step the groups not stepped during backward (all of them with ``max_grad_norm``), then issue the
        copies of the next forward's first shards."""
        transfers = self._transfers
        loss = None
        if closure is not None:  # torch's closure protocol: it runs forward and backward
            with torch.enable_grad():
                loss = closure()
        transfers.drain()  # (end_backward did: here for a step() without a backward)
        transfers.rotate()  # the step just taken says which shards the next forward needs first
        coef = None
        if self.max_grad_norm is not None:
            terms = []
            for g in self._model_groups:
                part = self._norm_terms.get(g)
                terms += part if part is not None else grad_norm_terms(group_grads(g), self.norm_type)
            self.last_grad_norm = global_grad_norm(self._runtime, terms, self.norm_type)
            coef = clip_coefficient(self.max_grad_norm, self.last_grad_norm)
        for g in self._inner:
            if g in self._stepped:
                continue
            if coef is not None:
                scale_grads(group_grads(g), coef)
            self._step_group(g)
            transfers.host_updated(g)  # its copy to the device overlaps the steps that follow
        if coef is not None:  # groups no optimizer steps are clipped too, as clip_grad_norm_ clips them
            for g in self._model_groups:
                if g not in self._inner:
                    scale_grads(group_grads(g), coef)
        transfers.copy_first_ahead()
        self._stepped.clear()
        self._norm_terms.clear()
        return loss


optimizer_guard.allow_optimizer(OffloadOptimizer)  # steps one inner optimizer per group, each checked
optimizer_guard.delegates_step(OffloadOptimizer)  # (the inner optimizers step plain local parameters)


def _options(param_group: dict) -> dict:
    return {k: v for k, v in param_group.items() if k != "params"}
