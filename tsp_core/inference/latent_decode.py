"""Decode of multi-head latent attention (DeepSeek-V3's MLA) over a sequence-sharded LATENT cache
(docs/design.md "Decode").

Prefill leaves each rank the latent ``[kv_lora_rank(c_kv) normalised | k_rope rotated]`` of its
own tokens (``latent_dim`` channels a token, every head's K/V in it), in the cache's key slots of
the layer (its value slots hold no channel). Per new token, with the weights resident (no weight
moves):

1. every rank computes the new token's query input and latent from the replicated
   down-projections (the same on every rank: nothing to exchange); the rank whose turn it is
   caches the latent;
2. each rank absorbs the key up-projection of its heads into their queries (``q_nope W_UK`` in
   latent space, beside ``q_rope``: MLA's inference form) and one all-gather gives every rank
   the absorbed queries of every head;
3. every rank attends all heads to its own cached latents (the values are the latents too) and
   an all-to-all sends each head group's partial output and log-sum-exp to the group's owner,
   which merges them (:func:`tsp_core.inference.decode.merge_heads`);
4. the owner applies its heads' value up-projection ``W_UV`` and its rows of o_proj; an
   all-reduce sums the head groups.

Absorbing changes the order of the products only: the scores are ``q_nope . (W_UK c) + q_rope .
k_rope`` and the output ``W_UV (P c)``, Hugging Face's ``(W_UK c)`` and ``P (W_UV c)``
re-associated.
"""

from __future__ import annotations

import torch

from ..distributed import comm
from ..distributed.mesh import TSPMesh
from ..distributed.params import local
from ..layers.attention.latent import TSPLatentAttention, latent_queries


def latent_step(mesh: TSPMesh, attn: TSPLatentAttention, x: torch.Tensor, cos: torch.Tensor,
                sin: torch.Tensor, cached: torch.Tensor, length: int, slot: int | None,
                visible: torch.Tensor, attend, merge) -> torch.Tensor:
    """One decode step of the latent attention: ``x`` [B, h] (the same on every rank), cos/sin
    [B, 1, qk_rope_head_dim] of the new tokens' positions, ``cached`` [B, 1, capacity,
    latent_dim] this rank's latent cache of the layer (``slot``: where this rank stores the new
    token's, None when it is not its turn), ``length`` slots used, ``visible`` [B, length];
    ``attend``/``merge``: tsp_core.inference.decode's split-KV attention and owner merge.
    Returns [B, h], the same on every rank."""
    s = attn.spec
    group, D = mesh.group, mesh.size
    B, n, R = x.shape[0], s.local_heads, s.kv_lora_rank
    w = {name: local(p) for name, p in attn.named_parameters()}
    q_in, latent = attn.local_latent(x[:, None], cos, sin)           # [B, 1, q], [B, 1, C]
    if slot is not None:                                              # this rank's turn
        cached[:, 0, slot] = latent[:, 0]
    wq = w["q_proj.weight" if s.q_lora_rank is None else "q_b_proj.weight"]
    q = latent_queries(q_in, wq, cos, sin, s)[:, :, 0]                      # [B, n, qk_head_dim]
    wkv = w["kv_b_proj.weight"].view(n, s.qk_nope_head_dim + s.v_head_dim, R)
    absorbed = torch.einsum("bhk,hkr->bhr", q[..., :s.qk_nope_head_dim],
                            wkv[:, :s.qk_nope_head_dim])
    mine = torch.cat((absorbed, q[..., s.qk_nope_head_dim:]), dim=-1)  # [B, n, latent_dim]
    every = mine.new_empty(D, *mine.shape)
    comm.all_gather(every, mine.contiguous(), group)                  # every head's, rank order
    q_all = every.transpose(0, 1).reshape(B, D * n, s.latent_dim)
    lat = cached[:, :, :length]
    out, lse = attend(q_all, lat, lat, visible, s.scale)              # values: the latents
    C = s.latent_dim
    send = torch.cat([out, lse.unsqueeze(-1)], dim=-1).view(B, D, n, C + 1).transpose(0, 1)
    send = send.contiguous()
    recv = torch.empty_like(send)
    comm.all_to_all(recv, send, group)
    merged = merge(recv[..., C], recv[..., :C])[..., :R].to(x.dtype)  # [B, n, kv_lora_rank]
    v = torch.einsum("bhr,hvr->bhv", merged, wkv[:, s.qk_nope_head_dim:])
    y = v.reshape(B, n * s.v_head_dim) @ w["o_proj.weight"].t()
    comm.all_reduce(y, group)
    if "o_proj.bias" in w:
        y = y + w["o_proj.bias"]
    return y
