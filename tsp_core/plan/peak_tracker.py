"""``MemTracker`` with its per-op peak update indexed by module name (:class:`IndexedMemTracker`),
the same numbers in time independent of the model's depth.

After every op PyTorch's ``MemTracker._update_peak_stats`` walks *every* module it has seen so far
and updates those whose name is in ``ModTracker.parents`` (the modules running now). A
whole-model simulation has hundreds of modules (about nine per decoder layer) and millions of ops,
so the walk costs O(modules) per op, O(layers^2) per step: most of a 32-layer simulation's time.
Here the walk visits only the running modules, through an index from a module's name to its
stats, rebuilt whenever a module's stats may have been added or renamed.
"""

from __future__ import annotations

from copy import deepcopy
from typing import Any

from torch.distributed._tools.mem_tracker import _TOTAL_KEY, MemTracker, _ModMemStats, _State


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
