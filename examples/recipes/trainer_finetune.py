"""Fine-tune a pretrained causal LM with TSP through the transformers Trainer (docs/recipes.md).

    torchrun --nproc-per-node 8 examples/recipes/trainer_finetune.py \
        --model /models/Llama-3.1-8B --data tokens.bin --out runs/llama8b

The switch: ``TSPTrainer`` and ``TSPTrainingArguments(tsp_size=...)`` in place of ``Trainer`` and
``TrainingArguments``. The model comes from ``tsp_transformers.load_pretrained``, each rank reading
only its slices of the safetensors files (``from_pretrained`` would build the whole model on every
rank first); ``TSPTrainer`` takes it converted. bf16 parameters on CUDA, activation
checkpointing, AdamW, ``checkpoint-N`` every ``--save-every`` steps (an ordinary Hugging Face
checkpoint plus the optimizer state, resumable at any TSP degree), ``--resume`` from the latest,
and TSP's figures (``tsp/comm_mib``, ``tsp/tokens_per_s``, peak memory) in every log row, so
``--report-to tensorboard`` (or wandb...) receives them. Long context: ``--activation-offload``
and ``--tile-tokens N`` are ``TSPTrainingArguments(tsp_activation_offload=True, tsp_tile_tokens=N)``
and go to ``load_pretrained`` too (docs/long-context.md). Data format and flags: common.py.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from common import TokenRows, long_context, parse_args, report
from transformers import TrainerCallback
from transformers.trainer_utils import get_last_checkpoint

import tsp_core
from tsp_transformers import TSPTrainer, TSPTrainingArguments, load_pretrained


class PrintRows(TrainerCallback):
    """Each training log row (loss and TSP's figures) as common.report prints it."""

    def __init__(self, a) -> None:
        self.a = a

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss" in logs:
            report(self.a, state.global_step, logs["loss"],
                   {k: v for k, v in logs.items() if k.startswith("tsp/")})


def main(argv: list[str] | None = None) -> None:
    a = parse_args(__doc__, argv, extra=(("--report-to", dict(default="none")),))
    args = TSPTrainingArguments(
        output_dir=a.out, tsp_size=a.tsp,                 # <- the one TSP argument
        tsp_activation_offload=a.activation_offload,      # long context
        tsp_tile_tokens=a.tile_tokens,
        per_device_train_batch_size=a.batch, max_steps=a.steps, learning_rate=a.lr,
        weight_decay=0.0, lr_scheduler_type="constant", max_grad_norm=1.0,
        activation_checkpointing=True,
        activation_checkpointing_kwargs={"use_reentrant": False},
        train_sampling_strategy="sequential",             # the file's order (common.py)
        save_strategy="steps", save_steps=a.save_every, logging_steps=1,
        report_to=a.report_to, use_cpu=not torch.cuda.is_available(),
        bf16=False)                                       # the parameters are already bf16
    _ = args.world_size                                   # starts the process group
    model = load_pretrained(a.model, tsp_size=a.tsp, dtype=a.torch_dtype, **long_context(a))
    data = TokenRows(a, model.config.vocab_size)          # the Trainer skips rows on resume
    trainer = TSPTrainer(model=model, args=args, train_dataset=data, callbacks=[PrintRows(a)])
    resume = get_last_checkpoint(a.out) if a.resume and os.path.isdir(a.out) else None
    trainer.train(resume_from_checkpoint=resume)
    if dist.get_rank() == 0 and resume:
        print(f"resumed from {resume}")


if __name__ == "__main__":
    with tsp_core.run_cleanly():  # barrier, destroy the groups, exit 0 (docs/cluster.md)
        main()
