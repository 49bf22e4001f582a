"""A float64-faithful Hugging Face Gated DeltaNet (Qwen3.5's and Qwen3-Next's linear-attention
layer) for the references of tests/layers/test_linear_attention.py, tests/models/test_qwen3_5.py
and tests/models/test_qwen3_next.py.

Hugging Face's ``Qwen3_5GatedDeltaNet`` keeps float32 islands inside a float64 model: its torch
fallback of the gated delta rule (``torch_chunk_gated_delta_rule``) casts every input to float32,
``Qwen3_5RMSNormGated`` normalises in float32, and the decay is computed from ``A_log.float()``
and ``a.float()``. That would cap any agreement at ~1e-7. :func:`float64_delta_nets` patches a
model's (or one layer's) forward with a copy of Hugging Face's code in which those casts keep the
model's dtype when it is wider than float32, and nothing else changes: the copies are Hugging
Face's own source (the chunked and the recurrent rule, the gated norm, the layer's forward with
its cache paths), compiled again with those casts replaced (:func:`_faithful`).
test_linear_attention checks that the copy gives the unmodified layer's bits in float32."""

from __future__ import annotations

import inspect
import textwrap
import types

import torch


def _faithful(source_of, casts: dict[str, str], m, faithful: dict):
    """Hugging Face's function or method (its source, decorators off) compiled again in its
    module ``m``'s namespace (with the copies already in ``faithful``) with each cast in
    ``casts`` (text -> replacement, each present) changed: the float32 islands in the input's
    dtype when that is wider; float32 inputs give exactly the original."""
    src = textwrap.dedent(inspect.getsource(source_of))
    src = src[src.index("def "):]  # the hub-kernel and deprecation decorators off
    for old, new in casts.items():
        assert old in src, f"Hugging Face's {source_of.__qualname__} changed: re-check the copy"
        src = src.replace(old, new)
    namespace = dict(vars(m))
    namespace.update(faithful)  # the copies call each other
    exec(compile(src, m.__file__, "exec"), namespace)
    return namespace[source_of.__name__]


# the faithful copies by Hugging Face's layer class: Qwen3.5's, and Qwen3-Next's (the same code
# but for its fused in_proj_qkvz and in_proj_ba)
_FAITHFUL: dict[str, dict] = {}
LAYERS = {"Qwen3_5GatedDeltaNet": ("qwen3_5", "Qwen3_5RMSNormGated"),
          "Qwen3NextGatedDeltaNet": ("qwen3_next", "Qwen3NextRMSNormGated")}


def _build(layer: str) -> dict:
    import importlib

    family, norm = LAYERS[layer]
    m = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    wide = "torch.promote_types({}, torch.float32)"
    out: dict = {}
    for rule in (m.torch_chunk_gated_delta_rule, m.torch_recurrent_gated_delta_rule):
        out[rule.__name__] = _faithful(rule, {"torch.float32": wide.format("initial_dtype")}, m,
                                       out)
    out["norm"] = _faithful(getattr(m, norm).forward,
                            {"torch.float32": wide.format("input_dtype")}, m, out)
    out["forward"] = _faithful(getattr(m, layer).forward,
                               {".float()": f".to({wide.format('hidden_states.dtype')})"}, m, out)
    return out


def float64_delta_nets(module: torch.nn.Module) -> None:
    """Patch every ``Qwen3_5GatedDeltaNet`` and ``Qwen3NextGatedDeltaNet`` in ``module`` (itself
    included) with the faithful forward (with and without a cache: prefill and decode) and its
    gated norm."""
    for sub in module.modules():
        name = type(sub).__name__
        if name in LAYERS:
            if name not in _FAITHFUL:
                _FAITHFUL[name] = _build(name)
            copies = _FAITHFUL[name]
            sub.forward = types.MethodType(copies["forward"], sub)
            sub.norm.forward = types.MethodType(copies["norm"], sub.norm)


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


# tests/support/hf_models.py's tiny Qwen3.5 with Gated DeltaNet layers: 4 key heads repeated to
# 8 value heads of 8 channels, a kernel-4 convolution
DELTA_NET = dict(linear_num_key_heads=4, linear_num_value_heads=8, linear_key_head_dim=8,
                 linear_value_head_dim=8, linear_conv_kernel_dim=4)


def spread_delta_nets(model: torch.nn.Module) -> None:
    """Every Gated DeltaNet's decays to a few tenths per token (Hugging Face draws A up to 16:
    the state would forget within a token), ``dt_bias`` and the gated norm's weight off one, and
    every RMSNorm weight off its initial value: a weight applied the wrong way changes the loss."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.uniform_(-2.5, -0.5)
            elif name.endswith(("dt_bias", "linear_attn.norm.weight")):
                p.add_(0.3 * torch.randn(p.shape))
            elif name.endswith("norm.weight"):
                p.add_(0.1 * torch.randn(p.shape))
