"""Bad input fails on every rank before any collective, with a message naming the numbers; the
mesh puts TSP groups on consecutive ranks and wraps framework-made meshes; ``init_mesh(pp_size=)``
puts the pipeline dim outermost; ``init_mesh(timeout=)`` bounds every group's collectives."""

from __future__ import annotations

import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from tests.support import dist_pool
from tsp_core import TSPAttention, TSPGatedMLP, TSPMesh, comm, guard, init_mesh
from tsp_core.distributed.mesh import check_mesh_shape
from tsp_core.layers.attention import AttentionShape


def _expect(fn, pattern: str) -> str:
    with comm.track() as stats:
        with pytest.raises(ValueError, match=pattern) as info:
            fn()
    assert not stats.calls, f"collectives issued before the error: {dict(stats.calls)}"
    return str(info.value)


def bad_inputs() -> list[str]:
    m = dist_pool.mesh(4)
    f64 = torch.float64
    msgs = [
        _expect(lambda: TSPAttention(m, AttentionShape(48, 6, 6, 8)),
                r"tsp_size \(4\) must divide num_attention_heads \(6\)"),
        _expect(lambda: TSPAttention(m, AttentionShape(64, 8, 3, 8)),
                r"num_key_value_heads \(3\) must divide num_attention_heads \(8\)"),
        _expect(lambda: TSPAttention(m, AttentionShape(96, 12, 6, 8)),
                r"num_key_value_heads \(6\) and tsp_size \(4\): one must divide the other"),
        _expect(lambda: TSPGatedMLP(m, 16, 30),
                r"tsp_size \(4\) must divide intermediate_size \(30\)"),
    ]
    attn = TSPAttention(m, AttentionShape(32, 4, 2, 8), dtype=f64)
    mlp = TSPGatedMLP(m, 32, 64, dtype=f64)
    pos = torch.arange(4)
    wrong = {k: torch.zeros(shape[0], 33) for k, shape in attn.full_shapes.items()}
    msgs.append(_expect(lambda: attn.load_full(wrong),
                        r"q_proj.weight has shape \(32, 33\), expected \(32, 32\) "
                        r"\(hidden_size=32, heads=4/2"))
    msgs.append(_expect(lambda: attn(torch.zeros(1, 4, 31, dtype=f64), pos),
                        r"input of shape \(1, 4, 31\) does not match the layer: expected "
                        r"\[batch, local_seq, hidden_size=32\]"))
    msgs.append(_expect(lambda: mlp(torch.zeros(1, 4, 31, dtype=f64)), r"hidden_size=32"))
    msgs.append(_expect(lambda: attn(torch.zeros(1, 3, 32, dtype=f64), torch.arange(3)),
                        r"local sequence length \(3\) must be even"))
    msgs.append(_expect(lambda: attn(torch.zeros(1, 4, 32, dtype=f64), torch.arange(5)),
                        r"position_ids of shape \(1, 5\) do not match"))
    msgs.append(_expect(lambda: attn(torch.zeros(1, 4, 32, dtype=torch.float32), pos),
                        r"input dtype \(torch.float32\) differs from q_proj.weight "
                        r"\(torch.float64\)"))
    with torch.no_grad():  # one shard of another dtype
        attn.o_proj.weight = torch.nn.Parameter(attn.o_proj.weight.to(torch.float32))  # noqa
    msgs.append(_expect(lambda: attn(torch.zeros(1, 4, 32, dtype=f64), pos),
                        r"differs from o_proj.weight \(torch.float32\)"))
    dist.barrier()
    return msgs


def test_bad_input_fails_everywhere_before_any_collective(pool):
    per_rank = pool.run(bad_inputs)
    assert all(msgs == per_rank[0] for msgs in per_rank)


def test_mesh_shape_errors():
    with pytest.raises(ValueError, match=r"tsp_size \(3\) must divide the world size \(4\)"):
        check_mesh_shape(4, 3, None)
    with pytest.raises(ValueError, match=r"dp_size \(3\) \* tsp_size \(2\) = 6 does not match "
                                         r"the world size \(4\)"):
        check_mesh_shape(4, 2, 3)
    assert check_mesh_shape(8, 4, None) == 2


def mesh_facts() -> dict:
    with pytest.raises(ValueError, match=r"tsp_size \(3\) must divide the world size \(4\)"):
        init_mesh(3)
    m = init_mesh(2)
    ranks = dist.get_process_group_ranks(m.group)
    tp = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_shard", "tp"))
    wrapped = TSPMesh.from_device_mesh(tp, "tp")
    with pytest.raises(ValueError, match=r"mesh has no dim named 'tensor_parallel'"):
        TSPMesh.from_device_mesh(tp, "tensor_parallel")
    return dict(ranks=ranks, rank=m.rank, size=m.size, dp=m.dp_size, next=m.next_rank(),
                prev=m.prev_rank(), wrapped=(wrapped.size, wrapped.rank, wrapped.other_dims))


def test_mesh_groups_are_consecutive(pool):
    facts = pool.run(mesh_facts)
    for r, f in enumerate(facts):
        assert f["ranks"] == [r - r % 2, r - r % 2 + 1]
        assert (f["rank"], f["size"], f["dp"]) == (r % 2, 2, 2)
        assert (f["next"], f["prev"]) == ((r + 1) % 2, (r + 1) % 2)
        assert f["wrapped"] == (2, r % 2, ("dp_shard",))


