"""``MemTracker`` with its per-op peak update indexed by module name (:class:`IndexedMemTracker`),
the same numbers in time independent of the model's depth.

After every op PyTorch's ``MemTracker._update_peak_stats`` walks *every* module it has seen so far
and updates those whose name is in ``ModTracker.parents`` (the modules running now). A
whole-model simulation has hundreds of modules (about nine per decoder layer) and millions of ops,
so the walk costs O(modules) per op, O(layers^2) per step: most of a 32-layer simulation's time.
Here the walk visits only the running modules, through an index from a module's name to its
stats, rebuilt whenever a module's stats may have been added or renamed; and an op's single
tensor output is tracked without a pytree walk.
"""

from __future__ import annotations

from copy import deepcopy
from functools import partial
from typing import Any

import torch
from torch._guards import active_fake_mode
from torch.distributed._tools.mem_tracker import (
    _TOTAL_KEY,
    MemTracker,
    _MemRefType,
    _ModMemStats,
    _ModState,
    _State,
)
from torch.distributed.tensor import DTensor
from torch.utils._pytree import tree_map_only


class IndexedMemTracker(MemTracker):
    """``MemTracker`` whose peak update visits only the running modules' stats.

    Why every number is unchanged: ``_update_peak_stats`` (below, line for line PyTorch's body but
    for the loop it runs over) updates a module's stats only when ``mod_stats.mod_fqn`` is in
    ``self._mod_tracker.parents``, and each update touches that module's own ``local_peak`` and
    ``snapshots`` alone (no state is shared between modules, so their order is immaterial). The
    index maps every ``mod_fqn`` to all the stats carrying it (a name shared by two modules keeps
    both), so visiting ``index[name] for name in parents`` visits exactly the stats PyTorch's loop
    updates. ``memory_tracking`` gains an entry, or an entry's ``mod_fqn`` changes, only in
    ``_pre_fw_hook`` and is emptied only by ``reset_mod_stats``: both drop the index, which is
    rebuilt from ``memory_tracking`` on the next op. The process-wide peak (``_peak_mem``) is
    updated by PyTorch's own lines, unchanged. ``tests/plan/test_simulate_tracker.py`` compares
    whole records against the stock tracker.
    """

    def __init__(self) -> None:
        super().__init__()
        self._by_fqn: dict[str, list[_ModMemStats]] | None = None

    def _pre_fw_hook(self, module: Any, inputs: Any) -> None:
        super()._pre_fw_hook(module, inputs)
        self._by_fqn = None   # a module's stats may have been added or renamed

    def reset_mod_stats(self) -> None:
        super().reset_mod_stats()
        self._by_fqn = None

    def _index(self) -> dict[str, list[_ModMemStats]]:
        if self._by_fqn is None:
            index: dict[str, list[_ModMemStats]] = {}
            for mod_stats in self.memory_tracking.values():
                index.setdefault(mod_stats.mod_fqn, []).append(mod_stats)
            self._by_fqn = index
        return self._by_fqn

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        """PyTorch's ``MemTracker.__torch_dispatch__`` line for line, but for a bare tensor
        result, which is tracked directly: ``tree_map_only(torch.Tensor, f, t)`` is ``f(t)`` for
        a tensor ``t`` (a pytree leaf), so the same storages are tracked in the same order."""
        if any(t == DTensor for t in types):
            return NotImplemented
        if (func is torch.ops._c10d_functional.wait_tensor.default
                and active_fake_mode()):
            res = args[0]   # PyTorch's: its meta impl returns a new tensor, eager does not
        else:
            res = func(*args, **kwargs or {})
        if active_fake_mode() is self._fake_mode_on_entry:
            if self._in_opt:
                reftype = _MemRefType.OPT
            elif self._mod_tracker.is_bw and not self._in_ac:
                reftype = _MemRefType.TEMP
            else:
                reftype = _MemRefType.ACT
            if isinstance(res, torch.Tensor):
                self._track(reftype, res)
            else:
                tree_map_only(torch.Tensor, partial(self._track, reftype), res)
            peak_state = _ModState.PEAK_BW if self._mod_tracker.is_bw else _ModState.PEAK_FW
            self._update_peak_stats(peak_state)
        return res

    def _update_peak_stats(self, peak_state: _State) -> None:
        curr_snap = self._curr_mem_snap
        index = self._index()
        for name in self._mod_tracker.parents:
            for mod_stats in index.get(name, ()):
                if peak_state in mod_stats.snapshots:
                    for dev, dev_snap in curr_snap.items():
                        if mod_stats.local_peak.get(dev, 0) < dev_snap[_TOTAL_KEY]:
                            mod_stats.local_peak[dev] = dev_snap[_TOTAL_KEY]
                            mod_stats.snapshots[peak_state][-1][dev] = deepcopy(dev_snap)

        for dev, dev_snap in curr_snap.items():
            if self._peak_mem.get(dev, 0) < dev_snap[_TOTAL_KEY]:
                self._peak_mem[dev] = dev_snap[_TOTAL_KEY]
                self._peak_mem_snap[dev] = deepcopy(dev_snap)
