"""Stage 1 of :func:`tsp_core.parallelize`: read the Hugging Face model into one spec per layer.

What each decoder layer is made of (softmax attention with its key/value heads and head size, or
a Gated DeltaNet; a gated, plain or mixture-of-experts MLP and its width; an MoE beside the MLP),
read once from the model's own modules and the policy, so that the checks (:mod:`.checks`) and
the construction (:mod:`.build`) look at the same facts. Reading never raises for a model the
checks will refuse: a missing module reads as absent."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..distributed.mesh import TSPMesh
from ..layers.attention import AttentionParts
from ..layers.moe import MoESpec, choose_schedule
from .policies import DecoderPolicy
from .policies.attention import norm_eps  # noqa: F401  (read here by checks and build)

# Hugging Face's activation names -> the TSP MLPs' (tsp_core.layers.mlp)
ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh",
               "gelu_tanh": "gelu_tanh", "xielu": "xielu"}


@dataclass(frozen=True)
class LayerSpec:
    """One decoder layer as TSP sees it."""

    index: int
    module: nn.Module  # the Hugging Face decoder layer
    delta_net: nn.Module | None  # its Gated DeltaNet (Qwen3.5), None: softmax attention
    attention: nn.Module | None  # its softmax attention module, None: a Gated DeltaNet layer
    kv_heads: int  # the attention's key/value heads and head size (Gemma 4's own per layer)
    head_dim: int
    mlp: nn.Module  # the Hugging Face MLP (or sparse block)
    mlp_kind: str  # "moe", "plain" (down(act(up(x)))) or "gated"
    mlp_width: int | None  # a dense MLP's intermediate size, None for an MoE block
    moe_beside: bool  # an MoE beside the dense MLP (Gemma 4's enable_moe_block)


@dataclass(frozen=True)
class ModelSpec:
    """The whole model as TSP sees it: the config's head shape, every layer, the MoE shape."""

    config: Any
    num_heads: int
    kv_heads: int
    head_dim: int
    layers: tuple[LayerSpec, ...]
    moe: MoESpec | None  # the sparse MLPs' shape and routing, None for a dense model


def read_model(model: nn.Module, mesh: TSPMesh, policy: DecoderPolicy) -> ModelSpec:
    """The spec of ``model`` under ``policy`` for a TSP group of ``mesh.size`` ranks."""
    c = model.config
    nq, nkv, head_dim = config_shape(c)
    base = getattr(model, policy.modules.base_model, None)
    layers = tuple(read_layer(i, layer, c, policy, (nq, nkv, head_dim))
                   for i, layer in enumerate(getattr(base, policy.modules.layers, [])))
    has_moe = any(s.mlp_kind == "moe" or s.moe_beside for s in layers)
    return ModelSpec(c, nq, nkv, head_dim, layers, moe_spec(c, policy, mesh) if has_moe else None)


def read_layer(index: int, layer: nn.Module, config: Any, policy: DecoderPolicy,
               shape: tuple[int, int, int]) -> LayerSpec:
    """One decoder layer's spec (``shape``: the config's query heads, key/value heads and
    head size)."""
    delta = delta_net(layer, policy)
    attn = None if delta is not None else getattr(layer, policy.modules.attention, None)
    kv_heads, head_dim = shape[1:]
    if attn is not None:
        kv_heads, head_dim = attention_shape(attn, *shape)
    mlp = getattr(layer, policy.modules.mlp, None)
    kind = ("moe" if policy.ffn.sparse_mlp(mlp) else "plain" if is_plain_mlp(mlp, policy)
            else "gated")
    width = None if kind == "moe" else mlp_width(mlp, config, policy)
    return LayerSpec(index, layer, delta, attn, kv_heads, head_dim, mlp, kind, width,
                     policy.ffn.moe_beside_mlp(layer))


def attention_parts(layer: LayerSpec, config: Any, policy: DecoderPolicy
                    ) -> AttentionParts | None:
    """The parts the policy reads from a layer's Hugging Face attention
    (:meth:`~.policies.attention.AttentionPolicy.parts`), read when the checks and the build
    need them (a model already parallelized holds no Hugging Face attention to read); None for
    a layer without softmax attention or with the family's own attention module."""
    if layer.attention is None or policy.attn.module is not None:
        return None
    return policy.attn.parts(config, layer.attention, policy.norm)


