"""Collectives probed with integer-valued inputs whose results are known exactly, in both
directions of every autograd-aware collective, and the byte counters' rules."""

from __future__ import annotations

import pytest
import torch

from tests.support import dist_pool
from tsp_core import comm
from tsp_core.sequence.layout import shard_sequence


def probe(tsp: int) -> dict:
    mesh = dist_pool.mesh(tsp)
    g, D, p = mesh.group, mesh.size, mesh.rank
    f64 = torch.float64
    with comm.track() as stats:
        # owner broadcast: forward copies the owner's value, backward sums onto the owner only
        for src in range(D):
            x = torch.full((3,), float(10 * p + 1), dtype=f64, requires_grad=True)
            y = comm.owner_broadcast(x, src, g)
            assert y.tolist() == [10.0 * src + 1] * 3
            (y * (p + 1)).sum().backward()
            expected = sum(range(1, D + 1)) if p == src else 0.0
            assert x.grad.tolist() == [expected] * 3, (src, x.grad)

        # sequence gather: every rank's tokens in global order; backward reduce-scatters
        seq = 4 * D
        full = torch.arange(2 * seq, dtype=f64).view(1, seq, 2)
        x = shard_sequence(full, p, D).requires_grad_()
        y = comm.gather_sequence(x, g, dim=1)
        assert torch.equal(y, full)
        (y * (p + 1)).sum().backward()
        assert x.grad.eq(sum(range(1, D + 1))).all()

        # ring shift: previous rank's value; backward returns grads to the sender
        x = torch.full((2,), float(p), dtype=f64, requires_grad=True)
        y = comm.ring_shift(x, g)
        assert y.tolist() == [float((p - 1) % D)] * 2
        (y * (p + 1)).sum().backward()
        assert x.grad.tolist() == [float((p + 1) % D + 1)] * 2

        # all-to-all of rows with uneven splits: rank p sends r+1 rows to rank r
        in_splits = [r + 1 for r in range(D)]
        out_splits = [p + 1] * D
        x = torch.cat([torch.full((r + 1, 1), float(100 * p + r)) for r in range(D)]).to(f64)
        x.requires_grad_()
        y = comm.all_to_all_rows(x, g, out_splits, in_splits)
        assert y[:, 0].tolist() == [float(100 * s + p) for s in range(D) for _ in range(p + 1)]
        y.sum().backward()
        assert x.grad.eq(1).all()

        # sum_grad: identity forward, gradient summed over the group
        x = torch.ones(2, dtype=f64, requires_grad=True)
        (comm.sum_grad(x, g) * (p + 1)).sum().backward()
        assert x.grad.tolist() == [float(sum(range(1, D + 1)))] * 2
    return {"calls": dict(stats.calls), "bytes": dict(stats.bytes)}


@pytest.mark.parametrize("tsp", [1, 2, 4])
def test_collectives_exact(pool, tsp):
    D = tsp
    for rank, res in enumerate(pool.run(probe, tsp)):  # every rank (TSP rank p = rank % D)
        if D == 1:
            assert res["calls"] == {}, f"rank {rank}: a group of one rank must issue nothing"
            continue
        p, f = rank % D, (D - 1) / D
        assert res["calls"] == {"broadcast": D, "reduce": D, "all_gather": 1, "reduce_scatter": 1,
                                "ring_pass": 2, "all_to_all": 2, "all_reduce": 1}, (rank, res)
        seq_bytes = 2 * 4 * D * 8  # the gathered [1, 4D, 2] float64 tensor
        # rank p sends r+1 rows to each rank r and receives p+1 from each: what leaves it
        # (all but its own p+1) or what reaches it from the others, the larger counts
        a2a_bytes = max(sum(range(1, D + 1)) - (p + 1), (p + 1) * (D - 1)) * 8
        assert res["bytes"] == pytest.approx({
            "broadcast": D * f * 24, "reduce": D * f * 24, "all_gather": f * seq_bytes,
            "reduce_scatter": f * seq_bytes, "ring_pass": 2 * 16, "all_to_all": 2 * a2a_bytes,
            "all_reduce": 2 * f * 16}), (rank, res)


def nested_tracking():
    mesh = dist_pool.mesh(2)
    before = comm.global_stats().calls["all_reduce"]
    with comm.track() as outer:
        with comm.track() as inner:
            comm.all_reduce(torch.ones(4), mesh.group)
        comm.all_reduce(torch.ones(4), mesh.group)
    return (inner.calls["all_reduce"], outer.calls["all_reduce"],
            comm.global_stats().calls["all_reduce"] - before)


def test_track_nests_inside_global_counters(pool):
    per_rank = pool.run(nested_tracking)
    assert per_rank == [(1, 2, 2)] * 4, per_rank  # every rank
