"""``shardwise.optim.Muon``: exact Muon on sharded parameters, with AdamW for what Muon should not touch.

The result after every step equals ``torch.optim.Muon`` (+ ``torch.optim.AdamW`` for the other
parameters) run on the unsharded model, in the same Newton–Schulz dtype. The work per step:

    momentum / nesterov     elementwise on the local shards (torch's lerp formulas), no communication
    all-to-all              every rank's pieces of every matrix to that matrix's owner (exchange.py)
    Newton–Schulz           each matrix once, on its owner; same-shaped matrices in one batched call
    all-to-all              the orthogonalised pieces back
    update                  decoupled weight decay and the shape-scaled lr, elementwise on the shards
    AdamW                   torch's own AdamW kernel on the local shards of the other parameters

State lives in ``optimizer.state[p]`` as tensors shaped like the shard (``momentum_buffer``; AdamW's
``exp_avg``, ``exp_avg_sq`` and scalar ``step``), so shardwise checkpoints save, load and reshard it.
"""

from __future__ import annotations

import math
import re
import warnings
from typing import Callable, Iterable, Optional, Union

import torch

from shardwise.errors import ShardwiseError
from shardwise.engine.logical_shapes import ParamInfo, layout_of, param_info
from shardwise.optim import exchange
from shardwise.engine.surface.optimizer_guard import allow_optimizer
from shardwise.optim.newton_schulz import DEFAULT_COEFFICIENTS, DEFAULT_EPS, DEFAULT_STEPS, orthogonalize

UseMuon = Callable[[str, ParamInfo], bool]

# Names of parameters that are matrices but not hidden-layer weights: token/position embeddings and output
# heads (Keller Jordan's and Moonshot's recipes keep them on AdamW). Matched against every name of the
# parameter, so a head tied to the embedding is caught by either.
_NOT_HIDDEN = re.compile(r"(^|\.)(wte|wpe|embed\w*|\w*embeddings?|lm_head|head|output|classifier|score)(\.|$)")


def default_use_muon(name: str, info: ParamInfo) -> bool:
    """The default routing: Muon for 2-D logical shapes whose names are not embeddings or output heads
    (``wte``, ``wpe``, ``embed*``, ``*embeddings``, ``lm_head``, ``head``, ``output``, ``classifier``,
    ``score`` as a module name); everything else (1-D norms and biases, embeddings, heads, >2-D) to AdamW.
    ``nn.Embedding`` weights go to AdamW whatever their name (checked by Muon itself)."""
    return info.ndim == 2 and not any(_NOT_HIDDEN.search(n) for n in info.names)


def _matrix_shape(info: ParamInfo) -> tuple[int, int]:
    """The matrix Muon orthogonalises: the parameter itself, or (dim 0, the rest) for >2-D (Keller's Muon
    flattens convolution filters this way)."""
    return info.shape[0], info.numel // info.shape[0]


def adjusted_lr(lr: float, adjust_lr_fn: Optional[str], shape: tuple[int, int]) -> float:
    """torch.optim.Muon's ``_adjust_lr``: "original" (Keller) sqrt(max(1, A/B)), "match_rms_adamw"
    (Moonshot) 0.2 sqrt(max(A, B))."""
    a, b = shape
    if adjust_lr_fn is None or adjust_lr_fn == "original":
        return lr * math.sqrt(max(1, a / b))
    return lr * 0.2 * math.sqrt(max(a, b))


def _dtype_name(dtype: Union[str, torch.dtype]) -> str:
    name = str(dtype).replace("torch.", "")
    if not isinstance(getattr(torch, name, None), torch.dtype) or not getattr(torch, name).is_floating_point:
        raise ShardwiseError(f"Muon ns_dtype={dtype!r} is not a floating dtype (e.g. torch.bfloat16, torch.float32)")
    return name


