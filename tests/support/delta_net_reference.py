"""A float64-faithful Hugging Face Gated DeltaNet (Qwen3.5's linear-attention layer) for the
references of tests/layers/test_linear_attention.py and tests/models/test_qwen3_5.py.

Hugging Face's ``Qwen3_5GatedDeltaNet`` keeps float32 islands inside a float64 model: its torch
fallback of the gated delta rule (``torch_chunk_gated_delta_rule``) casts every input to float32,
``Qwen3_5RMSNormGated`` normalises in float32, and the decay is computed from ``A_log.float()``
and ``a.float()``. That would cap any agreement at ~1e-7. :func:`float64_delta_nets` patches a
model's (or one layer's) forward with a copy of Hugging Face's code in which those casts keep the
model's dtype when it is wider than float32, and nothing else changes: the chunk rule is Hugging
Face's own source with ``torch.float32`` replaced by the input dtype (:func:`_faithful_rule`),
the convolution and the L2 norm are Hugging Face's functions, and the forward below is theirs
line for line without the cache paths. test_linear_attention checks the copy against the
unmodified layer in float32 (where the two must agree exactly up to float32 rounding)."""

from __future__ import annotations

import inspect
import textwrap
import types

import torch
import torch.nn.functional as F


def _faithful_rule():
    """Hugging Face's ``torch_chunk_gated_delta_rule`` with its float32 casts in the input's
    dtype (``initial_dtype``) instead; float32 inputs give exactly the original."""
    from transformers.models.qwen3_5 import modeling_qwen3_5 as m

    src = textwrap.dedent(inspect.getsource(m.torch_chunk_gated_delta_rule))
    src = src[src.index("def "):]  # the hub-kernel decorator off
    assert src.count("torch.float32") == 1, "Hugging Face's chunk rule changed: re-check the copy"
    src = src.replace("torch.float32", "torch.promote_types(initial_dtype, torch.float32)")
    namespace = dict(vars(m))
    exec(compile(src, m.__file__, "exec"), namespace)
    return namespace["torch_chunk_gated_delta_rule"]


def _gated_norm(self, hidden_states, gate):
    """``Qwen3_5RMSNormGated.forward`` in float32 or wider."""
    input_dtype = hidden_states.dtype
    wide = torch.promote_types(input_dtype, torch.float32)
    hidden_states = hidden_states.to(wide)
    variance = hidden_states.pow(2).mean(-1, keepdim=True)
    hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
    hidden_states = self.weight * hidden_states.to(input_dtype)
    hidden_states = hidden_states * F.silu(gate.to(wide))
    return hidden_states.to(input_dtype)


def _forward(self, hidden_states, cache=None, attention_mask=None, **kwargs):
    """``Qwen3_5GatedDeltaNet.forward`` without a cache, the decay's casts in float32 or wider."""
    from transformers.models.qwen3_5 import modeling_qwen3_5 as m

    if cache is not None:
        raise NotImplementedError("the float64 reference layer runs without a cache")
    hidden_states = m.apply_mask_to_padding_states(hidden_states, attention_mask)
    batch_size, seq_len, _ = hidden_states.shape
    mixed_qkv = self.in_proj_qkv(hidden_states).transpose(1, 2)
    z = self.in_proj_z(hidden_states).reshape(batch_size, seq_len, -1, self.head_v_dim)
    b = self.in_proj_b(hidden_states)
    a = self.in_proj_a(hidden_states)
    mixed_qkv = m.causal_conv1d_fn(mixed_qkv, self.conv1d.weight.squeeze(1), self.conv1d.bias,
                                   activation=self.activation)
    mixed_qkv = mixed_qkv.transpose(1, 2)
    query, key, value = torch.split(mixed_qkv, [self.key_dim, self.key_dim, self.value_dim], dim=-1)
    query = query.reshape(batch_size, seq_len, -1, self.head_k_dim)
    key = key.reshape(batch_size, seq_len, -1, self.head_k_dim)
    value = value.reshape(batch_size, seq_len, -1, self.head_v_dim)
    beta = b.sigmoid()
    wide = torch.promote_types(hidden_states.dtype, torch.float32)
    g = -self.A_log.to(wide).exp() * F.softplus(a.to(wide) + self.dt_bias)
    core_attn_out, _ = RULE(query, key, value, g=g, beta=beta, initial_state=None,
                            output_final_state=False, use_qk_l2norm_in_kernel=True)
    core_attn_out = core_attn_out.reshape(-1, self.head_v_dim)
    z = z.reshape(-1, self.head_v_dim)
    core_attn_out = self.norm(core_attn_out, z)
    core_attn_out = core_attn_out.reshape(batch_size, seq_len, -1)
    return self.out_proj(core_attn_out)


RULE = None


def float64_delta_nets(module: torch.nn.Module) -> None:
    """Patch every ``Qwen3_5GatedDeltaNet`` in ``module`` (itself included) with the faithful
    forward above, and its gated norm."""
    global RULE
    if RULE is None:
        RULE = _faithful_rule()
    for sub in module.modules():
        if type(sub).__name__ == "Qwen3_5GatedDeltaNet":
            sub.forward = types.MethodType(_forward, sub)
            sub.norm.forward = types.MethodType(_gated_norm, sub.norm)


def hf_layer(config_kwargs: dict, dtype: torch.dtype = torch.float64, faithful: bool = True):
    """A Hugging Face ``Qwen3_5GatedDeltaNet`` (layer 0 of a text config built from
    ``config_kwargs``), its weights drawn so that every one matters, in ``dtype``."""
    from transformers import Qwen3_5TextConfig
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5GatedDeltaNet

    cfg = Qwen3_5TextConfig(layer_types=["linear_attention"], num_hidden_layers=1,
                            **config_kwargs)
    torch.manual_seed(0)
    layer = Qwen3_5GatedDeltaNet(cfg, 0).to(dtype)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in layer.named_parameters():
            if name == "A_log":  # decays of a few tenths per token: the state matters
                p.copy_(torch.empty(p.shape).uniform_(-2.5, -0.5, generator=gen).to(dtype))
            elif name in ("dt_bias", "norm.weight"):
                p.copy_((1 + 0.3 * torch.randn(p.shape, generator=gen)).to(dtype))
            else:
                p.copy_((0.3 * torch.randn(p.shape, generator=gen)).to(dtype))
    if faithful:
        float64_delta_nets(layer)
    return layer, cfg
