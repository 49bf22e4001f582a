"""Bad input through the public API (shard_batch + the model) and the adapters' batch paths
(shard_full_batches: Fabric, Accelerate, the Trainer; tsp_lightning's shard: the Lightning
Trainer) fails on every rank of the TSP group with a message naming the problem and the fix; errors
in the full batch come before any collective, errors only one rank can see after one agreed
all-gather; afterwards the group still trains in step."""

from __future__ import annotations

import copy

import pytest
import torch

import tsp_core
from tsp_core import comm
from tsp_core.parallelize import shard_full_batches

from . import dist_pool, hf_models


@pytest.fixture(scope="module")
def pool():
    p = dist_pool.DistPool(2, timeout=120)
    yield p
    p.close()


def matrix() -> list[str]:
    import tsp_lightning

    mesh = dist_pool.mesh(2)
    rank = mesh.rank
    model = tsp_core.parallelize(hf_models.build("llama", torch.float32), mesh)
    model.tsp_step = 7
    ids = torch.randint(0, 96, (2, 16), generator=torch.Generator().manual_seed(0))
    msgs = []

    def expect(pattern: str, fn, calls: dict) -> None:
        with comm.track() as stats, pytest.raises(ValueError, match=pattern) as info:
            fn()
        assert dict(stats.calls) == calls, (pattern, dict(stats.calls))
        msgs.append(str(info.value))

    def step(batch: dict):
        return model(**tsp_core.shard_batch(batch, mesh)).loss

    none, agreed = {}, {"all_gather": 1}
    # wrong shapes, too short, labels that do not match the inputs (full batch: no collective)
    expect(r"input_ids must have shape \[batch, seq\], got \(16,\)",
           lambda: step({"input_ids": ids[0]}), none)
    expect(r"labels has shape \(2, 15\) but input_ids has \(2, 16\)",
           lambda: step({"input_ids": ids, "labels": ids[:, :15]}), none)
    expect(r"sequence length \(3\) is shorter than 2\*tsp_size \(4\)",
           lambda: tsp_lightning.common.shard({"input_ids": ids[:, :3]}, mesh), none)
    # negative and non-contiguous position ids in the full batch
    bad_pos = torch.arange(16).repeat(2, 1)
    expect(r"position_ids of row 0 start at -1",
           lambda: step({"input_ids": ids, "position_ids": bad_pos - 1}), none)
    bad_pos[1, 5:] += 2
    expect(r"position_ids of row 1 go from 4 to 7 at index 5",
           lambda: step({"input_ids": ids, "position_ids": bad_pos}), none)
    # labels outside the vocabulary, on one rank's tokens only (through the adapters' hook)
    hooked = shard_full_batches(copy.deepcopy(model))
    labels = ids.clone()
    labels[0, 3] = 500  # shifted: token 2, owned by rank 0
    expect(r"bad input at step 7: TSP rank\(s\) \[0\]: shift_labels outside \[0, 96\)",
           lambda: hooked(input_ids=ids, labels=labels), agreed)
    # a rank of the group with another batch size (a sampler over all ranks, not dp ranks)
    rows = 2 if rank == 0 else 3
    other = torch.randint(0, 96, (rows, 16), generator=torch.Generator().manual_seed(1))
    expect(r"ranks of one TSP group have different batches \(rank 0: 2 rows x 8 local tokens, "
           r"rank 1: 3 rows x 8 local tokens\)",
           lambda: hooked(input_ids=other, labels=other), agreed)
    # local position ids that are not the layout's (built by hand, not by shard_batch)
    local = tsp_core.shard_batch({"input_ids": ids, "labels": ids}, mesh)
    expect(r"TSP rank\(s\) \[0, 1\]: position_ids that are not the global positions",
           lambda: model(input_ids=local["input_ids"], shift_labels=local["shift_labels"],
                         position_ids=torch.arange(8).repeat(2, 1)), agreed)
    # NaN / inf in float inputs on one rank, reported with the step
    emb = torch.zeros(2, 8, 64)
    if rank == 1:
        emb[1, 2, 3], emb[0, 0, 0] = float("nan"), float("inf")
    expect(r"bad input at step 7: TSP rank\(s\) \[1\]: NaN or inf in inputs_embeds: .* \(2 values\)",
           lambda: model(inputs_embeds=emb, position_ids=local["position_ids"],
                         shift_labels=local["shift_labels"]), agreed)
    # the group is still in step: a good batch trains and gives the one-process loss
    ref = hf_models.build("llama", torch.float32)
    want = ref(input_ids=ids, labels=ids).loss
    got = step({"input_ids": ids, "labels": ids})
    got.backward()
    assert abs(got.item() - want.item()) <= 1e-5 * want.item(), (got.item(), want.item())
    return msgs


def test_bad_input_fails_on_every_rank(pool):
    per_rank = pool.run(matrix)
    assert len(per_rank[0]) == 9
    # full-batch errors read the same everywhere; agreed ones start the same on every rank
    assert per_rank[0][:5] == per_rank[1][:5]
    for a, b in zip(per_rank[0][5:], per_rank[1][5:]):
        assert a.split(". This rank")[0] == b.split(". This rank")[0], (a, b)
    assert "This rank (TSP rank 0): 1 shift_labels outside [0, 96) (from 500 to 500)" in per_rank[0][5]
    assert "This rank (TSP rank 1): 2 NaN/inf values in inputs_embeds" in per_rank[1][8]