class Muon(torch.optim.Optimizer):
    """Muon for the 2-D hidden-layer matrices of a sharded model, AdamW for the rest, in one optimizer.

    Args:
        params: the model's parameters after ``shardwise.shard`` (or param groups of them; a group may set
            any option below, including the ``adamw_*`` ones for its AdamW part).
        lr, weight_decay, momentum, nesterov, ns_coefficients, eps, ns_steps, adjust_lr_fn: as
            ``torch.optim.Muon`` (decoupled weight decay ``p *= 1 - lr * weight_decay``; the update is scaled
            by ``adjust_lr_fn`` from the *logical* shape).
        ns_dtype: dtype of the Newton–Schulz iteration; torch's is bfloat16 (the default here too).
            ``torch.float32`` makes the update exactly reproducible against an fp32 reference.
        adamw_lr, adamw_betas, adamw_eps, adamw_weight_decay: AdamW for the parameters not on Muon.
        use_muon: ``(name, ParamInfo) -> bool`` choosing the Muon parameters; default ``default_use_muon``
            (plus: no ``nn.Embedding`` weight). A chosen >2-D parameter is flattened to (dim 0, rest); a
            chosen 0-D/1-D one is an error. With the default rule >2-D parameters go to AdamW with a warning.
    """

    def __init__(self, params: Iterable, lr: float = 0.02, weight_decay: float = 0.1, momentum: float = 0.95,
                 nesterov: bool = True, ns_coefficients: tuple[float, float, float] = DEFAULT_COEFFICIENTS,
                 eps: float = DEFAULT_EPS, ns_steps: int = DEFAULT_STEPS, adjust_lr_fn: Optional[str] = None,
                 ns_dtype: Union[str, torch.dtype] = torch.bfloat16, adamw_lr: float = 3e-4,
                 adamw_betas: tuple[float, float] = (0.9, 0.95), adamw_eps: float = 1e-8,
                 adamw_weight_decay: float = 0.0, use_muon: Optional[UseMuon] = None):
        for key, value in (("lr", lr), ("weight_decay", weight_decay), ("momentum", momentum),
                           ("adamw_lr", adamw_lr), ("adamw_weight_decay", adamw_weight_decay)):
            if not value >= 0.0:
                raise ShardwiseError(f"Muon {key}={value} must be >= 0")
        if adjust_lr_fn not in (None, "original", "match_rms_adamw"):
            raise ShardwiseError(f"Muon adjust_lr_fn={adjust_lr_fn!r}: valid are None, 'original', 'match_rms_adamw'")
        if not 0 < ns_steps < 100 or len(ns_coefficients) != 3:
            raise ShardwiseError(f"Muon ns_steps={ns_steps} must be in 1..99 and ns_coefficients three numbers")
        self._use_muon = use_muon
        self._default_rule = use_muon is None
        self._adamw_defaults = dict(adamw_lr=adamw_lr, adamw_betas=tuple(adamw_betas), adamw_eps=adamw_eps,
                                    adamw_weight_decay=adamw_weight_decay)
        defaults = dict(lr=lr, weight_decay=weight_decay, momentum=momentum, nesterov=nesterov,
                        ns_coefficients=tuple(ns_coefficients), eps=eps, ns_steps=ns_steps,
                        adjust_lr_fn=adjust_lr_fn, ns_dtype=_dtype_name(ns_dtype), betas=tuple(adamw_betas),
                        use_muon=True)
        self._plans: dict[tuple[int, ...], exchange.ExchangePlan] = {}
        super().__init__(self._route(params), defaults)
        self._groups = self._shard_groups()

    # ---- construction: routing every parameter to Muon or AdamW -------------------------------------------
    def _route(self, params: Iterable) -> list[dict]:
        """Split every user group into a Muon group and an AdamW group (empty ones dropped)."""
        params = list(params)
        user_groups = params if params and isinstance(params[0], dict) else [{"params": params}]
        out, routed_away = [], []
        for ug in user_groups:
            ps = ug["params"]
            ps = [ps] if isinstance(ps, torch.Tensor) else list(ps)
            options = {k: v for k, v in ug.items() if k != "params" and not k.startswith("adamw_")}
            adam = {k: ug.get(k, v) for k, v in self._adamw_defaults.items()}
            muon_ps, adam_ps = [], []
            for p in ps:
                info = param_info(p)
                if self._routes_to_muon(p, info, routed_away):
                    muon_ps.append(p)
                else:
                    adam_ps.append(p)
            if muon_ps:
                out.append({**options, "params": muon_ps, "use_muon": True})
            if adam_ps:
                out.append({**options, "params": adam_ps, "use_muon": False, "lr": adam["adamw_lr"],
                            "betas": tuple(adam["adamw_betas"]), "eps": adam["adamw_eps"],
                            "weight_decay": adam["adamw_weight_decay"]})
        if routed_away:
            warnings.warn(f"shardwise Muon: {len(routed_away)} parameter(s) with more than 2 dimensions go to AdamW "
                          f"(e.g. {routed_away[0]}); pass use_muon= to orthogonalise them flattened to "
                          f"(dim 0, rest)", stacklevel=3)
        return out

    def _routes_to_muon(self, p: torch.Tensor, info: ParamInfo, routed_away: list) -> bool:
        if self._default_rule:
            group, i = layout_of(p)
            if any(isinstance(ref.module, torch.nn.Embedding) for ref in group.plan.params[i].refs):
                return False
            if info.ndim > 2 and not any(_NOT_HIDDEN.search(n) for n in info.names):
                routed_away.append(f"{info.name} {tuple(info.shape)}")
            return default_use_muon(info.name, info)
        chosen = bool(self._use_muon(info.name, info))
        if chosen and info.ndim < 2:
            raise ShardwiseError(f"Muon use_muon chose {info.name!r} of shape {tuple(info.shape)}: Muon needs a "
                                 f"matrix (2-D, or >2-D flattened); route it to AdamW")
        return chosen

    def _shard_groups(self):
        """The one shard group every Muon matrix is split over (all parameters must come from one model)."""
        found = {}
        for g in self.param_groups:
            for p in g["params"]:
                flat = layout_of(p)[0]
                found.setdefault(id(flat.pgs.shard), flat)
        if len(found) > 1:
            raise ShardwiseError("Muon: the parameters come from models sharded over different process groups; "
                                 "build one optimizer per sharded model")
        flat = next(iter(found.values()), None)
        self._device, self._checker = (flat.device, flat.checker) if flat is not None else (None, None)
        return flat.pgs if flat is not None else None

    # ---- the step ----------------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        matrices = []  # (param, group, update piece) for every Muon parameter with a gradient, in group order
        for group in self.param_groups:
            if group["use_muon"]:
                matrices += self._momentum(group)
            else:
                self._adamw(group)
        if matrices:
            self._orthogonalize_and_update(matrices)
        return loss

    def _momentum(self, group: dict) -> list:
        """torch.optim.Muon's momentum on the local piece: B = lerp(B, g, 1 - mu); nesterov: lerp(g, B, mu)."""
        out = []
        mu = group["momentum"]
        for p in group["params"]:
            if p.grad is None:
                continue
            state = self.state[p]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(p.grad, memory_format=torch.preserve_format)
            buf = state["momentum_buffer"]
            buf.lerp_(p.grad, 1 - mu)
            out.append((p, group, p.grad.lerp(buf, mu) if group["nesterov"] else buf))
        return out

    def _orthogonalize_and_update(self, matrices: list) -> None:
        infos = [param_info(p) for p, _, _ in matrices]
        shapes = [_matrix_shape(info) for info in infos]
        groups = self._groups
        size, rank = groups.shard_size, groups.shard_rank
        key = tuple(id(p) for p, _, _ in matrices)
        plan = self._plans.get(key)
        if plan is None:
            plan = exchange.ExchangePlan(
                owners=exchange.assign_owners([m * n * min(m, n) for m, n in shapes], size),
                pieces=tuple(_pieces(p, size) for p, _, _ in matrices))
            self._plans[key] = plan
        by_dtype: dict[str, list[int]] = {}
        for j, (_, group, _) in enumerate(matrices):
            by_dtype.setdefault(group["ns_dtype"], []).append(j)
        for dtype_name, js in by_dtype.items():  # one exchange per Newton–Schulz dtype (normally exactly one)
            sub = plan if len(js) == len(matrices) else exchange.ExchangePlan(
                tuple(plan.owners[j] for j in js), tuple(plan.pieces[j] for j in js))
            pieces = exchange.exchange_and_orthogonalize(
                [matrices[j][2] for j in js], [shapes[j] for j in js], sub, rank, groups.shard,
                lambda ks, whole, js=js: _orthogonalize_batched(whole, [matrices[js[k]][1] for k in ks]),
                getattr(torch, dtype_name), self._device, self._checker)
            for j, piece in zip(js, pieces):
                p, group, _ = matrices[j]
                lr = group["lr"]
                p.mul_(1 - lr * group["weight_decay"])
                p.add_(piece, alpha=-adjusted_lr(lr, group["adjust_lr_fn"], shapes[j]))

    def _adamw(self, group: dict) -> None:
        params, grads, exp_avgs, exp_avg_sqs, steps = [], [], [], [], []
        for p in group["params"]:
            if p.grad is None:
                continue
            state = self.state[p]
            if not state:
                state["step"] = torch.zeros((), dtype=torch.float32)
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            params.append(p)
            grads.append(p.grad)
            exp_avgs.append(state["exp_avg"])
            exp_avg_sqs.append(state["exp_avg_sq"])
            steps.append(state["step"])
        if params:
            _torch_adamw(params, grads, exp_avgs, exp_avg_sqs, steps, group)


