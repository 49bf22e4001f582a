"""The families' RMSNorms (tsp_core/layers/norm.py) are Hugging Face's own numerics in every
precision a model is stored in: output, input gradient and weight gradient bit for bit against
the unmodified Hugging Face module, in float32, bfloat16 and float16. Float64 models run wider
than Hugging Face on purpose (its ``.float()`` would round them); the parity tests cover them.
Low precision is where a norm's casts differ: a norm that scales before its float32 step, or
casts back before scaling when Hugging Face scales first, is only visible here."""

from __future__ import annotations

import pytest
import torch

from tsp_core.layers.norm import NORMS, unscaled_norm

DIM, EPS = 48, 1e-6


def hf_norm(kind: str):
    """The unmodified Hugging Face module whose numerics ``kind`` claims."""
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm
    from transformers.models.gemma4.modeling_gemma4 import Gemma4RMSNorm
    from transformers.models.llama.modeling_llama import LlamaRMSNorm
    from transformers.models.llama4.modeling_llama4 import Llama4TextL2Norm
    from transformers.models.olmo2.modeling_olmo2 import Olmo2RMSNorm

    return {"llama": lambda: LlamaRMSNorm(DIM, eps=EPS), "gemma": lambda: Gemma3RMSNorm(DIM, EPS),
            "olmo2": lambda: Olmo2RMSNorm(DIM, eps=EPS), "gemma4": lambda: Gemma4RMSNorm(DIM, EPS),
            "gemma4-unscaled": lambda: Gemma4RMSNorm(DIM, EPS, with_scale=False),
            "l2": lambda: Llama4TextL2Norm(EPS)}[kind]()


def inputs(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rows whose mean squares run from 1e-6 to 1e2 (eps and the casts both matter), a weight
    away from its initial value, and an upstream gradient, all in ``dtype``."""
    gen = torch.Generator().manual_seed(0)
    scale = torch.logspace(-3, 1, 12, dtype=torch.float64)[:, None]
    x = (torch.randn(12, DIM, generator=gen, dtype=torch.float64) * scale).to(dtype)
    weight = (torch.randn(DIM, generator=gen, dtype=torch.float64) * 0.7 + 0.3).to(dtype)
    grad = torch.randn(12, DIM, generator=gen, dtype=torch.float64).to(dtype)
    return x, weight, grad


def run(fn, x: torch.Tensor, grad: torch.Tensor, weight: torch.Tensor | None):
    x = x.clone().requires_grad_()
    out = fn(x)
    out.backward(grad)
    return out.detach(), x.grad, None if weight is None else weight.grad


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("kind", ["llama", "gemma", "olmo2", "gemma4", "gemma4-unscaled", "l2"])
def test_norm_is_hugging_face_bit_for_bit(kind, dtype):
    x, w, grad = inputs(dtype)
    module = hf_norm(kind).to(dtype)
    scaled = hasattr(module, "weight")
    if scaled:
        with torch.no_grad():
            module.weight.copy_(w)
    ours_w = module.weight.detach().clone().requires_grad_() if scaled else None
    if kind == "gemma4-unscaled":
        ours = lambda t: unscaled_norm(t, "gemma4", EPS)  # noqa: E731
    else:
        ours = lambda t: NORMS[kind](t, ours_w, EPS)  # noqa: E731
    want = run(module, x, grad, module.weight if scaled else None)
    got = run(ours, x, grad, ours_w)
    for name, a, b in zip(("output", "input gradient", "weight gradient"), got, want):
        if b is None:
            continue
        assert a.dtype == b.dtype, (kind, name, a.dtype, b.dtype)
        diff = (a.double() - b.double()).abs().max().item()
        assert torch.equal(a, b), f"{kind} in {dtype}: {name} differs from Hugging Face's " \
                                  f"(max {diff:.3e})"
