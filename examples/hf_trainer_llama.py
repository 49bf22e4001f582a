"""The transformers Trainer with TSP: ``TSPTrainingArguments(tsp_size=...)`` and ``TSPTrainer``
instead of ``TrainingArguments`` and ``Trainer``; everything else is an ordinary script.

    torchrun --standalone --nproc_per_node 2 examples/hf_trainer_llama.py --tsp_size 2
    python examples/hf_trainer_llama.py                      (tsp_size 1: exactly the plain Trainer)

The model is a small random-init Llama written with save_pretrained first (nothing is
downloaded); ``--output_dir`` defaults to ./runs/hf_trainer. With TSP every training log also
carries TSP's figures (``tsp/comm_mib``, ``tsp/wait_frac``, ``tsp/tokens_per_s``, peak memory:
docs/monitoring.md), so ``--report_to tensorboard`` etc. receive them; the last one is printed.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM, HfArgumentParser, LlamaConfig, LlamaForCausalLM

import tsp_core
from tsp_transformers import TSPTrainer, TSPTrainingArguments


def main() -> None:
    defaults = ["--output_dir", "runs/hf_trainer", "--max_steps", "8", "--logging_steps", "1",
                "--per_device_train_batch_size", "2", "--report_to", "none", "--use_cpu",
                "--save_strategy", "no"]
    (args,) = HfArgumentParser(TSPTrainingArguments).parse_args_into_dataclasses(
        defaults + sys.argv[1:])
    path = os.path.join(args.output_dir, "initial_model")
    if args.process_index == 0 and not os.path.exists(path):
        torch.manual_seed(0)
        LlamaForCausalLM(LlamaConfig(vocab_size=4096, hidden_size=256, intermediate_size=704,
                                     num_hidden_layers=4, num_attention_heads=8,
                                     num_key_value_heads=4)).save_pretrained(path)
    if dist.is_initialized():
        dist.barrier()
    model = AutoModelForCausalLM.from_pretrained(path)
    ids = torch.randint(0, 4096, (32, 512), generator=torch.Generator().manual_seed(1))
    data = [{"input_ids": row, "labels": row} for row in ids]
    trainer = TSPTrainer(model=model, args=args, train_dataset=data)   # <- was Trainer
    trainer.train()
    rows = [log for log in trainer.state.log_history if "tsp/steps" in log]
    if rows and args.process_index == 0:
        print(tsp_core.metrics.summary(rows[-1]))
    trainer.save_model(os.path.join(args.output_dir, "final"))   # an ordinary HF checkpoint


if __name__ == "__main__":
    with tsp_core.run_cleanly():  # barrier, destroy the groups, exit 0 (docs/cluster.md)
        main()
