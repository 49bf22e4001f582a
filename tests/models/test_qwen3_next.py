"""Qwen3-Next (Qwen3NextForCausalLM, ``qwen3_next``) under TSP against the unmodified Hugging Face
model on one process, float64 (tests/support/hf_models.py "qwen3_next"): a Gated DeltaNet layer
whose q, k, v, z, b and a come from the fused, per-key-head interleaved ``in_proj_qkvz`` and
``in_proj_ba``, then a full-attention layer (Qwen3.5's: output gate, per-head q/k norms, partial
rotary, biases); both MLPs sparse (4 experts, top 2) with a shared expert scaled per token by
``sigmoid(shared_expert_gate(x))``; ``1 + w`` norms. Hugging Face's float32 islands (the norms,
the gated delta rule, the decay's casts) run in float64 in the reference
(tests/support/norm_reference.py, tests/support/delta_net_reference.py); its loss there is the
cross-entropy plus the load-balancing loss in float64 (tests/layers/test_moe.py)."""

from __future__ import annotations

import copy
from functools import partial

import pytest
import torch
import torch.distributed as dist

import tsp_core
from tests.inference.test_decode import greedy_parity
from tests.layers.test_moe import aux_loss_present
from tests.layers.test_moe import reference_loss as moe_reference_loss
from tests.support import dist_pool, hf_models, parity
from tests.support.reference import assert_same_state


def sgd_parity(tsp: int, schedule: str | None = None) -> parity.Parity:
    """3 SGD steps (lr 0.5) of 2 rows of 13 tokens per replica (padded to 16: zigzag chunks of 2
    tokens at tsp 4, shorter than the kernel's halo of 3): each step's loss (with the
    load-balancing loss) to 1e-10, the first step's gradients (gathered) to 1e-10 and the
    weights after the steps to 1e-8, on every rank (tests/support/parity.py); ``schedule``: the
    experts' (tsp_core.layers.moe), else the one the cost model picks."""
    return parity.Parity(partial(hf_models.build, "qwen3_next", torch.float64), tsp, seq=13,
                         reference_loss=moe_reference_loss,
                         options={} if schedule is None else dict(moe_schedule=schedule),
                         check_output=partial(aux_loss_present, True),
                         name=f"qwen3_next {schedule or ''}")


@pytest.mark.parametrize("world,tsp", [(1, 1), (2, 2), (4, 4), (4, 2)], ids=lambda v: str(v))
def test_training_parity_float64(pools, world, tsp):
    parity.assert_same_losses(pools.of(world).run(parity.train_parity, sgd_parity(tsp)))


@pytest.mark.parametrize("schedule", ["expert", "ring"])
def test_training_parity_float64_each_moe_schedule(pools, schedule):
    # the shared expert and its gate beside the routed experts under either schedule
    parity.assert_same_losses(pools.of(2).run(parity.train_parity, sgd_parity(2, schedule)))


def empty_shared_expert_refused() -> str:
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    fields = {**hf_models.ZOO["qwen3_next"].fields, "shared_expert_intermediate_size": 0}
    model = Qwen3NextForCausalLM(Qwen3NextConfig(**{**hf_models.COMMON, **fields}))
    return parity.parallelize_refusal(model, 2)


def test_empty_shared_expert_is_refused(pools):
    """shared_expert_intermediate_size 0 (Hugging Face keeps an empty shared expert behind its
    gate): refused by field and value on every rank, before any collective."""
    msgs = pools.of(2).run(empty_shared_expert_refused)
    assert msgs[0] == msgs[1], msgs
    assert msgs[0].startswith("config.shared_expert_intermediate_size=0: Hugging Face's "
                              "Qwen3-Next then keeps an empty shared_expert"), msgs[0]


@pytest.mark.parametrize("tsp", [2, 4])
def test_greedy_generation_matches_hf(pools, tsp):
    """Left-padded prompts of 7, 33 and 100 tokens, 24 new tokens ("qwen3_next-generate": no
    load-balancing loss, which Hugging Face's generate cannot compute under a padding mask): the
    Gated DeltaNet layer carries its state from prefill through every step, the shared expert's
    gate scales each rank's channels before the all-reduce; tokens equal and every step's logits
    within 1e-8 of Hugging Face's cached generation."""
    outs = pools.of(tsp).run(greedy_parity, "qwen3_next-generate", tsp, [7, 33, 100], 24)
    assert all(o == outs[0] for o in outs), "ranks generated different tokens"


