"""Tiny random-init Hugging Face models of each supported family (nothing is downloaded)."""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tests.support import delta_net_reference, llama4_reference

COMMON = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6)

FAMILIES = ("llama", "llama-tied", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3",
            "granite", "olmo2", "phi3", "olmo3", "seed_oss", "seed_oss-defaults", "exaone4",
            "smollm3", "glm4", "ernie4_5", "apertus", "hunyuan_v1_dense", "llama4_text", "gemma4")
# every family runs Hugging Face's SDPA attention, float64 throughout: the eager attention of
# OLMo 3, Seed-OSS, EXAONE 4 and SmolLM3 computes its softmax in float32 even in a float64 model
# (only Gemma 2, whose soft-capping exists only in eager, runs a float64 copy: use_exact_eager;
# Ernie 4.5's rotary, float32 in every attention, too: float64_ernie_rope)
# the tensor-parallel baselines refuse per-head q/k norms (tsp_core.baselines.build)
BASELINE_FAMILIES = ("llama", "llama-tied", "mistral", "qwen2")
# float32 runs (a sanity check beside the float64 exactness runs): one family per feature set.
# Not Phi-3 and OLMo 2: after 5 AdamW steps single weight elements differ from HF's float32 run by
# 1.1e-4 and 1.25e-4 (OLMo 2 already at tsp 1), float32 rounding that AdamW amplifies past the
# 1e-4 tolerance: OLMo 2's q/k norm weight gradients are ill-conditioned sums, HF's own float32
# ones up to 3.8e-5 (relative to their max) off the float64 ones, TSP's 7.9e-5. Their float64
# runs hold every weight to 1e-8
FLOAT32_FAMILIES = ("llama-tied", "mistral", "qwen2", "qwen3", "gemma2", "gemma3", "granite")


# the sparse layers of the tiny Llama 4
LLAMA4_MOE_LAYERS = (0,)


EXACT_EAGER = "tsp_tests_exact_eager"


def exact_eager_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                          softcap=None, **kwargs):
    """transformers' Gemma 2 ``eager_attention_forward`` (the scores times ``scaling``, then
    ``tanh(s / softcap) * softcap``, then the additive mask, softmax, times V), with one change:
    the softmax runs in the scores' dtype when it is wider than float32 (HF's always runs in
    float32, ~1e-7 off in a float64 model); for float32 and below it is HF's."""
    from transformers.models.gemma2.modeling_gemma2 import repeat_kv

    key = repeat_kv(key, module.num_key_value_groups)
    value = repeat_kv(value, module.num_key_value_groups)
    weights = torch.matmul(query, key.transpose(2, 3)) * scaling
    if softcap is not None:
        weights = weights / softcap
        weights = torch.tanh(weights)
        weights = weights * softcap
    if attention_mask is not None:
        weights = weights + attention_mask
    wide = torch.promote_types(query.dtype, torch.float32)
    weights = F.softmax(weights, dim=-1, dtype=wide).to(query.dtype)
    weights = F.dropout(weights, p=dropout, training=module.training)
    return torch.matmul(weights, value).transpose(1, 2).contiguous(), weights


