"""Full state dicts in and out: full_state_dict -> save_pretrained -> from_pretrained reproduces the
model; a save_pretrained checkpoint loads into a TSP model with each rank reading ~1/D of it; per-rank
parameter bytes are total / D plus the replicated norms."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

import tsp_core
from tsp_core.layout import shard_sequence
from tsp_core.params import local

from . import dist_pool, hf_models
from .reference import assert_close


@pytest.fixture(scope="module")
def pool():
    p = dist_pool.DistPool(4)
    yield p
    p.close()


def round_trip(family: str, tsp: int, path: str) -> dict:
    from transformers import AutoModelForCausalLM

    mesh = dist_pool.mesh(tsp)
    D, p = mesh.size, mesh.rank
    ref = hf_models.build(family, torch.float64)
    model = tsp_core.parallelize(copy.deepcopy(ref), mesh)
    ids = torch.randint(0, ref.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want = ref(input_ids=ids).logits

    full = tsp_core.full_state_dict(model, rank0_only=True)
    if dist.get_rank() == 0:
        plain = hf_models.build(family, torch.float64, seed=99)
        plain.load_state_dict(full)
        plain.save_pretrained(path)
    else:
        assert full == {}
    dist.barrier()
    loaded = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64)
    with torch.no_grad():
        assert_close(loaded(input_ids=ids).logits, want, 1e-12, "logits after save/load")

    other = tsp_core.parallelize(hf_models.build(family, torch.float64, seed=99), mesh)
    read = tsp_core.load_full_state_dict(other, path)
    with torch.no_grad():
        logits = other(**tsp_core.shard_batch({"input_ids": ids}, mesh)).logits
    assert_close(logits, shard_sequence(want, p, D), 1e-12, "logits after load_full_state_dict")

    total = sum(t.numel() for t in ref.parameters())  # a tied weight counts once
    norms = sum(t.numel() for n, t in ref.named_parameters() if "norm" in n)
    local_params = sum(local(t).numel() for t in model.parameters())
    dist.barrier()
    return dict(read=read, total=total, norms=norms, local=local_params)


@pytest.mark.parametrize("family", ["llama", "llama-tied", "qwen2"])
@pytest.mark.parametrize("tsp", [2, 4])
def test_round_trip_and_sliced_reads(pool, tmp_path, family, tsp):
    res = pool.run(round_trip, family, tsp, str(tmp_path / "ckpt"))[0]
    cfg = hf_models.build(family, torch.float32).config
    h, d = cfg.hidden_size, cfg.hidden_size // cfg.num_attention_heads
    layers, nkv = cfg.num_hidden_layers, cfg.num_key_value_heads
    # k and v: 1/D of the rows on every rank, also with nkv < D (a slice of a head, never a copy)
    kv_full = layers * 2 * nkv * d * (h + (1 if family == "qwen2" else 0))
    kv_local = layers * 2 * -(-nkv * d // tsp) * (h + (1 if family == "qwen2" else 0))
    vocab_local = -(-cfg.vocab_size // tsp) * h * (1 if cfg.tie_word_embeddings else 2)
    vocab_full = cfg.vocab_size * h * (1 if cfg.tie_word_embeddings else 2)
    sharded = res["total"] - res["norms"] - kv_full - vocab_full
    expected = sharded // tsp + res["norms"] + kv_local + vocab_local
    assert res["local"] == expected, (res, expected)
    # what each rank read from disk: its slices plus the replicated norms, never the whole file
    assert res["read"] == expected, (res, expected)
