"""Long context changes no number (docs/design.md "Long context"): with activation checkpointing,
host offload of the layer inputs (``activation_offload=True``) and token tiles several times
smaller than a rank's tokens (the last tile shorter), a TSP model's loss and the first step's
gradient of every parameter (gathered to full shape, no optimizer in between) match the
unmodified Hugging Face model on one process in float64 to 1e-10 on every rank, at tsp 1, 2, 4 and
dp 2 x tsp 2: Llama with one key/value head (MQA), OLMo 2 (q/k norms over all heads, the phased
attention schedule) and Mixtral under both expert schedules."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

import tsp_core
from tests.layers import test_moe
from tests.support import dist_pool, gather, hf_models
from tests.support.reference import assert_grads_close
from tsp_core.distributed.model_state import model_state

SEQ = 64    # 16 tokens per row at tsp 4, 64 at tsp 1
TILE = 3    # divides none of 16, 32, 64 or 128 (a row's or a rank's tokens): every last tile short


def build(case: str):
    """The reference model in float64, its loss function and ``parallelize``'s extra arguments."""
    if case == "llama-mqa":
        return hf_models.build("llama", torch.float64, kv_heads=1), hf_models.reference_loss, {}
    if case == "olmo2":
        return hf_models.build("olmo2", torch.float64), hf_models.reference_loss, {}
    family, _, schedule = case.partition("-")
    assert family == "mixtral", case
    # eager experts (grouped_mm has no float64 kernel); cross-entropy and load-balancing loss in
    # float64 (Hugging Face's own run in float32)
    return test_moe.build(family), test_moe.reference_loss, {"moe_schedule": schedule}


def batch(vocab: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(7)
    ids = torch.randint(0, vocab, (rows, SEQ), generator=gen)
    labels = ids.clone()
    labels[0, :3] = -100           # ignored labels
    labels[-1, SEQ // 2] = -100
    return ids, labels


def long_context_parity(case: str, tsp: int) -> float:
    """One step on every rank: the loss (relative 1e-10) and every parameter's gradient, gathered
    from the shards (relative 1e-10, named with the rank), against the unmodified model."""
    mesh = dist_pool.mesh(tsp)
    dp, dp_rank = mesh.dp_size, mesh.device_mesh.get_coordinate()[0]
    what = f"{case} dp {dp} x tsp {tsp} rank {dist.get_rank()}"
    ref, reference_loss, kwargs = build(case)
    model = copy.deepcopy(ref)
    model.activation_checkpointing_enable()
    model = tsp_core.parallelize(model, mesh, tile_tokens=TILE, activation_offload=True,
                                 **kwargs)
    assert SEQ // tsp >= 4 * TILE, f"{what}: a tile ({TILE}) is not several times smaller " \
                                   f"than a row's tokens ({SEQ // tsp})"
    layers = list(model.model.layers)
    tiled = {n: m.tile_tokens for n, m in model.named_modules() if hasattr(m, "tile_tokens")}
    for name in [f"model.layers.{i}.mlp" for i in range(len(layers))] + ["lm_head"]:
        assert tiled.get(name) == TILE, f"{what}: {name} is not tiled by {TILE}: {tiled}"
    # a checkpointed layer's attention runs twice: in the forward, then in the recompute
    forwards = [0] * len(layers)
    hooks = [layer.self_attn.register_forward_pre_hook(
        lambda *_, i=i: forwards.__setitem__(i, forwards[i] + 1)) for i, layer in enumerate(layers)]

    rows = 2
    ids, labels = batch(ref.config.vocab_size, rows * dp)
    expected = reference_loss(ref, ids, labels)
    mine = slice(dp_rank * rows, (dp_rank + 1) * rows)
    loss = model(**tsp_core.shard_batch({"input_ids": ids[mine], "labels": labels[mine]},
                                        mesh)).loss
    rel = abs(loss.item() - expected.item()) / abs(expected.item())
    assert rel <= 1e-10, f"{what}: loss {loss.item()!r} vs {expected.item()!r} (rel {rel:.2e})"
    expected.backward()
    loss.backward()
    for h in hooks:
        h.remove()
    # each layer's saved input went to the host and came back once, all but the last layer's
    # (the first the backward needs) started one layer ahead
    count = len(layers)
    want_stats = {"offloaded": count, "brought_back": count, "prefetched": count - 1}
    stats = model_state(model).offload.stats
    assert stats == want_stats, f"{what}: offload {stats}, not {want_stats}"
    assert forwards == [2] * count, f"{what}: attention forwards per layer {forwards}, not 2 " \
                                    f"each (forward and recompute)"
    want = {name: p.grad for name, p in ref.named_parameters()}
    assert_grads_close(gather.full_grads(model), want, 1e-10, f"{what} step 0")
    dist.barrier()
    return loss.item()


CONFIGS = [(1, 1), (2, 2), (4, 4), (4, 2)]   # (world size, tsp size); (4, 2) is dp 2 x tsp 2
CASES = ["llama-mqa", "olmo2", "mixtral-expert", "mixtral-ring"]


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("world,tsp", CONFIGS, ids=lambda v: str(v))
def test_tiles_checkpointing_and_offload_change_no_number(pools, world, tsp, case):
    losses = pools.of(world).run(long_context_parity, case, tsp)
    assert all(r == losses[0] for r in losses), f"the loss differs between ranks: {losses}"
