"""The FSDP engine: everything that shards a model, gathers its units, reduces its gradients and checks that
the ranks agree. It imports nothing of shardwise but itself and ``errors``, and inside it the folders import
down only (tests/test_layering.py)::

    base/ (layout, device, collectives)  <  checks/ (fingerprints)  <  core/ (the step)  <  surface/ (what
    user code sees of parameters and gradients), and the loose modules here (shard(), clipping, state dicts)

Reading order of one training step (full_shard, the default: checks on, no offload, a model with buffers;
forward, backward, ``shardwise.clip_grad_norm_``, ``optimizer.step()``). The step enters these 24 files
(tests/engine/test_reading_order.py traces one and holds this list to it):

 1. ``base/plan.py``            units -> flat groups (unit x dtype x requires_grad), offsets, padding: pure layout
 2. ``core/flat_group.py``      one flat group's memory: the persistent ``shard``, the ``gathered`` buffer that
                                ``begin_unshard``/``reshard`` fill and free, packing the gradients
 3. ``core/reduction.py``       one gradient reduction in flight: reduce-scatter, replicas, division, hand-out
 4. ``core/grad_usage.py``      which parameters got a gradient, agreed across ranks: no gradient is ``None``
 5. ``core/unit.py``            a unit's hooks: enter (unshard, prefetch the next, bind views), exit (reshard),
                                pre-backward (re-gather), post-backward (reduce)
 6. ``core/runtime.py``         the model-wide state: phase, forward order, pending reductions, end of backward
 7. ``core/seams.py``           where the core takes its parameters from and hands its gradients to
 8. ``base/collectives.py``     the torch.distributed calls and the one ``wait`` ...
 9. ``base/watchdog.py``        ... through the stall watchdog
10. ``base/torch_internals.py`` the torch internals the step relies on, one function each
11. ``base/nested.py``          the tensors inside a unit's outputs (to hook them for backward)
12. ``base/strategy.py``        the process groups and the data-parallel size
13. ``base/device.py``          the control group: the gloo host group that carries the ranks' agreements
14. ``checks/fingerprint.py``   the ranks agree on every collective before it is issued (once per phase)
15. ``surface/shard_param.py``  the parameter factory: a ``Piece`` over a local parameter, what the core asks
16. ``surface/grad_sink.py``    the gradient sink: ``.grad`` pieces, hooks, direct gradients
17. ``surface/pieces.py``       ``Piece``: the whole tensor to user code (its table: piece_ops.py), ``local_only``
18. ``surface/param_hooks.py``  tensor hooks and post-accumulate-grad hooks at hand-out
19. ``surface/direct_grads.py`` gradients that reached a parameter directly (a penalty)
20. ``surface/optimizer_guard.py`` the optimizer step hooks ...
21. ``surface/optimizer_swap.py`` ... which swap in plain local parameters for the step (no Python dispatch)
22. ``buffer_broadcast.py``     rank 0's buffers before each forward
23. ``grad_norm.py``            ``clip_grad_norm_``
24. ``ddp_idioms.py``           the root model's attribute lookups (``model.module`` is a named error; DDP's
                                ``no_sync()`` and ``require_backward_grad_sync``, FSDP's idioms, on the model)

``api.py`` builds all of it (``shard()``); docs/ARCHITECTURE.md draws the step and lists every file.
"""
