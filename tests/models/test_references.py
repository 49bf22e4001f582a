"""The float64-faithful copies of Hugging Face code that the float64 references run are Hugging
Face's own arithmetic: in float32 (and bf16 for the norms) each gives the unmodified module's
bits, forward and backward, on inputs that exercise what the copy could misread.

- The norms (tests/support/norm_reference.py): Gemma 1-3's and Qwen3.5's ``1 + w`` RMSNorm,
  Gemma 4's weight-scaled one and its unscaled ``with_scale=False`` variant (value and router
  norms), alone and inside the zoo's Gemma, Gemma 2, Gemma 3, Gemma 4 and Qwen3.5 models.
- Llama 4's attention, L2 q/k norm and router (tests/support/llama4_reference.py), inside the
  zoo's Llama 4: a training step (RoPE then the q/k norm on the chunked layer; the temperature
  on the NoPE layer, whose factor changes every 4 tokens) and cached decode steps, where the
  temperature's positions start at the cache's length.
- GLM-4.5's and DeepSeek-V3's router (tests/support/moe_reference.py): the logits, the group
  mask, the top-k-group choice, the renormalised and scaled weights and their gradients, on
  routers whose groups and correction bias change many tokens' experts.

These copies are what makes a float64 reference stand apart from tsp_core (test_linear_attention
checks the Gated DeltaNet's copy the same way); a misreading shared by a copy and TSP would pass
every parity test, and fails here."""

from __future__ import annotations

import copy

import pytest
import torch

from tests.support import hf_models, llama4_reference, moe_reference, norm_reference


