"""Gradient-norm clipping with torch's own function in a plain loop: the norm of a TSP model's
parameters is the one-process norm, also with fewer key/value heads than ranks (MQA/GQA), where
each rank holds a slice of the key/value rows rather than a copy of a head. Clipping is active
(threshold below every step's norm) and the optimizer is plain SGD, so a norm counting a copy
twice shows in the norm and, through the clip factor, in every weight."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

import tsp_core
from tests.support import dist_pool, gather, hf_models
from tsp_core.distributed.params import local

STEPS, ROWS, SEQ, LR, CLIP = 3, 4, 22, 0.5, 0.05  # 22 tokens: padding at tsp 2 and 4


def clipped_sgd(tsp: int, kv_heads: int) -> dict:
    mesh = dist_pool.mesh(tsp)
    ref = hf_models.build("llama", torch.float64, kv_heads=kv_heads)
    model = tsp_core.parallelize(copy.deepcopy(ref), mesh)
    gen = torch.Generator().manual_seed(7)
    batches = [torch.randint(0, ref.config.vocab_size, (ROWS, SEQ), generator=gen)
               for _ in range(STEPS)]
    want = hf_models.sgd_reference(ref, batches, LR, CLIP)
    assert min(want["norms"]) > 2 * CLIP, want["norms"]  # clipping is active at every step

    # every weight is stored once: the ranks' local key/value rows add up to the full tensor
    attn = model.model.layers[0].self_attn
    rows = torch.tensor([local(attn.k_proj.weight).shape[0]
                         - (attn.shard_spec("k_proj.weight", mesh.rank).local_len
                            - attn.shard_spec("k_proj.weight", mesh.rank).length)])
    dist.all_reduce(rows, group=mesh.group)
    assert int(rows) == kv_heads * attn.spec.head_dim, (int(rows), kv_heads)

    opt = torch.optim.SGD(model.parameters(), lr=LR)
    dp, dp_rank = mesh.dp_size, dist.get_rank() // mesh.size
    run: dict = {"losses": [], "norms": []}
    for step, ids in enumerate(batches):
        mine = ids.chunk(dp)[dp_rank]  # each data-parallel replica its own rows
        loss = model(**tsp_core.shard_batch({"input_ids": mine, "labels": mine}, mesh)).loss
        loss.backward()
        if step == 0:
            run["grads0"] = gather.full_grads(model)
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        assert isinstance(norm, DTensor), type(norm)
        run["norms"].append(norm.full_tensor().item())
        opt.step()
        opt.zero_grad()
        run["losses"].append(loss.item())
    run["weights"] = tsp_core.full_state_dict(model)
    hf_models.assert_matches_reference(run, want, 1e-8, norm_tol=1e-9,
                                       what=f"tsp {tsp}, dp {dp}, {kv_heads} kv heads: ")
    dist.barrier()
    return run["norms"]


@pytest.mark.parametrize("tsp,kv_heads", [(2, 1), (4, 1), (4, 2)],
                         ids=["dp2-tsp2-mqa", "tsp4-mqa", "tsp4-2kv"])
def test_torch_clip_grad_norm_is_the_one_process_norm(pools, tsp, kv_heads):
    norms = pools.of(4).run(clipped_sgd, tsp, kv_heads)
    assert all(n == norms[0] for n in norms), norms  # the same norm on every rank
