"""A small torchrun job (one all-reduce) run through tests/support/exit_cleanly.py, where one rank
can fail while the run ends: ``TSP_TEST_TEARDOWN="MODE:RANK"`` with MODE one of
raise    the script raises after its work is done,
barrier  the barrier in tsp_core.shutdown raises,
destroy  destroy_process_group in tsp_core.shutdown raises,
abort    the process aborts after its work, as gloo's finaliser race does (SIGABRT),
skip     the process leaves with os._exit(0) before tsp_core.shutdown (no exit line)."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

dist.init_process_group("gloo")
rank = dist.get_rank()
total = torch.tensor([rank + 1.0])
dist.all_reduce(total)
print(f"rank {rank}: sum {total.item():.0f}", flush=True)

mode, _, who = os.environ.get("TSP_TEST_TEARDOWN", "").partition(":")
if who and int(who) == rank:
    if mode == "raise":
        raise RuntimeError(f"rank {rank} fails after its work")
    if mode in ("barrier", "destroy"):
        name = "barrier" if mode == "barrier" else "destroy_process_group"

        def fail(*args, **kwargs):
            raise RuntimeError(f"{name} fails on rank {rank}")

        setattr(dist, name, fail)
    elif mode == "abort":
        os.abort()
    elif mode == "skip":
        os._exit(0)
