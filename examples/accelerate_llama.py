"""An ordinary Accelerate training script; TSP is the one changed line (``TSPAccelerator``), plus
an optional one that logs TSP's figures.

    accelerate launch --multi_gpu --num_processes 2 examples/accelerate_llama.py   (TSP, 2
    processes) python examples/accelerate_llama.py --plain                                  (the
    original script)

(On a CPU-only machine ``accelerate launch --cpu`` starts one process; ``--multi_gpu`` starts
torchrun workers, which run on CPU with gloo.)

The TSP degree is every process unless ``TSPAccelerator(tsp_size=...)`` or
``accelerate launch --parallelism_config_tp_size D`` says otherwise. The script trains 4 steps,
saves the state, trains 2 more, reloads the state and trains those 2 again: the two runs of
steps 5-6 must be identical. ``--out DIR`` writes the losses and final weights (rank 0). With
TSP, ``accelerator.tsp_metrics()`` (MiB sent, waiting, tokens/s, peak memory per step since its
previous call) goes to ``accelerator.log`` every step, here into a ``JSONLinesTracker``
(``DIR/metrics.jsonl``; ``log_with="tensorboard"`` or ``"wandb"`` take it the same way), and
rank 0 prints the last row.
"""

from __future__ import annotations

import argparse
import json
import os

import torch
from accelerate import Accelerator
from torch.utils.data import DataLoader
from transformers import DataCollatorWithFlattening, LlamaConfig, LlamaForCausalLM

import tsp_core
from tsp_accelerate import JSONLinesTracker, TSPAccelerator


def documents(count: int, vocab: int = 128) -> list[dict]:
    """Documents of 1..63 tokens, for --packed (DataCollatorWithFlattening packs them in rows)."""
    gen = torch.Generator().manual_seed(2)
    lengths = torch.randint(1, 64, (count,), generator=gen).tolist()
    return [{"input_ids": torch.randint(0, vocab, (n,), generator=gen).tolist()} for n in lengths]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--plain", action="store_true", help="use accelerate.Accelerator (no TSP)")
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--dtype", default="float32", choices=["float32", "float64"])
    ap.add_argument("--packed", action="store_true",
                    help="several documents per row (DataCollatorWithFlattening)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()

    log_with = [JSONLinesTracker(os.path.join(a.out or ".", "metrics.jsonl"))]
    accelerator = Accelerator(log_with=log_with) if a.plain else TSPAccelerator(log_with=log_with)
    accelerator.init_trackers("accelerate_llama")

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128,
                                         num_hidden_layers=2, num_attention_heads=4,
                                         num_key_value_heads=2, max_position_embeddings=a.seq))
    model.to(getattr(torch, a.dtype))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.randint(0, 128, (32, a.seq), generator=torch.Generator().manual_seed(1))
    data = [{"input_ids": row, "labels": row} for row in ids]
    loader = DataLoader(data, batch_size=2)
    if a.packed:
        loader = DataLoader(documents(32), batch_size=2, collate_fn=DataCollatorWithFlattening())
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)

    batches = iter(loader)
    figures: list[dict] = []

    def train(steps: int, batch_list: list | None = None) -> list[float]:
        losses = []
        for i in range(steps):
            batch = batch_list[i] if batch_list else next(batches)
            loss = model(**batch).loss          # the same call as without TSP
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
            figures.append({} if a.plain else accelerator.tsp_metrics())   # optional, TSP only
            accelerator.log({"loss": losses[-1], **figures[-1]}, step=len(figures))
        return losses

    losses = train(4)
    state_dir = os.path.join(a.out or ".", "state")
    accelerator.save_state(state_dir)
    later = [next(batches), next(batches)]
    first = train(2, later)
    accelerator.load_state(state_dir)
    again = train(2, later)
    if first != again:
        raise SystemExit(f"save_state/load_state did not round-trip: {first} vs {again}")
    losses += first

    if a.plain:
        weights = {k: v.detach() for k, v in accelerator.unwrap_model(model).state_dict().items()}
    else:
        weights = tsp_core.full_state_dict(accelerator.unwrap_model(model), rank0_only=True)
    if accelerator.is_main_process:
        print(f"processes {accelerator.num_processes}, TSP degree "
              f"{getattr(getattr(accelerator, 'tsp_mesh', None), 'size', 1)}")
        print("losses", " ".join(f"{x:.6f}" for x in losses))
        if not a.plain:
            print(tsp_core.metrics.summary(figures[-1]))
        if a.out:
            torch.save(weights, os.path.join(a.out, "weights.pt"))
            with open(os.path.join(a.out, "losses.json"), "w") as f:
                json.dump(losses, f)
    accelerator.end_training()


if __name__ == "__main__":
    with tsp_core.run_cleanly():  # barrier, destroy the groups, exit 0 (docs/cluster.md)
        main()
