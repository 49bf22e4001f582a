"""The collective guard: with TSP_DEBUG_COLLECTIVES=1, ranks that issue different collectives (or
run different schedules) all raise an error naming every rank's op instead of hanging; by default a
collective that times out is named in the error (kind, call number, group, bytes)."""

from __future__ import annotations

import os
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from tests.support import dist_pool
from tsp_core import TSPAttention, TSPGatedMLP, comm, guard
from tsp_core.layers.attention import AttentionShape


@pytest.fixture(scope="module")
def pool(pools):
    return pools.of(2, timeout=90)


def _debug(on: bool) -> None:
    if on:
        os.environ[guard.ENV] = "1"
    else:
        os.environ.pop(guard.ENV, None)
    guard.reset()


def mismatched_ops() -> str:
    group = dist.new_group([0, 1], timeout=timedelta(seconds=30))
    _debug(True)
    try:
        t = torch.ones(8)
        with pytest.raises(guard.CollectiveMismatch) as info:
            if dist.get_rank() == 0:
                comm.broadcast(t, 0, group)
            else:
                comm.all_reduce(t, group)
        return str(info.value)
    finally:
        _debug(False)


def test_mismatched_collectives_name_both_ops_on_every_rank(pool):
    msgs = pool.run(mismatched_ops)
    assert msgs[0] == msgs[1]
    assert ("collective mismatch on a group of 2 ranks (global ranks [0, 1]): global rank(s) [0] "
            "issued broadcast (call #1, 16 bytes of traffic); global rank(s) [1] issued all_reduce "
            "(call #1, 32 bytes of traffic)") in msgs[0], msgs[0]


def different_schedules(debug: bool) -> dict:
    # rank 0 runs attention, rank 1 the MLP; in debug mode both fail at the first collective. The
    # same schedule on both ranks runs unchanged in debug mode (same output, same counted calls).
    mesh = dist_pool.mesh(2)
    attn = TSPAttention(mesh, AttentionShape(32, 4, 2, 8), dtype=torch.float64)
    mlp = TSPGatedMLP(mesh, 32, 64, dtype=torch.float64)
    x = torch.randn(1, 8, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    pos = torch.arange(8)
    _debug(debug)
    try:
        with comm.track() as stats:
            same = attn(x, pos).detach()
        out = dict(same=same, calls=dict(stats.calls))
        if debug:
            with pytest.raises(guard.CollectiveMismatch) as info:
                attn(x, pos) if dist.get_rank() == 0 else mlp(x)
            out["error"] = str(info.value)
        return out
    finally:
        _debug(False)


def test_different_schedules_fail_in_debug_mode_and_debug_mode_changes_nothing(pool):
    plain, debug = pool.run(different_schedules, False), pool.run(different_schedules, True)
    for p, d in zip(plain, debug):
        assert torch.equal(p["same"], d["same"])
        assert p["calls"] == d["calls"] == {"broadcast": 2, "all_gather": 2}, \
            (p["calls"], d["calls"])
    err = debug[0]["error"]
    assert debug[1]["error"] == err
    assert "[0] issued broadcast (call #5" in err and "[1] issued ring_pass (call #5" in err, err


def timeout_named() -> list[str]:
    group = dist.new_group([0, 1], timeout=timedelta(seconds=2))
    guard.reset()
    msgs = []
    if dist.get_rank() == 0:  # rank 1 never joins: a dead or stuck peer
        t = torch.ones(4)
        with pytest.raises(guard.CollectiveError) as info:
            comm.all_reduce(t, group)
        msgs.append(str(info.value))
        with pytest.raises(guard.CollectiveError) as info:
            comm.all_gather(torch.empty(8), t, group, async_op=True).wait()
        msgs.append(str(info.value))
    return msgs


def test_timeout_names_the_collective(pool):
    msgs = pool.run(timeout_named)[0]
    assert msgs[0].startswith("TSP collective all_reduce (call #1 on this group of 2 ranks, global "
                              "ranks [0, 1]; 16 bytes of traffic) failed: "), msgs[0]
    assert msgs[1].startswith("TSP collective all_gather (call #2 on this group of 2 ranks, global "
                              "ranks [0, 1]; 16 bytes of traffic) failed: "), msgs[1]
    assert "TSP_DEBUG_COLLECTIVES=1" in msgs[0]
