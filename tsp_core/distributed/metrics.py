"""What TSP does while it trains, per optimizer step and per rank, for the loggers users have.

A :class:`StepMetrics` covers a window of optimizer steps (from :meth:`~StepMetrics.start`, or
the previous :meth:`~StepMetrics.read`, to the next read) and reports, averaged per step, a flat
dict with stable names (docs/monitoring.md says what each means and what a healthy run shows):

- ``tsp/steps``: optimizer steps in the window; ``tsp/step_s``: wall seconds per step.
- ``tsp/comm_mib``, ``tsp/collectives``: MiB this rank sent (``tsp_core.comm``'s ring rule) and
  collectives it issued, per step; ``tsp/comm_mib/<kind>``, ``tsp/collectives/<kind>`` by kind.
- ``tsp/wait_s``: seconds per step the host was blocked in a collective (``comm``'s
  ``wait_seconds``); ``tsp/wait_frac``: that over ``tsp/step_s``.
- ``tsp/tokens``: tokens per step over every data-parallel replica (the one-process batch
  ``shard_batch`` received, times the data-parallel size), ``tsp/tokens_per_s`` the same per
  second; ``tsp/tokens_per_s_local``: the tokens this rank itself holds (its 1/D share, TSP's
  padding included) per second.
- Memory: ``tsp/peak_mem_mib``, the CUDA allocator's peak in the window (``max_memory_allocated``);
  on CPU ``tsp/peak_rss_mib``, the process's peak resident set in the window (Linux resets its
  high-water mark, ``/proc/self/clear_refs``), or where that cannot be reset
  ``tsp/peak_rss_mib_since_start``.

Everything comes from counters this process keeps anyway: no collective, except with
``group_max=True``, which adds ``tsp/max/...`` (the largest value over every rank of the job) with
one all-reduce of five numbers per read, left out of every window's counts. :func:`paused`
excludes evaluation and checkpointing from every live window (the adapters use it), so a window
describes training steps only.
"""

from __future__ import annotations

import contextlib
import os
import time
import weakref
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from . import comm

MIB = 2.0 ** 20
_TOKENS = {"group": 0, "local": 0}
_LIVE: weakref.WeakSet[StepMetrics] = weakref.WeakSet()


def count_tokens(group: int, local: int) -> None:
    """Record a batch: ``group`` tokens in the one-process batch of this rank's TSP group,
    ``local`` of them held by this rank (``shard_batch`` calls it)."""
    _TOKENS["group"] += group
    _TOKENS["local"] += local


@dataclass
class _Totals:
    """This process's cumulative counters at one moment (or the sum of differences of them)."""

    seconds: float = 0.0
    wait_seconds: float = 0.0
    tokens: int = 0
    local_tokens: int = 0
    calls: Counter = field(default_factory=Counter)
    bytes: Counter = field(default_factory=Counter)

    @classmethod
    def now(cls) -> _Totals:
        stats = comm.global_stats()
        return cls(time.perf_counter(), stats.wait_seconds, _TOKENS["group"], _TOKENS["local"],
                   Counter(stats.calls), Counter(stats.bytes))

    def add_since(self, start: _Totals, end: _Totals) -> None:
        self.seconds += end.seconds - start.seconds
        self.wait_seconds += end.wait_seconds - start.wait_seconds
        self.tokens += end.tokens - start.tokens
        self.local_tokens += end.local_tokens - start.local_tokens
        self.calls.update(end.calls)
        self.calls.subtract(start.calls)
        self.bytes.update(end.bytes)
        self.bytes.subtract(start.bytes)


class _Peak:
    """Peak memory of the process between :meth:`reset` and :meth:`mib`: the CUDA allocator's on
    a CUDA device, else the resident set's high-water mark (Linux lets it be reset)."""

    def __init__(self, device_type: str) -> None:
        self.cuda = device_type == "cuda" and torch.cuda.is_available()
        self.key = "tsp/peak_mem_mib" if self.cuda else "tsp/peak_rss_mib"

    def reset(self) -> None:
        if self.cuda:
            torch.cuda.reset_peak_memory_stats()
            return
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # "reset the peak resident set size" (proc(5))
        except OSError:
            self.key = "tsp/peak_rss_mib_since_start"

    def mib(self) -> float:
        if self.cuda:
            return torch.cuda.max_memory_allocated() / MIB
        try:
            with open("/proc/self/status") as f:
                for line in f:
                    if line.startswith("VmHWM:"):
                        return int(line.split()[1]) * 1024 / MIB
        except OSError:
            pass
        import resource  # the lifetime peak (KiB on Linux, bytes on macOS)

        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        self.key = "tsp/peak_rss_mib_since_start"
        return peak / (MIB if os.uname().sysname == "Darwin" else 1024.0)


