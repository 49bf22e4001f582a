"""Bad input through the public API (shard_batch + the model) and the adapters' batch paths
(shard_full_batches: Fabric, Accelerate, the Trainer; tsp_lightning's shard: the Lightning
Trainer) fails on every rank of the TSP group with a message naming the problem and the fix; errors
in the full batch come before any collective, errors only one rank can see after one agreed
all-gather; afterwards the group still trains in step."""

from __future__ import annotations

import copy
import os
import re

import pytest
import torch

import tsp_core
from tests.support import dist_pool, hf_models, launch
from tsp_core import comm
from tsp_core.models import shard_full_batches


@pytest.fixture(scope="module")
def pool(pools):
    return pools.of(2, timeout=120)


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
    # ranks of the group given different rows of the same shape, or the same tokens with other
    # labels (masking without a shared seed): caught by the fingerprint of the full batch, in the
    # same all-gather, through shard_batch, the adapters' hook and Lightning's strategy
    from tsp_lightning import TSPStrategy

    differ = (r"ranks of one TSP group were given different batches: TSP rank\(s\) \[0\] \(global "
              r"\[0\]\): 0x[0-9a-f]+, TSP rank\(s\) \[1\] \(global \[1\]\): 0x[0-9a-f]+ .*usual "
              r"causes: a DistributedSampler over the whole world")
    own = torch.randint(0, 96, (2, 16), generator=torch.Generator().manual_seed(10 + rank))
    expect(differ, lambda: step({"input_ids": own, "labels": own}), agreed)
    expect(differ, lambda: hooked(input_ids=own, labels=own), agreed)
    strategy = TSPStrategy(tsp_size=2)
    strategy._built_mesh = mesh
    expect(differ, lambda: model(**strategy.batch_to_device({"input_ids": own, "labels": own},
                                                            torch.device("cpu"))), agreed)
    masked = ids.clone()
    masked[1, 5 + rank] = -100
    expect(differ, lambda: hooked(input_ids=ids, labels=masked), agreed)
    # the same tokens and labels, only the attention mask differs (right padding from token 12 on
    # rank 0, from 13 on rank 1: a collator that pads per rank); nothing else in the agreed row
    # (shapes, documents, rope length) tells the ranks apart
    padded = torch.ones_like(ids)
    padded[1, 12 + rank:] = 0
    expect(differ, lambda: step({"input_ids": ids, "labels": ids, "attention_mask": padded}),
           agreed)
    expect(differ, lambda: hooked(input_ids=ids, labels=ids, attention_mask=padded), agreed)
    # local position ids that are not the layout's (built by hand, not by shard_batch)
    local = tsp_core.shard_batch({"input_ids": ids, "labels": ids}, mesh)
    expect(r"TSP rank\(s\) \[0, 1\]: position_ids that are not the global positions",
           lambda: model(input_ids=local["input_ids"], shift_labels=local["shift_labels"],
                         position_ids=torch.arange(8).repeat(2, 1)), agreed)
    # NaN / inf in float inputs on one rank, reported with the step
    emb = torch.zeros(2, 8, 64)
    if rank == 1:
        emb[1, 2, 3], emb[0, 0, 0] = float("nan"), float("inf")
    expect(r"bad input at step 7: TSP rank\(s\) \[1\]: NaN or inf in inputs_embeds: "
           r".* \(2 values\)",
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
    assert len(per_rank[0]) == 15
    # full-batch errors read the same everywhere; agreed ones start the same on every rank
    assert per_rank[0][:5] == per_rank[1][:5]
    for a, b in zip(per_rank[0][5:], per_rank[1][5:]):
        assert a.split(". This rank")[0] == b.split(". This rank")[0], (a, b)
    assert ("This rank (TSP rank 0): 1 shift_labels outside [0, 96) (from 500 to 500)"
            in per_rank[0][5])
    assert "This rank (TSP rank 1): 2 NaN/inf values in inputs_embeds" in per_rank[1][14]
    # the same rows through shard_batch, the hook and Lightning's strategy: the same fingerprints
    assert per_rank[0][7] == per_rank[0][8] == per_rank[0][9] != per_rank[0][10]
    assert per_rank[0][11] == per_rank[0][12] != per_rank[0][7]  # the mask alone: through both


def sampler_over_the_world(tsp: int) -> str:
    """4 ranks, tsp 4 or dp 2 x tsp 2. A DistributedSampler over every rank gives the ranks of a
    TSP group different rows: every rank raises at the first step, naming its group's ranks by
    fingerprint (global ranks too); with the sampler over the data-parallel ranks the
    ranks train (the data-parallel replicas' different batches are not an error)."""
    import torch.distributed as dist
    from torch.utils.data import DataLoader, DistributedSampler

    mesh = dist_pool.mesh(tsp)
    model = tsp_core.parallelize(hf_models.build("llama", torch.float32), mesh)
    data = [{"input_ids": r, "labels": r} for r in
            torch.randint(0, 96, (16, 16), generator=torch.Generator().manual_seed(2))]

    def first_batch(sampler) -> dict:
        return next(iter(DataLoader(data, batch_size=2, sampler=sampler)))

    right = DistributedSampler(data, num_replicas=mesh.dp_size, rank=dist.get_rank() // mesh.size,
                               shuffle=False)
    model(**tsp_core.shard_batch(first_batch(right), mesh)).loss.backward()
    # a loader split by global rank % 2: ranks 0 and 2 get one batch, 1 and 3 another
    split = DistributedSampler(data, num_replicas=2, rank=dist.get_rank() % 2, shuffle=False)
    world = DistributedSampler(data, shuffle=False)  # over all 4 ranks: the usual mistake
    with comm.track() as stats, pytest.raises(ValueError, match="were given different batches"
                                              ) as info:
        model(**tsp_core.shard_batch(first_batch(split if tsp == 4 else world), mesh))
    assert dict(stats.calls) == {"all_gather": 1}, dict(stats.calls)
    if tsp == 4:
        return str(info.value)
    # bad labels on one rank of the second TSP group only: that group raises with the details,
    # the first group's ranks raise too instead of waiting for it in a data-parallel collective
    batch = first_batch(right)
    if dist.get_rank() == 3:
        batch["labels"] = batch["labels"].clone().fill_(1000)
    with comm.track() as stats, pytest.raises(ValueError) as one_group:
        model(**tsp_core.shard_batch(batch, mesh))
    assert dict(stats.calls) == {"all_gather": 1}, dict(stats.calls)
    return str(info.value), str(one_group.value)


def test_ranks_of_a_group_with_different_batches_raise_on_every_rank(pools):
    tsp4 = pools.of(4).run(sampler_over_the_world, 4)
    assert len(set(tsp4)) == 1
    assert re.search(r"TSP rank\(s\) \[0, 2\] \(global \[0, 2\]\): 0x[0-9a-f]+, TSP rank\(s\) "
                     r"\[1, 3\] \(global \[1, 3\]\): 0x", tsp4[0]), tsp4[0]
    assert "DistributedSampler(dataset, num_replicas=mesh.dp_size, rank=torch.distributed." \
           "get_rank() // mesh.size)" in tsp4[0]
    dp2, one_group = zip(*pools.of(4).run(sampler_over_the_world, 2))
    assert dp2[0] == dp2[1] != dp2[2] == dp2[3]
    assert re.search(r"TSP rank\(s\) \[0\] \(global \[2\]\): 0x[0-9a-f]+, TSP rank\(s\) \[1\] "
                     r"\(global \[3\]\)", dp2[2]), dp2[2]
    assert one_group[0] == one_group[1], one_group
    assert "bad input in another TSP group (global ranks [2, 3])" in one_group[0], one_group[0]
    for msg in one_group[2:]:  # the details on both ranks of the bad group (rank 3 adds its own)
        assert "TSP rank(s) [1]: shift_labels outside [0, 96)" in msg, msg


def test_adapters_raise_on_every_rank_at_the_first_step(tmp_path):
    """One torchrun of 2 processes (tests/jobs/bad_batch_job.py): TSPTrainer, TSPAccelerator and
    Lightning's Trainer, each fed different batches on the two ranks of its TSP group, raise the
    same error on both ranks at their first forward (no step finished, no hang; the job exits 0)."""
    import json

    job = os.path.join(launch.JOBS, "bad_batch_job.py")
    launch.run(launch.torchrun(2, launch.EXIT_CLEANLY, job, "--out", str(tmp_path)), 2)
    ranks = []
    for r in range(2):
        with open(tmp_path / f"rank{r}.json") as f:
            ranks.append(json.load(f))
    assert ranks[0] == ranks[1]
    for adapter, msg in ranks[0].items():
        assert re.match(r"bad input at forward call 1 .*ranks of one TSP group were given "
                        r"different batches: TSP rank\(s\) \[0\] \(global \[0\]\): "
                        r"0x[0-9a-f]+, TSP rank\(s\) \[1\] \(global \[1\]\)", msg), (adapter, msg)
