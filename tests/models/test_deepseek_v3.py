"""DeepSeek-V3 (``deepseek_v3``) under TSP: multi-head latent attention on its own schedule
(tsp_core/layers/attention/latent.py) and the MoE of GLM-4.5's policy.

- Training parity in float64 against the unmodified Hugging Face model on one process, at tsp 1,
  2, 4 and dp 2 x tsp 2, with the low-rank query (q_lora_rank) and without it (q_proj, on the dp 2
  x tsp 2 run): the loss of each of 3 SGD steps (1e-10), the first step's gradient of every
  parameter (1e-10, every rank) and every weight after the 3 steps (1e-8). The tiny model has
  every feature on: a dense first layer and a sparse one (8 experts in 2 groups, top 2 of the
  best group, a random correction bias, routed_scaling_factor 2.5, one shared expert), yarn
  rotary (its mscale changes the softmax scale and its attention factor cos/sin), DeepSeek's
  interleaved rotary pairs, a query/key head size (12) unlike the value head size (6), RMSNorm
  weights away from one. Hugging Face's eager softmax runs in float32: the reference runs SDPA
  (float64 throughout); its router computes in float32 (``hidden_states.type(torch.float32)``):
  the reference's router runs the same code in float64 (tests/support/moe_reference.py's
  float64_glm_router, the same router code as GLM-4.5's, proved bit for bit against Hugging
  Face's in float32 by tests/models/test_references.py).
- Checkpoints: Hugging Face's save_pretrained loads bit for bit, TSP's save_pretrained writes
  Hugging Face's tensors bit for bit (tsp 2, the ring MoE schedule, which then trains one step
  exactly).
- A packed row (three documents) at tsp 2: Hugging Face's loss and gradients of the documents
  run alone.
- The collectives of one MLA layer at tsp 2 and 4: calls and bytes equal
  ``latent_collectives`` (docs/design.md "Multi-head latent attention (DeepSeek-V3)").
- The memory rule under fake tensors: what one layer of DeepSeek-V3's attention keeps for the
  backward is the same at D = 4 and D = 8 for the same local tokens (nothing grows with the
  gathered sequence) and within the named floor of local tensors.
- Greedy generation over the sequence-sharded latent cache at tsp 2 and 4 (with and without
  q_lora_rank): Hugging Face's tokens, and every step's logits to 1e-8.
"""

from __future__ import annotations

import copy
import os
from functools import partial

import pytest
import torch
import torch.distributed as dist

import tsp_core
from tests.inference.test_decode import left_padded, reference_logits
from tests.support import dist_pool, gather, parity
from tests.support.moe_reference import float64_glm_router
from tests.support.reference import assert_close, assert_grads_close
from tsp_core import comm
from tsp_core.sequence.layout import position_ids