def _pieces(p: torch.Tensor, size: int) -> tuple[int, ...]:
    """Elements of ``p``'s parameter held by each shard rank (from the plan: the ranks' ranges)."""
    group, i = layout_of(p)
    spec = group.plan.params[i]
    return tuple(hi - lo for lo, hi in (spec.local_range(*group.plan.shard_range(r)) for r in range(size)))


def _orthogonalize_batched(whole: list[torch.Tensor], groups: list[dict]) -> list[torch.Tensor]:
    """Newton–Schulz of every matrix, one batched call per (shape, NS options)."""
    batches: dict[tuple, list[int]] = {}
    for k, (w, g) in enumerate(zip(whole, groups)):
        key = (tuple(w.shape), g["ns_coefficients"], g["ns_steps"], g["eps"], g["ns_dtype"])
        batches.setdefault(key, []).append(k)
    out: list[torch.Tensor] = [None] * len(whole)  # type: ignore[list-item]
    for (_, coefficients, steps, eps, dtype_name), ks in batches.items():
        results = orthogonalize([whole[k] for k in ks], coefficients, steps, eps, getattr(torch, dtype_name))
        for k, o in zip(ks, results):
            out[k] = o
    return out


def _torch_adamw(params, grads, exp_avgs, exp_avg_sqs, steps, group: dict) -> None:
    """torch's own Adam kernel with decoupled weight decay (what ``torch.optim.AdamW`` runs), so the AdamW part
    is bitwise torch's. ``torch.optim.adam.adam`` with ``decoupled_weight_decay``: checked on torch 2.11, 2.13."""
    from torch.optim.adam import adam

    beta1, beta2 = group["betas"]
    adam(params, grads, exp_avgs, exp_avg_sqs, [], steps, foreach=None, capturable=False, differentiable=False,
         fused=None, grad_scale=None, found_inf=None, has_complex=False, decoupled_weight_decay=True,
         amsgrad=False, beta1=beta1, beta2=beta2, lr=group["lr"], weight_decay=group["weight_decay"],
         eps=group["eps"], maximize=False)


allow_optimizer(Muon)  # shardwise's own: orthogonalises whole matrices gathered across the shard group
