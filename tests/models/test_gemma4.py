"""Gemma 4 text beyond the family tests (tests/support/hf_models.py builds it with every feature
TSP runs: the value norm, global layers with their own head size, attention_k_eq_v, per-layer
inputs, KV-shared layers with double-wide MLPs, the MoE block beside every MLP; the family tests
run its experts under the expert schedule): activation checkpointing of the KV-shared layers.
A KV-shared layer attends with K/V another layer's schedule returned; non-reentrant checkpointing
keeps their gradient path (exact), reentrant checkpointing recomputes the storing layer after the
reusing one and would drop it, so it raises. The MoE block under both schedules with plain SGD
(its router's norm, scale vector and per-expert scales, the extra norms), greedy generation
under the ring schedule, and its collectives and their bytes (the MoE formula's)."""

from __future__ import annotations

import copy
from functools import partial

import pytest
import torch
import torch.distributed as dist

import tsp_core
from tests.support import dist_pool, hf_models, parity
from tests.support.reference import assert_close
from tsp_core import comm


def checkpointed_step(reentrant: bool) -> str:
    mesh = dist_pool.mesh(2)
    ref = hf_models.build("gemma4", torch.float64)
    model = tsp_core.parallelize(copy.deepcopy(ref), mesh)
    model.activation_checkpointing_enable(
        activation_checkpointing_kwargs={"use_reentrant": reentrant})
    gen = torch.Generator().manual_seed(7)
    ids = torch.randint(0, ref.config.vocab_size, (2, 24), generator=gen)
    data, sgd = [(ids, ids)], partial(torch.optim.SGD, lr=0.5)
    if reentrant:  # the forward runs, the backward refuses
        with pytest.raises(RuntimeError, match="reentrant activation checkpointing recomputes"):
            parity.tsp_record(model, mesh, data, sgd, rows=2)
        return "refused"
    parity.compare(parity.tsp_record(model, mesh, data, sgd, rows=2),
                   parity.reference_record(ref, data, sgd), parity.FLOAT64,
                   f"gemma4 checkpointed rank {dist.get_rank()}")
    return "exact"


@pytest.mark.parametrize("reentrant", [False, True])
def test_kv_shared_layers_under_activation_checkpointing(pools, reentrant):
    want = "refused" if reentrant else "exact"
    assert pools.of(2).run(checkpointed_step, reentrant) == [want] * 2


def dense_float32() -> torch.nn.Module:
    """hf_models' Gemma 4 in float32 with Hugging Face's own norms, for the bf16 autocast case,
    with changes that keep its bf16 run within bf16's precision of its float32 one (the zoo's,
    which Hugging Face's own bf16 run misses by 48 to 144 u, fits no bound derived from bf16's
    precision). Its scores are RMS-normalised q and k at scale 1, up to head_dim (24, 32) in
    size: rounding q and k to bf16 moves them by up to head_dim x u, which the softmax turns
    into probabilities that many u off; with the q/k norm weights at a tenth the scores are
    O(1). initializer_range 0.02, not the zoo's 0.2 (which makes the final soft-cap nonlinear
    for the float64 tests, and amplifies rounding). No MoE block: a token whose top 2 of 4
    experts are within bf16's noise of a tie picks another expert, a jump no precision bound
    covers (moe_sgd_parity runs the block in float64). Every other feature of the zoo's model
    is kept."""
    from transformers import Gemma4ForCausalLM, Gemma4TextConfig

    fields = {**hf_models.COMMON, **copy.deepcopy(hf_models.ZOO["gemma4"].fields),
              "enable_moe_block": False, "initializer_range": 0.02}
    torch.manual_seed(0)
    model = Gemma4ForCausalLM(Gemma4TextConfig(**fields))
    with torch.no_grad():
        for layer in model.model.layers:  # off one, as the zoo's
            layer.layer_scalar.fill_(0.8 + 0.4 * torch.rand(()).item())
        hf_models.spread_norms_and_biases(model)
        for name, p in model.named_parameters():
            if name.endswith(("q_norm.weight", "k_norm.weight")):
                p.mul_(0.1)
    return model