def pp_mesh_facts() -> dict:
    with pytest.raises(ValueError, match=r"pp_size \(3\) must divide the world size \(4\)"):
        init_mesh(1, pp_size=3)
    with pytest.raises(ValueError, match=r"pp_size \(0\) must be a whole number"):
        init_mesh(1, pp_size=0)
    m = init_mesh(2, pp_size=2)
    stage = m.stage_mesh()
    f = init_mesh(1, pp_size=2, dp_shard=2)
    with pytest.raises(ValueError, match=r"the mesh has a pipeline dim 'pp' of size 2; cut the "
                                         r"model into stages with tsp_core.pipeline"):
        import tsp_core
        from tests.support.hf_models import build
        tsp_core.parallelize(build("llama", torch.float32), m)
    return dict(dims=m.device_mesh.mesh_dim_names, pp=dist.get_process_group_ranks(m.pp_group),
                tsp=dist.get_process_group_ranks(m.group), sizes=(m.pp_size, m.dp_size, m.size),
                pp_rank=m.pp_rank, other=m.other_dims, stage=stage.device_mesh.mesh_dim_names,
                stage_tsp=dist.get_process_group_ranks(stage.group),
                stage_sizes=(stage.pp_size, stage.dp_size, stage.size),
                fsdp=(f.device_mesh.mesh_dim_names, f.pp_size, f.dp_size, f.fsdp_size,
                      f.stage_mesh().device_mesh.mesh_dim_names, f.stage_mesh().shard_dim,
                      dist.get_process_group_ranks(f.device_mesh.get_group("dp_shard"))))


def test_pipeline_dim_is_outermost(pool):
    for r, f in enumerate(pool.run(pp_mesh_facts)):
        assert f["dims"] == ("pp", "dp", "tsp") and f["sizes"] == (2, 1, 2), f
        assert f["pp"] == [r % 2, r % 2 + 2] and f["pp_rank"] == r // 2, f
        assert f["tsp"] == f["stage_tsp"] == [r - r % 2, r - r % 2 + 1], f
        assert f["other"] == ("dp",) and f["stage"] == ("dp", "tsp"), f
        assert f["stage_sizes"] == (1, 1, 2), f
        assert f["fsdp"] == (("pp", "dp_replicate", "dp_shard", "tsp"), 2, 2, 2,
                             ("dp_replicate", "dp_shard", "tsp"), "dp_shard",
                             [r - r % 2, r - r % 2 + 1]), f


def group_timeout(group: dist.ProcessGroup) -> float:
    """The seconds a gloo group's collectives wait for the other ranks."""
    return group._get_backend(torch.device("cpu")).options._timeout.total_seconds()


def mesh_timeout(seconds: float) -> dict:
    # dp 2 x tsp 2: rank 0 starts a collective on its TSP group {0, 1} that rank 1 never joins,
    # then one on its data-parallel group {0, 2} that rank 2 never joins; each raises after
    # `seconds` (torch's default is 30 minutes)
    world = dist.group.WORLD
    before = group_timeout(world)
    mesh = init_mesh(2, timeout=seconds)
    groups = {"tsp": mesh.group, "dp": mesh.device_mesh.get_group("dp")}
    out = {"timeouts": {name: group_timeout(g) for name, g in {"world": world, **groups}.items()}}
    dist.distributed_c10d._set_pg_timeout(timedelta(seconds=before), world)  # the pool's, again
    if dist.get_rank() == 0 and set(out["timeouts"].values()) == {seconds}:  # else it would hang
        for name, group in groups.items():
            guard.reset()
            start = time.monotonic()
            with pytest.raises(guard.CollectiveError) as info:
                comm.all_reduce(torch.ones(4), group)
            out[name] = (time.monotonic() - start, str(info.value))
    dist.barrier()
    return out


def test_init_mesh_timeout_bounds_every_group(pool):
    seconds = 2.0
    per_rank = pool.run(mesh_timeout, seconds)
    for facts in per_rank:  # the default group too: init_mesh sets it when it exists already
        assert facts["timeouts"] == {"world": seconds, "tsp": seconds, "dp": seconds}, facts
    for name, ranks in (("tsp", "[0, 1]"), ("dp", "[0, 2]")):
        waited, message = per_rank[0][name]
        assert seconds <= waited < seconds + 20, (name, waited)
        assert message.startswith(f"TSP collective all_reduce (call #1 on this group of 2 ranks, "
                                  f"global ranks {ranks}"), message
        assert f"Timed out waiting {seconds * 1000:.0f}ms" in message, message


def test_a_bad_timeout_fails_before_any_process_group():
    def groups() -> int:
        return len(dist.distributed_c10d._world.pg_map) if dist.is_initialized() else 0

    before = groups()
    for bad in (0, -5, 0.0, timedelta(0), timedelta(seconds=-1), float("nan"), float("inf")):
        with pytest.raises(ValueError, match=r"timeout \(.*\) must be a positive duration: "
                                             r"how long a collective may wait for the other"):
            init_mesh(1, timeout=bad)
    with pytest.raises(TypeError, match=r"timeout must be a datetime.timedelta or a number of "
                                        r"seconds, got str '600'"):
        init_mesh(1, timeout="600")
    assert groups() == before
