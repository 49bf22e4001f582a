"""Fine-tune a pretrained causal LM with TSP in a plain PyTorch loop (docs/recipes.md).

    torchrun --nproc-per-node 8 examples/recipes/pytorch_finetune.py \
        --model /models/Llama-3.1-8B --data tokens.bin --out runs/llama8b

The switch: ``tsp_core.init_mesh`` + ``tsp_transformers.load_pretrained`` (each rank reads only
its slices of the safetensors files onto the meta-device model: the full model never exists on
one rank) and ``tsp_core.shard_batch`` on every full batch. bf16 parameters on CUDA, activation
checkpointing, AdamW, a checkpoint every ``--save-every`` steps (``tsp_core.save_checkpoint``:
Hugging Face names and shapes, loads at any TSP degree), ``--resume`` from the latest one, and
TSP's figures per step (``tsp/comm_mib``, ``tsp/tokens_per_s``, peak memory) printed and
appended to ``<out>/metrics.jsonl``. Long context: ``--activation-offload`` and
``--tile-tokens N`` go to ``tsp_core.parallelize`` through ``load_pretrained``
(docs/long-context.md). Data format and flags: common.py, ``--help``.
"""

from __future__ import annotations

import os

import torch
from common import TokenRows, data_parallel_sampler, device, long_context, parse_args, report
from torch.utils.data import DataLoader

import tsp_core
from tsp_transformers import load_pretrained


def main(argv: list[str] | None = None) -> None:
    a = parse_args(__doc__, argv)
    mesh = tsp_core.init_mesh(a.tsp)                      # ("dp", "tsp"), TSP inside a node
    model = load_pretrained(a.model, mesh=mesh, dtype=a.torch_dtype,
                            **long_context(a))            # tile_tokens, activation_offload
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=a.lr, weight_decay=0.0)

    start, latest = 0, tsp_core.latest_checkpoint(a.out) if a.resume else None
    if latest:
        start = tsp_core.load_checkpoint(latest, model, optimizer)["step"]
    data = TokenRows(a, model.config.vocab_size, start=start * a.batch * mesh.dp_size)
    loader = DataLoader(data, batch_size=a.batch, sampler=data_parallel_sampler(data, mesh))

    meter = tsp_core.metrics.StepMetrics(mesh)
    meter.start(start)
    for step, batch in zip(range(start + 1, a.steps + 1), loader):
        batch = {k: v.to(device()) for k, v in batch.items()}
        model.tsp_step = step                             # named in bad-input errors
        loss = model(**tsp_core.shard_batch(batch, mesh)).loss   # the global mean
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        report(a, step, loss.item(), meter.read(step))
        if step % a.save_every == 0 or step == a.steps:
            with tsp_core.metrics.paused():
                tsp_core.save_checkpoint(os.path.join(a.out, f"step_{step}"), model, optimizer,
                                         step=step)


if __name__ == "__main__":
    with tsp_core.run_cleanly():  # barrier, destroy the groups, exit 0 (docs/cluster.md)
        main()
