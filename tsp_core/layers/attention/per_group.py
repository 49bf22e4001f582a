"""The default TSP attention schedule (docs/design.md "Attention"): broadcast each rank's head
group in turn, gather that group's K/V, attend with the local queries, accumulate the output
projection locally.

The schedule is one ``torch.autograd.Function`` so that the backward keeps only this rank's own
weight shard and the local Q/K/V/output/LSE of its own tokens (docs/design.md "Memory rules"):
weights and K/V that came from other ranks are fetched again in the backward instead of being
saved.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .. import flash
from ..lora import add_input, input_backward, output_backward, output_part
from ..nf4 import restored, tensors_only
from .rounds import (
    AttentionSpec,
    KVGathers,
    OwnerReduces,
    Rounds,
    Shards,
    attend_round,
    attend_round_backward,
    gated,
    gated_backward,
    join_gate,
    join_heads,
    rotated,
    rotated_backward,
    row_groups,
    split_gate,
    split_heads,
    split_norms,
)


class PerGroupAttentionFn(torch.autograd.Function):
    """Round r uses rank r's query heads; with nkv < D, rounds r of one key/value head
    (``kv_replicas`` consecutive rounds) share that head's K/V: it is computed, gathered (and in
    the backward, its gradient reduce-scattered) once per head, not once per round.

    Overlap (docs/design.md "Attention"): while round r attends, the K/V all-gather of round r+1 and
    the owner broadcast of round r+2 are in flight; in the backward, the dK/dV of the previous
    key/value head are reduce-scattered during the first half of round r's attention and the K/V
    of the next one gathered during the second (never both: docs/memory.md "The attention
    backward's floor").

    LoRA (``spec.lora``, :mod:`tsp_core.layers.lora`): the adapters' tensors follow the weights;
    each round adds ``u @ B[rows]^T`` to the rows of q, k, v it computes and sums the output
    projection's input into ``z`` [B, L, r] (one more output). Frozen projections (none of
    them requires grad) get no weight gradient: the owner reduces (and the key/value slices'
    reduce-scatter) are not issued."""

    @staticmethod
    def forward(ctx, x, cos, sin, spec: AttentionSpec, group, docs, kv_sink, dropout, *weights):
        B, L, _ = x.shape
        nq, nkv, d = spec.local_heads, spec.local_kv_heads, spec.head_dim
        D, R = spec.tsp_size, spec.kv_replicas
        values = spec.parts.values
        groups = row_groups(docs, L * D, dist.get_rank(group), spec)
        first = len(ctx.needs_input_grad) - len(weights)  # the weights' place among the inputs
        weights, low = spec.lora.split(weights)
        if spec.parts.takes_kv:  # the first "weight" is another layer's kv_all, reused as it is
            shared, *weights = weights
            first += 1
        proj, (qn, kn) = split_norms(weights, spec)
        ctx.wgrad = any(ctx.needs_input_grad[first:first + len(proj)])
        shards = Shards(proj, spec, group)
        q_all = x.new_empty(D, B, nq, L, d)
        kv_all = shared if spec.parts.takes_kv else x.new_empty(D // R, 2, B, nkv, L, d)
        if tuple(kv_all.shape) != (D // R, 2, B, nkv, L, d):
            raise ValueError(f"the shared K/V have shape {tuple(kv_all.shape)}, this layer needs "
                             f"{(D // R, 2, B, nkv, L, d)}: the layers sharing K/V must have "
                             f"the same key/value heads and head_dim")
        out_all = x.new_empty(D, B, nq, L, d)
        lse_all = x.new_empty(D, B, nq, L, dtype=torch.float64 if x.dtype == torch.float64
                              else torch.float32)
        y = x.new_zeros(x.shape)  # contiguous, whatever x's strides
        z = x.new_zeros(B * L, low["o_proj"][0].shape[0]) if "o_proj" in low else None
        kvs = KVGathers(kv_all, groups, spec, group)

        def project(r: int, buf: torch.Tensor) -> tuple:
            """Round r's queries and, in the first round of its key/value head, that head's K/V,
            whose gather starts at once; returns the round's output projection, sinks and output
            gate (this rank's tokens', from the round's query shard; None without one)."""
            wq, wk, wv, wo, bq, bk, bv = shards.unpack(r, buf)
            q, gate = split_gate(add_input(F.linear(x, wq, bq), low.get("q_proj"),
                                           spec.q_rows(r)), spec, nq)
            q_all[r] = rotated(split_heads(q, nq), qn, cos, sin, spec)
            if r % R == 0 and spec.parts.takes_kv:
                kvs.start(r // R)
            elif r % R == 0:
                j = r // R
                k = add_input(F.linear(x, wk, bk), low.get("k_proj"), spec.kv_rows(j))
                v = add_input(F.linear(x, wv, bv), low.get("v_proj"), spec.kv_rows(j))
                kv_all[j, 0] = rotated(split_heads(k, nkv), kn, cos, sin, spec)
                kv_all[j, 1] = values.apply(split_heads(v, nkv))
                kvs.start(j)
            return wo, None if shards.sinks is None else shards.round_sinks(buf), gate

        def attend(r: int, wo: torch.Tensor, sinks: torch.Tensor | None,
                   gate: torch.Tensor | None) -> None:
            attend_round(r, q_all, out_all, lse_all, kvs, sinks, dropout)
            attn = gated(join_heads(out_all[r]), gate).reshape(B * L, -1)
            y.view(B * L, -1).addmm_(attn, wo.t())
            output_part(z, attn, low.get("o_proj"), spec.o_cols(r))

        previous = None
        for r, buf in Rounds(shards.round_pack.pack(shards.round), group):
            wo, sinks, gate = project(r, buf)  # receiving buf started round r+1's broadcast
            if previous is not None:
                attend(*previous)
            previous = (r, wo, sinks, gate)
        attend(*previous)
        if kv_sink is not None:  # prefill: this rank's own tokens' K/V of every key/value head
            kv_sink(kv_all)
        ctx.spec, ctx.group, ctx.groups, ctx.dropout = spec, group, groups, dropout
        saved, ctx.kept = tensors_only(weights)  # NF4 shards are kept beside (..nf4)
        ctx.save_for_backward(x, cos, sin, q_all, kv_all, out_all, lse_all, *saved,
                              *[t for ts in low.values() for t in ts])
        outs = (y, *([kv_all] if spec.parts.gives_kv else []),
                *([z.view(B, L, -1)] if z is not None else []))
        if spec.parts.gives_kv:  # for the layers that reuse these K/V; their gradient comes back
            ctx.set_materialize_grads(False)
        return outs if len(outs) > 1 else y

    @staticmethod
    def backward(ctx, dy, *extra):
        spec, group, groups = ctx.spec, ctx.group, ctx.groups
        dkv_reused = extra[0] if spec.parts.gives_kv else None
        dz = extra[-1] if "o_proj" in spec.lora.names else None
        x, cos, sin, q_all, kv_all, out_all, lse_all, *saved = ctx.saved_tensors
        weights, low = spec.lora.split(saved)
        weights = restored(weights, ctx.kept)
        lgrads = spec.lora.zero_grads(low)
        wgrad = ctx.wgrad
        if dy is None:  # only the returned K/V were used
            dy = torch.zeros_like(x)
        B, L, h = x.shape
        nq, nkv, R = spec.local_heads, spec.local_kv_heads, spec.kv_replicas
        values = spec.parts.values
        proj, (qn, kn) = split_norms(weights, spec)
        norm_grads = [None, None]  # q_norm, k_norm: summed over the rounds
        shards = Shards(proj, spec, group)
        kv_grads = shards.kv_grad_buffers() if shards.sliced and wgrad else []
        dy = dy.contiguous()
        dz2 = None if dz is None else dz.reshape(B * L, -1)
        x2, dy2 = x.reshape(B * L, h), dy.reshape(B * L, h)
        dx = x.new_zeros(x.shape)
        dx2 = dx.view(B * L, h)
        reduces = OwnerReduces(group)
        kvs = KVGathers(kv_all, groups, spec, group)
        dkv_sum: dict[int, torch.Tensor] = {}
        shared_grad = torch.empty_like(kv_all) if spec.parts.takes_kv else None

        def finish(r: int, grads: list, wk: torch.Tensor, wv: torch.Tensor,
                   bk: torch.Tensor | None, bv: torch.Tensor | None,
                   sinks_grad: torch.Tensor | None) -> None:
            """Round r's tail, one round late so that its dK/dV reduce-scatter overlapped the
            next round: in the last round of a key/value head, that projection's backward; then
            the round's weight gradients (and its sinks') on their way to the owner."""
            if r % R == R - 1 and spec.parts.takes_kv:  # the K/V's owner layer takes its grad
                shared_grad[r // R] = kvs.scattered(r // R)
            elif r % R == R - 1:
                dkv = kvs.scattered(r // R)
                if dkv_reused is not None:  # the KV-shared layers' gradient of these K/V
                    dkv = dkv + dkv_reused[r // R]
                rows = spec.kv_rows(r // R)
                pre = None if kn is None else split_heads(  # recomputed
                    add_input(F.linear(x, wk, bk), low.get("k_proj"), rows), nkv)
                dk, g = rotated_backward(pre, kn, cos, sin, spec, dkv[0])
                if g is not None:
                    norm_grads[1] = g if norm_grads[1] is None else norm_grads[1] + g
                pre = (split_heads(add_input(F.linear(x, wv, bv), low.get("v_proj"), rows), nkv)
                       if values.needs_input else None)  # recomputed, as the keys' norm input
                dv = values.backward(pre, dkv[1])
                dk, dv = join_heads(dk).reshape(B * L, -1), join_heads(dv).reshape(B * L, -1)
                input_backward(dk, low.get("k_proj"), lgrads.get("k_proj"), rows)
                input_backward(dv, low.get("v_proj"), lgrads.get("v_proj"), rows)
                if wgrad:
                    shards.add_kv_grads(r // R, dk, dv, x2, wk, wv, dx2, grads, kv_grads)
                else:  # frozen: the input's gradient only
                    dx2.addmm_(dk, wk).addmm_(dv, wv)
            if wgrad:
                reduces.send(r, shards.round_pack.pack(shards.round_grads(grads, sinks_grad)))

        kvs.start(0)
        previous = None
        for r, buf in Rounds(shards.round_pack.pack(shards.round), group):
            wq, wk, wv, wo, bq, bk, bv = shards.unpack(r, buf)
            o = out_all[r]
            # recomputed from this rank's tokens: the pre-norm queries (with a q norm) and the
            # output gate (with one); nothing of them was kept from the forward
            pre, gate = (split_gate(add_input(F.linear(x, wq, bq), low.get("q_proj"),
                                              spec.q_rows(r)), spec, nq)
                         if qn is not None or spec.parts.output_gate else (None, None))
            d_attn = F.linear(dy, wo.t())
            if dz2 is not None:  # the output projection's adapter: its share of the gradient
                # (its input recomputed and dropped at once, not held through the round)
                d_attn = output_backward(d_attn.reshape(B * L, -1), dz2,
                                         gated(join_heads(o), gate).reshape(B * L, -1),
                                         low["o_proj"], lgrads["o_proj"], spec.o_cols(r)
                                         ).view_as(d_attn)
            do, dgate = gated_backward(d_attn, join_heads(o), gate)
            del d_attn
            do = split_heads(do, nq).contiguous()
            dq = attend_round_backward(r, do, q_all, out_all, lse_all, kvs, dkv_sum,
                                       ctx.dropout)
            sinks_grad = (None if shards.sinks is None else
                          flash.sink_backward(do, o, lse_all[r], shards.round_sinks(buf)))
            del do
            pre = None if qn is None else split_heads(pre, nq)
            dq, g = rotated_backward(pre, qn, cos, sin, spec, dq)
            if g is not None:
                norm_grads[0] = g if norm_grads[0] is None else norm_grads[0] + g
            dq = join_gate(join_heads(dq), dgate, spec, nq).reshape(B * L, -1)
            del dgate
            input_backward(dq, low.get("q_proj"), lgrads.get("q_proj"), spec.q_rows(r))
            dx2.addmm_(dq, wq)
            grads = [None] * 7
            if wgrad:
                go = dy2.t() @ gated(join_heads(o), gate).reshape(B * L, -1)
                grads = [dq.t() @ x2, None, None, go,
                         dq.sum(0) if shards.bias else None, None, None]
            del dq
            if previous is not None:
                finish(*previous)
            previous = (r, grads, wk, wv, bk, bv, sinks_grad)
        finish(*previous)
        grads = (shards.own_grads(shards.round_pack.unpack(reduces.finish()), kv_grads)
                 if wgrad else [None] * len(proj))  # frozen: no weight gradient moved
        if qn is not None:
            grads = [*grads, *(norm_grads[:1] if spec.parts.takes_kv else norm_grads)]
        if spec.parts.takes_kv:
            grads = [shared_grad, *grads]
        grads += spec.lora.grads(lgrads)
        return (dx, None, None, None, None, None, None, None, *grads)
