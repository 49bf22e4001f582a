"""Stage 3 of :func:`tsp_core.parallelize`: build the TSP modules from the specs.

:func:`plan_modules` builds every TSP module that will replace a Hugging Face one (vocabulary
embeddings, attention or Gated DeltaNet, MLP or experts, norms, small replicated modules, the
head) and records each replacement in a :class:`ModulePlan`, with the state it will load;
nothing in the model changes here (:mod:`.wrap` applies the plan once it is checked). Each kind
of module has one builder; a family's own attention comes from its policy
(``AttentionPolicy.module``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..distributed.mesh import TSPMesh
from ..layers.attention import AttentionShape, TSPAttention
from ..layers.dropout import RankDropout, RankDropoutModule
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
    attention_parts,
    hf_linear,
    norm_eps,
)


@dataclass
class Replacement:
    """One Hugging Face module to replace: ``parent.name = new``, loading ``state`` (the replaced
    module's, None for a model on the meta device, a tied head or a stateless module: a layer's
    own dropout made an identity)."""

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
        fused = {} if role is None else self.policy.modules.fused_in(role)
        if fused:  # Hugging Face's fused projections
            new.fuse(fused)
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
    names = plan.policy.modules
    base = getattr(model, names.base_model)
    embed = plan_embeddings(base, plan)
    plan.replicate(base, names.base_replicated)
    for layer in plan.spec.layers:
        plan_layer(layer, plan)
    plan.replace(base, names.final_norm, rms_norm(plan, getattr(base, names.final_norm)))
    plan_head(model, embed, plan)
    return plan


def plan_embeddings(base: nn.Module, plan: ModulePlan) -> TSPEmbedding:
    """The vocabulary-sharded embedding and the family's further ones (Gemma 4's per-layer
    inputs, where the model has them); returns the main one (a tied head shares it)."""
    c, names = plan.spec.config, plan.policy.modules
    embed = embedding(plan, getattr(base, names.embed), c.vocab_size, c.hidden_size)
    plan.replace(base, names.embed, embed)
    for name in names.extra_embeds:
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
        mixer = tsp_delta_net(plan.mesh, c, layer.delta_net, plan.opts)
        plan.replace(layer.module, policy.modules.linear_attention, mixer)
    else:
        mixer = build_attention(layer, plan)
        plan.replace(layer.module, policy.modules.attention, mixer)
    mlp = build_mlp(layer, plan)
    plan.replace(layer.module, policy.modules.mlp, mlp)
    add_output_dropout(plan, layer.module, (mixer, mlp))
    if layer.moe_beside:  # Gemma 4: the layer calls its router and experts itself
        moe = plan.spec.moe
        plan.replace(layer.module, policy.ffn.moe.router,
                     TSPRouter(plan.mesh, moe, init_seed=None, **plan.opts))
        plan.replace(layer.module, policy.ffn.moe.experts, experts(plan, moe))
    for norm in policy.modules.layer_norms:
        plan.replace(layer.module, norm, rms_norm(plan, getattr(layer.module, norm)))
    plan.replicate(layer.module, policy.modules.layer_replicated)


def add_output_dropout(plan: ModulePlan, layer: nn.Module, modules: tuple[nn.Module, ...]) -> None:
    """The policy's ``output_dropout`` (a config field; Seed-OSS's ``residual_dropout``, which
    Hugging Face applies inside the attention and MLP that TSP replaces) as a
    :class:`~tsp_core.layers.dropout.RankDropout` hook on a layer's new attention and MLP: each
    rank drops its own tokens with masks of its own. No hook for a field that is absent or 0.
    The layer's own dropout modules (``ModuleNames.layer_dropouts``, Phi-3's) become
    :class:`~tsp_core.layers.dropout.RankDropoutModule`: the same place and ``p``, each rank's own
    masks (left as they are, they would draw one mask for every rank)."""
    name = plan.policy.output_dropout
    for dropout in plan.policy.modules.layer_dropouts:
        new = RankDropoutModule.replacing(getattr(layer, dropout))
        plan.replacements.append(Replacement(layer, dropout, new, None))
    p = float(getattr(plan.spec.config, name, 0.0) or 0.0) if name else 0.0
    for module in modules if p else ():
        module.register_forward_hook(RankDropout(p))


def build_attention(layer: LayerSpec, plan: ModulePlan) -> nn.Module:
    """The TSP attention of one layer: the family's own module (``AttentionPolicy.module``:
    DeepSeek-V3's latent attention), else an :class:`HFTSPAttention` of the layer's shape and
    the parts the policy reads from the Hugging Face module (:func:`.reading.attention_parts`);
    a layer that reuses K/V learns which earlier layer stores them."""
    policy, c, attn, mesh = plan.policy, plan.spec.config, layer.attention, plan.mesh
    plan.attention_layers += 1
    if policy.attn.module is not None:
        return policy.attn.module(mesh, c, attn, plan.opts)
    bias = hf_linear(attn, "q_proj", policy.modules.fused_in("attention")).bias is not None
    shape = AttentionShape(c.hidden_size, plan.spec.num_heads, layer.kv_heads, layer.head_dim,
                           qkv_bias=bias, o_bias=attn.o_proj.bias is not None)
    parts = attention_parts(layer, c, policy)
    new = HFTSPAttention(mesh, shape, parts, init_seed=None, **plan.opts)
    new.attention_dropout = float(getattr(c, "attention_dropout", 0.0) or 0.0)
    sharing = parts.kv_sharing
    if sharing is not None and sharing.reuses:  # the last layer before it storing under its key
        new.kv_source = plan.kv_stores.get(sharing.key)
    elif sharing is not None:
        plan.kv_stores[sharing.key] = plan.attention_layers - 1
    return new


def build_mlp(layer: LayerSpec, plan: ModulePlan) -> nn.Module:
    """The TSP MLP of one layer, by its kind: the experts, an ungated MLP or a gated one."""
    c, mlp, policy = plan.spec.config, layer.mlp, plan.policy
    if layer.mlp_kind == "moe":
        return experts(plan, plan.spec.moe, returns_pair=policy.ffn.moe.returns_pair,
                       router_dtype=getattr(mlp, policy.ffn.moe.router).weight.dtype)
    act = ACTIVATIONS[activation(c)]
    if layer.mlp_kind == "plain":
        return TSPPlainMLP(plan.mesh, c.hidden_size, layer.mlp_width, activation=act,
                           bias=mlp.up_proj.bias is not None, init_seed=None, **plan.opts)
    bias = hf_linear(mlp, "gate_proj", policy.modules.fused_in("mlp")).bias is not None
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
    c, names = plan.spec.config, plan.policy.modules
    name = names.lm_head
    old = getattr(model, name)
    if old.weight is getattr(getattr(model, names.base_model), names.embed).weight:
        head = TSPLMHead(plan.mesh, c.vocab_size, c.hidden_size, tied_to=embed)
        plan.replacements.append(Replacement(model, name, head, None))
    else:
        plan.replace(model, name, TSPLMHead(plan.mesh, c.vocab_size, c.hidden_size,
                                            init_seed=None, **plan.opts), old)
