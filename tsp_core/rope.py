"""Rotary position embedding at global positions, in the Hugging Face convention
(``rotate_half``, ``emb = cat(freqs, freqs)``), so that HF weights give HF numbers."""

from __future__ import annotations

import torch


def default_inv_freq(head_dim: int, theta: float = 10000.0) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))


def cos_sin(position_ids: torch.Tensor, inv_freq: torch.Tensor, scaling: float,
            dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin of shape [B, L, head_dim] for ``position_ids`` [B, L], computed in float32."""
    freqs = position_ids[..., None].float() * inv_freq.float().to(position_ids.device)
    emb = torch.cat((freqs, freqs), dim=-1)
    return (emb.cos() * scaling).to(dtype), (emb.sin() * scaling).to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [B, H, L, d] with cos, sin [B, L, d]."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return x * cos + rotate_half(x) * sin


def apply_backward(g: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Gradient through :func:`apply` (the rotation's transpose)."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return g * cos - rotate_half(g * sin)
