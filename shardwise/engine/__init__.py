"""The FSDP engine: everything that shards a model, gathers its units, reduces its gradients and checks that
the ranks agree. It imports nothing of shardwise but itself and ``errors`` (tests/test_layering.py).

Reading order of one training step (full_shard, the default), in five files:

1. ``api.py``        ``shard()``: resolve the strategy and device, build the plan, allocate, fill, wire hooks.
2. ``plan.py``       units -> flat groups (unit x dtype x requires_grad), offsets, padding: pure layout.
3. ``flat_group.py`` one flat group's memory: the persistent ``shard``, the ``gathered`` buffer that
                     ``unshard``/``reshard`` fill and free, ``reduce_grads`` into the gradient shard.
4. ``unit.py``       a unit's hooks: enter (unshard, prefetch the next, bind views), exit (reshard),
   ``runtime.py``    pre-backward (re-gather), post-backward (reduce-scatter); the model-wide state:
                     phase, forward order, pending reductions, end of backward.
5. ``collectives.py`` the torch.distributed calls and the one ``wait`` (through ``watchdog.py``).

Then ``grad_norm.py`` (``clip_grad_norm_``) and the user's ``optimizer.step()`` on the shard parameters.
torch's own APIs on those pieces: ``shard_grad.py`` (parameters and gradients whose norms span the ranks),
``shard_param.py`` (the parameter type; autograd calls naming parameters), ``direct_grads.py`` (penalties
computed from the parameters), ``optimizer_guard.py`` (which optimizers, whose state), ``param_hooks.py`` (``p.register_hook``).
What users put around the model: ``wrapper_refusal.py`` (DDP, ``fully_shard``, pickling refused),
``state_dict_stamps.py`` (``model.state_dict()`` / ``load_state_dict`` whose pieces), ``dcp_pieces.py``
(torch.distributed.checkpoint of the pieces refused).

Around that path: ``fingerprint.py`` (every collective is fingerprinted, so ranks that disagree fail by
name instead of hanging), ``watchdog.py`` (stall reports), ``agree.py`` (one error on every rank),
``materialize.py`` (filling shards, meta init), ``mixed_precision.py``, ``cpu_offload.py`` +
``offload_transfers.py`` + ``streams.py`` (CPU offload), ``activation_checkpoint.py``,
``buffer_broadcast.py``, ``full_params.py`` / ``state_dict.py`` (whole parameters on demand),
``logical_shapes.py`` (a shard's full name and shape), ``grad_scaler.py`` (fp16), ``strategy.py`` and
``device.py`` (process groups, device, backend). docs/ARCHITECTURE.md draws it.
"""
