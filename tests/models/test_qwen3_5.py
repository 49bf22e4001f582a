"""Qwen3.5 text (Qwen3_5ForCausalLM) under TSP against the unmodified Hugging Face model on one
process, float64. Its Gated DeltaNet layers at the end (test_delta_net_*). Its full-attention
layers (tests/support/hf_models.py "qwen3_5": layer_types all "full_attention"): the output
gate ([query | gate] rows per head in q_proj), per-head q/k norms scaled by 1 + w, partial
rotary through the text rotary's mrope sections, q/k/v/o biases. Hugging Face's RMSNorms
compute in float32 even in a float64 model; the reference's run in
float64 (hf_models.float64_qwen3_5_norms, the same formula), the rest is Hugging Face's own code
(SDPA attention). Plain SGD, so that a gradient of the wrong scale shows in the weights."""

from __future__ import annotations

import copy
import os
from functools import partial

import pytest
import torch
import torch.distributed as dist

import tsp_core
from tests.inference.test_decode import greedy_parity
from tests.support import dist_pool, hf_models, parity
from tests.support.reference import assert_same_state


def test_text_rotary_is_plain_rope():
    """The text rotary's mrope sections (T, H, W) take the same position on every axis for text
    (2-D position_ids, or 3 equal rows): cos/sin of plain RoPE over the rotated channels
    (partial_rotary_factor 0.25 of head_dim 24: 6), bit for bit."""
    model = hf_models.build("qwen3_5", torch.float64)
    c = model.config
    dim = int(c.head_dim * c.rope_parameters["partial_rotary_factor"])
    pos = torch.tensor([[0, 1, 5, 9, 30, 31, 100, 255], [3, 4, 5, 6, 7, 8, 9, 10]])
    inv = 1.0 / (c.rope_parameters["rope_theta"]
                 ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
    freqs = pos[..., None].float() * inv
    want = [t.to(torch.float64) for t in (torch.cat((freqs, freqs), -1).cos(),
                                          torch.cat((freqs, freqs), -1).sin())]
    x = torch.zeros(2, 8, c.hidden_size, dtype=torch.float64)
    for given in (pos, pos[None].expand(3, -1, -1)):
        got = model.model.rotary_emb(x, given)
        assert got[0].shape[-1] == dim
        assert all(torch.equal(g, w) for g, w in zip(got, want)), "mrope != plain RoPE for text"


def sgd_parity(tsp: int, seq: int = 24, family: str = "qwen3_5") -> parity.Parity:
    """3 SGD steps (lr 0.5) of 2 rows of ``seq`` tokens per replica: each step's loss to 1e-10,
    the first step's gradients (gathered) to 1e-10 and the weights after the steps to 1e-8, on
    every rank (tests/support/parity.py). ``family``: tests/support/hf_models.py's Qwen3.5 (with
    Gated DeltaNet layers: "qwen3_5-linear", "qwen3_5-mixed")."""
    return parity.Parity(partial(hf_models.build, family, torch.float64), tsp, seq=seq,
                         name=family)


@pytest.mark.parametrize("world,tsp", [(2, 2), (4, 4), (4, 2)], ids=lambda v: str(v))
def test_training_parity_float64(pools, world, tsp):
    parity.assert_same_losses(pools.of(world).run(parity.train_parity, sgd_parity(tsp)))


@pytest.mark.parametrize("tsp", [2, 4])
def test_greedy_generation_matches_hf(pools, tsp):
    # left-padded prompts of 7, 33 and 100 tokens, 24 new tokens: the decode step applies each
    # rank's own heads' output gate after the log-sum-exp merge
    outs = pools.of(tsp).run(greedy_parity, "qwen3_5", tsp, [7, 33, 100], 24)
    assert all(o == outs[0] for o in outs), "ranks generated different tokens"


def round_trips(tsp: int, root: str) -> None:
    """full_state_dict, save_pretrained (the safetensors file) and load_full_state_dict into a
    model of other weights give Hugging Face's tensors bit for bit (float32)."""
    from safetensors.torch import load_file

    mesh = dist_pool.mesh(tsp)
    ref = hf_models.build("qwen3_5", torch.float32)
    want = ref.state_dict()

    def same(got: dict, what: str) -> None:
        assert_same_state(got, want, what)

    model = tsp_core.parallelize(copy.deepcopy(ref), mesh)
    same(tsp_core.full_state_dict(model), "full_state_dict")
    path = os.path.join(root, f"qwen3_5-{tsp}")
    model.save_pretrained(path)
    dist.barrier()
    same(load_file(os.path.join(path, "model.safetensors")), "save_pretrained")
    other = tsp_core.parallelize(hf_models.build("qwen3_5", torch.float32, seed=5), mesh)
    tsp_core.load_full_state_dict(other, want)
    same(tsp_core.full_state_dict(other), "after load_full_state_dict")
    dist.barrier()


@pytest.mark.parametrize("tsp", [2, 4])
def test_round_trips_bit_for_bit(pools, tmp_path, tsp):
    pools.of(tsp).run(round_trips, tsp, str(tmp_path))


def delta_net_heads_refused() -> str:
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    config = Qwen3_5TextConfig(vocab_size=96, head_dim=24, **hf_models.COMMON,
                               layer_types=["linear_attention", "full_attention"],
                               linear_num_key_heads=3, linear_num_value_heads=6)
    return parity.parallelize_refusal(Qwen3_5ForCausalLM(config), 2)


def test_delta_net_heads_that_do_not_split_are_refused(pools):
    """Gated DeltaNet key heads that tsp_size does not divide: refused by field and value on
    every rank, before any collective, naming the sizes that work."""
    msgs = pools.of(2).run(delta_net_heads_refused)
    assert msgs[0] == msgs[1], msgs
    assert msgs[0].startswith("tsp_size (2) must divide linear_num_key_heads (3)"), msgs[0]
    assert msgs[0].endswith("valid tsp_size values for this model: 1"), msgs[0]


# Gated DeltaNet layers (tsp_core.layers.linear_attention): Hugging Face's float32 islands (its
# torch fallback of the gated delta rule, the gated norm, the decay's casts) computed in float64
# by tests/support/delta_net_reference.py, a copy of its code that changes only those casts.
# 13 tokens: padded to 16, zigzag chunks of 2 tokens at tsp 4, shorter than the kernel's halo of 3
@pytest.mark.parametrize("family,seq", [("qwen3_5-linear", 13), ("qwen3_5-mixed", 24)])
@pytest.mark.parametrize("world,tsp", [(2, 2), (4, 4), (4, 2)], ids=lambda v: str(v))
def test_delta_net_training_parity_float64(pools, world, tsp, family, seq):
    parity.assert_same_losses(pools.of(world).run(parity.train_parity,
                                                  sgd_parity(tsp, seq, family)))


def test_training_parity_bf16_autocast(pools):
    # the mix (a Gated DeltaNet layer, then a full-attention one with its output gate), float32
    # weights, forward and backward under bf16 autocast: one SGD step against the unmodified
    # model under the same autocast, within bf16's bounds (tests/support/parity.py
    # compare_bf16: G = 9 u). Measured: 1.7 u
    parity.assert_same_losses(pools.of(2).run(parity.train_parity, parity.bf16_parity(
        partial(hf_models.build, "qwen3_5-mixed", torch.float32), 2, "qwen3_5-mixed")))


@pytest.mark.parametrize("tsp", [2, 4])
def test_delta_net_greedy_generation_matches_hf(pools, tsp):
    """Left-padded prompts of 7, 33 and 100 tokens, 24 new tokens, through the default mix
    (a Gated DeltaNet layer, then a full-attention one): the linear layer carries its recurrent
    and convolution state from prefill through every step (tsp_core.layers.linear_attention
    .decode); tokens equal and every step's logits within 1e-8 of Hugging Face's cached
    generation (its float32 islands in float64, the recurrent rule's too)."""
    outs = pools.of(tsp).run(greedy_parity, "qwen3_5-mixed", tsp, [7, 33, 100], 24)
    assert all(o == outs[0] for o in outs), "ranks generated different tokens"


@pytest.mark.parametrize("tsp", [2, 4])
def test_delta_net_packed_rows_match_documents_run_alone(pools, tsp):
    """Packed rows (documents of 1 to 200 tokens, tests/sequence/test_packing.py): the Gated
    DeltaNet layer's state and convolution restart at every document, so loss, every gradient
    and every token's logits equal each document run alone through Hugging Face's model."""
    from tests.sequence.test_packing import packed_parity

    pools.of(4).run(packed_parity, "qwen3_5-mixed", tsp)
