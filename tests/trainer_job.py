"""A transformers Trainer job (plain Trainer, or TSPTrainer with --tsp_size) on a tiny Llama
saved with save_pretrained; run with python (1 process) or torchrun. Rank 0 writes the logged
losses and the final full weights to --out."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

import torch
from transformers import (
    AutoModelForCausalLM,
    DataCollatorWithFlattening,
    HfArgumentParser,
    TrainerCallback,
)
from tsp_transformers import TSPTrainer, TSPTrainingArguments

import tsp_core
from tsp_core.parallelize import TSPCausalLM


@dataclass
class JobArgs:
    model_path: str = field(default="")
    out: str = field(default="")
    resume: str = field(default="")
    packed: bool = field(default=False)
    num_docs: int = field(default=16)


def packed_documents(vocab: int, n: int) -> list[list[int]]:
    """``n`` documents of lengths 1..39 (DataCollatorWithFlattening packs them into rows)."""
    gen = torch.Generator().manual_seed(5)
    lengths = torch.randint(1, 40, (n,), generator=gen).tolist()
    return [torch.randint(0, vocab, (k,), generator=gen).tolist() for k in lengths]


class LossLog(TrainerCallback):
    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss" in logs:
            self.losses.append(logs["loss"])


def main() -> None:
    job, args = HfArgumentParser((JobArgs, TSPTrainingArguments)).parse_args_into_dataclasses()
    model = AutoModelForCausalLM.from_pretrained(job.model_path, dtype=torch.float32)
    if job.packed:  # documents of different lengths, several per row
        data = [{"input_ids": d} for d in packed_documents(model.config.vocab_size, job.num_docs)]
        collator = DataCollatorWithFlattening()
    else:
        gen = torch.Generator().manual_seed(5)
        ids = torch.randint(0, model.config.vocab_size, (8, 24), generator=gen)
        data = [{"input_ids": r, "labels": r} for r in ids]
        collator = None
    log = LossLog()
    trainer = TSPTrainer(model=model, args=args, train_dataset=data, eval_dataset=data[:4],
                         callbacks=[log], data_collator=collator)
    trainer.train(resume_from_checkpoint=job.resume or None)
    metrics = trainer.evaluate()
    model = trainer.model
    weights = (tsp_core.full_state_dict(model, rank0_only=True) if isinstance(model, TSPCausalLM)
               else {k: v.detach().clone() for k, v in model.state_dict().items()})
    if trainer.args.process_index == 0:
        os.makedirs(job.out, exist_ok=True)
        torch.save(weights, os.path.join(job.out, "weights.pt"))
        with open(os.path.join(job.out, "result.json"), "w") as f:
            json.dump({"losses": log.losses, "eval_loss": metrics["eval_loss"]}, f)


if __name__ == "__main__":
    main()
