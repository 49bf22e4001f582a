"""The baseline layouts (tp, tp-sp, cp, tp+cp, tp-sp+cp) on the same Hugging Face models as TSP:
loss and every gradient against the unmodified model on one process (float64), and the bytes of
one decoder layer's forward exactly equal to the formula of docs/design.md "Communication per
layer", for TSP too. Mixtral (sparse mixture of experts, tsp_core.baselines.moe) likewise, its loss
with the load-balancing loss, and its memory simulation under fake tensors."""

from __future__ import annotations

import pytest
import torch

from tests.support import hf_models
from tests.support.reference import assert_close
from tsp_core.baselines import build, layout_specs, parse_layouts
from tsp_core.plan.traffic import ModelShape, layer_forward_elements

SEQ = 24  # a multiple of 2 * 4: every layout's shards are whole


def batch(vocab: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(0, vocab, (2, SEQ), generator=gen)
    labels = ids.clone()
    labels[0, :5] = -100
    return {"input_ids": ids, "labels": labels}


def check_parity(family: str, layouts: str, recompute: str = "none") -> list[str]:
    import torch.distributed as dist

    from tsp_core.plan.simulate import recompute_kwargs

    ref = hf_models.build(family, torch.float64)
    data = batch(ref.config.vocab_size)
    ref_loss = hf_models.reference_loss(ref, data["input_ids"], data["labels"])
    ref_loss.backward()
    ref_grads = {n: p.grad for n, p in ref.named_parameters()}
    done = []
    for spec in parse_layouts(layouts, dist.get_world_size()):
        model = hf_models.build(family, torch.float64)
        config, before = model.config, (model.config.to_dict(), model.config._attn_implementation)
        pm = build(model, spec)
        # the caller's config object is untouched: the layout's model runs on its own copy
        assert (config.to_dict(), config._attn_implementation) == before, spec.label
        assert pm.model.config is not config, spec.label
        if recompute != "none":
            pm.model.activation_checkpointing_enable(
                activation_checkpointing_kwargs=recompute_kwargs(recompute))
            pm.model.train()
        loss = pm.step(data)
        assert_close(loss, ref_loss.detach(), 1e-10, f"{family} {spec.label} loss")
        grads = pm.full_grads()
        assert set(grads) == set(ref_grads), f"{spec.label}: {set(grads) ^ set(ref_grads)}"
        for name, g in ref_grads.items():
            assert_close(grads[name], g, 1e-10, f"{family} {spec.label} grad {name}")
        done.append(spec.label)
    return done


@pytest.mark.parametrize("family", hf_models.BASELINE_FAMILIES)
def test_parity_world2(pools, family):
    (done, *_) = pools.of(2).run(check_parity, family, "tp,tp-sp,cp")
    assert done == ["tp", "tp-sp", "cp"]


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2"])
def test_parity_world4(pools, family):
    (done, *_) = pools.of(4).run(check_parity, family, "cp,tp+cp,tp-sp+cp")
    assert done == ["cp", "tp+cp(2x2)", "tp-sp+cp(2x2)"]


@pytest.mark.parametrize("recompute", ["full", "selective"])
def test_parity_under_activation_checkpointing(pools, recompute):
    # tsp simulate --recompute wraps every decoder layer alike: TSP's blocks must be exact there
    (done, *_) = pools.of(2).run(check_parity, "qwen2", "tsp,tp-sp,cp", recompute)
    assert done == ["tsp", "tp-sp", "cp"]


def layer_bytes(layouts: str) -> list[tuple[str, float, float]]:
    import torch.distributed as dist

    out = []
    for spec in parse_layouts(layouts, dist.get_world_size()):
        model = hf_models.build("llama", torch.float32)
        pm = build(model, spec)
        data = batch(model.config.vocab_size)
        with pm.layer_traffic(1) as stats:
            pm.step(data)
        shape = ModelShape.from_config(model.config)
        rows, seq = data["input_ids"].shape
        expected = layer_forward_elements(spec.name, spec.tp, spec.cp, shape, rows, seq) * 4
        out.append((spec.label, stats.total_bytes, expected))
    return out


@pytest.mark.parametrize("world,layouts", [(2, "tsp,tp,tp-sp,cp"), (4, "tsp,cp,tp+cp,tp-sp+cp")])
def test_layer_bytes_match_formula(pools, world, layouts):
    for got in pools.of(world).run(layer_bytes, layouts):
        for label, measured, expected in got:
            assert measured > 0, label
            assert measured == pytest.approx(expected, rel=1e-12), (label, measured, expected)


def test_layout_names_and_shapes():
    assert [s.label for s in parse_layouts("tsp,tp+cp,tp-sp+cp", 8)] == [
        "tsp", "tp+cp(2x4)", "tp+cp(4x2)", "tp-sp+cp(2x4)", "tp-sp+cp(4x2)"]
    assert [(s.tp, s.cp) for s in layout_specs("cp", 4)] == [(1, 4)]
    with pytest.raises(ValueError, match="3 has none"):
        layout_specs("tp+cp", 3)
    with pytest.raises(ValueError, match="unknown layout 'sp'"):
        layout_specs("sp", 2)


def test_tensor_parallel_refuses_split_heads():
    model = hf_models.build("llama", torch.float32)  # 4 query heads, 2 key/value heads
    (spec,) = layout_specs("tp", 4)
    with pytest.raises(ValueError, match=r"tensor-parallel size \(4\) must divide "
                                         r"num_key_value_heads \(2\)"):
        build(model, spec)  # fails before any process group is needed


def test_context_parallel_refuses_length_dependent_rope():
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**{**hf_models.COMMON, "vocab_size": 96},
                         rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4})
    (spec,) = layout_specs("cp", 2)
    with pytest.raises(NotImplementedError, match=r"layout cp: .*dynamic rope.*differs between "
                                                  r"context-parallel ranks"):
        build(LlamaForCausalLM(config), spec)  # fails before any process group is needed