class StepMetrics:
    """Per-step figures of this rank over a window of optimizer steps (module docstring).

    ``step`` arguments are the caller's count of optimizer steps so far (Lightning's and the
    Trainer's ``global_step``), so micro-batches of gradient accumulation are one step."""

    # with group_max: the largest over every rank of these and of the peak memory
    MAX_KEYS = ("tsp/step_s", "tsp/wait_frac", "tsp/comm_mib", "tsp/tokens_per_s_local")

    def __init__(self, mesh=None, device_type: str | None = None) -> None:
        self.dp = mesh.dp_size if mesh is not None else 1
        self._peak = _Peak(device_type or (mesh.device_type if mesh is not None else "cpu"))
        self._acc = _Totals()
        self._mark: _Totals | None = None
        self._step: int | None = None
        self._peak_mib = 0.0
        self._pauses = 0

    @property
    def started(self) -> bool:
        return self._step is not None

    @property
    def paused(self) -> bool:
        return self._pauses > 0

    def start(self, step: int = 0) -> None:
        """Open a window at optimizer step ``step``."""
        self._acc, self._step, self._peak_mib, self._pauses = _Totals(), step, 0.0, 0
        self._peak.reset()
        self._mark = _Totals.now()
        _LIVE.add(self)

    def pause(self) -> None:
        """Leave what follows out of the window until :meth:`resume` (nested pauses count)."""
        self._pauses += 1
        if self._pauses == 1 and self._mark is not None:
            self._acc.add_since(self._mark, _Totals.now())
            self._peak_mib = max(self._peak_mib, self._peak.mib())
            self._mark = None

    def resume(self) -> None:
        self._pauses = max(0, self._pauses - 1)
        if self._pauses == 0 and self._step is not None and self._mark is None:
            self._peak.reset()
            self._mark = _Totals.now()

    def read(self, step: int, group_max: bool = False) -> dict[str, float]:
        """The window's figures per optimizer step, then a new window from ``step``; empty when
        no step was taken since the window opened (or it never did)."""
        if self._step is None or step <= self._step:
            return {}
        acc = self._acc
        if self._mark is not None:
            acc.add_since(self._mark, _Totals.now())
        peak = max(self._peak_mib, self._peak.mib())
        steps = step - self._step
        out = self._figures(acc, steps, peak)
        if group_max:
            out.update(self._group_max(out))
        paused = self._pauses
        self.start(step)  # the all-reduce above is in neither window
        self._pauses = paused
        if paused:
            self._mark = None
        return out

    def _figures(self, acc: _Totals, steps: int, peak_mib: float) -> dict[str, float]:
        step_s = acc.seconds / steps
        out = {"tsp/steps": float(steps), "tsp/step_s": step_s,
               "tsp/comm_mib": sum(acc.bytes.values()) / MIB / steps,
               "tsp/collectives": sum(acc.calls.values()) / steps,
               "tsp/wait_s": acc.wait_seconds / steps,
               "tsp/wait_frac": acc.wait_seconds / acc.seconds if acc.seconds > 0 else 0.0,
               "tsp/tokens": acc.tokens * self.dp / steps,
               "tsp/tokens_per_s": acc.tokens * self.dp / acc.seconds if acc.seconds > 0 else 0.0,
               "tsp/tokens_per_s_local": acc.local_tokens / acc.seconds if acc.seconds > 0 else 0.0,
               self._peak.key: peak_mib}
        for kind in sorted(acc.calls):
            if acc.calls[kind]:
                out[f"tsp/comm_mib/{kind}"] = acc.bytes[kind] / MIB / steps
                out[f"tsp/collectives/{kind}"] = acc.calls[kind] / steps
        return out

    def _group_max(self, out: dict[str, float]) -> dict[str, float]:
        """The largest value of a few figures over every rank of the job: one all-reduce."""
        if not dist.is_available() or not dist.is_initialized():
            return {}
        keys = [*self.MAX_KEYS, self._peak.key]
        t = torch.tensor([out[k] for k in keys], dtype=torch.float64)
        if dist.get_backend() == "nccl":
            t = t.cuda()
        comm.all_reduce(t, dist.group.WORLD, op=dist.ReduceOp.MAX)
        return {k.replace("tsp/", "tsp/max/", 1): float(v) for k, v in zip(keys, t.tolist())}


@contextlib.contextmanager
def paused() -> Iterator[None]:
    """Leave the block (evaluation, checkpointing) out of every live :class:`StepMetrics`."""
    meters = [m for m in _LIVE if m.started]
    for m in meters:
        m.pause()
    try:
        yield
    finally:
        for m in meters:
            m.resume()


def summary(figures: dict[str, float]) -> str:
    """One line for a run's end: throughput, communication, waiting, memory."""
    if not figures:
        return "tsp metrics: no optimizer step measured"
    mem = next((k for k in figures if "peak_" in k and "/max/" not in k), None)
    parts = [f"{figures['tsp/steps']:.0f} steps", f"{figures['tsp/step_s']:.3f} s/step",
             f"{figures['tsp/tokens_per_s']:.0f} tokens/s",
             f"{figures['tsp/comm_mib']:.2f} MiB sent/step in "
             f"{figures['tsp/collectives']:.0f} collectives",
             f"waiting {100 * figures['tsp/wait_frac']:.1f}%"]
    if mem:
        parts.append(f"{mem.removeprefix('tsp/')} {figures[mem]:.1f}")
    return "tsp metrics (this rank): " + ", ".join(parts)
