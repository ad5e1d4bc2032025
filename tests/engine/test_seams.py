"""The core's two seams (``shardwise/engine/core/seams.py``) with their defaults, in one process: the step
takes its parameters from a ``ParamFactory`` and hands its gradients to a ``GradSink``, and a flat group built
with neither gets plain ``nn.Parameter`` objects over its aliases and ``.grad`` views of the reduced shard.
(The surface's factory and sink, which ``shard()`` supplies, are what every distributed test runs.)"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from shardwise.engine.base.mixed_precision import MixedPrecision
from shardwise.engine.base.plan import build_plan
from shardwise.engine.base.strategy import ProcessGroups, Strategy
from shardwise.engine.base.torch_internals import version_counter
from shardwise.engine.core import reduction
from shardwise.engine.core.flat_group import FlatGroup
from shardwise.engine.core.seams import GradSink


class RecordingSink(GradSink):
    """The default sink, noting every assignment of a gradient (the one writer)."""

    def __init__(self):
        super().__init__()
        self.assigned = []

    def set_grad(self, p, grad):
        self.assigned.append((p, grad))
        super().set_grad(p, grad)


def _group(sink=None) -> FlatGroup:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
    plan = build_plan(model, None, 1)
    alone = ProcessGroups(shard=None, replicate=None, shard_size=1, shard_rank=0, replicate_size=1)
    g = FlatGroup(plan.units[0].groups[0], alone, torch.device("cpu"), MixedPrecision(), None, Strategy.FULL_SHARD,
                  sink=sink)
    for alias, spec in zip(g.aliases, g.plan.params):
        value = spec.refs[0].module._parameters[spec.refs[0].name]
        alias.copy_(value.detach().reshape(-1))
    return g


def _written_by_the_sink(sink: RecordingSink, g: FlatGroup) -> bool:
    """Every parameter's .grad is the tensor the sink last assigned to it."""
    last = {}
    for p, grad in sink.assigned:
        last[id(p)] = grad
    return all(p.grad is last.get(id(p)) for p in g.shard_params)


def _reduce(g: FlatGroup, grads, sync=True) -> None:
    r = g.reduce_grads(grads, sync=sync)
    if r is not None:
        reduction.finish(r)


def test_the_default_factory_makes_plain_parameters_over_the_aliases():
    g = _group()
    for p, alias, spec in zip(g.shard_params, g.aliases, g.plan.params):
        assert type(p) is nn.Parameter and p.requires_grad
        assert p.data_ptr() == alias.data_ptr() and p.shape == alias.shape == (spec.numel,)
        assert g.factory.is_intact(p, alias) and g.factory.requires_grad(p)
    p = g.shard_params[0]
    before_p, before_shard = g.factory.version(p), version_counter(g.shard)
    with torch.no_grad():
        p.add_(1.0)  # an optimizer step: the parameter's own counter, not the shard's (autograd's saved views)
    assert g.factory.version(p) == before_p + 1 and version_counter(g.shard) == before_shard
    assert g.changed_param() is None
    g.shard_params[2].data = torch.zeros(8)
    assert g.changed_param() == 2 and g.converted_dtype() is None


def test_the_default_sink_hands_out_grad_views_of_the_reduced_shard():
    sink = RecordingSink()
    g = _group(sink)
    grads = [torch.full(s.shape, float(i + 1)) for i, s in enumerate(g.plan.params)]
    _reduce(g, grads)
    storage = {p.grad.untyped_storage().data_ptr() for p in g.shard_params}
    assert len(storage) == 1, "every .grad is a view of one reduced shard"
    for p, grad in zip(g.shard_params, grads):
        assert torch.equal(p.grad, grad.reshape(-1))
    assert _written_by_the_sink(sink, g)
    _reduce(g, grads)  # a second backward adds into the same views
    for p, grad in zip(g.shard_params, grads):
        assert torch.equal(p.grad, 2 * grad.reshape(-1))
    assert len(sink.assigned) == len(g.shard_params) and _written_by_the_sink(sink, g), "adding assigns nothing"


def test_frozen_parameters_get_no_gradient():
    g = _group()
    g.shard_params[1].requires_grad_(False)
    with pytest.warns(UserWarning, match="frozen after shard"):
        _reduce(g, [torch.ones(s.shape) for s in g.plan.params])
    assert [p.grad is None for p in g.shard_params] == [False, True, False, False]


