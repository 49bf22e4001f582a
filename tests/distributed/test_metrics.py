"""``tsp_core.metrics`` on 2 processes, every rank: a window's figures per step from comm's
counters exactly, paused work left out, time blocked in a collective counted as waiting, tokens
from shard_batch, the peak resident set reset per window, and ``group_max``'s one all-reduce in
no window. (What the adapters log is checked against comm's counters in their own tests.)"""

from __future__ import annotations

import time

import torch

from tests.support import dist_pool
from tsp_core import comm, metrics, shard_batch

MIB = 2.0 ** 20
SLEEP = 0.3


def rss_mib() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024


def windows() -> dict:
    mesh = dist_pool.mesh(2)
    g, rank = mesh.group, mesh.rank
    ids = torch.arange(16).view(2, 8)
    meter = metrics.StepMetrics(mesh)
    torch.distributed.barrier(g)  # both ranks start together (not through comm: not counted)
    meter.start(0)
    start_rss = rss_mib()
    # step 1: rank 1 arrives late at an all-reduce of 4 floats; a 64 MiB buffer comes and goes
    shard_batch({"input_ids": ids, "labels": ids}, mesh)
    if rank == 1:
        time.sleep(SLEEP)
    comm.all_reduce(torch.ones(4), g)
    big = torch.ones(16 * 2 ** 20)
    big.add_(1)
    del big
    # not a step: evaluation, checkpointing
    with metrics.paused():
        comm.all_reduce(torch.ones(1000), g)
        comm.all_reduce(torch.ones(1000), g)
        shard_batch({"input_ids": ids}, mesh)
    # step 2: an all-gather of 4 floats per rank
    comm.all_gather(torch.empty(8), torch.ones(4), g)
    before = comm.global_stats().calls["all_reduce"]
    first = meter.read(2, group_max=True)
    max_calls = comm.global_stats().calls["all_reduce"] - before
    second = meter.read(3)            # one more "step" with nothing in it
    empty = meter.read(3)             # no step since the last read
    return {"rank": rank, "first": first, "second": second, "empty": empty,
            "max_calls": max_calls, "start_rss": start_rss}


def test_window_figures_every_rank(pools):
    results = pools.of(2).run(windows)
    assert [r["rank"] for r in results] == [0, 1]
    for r in results:
        first, second, what = r["first"], r["second"], f"rank {r['rank']}"
        assert first["tsp/steps"] == 2 and second["tsp/steps"] == 1, what
        # ring rule: all-reduce 2 x 16 bytes x 1/2, all-gather 32 bytes x 1/2; paused ones absent
        assert first["tsp/collectives"] == 1.0, (what, first)
        assert first["tsp/collectives/all_reduce"] == first["tsp/collectives/all_gather"] == 0.5
        assert first["tsp/comm_mib"] == (16 + 16) / MIB / 2, (what, first)
        assert first["tsp/comm_mib/all_reduce"] == first["tsp/comm_mib/all_gather"] == 8 / MIB
        # tokens: the one-process batch (2 x 8), this rank's half of it; the paused one absent
        assert first["tsp/tokens"] == 8.0, (what, first)
        step_s = first["tsp/step_s"]
        assert abs(first["tsp/tokens_per_s_local"] * step_s * 2 - 8) < 1e-9, (what, first)
        assert abs(first["tsp/wait_frac"] * step_s - first["tsp/wait_s"]) < 1e-12, what
        # group_max: one all-reduce, in neither window; the same largest values on every rank
        assert r["max_calls"] == 1 and second["tsp/collectives"] == 0.0, (what, second)
        assert second["tsp/comm_mib"] == 0.0 and second["tsp/tokens"] == 0.0, (what, second)
        assert r["empty"] == {}, what
        # peak resident set: the 64 MiB buffer in the first window, reset for the second
        assert first["tsp/peak_rss_mib"] >= r["start_rss"] + 60, (what, first, r["start_rss"])
        assert second["tsp/peak_rss_mib"] < first["tsp/peak_rss_mib"] - 50, (what, second)
    # rank 0 waited for rank 1 (its sleep, less the few ms rank 0 spent before the all-reduce);
    # rank 1 hardly waited
    waits = [r["first"]["tsp/wait_s"] * 2 for r in results]
    assert waits[0] >= 0.8 * SLEEP and waits[1] < 0.5 * SLEEP, waits
    for key in ("tsp/step_s", "tsp/wait_frac", "tsp/comm_mib", "tsp/peak_rss_mib"):
        largest = max(r["first"][key] for r in results)
        maxima = [r["first"][key.replace("tsp/", "tsp/max/", 1)] for r in results]
        assert maxima == [largest] * 2, key