def build(q_lora_rank: int | None = 16, seed: int = 0, dtype: torch.dtype = torch.float64):
    """A tiny DeepSeek-V3 in float64 with every feature TSP runs (module docstring). In float32
    (``dtype``) its router is Hugging Face's own: the float64 copy changes only float32's casts."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    torch.manual_seed(seed)
    rope = dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, mscale=1.0, mscale_all_dim=1.0,
                original_max_position_embeddings=32, beta_fast=32.0, beta_slow=1.0)
    model = DeepseekV3ForCausalLM(DeepseekV3Config(
        vocab_size=96, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
        q_lora_rank=q_lora_rank, kv_lora_rank=12, qk_nope_head_dim=8, qk_rope_head_dim=4,
        v_head_dim=6, n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1,
        routed_scaling_factor=2.5, n_shared_experts=1, first_k_dense_replace=1,
        norm_topk_prob=True, rope_interleave=True, max_position_embeddings=128,
        rope_parameters=rope))
    with torch.no_grad():
        for name, t in model.state_dict().items():
            if name.endswith("norm.weight"):
                t.add_(0.1 * torch.randn(t.shape))
            elif name.endswith("e_score_correction_bias"):
                t.copy_(0.3 * torch.randn(t.shape))
            elif name.endswith("mlp.gate.weight"):  # routing far from uniform
                t.normal_(0, 0.5)
    if dtype == torch.float64:
        float64_glm_router(model)
    model.set_experts_implementation("eager")
    return model.to(dtype)


def test_build_exercises_every_feature():
    ref = build()
    attn = ref.model.layers[0].self_attn
    assert ref.config._attn_implementation == "sdpa"
    assert attn.scaling != attn.qk_head_dim ** -0.5  # yarn's mscale
    assert attn.qk_head_dim != attn.v_head_dim and ref.config.rope_interleave
    assert not hasattr(ref.model.layers[0].mlp, "experts")  # first_k_dense_replace
    assert hasattr(ref.model.layers[1].mlp, "experts")
    assert ref.model.layers[1].mlp.gate.e_score_correction_bias.abs().min() > 0
    assert build(None).model.layers[0].self_attn.q_proj is not None


@pytest.mark.parametrize("world,tsp,q_lora_rank", [(1, 1, 16), (2, 2, 16), (4, 4, 16),
                                                   (4, 2, None)], ids=str)
def test_training_parity_float64(pools, world, tsp, q_lora_rank):
    # 3 SGD steps (lr 0.5) of 2 rows of 24 tokens per replica (tests/support/parity.py)
    case = parity.Parity(partial(build, q_lora_rank), tsp,
                         name=f"deepseek_v3 q_lora_rank {q_lora_rank}")
    parity.assert_same_losses(pools.of(world).run(parity.train_parity, case))


def test_training_parity_bf16_autocast(pools):
    # float32 weights, forward and backward under bf16 autocast: one SGD step of the latent
    # attention and the MoE (expert schedule) against the unmodified model under the same
    # autocast, within bf16's bounds (tests/support/parity.py compare_bf16: G = 9 u). Measured:
    # 0.9 u
    case = parity.bf16_parity(partial(build, 16, dtype=torch.float32), 2, "deepseek_v3")
    parity.assert_same_losses(pools.of(2).run(parity.train_parity, case))


LENGTHS = [13, 4, 19]  # one packed row of 36 tokens: documents across zigzag chunk boundaries


def packed_rows(tsp: int) -> None:
    """A packed row (position_ids restarting per document, shard_batch's tsp_docs): the latent
    attention stays inside each document (its latent gathered per document layout), so the loss
    and every gradient are Hugging Face's on the documents run alone."""
    import torch.nn.functional as F

    mesh = dist_pool.mesh(tsp)
    ref = build()
    model = tsp_core.parallelize(copy.deepcopy(ref), mesh)
    gen = torch.Generator().manual_seed(11)
    docs = [torch.randint(0, ref.config.vocab_size, (n,), generator=gen) for n in LENGTHS]
    labels = torch.cat([torch.cat([torch.tensor([-100]), d[1:]]) for d in docs])[None]
    positions = torch.cat([torch.arange(n) for n in LENGTHS])[None]
    total = sum(F.cross_entropy(ref(input_ids=d[None]).logits[0, :-1], d[1:], reduction="sum")
                for d in docs)
    expected = total / sum(n - 1 for n in LENGTHS)
    expected.backward()
    batch = tsp_core.shard_batch({"input_ids": torch.cat(docs)[None], "labels": labels,
                                  "position_ids": positions}, mesh)
    loss = model(**batch).loss
    assert abs(loss.item() - expected.item()) <= 1e-10 * abs(expected.item()), (loss, expected)
    loss.backward()
    assert_grads_close(gather.full_grads(model),
                       {n: p.grad for n, p in ref.named_parameters()}, 1e-10,
                       f"packed row, tsp {tsp}")
    dist.barrier()


def test_packed_rows(pools):
    pools.of(2).run(packed_rows, 2)


def checkpoints_and_ring(root: str) -> None:
    """Hugging Face's own save_pretrained (the Hub's per-expert layout) loads into a TSP model on
    the ring MoE schedule bit for bit; that model's save_pretrained writes Hugging Face's tensors
    bit for bit; one training step on the ring schedule is Hugging Face's (loss and every
    gradient to 1e-10, the weights after it to 1e-8: tests/support/parity.py)."""
    import os

    from safetensors.torch import load_file

    from tsp_core.layers.moe import TSPMoE

    mesh = dist_pool.mesh(2)
    ref = build()
    want = ref.state_dict()
    path = os.path.join(root, "hf")
    if dist.get_rank() == 0:
        ref.save_pretrained(path)
    dist.barrier()
    model = tsp_core.parallelize(build(seed=5), mesh, moe_schedule="ring")
    assert {m.schedule for m in model.modules() if isinstance(m, TSPMoE)} == {"ring"}
    tsp_core.load_full_state_dict(model, path)
    got = tsp_core.full_state_dict(model)
    assert sorted(got) == sorted(want), sorted(set(got) ^ set(want))
    for name, t in want.items():
        assert torch.equal(got[name], t), f"load_full_state_dict of HF's save_pretrained: {name}"
    model.save_pretrained(os.path.join(root, "tsp"))
    dist.barrier()
    mine, theirs = (load_file(os.path.join(root, d, "model.safetensors")) for d in ("tsp", "hf"))
    assert sorted(mine) == sorted(theirs), sorted(set(mine) ^ set(theirs))
    for name, t in theirs.items():
        assert torch.equal(mine[name], t), f"save_pretrained: {name}"
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(0, ref.config.vocab_size, (2, 24), generator=gen)
    data, sgd = [(ids, ids)], partial(torch.optim.SGD, lr=0.5)
    parity.compare(parity.tsp_record(model, mesh, data, sgd, rows=2),
                   parity.reference_record(ref, data, sgd), parity.FLOAT64,
                   f"ring schedule rank {dist.get_rank()}")
    dist.barrier()


def test_checkpoints_and_the_ring_schedule(pools, tmp_path):
    pools.of(2).run(checkpoints_and_ring, str(tmp_path))


# One MLA layer of count_collectives' shape at D = 2 (float64, 8 bytes; batch 2 x seq 32),
# (calls, bytes per rank) written out by hand, beside the formula (latent_collectives), so that
# a collective added to both the layer and the formula fails. Each head of 8: q_b 12 x 16 (qk
# head 8 + 4 by q_lora_rank 16) = 192, kv_b (8 + 6) x 12 = 168, o 6 x 32 = 192: 552, 4416 for
# all heads; each of the D = 2 broadcasts (and reduces) moves one group's half: 2208 x 8 =
# 17664 bytes in all by the ring rule ((D-1)/D of the 4416). The latent (12 + 4 = 16 per token)
# of 2 x 32 tokens, half of it from the other rank: 512 x 8 = 4096 bytes, once. The 7
# replicated tensors (q_a 16 x 32 + 16, its norm 16, kv_a 16 x 32 + 16, its norm 12, o bias
# 32: 1116 elements) are all-reduced in the backward, 2 (D-1)/D of them: 1116 x 8 = 8928 bytes
MLA_BY_HAND_D2 = {
    "forward": {"broadcast": (2, 17664), "all_gather": (1, 4096)},
    "backward": {"broadcast": (2, 17664), "all_gather": (1, 4096), "reduce": (2, 17664),
                 "reduce_scatter": (1, 4096), "all_reduce": (7, 8928)},
}


def count_collectives(tsp: int) -> None:
    """One MLA layer of the tiny shape, with biases (attention_bias): calls and bytes of each
    pass against the formula, and at D = 2 against :data:`MLA_BY_HAND_D2`."""
    from tsp_core.layers.attention.latent import TSPLatentAttention, latent_collectives

    mesh = dist_pool.mesh(tsp)
    batch, seq = 2, 32
    layer = TSPLatentAttention(mesh, 32, 8, q_lora_rank=16, kv_lora_rank=12, qk_nope_head_dim=8,
                               qk_rope_head_dim=4, v_head_dim=6, attention_bias=True,
                               dtype=torch.float64)
    x = torch.randn(batch, seq // tsp, 32, dtype=torch.float64, requires_grad=True)
    angles = position_ids(seq, mesh.rank, tsp)[None, :, None].double() * 0.1
    cos_sin = (angles.cos().expand(batch, -1, 4), angles.sin().expand(batch, -1, 4))
    with comm.track() as fwd:
        y = layer(x, cos_sin)
    with comm.track() as bwd:
        y.square().sum().backward()
    replicated = [t.numel() for n, t in layer.named_parameters()
                  if layer.shard_spec(n, 0).dim is None]
    assert len(replicated) == 7, replicated  # q_a (w, b), its norm, kv_a (w, b), its norm, o bias
    want = latent_collectives(layer.spec, batch, seq, 8, replicated)
    for what, stats in (("forward", fwd), ("backward", bwd)):
        got = {k: (stats.calls[k], stats.bytes[k]) for k in stats.calls}
        assert got == want[what], f"tsp {tsp} {what}: {got} != {want[what]}"
        if tsp == 2:
            assert got == MLA_BY_HAND_D2[what], f"{what}: {got} != by hand {MLA_BY_HAND_D2[what]}"
    dist.barrier()


def test_collectives_of_one_layer_match_the_formula(pools):
    pools.of(2).run(count_collectives, 2)
    pools.of(4).run(count_collectives, 4)


def greedy_generation(tsp: int, q_lora_rank: int | None) -> list[list[int]]:
    """tsp_core.generate and the model's own generate give Hugging Face's greedy tokens over the
    sequence-sharded latent cache, and every step's logits are HF's float64 logits
    (teacher-forced on the generated sequences) to 1e-8."""
    mesh = dist_pool.mesh(tsp)
    ref = build(q_lora_rank)
    model = tsp_core.parallelize(copy.deepcopy(ref), mesh)
    ids, mask = left_padded(ref.config.vocab_size, [6, 13])
    new = 8
    want = ref.generate(ids, attention_mask=mask, max_new_tokens=new, do_sample=False)
    assert want.shape[1] == ids.shape[1] + new, "the reference stopped early: pick other prompts"
    got, steps = tsp_core.generate(model, ids, new, attention_mask=mask, return_logits=True)
    assert torch.equal(got, want), f"D={tsp}: tokens differ\n{got}\n{want}"
    ref_logits = reference_logits(ref, want, mask, ids.shape[1])
    for t, step in enumerate(steps):
        assert_close(step, ref_logits[t], 1e-8, f"D={tsp} step {t} logits")
    hf_api = model.generate(ids, attention_mask=mask, max_new_tokens=new, do_sample=False)
    assert torch.equal(hf_api, want), f"D={tsp}: model.generate differs\n{hf_api}"
    return got.tolist()


@pytest.mark.parametrize("tsp,q_lora_rank", [(2, 16), (4, None)], ids=str)
def test_greedy_generation_matches_hf(pools, tsp, q_lora_rank):
    # prompts of 6 and 13 tokens (13 is padded to 16 at D = 4), left-padded
    outs = pools.of(tsp).run(greedy_generation, tsp, q_lora_rank)
    assert all(o == outs[0] for o in outs), "ranks generated different tokens"


# ------------------------------------------------------------------- memory rule, fake tensors

# DeepSeek-V3's attention (the published config: h 7168, 128 heads, q_lora_rank 1536,
# kv_lora_rank 512, qk_nope 128, qk_rope 64, v_head 128) as rank 0 of D ranks, bf16
V3 = dict(hidden_size=7168, num_heads=128, q_lora_rank=1536, kv_lora_rank=512,
          qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128)
LOCAL = 2048             # this rank's tokens, at every D
SLACK_PER_TOKEN = 64     # bytes; the gathered latent is 1152 D bytes per local token


def kept_for_backward(D: int) -> int:
    """Bytes one MLA layer's forward leaves alive besides its output (what autograd keeps for
    the backward), rank 0 of a fake D-rank world; the backward then runs too. Runs in a
    session simulation worker (a spawned process), owning the default process group meanwhile."""
    os.environ["OMP_NUM_THREADS"] = "1"
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.mem_tracker import MemTracker, _ModState
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from tsp_core.layers.attention.latent import TSPLatentAttention

    torch.set_num_threads(1)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=D)
    try:
        mesh = tsp_core.init_mesh(D)
        with FakeTensorMode():
            layer = TSPLatentAttention(mesh, dtype=torch.bfloat16, init_seed=None, **V3)
            tracker = MemTracker()
            tracker.track_external(layer)
            with tracker:  # the inputs exist before the forward starts
                x = torch.empty(1, LOCAL, V3["hidden_size"], dtype=torch.bfloat16,
                                requires_grad=True)
                cos_sin = tuple(torch.empty(1, LOCAL, V3["qk_rope_head_dim"],
                                            dtype=torch.bfloat16) for _ in range(2))
                y = layer(x, cos_sin)
                y.backward(torch.empty_like(y))
            snaps = tracker.memory_tracking[layer].snapshots
            (pre,) = snaps[_ModState.PRE_FW][0].values()
            (post,) = snaps[_ModState.POST_FW][0].values()
            return int(post["Total"]) - int(pre["Total"]) - y.numel() * y.element_size()
    finally:
        dist.destroy_process_group()


def local_floor_per_token() -> int:
    """Bytes per local token the layer may keep (bf16, float32 for the norms' statistics): the
    schedule's q input, latent, queries of every head, output and LSE, and what autograd keeps of
    the local down-projections (each RMSNorm's float32 input and normalised output and its
    rsqrt; the rotation of the rotary key keeps only cos and sin, which exist already)."""
    nq, dqk = V3["num_heads"], V3["qk_nope_head_dim"] + V3["qk_rope_head_dim"]
    cq, r, dr = V3["q_lora_rank"], V3["kv_lora_rank"], V3["qk_rope_head_dim"]
    schedule = 2 * cq + 2 * (r + dr) + 2 * nq * (dqk + V3["v_head_dim"]) + 4 * nq
    norms = (4 + 2) * cq + 4 + (4 + 2) * r + 4
    return schedule + norms


def test_the_memory_rule_holds_under_fake_tensors(simulations):
    # in the session's simulation workers (tests/support/simulations.py)
    kept = dict(zip((4, 8), simulations.map(kept_for_backward, (4, 8))))
    floor = local_floor_per_token() * LOCAL
    slack = SLACK_PER_TOKEN * LOCAL
    what = (f"kept for backward at {LOCAL} local tokens: D=4 {kept[4]}, D=8 {kept[8]} bytes; "
            f"local floor {floor} (+ slack {slack})")
    assert abs(kept[8] - kept[4]) <= slack, what  # nothing of the gathered sequence is kept
    assert floor - slack <= kept[8] <= floor + slack, what


def test_the_preset_has_the_published_sizes():
    """`tsp simulate --model deepseek-v3`: the published config.json's sizes (671.03e9
    parameters without the next-token-prediction layer), the latent attention's collectives
    per layer at D = 8 by the formula (docs/benchmarks.md's row); `tsp plan`'s closed forms
    count the same bytes (tests/plan/test_plan.py holds its memory to `tsp simulate`)."""
    from transformers import AutoModelForCausalLM

    from tsp_core.layers.attention.latent import LatentSpec, latent_collectives
    from tsp_core.plan.simulate import model_config
    from tsp_core.plan.traffic import ModelShape

    c = model_config("deepseek-v3")
    assert (c.hidden_size, c.num_hidden_layers, c.num_attention_heads, c.q_lora_rank,
            c.kv_lora_rank, c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim,
            c.n_routed_experts, c.num_experts_per_tok, c.n_group, c.topk_group,
            c.n_shared_experts, c.moe_intermediate_size, c.intermediate_size,
            c.first_k_dense_replace, c.vocab_size) == (7168, 61, 128, 1536, 512, 128, 64, 128,
                                                       256, 8, 8, 4, 1, 2048, 18432, 3, 129280)
    counts = []
    for n in (3, 4):  # the dense layers, then one sparse layer more
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(model_config("deepseek-v3", layers=n))
        counts.append(sum(p.numel() for p in model.parameters()))
    assert counts[0] + 58 * (counts[1] - counts[0]) == 671_026_404_352
    attn = model.model.layers[0].self_attn
    spec = LatentSpec(7168, 128, 1536, 512, 128, 64, 128, 8, attn.scaling)
    fwd = latent_collectives(spec, 1, 131072, 2, [])["forward"]
    assert fwd == {"broadcast": (8, 7 / 8 * 171_966_464 * 2),
                   "all_gather": (1, 7 / 8 * 131072 * 576 * 2)}
    shape = ModelShape.from_config(c)
    assert shape.sharded_attention_weights == 171_966_464
    assert shape.sequence_bytes(8, 1, 131072) == fwd["all_gather"][1]