def test_no_sync_marks_follow_the_grads_the_user_holds():
    sink = RecordingSink()
    g = _group(sink)
    ones = [torch.ones(s.shape) for s in g.plan.params]
    _reduce(g, ones, sync=False)
    assert all(torch.equal(p.grad, torch.zeros_like(p)) for p in g.shard_params)
    assert g.has_unsynced_grad() and _written_by_the_sink(sink, g)
    _reduce(g, ones, sync=True)  # the accumulated micro-batch joins this one
    assert all(torch.equal(p.grad, torch.full_like(p, 2.0)) for p in g.shard_params)
    assert _written_by_the_sink(sink, g)
    _reduce(g, ones, sync=False)
    with torch.no_grad():
        g.shard_params[0].grad.zero_()  # zero_grad(set_to_none=False): the accumulation goes with the grads
    assert not g.has_unsynced_grad()


def test_a_whole_group_dtype_conversion_is_followed_with_its_grads():
    sink = RecordingSink()
    g = _group(sink)
    _reduce(g, [torch.ones(s.shape) for s in g.plan.params])
    values = [p.detach().clone() for p in g.shard_params]
    for p in g.shard_params:  # what model.double() does to each parameter (nn.Module._apply)
        p.data = p.data.double()
        p.grad.data = p.grad.data.double()
    assert g.changed_param() == 0 and g.converted_dtype() == torch.float64
    g.adopt_conversion(torch.float64)
    assert g.shard.dtype == torch.float64 and g.changed_param() is None
    for p, alias, v in zip(g.shard_params, g.aliases, values):
        assert p.data_ptr() == alias.data_ptr() and torch.equal(p.detach(), v.double())
        assert p.grad.dtype == torch.float64
    assert _written_by_the_sink(sink, g)


# ---- no gradient means p.grad is None (core/grad_usage.py) ------------------------------------------------
def _end_backward(g: FlatGroup) -> None:
    """What ModelRuntime.end_backward does for a group of one rank: its own marks are everyone's."""
    used, g.used_this_backward = g.used_this_backward, None
    g.sink.end_backward(g, used)


def test_a_parameter_no_backward_reached_gets_no_gradient():
    sink = RecordingSink()
    g = _group(sink)
    shapes = [s.shape for s in g.plan.params]
    _reduce(g, [torch.ones(shapes[0]), None, torch.ones(shapes[2]), None])
    assert g.used_this_backward == [True, False, True, False]
    _end_backward(g)
    assert [p.grad is None for p in g.shard_params] == [False, True, False, True]
    assert _written_by_the_sink(sink, g)
    # A parameter that held a gradient keeps it, unchanged (plain torch leaves an existing .grad alone).
    _reduce(g, [None, torch.ones(shapes[1]), None, None])
    _end_backward(g)
    assert [p.grad is None for p in g.shard_params] == [False, False, False, True]
    assert torch.equal(g.shard_params[0].grad, torch.ones(shapes[0]).reshape(-1))


def test_no_sync_hands_out_handles_only_to_what_was_used_and_the_synced_backward_decides():
    g = _group(RecordingSink())
    shapes = [s.shape for s in g.plan.params]
    _reduce(g, [torch.ones(shapes[0]), None, None, None], sync=False)
    assert [p.grad is None for p in g.shard_params] == [False, True, True, True], "as DDP under no_sync"
    _reduce(g, [None, None, None, torch.ones(shapes[3])], sync=False)
    assert [p.grad is None for p in g.shard_params] == [False, True, True, False]
    _reduce(g, [None, torch.ones(shapes[1]), None, None], sync=True)  # the synced micro-batch
    _end_backward(g)
    assert [p.grad is None for p in g.shard_params] == [False, False, True, False], "used in any micro-batch = used"
    assert torch.equal(g.shard_params[0].grad, torch.ones(shapes[0]).reshape(-1))
    # Handles dropped between micro-batches (zero_grad): the accumulation and what it marked start again.
    _reduce(g, [torch.ones(shapes[0]), None, None, None], sync=False)
    for p in g.shard_params:
        p.grad = None
    _reduce(g, [None, None, torch.ones(shapes[2]), None], sync=True)
    _end_backward(g)
    assert [p.grad is None for p in g.shard_params] == [True, True, False, True]
