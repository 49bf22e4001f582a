"""What a policy is and the registry of them: :class:`DecoderPolicy` (where a family keeps each
TSP role), :class:`ExpertsPolicy` (its sparse blocks), :func:`register_policy`,
:func:`find_policy`."""


from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from torch import nn


def _no_window(config: Any, attention: nn.Module) -> int | None:
    return None


def _always(config: Any) -> bool:
    return True


def _rotary(config: Any, attention: nn.Module) -> bool:
    return True


def _never(config: Any, attention: nn.Module) -> bool:
    return False


def _no_sharing(config: Any, attention: nn.Module) -> None:
    return None


def _softmax_router(config: Any) -> dict:
    return {}


@dataclass(frozen=True)
class ExpertsPolicy:
    """Where a family keeps its sparse mixture-of-experts blocks and how they route
    (:mod:`tsp_core.layers.moe`): the block's router and experts module names (Hugging Face's
    ``gate.weight``, ``experts.gate_up_proj``, ``experts.down_proj``), the config fields of the
    expert count, the experts per token and the per-expert intermediate size, whether the top-k
    weights are renormalised (``norm_topk(config)``) and cast back to the logits' dtype, and the
    names of the Hub's per-expert checkpoint layout (read and written by tsp_core.state.checkpoint).
    A layer whose MLP has no ``experts`` module is a dense one (Qwen3-MoE's ``mlp_only_layers``,
    GLM-4.5's ``first_k_dense_replace``). ``options(config)``: further
    :class:`~tsp_core.layers.moe.MoESpec` fields, the router kind and its parameters and the
    shared experts (GLM-4.5); ``aux_loss``: whether the family adds the load-balancing loss
    (GLM-4.5 balances with its correction bias instead and has none); ``router_float32``: the
    router weight may be float32 in a model of another dtype."""

    num_experts: str
    intermediate_size: str = "intermediate_size"
    top_k: str = "num_experts_per_tok"
    router: str = "gate"
    experts: str = "experts"
    norm_topk: Callable[[Any], bool] = field(default=_always)
    weights_in_logits_dtype: bool = False
    # the Hub's checkpoint layout (transformers' conversion mapping): one tensor per expert and
    # projection, ``<mlp>.experts.<e>.<gate|up|down>.weight``, the block under ``hub_module``;
    # None: the Hub stores the experts as the model does (gpt-oss, Llama 4)
    hub_parts: tuple[str, str, str] | None = ("gate_proj", "up_proj", "down_proj")
    hub_module: str | None = None   # the block's name in the checkpoint, if not the model's
    options: Callable[[Any], dict] = field(default=_softmax_router)
    aux_loss: bool = True
    # the router's weight may stay float32 in a model of another dtype (GLM-4.5: transformers
    # keeps it so, ``_keep_in_fp32_modules_strict``); the TSP router keeps its dtype
    router_float32: bool = False
    # the block's forward returns (hidden states, its router's output) and its decoder layer
    # unpacks the pair (gpt-oss, Llama 4); the TSP block returns (hidden states, router logits)
    returns_pair: bool = False
    # the router and the experts are the decoder layer's own modules, beside its dense MLP, and
    # the layer's code calls them apart: router(x) -> (probabilities, weights, experts), then
    # experts(x', experts, weights) (Gemma 4's enable_moe_block; TSPRouter and TSPMoE with
    # router_apart); the norms around them are the policy's layer_replicated
    beside_mlp: bool = False

    def spec(self, config: Any, size: int, activation: str = "silu"):
        """The :class:`~tsp_core.layers.moe.MoESpec` of the sparse MLPs over ``size`` ranks."""
        from ...layers.moe import MoESpec

        options = {"activation": activation, "router_name": self.router,
                   "router_apart": self.beside_mlp,  # the layer calls the router itself
                   **self.options(config)}  # options may set the experts' own activation
        return MoESpec(config.hidden_size, getattr(config, self.intermediate_size),
                       getattr(config, self.num_experts), getattr(config, self.top_k), size,
                       norm_topk=self.norm_topk(config),
                       weights_in_logits_dtype=self.weights_in_logits_dtype, **options)