def test_training_parity_bf16_autocast(pools):
    # float32 weights, forward and backward under bf16 autocast: one SGD step against the
    # unmodified model under the same autocast, within bf16's bounds for its 4 layers
    # (tests/support/parity.py compare_bf16: sqrt(2) G = 12.7 u). Measured: 4.9 u
    parity.assert_same_losses(pools.of(2).run(parity.train_parity, parity.bf16_parity(
        dense_float32, 2, "gemma4 dense")))


def moe_sgd_parity(tsp: int) -> list[float]:
    """3 SGD steps of the MoE model (hf_models' gemma4: the experts beside every MLP) under both
    MoE schedules against the unmodified model (tests/support/parity.py, one reference run for
    both): loss per step 1e-10, first-step gradients 1e-10, weights after 3 steps 1e-8 (plain
    SGD: a gradient of the wrong scale shows); then greedy generation under the ring schedule
    (the expert schedule's: tests/inference/test_decode.py) gives Hugging Face's tokens, each
    step's logits within 1e-8, and its full state dict is Hugging Face's bit for bit (the
    experts' gate_up_proj fused from the ring's gate and up)."""
    from tsp_core.layers.moe import TSPMoE, TSPRouter

    mesh = dist_pool.mesh(tsp)
    gen = torch.Generator().manual_seed(3)
    vocab = hf_models.build("gemma4", torch.float64).config.vocab_size
    data = [(ids, ids) for ids in
            (torch.randint(0, vocab, (2, 24), generator=gen) for _ in range(3))]
    sgd = partial(torch.optim.SGD, lr=0.1)
    want = parity.reference_record(hf_models.build("gemma4", torch.float64), data, sgd)
    losses = []
    for schedule in ("expert", "ring"):
        model = tsp_core.parallelize(hf_models.build("gemma4", torch.float64), mesh,
                                     moe_schedule=schedule)
        parity.check_moe_schedule(model, schedule)
        assert all(isinstance(layer.router, TSPRouter) and isinstance(layer.experts, TSPMoE)
                   for layer in model.model.layers), schedule
        run = parity.tsp_record(model, mesh, data, sgd, rows=2)
        parity.compare(run, want, parity.FLOAT64,
                       f"{schedule} tsp {tsp} rank {dist.get_rank()}")
        losses += run["losses"]
    ref = hf_models.build("gemma4", torch.float64)
    model = tsp_core.parallelize(copy.deepcopy(ref), mesh, moe_schedule="ring")
    full, want_sd = tsp_core.full_state_dict(model), ref.state_dict()  # the ring's fused names
    assert sorted(full) == sorted(want_sd) and all(torch.equal(full[n], t)
                                                   for n, t in want_sd.items())
    prompt = torch.randint(0, vocab, (1, 7), generator=gen)
    tokens = ref.generate(prompt, max_new_tokens=6, do_sample=False)
    with torch.no_grad():
        ref_logits = ref(input_ids=tokens).logits[0, prompt.shape[1] - 1:-1]
    got, steps = tsp_core.generate(model, prompt, 6, return_logits=True)
    assert torch.equal(got, tokens), (got, tokens)
    for t, step in enumerate(steps):
        assert_close(step[0], ref_logits[t], 1e-8, f"ring tsp {tsp} step {t} logits")
    dist.barrier()
    return losses


@pytest.mark.parametrize("tsp", [2, 4])
def test_moe_block_both_schedules_sgd_and_ring_generation(pools, tsp):
    losses = pools.of(tsp).run(moe_sgd_parity, tsp)
    assert all(r == losses[0] for r in losses), "the loss must be identical on every rank"