def config_shape(config: Any) -> tuple[int, int, int]:
    """(query heads, key/value heads, head_dim) of the config; on a heterogeneous config (Gemma
    4's: head_dim and num_key_value_heads per layer, which transformers refuses to read globally)
    the model-wide values, each layer's own being read from its attention module
    (:func:`attention_shape`)."""
    def read(name: str) -> Any:
        try:
            return getattr(config, name, None)
        except RuntimeError:  # transformers' AmbiguousGlobalPerLayerAttributeError
            return config._getattr_without_heterogeneous_validation(name)

    nq = config.num_attention_heads
    return nq, read("num_key_value_heads") or nq, read("head_dim") or config.hidden_size // nq


def attention_shape(attn: nn.Module, nq: int, nkv: int, head_dim: int) -> tuple[int, int]:
    """A layer's (key/value heads, head_dim): the Hugging Face attention module's own where it
    has them (``num_key_value_groups``, ``head_dim``: Gemma 4's global layers have their own),
    else the config's ``nkv`` and ``head_dim``."""
    groups = getattr(attn, "num_key_value_groups", None)
    return (nq // groups if groups else nkv), (getattr(attn, "head_dim", None) or head_dim)


def delta_net(layer: nn.Module, policy: DecoderPolicy) -> nn.Module | None:
    """A decoder layer's Gated DeltaNet (``ModuleNames.linear_attention``, Qwen3.5's linear
    attention), None for a layer with softmax attention."""
    name = policy.modules.linear_attention
    return getattr(layer, name, None) if name else None


def mlp_width(mlp: nn.Module, config: Any, policy: DecoderPolicy) -> int:
    """A dense MLP's intermediate size, from its up projection's rows (its share of a fused one):
    each layer's own (Gemma 4's double-wide MLPs on its KV-shared layers), else the config's."""
    for name, parts in policy.modules.fused_in("mlp").items():
        if "up_proj" in parts and isinstance(getattr(mlp, name, None), nn.Linear):
            return getattr(mlp, name).out_features // len(parts)
    up = getattr(mlp, "up_proj", None)
    if isinstance(up, nn.Linear):
        return up.out_features
    return getattr(config, policy.ffn.dense_intermediate_size)


def is_plain_mlp(mlp: nn.Module, policy: DecoderPolicy) -> bool:
    """Whether a dense MLP is ungated, ``down(act(up(x)))`` (Apertus): it has no gate, plain or
    fused; :class:`~tsp_core.layers.mlp.TSPPlainMLP` replaces it."""
    return not (policy.ffn.sparse_mlp(mlp) or hasattr(mlp, "gate_proj")
                or policy.modules.fused_in("mlp"))


def moe_spec(config: Any, policy: DecoderPolicy, mesh: TSPMesh) -> MoESpec:
    """The shape and routing of the family's sparse MLPs, from the config."""
    return policy.ffn.moe.spec(config, mesh.size, ACTIVATIONS.get(activation(config), "silu"))


def activation(config: Any) -> str:
    """The MLP's activation name (Gemma 2/3 call the field hidden_activation)."""
    return getattr(config, "hidden_act", None) or getattr(config, "hidden_activation", None)


def softcap(hook: Any, config: Any) -> float | None:
    """A policy's soft-cap of ``config`` (None: the family has none, or it is off)."""
    cap = None if hook is None else hook(config)
    return None if cap is None else float(cap)


def hf_linear(module: nn.Module, name: str, fused: dict[str, tuple[str, ...]]) -> nn.Module:
    """The Hugging Face Linear holding projection ``name``: itself, or the fused one it is part
    of (Phi-3's ``qkv_proj`` holds q_proj's rows)."""
    for fused_name, parts in fused.items():
        if name in parts:
            return getattr(module, fused_name)
    return getattr(module, name)


def placement(model: nn.Module, mesh: TSPMesh) -> dict[str, Any]:
    """The dtype and device of the TSP modules: the model's own; for a model on the meta device
    (weights come later, from load_full_state_dict), the mesh's device."""
    p0 = next(model.parameters())
    if not p0.is_meta:
        device = p0.device
    elif mesh.device_type == "cuda":
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        device = torch.device("cpu")
    return {"dtype": p0.dtype, "device": device}


def moe_schedule_for(model: nn.Module, mesh: TSPMesh, policy: DecoderPolicy, requested: str,
                     tokens_per_rank: int | None) -> str:
    """The MoE schedule the layers run: ``requested``, or for "auto" the one that moves fewer
    bytes at ``tokens_per_rank`` (:func:`tsp_core.layers.moe.choose_schedule`). A dense model
    (a dense Gemma 4 under its MoE policy, too) keeps "auto": it has no MoE layer."""
    if policy.ffn.moe is None or requested != "auto" or not getattr(
            model.config, policy.ffn.moe.num_experts, None):
        return requested
    return choose_schedule(moe_spec(model.config, policy, mesh), tokens_per_rank)
