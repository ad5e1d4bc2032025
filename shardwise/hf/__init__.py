"""Integrations built on the engine: Hugging Face model directories (``weight_files``, ``pretrained``: each rank
reads only its own shards), ``--model`` resolution (``model_spec``, ``config_model``, ``presets``), peft LoRA
(``lora``) and export of a checkpoint as a model or adapter directory (``export``, ``export_lora``,
``rebuild``). The engine and ``checkpoint/`` never import this package, nor transformers or peft."""

from shardwise.hf.quantization import quiet_bitsandbytes_kernel_hint

quiet_bitsandbytes_kernel_hint()  # before any path through here imports transformers or peft
