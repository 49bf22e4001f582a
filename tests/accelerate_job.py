"""An ordinary Accelerate training script with gradient clipping, for TSPAccelerator's plain and
DeepSpeed paths.

    TSP_SIZE=2 accelerate launch --multi_gpu --num_processes 4 accelerate_job.py ...  (dp 2 x tsp 2)
    accelerate launch --use_deepspeed --zero_stage 2 --num_processes 2 accelerate_job.py ...
    python accelerate_job.py --plain ...       (plain Accelerator, one process, no DeepSpeed)

Each process takes ``--batch`` rows per step from a sequential loader that Accelerate splits over
the data-parallel ranks (replica i takes batches i, i + dp, ...; every rank of a TSP group the
same). ``accelerator.clip_grad_norm_`` clips and returns the norm it clipped by (under DeepSpeed
clipping is DeepSpeed's, at the 1.0 Accelerate fills in, and the norm DeepSpeed's).
``--kv-heads 1,2`` trains one model per entry, each prepared by the one accelerator.
``--round-trip``: save the state after step 2, train steps 3-4, load it and train them again: the
repeats must be identical (exit 1 otherwise). ``--case "NAME ARGS..."`` (repeatable): one more
run in the same processes with its own accelerator, results in --out/NAME.

Every rank writes its losses and norms per model (``rank<R>.json``); rank 0 the final full
weights and (not under DeepSpeed, whose gradients live in its buffers) the first step's full
gradients before clipping (``weights_kv<N>.pt``, ``grads0_kv<N>.pt``).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex

import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType
from torch.utils.data import DataLoader
from tsp_accelerate import JSONLinesTracker, TSPAccelerator

import tsp_core

try:  # run as a script from tests/, or imported by the test module
    from hf_models import build, full_grads
    from metrics_check import StepCounters
except ImportError:
    from .hf_models import build, full_grads
    from .metrics_check import StepCounters


def rows(n: int) -> torch.Tensor:
    return torch.randint(0, 96, (n, 24), generator=torch.Generator().manual_seed(1))


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser()
    ap.add_argument("--plain", action="store_true")
    ap.add_argument("--tsp-size", type=int, default=None, help="else TSP_SIZE or every process")
    ap.add_argument("--dtype", default="float32", choices=["float32", "float64"])
    ap.add_argument("--kv-heads", default="2", help="comma-separated: one model each")
    ap.add_argument("--family", default="llama", help="a tests/hf_models family")
    ap.add_argument("--optimizer", choices=["adamw", "sgd"], default="sgd")
    ap.add_argument("--lr", type=float, default=0.5)
    ap.add_argument("--clip", type=float, default=1.0)
    ap.add_argument("--batch", type=int, default=2, help="rows per process and step")
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--round-trip", action="store_true")
    ap.add_argument("--metrics", action="store_true",
                    help="log tsp_metrics() every 2 steps to a JSONLinesTracker (out/tracker.jsonl)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--case", action="append", default=[])
    return ap


def train(a) -> Accelerator:
    if a.plain:
        accelerator = Accelerator(cpu=True)
    else:
        trackers = [JSONLinesTracker(os.path.join(a.out, "tracker.jsonl"))] if a.metrics else None
        accelerator = TSPAccelerator(tsp_size=a.tsp_size, log_with=trackers)
        if a.metrics:
            accelerator.init_trackers("job")
    deepspeed = accelerator.distributed_type == DistributedType.DEEPSPEED
    kv_heads = [int(k) for k in a.kv_heads.split(",")]
    models = [build(a.family, getattr(torch, a.dtype), kv_heads=k) for k in kv_heads]
    opt_cls = torch.optim.SGD if a.optimizer == "sgd" else torch.optim.AdamW
    optimizers = [opt_cls(m.parameters(), lr=a.lr) for m in models]
    loader = DataLoader([{"input_ids": r, "labels": r} for r in rows(a.rows)], batch_size=a.batch)
    # one prepare call per model: Accelerate's tp path maps optimizer parameters by parameter
    # name over everything in one call, so two models of the same names there would collide;
    # DeepSpeed wants the loader in the model's call (it reads the micro-batch size from it)
    first = accelerator.prepare(models[0], optimizers[0], loader)
    pairs = [first[:2]] + [accelerator.prepare(m, o) for m, o in zip(models[1:], optimizers[1:])]
    models, optimizers, loader = [m for m, _ in pairs], [o for _, o in pairs], first[2]
    batches = list(loader)
    losses = {k: [] for k in kv_heads}
    norms = {k: [] for k in kv_heads}
    grads0: dict = {}
    counters, metric_rows = StepCounters(), []

    def step(batch) -> None:
        counters.begin()
        for k, model, optimizer in zip(kv_heads, models, optimizers):
            loss = model(**batch).loss
            accelerator.backward(loss)
            if k not in grads0 and not deepspeed:
                grads0[k] = full_grads(accelerator.unwrap_model(model))
            norms[k].append(float(accelerator.clip_grad_norm_(model.parameters(), a.clip)))
            optimizer.step()
            optimizer.zero_grad()
            losses[k].append(loss.item())
        counters.end()
        if a.metrics and len(counters.steps) % 2 == 0:
            metric_rows.append(accelerator.tsp_metrics())
            accelerator.log(metric_rows[-1], step=len(counters.steps))

    if a.round_trip:
        for b in batches[:2]:
            step(b)
        state = os.path.join(a.out, "state")
        accelerator.save_state(state)
        for b in batches[2:4]:
            step(b)
        first = {k: v[2:] for k, v in losses.items()}
        accelerator.load_state(state)
        for b in batches[2:4]:
            step(b)
        again = {k: v[4:] for k, v in losses.items()}
        if again != first:
            raise SystemExit(f"save_state/load_state did not round-trip: {first} vs {again}")
        losses = {k: v[:4] for k, v in losses.items()}
        norms = {k: v[:4] for k, v in norms.items()}
    else:
        for b in batches[:a.steps]:
            step(b)

    rank = accelerator.process_index
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, f"rank{rank}.json"), "w") as f:
        json.dump({"losses": losses, "norms": norms, "metric_rows": metric_rows,
                   "step_counts": counters.steps}, f)
    for k, model in zip(kv_heads, models):
        unwrapped = accelerator.unwrap_model(model)
        if a.plain:
            weights = {n: v.detach() for n, v in unwrapped.state_dict().items()}
        else:
            weights = tsp_core.full_state_dict(unwrapped, rank0_only=True)
        if rank == 0:
            torch.save(weights, os.path.join(a.out, f"weights_kv{k}.pt"))
            if k in grads0:
                torch.save(grads0[k], os.path.join(a.out, f"grads0_kv{k}.pt"))
    if accelerator.is_main_process:
        print(f"processes {accelerator.num_processes}, distributed {accelerator.distributed_type}, "
              f"TSP degree {getattr(getattr(accelerator, 'tsp_mesh', None), 'size', 1)}")
    return accelerator


def main() -> None:
    ap = parser()
    a = ap.parse_args()
    if not a.case:
        return train(a).end_training()
    from accelerate.state import AcceleratorState

    accelerator = None
    for spec in a.case:
        name, *extra = shlex.split(spec)
        args = ap.parse_args([*extra, "--out", os.path.join(a.out, name)])
        if accelerator is not None and args.tsp_size != accelerator.tsp_mesh.size:
            try:  # the process-wide state would keep the first TSP size: refused, not ignored
                TSPAccelerator(tsp_size=args.tsp_size)
                raise AssertionError(f"a second TSPAccelerator(tsp_size={args.tsp_size}) was "
                                     f"accepted beside one of size {accelerator.tsp_mesh.size}")
            except ValueError as e:
                assert "cannot change it" in str(e), e
        # an Accelerator keeps its parallelism config in a process-wide state: a new TSP size
        # needs a new one (the process group stays; end_training would destroy it)
        AcceleratorState._reset_state()
        accelerator = train(args)
    accelerator.end_training()


if __name__ == "__main__":
    main()
