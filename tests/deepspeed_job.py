"""A DeepSpeed training job with tsp_deepspeed on a tiny Llama (run with torchrun,
DS_ACCELERATOR=cpu). Each data-parallel replica takes its rows of the global batch. Rank 0 writes
the losses, the final full weights and this rank's optimizer-state bytes to --out."""

from __future__ import annotations

import argparse
import json
import os

import torch
import torch.distributed as dist
import tsp_deepspeed

import tsp_core

try:  # run as a script from tests/, or imported by the test module
    from hf_models import build
except ImportError:
    from .hf_models import build


def batches(steps: int, rows: int):
    gen = torch.Generator().manual_seed(7)
    return [torch.randint(0, 96, (rows, 24), generator=gen) for _ in range(steps)]


def config(stage: int) -> dict:
    return {"train_micro_batch_size_per_gpu": 2, "gradient_clipping": 1.0,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01}},
            "zero_optimization": {"stage": stage}}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--stage", type=int, default=1)
    ap.add_argument("--tsp", type=int, default=2)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--save-at", type=int, default=0)
    ap.add_argument("--resume", default="")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    model = build("llama", torch.float32)
    cfg = {**config(a.stage), "tsp": {"size": a.tsp}}   # the config section works like tsp_size
    engine, *_ = tsp_deepspeed.initialize(model=model, config=cfg,
                                          model_parameters=model.parameters())
    mesh = tsp_core.get_mesh(engine.module)
    dp, dp_rank = mesh.dp_size, mesh.device_mesh.get_coordinate()[0]
    data = batches(a.steps, 2 * dp)
    first = 0
    if a.resume:
        engine.load_checkpoint(a.resume)
        first = a.save_at
    losses = []
    for step in range(first, a.steps):
        ids = data[step][2 * dp_rank: 2 * dp_rank + 2]
        loss = engine(**tsp_core.shard_batch({"input_ids": ids, "labels": ids}, mesh)).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        if a.save_at and step + 1 == a.save_at and not a.resume:
            engine.save_checkpoint(os.path.join(a.out, "ckpt"))
    state = engine.optimizer.optimizer.state if hasattr(engine.optimizer, "optimizer") \
        else engine.optimizer.state
    opt_bytes = sum(t.numel() * t.element_size() for s in state.values() for t in s.values()
                    if torch.is_tensor(t) and t.dim() > 0)
    weights = tsp_core.full_state_dict(engine.module, rank0_only=True)
    if dist.get_rank() == 0:
        os.makedirs(a.out, exist_ok=True)
        torch.save(weights, os.path.join(a.out, "weights.pt"))
        with open(os.path.join(a.out, "result.json"), "w") as f:
            json.dump({"losses": losses, "optimizer_bytes": opt_bytes}, f)


if __name__ == "__main__":
    main()
