"""HF Trainer + FSDP2 + bitsandbytes QLoRA on CPU, the row beside qlora_bench.py: does it run, and as what?

    torchrun --nproc-per-node 2 bench/hf_trainer_qlora.py runs/qlora-bench/llama-h2048-i5632-l8-v32000

Loads the directory qlora_bench.py writes with ``BitsAndBytesConfig(load_in_4bit=True, nf4, double
quantisation, bf16 compute and storage)`` on CPU, wraps every projection with peft LoRA r=16 and trains
3 steps of batch 1 x seq 64 with ``fsdp="full_shard auto_wrap"``, ``fsdp_config={"fsdp_version": 2, ...}``,
bf16 and gradient checkpointing, as a user would. Prints the wrapper Trainer actually used, the median step
time, the RSS after loading and the peak RSS over training, both less the RSS once the libraries are
imported (as qlora_bench.py's baseline), per rank.
"""

from __future__ import annotations

import os
import sys
import time

import torch

from proc_rss import current_rss, peak_rss  # this script's folder is first on sys.path


def main() -> None:
    from peft import LoraConfig, get_peft_model
    from transformers import (AutoModelForCausalLM, BitsAndBytesConfig, Trainer, TrainerCallback,
                              TrainingArguments)

    import bitsandbytes  # noqa: F401  (imported before the baseline: library code, not model memory)
    import transformers.models.llama.modeling_llama  # noqa: F401

    torch.set_num_threads(1)
    baseline = current_rss()
    bnb = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                             bnb_4bit_compute_dtype=torch.bfloat16, bnb_4bit_quant_storage=torch.bfloat16)
    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(sys.argv[1], quantization_config=bnb, dtype=torch.bfloat16,
                                                 device_map={"": "cpu"})
    load_s = time.perf_counter() - t0
    model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, task_type="CAUSAL_LM", target_modules=[
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]))
    vocab = model.config.vocab_size

    class RandomTokens(torch.utils.data.Dataset):
        def __len__(self):
            return 64

        def __getitem__(self, i):
            x = torch.randint(0, vocab, (64,), generator=torch.Generator().manual_seed(i))
            return {"input_ids": x, "labels": x}

    class StepTimes(TrainerCallback):
        times: list = []

        def on_step_begin(self, *a, **k):
            self.t = time.perf_counter()

        def on_step_end(self, *a, **k):
            self.times.append(time.perf_counter() - self.t)

    args = TrainingArguments(output_dir="/tmp/hf_trainer_qlora", per_device_train_batch_size=1, max_steps=3,
                             use_cpu=True, bf16=True, gradient_checkpointing=True, report_to=[], save_strategy="no",
                             fsdp="full_shard auto_wrap", fsdp_config={
                                 "fsdp_version": 2, "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"]})
    trainer = Trainer(model=model, args=args, train_dataset=RandomTokens(), callbacks=[StepTimes()])
    loaded = current_rss() - baseline
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    trainer.train()
    times = sorted(StepTimes.times[1:])
    print(f"rank {os.environ.get('RANK')}: wrapped as {type(trainer.model_wrapped).__name__} "
          f"(accelerate distributed_type {trainer.accelerator.distributed_type}); load {load_s:.1f} s, "
          f"step {times[len(times) // 2]:.2f} s (median of {len(times)}); RSS after load {loaded / 1e9:.3f} GB, "
          f"peak over training {(peak_rss() - baseline) / 1e9:.3f} GB (both less the baseline)", flush=True)


if __name__ == "__main__":
    main()
