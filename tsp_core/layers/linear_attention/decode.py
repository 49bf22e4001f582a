"""Generation through a TSP Gated DeltaNet layer (docs/design.md "Decode"): the layer carries a
state, not a cache. After prefill rank p holds, for its own head group, the recurrent state after
each row's prompt [B, nv/D, d_k, d_v] and the convolution's window of the prompt's last
``kernel - 1`` projected tokens [B, channels/D, kernel - 1]; each decode step updates both in
place of a cache, tensor-parallel style on the resident shards (no weight moves), and one
all-reduce sums the head groups' output-projection columns.

Prefill runs the layer's TSP forward with the tokens past each row's prompt turned into no-ops
(beta 0, decay 1), so the state composed from the gathered maps of the rank's own round is the
state after the prompt; the convolution window's input tokens are assembled by one all-reduce of
[B, kernel - 1, h] (each rank adds the ones it holds).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ...distributed import comm
from ...distributed.params import local
from ...sequence.layout import position_ids
from .delta_rule import compute_dtype, gated_norm, l2norm
from .schedule import run_forward


@dataclass
class DeltaNetState:
    """A layer's decode state on this rank, for its own head group."""

    recurrent: torch.Tensor   # [B, nv/D, d_k, d_v], in the compute dtype
    conv: torch.Tensor        # [B, channels/D, kernel - 1]: projected q, k, v inputs


def _weights(module) -> list[torch.Tensor]:
    from .module import ROUND_WEIGHTS

    return [local(module.get_parameter(n)) for n in ROUND_WEIGHTS]


def _last_tokens(x: torch.Tensor, lengths: torch.Tensor, K1: int, mesh) -> torch.Tensor:
    """[B, K1, h]: each row's last K1 prompt tokens (zeros before its start), on every rank."""
    B, L, h = x.shape
    out = x.new_zeros(B, K1, h)
    pos = position_ids(L * mesh.size, mesh.rank, mesh.size, mesh.layout, device=x.device)
    for b in range(B):
        slot = pos - (int(lengths[b]) - K1)
        mine = (slot >= 0) & (slot < K1)
        out[b, slot[mine]] = x[b, mine]
    comm.all_reduce(out, mesh.group)
    return out


@torch.no_grad()
def prefill(module, x: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """The layer's forward on right-padded prompts of ``lengths`` [B]; leaves its
    :class:`DeltaNetState` on ``module.tsp_delta_state``."""
    spec, mesh = module.spec, module.mesh
    weights = _weights(module)
    y, final = run_forward(x, local(module.norm.weight), spec, mesh.group, None, weights,
                           lengths.to(x.device))
    if spec.halo:
        window = F.linear(_last_tokens(x, lengths, spec.halo, mesh),
                          torch.cat(weights[:3])).transpose(1, 2)
    else:
        window = x.new_zeros(x.shape[0], sum(w.shape[0] for w in weights[:3]), 0)
    module.tsp_delta_state = DeltaNetState(final, window.contiguous())
    return y


@torch.no_grad()
def step(module, x: torch.Tensor) -> torch.Tensor:
    """One decode step, x [B, 1, h] (the same on every rank) -> [B, 1, h]: Hugging Face's
    single-token path (``causal_conv1d_update``, ``torch_recurrent_gated_delta_rule``) on this
    rank's head group, its output-projection columns summed over the group."""
    spec, mesh, state = module.spec, module.mesh, module.tsp_delta_state
    if state is None:
        raise RuntimeError("a Gated DeltaNet decode step before its prefill")
    wq, wk, wv, wz, wb, wa, cq, ck, cv, a_log, dt_bias, wo = _weights(module)
    xt = x[:, 0]
    B, cd = xt.shape[0], compute_dtype(x.dtype)
    window = torch.cat([state.conv, F.linear(xt, torch.cat([wq, wk, wv]))[..., None]], dim=-1)
    state.conv = window[..., 1:].contiguous()
    mixed = F.silu((window * torch.cat([cq, ck, cv])[:, 0]).sum(-1))
    nk, nv, dk, dv = spec.local_k_heads, spec.local_v_heads, spec.head_k_dim, spec.head_v_dim
    q, k, v = mixed.split([nk * dk, nk * dk, nv * dv], dim=-1)
    q, k = (t.view(B, nk, dk).repeat_interleave(nv // nk, dim=1).to(cd) for t in (q, k))
    q, k, v = l2norm(q) * dk ** -0.5, l2norm(k), v.view(B, nv, dv).to(cd)
    beta = torch.sigmoid(F.linear(xt, wb)).to(cd)
    g = -a_log.to(cd).exp() * F.softplus(F.linear(xt, wa).to(cd) + dt_bias)
    s = state.recurrent * g.exp()[..., None, None]
    delta = (v - (s * k[..., None]).sum(-2)) * beta[..., None]
    s = s + k[..., None] * delta[..., None, :]
    state.recurrent = s
    out = (s * q[..., None]).sum(-2).to(x.dtype)                     # [B, nv, dv]
    z = F.linear(xt, wz).view(B, nv, dv)
    y = gated_norm(out, z, local(module.norm.weight), spec.eps).reshape(B, nv * dv) @ wo.t()
    comm.all_reduce(y, mesh.group)
    return y[:, None]