def _draws(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _hf_twin(model: torch.nn.Module, classes: tuple[str, ...]) -> torch.nn.Module:
    """A deep copy of ``model`` whose modules of ``classes`` run Hugging Face's own forward
    again (the copies are patched per instance, ``module.forward``)."""
    twin = copy.deepcopy(model)
    undone = 0
    for module in twin.modules():
        if type(module).__name__ in classes and "forward" in vars(module):
            del module.forward
            undone += 1
    assert undone, f"no patched {classes} in {type(model).__name__}"
    return twin


def _assert_same_bits(ours: dict, theirs: dict, what: str) -> None:
    """Every tensor of ``ours`` is ``theirs`` bit for bit (the same names)."""
    assert sorted(ours) == sorted(theirs), f"{what}: names differ"
    for name, t in theirs.items():
        a = ours[name]
        assert a.dtype == t.dtype and torch.equal(a, t), \
            f"{what}: {name} differs (max {(a.double() - t.double()).abs().max().item():.3e})"


def _run_with_grads(model: torch.nn.Module, *args, **kwargs) -> dict:
    """The output's tensors, then its backward against fixed random weights: every parameter's
    gradient and the float inputs' (by name)."""
    out = model(*args, **kwargs)
    outs = (out.logits,) if hasattr(out, "logits") else out if isinstance(out, tuple) else (out,)
    got = {f"out{i}": t.detach().clone() for i, t in enumerate(outs)}
    floats = [t for t in outs if t.is_floating_point() and t.requires_grad]
    loss = sum((t * torch.randn(t.shape, generator=_draws(7 + i), dtype=t.dtype)).sum()
               for i, t in enumerate(floats))
    loss.backward()
    got.update({f"grad {n}": p.grad.clone() for n, p in model.named_parameters()})
    got.update({f"input grad {i}": a.grad.clone() for i, a in enumerate(args)
                if isinstance(a, torch.Tensor) and a.grad is not None})
    return got


# ------------------------------------------------------------------------------------ norms

NORMS = ["gemma", "gemma2", "gemma3", "gemma4", "gemma4-unscaled", "qwen3_5"]


def _hf_norm(kind: str, dim: int) -> torch.nn.Module:
    """Hugging Face's norm of ``kind``, its weight drawn away from its initial value."""
    from transformers.models.gemma.modeling_gemma import GemmaRMSNorm
    from transformers.models.gemma2.modeling_gemma2 import Gemma2RMSNorm
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm
    from transformers.models.gemma4.modeling_gemma4 import Gemma4RMSNorm
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5RMSNorm

    if kind.startswith("gemma4"):
        norm = Gemma4RMSNorm(dim, eps=1e-6, with_scale=kind == "gemma4")
    else:
        cls = dict(gemma=GemmaRMSNorm, gemma2=Gemma2RMSNorm, gemma3=Gemma3RMSNorm,
                   qwen3_5=Qwen3_5RMSNorm)[kind]
        norm = cls(dim, eps=1e-6)
    with torch.no_grad():
        for p in norm.parameters():
            p.add_(0.5 * torch.randn(p.shape, generator=_draws(1)))
    return norm


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("kind", NORMS)
def test_norm_copy_is_hugging_face(kind, dtype):
    """The copy's output, input gradient and weight gradient are the unmodified norm's bits. The
    input's rows have mean squares from 1e-6 (eps then matters) to 1e2: eps in the wrong place,
    rsqrt for pow(., -0.5), w for 1 + w, or a cast before the scaling changes bits. In float64
    the copy is wider than Hugging Face's float32 (it would be no use otherwise)."""
    theirs = _hf_norm(kind, 24).to(dtype)
    ours = copy.deepcopy(theirs)
    assert norm_reference.float64_norms(ours) == 1
    scales = torch.logspace(-3, 1, 10)[:, None]
    x = scales * torch.randn(2, 10, 24, generator=_draws(2))
    runs = [_run_with_grads(m, x.to(dtype).clone().requires_grad_()) for m in (ours, theirs)]
    _assert_same_bits(*runs, f"{kind} norm in {dtype}")
    x64 = x.double()
    wide, narrow = ours.double()(x64), theirs.double()(x64)
    off = (wide - narrow).abs().max().item()
    assert 0 < off < 1e-5, f"{kind}: the float64 copy {off:.1e} from Hugging Face's float32"


@pytest.mark.parametrize("family", ["gemma", "gemma2", "gemma3", "gemma4", "qwen3_5"])
def test_zoo_norms_are_hugging_face_in_float32(family):
    """The zoo's model with the faithful norms gives the model with Hugging Face's norms bit for
    bit in float32: logits and every gradient (every norm class of the family has its copy)."""
    ours = hf_models.build(family, torch.float32)
    theirs = _hf_twin(ours, tuple(norm_reference.FORWARDS))
    ids = torch.randint(0, ours.config.vocab_size, (2, 12), generator=_draws(3))
    runs = [_run_with_grads(m, input_ids=ids) for m in (ours, theirs)]
    _assert_same_bits(*runs, f"{family} in float32")


def test_qwen3_next_copies_are_hugging_face_in_float32():
    """The zoo's Qwen3-Next with its faithful norms and Gated DeltaNet (the forward, with the
    fused in_proj_qkvz and in_proj_ba, and the gated norm: tests/support/delta_net_reference.py)
    gives the unmodified model bit for bit in float32: logits and every gradient."""
    ours = hf_models.build("qwen3_next", torch.float32)
    theirs = _hf_twin(ours, (*norm_reference.FORWARDS, "Qwen3NextGatedDeltaNet",
                             "Qwen3NextRMSNormGated"))
    ids = torch.randint(0, ours.config.vocab_size, (2, 12), generator=_draws(3))
    runs = [_run_with_grads(m, input_ids=ids) for m in (ours, theirs)]
    _assert_same_bits(*runs, "qwen3_next in float32")


# ---------------------------------------------------------------------------------- Llama 4

LLAMA4_CLASSES = ("Llama4TextAttention", "Llama4TextL2Norm", "Llama4Router")


def _llama4_pair():
    ours = hf_models.build("llama4_text", torch.float32)
    return ours, _hf_twin(ours, LLAMA4_CLASSES)


def test_llama4_copy_trains_as_hugging_face_in_float32():
    """A training step's logits and every gradient, bit for bit: layer 0 rotates then
    L2-normalises q and k (chunked attention, the router); layer 1 (NoPE) scales q by the
    temperature, log1p(floor((position + 1) / 4)) * 0.5 + 1 over 13 positions (4 factors)."""
    ours, theirs = _llama4_pair()
    layers = ours.model.layers
    assert layers[0].self_attn.use_rope and hasattr(layers[0].self_attn, "qk_norm")
    assert not layers[1].self_attn.use_rope and layers[1].self_attn.attn_temperature_tuning
    ids = torch.randint(0, ours.config.vocab_size, (2, 13), generator=_draws(4))
    runs = [_run_with_grads(m, input_ids=ids, use_cache=False) for m in (ours, theirs)]
    _assert_same_bits(*runs, "llama4 training step in float32")


def test_llama4_copy_decodes_as_hugging_face_in_float32():
    """Cached decode: a 6-token prefill, then 4 one-token steps at positions 6-9, whose
    temperature counts from the cache's length (position 7's factor, floor(8 / 4) = 2, is not
    position 0's): every step's logits bit for bit."""
    ours, theirs = _llama4_pair()
    ids = torch.randint(0, ours.config.vocab_size, (2, 10), generator=_draws(5))
    steps = []
    for model in (ours, theirs):
        with torch.no_grad():
            out = model(input_ids=ids[:, :6], use_cache=True)
            logits = [out.logits]
            for t in range(6, 10):
                out = model(input_ids=ids[:, t:t + 1], cache=out.past_key_values,
                            use_cache=True)
                logits.append(out.logits)
        steps.append({f"step {i}": t for i, t in enumerate(logits)})
    _assert_same_bits(*steps, "llama4 decode in float32")


def test_llama4_temperature_and_offset_matter():
    """The checks above see the temperature and its offset: HF's factors at positions 6-9 with
    the cache's offset differ from those at 0-3 and from those one position later."""
    attn = hf_models.build("llama4_text", torch.float32).model.layers[1].self_attn

    def factors(first: int) -> torch.Tensor:
        positions = torch.arange(first, first + 4).float()
        return torch.log1p(torch.floor((positions + 1.0) / attn.floor_scale)) * attn.attn_scale + 1

    assert not torch.equal(factors(6), factors(0)) and not torch.equal(factors(6), factors(7))
    assert llama4_reference.float64_llama4 in hf_models.ZOO["llama4_text"].adjust


# ------------------------------------------------------------------------- GLM / DeepSeek router

ROUTERS = {
    # tests/layers/test_moe.py's GLM-4.5 and tests/models/test_deepseek_v3.py's: 8 experts in 2
    # groups, the best group's top 2
    "glm4_moe": dict(n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1),
    "deepseek_v3": dict(n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1),
    # 16 experts in 4 groups of 4, the best 2 groups (by their top-2 sums) hold the top 3
    "glm4_moe-4groups": dict(n_routed_experts=16, num_experts_per_tok=3, n_group=4,
                             topk_group=2),
}


def _hf_router(case: str):
    """Hugging Face's router of ``case`` (h 32, routed_scaling_factor 2.5, norm_topk_prob), its
    weight N(0, 0.5) and a N(0, 0.3) correction bias: routing far from uniform."""
    if case.startswith("deepseek"):
        from transformers import DeepseekV3Config as Config
        from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
            DeepseekV3TopkRouter as Router,
        )
    else:
        from transformers import Glm4MoeConfig as Config
        from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeTopkRouter as Router
    config = Config(hidden_size=32, routed_scaling_factor=2.5, norm_topk_prob=True,
                    **ROUTERS[case])
    router = Router(config)
    gen = _draws(6)
    with torch.no_grad():
        router.weight.normal_(0, 0.5, generator=gen)
        router.e_score_correction_bias.copy_(0.3 * torch.randn(router.num_experts, generator=gen))
    return router


