"""Gemma 4 text beyond the family tests (tests/support/hf_models.py builds it with every feature
TSP runs: the value norm, global layers with their own head size, attention_k_eq_v, per-layer
inputs, KV-shared layers with double-wide MLPs): activation checkpointing of the KV-shared layers.
A KV-shared layer attends with K/V another layer's schedule returned; non-reentrant checkpointing
keeps their gradient path (exact), reentrant checkpointing recomputes the storing layer after the
reusing one and would drop it, so it raises."""

from __future__ import annotations

import copy

import pytest
import torch

import tsp_core
from tests.support import dist_pool, hf_models
from tests.support.reference import assert_grads_close


def checkpointed_step(reentrant: bool) -> str:
    mesh = dist_pool.mesh(2)
    ref = hf_models.build("gemma4", torch.float64)
    model = tsp_core.parallelize(copy.deepcopy(ref), mesh)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    gen = torch.Generator().manual_seed(7)
    ids = torch.randint(0, ref.config.vocab_size, (2, 24), generator=gen)
    loss = model(**tsp_core.shard_batch({"input_ids": ids, "labels": ids}, mesh)).loss
    if reentrant:
        with pytest.raises(RuntimeError, match="reentrant activation checkpointing recomputes"):
            loss.backward()
        return "refused"
    loss.backward()
    expected = hf_models.reference_loss(ref, ids, ids)
    expected.backward()
    assert abs(loss.item() - expected.item()) <= 1e-10 * abs(expected.item()), (loss, expected)
    assert_grads_close(hf_models.full_grads(model), {n: p.grad for n, p in ref.named_parameters()},
                       1e-10, "gemma4 checkpointed")
    return "exact"


@pytest.mark.parametrize("reentrant", [False, True])
def test_kv_shared_layers_under_activation_checkpointing(pools, reentrant):
    want = "refused" if reentrant else "exact"
    assert pools.of(2).run(checkpointed_step, reentrant) == [want] * 2
