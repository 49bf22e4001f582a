"""Fine-tune a pretrained causal LM with TSP through Accelerate (docs/recipes.md).

    accelerate launch --multi_gpu --num_processes 8 examples/recipes/accelerate_finetune.py \
        --model /models/Llama-3.1-8B --data tokens.bin --out runs/llama8b

The switch: ``TSPAccelerator()`` in place of ``Accelerator()``. The model comes from
``tsp_transformers.load_pretrained`` on the accelerator's mesh, each rank reading only its slices
of the safetensors files; ``prepare`` takes it converted and gets every rank of a TSP group the
same batches. bf16 parameters on CUDA, activation checkpointing, AdamW, ``save_state`` every
``--save-every`` steps (``<out>/step_N``; the model and optimizer as a tsp_core checkpoint,
resumable at any TSP degree), ``--resume`` from the latest, and ``accelerator.tsp_metrics()``
(``tsp/comm_mib``, ``tsp/tokens_per_s``, peak memory) logged to ``<out>/metrics.jsonl`` by a
``JSONLinesTracker`` (``log_with="tensorboard"`` or ``"wandb"`` take it the same way). Data
format and flags: common.py. Long context: ``--activation-offload`` and ``--tile-tokens N`` are
``TSPAccelerator(activation_offload=True, tile_tokens=N)`` and go to ``load_pretrained`` too
(docs/long-context.md).
"""

from __future__ import annotations

import os
import re

import torch
from common import TokenRows, long_context, parse_args, report
from torch.utils.data import DataLoader

import tsp_core
from tsp_accelerate import JSONLinesTracker, TSPAccelerator
from tsp_transformers import load_pretrained


def latest_state(out: str) -> tuple[int, str | None]:
    """The highest step of a complete ``save_state`` directory ``<out>/step_N`` (its tsp_core
    checkpoint written last but one: its marker exists only once every rank's part does)."""
    steps = [int(m.group(1)) for name in (os.listdir(out) if os.path.isdir(out) else [])
             if (m := re.fullmatch(r"step_(\d+)", name))
             and os.path.exists(os.path.join(out, name, "tsp_model", "tsp_checkpoint.json"))]
    return (max(steps), os.path.join(out, f"step_{max(steps)}")) if steps else (0, None)


def main(argv: list[str] | None = None) -> None:
    a = parse_args(__doc__, argv)
    tracker = JSONLinesTracker(os.path.join(a.out, "metrics.jsonl"), append=a.resume)
    accelerator = TSPAccelerator(tsp_size=a.tsp, log_with=[tracker],  # <- was Accelerator()
                                 **long_context(a))
    accelerator.init_trackers("recipe")
    model = load_pretrained(a.model, mesh=accelerator.tsp_mesh, dtype=a.torch_dtype,
                            **long_context(a))
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=a.lr, weight_decay=0.0)
    data = TokenRows(a, model.config.vocab_size)
    loader = DataLoader(data, batch_size=a.batch)         # in file order; prepare splits it over
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)   # replicas

    start, state = latest_state(a.out) if a.resume else (0, None)
    if state:
        accelerator.load_state(state)
        loader = accelerator.skip_first_batches(loader, start)
    accelerator.tsp_metrics()                             # open the window after loading
    for step, batch in zip(range(start + 1, a.steps + 1), loader):
        loss = model(**batch).loss                        # the model shards the full batch
        accelerator.backward(loss)
        accelerator.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        figures = accelerator.tsp_metrics()
        accelerator.log({"loss": loss.item(), **figures}, step=step)
        report(a, step, loss.item(), figures, log_file=False)   # the tracker writes the file
        if step % a.save_every == 0 or step == a.steps:
            accelerator.save_state(os.path.join(a.out, f"step_{step}"))
    accelerator.end_training()


if __name__ == "__main__":
    with tsp_core.run_cleanly():  # barrier, destroy the groups, exit 0 (docs/cluster.md)
        main()
