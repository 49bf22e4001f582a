"""Mixture-of-experts under TSP (tsp_core.layers.moe, docs/moe.md): tiny Mixtral (4 experts, top 2)
and Qwen3-MoE (8 experts, top 2, normalised top-k, q/k norms, one dense layer) against the
unmodified Hugging Face model on one process in float64: loss including the load-balancing loss over
the global batch, the first step's gradient of every parameter (relative 1e-10, every rank), every
weight after AdamW steps, at tsp 1, 2, 4 and dp 2 x tsp 2, under both schedules; greedy
generation; the all-to-all calls and bytes of one layer against the formula for uniform and skewed
routing; gpt-oss in float16 and GLM-4.5 in bf16 with their float32 norms and router: loss and
gradients within the precision's bounds of Hugging Face's own run, the float32 steps computed in
float32 (low_precision_backward, norm_in_float32, router_in_float32)."""

from __future__ import annotations

import copy
import dataclasses
from functools import partial

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import tsp_core
from tests.inference.test_decode import left_padded
from tests.support import dist_pool, gather, parity
from tests.support.moe_reference import float64_glm_router
from tests.support.reference import assert_close, assert_grads_close
from tsp_core import comm
from tsp_core.layers.moe import TSPMoE

AUX_COEF = 0.3  # large enough that a wrong load-balancing loss moves the loss and the router


def build(family: str, seed: int = 0):
    """A tiny random MoE model in float64 with the router's logits in its output (HF's experts in
    their eager implementation: grouped_mm has no float64 kernel)."""
    torch.manual_seed(seed)
    common = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-6,
                  output_router_logits=True, router_aux_loss_coef=AUX_COEF)
    if family == "mixtral":
        from transformers import MixtralConfig, MixtralForCausalLM

        model = MixtralForCausalLM(MixtralConfig(
            vocab_size=96, intermediate_size=48, num_local_experts=4, num_experts_per_tok=2,
            sliding_window=7, **common))
    elif family == "qwen3_moe":
        from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

        model = Qwen3MoeForCausalLM(Qwen3MoeConfig(
            vocab_size=96, intermediate_size=64, moe_intermediate_size=16, num_experts=8,
            num_experts_per_tok=2, norm_topk_prob=True, head_dim=16, mlp_only_layers=[1],
            **common))
        with torch.no_grad():  # q/k norms away from their initial ones
            for name, p in model.named_parameters():
                if name.endswith("norm.weight"):
                    p.add_(0.1 * torch.randn(p.shape))
    elif family == "glm4_moe":
        model = glm4_moe()
    elif family == "gpt_oss":
        model = gpt_oss(common)
    else:
        raise ValueError(family)
    with torch.no_grad():  # a router that prefers some experts: routing far from uniform
        for name, p in model.named_parameters():
            if name.endswith(("mlp.gate.weight", "mlp.router.weight")):
                p.normal_(0, 0.5)
    model.set_experts_implementation("eager")
    return model.to(torch.float64)


def gpt_oss(common: dict, **overrides):
    """gpt-oss with every feature on: biases on every attention projection, sinks of a few units
    (they take a real share of each softmax row), sliding (window 5) and full layers
    alternating, yarn rotary (its attention factor scales cos and sin); 4 experts, top 2 by a
    softmax over the top logits of a router with a bias; experts with biases, gate and up in
    alternate columns, and a swiglu_limit low enough that the clamps cut a good share of the
    gates and ups (test_gpt_oss_build_exercises_every_feature counts them)."""
    from transformers import GptOssConfig, GptOssForCausalLM

    config = dict(vocab_size=96, intermediate_size=16, num_local_experts=4,
                  num_experts_per_tok=2, head_dim=8, sliding_window=5, swiglu_limit=0.6,
                  swiglu_alpha=1.702, **{**common, "num_hidden_layers": 2})
    model = GptOssForCausalLM(GptOssConfig(**{**config, **overrides}))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("sinks"):
                p.copy_(2 * torch.randn(p.shape))
            elif name.endswith(("bias", "norm.weight")):
                p.add_(0.3 * torch.randn(p.shape))
            elif name.endswith(("gate_up_proj", "down_proj")):
                p.normal_(0, 0.3)
    return model


def glm4_moe(**overrides):
    """GLM-4.5 with every feature on: sigmoid routing over 8 experts in n_group 2 groups of which
    topk_group 1 holds the top 2, routed_scaling_factor 2.5, a random non-zero correction bias
    (it changes the choice of many tokens: test_glm4_moe_build_exercises_every_feature), one
    shared expert, layer 0 dense (first_k_dense_replace 1), partial rotary (half the head on
    rotate-half channels), q/k norms away from one, norm_topk_prob. Its router computes in
    float32 even in a float64 model (``hidden_states.type(torch.float32)``): its weight gradient
    would be a float32 sum, ~1e-7 off any other order, so the reference's routers run the same
    code in the model's dtype when it is wider (tests/support/moe_reference.py)."""
    from transformers import Glm4MoeConfig, Glm4MoeForCausalLM

    config = dict(vocab_size=96, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                  n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1,
                  routed_scaling_factor=2.5, n_shared_experts=1, first_k_dense_replace=1,
                  use_qk_norm=True, norm_topk_prob=True, partial_rotary_factor=0.5,
                  max_position_embeddings=128, rms_norm_eps=1e-6, output_router_logits=True)
    model = Glm4MoeForCausalLM(Glm4MoeConfig(**{**config, **overrides}))
    with torch.no_grad():  # from build's seed: another seed, another bias
        for name, t in model.state_dict().items():
            if name.endswith("norm.weight"):
                t.add_(0.1 * torch.randn(t.shape))
            if name.endswith("e_score_correction_bias"):
                t.copy_(0.3 * torch.randn(t.shape))
    float64_glm_router(model)
    return model


def aux_reference(router_logits, num_experts: int, top_k: int) -> torch.Tensor:
    """Hugging Face's load_balancing_loss_func in float64 (its own sums run in float32)."""
    counts = torch.zeros(num_experts, dtype=torch.float64)
    probs_sum = torch.zeros(num_experts, dtype=torch.float64)
    rows = 0
    for logits in router_logits:
        probs = torch.softmax(logits, -1)
        chosen = torch.topk(probs, top_k, -1).indices.reshape(-1)
        counts += torch.bincount(chosen, minlength=num_experts).to(torch.float64)
        probs_sum += probs.sum(0)
        rows += probs.shape[0]
    return (counts / rows * (probs_sum / rows)).sum() * num_experts


