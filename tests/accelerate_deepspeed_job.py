"""An ordinary Accelerate script with gradient clipping, for the DeepSpeed path of TSPAccelerator.

    accelerate launch --use_deepspeed --zero_stage 2 --num_processes 2 accelerate_deepspeed_job.py
    python accelerate_deepspeed_job.py --plain          (plain Accelerator, one process, no DeepSpeed)
    TSP_SIZE=2 accelerate launch ... --num_processes 4 accelerate_deepspeed_job.py   (dp 2 x tsp 2;
        its reference is --plain --batch 4: the data-parallel ranks take consecutive batches of 2)

With DeepSpeed, ``accelerator.clip_grad_norm_`` leaves clipping to DeepSpeed, at the 1.0 that
Accelerate fills in; without, it clips at 1.0 itself. The script trains 4 steps, saves the state
after step 2, and after step 4 loads it and trains steps 3-4 again: the repeats must be identical
(exit 1 otherwise). ``--out DIR``: losses, gradient norms before clipping (DeepSpeed's under
DeepSpeed) and final full weights (rank 0).
"""

from __future__ import annotations

import argparse
import json
import os

import torch
from accelerate import Accelerator
from torch.utils.data import DataLoader
from transformers import LlamaConfig, LlamaForCausalLM
from tsp_accelerate import TSPAccelerator

import tsp_core


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--plain", action="store_true")
    ap.add_argument("--batch", type=int, default=2, help="rows per process and step")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    accelerator = Accelerator(cpu=True) if a.plain else TSPAccelerator()

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128,
                                         num_hidden_layers=2, num_attention_heads=4,
                                         num_key_value_heads=2, max_position_embeddings=64))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.randint(0, 128, (16, 32), generator=torch.Generator().manual_seed(1))
    loader = DataLoader([{"input_ids": r, "labels": r} for r in ids], batch_size=a.batch)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    batches = list(loader)

    norms = []

    def step(batch) -> float:
        loss = model(**batch).loss
        accelerator.backward(loss)
        norms.append(float(accelerator.clip_grad_norm_(model.parameters(), 1.0)))
        optimizer.step()
        optimizer.zero_grad()
        return loss.item()

    losses = [step(b) for b in batches[:2]]
    state = os.path.join(a.out, "state")
    accelerator.save_state(state)
    losses += [step(b) for b in batches[2:4]]
    accelerator.load_state(state)
    again = [step(b) for b in batches[2:4]]
    if again != losses[2:]:
        raise SystemExit(f"save_state/load_state did not round-trip: {losses[2:]} vs {again}")

    unwrapped = accelerator.unwrap_model(model)
    if a.plain:
        weights = {k: v.detach() for k, v in unwrapped.state_dict().items()}
    else:
        weights = tsp_core.full_state_dict(unwrapped, rank0_only=True)
    if accelerator.is_main_process:
        print(f"processes {accelerator.num_processes}, distributed {accelerator.distributed_type}, "
              f"TSP degree {getattr(getattr(accelerator, 'tsp_mesh', None), 'size', 1)}")
        torch.save(weights, os.path.join(a.out, "weights.pt"))
        with open(os.path.join(a.out, "losses.json"), "w") as f:
            json.dump({"losses": losses, "grad_norms": norms[:4]}, f)
    accelerator.end_training()


if __name__ == "__main__":
    main()
