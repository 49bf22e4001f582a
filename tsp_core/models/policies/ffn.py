"""A policy's ``ffn`` group: :class:`FeedForwardPolicy`, a family's MLPs, dense or sparse, and
:class:`ExpertsPolicy`, where its sparse mixture-of-experts blocks keep their parts and how they
route."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from torch import nn


def _always(config: Any) -> bool:
    return True


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
    # router_apart); the norms around them are the policy's modules.layer_replicated
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
class FeedForwardPolicy:
    """A family's MLPs (defaults: Llama's, every layer a dense gated MLP of
    ``config.intermediate_size``). Each layer's dense width is read from its module; the config
    field ``dense_intermediate_size`` is what the planner and the baselines read without a model
    (Llama 4: ``intermediate_size_mlp``, its experts having ``intermediate_size``). ``moe``: the
    sparse mixture-of-experts blocks (Mixtral, Qwen3-MoE, ...), None for a dense family. The
    helpers answer per layer, because a family may mix dense and sparse layers or hold both in
    one layer."""

    dense_intermediate_size: str = "intermediate_size"
    moe: ExpertsPolicy | None = None

    def sparse_mlp(self, mlp: nn.Module) -> bool:
        """Whether a layer's MLP is the family's sparse mixture-of-experts block (a layer without
        ``experts`` is a dense one: Qwen3-MoE's ``mlp_only_layers``)."""
        return self.moe is not None and hasattr(mlp, self.moe.experts)

    def moe_beside_mlp(self, layer: nn.Module) -> bool:
        """Whether a decoder layer holds an MoE beside its dense MLP (``ExpertsPolicy.beside_mlp``:
        Gemma 4's layers with enable_moe_block have ``router`` and ``experts`` of their own)."""
        return self.moe is not None and self.moe.beside_mlp and hasattr(layer, self.moe.experts)