def use_exact_eager(model) -> None:
    """Make ``model`` (a Gemma 2) run :func:`exact_eager_attention`, registered with transformers
    under its own name with eager attention's additive masks (causal, sliding, padding)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, eager_mask

    AttentionInterface.register(EXACT_EAGER, exact_eager_attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(EXACT_EAGER, eager_mask)
    model.config._attn_implementation = EXACT_EAGER


def float64_ernie_rope(model: nn.Module | None = None) -> None:
    """Ernie 4.5's ``apply_rotary_pos_emb`` rotates q and k in float32 whatever their dtype
    (``q.float() * cos``: a float64 model's q and k rounded to float32, ~1e-8 off). Replaced,
    process-wide and idempotently, by the same formula in q's dtype when that is wider than
    float32; for float32 and below it is Hugging Face's own function. ``model`` is not needed
    (the function is replaced in its module); it lets the zoo list this as an adjustment."""
    from transformers.models.ernie4_5 import modeling_ernie4_5 as ernie

    hf = getattr(ernie.apply_rotary_pos_emb, "hf_original", ernie.apply_rotary_pos_emb)

    def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
        if torch.finfo(q.dtype).bits <= 32:
            return hf(q, k, cos, sin, unsqueeze_dim)
        cos, sin = (t.unsqueeze(unsqueeze_dim).to(q.dtype) for t in (cos, sin))
        cos = cos[..., : cos.shape[-1] // 2].repeat_interleave(2, dim=-1)
        sin = sin[..., : sin.shape[-1] // 2].repeat_interleave(2, dim=-1)
        return (q * cos + ernie.rotate_half(q) * sin, k * cos + ernie.rotate_half(k) * sin)

    apply_rotary_pos_emb.hf_original = hf
    ernie.apply_rotary_pos_emb = apply_rotary_pos_emb


def float64_gemma_norms(model) -> None:
    """Gemma's RMSNorms (1-3: scaled by ``1 + weight``; 4: by the weight, or unscaled) compute in
    float32 even in a float64 model (``x.float()``, ``weight.float()``): their weight gradients
    are sums rounded to float32, which caps agreement with any other summation order at ~1e-7.
    The reference's norms run tests/support/norm_reference.py's copies of Hugging Face's
    forwards, in the model's dtype when it is wider (Hugging Face's bits for float32 and below:
    tests/models/test_references.py)."""
    _faithful_norms(model, lambda name: name.startswith("Gemma") and name.endswith("RMSNorm"))


def float64_qwen3_5_norms(model) -> None:
    """Qwen3.5's RMSNorms (``Qwen3_5RMSNorm``: scaled by ``1 + weight``) compute in float32 even
    in a float64 model (``x.float()``), as Gemma's do: the reference's run
    tests/support/norm_reference.py's copy, in the model's dtype when it is wider (its gated norm
    is the Gated DeltaNet's: tests/support/delta_net_reference.py)."""
    _faithful_norms(model, lambda name: name == "Qwen3_5RMSNorm")


def _faithful_norms(model, wanted: Callable[[str], bool]) -> None:
    """Patch every norm whose class name is ``wanted`` with its faithful copy; a wanted class
    without a copy is an error (it would keep Hugging Face's float32 island silently)."""
    from tests.support import norm_reference

    names = {type(m).__name__ for m in model.modules() if wanted(type(m).__name__)}
    missing = sorted(names - set(norm_reference.FORWARDS))
    assert not missing, f"no float64-faithful copy of {missing} in tests/support/norm_reference.py"
    norm_reference.float64_norms(model, wanted)


def build(family: str, dtype: torch.dtype, seed: int = 0, kv_heads: int | None = None):
    """The zoo's ``family`` (:data:`ZOO`) from ``seed``, in ``dtype``. ``kv_heads``:
    num_key_value_heads instead of COMMON's 2 (1 = MQA: at tsp 2 and 4 each key/value head is
    split over several ranks)."""
    import transformers

    if family not in ZOO:
        raise ValueError(f"no zoo model {family!r}; the zoo holds {sorted(ZOO)}")
    row = ZOO[family]
    torch.manual_seed(seed)
    common = COMMON if kv_heads is None else {**COMMON, "num_key_value_heads": kv_heads}
    fields = copy.deepcopy(row.fields)  # a config may change the lists and dicts it is given
    config = getattr(transformers, row.config_class)(**{**common, **fields})
    model = getattr(transformers, row.model_class)(config)
    for adjust in row.adjust:  # in order: some draw from the seeded generator
        adjust(model)
    return model.to(dtype)


@dataclass(frozen=True)
class ZooModel:
    """One model of the zoo: transformers' causal-LM and config classes by name, the config's
    fields over COMMON, and the adjustments applied after construction, in order (their random
    draws follow the construction's, so the order is part of the weights)."""

    model_class: str
    config_class: str
    fields: dict[str, Any]
    adjust: tuple[Callable[[nn.Module], None], ...] = ()


def spread_norms_and_biases(model: nn.Module) -> None:
    """Norms and biases away from their initial ones/zeros: a weight applied the wrong way
    (w vs 1 + w), or not at all, changes the very first loss."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("norm.weight", "bias", "alpha_p", "alpha_n")):
                p.add_(0.1 * torch.randn(p.shape))


def xielu_off_defaults(model: nn.Module) -> None:
    """Apertus's xIELU beta and eps buffers off their defaults."""
    for layer in model.model.layers:
        layer.mlp.act_fn.beta.fill_(0.4 + 0.05 * torch.rand(()).item())
        layer.mlp.act_fn.eps.fill_(-1e-3 * (1 + torch.rand(()).item()))


def gemma4_experts_and_scalars(model: nn.Module) -> None:
    """Gemma 4's experts in eager (grouped_mm takes no float64); the layers' scalars, its
    router's scale and per-expert scales off one: a layer that skips one is off."""
    model.set_experts_implementation("eager")
    with torch.no_grad():
        for layer in model.model.layers:
            layer.layer_scalar.fill_(0.8 + 0.4 * torch.rand(()).item())
            layer.router.scale.add_(0.3 * torch.randn(layer.router.scale.shape))
            layer.router.per_expert_scale.add_(0.3 * torch.randn(4))


def qwen3_next_parts(model: nn.Module) -> None:
    """Qwen3-Next's (1 + w) RMSNorms in float64 (as Qwen3.5's), its experts in eager (grouped_mm
    takes no float64), routers that prefer some experts and shared-expert gates far from 0
    (sigmoid ~0.5 otherwise hides a gate applied wrongly)."""
    _faithful_norms(model, lambda name: name == "Qwen3NextRMSNorm")
    model.set_experts_implementation("eager")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("mlp.gate.weight", "shared_expert_gate.weight")):
                p.normal_(0, 0.5)


