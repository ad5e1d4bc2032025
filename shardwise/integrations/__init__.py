"""Where people already train: shardwise inside the frameworks' own loops, which otherwise wrap the model in
DDP (refused on a sharded model, engine/surface/wrapper_refusal.py). Each integration makes its framework not wrap:
the model is sharded once, handed to the framework as it is, and saved whole through
``shardwise.save_whole_model`` (Lightning: ``shardwise.full_state_dict`` inside its own checkpoint file); optimizer state goes through shardwise's own checkpoints (per rank pieces,
resharded at any world size).

- ``accelerate``: ``shard_and_prepare(accelerator, model, ...)`` and ``save_model(accelerator, model, dir)``
  for your own Accelerate loop; the one place that hands a sharded model to an ``Accelerator`` (its public
  ``prepare_model(model, device_placement=False, evaluation_mode=True)``: autocast kept, no DDP).
- ``lightning``: ``strategy="shardwise"`` for Lightning's ``Trainer`` and ``Fabric`` (``ShardwiseStrategy``,
  ``ShardwiseFabricStrategy``); checkpoints in ``lightning_checkpoint``: a whole-model file one process loads
  plus a sidecar of per-rank pieces.
- ``transformers``: ``ShardwiseTrainerMixin`` and ``ShardwiseTrainer`` (Hugging Face ``Trainer``; the mixin
  also goes in front of TRL's ``SFTTrainer``); ``training_args``: what ``TrainingArguments``' FSDP settings
  become.

Importing a module here imports its framework; this package itself imports nothing.
"""