def interleaved_rows(tsp: int) -> list[int]:
    """The key head each local row of this rank's q, k, v and z came from, read back from the
    fused tensor: HF's in_proj_qkvz with every row set to its key head's index."""
    mesh = dist_pool.mesh(tsp)
    model = hf_models.build("qwen3_next", torch.float64)
    attn = model.model.layers[0].linear_attn
    group = attn.in_proj_qkvz.weight.shape[0] // attn.num_k_heads
    with torch.no_grad():
        attn.in_proj_qkvz.weight.copy_(torch.arange(attn.num_k_heads, dtype=torch.float64)
                                       .repeat_interleave(group)[:, None].expand(-1, 64))
    model = tsp_core.parallelize(model, mesh)
    new = model.model.layers[0].linear_attn
    got = [int(v) for n in ("q", "k", "v", "z")
           for v in new.get_parameter(f"in_proj_{n}.weight").to_local()[:, 0].unique()]
    dist.barrier()
    return got


@pytest.mark.parametrize("tsp", [2, 4])
def test_each_rank_owns_whole_key_head_groups(pools, tsp):
    """Rank p's q, k, v and z rows all come from its own key heads [p nk/D, (p+1) nk/D) of the
    interleaved in_proj_qkvz (4 key heads)."""
    per = 4 // tsp
    got = pools.of(tsp).run(interleaved_rows, tsp)
    for rank, heads in enumerate(got):
        assert heads == list(range(rank * per, (rank + 1) * per)) * 4, (rank, heads)


def round_trips(tsp: int, root: str) -> None:
    """Hugging Face's interleaved ``in_proj_qkvz`` and ``in_proj_ba`` (and every other tensor)
    bit for bit (float32) in full_state_dict, save_pretrained's file (Hugging Face's own), after
    load_full_state_dict from a dict and from Hugging Face's own checkpoint directory (read slice
    by slice), and in a DCP checkpoint loaded into the plain model."""
    import os

    from safetensors.torch import load_file

    mesh = dist_pool.mesh(tsp)
    ref = hf_models.build("qwen3_next", torch.float32)
    want = ref.state_dict()
    assert "model.layers.0.linear_attn.in_proj_qkvz.weight" in want

    def same(got: dict, what: str) -> None:
        assert_same_state(got, want, what)

    model = tsp_core.parallelize(copy.deepcopy(ref), mesh)
    same(tsp_core.full_state_dict(model), "full_state_dict")
    hf_dir, tsp_dir, dcp_dir = (os.path.join(root, f"{n}-{tsp}") for n in ("hf", "tsp", "dcp"))
    if dist.get_rank() == 0:
        ref.save_pretrained(hf_dir)
    model.save_pretrained(tsp_dir)
    dist.barrier()
    saved, hf_saved = (load_file(os.path.join(d, "model.safetensors")) for d in (tsp_dir, hf_dir))
    assert sorted(saved) == sorted(hf_saved), sorted(set(saved) ^ set(hf_saved))
    for name, t in hf_saved.items():  # the Hub's layout (one tensor per expert), as HF writes it
        assert torch.equal(saved[name], t), f"save_pretrained: {name}"
    for source in (want, hf_dir):
        other = tsp_core.parallelize(hf_models.build("qwen3_next", torch.float32, seed=5), mesh)
        tsp_core.load_full_state_dict(other, source)
        same(tsp_core.full_state_dict(other), f"after load_full_state_dict({source!r:.20})")
    tsp_core.save_checkpoint(dcp_dir, model)
    plain = hf_models.build("qwen3_next", torch.float32, seed=5)
    tsp_core.load_checkpoint(dcp_dir, plain)
    same(plain.state_dict(), "a DCP checkpoint loaded into the plain model")
    dist.barrier()


@pytest.mark.parametrize("tsp", [2, 4])
def test_round_trips_bit_for_bit(pools, tmp_path, tsp):
    pools.of(tsp).run(round_trips, tsp, str(tmp_path))
