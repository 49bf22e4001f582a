"""Qwen3.5's and Qwen3-Next's Gated DeltaNet layers in a Hugging Face model under TSP: the
Hugging Face module read into a :class:`~tsp_core.layers.linear_attention.TSPGatedDeltaNet` with
its call signature (the policy's ``modules.linear_attention`` names the module; a decoder layer
that has it has no softmax attention), its tensors named as that model names them."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..distributed.mesh import TSPMesh
from ..layers.linear_attention import TSPGatedDeltaNet, check_delta_net_shape
from ..layers.sizes import valid_sizes_hint


class HFTSPGatedDeltaNet(TSPGatedDeltaNet):
    """:class:`TSPGatedDeltaNet` with the call signature of Hugging Face's
    ``Qwen3_5GatedDeltaNet``: ``forward(hidden_states, cache=None, attention_mask=None,
    **kwargs)``, packed rows from the model's ``tsp_docs``."""

    def forward(self, hidden_states: torch.Tensor, cache: Any = None,
                attention_mask: torch.Tensor | None = None, **kwargs: Any) -> torch.Tensor:
        state = self.tsp_decode  # tsp_core.inference.decode: prefill or a decode step
        if state is not None:
            return state.delta_net(self, hidden_states)
        if cache is not None:
            raise NotImplementedError("TSP's Gated DeltaNet takes no cache in its forward; "
                                      "generate with model.generate(...) or tsp_core.generate")
        if attention_mask is not None and not bool(attention_mask.all()):
            # Hugging Face zeroes padded tokens' inputs; under TSP padding is only at the end of
            # a row (shard_batch checks it), where causal layers cannot reach real tokens
            raise ValueError("a padding mask reached a Gated DeltaNet layer; TSP takes padding "
                             "only at the end of rows (tsp_core.shard_batch pads and drops the "
                             "mask)")
        return super().forward(hidden_states, docs=kwargs.get("tsp_docs"))


def delta_net_shape(config: Any) -> tuple[int, int, int, int, int]:
    """(key heads, value heads, key head size, value head size, conv kernel) of a config."""
    return (config.linear_num_key_heads, config.linear_num_value_heads,
            config.linear_key_head_dim, config.linear_value_head_dim,
            config.linear_conv_kernel_dim)


def check_delta_nets(config: Any, tsp_size: int, valid: list[int]) -> None:
    """Raise before anything changes when the Gated DeltaNet heads cannot be split, naming the
    sizes that would work for the whole model (``valid``)."""
    nk, nv, *_ = delta_net_shape(config)
    try:
        check_delta_net_shape(tsp_size, nk, nv)
    except ValueError as e:
        raise ValueError(f"{e}; {valid_sizes_hint(valid)}") from None
    if getattr(config, "hidden_act", "silu") not in ("silu", "swish"):
        raise ValueError(f"hidden_act {config.hidden_act!r}: TSP's Gated DeltaNet applies SiLU "
                         f"after its convolution, as Hugging Face's Qwen3.5 does for 'silu'")


def tsp_delta_net(mesh: TSPMesh, config: Any, hf: nn.Module, opts: dict) -> HFTSPGatedDeltaNet:
    """The TSP module for Hugging Face's Gated DeltaNet ``hf`` (its weights loaded later)."""
    nk, nv, dk, dv, kernel = delta_net_shape(config)
    if hf.conv1d.bias is not None:
        raise ValueError("a Gated DeltaNet conv1d with a bias: Qwen3.5's has none, and TSP's "
                         "schedule carries none")
    new = HFTSPGatedDeltaNet(mesh, config.hidden_size, nk, nv, dk, dv, kernel,
                             hf.layer_norm_epsilon, init_seed=None, **opts)
    if hasattr(hf, "in_proj_qkvz"):  # Qwen3-Next's fused projections
        fuse_per_key_head(new, nk)
    return new


def fuse_per_key_head(module: TSPGatedDeltaNet, num_k_heads: int) -> None:
    """Name ``module``'s projections as Qwen3-Next does: ``in_proj_qkvz.weight`` holds, per key
    head h, [q_h (d_k rows) | k_h (d_k) | v (r d_v: the r = nv/nk value heads that repeat h) |
    z (r d_v)], and ``in_proj_ba.weight`` per key head [b (r rows) | a (r)]. A rank owns whole
    key heads, so its rows of every part are its own heads' groups, one contiguous block of
    each fused tensor; the module keeps q, k, v, z, b and a apart, as for Qwen3.5 (the
    convolution's channels are [q | k | v] over all heads in both models)."""
    module.fuse({})
    parts = ("in_proj_q", "in_proj_k", "in_proj_v", "in_proj_z")
    module.fuse_tensors("in_proj_qkvz.weight", tuple(f"{p}.weight" for p in parts), 0,
                        num_k_heads)
    module.fuse_tensors("in_proj_ba.weight", ("in_proj_b.weight", "in_proj_a.weight"), 0,
                        num_k_heads)
