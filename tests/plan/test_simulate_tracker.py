"""``tsp simulate``'s tracker (``tsp_core.plan.peak_tracker.IndexedMemTracker``) gives the records
PyTorch's ``MemTracker`` gives, number for number: peak, host bytes, breakdown and every phase
(each phase is a module's own peak snapshot, which is what the index changes how it reaches)."""

from __future__ import annotations

import os
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context

# two layers (the index must keep each layer's modules apart), recompute with activation offload
# (modules re-entered in backward; 1024 local tokens: layer inputs of 128 KiB, over offload's
# MIN_BYTES, so host bytes) and an untiled baseline beside TSP
REQUESTS = [dict(layout="tsp", tp=4, cp=1, seq=4096, model="tiny", recompute="full",
                 activation_offload=True),
            dict(layout="tp+cp", tp=2, cp=2, seq=512, model="tiny", recompute="selective")]


def records(stock: bool) -> list[dict]:
    """The records of :data:`REQUESTS` without their run time, with PyTorch's tracker if
    ``stock``, run in a worker process of its own process group."""
    os.environ["OMP_NUM_THREADS"] = "1"
    import torch
    from torch.distributed._tools.mem_tracker import MemTracker

    from tsp_core.plan import peak_tracker
    from tsp_core.plan.simulate import SimulationRequest, record_dict, simulate

    torch.set_num_threads(1)
    if stock:  # simulate imports the tracker by this name when it runs
        peak_tracker.IndexedMemTracker = MemTracker
    out = []
    for r in REQUESTS:
        rec = record_dict(simulate(SimulationRequest(**r)))
        rec.pop("seconds")
        out.append(rec)
    return out


def test_indexed_tracker_gives_the_stock_records():
    with ProcessPoolExecutor(max_workers=2, mp_context=get_context("spawn")) as pool:
        indexed, stock = pool.map(records, (False, True))
    assert indexed[0]["host_bytes"] > 0, indexed[0]
    for mine, theirs in zip(indexed, stock):
        assert len(mine["phases"]) == 6 and mine["layers"] == 2, mine
        assert mine == theirs
