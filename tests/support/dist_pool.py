"""A pool of gloo worker processes that lives for the whole test session.

Starting 4 processes that import torch, transformers and tsp_core costs seconds on a 2-core machine
(about 10 s for a pool of 4), so the session starts one pool per world size and every test module
sends it test functions (tests/conftest.py's ``pools``). A function runs on every rank; any rank's
exception fails the test with that rank's traceback; a hang fails it after ``timeout`` seconds.
Either way the pool is replaced by a fresh one, since ranks may be stuck in a collective.

A shared pool must not let one test change what the next one sees, so each worker holds every
function to its own state: a function that leaves the environment, torch's default dtype, grad
mode, deterministic-algorithms flag or thread count, the default group's timeout or the registered
model policies changed fails its test, naming what it left, and the worker puts them back first.
When a new module takes the pool over, :func:`fresh_state` gives it what a new pool would: a
non-deterministic random seed per rank (a new process has one), no garbage left, and a default
group that still answers (a barrier).
"""

from __future__ import annotations

import gc
import os
import pickle
import queue
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch.multiprocessing as mp

# set by the libraries themselves when imported or first used: not a test's doing, and kept
LIBRARY_ENV = {"TORCHINDUCTOR_CACHE_DIR",  # torch's compile cache, on first use
               "PYTORCH_NVML_BASED_CUDA_CHECK"}  # lightning and deepspeed, when imported


def _state() -> dict[str, Any]:
    """What a test function might change in a worker and must put back."""
    import torch
    import torch.distributed as dist

    state: dict[str, Any] = {
        "environment": {k: v for k, v in os.environ.items() if k not in LIBRARY_ENV},
        "default dtype": torch.get_default_dtype(),
        "grad mode": torch.is_grad_enabled(),
        "deterministic algorithms": torch.are_deterministic_algorithms_enabled(),
        "threads": torch.get_num_threads(),
        "default group timeout": dist.group.WORLD._get_backend(torch.device("cpu"))
        .options._timeout,
    }
    policies = sys.modules.get("tsp_core.models.policies.base")
    if policies is not None:
        state["registered policies"] = dict(policies._POLICIES)
    return state


def _restore(state: dict[str, Any]) -> None:
    import torch
    import torch.distributed as dist

    kept = {k: v for k, v in os.environ.items() if k in LIBRARY_ENV}
    os.environ.clear()
    os.environ.update(state["environment"], **kept)
    torch.set_default_dtype(state["default dtype"])
    torch.set_grad_enabled(state["grad mode"])
    torch.use_deterministic_algorithms(state["deterministic algorithms"])
    torch.set_num_threads(state["threads"])
    dist.distributed_c10d._set_pg_timeout(state["default group timeout"], dist.group.WORLD)
    if "registered policies" in state:
        registry = sys.modules["tsp_core.models.policies.base"]._POLICIES
        registry.clear()
        registry.update(state["registered policies"])


def _left_behind(before: dict[str, Any], after: dict[str, Any]) -> list[str]:
    """Each change from ``before`` to ``after``, in words (the environment by variable)."""
    found = []
    env_before, env_after = before["environment"], after["environment"]
    for key in sorted(set(env_before) | set(env_after)):
        if env_before.get(key) != env_after.get(key):
            found.append(f"environment variable {key}: {env_before.get(key)!r} -> "
                         f"{env_after.get(key)!r}")
    for key in (k for k in before if k != "environment"):
        if key in after and before[key] != after[key]:
            if key == "registered policies":
                added, removed = after[key].keys() - before[key], before[key].keys() - after[key]
                found.append(f"registered policies: added {sorted(added)}, removed "
                             f"{sorted(removed)}, or one replaced")
            else:
                found.append(f"{key}: {before[key]} -> {after[key]}")
    return found


def _call(fn: Callable[..., Any], args: tuple, kwargs: dict) -> tuple[bool, Any]:
    """``fn(*args, **kwargs)``: (True, its result), or (False, what went wrong), with the worker's
    state as it was before the call either way."""
    if fn is fresh_state:
        return True, fn(*args, **kwargs)
    before = _state()
    try:
        value = fn(*args, **kwargs)
    except BaseException:  # noqa: BLE001 - reported to the parent
        _restore(before)
        return False, traceback.format_exc()
    left = _left_behind(before, _state())  # what the call imported first is not compared
    if left:
        _restore(before)
        return False, (f"{fn.__name__} left state behind in the shared pool (restore it, e.g. in "
                       f"a finally): " + "; ".join(left))
    return True, value


