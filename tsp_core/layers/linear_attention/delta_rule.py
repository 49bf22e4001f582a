"""The math of one Gated DeltaNet head group on one run of consecutive tokens (Qwen3.5's linear
attention), written once and used by the TSP schedule in its forward and, under autograd, in its
backward recomputation.

Per value head the recurrent state S [d_k, d_v] evolves token by token as
``S <- exp(g) (I - beta k k^T) S + beta k v^T`` and the output is ``S^T q``. Over a run of tokens
that is an affine map ``S -> A S + B`` (A [d_k, d_k], B [d_k, d_v]): :func:`chunk_rule` run
from the state ``[I | 0]`` with the values widened by d_k zero columns ends in ``[A | B]``, so one
function gives both a run's outputs and its map. It is Hugging Face's chunked algorithm
(``torch_chunk_gated_delta_rule``, sub-chunks of 64 tokens, a unit-triangular solve per sub-chunk)
in the compute dtype (float32 at least, like Hugging Face's; float64 stays float64).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

SUB_CHUNK = 64  # Hugging Face's chunk_size of the torch fallback


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The delta rule's dtype: float32 at least (Hugging Face computes it in float32)."""
    return torch.promote_types(dtype, torch.float32)


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """Hugging Face's (FLA's) ``x * rsqrt(sum(x^2) + eps)`` over the last dim."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def chunk_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
               beta: torch.Tensor, state: torch.Tensor, outputs: bool = True
               ) -> tuple[torch.Tensor | None, torch.Tensor]:
    """Outputs [B, H, T, d_v] (None unless ``outputs``) and the final state [B, H, d_k, d_v] of
    the gated delta rule over T tokens from ``state``. ``q``, ``k`` [B, H, T, d_k] are already
    repeated to the value heads, L2-normalised, and ``q`` scaled by d_k^-1/2; ``g`` (log decay)
    and ``beta`` [B, H, T]; all in one dtype."""
    T, C = q.shape[2], SUB_CHUNK
    pad = (C - T % C) % C
    q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
    beta, g = (F.pad(x, (0, pad)) for x in (beta, g))
    B_, H = q.shape[:2]
    n = (T + pad) // C
    v_beta, k_beta = v * beta.unsqueeze(-1), k * beta.unsqueeze(-1)
    q, k, k_beta, v_beta = (x.reshape(B_, H, n, C, x.shape[-1]) for x in (q, k, k_beta, v_beta))
    decay = g.reshape(B_, H, n, C).cumsum(dim=3)
    upper = torch.ones(C, C, dtype=torch.bool, device=q.device).triu(1)
    pairwise = (decay.unsqueeze(4) - decay.unsqueeze(3)).masked_fill(upper, float("-inf")).exp()
    ut = (k_beta @ k.transpose(-1, -2)) * pairwise
    new_v = torch.linalg.solve_triangular(ut, v_beta, upper=False, unitriangular=True)
    k_read = torch.linalg.solve_triangular(ut, k_beta * decay.exp().unsqueeze(-1), upper=False,
                                           unitriangular=True)
    intra = (q @ k.transpose(-1, -2)) * pairwise if outputs else None
    q = q * decay.exp().unsqueeze(-1)
    k = k * (decay[..., -1:] - decay).exp().unsqueeze(-1)
    chunk_decay = decay[..., -1].exp()[..., None, None]
    outs = []
    for i in range(n):
        v_new = new_v[:, :, i] - k_read[:, :, i] @ state
        if outputs:
            outs.append(q[:, :, i] @ state + intra[:, :, i] @ v_new)
        state = state * chunk_decay[:, :, i] + k[:, :, i].transpose(-1, -2) @ v_new
    out = torch.cat(outs, dim=2)[:, :, :T] if outputs else None
    return out, state


def chunk_map(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
              beta: torch.Tensor) -> torch.Tensor:
    """The run's map ``S -> A S + B`` as one tensor ``[A | B]`` [B, H, d_k, d_k + d_v]: the final
    state from ``[I | 0]`` with d_k zero value columns in front of the values (A S from the
    identity part, B from the values)."""
    B_, H, T, dk = k.shape
    wide = torch.cat([v.new_zeros(B_, H, T, dk), v], dim=-1)
    start = torch.cat([torch.eye(dk, dtype=v.dtype, device=v.device).expand(B_, H, dk, dk),
                       v.new_zeros(B_, H, dk, v.shape[-1])], dim=-1)
    return chunk_rule(q, k, wide, g, beta, start, outputs=False)[1]


def apply_map(m: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
    """``A S + B`` for ``m = [A | B]``."""
    dk = m.shape[-2]
    return m[..., :dk] @ state + m[..., dk:]


def gated_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float
               ) -> torch.Tensor:
    """Qwen3.5's ``RMSNormGated`` over the last dim, in Hugging Face's numerics: normalised in
    float32 at least, scaled by ``weight`` in the input's dtype, times SiLU(gate) in float32 at
    least (float64 stays float64)."""
    dtype, cd = x.dtype, compute_dtype(x.dtype)
    h = x.to(cd)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    h = weight * h.to(dtype)
    return (h * F.silu(gate.to(cd))).to(dtype)