def moe_traffic(tsp: int) -> None:
    """Gemma 4's router apart and its experts under both schedules: the router adds one
    gradient all-reduce per tensor (proj [E, h], scale [h], per_expert_scale [E]: the MoE
    formula's router bytes with router_extra h + E) and no other collective; the experts move
    what any family's do (expert: the counts, dispatch and combine all-to-alls and their
    gradients; ring: the slices D-1 hops forward, 2D-1 backward)."""
    from tsp_core.layers.moe import MoESpec, TSPMoE, TSPRouter, moe_bytes

    mesh = dist_pool.mesh(tsp)
    D, h, F, E, k, T = tsp, 16, 8, 8, 2, 12
    spec = MoESpec(h, F, E, k, D, activation="gelu_tanh", router="normed_softmax",
                   router_name="router", router_apart=True)
    formula = moe_bytes(E, k, F, h, T, D, b=8, router_extra=h + E)
    ring_bytes = 3 * E * F * h * 8
    router_bytes = formula.b_backward - (2 * D - 1) / D * ring_bytes
    for schedule in ("expert", "ring"):
        router = TSPRouter(mesh, spec, dtype=torch.float64)
        experts = TSPMoE(mesh, h, F, E, k, schedule=schedule, dtype=torch.float64,
                         **spec.options())
        x = torch.randn(T, h, dtype=torch.float64, requires_grad=True,
                        generator=torch.Generator().manual_seed(mesh.rank))
        with comm.track() as fwd:
            _, weights, chosen = router(x)
            y = experts(x, chosen, weights)
        with comm.track() as bwd:
            y.sum().backward()
        if schedule == "expert":
            assert dict(fwd.calls) == {"all_to_all": 3}, dict(fwd.calls)
            assert dict(bwd.calls) == {"all_to_all": 2, "all_reduce": 3}, dict(bwd.calls)
        else:
            shard = ring_bytes / D
            assert dict(fwd.calls) == {"ring_pass": D - 1}, dict(fwd.calls)
            assert dict(fwd.bytes) == {"ring_pass": (D - 1) * shard}, dict(fwd.bytes)
            assert dict(bwd.calls) == {"ring_pass": 2 * D - 1, "all_reduce": 3}, dict(bwd.calls)
            assert bwd.bytes["ring_pass"] == (2 * D - 1) * shard, dict(bwd.bytes)
        assert bwd.bytes["all_reduce"] == pytest.approx(router_bytes), (dict(bwd.bytes),
                                                                        router_bytes)
        # by hand (D = 4, float64): the router's proj 8 x 16, scale 16, per-expert scales 8 are
        # 152 elements, 1216 bytes, all-reduced at 2 (D-1)/D = 1.5 times: 1824 bytes
        assert bwd.calls["all_reduce"] == 3 and bwd.bytes["all_reduce"] == 1824, dict(bwd.bytes)
        if schedule == "ring":  # each expert's gate, up and down: 3 x 8 x 16 = 384 elements, 8
            # experts 3072, 24576 bytes, a quarter (6144) per hop: 3 hops forward (18432), 3
            # again and 4 gradient hops backward (7: 43008)
            assert dict(fwd.calls) == {"ring_pass": 3} and fwd.bytes["ring_pass"] == 18432
            assert bwd.calls["ring_pass"] == 7 and bwd.bytes["ring_pass"] == 43008, dict(bwd.bytes)
        assert all(p.grad is not None for m in (router, experts) for p in m.parameters())
    dist.barrier()


def test_moe_block_collectives(pools):
    pools.of(4).run(moe_traffic, 4)


def test_simulate_takes_the_moe_config_and_plan_refuses_it(tmp_path):
    """``tsp simulate`` takes the MoE model's config.json (the router and norms replicated, the
    experts 1/D: the parameters it holds are those counted here, bf16 at D = 2); ``tsp plan``'s
    closed forms refuse it by name (its layers' attention shapes differ)."""
    import math

    from tsp_core.plan.simulate import SimulationRequest, simulate
    from tsp_core.plan.traffic import ModelShape

    ref = hf_models.build("gemma4", torch.float32)
    ref.config.save_pretrained(tmp_path / "gemma4")
    rec = simulate(SimulationRequest("tsp", 2, 1, 256, str(tmp_path / "gemma4" / "config.json"),
                                     optimizer="none")).__dict__
    replicated = ("norm", "router.", "per_layer_model_projection", "per_layer_input_gate",
                  "per_layer_projection")
    held = 0
    for name, p in ref.named_parameters():
        if "embed_tokens" in name:  # vocabulary rows, padded to a multiple of D
            held += math.ceil(p.shape[0] / 2) * p.shape[1]
        else:
            held += p.numel() if any(r in name for r in replicated) else p.numel() // 2
    assert any(n.endswith("experts.gate_up_proj") for n, _ in ref.named_parameters())
    assert rec["breakdown"]["parameters"] == 2 * held, (rec["breakdown"], held)
    with pytest.raises(ValueError, match=r"config\.\w+ differs from layer to layer .* "
                                         r"estimate this model with tsp simulate"):
        ModelShape.from_config(ref.config)
