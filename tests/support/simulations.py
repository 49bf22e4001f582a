"""Simulations (``tsp simulate``'s records) run in worker processes that the whole session shares.

A spawned worker pays about 4 s of CPU to start and import torch, transformers and tsp_core, and
the planner tests ran a pool of two per test; tests/conftest.py's ``simulations`` fixture starts
one pool of two for the session instead. Reusing a worker is what
``tsp_core.plan.simulate.simulate_many`` already does between records: each record
builds its own fake process group, fake tensor mode and tracker. A function that changes a
worker's modules for good (as tests/plan/test_simulate_tracker.py swaps the tracker) must keep a
pool of its own.
"""

from __future__ import annotations

import os
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context

WORKERS = 2  # one per core of the 2-core machine the suite is sized for


def start() -> ProcessPoolExecutor:
    """The pool of :data:`WORKERS` spawned processes (no fork: the parent holds threads)."""
    return ProcessPoolExecutor(max_workers=WORKERS, mp_context=get_context("spawn"))


def simulate_one(request):
    """The record of one ``tsp_core.plan.simulate.SimulationRequest`` in one thread, as
    ``simulate_many`` runs it."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch

    from tsp_core.plan.simulate import simulate

    torch.set_num_threads(1)
    return simulate(request)


def simulate_all(pool: ProcessPoolExecutor, requests: list) -> list:
    """The records of ``requests``, in their order, run in ``pool``."""
    return list(pool.map(simulate_one, requests))