GEMMA4_MOE = dict(enable_moe_block=True, num_experts=4, top_k_experts=2, moe_intermediate_size=16)
GEMMA2_SOFTCAPS = dict(attn_logit_softcapping=2.0, final_logit_softcapping=3.0)
SLIDING_FULL = ["sliding_attention", "full_attention"]
HEAD_24 = dict(vocab_size=96, head_dim=24)
SPREAD = (spread_norms_and_biases,)

# every model's vocabulary is 96 unless it says otherwise (a vocabulary that needs padding at
# tsp 2 and 4: 101, 97)
ZOO: dict[str, ZooModel] = {
    "llama": ZooModel("LlamaForCausalLM", "LlamaConfig", dict(vocab_size=96)),
    # tied embeddings, a vocabulary that needs padding at D = 2, 4
    "llama-tied": ZooModel("LlamaForCausalLM", "LlamaConfig",
                           dict(vocab_size=101, tie_word_embeddings=True)),
    # sliding window smaller than the test sequences
    "mistral": ZooModel("MistralForCausalLM", "MistralConfig",
                        dict(vocab_size=96, sliding_window=7)),
    # q/k/v biases; layer 1 uses a sliding window
    "qwen2": ZooModel("Qwen2ForCausalLM", "Qwen2Config", dict(
        vocab_size=96, use_sliding_window=True, sliding_window=9, max_window_layers=1)),
    # per-head q/k norms, head_dim 24 (not 64/4), biases, a sliding layer
    "qwen3": ZooModel("Qwen3ForCausalLM", "Qwen3Config", dict(
        **HEAD_24, attention_bias=True, use_sliding_window=True, sliding_window=9,
        max_window_layers=1), SPREAD),
    # (1 + w) norms, scaled embedding, tanh-GELU, head_dim 24
    "gemma": ZooModel("GemmaForCausalLM", "GemmaConfig", HEAD_24,
                      (float64_gemma_norms, *SPREAD)),
    # sandwich norms, query_pre_attn_scalar, alternating sliding layers, soft-capping. The
    # soft-caps small for the scores and logits of this size: initializer_range 0.2 (not 0.02)
    # gives attention scores of about 2 (up to ~13) and logits of about 1.3 (up to ~6), so
    # tanh(s / 2) and tanh(logits / 3) are far from linear (GEMMA2_SOFTCAPS). HF's only
    # attention for Gemma 2 with soft-capping is its eager one, whose softmax runs in float32
    # whatever the dtype (1e-7 off in float64, like its loss): the reference uses the same
    # attention with the softmax in the model's dtype when that is wider (use_exact_eager)
    "gemma2": ZooModel("Gemma2ForCausalLM", "Gemma2Config", dict(
        **HEAD_24, query_pre_attn_scalar=20, sliding_window=9, initializer_range=0.2,
        **GEMMA2_SOFTCAPS), (use_exact_eager, float64_gemma_norms, *SPREAD)),
    # Gemma 2's layout plus per-head q/k norms and local/global rotary bases
    "gemma3": ZooModel("Gemma3ForCausalLM", "Gemma3TextConfig", dict(
        **HEAD_24, query_pre_attn_scalar=20, sliding_window=9, layer_types=SLIDING_FULL),
        (float64_gemma_norms, *SPREAD)),
    # embedding, residual, attention and logits multipliers
    "granite": ZooModel("GraniteForCausalLM", "GraniteConfig", dict(
        vocab_size=96, embedding_multiplier=3.0, residual_multiplier=0.5,
        attention_multiplier=0.3, logits_scaling=4.0), SPREAD),
    # q/k norms over all heads, norms after attention and MLP, biases
    "olmo2": ZooModel("Olmo2ForCausalLM", "Olmo2Config",
                      dict(vocab_size=96, attention_bias=True), SPREAD),
    # fused qkv_proj and gate_up_proj, sliding window, partial rotary (Phi-4-mini), padding row
    "phi3": ZooModel("Phi3ForCausalLM", "Phi3Config", dict(
        vocab_size=96, sliding_window=7, partial_rotary_factor=0.5, pad_token_id=0,
        eos_token_id=2), SPREAD),
    # OLMo 2's layout plus a sliding layer (layer_types)
    "olmo3": ZooModel("Olmo3ForCausalLM", "Olmo3Config", dict(
        vocab_size=96, attention_bias=True, sliding_window=9, layer_types=SLIDING_FULL),
        SPREAD),
    # q/k/v biases and an o_proj bias, head_dim 24; its dropouts (0.1 by default) off
    "seed_oss": ZooModel("SeedOssForCausalLM", "SeedOssConfig", dict(
        **HEAD_24, attention_bias=True, attention_out_bias=True, attention_dropout=0.0,
        residual_dropout=0.0), SPREAD),
    # Seed-OSS's shipped dropouts (SeedOssConfig(): attention_dropout and residual_dropout 0.1)
    # in eval mode: no dropout runs, exactly the p = 0 path
    "seed_oss-defaults": ZooModel("SeedOssForCausalLM", "SeedOssConfig", dict(
        **HEAD_24, attention_bias=True, attention_out_bias=True), (*SPREAD, nn.Module.eval)),
    # per-head q/k norms, norms after attention and MLP, head_dim 24, the hybrid layout: a
    # sliding layer with RoPE and a full one without (global NoPE)
    "exaone4": ZooModel("Exaone4ForCausalLM", "Exaone4Config", dict(
        **HEAD_24, sliding_window=9, layer_types=SLIDING_FULL), SPREAD),
    # a NoPE layer (no_rope_layers 0: no rotary at all) and a sliding one with RoPE
    "smollm3": ZooModel("SmolLM3ForCausalLM", "SmolLM3Config", dict(
        vocab_size=96, pad_token_id=None, no_rope_layers=[1, 0], use_sliding_window=True,
        sliding_window=9, layer_types=SLIDING_FULL), SPREAD),
    # interleaved partial rotary, fused gate_up_proj, q/k/v biases, four norms per layer
    "glm4": ZooModel("Glm4ForCausalLM", "Glm4Config", dict(**HEAD_24, pad_token_id=None),
                     SPREAD),
    # a bias on every projection (use_bias), interleaved rotary, tied embeddings, head_dim 24;
    # its float32 rotary in float64 (float64_ernie_rope)
    "ernie4_5": ZooModel("Ernie4_5ForCausalLM", "Ernie4_5Config", dict(
        **HEAD_24, use_bias=True, tie_word_embeddings=True), (float64_ernie_rope, *SPREAD)),
    # ungated MLP with xIELU (learnable alpha_p, alpha_n), per-head q/k norms, q/k/v/o biases;
    # its llama3 rope, scaled below a 64-token original length (a test sequence is longer)
    "apertus": ZooModel("ApertusForCausalLM", "ApertusConfig", dict(
        vocab_size=96, attention_bias=True, rope_parameters=dict(
            rope_type="llama3", rope_theta=12e6, factor=8.0, low_freq_factor=1.0,
            high_freq_factor=4.0, original_max_position_embeddings=64)),
        (xielu_off_defaults, *SPREAD)),
    # per-head q/k norms after RoPE, q/k/v/o biases, head_dim 24, NTK alpha (static:
    # "ntk_alpha")
    "hunyuan_v1_dense": ZooModel("HunYuanDenseV1ForCausalLM", "HunYuanDenseV1Config", dict(
        **HEAD_24, attention_bias=True, rope_parameters=dict(
            rope_type="dynamic", rope_theta=10000.0, alpha=1000.0, factor=1.0)), SPREAD),
    # layer 0 with RoPE: chunks of 5 tokens (a zigzag chunk holds 3 or 6), the L2 q/k norm and
    # the MoE (LLAMA4_MOE_LAYERS: 4 experts of 64 channels, top 1, a shared expert); NoPE
    # layer 1: the attention temperature (floor_scale 4: the factor changes every 4 tokens), a
    # dense MLP of intermediate_size_mlp 96, not intermediate_size 64. RoPE from complex
    # freqs_cis on channel pairs. Its float32 steps run in float64 in a float64 model
    # (tests/support/llama4_reference.py)
    "llama4_text": ZooModel("Llama4ForCausalLM", "Llama4TextConfig", dict(
        vocab_size=96, pad_token_id=None, intermediate_size=64, intermediate_size_mlp=96,
        no_rope_layers=[1, 0], attention_chunk_size=5, use_qk_norm=True,
        attn_temperature_tuning=True, floor_scale=4, attn_scale=0.5, num_local_experts=4,
        num_experts_per_tok=1, moe_layers=list(LLAMA4_MOE_LAYERS)),
        (llama4_reference.float64_llama4, *SPREAD)),
    # Gemma 4 text: weight-scaled norms, the value norm, global layers with their own head size
    # (32) and one key/value head (MQA: K/V slices at tsp 2, 4) whose values are the keys'
    # projection (attention_k_eq_v); per-layer inputs; the final logit soft-cap; a vocabulary
    # that needs padding at tsp 2 and 4, for both embeddings; layers 2 and 3 reuse the K/V of
    # layers 0 and 1 (KV-shared layers), with MLPs of twice the width (use_double_wide_mlp);
    # the MoE block beside every MLP (enable_moe_block: 4 experts of 16 channels, top 2)
    "gemma4": ZooModel("Gemma4ForCausalLM", "Gemma4TextConfig", dict(
        num_hidden_layers=4, vocab_size=97, vocab_size_per_layer_input=97, head_dim=24,
        global_head_dim=32, num_global_key_value_heads=1, attention_k_eq_v=True,
        sliding_window=9, layer_types=SLIDING_FULL * 2, hidden_size_per_layer_input=8,
        num_kv_shared_layers=2, use_double_wide_mlp=True, final_logit_softcapping=3.0,
        initializer_range=0.2, **GEMMA4_MOE),
        (gemma4_experts_and_scalars, float64_gemma_norms, *SPREAD)),
    # Qwen3.5 text, full-attention layers only: the output gate ([query | gate] rows per head
    # in q_proj), partial rotary (0.25 of head_dim 24: 6 channels) through the text rotary's
    # mrope sections, (1 + w) norms, q/k/v/o biases
    "qwen3_5": ZooModel("Qwen3_5ForCausalLM", "Qwen3_5TextConfig", dict(
        **HEAD_24, attention_bias=True,
        layer_types=["full_attention"] * COMMON["num_hidden_layers"]),
        (float64_qwen3_5_norms, *SPREAD)),
    # Qwen3.5's Gated DeltaNet layers: all of them, or the mix (linear, full); their float32
    # islands in float64 (tests/support/delta_net_reference.py). Without a full-attention layer
    # HF's cache cannot say its length: no cache by default
    **{family: ZooModel("Qwen3_5ForCausalLM", "Qwen3_5TextConfig", dict(
        **HEAD_24, layer_types=["linear_attention", second], **delta_net_reference.DELTA_NET,
        use_cache=second == "full_attention"),
        (float64_qwen3_5_norms, delta_net_reference.float64_delta_nets,
         delta_net_reference.spread_delta_nets))
       for family, second in (("qwen3_5-linear", "linear_attention"),
                              ("qwen3_5-mixed", "full_attention"))},
    # Qwen3-Next: Qwen3.5's mix (a Gated DeltaNet layer, then a full-attention one with the
    # output gate, partial rotary, q/k/v/o biases) with the fused, per-key-head interleaved
    # in_proj_qkvz and in_proj_ba, and a sparse MoE in both layers (4 experts of 16 channels, top
    # 2, renormalised) with a shared expert of 32 channels behind its sigmoid gate; the
    # load-balancing loss (coefficient 0.3) in the loss; "qwen3_next-generate" without it
    # (Hugging Face's generate fails computing it under a padding mask)
    **{family: ZooModel("Qwen3NextForCausalLM", "Qwen3NextConfig", dict(
        **HEAD_24, attention_bias=True, layer_types=["linear_attention", "full_attention"],
        **delta_net_reference.DELTA_NET, num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=16, shared_expert_intermediate_size=32, norm_topk_prob=True,
        output_router_logits=aux, router_aux_loss_coef=0.3),
        (qwen3_next_parts, delta_net_reference.float64_delta_nets,
         delta_net_reference.spread_delta_nets, spread_norms_and_biases))
       for family, aux in (("qwen3_next", True), ("qwen3_next-generate", False))},
}


