"""Stage 3 of :func:`tsp_core.parallelize`: build the TSP modules from the specs.

:func:`plan_modules` builds every TSP module that will replace a Hugging Face one (vocabulary
embeddings, attention or Gated DeltaNet, MLP or experts, norms, small replicated modules, the
head) and records each replacement in a :class:`ModulePlan`, with the state it will load;
nothing in the model changes here (:mod:`.wrap` applies the plan once it is checked). Each kind
of module has one builder; a family's own attention comes from its policy
(``DecoderPolicy.attention_module``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..distributed.mesh import TSPMesh
from ..layers.attention import TSPAttention
from ..layers.mlp import TSPGatedMLP, TSPPlainMLP
from ..layers.moe import TSPMoE, TSPRouter
from ..layers.norm import TSPRMSNorm
from ..layers.replicated import TSPReplicatedLinear
from ..layers.vocab import TSPEmbedding, TSPLMHead
from .checks import refuse_left_out
from .delta_net import tsp_delta_net
from .hf_attention import HFTSPAttention
from .policies import DecoderPolicy
from .reading import (
    ACTIVATIONS,
    LayerSpec,
    ModelSpec,
    activation,
    hf_linear,
    norm_eps,
    softcap,
)


@dataclass
class Replacement:
    """One Hugging Face module to replace: ``parent.name = new``, loading ``state`` (the replaced
    module's, None for a model on the meta device or a tied head)."""

    parent: nn.Module
    name: str
    new: nn.Module
    state: dict[str, torch.Tensor] | None


@dataclass
class ModulePlan:
    """The replacements of one model, in order, and what building them needs."""

    mesh: TSPMesh
    policy: DecoderPolicy
    spec: ModelSpec
    opts: dict[str, Any]  # dtype and device of the TSP modules (.reading.placement)
    empty: bool  # the model is on the meta device: no state to load
    moe_schedule: str
    replacements: list[Replacement] = field(default_factory=list)
    # KV sharing: key -> the index (among the attention layers) of the layer that stores it
    kv_stores: dict[Any, int] = field(default_factory=dict)
    attention_layers: int = 0  # softmax attention layers built so far

    def replace(self, parent: nn.Module, name: str, new: nn.Module,
                old: nn.Module | None = None) -> None:
        """Plan ``parent.name = new``; a fused Hugging Face projection's parts are fused in the
        TSP module too, and its state is checked to be taken whole."""
        role = ("attention" if isinstance(new, TSPAttention) else
                "mlp" if isinstance(new, TSPGatedMLP) else None)
        if role is not None and self.policy.fused_in(role):  # Hugging Face's fused projections
            new.fuse(self.policy.fused_in(role))
        state = None
        if not self.empty:
            state = (old or getattr(parent, name)).state_dict()
            refuse_left_out(self.policy, f"{parent.__class__.__name__}.{name}", state, new)
        self.replacements.append(Replacement(parent, name, new, state))

    def replicate(self, parent: nn.Module, names: tuple[str, ...]) -> None:
        """Plan the policy's small per-token modules of ``parent`` replicated over the group."""
        for name in names:
            if getattr(parent, name, None) is not None:
                self.replace(parent, name, replicated(self, getattr(parent, name)))


def plan_modules(model: nn.Module, plan: ModulePlan) -> ModulePlan:
    """Every replacement of ``model``, built and recorded in ``plan``."""
    policy = plan.policy
    base = getattr(model, policy.base_model)
    embed = plan_embeddings(base, plan)
    plan.replicate(base, policy.base_replicated)
    for layer in plan.spec.layers:
        plan_layer(layer, plan)
    plan.replace(base, policy.final_norm, rms_norm(plan, getattr(base, policy.final_norm)))
    plan_head(model, embed, plan)
    return plan


def plan_embeddings(base: nn.Module, plan: ModulePlan) -> TSPEmbedding:
    """The vocabulary-sharded embedding and the family's further ones (Gemma 4's per-layer
    inputs, where the model has them); returns the main one (a tied head shares it)."""
    c = plan.spec.config
    embed = embedding(plan, getattr(base, plan.policy.embed), c.vocab_size, c.hidden_size)
    plan.replace(base, plan.policy.embed, embed)
    for name in plan.policy.extra_embeds:
        old = getattr(base, name, None)
        if old is not None:
            plan.replace(base, name, embedding(plan, old, old.num_embeddings, old.embedding_dim))
    return embed


def embedding(plan: ModulePlan, old: nn.Embedding, rows: int, width: int) -> TSPEmbedding:
    """A vocabulary-sharded embedding of ``rows`` x ``width`` in ``old``'s place (with Hugging
    Face's scale, Gemma's)."""
    new = TSPEmbedding(plan.mesh, rows, width, old.padding_idx, init_seed=None, **plan.opts)
    if getattr(old, "embed_scale", None) is not None:  # HF's scaled word embedding (Gemma)
        new.scale_by(old.embed_scale)
    return new


def plan_layer(layer: LayerSpec, plan: ModulePlan) -> None:
    """One decoder layer: its attention (or Gated DeltaNet), MLP (or experts), norms and
    replicated modules."""
    policy, c = plan.policy, plan.spec.config
    if layer.delta_net is not None:  # Qwen3.5's Gated DeltaNet: no softmax attention here
        plan.replace(layer.module, policy.linear_attention,
                     tsp_delta_net(plan.mesh, c, layer.delta_net, plan.opts))
    else:
        plan.replace(layer.module, policy.attention, build_attention(layer, plan))
    plan.replace(layer.module, policy.mlp, build_mlp(layer, plan))
    if layer.moe_beside:  # Gemma 4: the layer calls its router and experts itself
        moe = plan.spec.moe
        plan.replace(layer.module, policy.moe.router,
                     TSPRouter(plan.mesh, moe, init_seed=None, **plan.opts))
        plan.replace(layer.module, policy.moe.experts, experts(plan, moe))
    for norm in policy.layer_norms:
        plan.replace(layer.module, norm, rms_norm(plan, getattr(layer.module, norm)))
    plan.replicate(layer.module, policy.layer_replicated)


def build_attention(layer: LayerSpec, plan: ModulePlan) -> nn.Module:
    """The TSP attention of one layer: the family's own module (DeepSeek-V3's latent attention),
    else an :class:`HFTSPAttention` with the parts the policy reads from the Hugging Face
    module; a KV-sharing layer learns which earlier layer stores its K/V."""
    policy, c, attn, mesh = plan.policy, plan.spec.config, layer.attention, plan.mesh
    sharing = policy.kv_sharing(c, attn)
    own = policy.attention_module  # the family's own schedule (DeepSeek-V3's latent one)
    new = own(mesh, c, attn, plan.opts) if own is not None else hf_attention(layer, plan)
    if sharing is not None:
        new.kv_role, new.kv_key = sharing
        if sharing[0] == "reuse":  # the last layer before it that stores under its key
            new.kv_source = plan.kv_stores.get(new.kv_key)
        else:
            plan.kv_stores[new.kv_key] = plan.attention_layers
    plan.attention_layers += 1
    new.rotary = bool(policy.rotary(c, attn))
    new.rope_half_width = policy.rope_half_width
    return new


def hf_attention(layer: LayerSpec, plan: ModulePlan) -> HFTSPAttention:
    """An :class:`HFTSPAttention` with the parts the policy reads from the layer's Hugging Face
    attention module."""
    policy, c, attn, mesh = plan.policy, plan.spec.config, layer.attention, plan.mesh
    l2_eps = policy.l2_qk_norm(c, attn)  # a weightless L2 q/k norm (Llama 4)
    sharing = policy.kv_sharing(c, attn)
    reuse = sharing is not None and sharing[0] == "reuse"
    return HFTSPAttention(
        mesh, c.hidden_size, plan.spec.num_heads, layer.kv_heads, layer.head_dim,
        qkv_bias=hf_linear(attn, "q_proj", policy.fused_in("attention")).bias is not None,
        o_bias=attn.o_proj.bias is not None, sliding_window=policy.sliding_window(c, attn),
        scale=attn.scaling,
        qk_norm_eps=head_norm_eps(policy, attn, c) if l2_eps is None else l2_eps,
        qk_norm_kind=policy.norm if l2_eps is None else "l2",
        softcap=softcap(policy.attn_softcap, c),
        qk_norm_all_heads=policy.qk_norm_all_heads,
        qk_norm_after_rope=policy.head_norms_after_rope,
        qk_norm_names=policy.head_norms or ("q_norm", "k_norm"),
        rope_interleaved=policy.rope_interleaved,
        attention_chunk_size=policy.attention_chunk(c, attn),
        sinks=isinstance(getattr(attn, "sinks", None), nn.Parameter),
        query_scale=policy.query_scale(c, attn),
        v_norm_eps=None if reuse else value_norm_eps(policy, attn),
        values_from_keys=bool(policy.values_from_keys(c, attn)), kv_shared=reuse,
        kv_out=sharing is not None and sharing[0] == "store",
        output_gate=policy.output_gate, init_seed=None, **plan.opts)


def head_norm_eps(policy: DecoderPolicy, attn: nn.Module, config: Any) -> float | None:
    """The epsilon of the attention's per-head q/k norms (None: the model has none)."""
    if policy.qk_norms(config) is None:
        return None
    return norm_eps(getattr(attn, policy.head_norms[0]))


def value_norm_eps(policy: DecoderPolicy, attn: nn.Module) -> float | None:
    """The epsilon of the attention's weightless value norm (``DecoderPolicy.value_norm``), None
    when the policy names none."""
    if policy.value_norm is None:
        return None
    norm = getattr(attn, policy.value_norm, None)
    if norm is None:
        raise ValueError(f"the policy {policy.name!r} names a value norm {policy.value_norm!r} "
                         f"that the attention ({type(attn).__name__}) does not have")
    return norm_eps(norm)


def build_mlp(layer: LayerSpec, plan: ModulePlan) -> nn.Module:
    """The TSP MLP of one layer, by its kind: the experts, an ungated MLP or a gated one."""
    c, mlp, policy = plan.spec.config, layer.mlp, plan.policy
    if layer.mlp_kind == "moe":
        return experts(plan, plan.spec.moe, returns_pair=policy.moe.returns_pair,
                       router_dtype=getattr(mlp, policy.moe.router).weight.dtype)
    act = ACTIVATIONS[activation(c)]
    if layer.mlp_kind == "plain":
        return TSPPlainMLP(plan.mesh, c.hidden_size, layer.mlp_width, activation=act,
                           bias=mlp.up_proj.bias is not None, init_seed=None, **plan.opts)
    bias = hf_linear(mlp, "gate_proj", policy.fused_in("mlp")).bias is not None
    return TSPGatedMLP(plan.mesh, c.hidden_size, layer.mlp_width, activation=act, bias=bias,
                       init_seed=None, **plan.opts)


def experts(plan: ModulePlan, spec: Any, **options: Any) -> TSPMoE:
    """A TSP mixture of experts of ``spec`` under the plan's MoE schedule."""
    return TSPMoE(plan.mesh, spec.hidden_size, spec.intermediate_size, spec.num_experts,
                  spec.top_k, **spec.options(), schedule=plan.moe_schedule, init_seed=None,
                  **options, **plan.opts)


def rms_norm(plan: ModulePlan, old: nn.Module) -> TSPRMSNorm:
    """A replicated RMSNorm like ``old``, in its weight's dtype (Hugging Face may keep norms
    float32), with the family's numerics."""
    return TSPRMSNorm(plan.mesh, plan.spec.config.hidden_size, norm_eps(old), plan.policy.norm,
                      **{**plan.opts, "dtype": old.weight.dtype})


def replicated(plan: ModulePlan, old: nn.Module) -> nn.Module:
    """The TSP module, replicated over the group, of a small per-token Linear or RMSNorm that
    the policy names (``base_replicated``, ``layer_replicated``)."""
    if isinstance(old, nn.Linear):
        return TSPReplicatedLinear(plan.mesh, old.in_features, old.out_features,
                                   old.bias is not None, init_seed=None, **plan.opts)
    weight = getattr(old, "weight", None)
    if isinstance(weight, nn.Parameter) and weight.dim() == 1 and (
            hasattr(old, "eps") or hasattr(old, "variance_epsilon")):
        return TSPRMSNorm(plan.mesh, weight.shape[0], norm_eps(old), plan.policy.norm,
                          **plan.opts)
    raise ValueError(f"the policy {plan.policy.name!r} replicates a {type(old).__name__}: only "
                     f"nn.Linear and RMSNorms (a 1-d weight and an eps) can be")


def plan_head(model: nn.Module, embed: TSPEmbedding, plan: ModulePlan) -> None:
    """The vocabulary-parallel LM head: tied to the embedding when the model ties them."""
    c, name = plan.spec.config, plan.policy.lm_head
    old = getattr(model, name)
    if old.weight is getattr(getattr(model, plan.policy.base_model), plan.policy.embed).weight:
        head = TSPLMHead(plan.mesh, c.vocab_size, c.hidden_size, tied_to=embed)
        plan.replacements.append(Replacement(model, name, head, None))
    else:
        plan.replace(model, name, TSPLMHead(plan.mesh, c.vocab_size, c.hidden_size,
                                            init_seed=None, **plan.opts), old)
