"""TSP attention for q/k norms over all heads of a token (OLMo 2): the rounds of
:mod:`tsp_core.layers.attention` in three phases, so that every head group's query and key of a
token exist before any of them is normalised.

The default schedule computes, attends and projects one head group per round; a norm whose
statistic spans every head cannot run there, since round r knows only group r. Here the same
broadcasts are split: (1) rounds of the q/k/v projection shards compute this rank's tokens' raw
projections of every group; the whole-width norms and RoPE then run locally, exactly as the
unmodified model runs them; (2) attention of every group, which moves no weight (K/V gathered
per key/value head as before); (3) rounds of the output projection shards. The backward mirrors
it: the output projection's rounds give dO of every group, attention backward gives dQ, dK, dV,
the norms' backward runs locally over all heads (its cross-head term is why it must wait for
every group), and the input projections' rounds give dX and the weight gradients.

Each weight is broadcast once per pass, as in the default schedule (the same bytes); what it
costs is overlap (attention no longer hides the next round's broadcast) and local buffers the
size of this rank's Q (raw projections, dO and dQ of every group: own tokens only, never another
rank's weight or K/V: docs/design.md "Memory rules").

Layers with attention sinks and q/k norms over all heads run here too (the default schedule
carries sinks the same way): each round's shard carries its owner's sinks (one logit per head),
the attention adds them (flash.add_sinks), and their gradient, computed in the attention
backward, goes back to the owner with the input projections' round gradients. The sinks of
every head ([tsp_size, heads per rank], num_attention_heads numbers) are kept from the forward
for the attention backward, which runs before the input projections' rounds bring them again."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .. import flash, rope
from ..norm import NORMS
from .rounds import (
    AttentionSpec,
    KVGathers,
    OwnerReduces,
    Rounds,
    Shards,
    attend_round,
    attend_round_backward,
    join_heads,
    rotated,
    row_groups,
    split_norms,
)


def _lse_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def normed_heads(raw: torch.Tensor, weight: torch.Tensor, heads: int, cos: torch.Tensor,
                 sin: torch.Tensor, spec: AttentionSpec) -> torch.Tensor:
    """raw [G, B, L, heads*d]: G head groups' projections, in head order, of the same tokens ->
    [G, B, heads, L, d] normalised over all G*heads heads of each token (``QKNorm.scope``
    "token"), over each head, or not at all (``weight`` None), RoPE applied."""
    G, B, L, _ = raw.shape
    flat = raw.permute(1, 2, 0, 3).reshape(B, L, -1)           # [B, L, all heads * d]: HF's q
    norm = spec.parts.qk_norm
    if weight is not None and spec.parts.over_token:
        flat = NORMS[norm.kind](flat, weight, norm.eps)
    heads_first = flat.view(B, L, G, heads, -1).permute(2, 0, 3, 1, 4)
    if weight is not None and not spec.parts.over_token:  # each head's, before or after RoPE
        return rotated(heads_first, weight, cos, sin, spec).contiguous()
    return rope.apply(heads_first, cos, sin, spec.parts.rotary.interleaved).contiguous()


class PhasedAttentionFn(torch.autograd.Function):
    """Same arguments as :class:`tsp_core.layers.attention.per_group.PerGroupAttentionFn`; with
    ``Mask.sinks`` the sinks follow the projection weights (before the q/k norm weights)."""

    @staticmethod
    def forward(ctx, x, cos, sin, spec: AttentionSpec, group, docs, kv_sink, dropout, *weights):
        B, L, _ = x.shape
        nq, nkv, d = spec.local_heads, spec.local_kv_heads, spec.head_dim
        D, R = spec.tsp_size, spec.kv_replicas
        groups = row_groups(docs, L * D, dist.get_rank(group), spec)
        proj, (qn, kn) = split_norms(weights, spec)
        shards = Shards(proj, spec, group, split_out=True)
        q_raw = x.new_empty(D, B, L, nq * d)            # phase 1: every group's raw projections
        kv_raw = x.new_empty(D // R, 2, B, L, nkv * d)
        sinks_all = None if shards.sinks is None else shards.sinks.new_empty(D, nq)
        for r, buf in Rounds(shards.round_pack.pack(shards.round), group):
            wq, wk, wv, _, bq, bk, bv = shards.unpack(r, buf)
            if sinks_all is not None:
                sinks_all[r] = shards.round_sinks(buf)
            q_raw[r] = F.linear(x, wq, bq)
            if r % R == 0:
                kv_raw[r // R, 0] = F.linear(x, wk, bk)
                kv_raw[r // R, 1] = F.linear(x, wv, bv)
        q_all, kv_all = _normed(q_raw, kv_raw, qn, kn, cos, sin, spec)
        out_all = x.new_empty(D, B, nq, L, d)              # phase 2: attention, no weights move
        lse_all = x.new_empty(D, B, nq, L, dtype=_lse_dtype(x))
        kvs = KVGathers(kv_all, groups, spec, group)
        kvs.start(0)
        for r in range(D):
            if r % R == R - 1:
                kvs.start(r // R + 1)  # the next head's K/V arrive while this round attends
            sinks = None if sinks_all is None else sinks_all[r]
            attend_round(r, q_all, out_all, lse_all, kvs, sinks, dropout)
        if kv_sink is not None:  # prefill: this rank's own tokens' K/V of every key/value head
            kv_sink(kv_all)
        del q_all, kv_all
        y = x.new_zeros(x.shape)                           # phase 3: the output projection
        for r, buf in Rounds(shards.out_pack.pack([proj[3]]), group):
            (wo,) = shards.out_pack.unpack(buf)
            y.view(B * L, -1).addmm_(join_heads(out_all[r]).reshape(B * L, -1), wo.t())
        ctx.spec, ctx.group, ctx.groups, ctx.sinks_all = spec, group, groups, sinks_all
        ctx.dropout = dropout
        ctx.save_for_backward(x, cos, sin, q_raw, kv_raw, out_all, lse_all, *weights)
        return y

    @staticmethod
    def backward(ctx, dy):
        spec, group, groups, sinks_all = ctx.spec, ctx.group, ctx.groups, ctx.sinks_all
        x, cos, sin, q_raw, kv_raw, out_all, lse_all, *weights = ctx.saved_tensors
        B, L, h = x.shape
        nq, R, D = spec.local_heads, spec.kv_replicas, spec.tsp_size
        proj, (qn, kn) = split_norms(weights, spec)
        shards = Shards(proj, spec, group, split_out=True)
        dy = dy.contiguous()
        x2, dy2 = x.reshape(B * L, h), dy.reshape(B * L, h)
        reduces = OwnerReduces(group)
        do_all = torch.empty_like(out_all)                # output projection's rounds: dO, dWo
        for r, buf in Rounds(shards.out_pack.pack([proj[3]]), group):
            (wo,) = shards.out_pack.unpack(buf)
            do_all[r] = F.linear(dy, wo.t()).view(B, L, nq, -1).transpose(1, 2)
            reduces.send(r, dy2.t() @ join_heads(out_all[r]).reshape(B * L, -1))
        go = reduces.finish()
        norms = [] if qn is None else [qn, kn]
        with torch.enable_grad():                          # the norms and RoPE, recomputed
            leaves = [t.detach().requires_grad_() for t in (q_raw, kv_raw[:, 0], *norms)]
            qn_l, kn_l = leaves[2:] if norms else (None, None)
            q_all = normed_heads(leaves[0], qn_l, nq, cos, sin, spec)
            k_all = normed_heads(leaves[1], kn_l, spec.local_kv_heads, cos, sin, spec)
        q_fixed = q_all.detach()
        values = spec.parts.values
        v_raw = _v_heads(kv_raw, spec)
        kv_all = torch.stack([k_all.detach(), values.apply(v_raw)], 1)
        dq_all, dkv_all = torch.empty_like(q_fixed), torch.empty_like(kv_all)
        kvs = KVGathers(kv_all, groups, spec, group)
        dkv_sum: dict[int, torch.Tensor] = {}
        kvs.start(0)
        sinks_grad = None if sinks_all is None else torch.empty_like(sinks_all)
        for r in range(D):                                 # attention, no weights move
            dq_all[r] = attend_round_backward(r, do_all[r], q_fixed, out_all, lse_all, kvs, dkv_sum,
                                              ctx.dropout)
            if sinks_grad is not None:
                sinks_grad[r] = flash.sink_backward(do_all[r], out_all[r], lse_all[r],
                                                    sinks_all[r])
            if r % R == 0 and r:  # the previous head's dK/dV, sent during this round
                dkv_all[r // R - 1] = kvs.scattered(r // R - 1)
        dkv_all[(D - 1) // R] = kvs.scattered((D - 1) // R)
        del do_all, kv_all, kvs
        dq_raw, dk_raw, *norm_grads = torch.autograd.grad((q_all, k_all), leaves,
                                                           (dq_all, dkv_all[:, 0]))
        dv_raw = _flat_groups(values.backward(v_raw, dkv_all[:, 1]))
        del dq_all, dkv_all, q_all, k_all, q_fixed, v_raw
        kv_grads = shards.kv_grad_buffers() if shards.sliced else []
        dx = x.new_zeros(x.shape)
        dx2 = dx.view(B * L, h)
        reduces = OwnerReduces(group)
        for r, buf in Rounds(shards.round_pack.pack(shards.round), group):  # input projections
            wq, wk, wv, _, _, _, _ = shards.unpack(r, buf)
            j = r // R
            dq = dq_raw[r].reshape(B * L, -1)
            dx2.addmm_(dq, wq)
            grads = [dq.t() @ x2, None, None, None, dq.sum(0) if shards.bias else None, None, None]
            if r % R == R - 1:
                shards.add_kv_grads(j, dk_raw[j].reshape(B * L, -1), dv_raw[j].reshape(B * L, -1),
                                    x2, wk, wv, dx2, grads, kv_grads)
            round_sinks_grad = None if sinks_grad is None else sinks_grad[r]
            reduces.send(r, shards.round_pack.pack(shards.round_grads(grads, round_sinks_grad)))
        grads = shards.own_grads(shards.round_pack.unpack(reduces.finish()), kv_grads, go)
        return (dx, None, None, None, None, None, None, None, *grads, *norm_grads)


def _normed(q_raw: torch.Tensor, kv_raw: torch.Tensor, qn: torch.Tensor, kn: torch.Tensor,
            cos: torch.Tensor, sin: torch.Tensor, spec: AttentionSpec):
    """Raw projections -> (q_all [D, B, nq, L, d], kv_all [G, 2, B, nkv, L, d]), normalised and
    rotated."""
    q_all = normed_heads(q_raw, qn, spec.local_heads, cos, sin, spec)
    k_all = normed_heads(kv_raw[:, 0], kn, spec.local_kv_heads, cos, sin, spec)
    return q_all, torch.stack([k_all, spec.parts.values.apply(_v_heads(kv_raw, spec))], 1)


def _v_heads(kv_raw: torch.Tensor, spec: AttentionSpec) -> torch.Tensor:
    """[G, 2, B, L, nkv*d] -> the values as projected [G, B, nkv, L, d] (before
    ``AttentionParts.values``)."""
    G, _, B, L, _ = kv_raw.shape
    return kv_raw[:, 1].view(G, B, L, spec.local_kv_heads, -1).transpose(2, 3)


def _flat_groups(t: torch.Tensor) -> torch.Tensor:
    """[G, B, n, L, d] -> [G, B, L, n*d]"""
    G, B, n, L, d = t.shape
    return t.transpose(2, 3).reshape(G, B, L, n * d)