def save_with_word_tokenizer(model, path: str) -> str:
    """Save ``model`` and a word-level tokenizer over its ids (``"t5 t17"`` -> 5, 17; t0 unknown,
    t1 padding, t2 end of sequence) in ``path``, as the trainers load them; returns ``path``."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    model.save_pretrained(path)
    vocab = {f"t{i}": i for i in range(model.config.vocab_size)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="t0", pad_token="t1",
                            eos_token="t2").save_pretrained(path)
    return path


def reference_loss(model, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The unmodified model's loss on the full batch. In float32 it is HF's own loss; in float64
    the cross-entropy is taken from HF's logits in float64, because HF's ForCausalLMLoss casts
    logits to float32 first (that would cap agreement at ~1e-7)."""
    if model.dtype != torch.float64:
        return model(input_ids=ids, labels=labels).loss
    logits = model(input_ids=ids).logits
    shifted = F.pad(labels, (0, 1), value=-100)[:, 1:]
    return F.cross_entropy(logits.flatten(0, 1), shifted.flatten(), ignore_index=-100)


def sgd_reference(model, batches: list[torch.Tensor], lr: float, clip: float | None,
                  optimizer=torch.optim.SGD) -> dict:
    """The unmodified model on one process, one global batch per step: loss
    (:func:`reference_loss`), gradient, ``torch.nn.utils.clip_grad_norm_`` at ``clip`` (None:
    no clipping, the norm still measured), plain SGD (no momentum, no weight decay: the update
    is lr times the clipped gradient, so a gradient of the wrong scale shows in the weights
    unless clipping cancels it, and then in the norm; ``optimizer`` another class, e.g. AdamW,
    whose scale invariance only the norms and first gradients then guard). Returns the losses,
    the norms before clipping, the first step's gradients (before clipping; of the parameters
    that have one: a PeftModel's adapters) and the final weights."""
    opt = optimizer(model.parameters(), lr=lr)
    losses, norms, grads0 = [], [], None
    for ids in batches:
        loss = reference_loss(model, ids, ids)
        loss.backward()
        if grads0 is None:
            grads0 = {n: p.grad.detach().clone() for n, p in model.named_parameters()
                      if p.grad is not None}
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip or float("inf"))
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        norms.append(norm.item())
    weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return dict(losses=losses, norms=norms, grads0=grads0, weights=weights)


