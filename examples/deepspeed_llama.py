"""DeepSpeed + TSP: ``tsp_deepspeed.initialize`` in place of ``deepspeed.initialize``.

    DS_ACCELERATOR=cpu torchrun --standalone --nproc_per_node 4 examples/deepspeed_llama.py --tsp 2

runs TSP degree 2 x data parallel 2 with ZeRO stage 2 on CPU; on GPUs drop DS_ACCELERATOR.
``--stage 3`` partitions the parameters over the data-parallel ranks too (ZeRO-3):

    DS_ACCELERATOR=cpu torchrun --standalone --nproc_per_node 4 \
        examples/deepspeed_llama.py --tsp 2 --stage 3

Batches reach the engine as ``engine(**tsp_core.shard_batch(batch, mesh))``.
At the end rank 0 prints TSP's figures per step (``tsp_core.metrics.StepMetrics``: MiB sent,
waiting, tokens/s, peak memory; DeepSpeed's own ZeRO collectives are not TSP's and not counted).
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
from transformers import LlamaConfig, LlamaForCausalLM

import tsp_core
import tsp_deepspeed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tsp", type=int, default=int(os.environ.get("WORLD_SIZE", "1")))
    ap.add_argument("--stage", type=int, default=2)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--seq", type=int, default=512)
    a = ap.parse_args()
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=4096, hidden_size=256, intermediate_size=704,
                                         num_hidden_layers=4, num_attention_heads=8,
                                         num_key_value_heads=4))
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_clipping": 1.0,
              "optimizer": {"type": "AdamW", "params": {"lr": 3e-4}},
              "zero_optimization": {"stage": a.stage},
              "tsp": {"size": a.tsp}}          # or tsp_deepspeed.initialize(..., tsp_size=...)
    engine, optimizer, _, _ = tsp_deepspeed.initialize(model=model, config=config,
                                                       model_parameters=model.parameters())
    mesh = tsp_core.get_mesh(engine.module)
    dp_rank = mesh.device_mesh.get_coordinate()[0]
    gen = torch.Generator().manual_seed(1 + dp_rank)       # each data-parallel replica its data
    if dist.get_rank() == 0:  # the stage DeepSpeed runs, as the engine reports it
        print(f"TSP degree {mesh.size} x data parallel {mesh.dp_size}, ZeRO stage "
              f"{engine.zero_optimization_stage()}", flush=True)
    meter = tsp_core.metrics.StepMetrics(mesh)
    meter.start()
    for step in range(a.steps):
        ids = torch.randint(0, 4096, (2, a.seq), generator=gen)
        loss = engine(**tsp_core.shard_batch({"input_ids": ids, "labels": ids}, mesh)).loss
        engine.backward(loss)
        engine.step()
        if dist.get_rank() == 0:
            print(f"step {step} loss {loss.item():.4f}")
    figures = meter.read(a.steps)
    if dist.get_rank() == 0:
        print(tsp_core.metrics.summary(figures))


if __name__ == "__main__":
    with tsp_core.run_cleanly():  # barrier, destroy the groups, exit 0 (docs/cluster.md)
        main()
