"""A pool of gloo worker processes that lives for one test module.

Starting 4 processes that import torch costs seconds on a 2-core machine, so each module starts
its pool once and sends it test functions. A function runs on every rank; any rank's exception
fails the test with that rank's traceback; a hang fails it after ``timeout`` seconds.
"""

from __future__ import annotations

import os
import pickle
import queue
import tempfile
import traceback
from typing import Any, Callable

import torch.multiprocessing as mp


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
            fn, args, kwargs = task
            try:
                results.put((rank, True, fn(*args, **kwargs)))
            except BaseException:  # noqa: BLE001 - reported to the parent
                results.put((rank, False, traceback.format_exc()))
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
        pickle.dumps((fn, args, kwargs))  # fail here, not silently in the queue's feeder thread
        for q in self._tasks:
            q.put((fn, args, kwargs))
        out: dict[int, Any] = {}
        errors: dict[int, str] = {}
        for _ in range(self.world_size):
            try:
                rank, ok, value = self._results.get(timeout=self.timeout)
            except queue.Empty:
                self.close(force=True)
                self._start()
                missing = self.world_size - len(out) - len(errors)
                raise AssertionError(f"{fn.__name__}: no answer from {missing} rank(s) within "
                                     f"{self.timeout}s (hang?)") from None
            (out if ok else errors)[rank] = value
        if errors:
            self.close(force=True)
            self._start()  # ranks may be stuck in a collective: later tests get fresh ones
            details = "\n".join(f"--- rank {r} ---\n{tb}" for r, tb in sorted(errors.items()))
            raise AssertionError(f"{fn.__name__} failed on rank(s) {sorted(errors)}:\n{details}")
        return [out[r] for r in range(self.world_size)]

    def close(self, force: bool = False) -> None:
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


_MESHES: dict[tuple, Any] = {}


def mesh(tsp_size: int, layout: str = "zigzag", dp_shard: int | None = None):
    """The ("dp", "tsp") mesh with this TSP size over the pool, or with ``dp_shard`` the
    ("dp_replicate", "dp_shard", "tsp") one (built once per worker)."""
    from tsp_core import init_mesh

    key = (tsp_size, layout, dp_shard)
    if key not in _MESHES:
        _MESHES[key] = init_mesh(tsp_size, layout=layout, dp_shard=dp_shard)
    return _MESHES[key]