def fresh_state() -> None:
    """A module's start on a pool that earlier modules used: a new non-deterministic random seed
    (as a new process has), no garbage left, and a default group that still answers."""
    import torch
    import torch.distributed as dist

    torch.seed()
    gc.collect()
    dist.barrier()


def _worker(rank: int, world_size: int, init_file: str, tasks, results) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world_size)
    try:
        while True:
            task = tasks.get()
            if task is None:
                break
            ok, value = _call(*task)
            results.put((rank, ok, value))
    finally:
        dist.destroy_process_group()


class DistPool:
    def __init__(self, world_size: int, timeout: float = 300.0) -> None:
        self.world_size, self.timeout = world_size, timeout
        self._start()

    def _start(self) -> None:
        world_size = self.world_size
        ctx = mp.get_context("spawn")
        fd, self._init_file = tempfile.mkstemp(prefix="tsp_pool_")
        os.close(fd)
        os.unlink(self._init_file)
        self._tasks = [ctx.Queue() for _ in range(world_size)]
        self._results = ctx.Queue()
        self._procs = [ctx.Process(target=_worker, args=(r, world_size, self._init_file,
                                                         self._tasks[r], self._results),
                                   daemon=True) for r in range(world_size)]
        for p in self._procs:
            p.start()

    def run(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> list[Any]:
        """Run ``fn(*args, **kwargs)`` on every rank; return the per-rank results."""
        return self.run_within(self.timeout, fn, args, kwargs)

    def run_within(self, timeout: float, fn: Callable[..., Any], args: tuple = (),
                   kwargs: dict | None = None) -> list[Any]:
        """:meth:`run`, failing when a rank has not answered within ``timeout`` seconds."""
        task = (fn, args, kwargs or {})
        pickle.dumps(task)  # fail here, not silently in the queue's feeder thread
        for q in self._tasks:
            q.put(task)
        out: dict[int, Any] = {}
        errors: dict[int, str] = {}
        for _ in range(self.world_size):
            try:
                rank, ok, value = self._results.get(timeout=timeout)
            except queue.Empty:
                self.close(force=True)
                self._start()
                missing = self.world_size - len(out) - len(errors)
                raise AssertionError(f"{fn.__name__}: no answer from {missing} rank(s) within "
                                     f"{timeout}s (hang?)") from None
            (out if ok else errors)[rank] = value
        if errors:
            self.close(force=True)
            self._start()  # ranks may be stuck in a collective: later tests get fresh ones
            details = "\n".join(f"--- rank {r} ---\n{tb}" for r, tb in sorted(errors.items()))
            raise AssertionError(f"{fn.__name__} failed on rank(s) {sorted(errors)}:\n{details}")
        return [out[r] for r in range(self.world_size)]

    def close(self, force: bool = False) -> None:
        """End the workers: ask them and wait, or with ``force`` kill them at once."""
        if not force:
            for q in self._tasks:
                q.put(None)
            for p in self._procs:
                p.join(timeout=30)
        for p in self._procs:
            if p.is_alive():
                p.kill()
        if os.path.exists(self._init_file):
            os.unlink(self._init_file)


def close_all(pools, wait: float = 10.0) -> None:
    """Close ``pools`` at the session's end: every worker is asked at once and given ``wait``
    seconds in all to leave its process group, then killed (nothing runs after them)."""
    pools = list(pools)
    for pool in pools:
        for q in pool._tasks:
            q.put(None)
    deadline = time.monotonic() + wait
    for pool in pools:
        for p in pool._procs:
            p.join(timeout=max(0.0, deadline - time.monotonic()))
        pool.close(force=True)


class Bounded:
    """A pool whose functions must answer within their own ``timeout`` (a module that expects
    quick answers fails sooner on a hang), sharing the pool's processes."""

    def __init__(self, pool: DistPool, timeout: float) -> None:
        self.pool, self.timeout, self.world_size = pool, timeout, pool.world_size

    def run(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> list[Any]:
        return self.pool.run_within(self.timeout, fn, args, kwargs)


_MESHES: dict[tuple, Any] = {}


def mesh(tsp_size: int, layout: str = "zigzag", dp_shard: int | None = None):
    """The ("dp", "tsp") mesh with this TSP size over the pool, or with ``dp_shard`` the
    ("dp_replicate", "dp_shard", "tsp") one (built once per worker, kept by every module that
    uses the pool)."""
    from tsp_core import init_mesh

    key = (tsp_size, layout, dp_shard)
    if key not in _MESHES:
        _MESHES[key] = init_mesh(tsp_size, layout=layout, dp_shard=dp_shard)
    return _MESHES[key]
