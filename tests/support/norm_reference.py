"""Float64-faithful copies of Hugging Face's Gemma 1-4, Qwen3.5 and Qwen3-Next RMSNorms, for the
references of tests/support/hf_models.py.

Hugging Face's norms compute in float32 whatever the model's dtype (``x.float()``,
``weight.float()``): in a float64 model their outputs and weight gradients round to float32,
which caps agreement with any other summation order at ~1e-7. Each copy here is Hugging Face's
forward with ``.float()`` replaced by a cast to float32 *at least* (the model's dtype when that
is wider), and nothing else: for float32 and below the copies are Hugging Face's own arithmetic,
which tests/models/test_references.py checks bit for bit against the unmodified modules.
Nothing here imports tsp_core: the reference stands apart from the code it checks."""

from __future__ import annotations

import types
from collections.abc import Callable

import torch
from torch import nn


def _wide(dtype: torch.dtype) -> torch.dtype:
    """float32 at least: Hugging Face's ``.float()``, or the model's dtype when it is wider."""
    return torch.promote_types(dtype, torch.float32)


def one_plus_weight_forward(self, x: torch.Tensor) -> torch.Tensor:
    """``GemmaRMSNorm.forward`` (Gemma 1-3, ``Qwen3_5RMSNorm``, ``Qwen3NextRMSNorm``): normalised
    with ``rsqrt(mean(x^2) + eps)``, scaled by ``1 + weight`` before the cast back."""
    xw = x.to(_wide(x.dtype))
    output = xw * torch.rsqrt(xw.pow(2).mean(-1, keepdim=True) + self.eps)
    output = output * (1.0 + self.weight.to(_wide(self.weight.dtype)))
    return output.type_as(x)


def gemma4_forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
    """``Gemma4RMSNorm.forward``: eps added to the mean square, then ``pow(., -0.5)`` (not
    rsqrt); scaled by the weight itself (not ``1 + weight``), or not at all when
    ``with_scale`` is False (its value norm and router norm), before the cast back."""
    h = hidden_states.to(_wide(hidden_states.dtype))
    mean_squared = h.pow(2).mean(-1, keepdim=True) + self.eps
    normed_output = h * torch.pow(mean_squared, -0.5)
    if self.with_scale:
        normed_output = normed_output * self.weight.to(_wide(self.weight.dtype))
    return normed_output.type_as(hidden_states)


# Hugging Face's norm classes (by name) and their faithful forwards
FORWARDS = {"GemmaRMSNorm": one_plus_weight_forward, "Gemma2RMSNorm": one_plus_weight_forward,
            "Gemma3RMSNorm": one_plus_weight_forward, "Qwen3_5RMSNorm": one_plus_weight_forward,
            "Qwen3NextRMSNorm": one_plus_weight_forward,
            "Gemma4RMSNorm": gemma4_forward}


def float64_norms(model: nn.Module, wanted: Callable[[str], bool] = lambda name: True) -> int:
    """Give every norm of ``model`` named in :data:`FORWARDS` whose class name is ``wanted`` its
    faithful forward (per module: other models of the process keep Hugging Face's). Returns how
    many were patched."""
    patched = 0
    for module in model.modules():
        name = type(module).__name__
        if name in FORWARDS and wanted(name):
            module.forward = types.MethodType(FORWARDS[name], module)
            patched += 1
    return patched