def reference_loss(model, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Cross-entropy from HF's logits in float64 plus the aux loss from its router logits in
    float64 (HF's own loss and aux sums run in float32)."""
    out = model(input_ids=ids, output_router_logits=True)
    shifted = F.pad(labels, (0, 1), value=-100)[:, 1:]
    ce = F.cross_entropy(out.logits.flatten(0, 1), shifted.flatten(), ignore_index=-100)
    c = model.config
    if c.model_type == "glm4_moe":  # no load-balancing loss (its correction bias balances)
        return ce
    experts = getattr(c, "num_local_experts", None) or c.num_experts
    return ce + AUX_COEF * aux_reference(out.router_logits, experts, c.num_experts_per_tok)


def aux_loss_present(present: bool, out) -> None:
    """A TSP step's output carries the load-balancing loss exactly when the family has one
    (GLM-4.5 has none: its correction bias balances)."""
    aux = getattr(out, "aux_loss", None)
    assert (aux is not None) == present, aux


def moe_parity(family: str, tsp: int, schedule: str = "expert", seq: int = 16,
               steps: int = 3) -> parity.Parity:
    """``steps`` AdamW steps (lr 1e-2) of 2 rows of ``seq`` tokens per replica under
    ``schedule``, the loss with the load-balancing loss (:func:`reference_loss`): losses and
    first gradients to 1e-10, weights to 1e-8, every rank (tests/support/parity.py)."""
    return parity.Parity(
        partial(build, family), tsp, steps=steps, seq=seq,
        optimizer=partial(torch.optim.AdamW, lr=1e-2), reference_loss=reference_loss,
        options=dict(moe_schedule=schedule),
        check_output=partial(aux_loss_present, family != "glm4_moe"),
        name=f"{family} {schedule}")


CONFIGS = [(1, 1), (2, 2), (4, 4), (4, 2)]   # (world size, tsp size); (4, 2) is dp 2 x tsp 2


MOE_FAMILIES = ["mixtral", "qwen3_moe", "glm4_moe", "gpt_oss"]


@pytest.mark.parametrize("world,tsp", CONFIGS, ids=lambda v: str(v))
@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_training_parity_float64(pools, family, world, tsp):
    parity.assert_same_losses(pools.of(world).run(parity.train_parity,
                                                  moe_parity(family, tsp)))


def test_load_balancing_loss_skips_tsp_padding(pools):
    """14 tokens at tsp 2 are padded to 16 by shard_batch, which marks the two it added in the
    attention_mask it returns: the aux loss counts only the real tokens, like one process."""
    pools.of(2).run(parity.train_parity, moe_parity("mixtral", 2, seq=14, steps=1))


@pytest.mark.parametrize("world,tsp", [(2, 2), (4, 4), (4, 2)], ids=lambda v: str(v))
@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_ring_schedule_training_parity_float64(pools, family, world, tsp):
    """The other schedule: every expert's channels split 1/D, the slices circulating."""
    parity.assert_same_losses(pools.of(world).run(parity.train_parity,
                                                  moe_parity(family, tsp, "ring")))


def test_schedule_chosen_by_the_bytes_formula():
    """"auto" picks the schedule that moves fewer bytes per layer by the traffic model's formula:
    below the crossover T* the expert schedule, above it the ring (Qwen3-30B-A3B's shape at
    D = 8: 4 T k h b (D-1)/D plus the counts against 3 E F h b (3D-2)/D plus the same router
    all-reduce, T* = 28964.6 tokens per rank)."""
    from tsp_core.layers.moe import MoESpec, choose_schedule, moe_bytes

    spec = MoESpec(2048, 768, 128, 8, 8)
    E, k, F_, h, D, b = 128, 8, 768, 2048, 8, 2
    for t in (1024, 28964, 28965, 65536):
        got = moe_bytes(E, k, F_, h, t, D)
        router = 2 * E * h * b * (D - 1) / D
        assert got.a == pytest.approx(4 * t * k * h * b * (D - 1) / D + 8 * E * (D - 1) / D
                                      + router)
        assert got.b == pytest.approx(3 * E * F_ * h * b * (3 * D - 2) / D + router)
        assert choose_schedule(spec, t) == ("expert" if got.a <= got.b else "ring"), t
    assert choose_schedule(spec, 28964) == "expert" and choose_schedule(spec, 28965) == "ring"
    assert choose_schedule(spec, None) == "expert"
    # shared experts (GLM-4.5): the dense TSP MLP under both schedules, no token moves: their
    # slices add 3 Fs h b (D-1)/D forward and (2D-1)/D of it backward to both; same crossover
    Fs = 2 * 768
    shared = dataclasses.replace(spec, shared_intermediate_size=Fs)
    for t in (1024, 65536):
        plain, got = moe_bytes(E, k, F_, h, t, D), moe_bytes(E, k, F_, h, t, D, shared=Fs)
        dense = 3 * Fs * h * b * (3 * D - 2) / D
        assert (got.a - plain.a, got.b - plain.b) == (pytest.approx(dense), pytest.approx(dense))
        assert got.crossover == plain.crossover
    assert choose_schedule(shared, 28964) == "expert" and choose_schedule(shared, 28965) == "ring"


def test_glm4_moe_build_exercises_every_feature():
    """The GLM-4.5 of the parity tests has every feature on and each one matters: layer 0 dense,
    layer 1 sparse with a shared expert; partial rotary, q/k norms; and on the hidden states
    its router really sees, TSP's route gives Hugging Face's router's experts and weights, while
    dropping the correction bias, the groups or routed_scaling_factor would change them."""
    from tsp_core.layers.moe import MoESpec, route

    model = build("glm4_moe")
    c, layers = model.config, model.model.layers
    assert [type(layer.mlp).__name__ for layer in layers] == ["Glm4MoeMLP", "Glm4MoeMoE"]
    assert c.rope_parameters["partial_rotary_factor"] == 0.5 and layers[1].self_attn.use_qk_norm
    gate = layers[1].mlp.gate
    seen = []
    hook = gate.register_forward_hook(lambda m, args, out: seen.append((args[0], out)))
    ids, _ = parity.batches(c.vocab_size, 2, 16, 1)[0]
    with torch.no_grad():
        model(input_ids=ids)
    hook.remove()
    (_, (logits, want_w, want_e)), = seen
    spec = MoESpec(c.hidden_size, c.moe_intermediate_size, 8, 2, 1, router="sigmoid",
                   routed_scaling=2.5, n_group=2, topk_group=1, correction_bias=True)
    bias = gate.e_score_correction_bias
    w, e = route(logits, spec, bias)
    order, want_order = e.sort(-1), want_e.sort(-1)
    assert torch.equal(order.values, want_order.values)
    assert_close(w.gather(1, order.indices), want_w.gather(1, want_order.indices), 1e-15,
                 "route vs Hugging Face's router")
    for what, other, other_bias in (
            ("the correction bias", spec, None),
            ("the groups", dataclasses.replace(spec, n_group=1, topk_group=1), bias)):
        alt = route(logits, other, other_bias)[1].sort(-1).values
        changed = (alt != order.values).any(-1).sum().item()
        assert changed >= 4, f"{what} changes {changed} tokens' experts: too few to be seen"
    unscaled = route(logits, dataclasses.replace(spec, routed_scaling=1.0), bias)[0]
    assert_close(w, 2.5 * unscaled, 1e-15, "routed_scaling_factor")
    # the tensor-parallel baselines' experts know only the softmax router: their family list
    # refuses GLM-4.5 (before any process group), it does not run without its router
    from tsp_core.baselines import build as build_baseline
    from tsp_core.baselines import layout_specs

    (tp,) = layout_specs("tp", 2)
    with pytest.raises(NotImplementedError, match=r"layout tp: the baselines are built and "
                                                  r"tested for .*mixtral, not glm4_moe"):
        build_baseline(model, tp)


def test_gpt_oss_build_exercises_every_feature():
    """The gpt-oss of the parity tests has every feature on and each one matters, on the hidden
    states its layers really see: the clamps cut at least a tenth of the gates and of the ups,
    the expert and router biases and the sinks are far from zero, the yarn rotary's attention
    factor is not 1, and both layer kinds are there. TSP's route gives Hugging Face's router's
    experts and weights (in exact arithmetic those of Mixtral's softmax renormalised over the
    top k; a softmax over every logit not renormalised would not give them)."""
    from tsp_core.layers.moe import MoESpec, expert_views, glu, route

    model = build("gpt_oss")
    c, layers = model.config, model.model.layers
    assert c.layer_types == ["sliding_attention", "full_attention"], c.layer_types
    assert model.model.rotary_emb.attention_scaling > 1.1
    mlp = layers[1].mlp
    seen = []
    hooks = [mlp.router.register_forward_hook(lambda m, a, out: seen.append((a[0], out)))]
    ids, _ = parity.batches(c.vocab_size, 2, 16, 1)[0]
    with torch.no_grad():
        model(input_ids=ids)
    for hook in hooks:
        hook.remove()
    (x, (_, want_w, want_e)), = seen
    spec = MoESpec(c.hidden_size, c.intermediate_size, 4, 2, 1, router="topk_softmax",
                   router_bias=True, layout="interleaved", expert_bias=True,
                   activation="swiglu_clamped", swiglu_limit=c.swiglu_limit,
                   swiglu_alpha=c.swiglu_alpha)
    logits = F.linear(x, mlp.router.weight, mlp.router.bias)
    w, e = route(logits, spec)
    assert torch.equal(e, want_e)
    assert_close(w, want_w, 1e-15, "route vs Hugging Face's router")
    other = route(logits, dataclasses.replace(spec, router="softmax", norm_topk=False))[0]
    assert (other - w).abs().max() > 1e-2, "the top-k softmax is not seen in these weights"
    ex = mlp.experts
    tensors = [ex.gate_up_proj.detach(), ex.down_proj.detach(), ex.gate_up_proj_bias.detach()]
    cut_gate = cut_up = 0
    for k in range(4):
        wg, wu, _, bg, bu = expert_views(spec, tensors, k)
        g, u = F.linear(x, wg, bg), F.linear(x, wu, bu)
        cut_gate += (g > c.swiglu_limit).sum().item()
        cut_up += (u.abs() > c.swiglu_limit).sum().item()
        assert not torch.equal(glu(g, u, spec),
                               glu(g, u, dataclasses.replace(spec, swiglu_limit=1e9)))
    rows = 4 * x.shape[0] * c.intermediate_size
    assert cut_gate > rows / 10 and cut_up > rows / 10, (cut_gate, cut_up, rows)
    for name, p in model.named_parameters():
        if name.endswith(("sinks", "bias")):
            assert p.abs().mean() > 0.1, f"{name} is near zero: it would not be seen"


# Low precision (bf16, fp16) against Hugging Face's own run in that precision. A run rounds each
# matmul's inputs and output to the precision's unit roundoff u; a gradient passes about k = 20
# such roundings, and two runs that round in different places differ by sqrt(2 k) u = 6.3 u
# (tests/support/precision.py, which derives G = 9 u for bf16): the loss and every gradient,
# norm-wise, within G = 9 u of Hugging Face's. What Hugging Face keeps float32 in such a model
# (gpt-oss's norm weights, GLM-4.5's router) must compute in float32 in TSP too: one rounding to
# u there is within G of the whole model, so that is checked on the layer itself, where both
# compute from the same inputs and may differ only in the order of float32 sums
# (:func:`float32_sums_agree`).
BF16_U, FP16_U, FLOAT32_U = 2.0 ** -8, 2.0 ** -11, 2.0 ** -24


def low_precision_backward(ref, model, mesh, ids, labels, u: float, what: str) -> None:
    """The TSP ``model``'s loss and gradients (one backward of ``ids``) against the unmodified
    ``ref`` run in the same low precision (unit roundoff ``u``): the loss within 2 G, every
    gradient within G norm-wise (G = 9 u), every parameter's gradient present and of the
    parameter's dtype, on every rank."""
    from tests.support.precision import relative_error

    want = ref(input_ids=ids, labels=labels).loss
    got = model(**tsp_core.shard_batch({"input_ids": ids, "labels": labels}, mesh)).loss
    assert abs(got.item() - want.item()) <= 2 * 9 * u * abs(want.item()), \
        f"{what}: loss {got.item()} vs {want.item()} (> 2 G = 18 u relative)"
    want.backward()
    got.backward()
    grads, refs = gather.full_grads(model), {n: p.grad for n, p in ref.named_parameters()}
    assert sorted(grads) == sorted(refs), f"{what}: {sorted(set(grads) ^ set(refs))}"
    for name, g in refs.items():
        assert grads[name].dtype == g.dtype, (what, name, grads[name].dtype, g.dtype)
    err = relative_error(grads, refs)
    assert err <= 9 * u, f"{what}: gradients {err / u:.2f} u from Hugging Face's (> G = 9 u)"
    dist.barrier()


def float32_sums_agree(got: torch.Tensor, want: torch.Tensor, magnitude: torch.Tensor, n: int,
                       what: str) -> None:
    """``got`` and ``want`` are the same float32 sums of ``n`` terms in two orders: each element
    within 2 n u32 of the sum of its terms' magnitudes (``magnitude``, the bound of recursive
    summation, twice). A step computed in bf16 or fp16 instead is off by about their u, 2^16 or
    2^13 times u32."""
    assert got.dtype == want.dtype == torch.float32, (what, got.dtype, want.dtype)
    bound = 2 * n * FLOAT32_U * magnitude
    excess = ((got - want).abs() / bound).max().item()
    assert excess <= 1, f"{what}: off by {excess:.3g} x 2 n u32 of its terms' magnitude (n {n})"


def router_in_float32(moe, gate, mesh) -> None:
    """GLM-4.5's float32 router in a bf16 model computes in float32 (HF casts the bf16 input up):
    on this rank's bf16 tokens TSP's router logits are Hugging Face's, and the router weight's
    gradient through them (summed over the ranks) is Hugging Face's, each to float32's sums."""
    h = gate.weight.shape[1]
    gen = torch.Generator().manual_seed(40 + mesh.rank)
    x = torch.randn(2, 8, h, generator=gen).to(torch.bfloat16)
    r = torch.randn(16, gate.weight.shape[0], generator=gen)
    moe(x.clone().requires_grad_())
    (moe.router_logits * r).sum().backward()
    got_w = gather.full_grads(moe)["gate.weight"]
    gate.weight.grad = None
    logits = type(gate).forward(gate, x)[0]  # Hugging Face's router, unmodified
    (logits * r).sum().backward()
    want_w = gate.weight.grad.clone()
    dist.all_reduce(want_w, group=mesh.group)
    xf = x.reshape(-1, h).float()
    float32_sums_agree(moe.router_logits, logits.detach(), xf.abs() @ gate.weight.abs().T, h,
                       f"router logits, rank {mesh.rank}")
    magnitude = r.abs().T @ xf.abs()
    dist.all_reduce(magnitude, group=mesh.group)
    float32_sums_agree(got_w, want_w, magnitude, 16 * mesh.size, f"router weight gradient, "
                       f"rank {mesh.rank}")
    gate.weight.grad = None
    moe.zero_grad()


def glm4_moe_variants(tsp: int) -> None:
    """GLM-4.5 with its options off (no q/k norms, a single group, scaling 1):
    one float64 step's loss to 1e-10 and every first-step gradient to 1e-10, at ``tsp``; and in
    bf16 with its float32 router."""
    mesh = dist_pool.mesh(tsp)
    torch.manual_seed(4)
    ref = glm4_moe(use_qk_norm=False, n_group=1, routed_scaling_factor=1.0)
    ref.set_experts_implementation("eager")
    ref = ref.to(torch.float64)
    model = tsp_core.parallelize(copy.deepcopy(ref), mesh)
    assert not any("q_norm" in n for n in ref.state_dict())
    ids, labels = parity.batches(ref.config.vocab_size, 2, 16, 1)[0]
    expected = reference_loss(ref, ids, labels)
    out = model(**tsp_core.shard_batch({"input_ids": ids, "labels": labels}, mesh))
    assert_loss(out.loss.item(), expected.item(), f"glm4_moe without options at tsp {tsp}")
    expected.backward()
    out.loss.backward()
    assert_grads_close(gather.full_grads(model),
                       {n: p.grad for n, p in ref.named_parameters()}, 1e-10,
                       f"glm4_moe without options at tsp {tsp}")
    # bf16 as from_pretrained loads it: the router weight and the correction bias stay float32
    # (_keep_in_fp32_modules_strict), in TSP and in its full state dict; the loss and every
    # gradient are HF's bf16 run's within bf16's bounds, and the router computes in float32
    torch.manual_seed(4)
    ref = glm4_moe()
    ref.set_experts_implementation("eager")
    ref = ref.to(torch.bfloat16)
    with torch.no_grad():
        for module in ref.modules():
            if type(module).__name__ == "Glm4MoeTopkRouter":
                module.weight.data = module.weight.data.float()
                module.e_score_correction_bias.data = module.e_score_correction_bias.float()
    model = tsp_core.parallelize(copy.deepcopy(ref), mesh)
    full = tsp_core.full_state_dict(model)
    for name in ("gate.weight", "gate.e_score_correction_bias"):
        name = f"model.layers.1.mlp.{name}"
        assert full[name].dtype == torch.float32, (name, full[name].dtype)
        assert torch.equal(full[name], ref.state_dict()[name]), name
    router_in_float32(model.model.layers[1].mlp, ref.model.layers[1].mlp.gate, mesh)
    low_precision_backward(ref, model, mesh, ids, labels, BF16_U, "glm4_moe bf16")


def test_glm4_moe_with_its_options_off(pools):
    pools.of(2).run(glm4_moe_variants, 2)


# ------------------------------------------------------------------------- greedy generation

def greedy_generation(family: str, tsp: int, lengths: list[int], new: int,
                      schedule: str = "expert") -> list[list[int]]:
    """tsp_core.generate and the parallelized model's own generate give HF's greedy tokens, and
    every step's logits are HF's float64 logits (teacher-forced on the generated sequences) to
    1e-8: the prefill runs the all-to-all dispatch, each decode step TSPMoE.decode_step."""
    mesh = dist_pool.mesh(tsp)
    ref = build(family)
    model = tsp_core.parallelize(copy.deepcopy(ref), mesh, moe_schedule=schedule)
    # Hugging Face's generate fails with it (transformers 5.24: its load_balancing_loss_func
    # gets a [B, S] attention mask for the one-token decode steps' router logits)
    ref.config.output_router_logits = False
    ids, mask = left_padded(ref.config.vocab_size, lengths)
    want = ref.generate(ids, attention_mask=mask, max_new_tokens=new, do_sample=False)
    assert want.shape[1] == ids.shape[1] + new, "the reference stopped early: pick other prompts"
    got, steps = tsp_core.generate(model, ids, new, attention_mask=mask, return_logits=True)
    assert torch.equal(got, want), f"{family} D={tsp}: tokens differ\n{got}\n{want}"
    full_mask = torch.cat([mask, mask.new_ones(mask.shape[0], new)], dim=1)
    pos = (full_mask.cumsum(1) - 1).clamp(min=0)
    with torch.no_grad():
        ref_logits = ref(input_ids=want, attention_mask=full_mask, position_ids=pos).logits
    ref_logits = ref_logits[:, ids.shape[1] - 1:-1].transpose(0, 1)
    assert len(steps) == new
    for t, step in enumerate(steps):
        assert_close(step, ref_logits[t], 1e-8, f"{family} D={tsp} step {t} logits")
    hf_api = model.generate(ids, attention_mask=mask, max_new_tokens=new, do_sample=False)
    assert torch.equal(hf_api, want), f"{family} D={tsp}: model.generate differs\n{hf_api}"
    return got.tolist()


@pytest.mark.parametrize("tsp", [2, 4])
@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_greedy_generation_matches_hf(pools, family, tsp):
    # prompts of 6 and 13 tokens (13 is padded to 16 at D = 4), left-padded; 13 + 8 tokens run
    # past Mixtral's sliding window of 7
    outs = pools.of(tsp).run(greedy_generation, family, tsp, [6, 13], 8)
    assert all(o == outs[0] for o in outs), "ranks generated different tokens"


def test_greedy_generation_ring_schedule(pools):
    outs = pools.of(2).run(greedy_generation, "qwen3_moe", 2, [6, 13], 8, "ring")
    assert all(o == outs[0] for o in outs), "ranks generated different tokens"


# ------------------------------------------------------------------------------- checkpoints

CKPT_STEPS = 2


def reference_steps(family: str):
    """One process: the loss of each of CKPT_STEPS AdamW steps on 2 rows of 16 tokens, and the
    full state dict after each step."""
    ref = build(family)
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    losses, states = [], []
    for ids, labels in parity.batches(ref.config.vocab_size, 2, 16, CKPT_STEPS):
        loss = reference_loss(ref, ids, labels)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        states.append({k: v.clone() for k, v in ref.state_dict().items()})
    return losses, states


def tsp_step(model, opt, mesh, ids, labels) -> float:
    out = model(**tsp_core.shard_batch({"input_ids": ids, "labels": labels}, mesh))
    out.loss.backward()
    opt.step()
    opt.zero_grad()
    return out.loss.item()


def assert_loss(got: float, want: float, what: str) -> None:
    assert abs(got - want) <= 1e-10 * abs(want), f"{what}: loss {got!r} vs {want!r}"


def assert_state(got: dict, want: dict, what: str, tol: float = 1e-8) -> None:
    assert sorted(got) == sorted(want), f"{what}: {sorted(set(got) ^ set(want))}"
    for name, t in want.items():
        assert_close(got[name], t, tol, f"{what}: {name}")


def save_at_tsp2(family: str, root: str, schedule: str = "expert") -> float:
    """Step 1 at tsp 2, then save_checkpoint (model + AdamW state) and save_pretrained; a plain
    model from_pretrained has the saved weights bit for bit; step 2 continues like one process."""
    import os

    mesh = dist_pool.mesh(2)
    losses, states = reference_steps(family)
    model = tsp_core.parallelize(build(family), mesh, moe_schedule=schedule)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    data = parity.batches(model.config.vocab_size, 2, 16, CKPT_STEPS)
    assert_loss(tsp_step(model, opt, mesh, *data[0]), losses[0], "step 1 at tsp 2")
    tsp_core.save_checkpoint(os.path.join(root, "dcp_d2"), model, opt, step=1)
    saved = tsp_core.full_state_dict(model)
    assert_state(saved, states[0], "after step 1 at tsp 2")
    model.save_pretrained(os.path.join(root, "hf_d2"))
    dist.barrier()
    plain = type(build(family)).from_pretrained(os.path.join(root, "hf_d2"),
                                                dtype=torch.float64)
    got = plain.state_dict()
    assert sorted(got) == sorted(saved)
    # GLM-4.5's router weight and correction bias: from_pretrained keeps them float32 whatever
    # dtype= says (_keep_in_fp32_modules_strict); the files hold them bit for bit
    kept = getattr(plain, "_keep_in_fp32_modules_strict", None) or []
    on_disk = {}
    if kept:
        from safetensors.torch import load_file

        for f in sorted(os.listdir(os.path.join(root, "hf_d2"))):
            if f.endswith(".safetensors"):
                on_disk.update(load_file(os.path.join(root, "hf_d2", f)))
    for name, t in saved.items():
        if any(k in name for k in kept):
            assert torch.equal(on_disk[name], t), f"save_pretrained at tsp 2 wrote {name}"
            t = t.to(torch.float32)
        assert got[name].dtype == t.dtype and torch.equal(got[name], t), \
            f"from_pretrained of save_pretrained at tsp 2: {name}"
    loss = tsp_step(model, opt, mesh, *data[1])
    assert_loss(loss, losses[1], "step 2 at tsp 2")
    assert_state(tsp_core.full_state_dict(model), states[1], "after step 2 at tsp 2")
    dist.barrier()
    return loss


def resume(family: str, tsp: int, root: str, saver_loss: float,
           schedule: str = "expert") -> None:
    """Load the tsp-2 checkpoint into a fresh model (other weights) and a fresh AdamW at ``tsp``
    (and, at tsp 1, into the plain Hugging Face model and a plain AdamW): step 2 gives the
    saving model's loss, and the weights after it are one process's (AdamW's moments and step
    count must have been loaded for that)."""
    import os

    mesh = dist_pool.mesh(tsp)
    losses, states = reference_steps(family)
    path = os.path.join(root, "dcp_d2")
    ids, labels = parity.batches(build(family).config.vocab_size, 2, 16, CKPT_STEPS)[1]
    model = tsp_core.parallelize(build(family, seed=11), mesh, moe_schedule=schedule)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    assert tsp_core.load_checkpoint(path, model, opt) == {"step": 1}
    assert_state(tsp_core.full_state_dict(model), states[0], f"loaded at tsp {tsp}", 1e-12)
    loss = tsp_step(model, opt, mesh, ids, labels)
    assert_loss(loss, saver_loss, f"step 2 resumed at tsp {tsp} vs the saving model")
    assert_loss(loss, losses[1], f"step 2 resumed at tsp {tsp} vs one process")
    assert_state(tsp_core.full_state_dict(model), states[1], f"after step 2 resumed at tsp {tsp}")
    if tsp == 1:
        plain = build(family, seed=12)
        plain_opt = torch.optim.AdamW(plain.parameters(), lr=1e-2)
        assert tsp_core.load_checkpoint(path, plain, plain_opt) == {"step": 1}
        assert_state(plain.state_dict(), states[0], "loaded into the plain model", 1e-12)
        loss = reference_loss(plain, ids, labels)
        loss.backward()
        plain_opt.step()
        assert_loss(loss.item(), saver_loss, "step 2 of the plain model vs the saving model")
        assert_state(plain.state_dict(), states[1], "after step 2 of the plain model")
    dist.barrier()


@pytest.mark.parametrize("family,saved,loaded", [
    ("mixtral", "expert", "expert"), ("mixtral", "ring", "expert"),
    ("qwen3_moe", "expert", "ring"), ("glm4_moe", "ring", "expert"),
    ("gpt_oss", "expert", "ring")])
def test_checkpoint_saved_at_tsp2_resumes_at_4_1_and_plain(pools, tmp_path, family, saved,
                                                           loaded):
    # across schedules too: a checkpoint holds Hugging Face's tensors, whatever the layout
    saver = pools.of(2).run(save_at_tsp2, family, str(tmp_path), saved)
    assert all(v == saver[0] for v in saver)
    pools.of(4).run(resume, family, 4, str(tmp_path), saver[0], loaded)
    pools.of(1).run(resume, family, 1, str(tmp_path), saver[0], loaded)


def load_hf_saved(family: str, root: str, schedule: str = "expert") -> None:
    """A checkpoint written by Hugging Face's own save_pretrained (transformers 5 writes the
    per-expert layout of the Hub checkpoints: Mixtral's block_sparse_moe.experts.<e>.w1/w2/w3,
    Qwen3-MoE's and GLM-4.5's mlp.experts.<e>.gate_proj/up_proj/down_proj, GLM-4.5's correction
    bias and shared experts as they are) loads into a TSP model with load_full_state_dict and
    tsp_transformers.load_pretrained, giving the model's weights and buffers."""
    import os

    from tsp_transformers import load_pretrained

    mesh = dist_pool.mesh(2)
    ref = build(family)
    want = ref.state_dict()
    path = os.path.join(root, f"hf_own_{family}")
    if dist.get_rank() == 0:
        ref.save_pretrained(path)
    dist.barrier()
    model = tsp_core.parallelize(build(family, seed=5), mesh, moe_schedule=schedule)
    tsp_core.load_full_state_dict(model, path)
    assert_state(tsp_core.full_state_dict(model), want, "load_full_state_dict", 0.0)
    loaded = load_pretrained(path, mesh=mesh, dtype=torch.float64)
    assert_state(tsp_core.full_state_dict(loaded), want, "tsp_transformers.load_pretrained", 0.0)
    dist.barrier()


@pytest.mark.parametrize("family,schedule", [("mixtral", "expert"), ("qwen3_moe", "expert"),
                                             ("mixtral", "ring"), ("glm4_moe", "expert"),
                                             ("gpt_oss", "ring")])
def test_hf_saved_checkpoint_loads_into_tsp(pools, tmp_path, family, schedule):
    pools.of(2).run(load_hf_saved, family, str(tmp_path), schedule)


# ------------------------------------------------------------ collectives of one MoE layer

TRAFFIC = dict(hidden=16, intermediate=8, experts=8, top_k=2, rows=2, seq=16)


def routed_layer(tsp: int, case: str, schedule: str = "expert", shared: int = 0):
    """A TSPMoE whose routing is set by construction, on this rank's tokens x [rows, seq/D, h],
    and the experts [N, k] every token must pick. The router reads expert e's logit from
    feature e (uniform) or experts 0..k-1 from feature 0, positive on every token (skewed)."""
    from tsp_core.layers.moe import TSPMoE

    c = TRAFFIC
    mesh = dist_pool.mesh(tsp)
    p, h, E, k = mesh.rank, c["hidden"], c["experts"], c["top_k"]
    N = c["rows"] * c["seq"] // tsp
    gen = torch.Generator().manual_seed(21)  # the same weights on every rank
    router = torch.zeros(E, h, dtype=torch.float64)
    x = 0.1 * torch.randn(N, h, generator=torch.Generator().manual_seed(30 + p),
                          dtype=torch.float64)
    if case == "uniform":  # token t of rank p: experts (t k + p + j) mod E, j < k: balanced
        router[:, :E] = 4 * torch.eye(E, dtype=torch.float64)
        x[:, :E] = 0
        chosen = torch.tensor([[(t * k + p + j) % E for j in range(k)] for t in range(N)])
        for j in range(k):
            x[torch.arange(N), chosen[:, j]] = 2.0 - 0.5 * j
    elif case == "skewed":  # every token: experts 0..k-1 (owned by rank 0)
        router[:k, 0] = torch.arange(k, 0, -1, dtype=torch.float64) + 2
        x[:, 0] = 1 + x[:, 0].abs()
        chosen = torch.arange(k).repeat(N, 1)
    else:
        raise ValueError(case)
    moe = TSPMoE(mesh, h, c["intermediate"], E, k, dtype=torch.float64, schedule=schedule,
                 shared_intermediate_size=shared)
    F_ = c["intermediate"]
    full = {"gate.weight": router,
            "experts.gate_up_proj": 0.3 * torch.randn(E, 2 * F_, h, generator=gen,
                                                      dtype=torch.float64),
            "experts.down_proj": 0.3 * torch.randn(E, h, F_, generator=gen, dtype=torch.float64)}
    for name, shape in {"gate_proj": (shared, h), "up_proj": (shared, h),
                        "down_proj": (h, shared)}.items() if shared else ():
        full[f"shared_experts.{name}.weight"] = 0.3 * torch.randn(shape, generator=gen,
                                                                   dtype=torch.float64)
    moe.load_full(full)
    return mesh, moe, x.view(c["rows"], -1, h), chosen


def expected_log(tsp: int, counts: list[list[int]], rank: int):
    """(forward log, backward log) of one rank by comm's rule, from every rank's per-expert
    counts, and the bytes of the rows that really leave / reach the rank (dispatch)."""
    c = TRAFFIC
    D, E, h = tsp, c["experts"], c["hidden"]
    per, frac, row = E // D, (D - 1) / D, h * 8
    send = [[sum(counts[q][r * per:(r + 1) * per]) for r in range(D)] for q in range(D)]
    sent, received = sum(send[rank]), sum(send[q][rank] for q in range(D))
    leave = (sent - send[rank][rank]) * row
    arrive = (received - send[rank][rank]) * row
    rows = max(leave, arrive)  # comm.all_to_all: the larger of what leaves and what arrives
    forward = [("all_to_all", E * 8 * frac), ("all_to_all", rows), ("all_to_all", rows)]
    backward = [("all_to_all", rows), ("all_to_all", rows), ("all_reduce", 2 * E * h * 8 * frac)]
    return forward, backward, (leave, arrive)


def layer_traffic(tsp: int, case: str, shared: int = 0) -> dict:
    from tsp_core.layers.moe import route

    mesh, moe, x, chosen = routed_layer(tsp, case, shared=shared)
    x.requires_grad_(True)
    E = TRAFFIC["experts"]
    with comm.track() as fwd:
        y = moe(x)
    experts = route(moe.router_logits, moe.spec)[1]
    assert torch.equal(experts.sort(-1).values, chosen.sort(-1).values), "routing not as built"
    mine = torch.bincount(chosen.reshape(-1), minlength=E)
    every = [torch.zeros_like(mine) for _ in range(tsp)]
    dist.all_gather(every, mine, group=mesh.group)  # raw: not counted
    counts = [t.tolist() for t in every]
    want_fwd, want_bwd, (leave, arrive) = expected_log(tsp, counts, mesh.rank)
    # shared experts: the dense TSP MLP's ring, its slices D-1 hops forward, 2D-1 backward
    dense = ("ring_pass", 3 * shared // tsp * TRAFFIC["hidden"] * 8)
    want_fwd, want_bwd = (want_fwd + [dense] * (tsp - 1) * bool(shared),
                          want_bwd + [dense] * (2 * tsp - 1) * bool(shared))
    g = torch.randn(y.shape, generator=torch.Generator().manual_seed(4), dtype=y.dtype)
    with comm.track() as bwd:
        (y * g).sum().backward()
    assert x.grad is not None and moe.gate.weight.grad is not None
    for what, stats, want in (("forward", fwd, want_fwd), ("backward", bwd, want_bwd)):
        calls, nbytes = {}, {}
        for kind, b in want:
            calls[kind] = calls.get(kind, 0) + 1
            nbytes[kind] = nbytes.get(kind, 0) + b
        assert dict(stats.calls) == calls, f"{case} D={tsp} {what}: {dict(stats.calls)}"
        assert dict(stats.bytes) == nbytes, f"{case} D={tsp} {what}: {dict(stats.bytes)}"
        assert sorted(stats.log) == sorted(want), f"{case} D={tsp} {what}: {stats.log}"
    dispatch = want_fwd[1][1]
    return dict(counted=dispatch, leave=leave, arrive=arrive)


@pytest.mark.parametrize("case", ["uniform", "skewed"])
@pytest.mark.parametrize("tsp", [2, 4])
def test_layer_collectives_exact(pools, tsp, case):
    """Forward: one all-to-all of the E per-expert counts, the dispatch and the combine
    all-to-all of the routed rows; backward: their two gradients and the router gradient's
    all-reduce; bytes by comm's rule (the larger of what leaves the rank and what reaches it)."""
    per_rank = pools.of(tsp).run(layer_traffic, tsp, case)
    c = TRAFFIC
    T_k_h_b = c["rows"] * c["seq"] // tsp * c["top_k"] * c["hidden"] * 8
    frac = (tsp - 1) / tsp
    if case == "uniform":  # docs/moe.md: T k h b (D-1)/D per all-to-all, counted and moved
        assert all(r == dict(counted=T_k_h_b * frac, leave=T_k_h_b * frac,
                             arrive=T_k_h_b * frac) for r in per_rank), per_rank
    else:  # rank 0 receives (D-1) T k h b; every other rank sends all its T k h b
        assert per_rank[0] == dict(counted=(tsp - 1) * T_k_h_b, leave=0,
                                   arrive=(tsp - 1) * T_k_h_b), per_rank
        assert all(r == dict(counted=T_k_h_b, leave=T_k_h_b, arrive=0)
                   for r in per_rank[1:]), per_rank


def test_layer_collectives_with_shared_experts(pools):
    """A shared expert (GLM-4.5) adds the dense TSP MLP's ring passes of its own slices and
    moves no token: the routed experts' collectives stay those of the layer without it, under
    both schedules."""
    per_rank = pools.of(4).run(layer_traffic, 4, "uniform", 8)
    T_k_h_b = TRAFFIC["rows"] * TRAFFIC["seq"] // 4 * TRAFFIC["top_k"] * TRAFFIC["hidden"] * 8
    assert all(r["leave"] == r["arrive"] == T_k_h_b * 3 / 4 for r in per_rank), per_rank
    pools.of(4).run(ring_traffic, 4, "uniform", 8)


def ring_traffic(tsp: int, case: str, shared: int = 0) -> None:
    """Schedule "ring": the forward moves every expert's channel slices D-1 hops, the backward
    D-1 hops again and the gradient accumulators D hops (3 E F/D h b each), plus the router
    gradient's all-reduce; routing changes none of it (no token moves)."""
    c = TRAFFIC
    mesh, moe, x, _ = routed_layer(tsp, case, "ring", shared)
    x.requires_grad_(True)
    D, E, h, F_ = tsp, c["experts"], c["hidden"], c["intermediate"]
    shard, dense = 3 * E * F_ // D * h * 8, 3 * shared // D * h * 8
    rings = 2 if shared else 1  # the experts' ring, then the shared experts' (their own MLP)
    with comm.track() as fwd:
        y = moe(x)
    with comm.track() as bwd:
        y.sum().backward()
    assert dict(fwd.calls) == {"ring_pass": rings * (D - 1)} and dict(fwd.bytes) == {
        "ring_pass": (D - 1) * (shard + dense)}, dict(fwd.bytes)
    assert dict(bwd.calls) == {"ring_pass": rings * (2 * D - 1), "all_reduce": 1}, \
        dict(bwd.calls)
    assert dict(bwd.bytes) == {"ring_pass": (2 * D - 1) * (shard + dense),
                               "all_reduce": 2 * E * h * 8 * (D - 1) / D}, dict(bwd.bytes)


@pytest.mark.parametrize("case", ["uniform", "skewed"])
def test_ring_layer_collectives_exact(pools, case):
    pools.of(4).run(ring_traffic, 4, case)


GPT_OSS_EXPERTS = dict(router="topk_softmax", router_bias=True, router_name="router",
                       layout="interleaved", expert_bias=True, activation="swiglu_clamped",
                       swiglu_limit=0.6)


def gpt_oss_traffic(tsp: int) -> None:
    """gpt-oss's experts (biases, the interleaved layout) under both schedules: the router's
    weight and bias and the replicated down-projection biases each get one gradient all-reduce
    (2 (D-1)/D of E h, E and E h numbers); the ring's slices carry their gate_up_proj_bias
    columns (E 2F/D numbers more per pass); the expert schedule's all-to-alls are those of any
    family (their bytes: test_layer_collectives_exact)."""
    c = TRAFFIC
    D, E, h, F_, k = tsp, c["experts"], c["hidden"], c["intermediate"], c["top_k"]
    mesh = dist_pool.mesh(tsp)
    frac = (D - 1) / D
    reduces = 2 * (E * h + E + E * h) * 8 * frac
    shard = (3 * E * F_ // D * h + E * 2 * F_ // D) * 8
    for schedule in ("expert", "ring"):
        moe = TSPMoE(mesh, h, F_, E, k, dtype=torch.float64, schedule=schedule,
                     **GPT_OSS_EXPERTS)
        x = torch.randn(c["rows"], c["seq"] // D, h, dtype=torch.float64,
                        generator=torch.Generator().manual_seed(mesh.rank), requires_grad=True)
        with comm.track() as fwd:
            y = moe(x)
        with comm.track() as bwd:
            y.sum().backward()
        if schedule == "ring":
            assert dict(fwd.calls) == {"ring_pass": D - 1}, dict(fwd.calls)
            assert dict(fwd.bytes) == {"ring_pass": (D - 1) * shard}, dict(fwd.bytes)
            assert dict(bwd.calls) == {"ring_pass": 2 * D - 1, "all_reduce": 3}, dict(bwd.calls)
            assert dict(bwd.bytes) == {"ring_pass": (2 * D - 1) * shard,
                                       "all_reduce": pytest.approx(reduces)}, dict(bwd.bytes)
        else:
            assert dict(fwd.calls) == {"all_to_all": 3}, dict(fwd.calls)
            assert dict(bwd.calls) == {"all_to_all": 2, "all_reduce": 3}, dict(bwd.calls)
            assert bwd.bytes["all_reduce"] == pytest.approx(reduces), dict(bwd.bytes)
        grads = [p.grad for p in moe.parameters()]
        assert all(g is not None for g in grads), [n for n, p in moe.named_parameters()
                                                   if p.grad is None]


def test_gpt_oss_layer_collectives(pools):
    pools.of(4).run(gpt_oss_traffic, 4)


def gpt_oss_fp16(root: str, tsp: int) -> None:
    """gpt-oss in float16 as from_pretrained loads it: its RMSNorm weights stay float32
    (``_keep_in_fp32_modules``, honoured for float16 only), in TSP and in its full state dict;
    the loss and every gradient are Hugging Face's float16 run's within float16's bounds
    (:func:`low_precision_backward`), and the norms compute in float32 as Hugging Face's do
    (:func:`norm_in_float32`), on every rank."""
    import os

    from transformers import GptOssForCausalLM

    mesh = dist_pool.mesh(tsp)
    path = os.path.join(root, "gpt_oss")
    if dist.get_rank() == 0:
        build("gpt_oss").save_pretrained(path)
    dist.barrier()
    ref = GptOssForCausalLM.from_pretrained(path, dtype=torch.float16)
    ref.set_experts_implementation("eager")
    kept = {n for n, p in ref.named_parameters() if p.dtype == torch.float32}
    assert kept and all(n.endswith("norm.weight") for n in kept), sorted(kept)
    model = tsp_core.parallelize(copy.deepcopy(ref), mesh)
    full, saved = tsp_core.full_state_dict(model), ref.state_dict()
    for name in kept:
        assert full[name].dtype == torch.float32 and torch.equal(full[name], saved[name]), name
    norm_in_float32(model.model.layers[0].input_layernorm, ref.model.layers[0].input_layernorm,
                    mesh)
    ids, labels = parity.batches(ref.config.vocab_size, 2, 16, 1)[0]
    low_precision_backward(ref, model, mesh, ids, labels, FP16_U, "gpt_oss float16")


def norm_in_float32(norm, hf_norm, mesh) -> None:
    """A float32 norm weight in a float16 model: Hugging Face normalises and scales in float32,
    then casts. On this rank's float16 tokens TSP's norm gives Hugging Face's output and input
    gradient (within one float16 rounding: the float32 values differ by float32's sums at most)
    and its weight gradient, summed over the ranks, to float32's sums (a norm that scaled or
    normalised in float16 would be ~u16 off)."""
    h = hf_norm.weight.shape[0]
    gen = torch.Generator().manual_seed(50 + mesh.rank)
    x = (3 * torch.randn(2, 8, h, generator=gen)).to(torch.float16)
    g = torch.randn(2, 8, h, generator=gen).to(torch.float16)
    runs = []
    for module in (norm, hf_norm):
        xi = x.clone().requires_grad_()
        y = module(xi)
        y.backward(g)
        runs.append((y.detach(), xi.grad))
    got_w = gather.full_grads(norm)["weight"]
    want_w = hf_norm.weight.grad.clone()
    dist.all_reduce(want_w, group=mesh.group)
    x32 = x.float()
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + hf_norm.variance_epsilon)
    magnitude = (g.float().abs() * normed.abs()).sum((0, 1))
    dist.all_reduce(magnitude, group=mesh.group)
    float32_sums_agree(got_w, want_w, magnitude, 16 * mesh.size,
                       f"norm weight gradient, rank {mesh.rank}")
    for what, got, want in zip(("output", "input gradient"), *runs):
        assert got.dtype == want.dtype == torch.float16, (what, got.dtype, want.dtype)
        ulps = ((got.float() - want.float()).abs() / (2 * FP16_U * want.float().abs())).max()
        assert ulps <= 1, f"norm {what}, rank {mesh.rank}: {ulps:.3g} float16 roundings off"
    hf_norm.weight.grad = None
    norm.zero_grad()


def test_gpt_oss_fp16_keeps_hf_float32_norms(pools, tmp_path):
    pools.of(2).run(gpt_oss_fp16, str(tmp_path), 2)


# ------------------------------------------------------------------------------ refusals

def refusals() -> list[str]:
    from transformers import MixtralConfig, MixtralForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    from tsp_core.distributed.params import ShardedModule
    from tsp_core.layers.moe import TSPMoE

    mesh = dist_pool.mesh(4)
    common = dict(vocab_size=96, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=64)
    msgs = []

    def expect(pattern: str, make) -> None:
        with comm.track() as stats, pytest.raises(ValueError, match=pattern) as info:
            make()
        assert dict(stats.calls) == {}, (pattern, dict(stats.calls))
        msgs.append(str(info.value))

    def refused(model, pattern: str) -> None:
        cls = type(model)
        before = {k: v.clone() for k, v in model.state_dict().items()}
        expect(pattern, lambda: tsp_core.parallelize(model, mesh))
        assert type(model) is cls and not any(isinstance(m, ShardedModule) for m in model.modules())
        after = model.state_dict()
        assert sorted(after) == sorted(before) and all(torch.equal(after[k], v)
                                                       for k, v in before.items())

    six = r"tsp_size \(4\) must divide the number of experts \(6\)"
    refused(MixtralForCausalLM(MixtralConfig(intermediate_size=48, num_local_experts=6,
                                             num_experts_per_tok=2, **common)), six)
    refused(Qwen3MoeForCausalLM(Qwen3MoeConfig(intermediate_size=64, moe_intermediate_size=16,
                                               num_experts=6, num_experts_per_tok=2, **common)),
            six)
    expect(six, lambda: TSPMoE(mesh, 32, 16, 6, 2, dtype=torch.float64))
    refused(MixtralForCausalLM(MixtralConfig(intermediate_size=48, num_local_experts=4,
                                             num_experts_per_tok=2, router_jitter_noise=0.1,
                                             **common)), r"router_jitter_noise=0\.1")
    refused(MixtralForCausalLM(MixtralConfig(intermediate_size=48, num_local_experts=4,
                                             num_experts_per_tok=5, **common)),
            r"num_experts_per_tok \(5\) must be between 1 and the number of experts \(4\)")
    # GLM-4.5's router and shared experts (tsp_core.layers.moe.check_router)
    refused(glm4_moe(n_group=3), r"n_group \(3\) must divide the number of experts \(8\)")
    refused(glm4_moe(n_group=4, num_experts_per_tok=3),
            r"topk_group \(1\) must be between 1 and n_group \(4\) and its groups must hold "
            r"the top 3 \(1 x 2 experts\)")
    refused(glm4_moe(n_shared_experts=0),
            r"config\.n_shared_experts=0: .* use n_shared_experts >= 1")
    refused(glm4_moe(moe_intermediate_size=6),
            r"tsp_size \(4\) must divide the shared experts' intermediate size \(6\)")
    # its float32 router in a bf16 model cannot go to FSDP2 (one dtype per layer)
    bf16 = glm4_moe().to(torch.bfloat16)
    for name, p in bf16.named_parameters():
        if name.endswith("mlp.gate.weight"):
            p.data = p.data.float()
    fsdp = dist_pool.mesh(2, dp_shard=2)
    expect(r"the model keeps its routers or norms float32 \(as from_pretrained loads them\) "
           r"and its other parameters \['torch\.bfloat16'\]: FSDP2 \(fsdp_size 2\) needs one "
           r"dtype per decoder layer; cast the model to one dtype",
           lambda: tsp_core.parallelize(bf16, fsdp))
    expect(r"n_group \(2\), topk_group \(1\) and the correction bias \(False\) belong to the "
           r"\"sigmoid\" router", lambda: TSPMoE(mesh, 32, 16, 8, 2, n_group=2,
                                                  dtype=torch.float64))
    return msgs


def test_refusals_on_every_rank(pools):
    msgs = pools.of(4).run(refusals)
    assert all(m == msgs[0] for m in msgs), "every rank must raise the same errors"