@pytest.mark.parametrize("layout", ["tp", "cp"])
def test_baselines_refuse_untested_families(layout):
    # e.g. Qwen3's q/k norms would get only this tp rank's heads' share of their gradient
    (spec,) = layout_specs(layout, 2)
    with pytest.raises(NotImplementedError, match=rf"layout {layout}: the baselines are built and "
                                                  rf"tested for llama, mistral, qwen2, mixtral, "
                                                  rf"not qwen3 "):
        build(hf_models.build("qwen3", torch.float32), spec)  # before any process group


# ---------------------------------------------------------------- mixture of experts (Mixtral)

def moe_model(implementation: str = "eager"):
    """Tiny Mixtral of tests/layers/test_moe.py (4 experts, top 2, a router far from uniform, the
    load-balancing loss at 0.3): float64 with the eager experts; float32 with any other experts
    implementation (grouped_mm has no float64 kernel)."""
    from tests.layers.test_moe import build as build_moe

    model = build_moe("mixtral")
    if implementation != "eager":
        model.set_experts_implementation(implementation)
        model = model.float()
    return model


def check_moe_parity(layouts: str, implementation: str = "eager") -> list[str]:
    """Loss (cross-entropy plus the load-balancing loss over the global batch) and every gradient
    of :func:`moe_model` against one process, to 1e-10 in float64 (1e-5 in float32); decoder
    layer 1's forward moves exactly the dense formula's bytes (the MoE block moves what the dense
    MLP moves)."""
    import torch.distributed as dist

    from tests.layers.test_moe import reference_loss

    ref = moe_model(implementation)
    tol = 1e-10 if ref.dtype == torch.float64 else 1e-5
    data = batch(ref.config.vocab_size)
    ref_loss = reference_loss(ref, data["input_ids"], data["labels"])
    ref_loss.backward()
    ref_grads = {n: p.grad for n, p in ref.named_parameters()}
    shape = ModelShape.from_config(ref.config)
    done = []
    for spec in parse_layouts(layouts, dist.get_world_size()):
        pm = build(moe_model(implementation), spec)
        with pm.layer_traffic(1) as stats:
            loss = pm.step(data)
        assert_close(loss, ref_loss.detach().to(loss.dtype), tol, f"mixtral {spec.label} loss")
        grads = pm.full_grads()
        assert set(grads) == set(ref_grads), f"{spec.label}: {set(grads) ^ set(ref_grads)}"
        for name, g in ref_grads.items():
            assert_close(grads[name], g, tol, f"mixtral {spec.label} grad {name}")
        expected = layer_forward_elements(spec.name, spec.tp, spec.cp, shape, *data["input_ids"]
                                          .shape) * ref.dtype.itemsize
        assert stats.total_bytes == pytest.approx(expected, rel=1e-12), (spec.label, stats.calls)
        done.append(spec.label)
    return done