@dataclass(frozen=True)
class DecoderPolicy:
    """Module names of one decoder-only family (defaults: the Llama layout shared by Mistral and
    Qwen2), how to read a layer's sliding window and attention chunk (an attention module's
    ``sinks`` parameter, gpt-oss's, is found by name), and the hooks the TSP modules call:
    per-head q/k norms (``head_norms``: the attention's module names, each an RMSNorm over
    head_dim), the norms' numerics (``norm``), a divisor of the logits (``logits_divisor(config)``), soft-caps
    (``tanh(x / cap) * cap``, None: off) of the attention scores (``attn_softcap(config)``) and of
    the logits after the divisor (``logits_softcap(config)``), the config fields to refuse
    (``unsupported``), and Gemma 4's hooks: a weightless value norm (``value_norm``), layers
    whose values are the key projection (``values_from_keys(config, attention)``), further
    vocabulary-sharded embeddings (``extra_embeds``) and small replicated per-token Linears and
    norms (``base_replicated``, ``layer_replicated``). Each layer's key/value heads, head_dim and
    MLP width are read from its Hugging Face modules. The rest of a family (embedding scale,
    sandwich norms, residual multipliers, per-layer rotary embeddings, the softmax scale) is the
    Hugging Face model's own code around the TSP modules, in training and in generation; the
    attention's ``scaling`` is read from the module, a scaled word embedding's ``embed_scale``
    too."""

    name: str
    model_types: tuple[str, ...]
    class_names: tuple[str, ...] = ()
    base_model: str = "model"
    embed: str = "embed_tokens"
    layers: str = "layers"
    final_norm: str = "norm"
    lm_head: str = "lm_head"
    attention: str = "self_attn"
    mlp: str = "mlp"
    layer_norms: tuple[str, ...] = ("input_layernorm", "post_attention_layernorm")
    sliding_window: Callable[[Any, nn.Module], int | None] = field(default=_no_window)
    # a layer's chunked local attention (Llama 4: a token sees only its own chunk), None: off
    attention_chunk: Callable[[Any, nn.Module], int | None] = field(default=_no_window)
    # whether a layer's attention rotates q and k (False: a NoPE layer, SmolLM3's
    # no_rope_layers, EXAONE 4's hybrid full layers): read from the HF attention module
    rotary: Callable[[Any, nn.Module], bool] = field(default=_rotary)
    # a layer's per-token query scale, a function of the tokens' global positions
    # (AttentionSpec.query_scale: Llama 4's attention temperature on NoPE layers), None: off
    query_scale: Callable[[Any, nn.Module], Any] = field(default=_no_window)
    # the eps of a layer's weightless L2 q/k norm (Llama 4's qk_norm, only on its RoPE layers,
    # after RoPE with head_norms_after_rope), None: none
    l2_qk_norm: Callable[[Any, nn.Module], float | None] = field(default=_no_window)
    # the config field of the dense MLPs' intermediate size (Llama 4: intermediate_size_mlp)
    dense_intermediate_size: str = "intermediate_size"
    rope_interleaved: bool = False  # RoPE on channel pairs (2i, 2i+1): GLM-4, Ernie 4.5
    # the model's rotary gives cos/sin [.., head_dim / 2], each frequency once, and rotates
    # halves with them (gpt-oss); TSP widens them to Hugging Face's usual cat(freqs, freqs)
    rope_half_width: bool = False
    head_norms: tuple[str, str] | None = None  # the attention's per-head q/k RMSNorms (Qwen3)
    # whether the config turns those norms on (GLM-4.5's use_qk_norm); default: always
    head_norms_on: Callable[[Any], bool] = field(default=_always)
    qk_norm_all_heads: bool = False            # ... over all heads of a token instead (OLMo 2)
    head_norms_after_rope: bool = False        # ... applied after RoPE (Hunyuan dense)
    norm: str = "llama"                        # every RMSNorm's numerics (layers.norm.NORMS)
    logits_divisor: Callable[[Any], float] | None = None  # logits / this (Granite)
    attn_softcap: Callable[[Any], float | None] | None = None    # scores soft-capped (Gemma 2)
    logits_softcap: Callable[[Any], float | None] | None = None  # logits soft-capped (Gemma 2)
    # config fields TSP does not implement: (name, what it is); a truthy value is refused
    unsupported: tuple[tuple[str, str], ...] = ()
    # the query projection gives per head [query | gate] and the attention output is multiplied
    # by sigmoid(gate) before o_proj (Qwen3.5, Qwen3-Next: TSPAttention's output_gate)
    output_gate: bool = False
    # projections the Hugging Face model fuses into one Linear (Phi-3): (role, fused module,
    # parts in row order), role "attention" or "mlp"; the TSP module keeps the parts and names
    # them by the fused tensor in every full state dict and checkpoint (ShardedModule.fuse)
    fused: tuple[tuple[str, str, tuple[str, ...]], ...] = ()
    # generation: Hugging Face's generate drops the KV cache and runs the whole sequence again
    # when it first reaches this many tokens + 1 (Phi-3: original_max_position_embeddings, where
    # longrope switches factors); tsp_core.generate does the same
    recompute_cache_at: Callable[[Any], int | None] | None = None
    # sparse mixture-of-experts MLPs (Mixtral, Qwen3-MoE): None for dense families
    moe: ExpertsPolicy | None = None
    # the attention's RMSNorm without a weight over each value head (Gemma 4's v_norm): it holds
    # no tensor, so only the policy can say it is there; its eps is read from the module
    value_norm: str | None = None
    # the decoder layer's Gated DeltaNet module (Qwen3.5's linear attention): a layer that has it
    # has no softmax attention and runs TSPGatedDeltaNet (tsp_core.layers.linear_attention)
    linear_attention: str | None = None
    # a layer whose attention has no value projection: the values are the key projection's
    # output before the key norm and RoPE (Gemma 4's attention_k_eq_v on its global layers)
    values_from_keys: Callable[[Any, nn.Module], bool] = field(default=_never)
    # further embeddings over a vocabulary on the base model, vocabulary-sharded like the main
    # one (Gemma 4's per-layer inputs, embed_tokens_per_layer), where the model has them
    extra_embeds: tuple[str, ...] = ()
    # small per-token Linears and RMSNorms on the base model and in each layer, replicated over
    # the TSP group (their gradients summed over it), where the model has them (Gemma 4's
    # per-layer input projections and norms); any parameter left unconverted is refused
    base_replicated: tuple[str, ...] = ()
    layer_replicated: tuple[str, ...] = ()
    # KV-shared layers (Gemma 4's num_kv_shared_layers): ("store", key) for a layer whose K/V
    # later layers reuse, ("reuse", key) for a layer that attends with the K/V last stored under
    # key, None for the others; the Hugging Face model's own forward passes the K/V between them
    # (its ``shared_kv_states``)
    kv_sharing: Callable[[Any, nn.Module], tuple[str, Any] | None] = field(default=_no_sharing)
    # a layer's attention built by the family instead of TSPAttention, with its own schedule
    # (DeepSeek-V3's multi-head latent attention): (mesh, config, the Hugging Face attention,
    # dtype/device options) -> the TSP module; None: TSPAttention
    attention_module: Callable[..., nn.Module] | None = None

    def qk_norms(self, config: Any) -> tuple[str, str] | None:
        """The q/k norms' module names where ``config`` has them, else None."""
        return self.head_norms if self.head_norms and self.head_norms_on(config) else None

    def sparse_mlp(self, mlp: nn.Module) -> bool:
        """Whether a layer's MLP is the family's sparse mixture-of-experts block (a layer without
        ``experts`` is a dense one: Qwen3-MoE's ``mlp_only_layers``)."""
        return self.moe is not None and hasattr(mlp, self.moe.experts)

    def moe_beside_mlp(self, layer: nn.Module) -> bool:
        """Whether a decoder layer holds an MoE beside its dense MLP (``ExpertsPolicy.beside_mlp``:
        Gemma 4's layers with enable_moe_block have ``router`` and ``experts`` of their own)."""
        return self.moe is not None and self.moe.beside_mlp and hasattr(layer, self.moe.experts)

    def fused_in(self, role: str) -> dict[str, tuple[str, ...]]:
        """The fused projections of ``role`` ("attention" or "mlp"): fused name -> parts."""
        return {name: parts for r, name, parts in self.fused if r == role}


_POLICIES: dict[str, DecoderPolicy] = {}


def register_policy(policy: DecoderPolicy) -> DecoderPolicy:
    """Make ``policy`` available to :func:`tsp_core.parallelize` (idempotent by name)."""
    _POLICIES[policy.name] = policy
    return policy


def supported() -> list[str]:
    return sorted(_POLICIES)


def find_policy(model: nn.Module) -> DecoderPolicy:
    """The policy for ``model``: by class name (including base classes), then model_type."""
    names = {c.__name__ for c in type(model).__mro__}
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    for policy in _POLICIES.values():
        if names & set(policy.class_names) or model_type in policy.model_types:
            return policy
    raise ValueError(
        f"no TSP policy for {type(model).__name__} (model_type={model_type!r}); supported: "
        f"{supported()}. Describe its module names with tsp_core.models.DecoderPolicy(...) and "
        f"pass it as parallelize(model, mesh, policy=...) or register it with "
        f"tsp_core.models.register_policy(...)")
