"""A float64-faithful Llama 4 text reference. Hugging Face's eager Llama 4 code computes four
things in float32 whatever the model's dtype: the rotation (``apply_rotary_emb``: ``xq.float()``
times the complex frequencies), the L2 q/k norm (``x.float()``), the router's sigmoid
(``router_scores.float()``) and the attention temperature (``positions.float()``, then the query
times the float32 factors). In a float64 model each rounds to float32 (~1e-8, past the 1e-10 the
parity tests hold). :func:`float64_llama4` makes a model run the same code with those steps in the
model's dtype when it is wider than float32; for float32 and below it is Hugging Face's own."""

from __future__ import annotations

import types

import torch
import torch.nn.functional as F


def _wide(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def apply_rotary_emb(xq: torch.Tensor, xk: torch.Tensor, freqs_cis: torch.Tensor):
    """Hugging Face's ``apply_rotary_emb`` in float32 at least (not always float32)."""
    xq_ = torch.view_as_complex(xq.to(_wide(xq.dtype)).reshape(*xq.shape[:-1], -1, 2))
    xk_ = torch.view_as_complex(xk.to(_wide(xk.dtype)).reshape(*xk.shape[:-1], -1, 2))
    xq_out = torch.view_as_real(xq_ * freqs_cis[:, :, None, :]).flatten(3)
    xk_out = torch.view_as_real(xk_ * freqs_cis[:, :, None, :]).flatten(3)
    return xq_out.type_as(xq), xk_out.type_as(xk)


def l2_norm_forward(self, x: torch.Tensor) -> torch.Tensor:
    """``Llama4TextL2Norm.forward`` in float32 at least."""
    return self._norm(x.to(_wide(x.dtype))).type_as(x)


def router_forward(self, hidden_states: torch.Tensor):
    """``Llama4Router.forward`` with the sigmoid in float32 at least."""
    router_logits = F.linear(hidden_states, self.weight, self.bias)
    top, indices = torch.topk(router_logits, self.top_k, dim=1)
    scores = torch.full_like(router_logits, float("-inf")).scatter_(1, indices, top)
    scores = torch.sigmoid(scores.to(_wide(scores.dtype))).to(scores.dtype)
    return scores, router_logits


def attention_forward(self, hidden_states: torch.Tensor, position_embeddings: torch.Tensor,
                      attention_mask: torch.Tensor | None, cache=None, **kwargs):
    """``Llama4TextAttention.forward`` with :func:`apply_rotary_emb` and the temperature
    factors in float32 at least."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    from transformers.models.llama4.modeling_llama4 import eager_attention_forward

    input_shape = hidden_states.shape[:-1]
    hidden_shape = (*input_shape, -1, self.head_dim)
    query_states = self.q_proj(hidden_states).view(hidden_shape)
    key_states = self.k_proj(hidden_states).view(*input_shape, -1, self.head_dim)
    value_states = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)
    if self.use_rope:
        query_states, key_states = apply_rotary_emb(query_states, key_states,
                                                    position_embeddings.to(query_states.device))
    if hasattr(self, "qk_norm"):
        query_states = self.qk_norm(query_states)
        key_states = self.qk_norm(key_states)
    if self.attn_temperature_tuning and not self.use_rope:
        past_seen_tokens = cache.get_seq_length(self.layer_idx) if cache is not None else 0
        positions = torch.arange(hidden_states.shape[1], device=hidden_states.device)
        positions = (positions + past_seen_tokens).to(_wide(query_states.dtype))
        attn_scales = torch.log1p(torch.floor((positions + 1.0) / self.floor_scale)) \
            * self.attn_scale + 1.0
        attn_scales = attn_scales.view((1, input_shape[-1], 1, 1)).expand((*input_shape, 1, 1))
        query_states = (query_states * attn_scales).to(query_states.dtype)
    query_states = query_states.transpose(1, 2)
    key_states = key_states.transpose(1, 2)
    if cache is not None:
        key_states, value_states = cache.update(key_states, value_states, self.layer_idx,
                                                kwargs=kwargs)
    attention_interface = ALL_ATTENTION_FUNCTIONS.get_interface(
        self.config._attn_implementation, eager_attention_forward)
    attn_output, attn_weights = attention_interface(
        self, query_states, key_states, value_states, attention_mask,
        dropout=0.0 if not self.training else self.attention_dropout, scaling=self.scaling,
        **kwargs)
    attn_output = attn_output.reshape(*input_shape, -1).contiguous()
    return self.o_proj(attn_output), attn_weights


def float64_llama4(model) -> None:
    """Give every attention, L2 norm and router of a Llama 4 text ``model`` the faithful forward
    above (per module: other models of the process keep Hugging Face's)."""
    from transformers.models.llama4 import modeling_llama4 as hf

    swaps = {hf.Llama4TextAttention: attention_forward, hf.Llama4TextL2Norm: l2_norm_forward,
             hf.Llama4Router: router_forward}
    for module in model.modules():
        forward = swaps.get(type(module))
        if forward is not None:
            module.forward = types.MethodType(forward, module)