@pytest.mark.parametrize("case", sorted(ROUTERS))
def test_glm_router_copy_is_hugging_face_in_float32(case):
    """Logits, top-k weights and experts of 64 tokens, and the gradients of the weight and the
    input, bit for bit; on these tokens the group mask and the correction bias each change the
    experts of at least 8 tokens (a copy that misreads either is seen)."""
    theirs = _hf_router(case)
    ours = copy.deepcopy(theirs)
    assert moe_reference.float64_glm_router(ours) == 1
    x = torch.randn(64, 32, generator=_draws(8))
    runs = [_run_with_grads(m, x.clone().requires_grad_()) for m in (ours, theirs)]
    _assert_same_bits(*runs, f"{case} router in float32")
    with torch.no_grad():
        scores = torch.sigmoid(x @ theirs.weight.T)
        _, _, experts = theirs(x)
    chosen = experts.sort(-1).values
    k = theirs.top_k
    for what, choice in (("the group mask", scores + theirs.e_score_correction_bias),
                         ("the correction bias", None)):
        if choice is None:  # the groups without the bias
            router = copy.deepcopy(theirs)
            router.e_score_correction_bias.zero_()
            other = router(x)[2]
        else:
            other = choice.topk(k, -1).indices
        changed = (other.sort(-1).values != chosen).any(-1).sum().item()
        assert changed >= 8, f"{case}: {what} changes {changed} of 64 tokens' experts"

