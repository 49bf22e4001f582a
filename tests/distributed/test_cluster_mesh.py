"""docs/cluster.md's mapping of the mesh onto nodes, on a simulated 2-node world (the fake
process-group backend, world 16, 8 processes per node, ranks numbered node by node as torchrun
and Slurm number them): every TSP group sits inside one node, every data-parallel group crosses
nodes, and a TSP size that would span nodes is warned about."""

from __future__ import annotations

import warnings

import pytest
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

from tsp_core.distributed.mesh import init_mesh

WORLD, PER_NODE = 16, 8


def _groups(rank: int, tsp_size: int, monkeypatch) -> tuple[list[int], list[int], list[str]]:
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(PER_NODE))
    dist.init_process_group("fake", rank=rank, world_size=WORLD, store=FakeStore())
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            mesh = init_mesh(tsp_size)
        tsp = dist.get_process_group_ranks(mesh.group)
        dp = dist.get_process_group_ranks(mesh.device_mesh.get_group("dp"))
        assert mesh.rank == tsp.index(rank)
        return tsp, dp, [str(w.message) for w in caught]
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("tsp_size", [8, 4, 2])
def test_tsp_groups_inside_a_node_dp_across(tsp_size, monkeypatch):
    node = {r: r // PER_NODE for r in range(WORLD)}
    seen = set()
    for rank in range(WORLD):
        tsp, dp, warned = _groups(rank, tsp_size, monkeypatch)
        assert not warned, warned
        assert rank in tsp and len(tsp) == tsp_size and rank in dp and len(dp) == WORLD // tsp_size
        assert len({node[r] for r in tsp}) == 1, (rank, tsp)          # one node
        assert {node[r] for r in dp} == {0, 1}, (rank, dp)           # both nodes
        assert tsp == list(range(tsp[0], tsp[0] + tsp_size))          # consecutive ranks
        seen.add(tuple(tsp))
    assert len(seen) == WORLD // tsp_size                              # a partition of the world


def test_tsp_group_larger_than_a_node_is_warned(monkeypatch):
    tsp, dp, warned = _groups(3, 16, monkeypatch)
    assert tsp == list(range(16)) and dp == [3]
    assert any("tsp_size (16) does not divide the 8 processes of a node" in w
               for w in warned), warned
