"""Memory meters for part (c): the CUDA allocator's counters, a live-storage counter for CPU, and
per-module phase figures read the way ``tsp simulate`` records them."""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class CudaMeter:
    """The caching allocator's counters (what torch.cuda.max_memory_allocated reports)."""

    def current(self) -> int:
        return torch.cuda.memory_allocated()

    def peak(self) -> int:
        return torch.cuda.max_memory_allocated()

    def reset_peak(self) -> None:
        torch.cuda.reset_peak_memory_stats()


class LiveBytes(TorchDispatchMode):
    """Bytes of the tensor storages allocated by ops while active and still alive: a CPU stand-in
    for the CUDA allocator's counters. An op output that shares an input's storage (a view, an
    in-place or out= op) allocated nothing; so a weight shard or an input made before the meter
    started is never counted when an op first shows it (counting those inflated the phase figures
    by the shards' bytes). Each storage counts once and is released when its last reference goes.
    Kernel-internal scratch buffers are invisible here, as they are to ``tsp simulate``."""

    def __init__(self) -> None:
        super().__init__()
        self.now = self.max = 0
        self._live: set[int] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from torch.distributed._tools.common_utils import get_untyped_storages

        out = func(*args, **(kwargs or {}))
        # an output sharing an input's storage (views, in-place and out= ops) allocated nothing;
        # every other output storage is new
        inputs = {st._cdata for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)
                  for st in get_untyped_storages(t)}
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                for st in get_untyped_storages(t):
                    if st._cdata not in inputs:
                        self._track(st)
        return out

    def _track(self, st) -> None:
        key = st._cdata
        if key in self._live:
            return
        n = st.nbytes()
        self._live.add(key)
        self.now += n
        self.max = max(self.max, self.now)
        weakref.finalize(st, self._free, key, n)

    def _free(self, key: int, n: int) -> None:
        if key in self._live:
            self._live.discard(key)
            self.now -= n

    def current(self) -> int:
        return self.now

    def peak(self) -> int:
        return self.max

    def reset_peak(self) -> None:
        self.max = self.now


class PhaseMemory:
    """What each module adds from its start to its own peak, forward and backward, the way
    ``tsp simulate`` records its ``phases`` (MemTracker's pre-forward to peak-forward and
    pre-backward to peak-backward snapshots): module hooks and tensor gradient hooks reset the
    meter's peak at a module's start and read it at its end."""

    def __init__(self, modules: dict[str, torch.nn.Module]) -> None:
        self.meter: Any = None
        self.added: dict[str, int] = {}
        self.overall = 0
        self._base: dict[str, int] = {}
        for role, m in modules.items():
            m.register_forward_pre_hook(self._pre_forward(role), with_kwargs=True)
            m.register_forward_hook(self._post_forward(role), with_kwargs=True)

    def start(self, meter) -> None:
        self.meter, self.added, self._base = meter, {}, {}
        meter.reset_peak()
        self.overall = meter.peak()

    def stop(self) -> None:
        self.overall = max(self.overall, self.meter.peak())
        self.meter = None

    def _begin(self, key: str) -> None:
        if self.meter is not None:
            self.overall = max(self.overall, self.meter.peak())
            self.meter.reset_peak()
            self._base[key] = self.meter.current()

    def _end(self, key: str) -> None:
        if self.meter is not None and key in self._base:
            self.added[key] = self.meter.peak() - self._base.pop(key)

    def _pre_forward(self, role: str) -> Callable:
        def hook(_module, args, kwargs):
            self._begin(f"{role}_forward")
            x = args[0] if args else kwargs.get("hidden_states")
            if self.meter is not None and x is not None and x.requires_grad:
                x.register_hook(lambda g: self._end(f"{role}_backward"))
        return hook

    def _post_forward(self, role: str) -> Callable:
        def hook(_module, _args, _kwargs, output):
            self._end(f"{role}_forward")
            y = output[0] if isinstance(output, tuple) else output
            if self.meter is not None and y.requires_grad:
                y.register_hook(lambda g: self._begin(f"{role}_backward"))
        return hook