def test_moe_parity_world2(pools):
    (done, *_) = pools.of(2).run(check_moe_parity, "tp,tp-sp,cp")
    assert done == ["tp", "tp-sp", "cp"]


def test_moe_parity_grouped_mm(pools):
    # the experts run Hugging Face's grouped_mm (the default implementation) on the local slices
    (done, *_) = pools.of(2).run(check_moe_parity, "tp-sp", "grouped_mm")
    assert done == ["tp-sp"]


def test_moe_parity_world4(pools):
    (done, *_) = pools.of(4).run(check_moe_parity, "tp+cp,tp-sp+cp")
    assert done == ["tp+cp(2x2)", "tp-sp+cp(2x2)"]


def test_moe_refusals():
    from tests.layers.test_moe import build as build_moe

    (spec,) = layout_specs("tp", 2)
    model = moe_model()
    model.config.router_jitter_noise = 0.1
    with pytest.raises(NotImplementedError, match=r"router_jitter_noise \(0.1\)"):
        build(model, spec)  # before any process group
    # Qwen3-MoE: per-head q/k norms, like Qwen3
    with pytest.raises(NotImplementedError, match=r"tested for .*mixtral, not qwen3_moe "):
        build(build_moe("qwen3_moe"), spec)


def test_moe_memory_simulation(tmp_path):
    # the experts run the model's experts implementation: Hugging Face's grouped_mm (the default;
    # fixed shapes, fake tensors run it) for tp, the eager loop for tp-sp, which under
    # FakeTensorMode (no routing values) runs on uniform routing's counts. Rank 0 holds 1/T of
    # every expert's channels, the router whole
    import json

    from transformers import MixtralConfig

    from tsp_core.plan.simulate import SimulationRequest, simulate_many

    h, f, e, vocab, layers = 64, 96, 4, 512, 2
    reqs = []
    for layout, implementation in (("tp", "grouped_mm"), ("tp-sp", "eager")):
        folder = tmp_path / implementation
        MixtralConfig(hidden_size=h, intermediate_size=f, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, vocab_size=vocab,
                      num_local_experts=e, num_experts_per_tok=2, sliding_window=None,
                      output_router_logits=True).save_pretrained(folder)
        config = json.loads((folder / "config.json").read_text())
        config["experts_implementation"] = implementation
        (folder / "config.json").write_text(json.dumps(config))
        reqs.append(SimulationRequest(layout=layout, tp=2, cp=1, seq=64, model=str(folder)))
    attention = 2 * h * h + 2 * h * (h // 2)   # q, o; k, v of 2 of 4 heads
    per_layer = (attention + 3 * e * f * h) / 2 + e * h + 2 * h   # split; router, norms whole
    elements = layers * per_layer + 2 * vocab * h / 2 + h   # vocabulary-sharded embedding, head
    for rec in simulate_many(reqs, jobs=1):
        assert rec.breakdown["parameters"] == elements * 2, rec.layout   # bfloat16
        assert rec.phases["mlp_forward"]["activations"] > 0, rec.layout