def assert_matches_reference(run: dict, ref: dict, tol: float, norm_tol: float | None = None,
                             what: str = "", loss_tol: float | None = None,
                             keys: tuple[str, ...] = ("losses", "norms", "grads0", "weights")
                             ) -> None:
    """A TSP run's losses (relative, ``loss_tol``), norms before clipping (relative,
    ``norm_tol``), first-step gradients and final weights (:func:`tests.reference.assert_close`,
    ``tol``) against :func:`sgd_reference`'s. ``keys`` names what is compared: a run that lacks
    one of them fails (it is not skipped), so a caller comparing less says so; a run's extra keys
    (a rank's other records) are not compared."""
    from tests.support.reference import assert_close

    missing = [key for key in keys if key not in run]
    assert not missing, f"{what}the run lacks {missing} (it has {sorted(run)})"
    norm_tol = tol if norm_tol is None else norm_tol
    loss_tol = tol if loss_tol is None else loss_tol
    for key, t in (("losses", loss_tol), ("norms", norm_tol)):
        if key in keys:
            assert len(run[key]) == len(ref[key]), f"{what}{key}: {run[key]} vs {ref[key]}"
            for step, (a, b) in enumerate(zip(run[key], ref[key])):
                assert abs(a - b) <= t * abs(b), f"{what}{key}, step {step}: {a} vs {b}"
    for key in ("grads0", "weights"):
        if key in keys:
            assert sorted(run[key]) == sorted(ref[key]), \
                f"{what}{key}: names differ: {sorted(set(run[key]) ^ set(ref[key]))}"
            for name, t in ref[key].items():
                assert_close(run[key][name], t, tol, f"{what}{key} {name}")


LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def lora_model(model, r: int, seed: int = 1):
    """``model`` inside PEFT's ``get_peft_model``: rank-``r`` LoRA (alpha 2r) on the seven
    projections, A and B random from ``seed`` (PEFT's B = 0 would give A no first gradient), the
    base frozen. Plain PEFT: the one-process reference builds the same."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    return get_peft_model(model, LoraConfig(r=r, lora_alpha=2 * r, init_lora_weights=False,
                                            target_modules=LORA_TARGETS))
