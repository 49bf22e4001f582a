"""TSP attention (DESIGN 3.1): broadcast each rank's head group in turn, gather that group's K/V,
attend with the local queries, accumulate the output projection locally.

The schedule is one ``torch.autograd.Function`` so that the backward keeps only this rank's own
weight shard and the local Q/K/V/output/LSE of its own tokens (DESIGN 4): weights and K/V that came
from other ranks are fetched again in the backward instead of being saved.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F

from . import comm, flash, rope
from .layout import row_segments
from .mesh import TSPMesh
from .norm import NORMS
from .packing import FlatPack
from .params import (
    REPLICATED,
    ShardedModule,
    ShardSpec,
    chunk_spec,
    even_spec,
    init_full,
    local_replicated,
    schedule_inputs,
)


def check_attention_shape(tsp_size: int, hidden_size: int, num_heads: int, num_kv_heads: int,
                          head_dim: int) -> None:
    """Raise, naming the numbers, when the heads cannot be split over ``tsp_size`` ranks."""
    if num_heads % tsp_size:
        raise ValueError(f"tsp_size ({tsp_size}) must divide num_attention_heads ({num_heads})")
    if num_kv_heads < 1 or num_heads % num_kv_heads:
        raise ValueError(f"num_key_value_heads ({num_kv_heads}) must divide "
                         f"num_attention_heads ({num_heads})")
    if num_kv_heads % tsp_size and tsp_size % num_kv_heads:
        raise ValueError(f"num_key_value_heads ({num_kv_heads}) and tsp_size ({tsp_size}): one "
                         f"must divide the other, so that each rank's query heads share whole "
                         f"key/value heads; pick tsp_size from the divisors or multiples of "
                         f"{num_kv_heads}")
    if hidden_size < 1 or head_dim < 1:
        raise ValueError(f"hidden_size ({hidden_size}) and head_dim ({head_dim}) must be positive")


@dataclass(frozen=True)
class AttentionSpec:
    """Static shape and pattern of one TSP attention layer."""

    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    tsp_size: int
    layout: str = "zigzag"
    causal: bool = True
    sliding_window: int | None = None
    scale: float | None = None
    qk_norm_eps: float | None = None   # per-head RMSNorm of q and k before RoPE (Qwen3, Gemma 3)
    qk_norm_kind: str = "llama"        # its numerics (tsp_core.norm.NORMS)
    softcap: float | None = None       # scores tanh(s / softcap) * softcap (Gemma 2; flash.py)
    # the q/k norms span all heads of a token (OLMo 2), not each head: attention_phased.py
    qk_norm_all_heads: bool = False

    @property
    def local_heads(self) -> int:
        return self.num_heads // self.tsp_size

    @property
    def local_kv_heads(self) -> int:
        return max(1, self.num_kv_heads // self.tsp_size)

    @property
    def kv_replicas(self) -> int:
        """How many ranks hold a copy of the same key/value head (MQA-like: nkv < D)."""
        return max(1, self.tsp_size // self.num_kv_heads)

    @property
    def softmax_scale(self) -> float:
        return self.scale if self.scale is not None else self.head_dim ** -0.5


def _heads(t: torch.Tensor, n: int) -> torch.Tensor:
    """[B, L, n*d] -> [B, n, L, d]"""
    B, L, _ = t.shape
    return t.view(B, L, n, -1).transpose(1, 2)


def _flat(t: torch.Tensor) -> torch.Tensor:
    """[B, n, L, d] -> [B, L, n*d]"""
    B, n, L, d = t.shape
    return t.transpose(1, 2).reshape(B, L, n * d)


class _Rounds:
    """Owner-broadcast of every rank's packed shard in turn, one round prefetched ahead."""

    def __init__(self, own: torch.Tensor, group: dist.ProcessGroup) -> None:
        self.own, self.group = own, group
        self.size, self.me = dist.get_world_size(group), dist.get_rank(group)
        self._pending = self._start(0)

    def _start(self, r: int):
        buf = self.own if r == self.me else torch.empty_like(self.own)
        return buf, comm.broadcast(buf, r, self.group, async_op=True)

    def __iter__(self):
        for r in range(self.size):
            buf, handle = self._pending
            handle.wait()
            if r + 1 < self.size:
                self._pending = self._start(r + 1)
            yield r, buf


class _OwnerReduces:
    """Each round's weight gradients summed onto the round's owner, at most one foreign reduce in
    flight; :meth:`finish` waits for all and returns this rank's own sum."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group, self.me = group, dist.get_rank(group)
        self.mine: tuple | None = None
        self.others: list[tuple] = []

    def send(self, owner: int, buf: torch.Tensor) -> None:
        pending = (buf, comm.reduce(buf, owner, self.group, async_op=True))
        if owner == self.me:
            self.mine = pending
            return
        self.others.append(pending)
        if len(self.others) > 1:
            self.others.pop(0)[1].wait()

    def finish(self) -> torch.Tensor:
        for _, handle in self.others:
            handle.wait()
        self.mine[1].wait()
        return self.mine[0]


@dataclass(frozen=True)
class _RowGroup:
    """Rows of the batch that share one token layout (packed rows may differ)."""

    rows: slice | list[int]
    docs: tuple[int, ...] | None
    pieces: list


def _row_groups(docs: tuple[tuple[int, ...], ...] | None, seq: int, rank: int,
                spec: AttentionSpec) -> list[_RowGroup]:
    def pieces(d: tuple[int, ...] | None):
        segs = row_segments(d or (seq,), rank, spec.tsp_size, spec.layout)
        return flash.plan_pieces(segs, seq, spec.causal, spec.sliding_window)

    if docs is None:
        return [_RowGroup(slice(None), None, pieces(None))]
    by_docs: dict[tuple[int, ...], list[int]] = {}
    for b, d in enumerate(docs):
        by_docs.setdefault(tuple(d), []).append(b)
    if len(by_docs) == 1:
        (d,) = by_docs
        return [_RowGroup(slice(None), d, pieces(d))]
    return [_RowGroup(rows, d, pieces(d)) for d, rows in by_docs.items()]


class _Shards:
    """This rank's attention weights, split into what each round broadcasts and where the round's
    key/value projection comes from.

    With at least as many key/value heads as ranks, a round's packed shard holds all four
    projections of that rank's heads. With fewer (nkv < D, MQA/GQA), each rank stores an even
    slice of the key/value rows instead of a copy of a whole head, so every weight exists once
    (gradient norms, checkpoints and optimizer state count it once); the slices are all-gathered
    once per pass, the rounds broadcast only the query and output projections, and the weight
    gradients of the slices are reduce-scattered back at the end."""

    def __init__(self, weights: Sequence[torch.Tensor], spec: AttentionSpec,
                 group: dist.ProcessGroup, split_out: bool = False) -> None:
        wq, wk, wv, wo, *b = weights
        self.spec, self.group, self.bias = spec, group, bool(b)
        self.sliced = spec.kv_replicas > 1
        self.round = [wq, wo, *b[:1]] if self.sliced else list(weights)
        # split_out: the output projection goes round by round on its own (attention_phased)
        self.split_out = split_out
        if split_out:
            self.round = [w for w in self.round if w is not wo]
            self.out_pack = FlatPack([wo.shape])
        self.round_pack = FlatPack([w.shape for w in self.round])
        self.kv_rows = spec.num_kv_heads * spec.head_dim
        self.kv_full: list[torch.Tensor] = []
        if self.sliced:
            kv = [wk, wv, *b[1:]]
            self.kv_pack = FlatPack([w.shape for w in kv])
            D = spec.tsp_size
            buf = wq.new_empty(D, self.kv_pack.numel)
            comm.all_gather(buf, self.kv_pack.pack(kv), group)
            self.kv_full = [t[:self.kv_rows] for t in self._rank_rows(buf)]

    def _rank_rows(self, buf: torch.Tensor) -> list[torch.Tensor]:
        """[D, packed slices] in rank order -> each tensor's padded full rows [D * per, ...]."""
        D = self.spec.tsp_size
        return [part.reshape(D * s[0], *s[1:])
                for part, s in zip(buf.split(self.kv_pack.sizes, dim=1), self.kv_pack.shapes)]

    def unpack(self, r: int, buf: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        """Round ``r``'s (wq, wk, wv, wo, bq, bk, bv); absent biases (and wo when split out)
        are None."""
        parts = self.round_pack.unpack(buf)
        if self.split_out:
            parts.insert(1 if self.sliced else 3, None)
        if not self.sliced:
            wq, wk, wv, wo, *b = parts
            return (wq, wk, wv, wo, *(b or [None] * 3))
        wq, wo, *bq = parts
        d = self.spec.head_dim
        rows = slice(r // self.spec.kv_replicas * d, (r // self.spec.kv_replicas + 1) * d)
        kv = [t[rows] for t in self.kv_full] + [None] * (4 - len(self.kv_full))
        return (wq, kv[0], kv[1], wo, *(bq or [None]), kv[2], kv[3])

    def round_grads(self, grads: list[torch.Tensor | None]) -> list[torch.Tensor]:
        """Of round weight gradients (wq, wk, wv, wo, bq, bk, bv), those the round's owner
        receives (in ``round_pack`` order)."""
        gq, gk, gv, go, bq, bk, bv = grads
        out = [] if self.split_out else [go]
        if self.sliced:
            return [gq, *out] + ([bq] if self.bias else [])
        return [gq, gk, gv, *out] + ([bq, bk, bv] if self.bias else [])

    def add_kv_grads(self, j: int, dk: torch.Tensor, dv: torch.Tensor, x2: torch.Tensor,
                     wk: torch.Tensor, wv: torch.Tensor, dx2: torch.Tensor,
                     grads: list[torch.Tensor | None], kv_grads: list[torch.Tensor]) -> None:
        """The last round of key/value head j: dX += dK Wk + dV Wv, and the key/value weight (and
        bias) gradients of this rank's tokens into ``grads`` (flat [B*L, rows] inputs); with
        slices, also into head j's rows of the ``kv_grads`` accumulators."""
        dx2.addmm_(dk, wk).addmm_(dv, wv)
        grads[1:3] = [dk.t() @ x2, dv.t() @ x2]
        if self.bias:
            grads[5:7] = [dk.sum(0), dv.sum(0)]
        if self.sliced:  # this rank's tokens' share of head j's gradient
            rows = slice(j * self.spec.head_dim, (j + 1) * self.spec.head_dim)
            for acc, g in zip(kv_grads, grads[1:3] + grads[5:7]):
                acc[rows] += g

    def own_grads(self, own: list[torch.Tensor], kv_grads: list[torch.Tensor],
                  go: torch.Tensor | None = None) -> list[torch.Tensor]:
        """This rank's weight gradients in weight order (wq, wk, wv, wo, biases), from its summed
        round gradients ``own`` (``round_pack`` order), the key/value slices' accumulators and,
        when the output projection is split out, its gradient ``go``."""
        own = list(own)
        if self.split_out:
            own.insert(1 if self.sliced else 3, go)
        if not self.sliced:
            return own
        gk, gv, *gb = self.scatter_kv_grads(kv_grads)
        gq, go, *gbq = own
        return [gq, gk, gv, go] + ([gbq[0], gb[0], gb[1]] if self.bias else [])

    def kv_grad_buffers(self) -> list[torch.Tensor]:
        """Zeroed padded full-row accumulators for the key/value weight gradients (sliced)."""
        D = self.spec.tsp_size
        return [t.new_zeros(D * s[0], *s[1:]) for t, s in zip(self.kv_full, self.kv_pack.shapes)]

    def scatter_kv_grads(self, full: list[torch.Tensor]) -> list[torch.Tensor]:
        """Sum every rank's key/value gradient rows and keep this rank's slice."""
        D = self.spec.tsp_size
        send = torch.cat([t.reshape(D, -1) for t in full], dim=1)
        out = send.new_empty(self.kv_pack.numel)
        comm.reduce_scatter(out, send, self.group)
        return self.kv_pack.unpack(out)


def _split_norms(weights: Sequence[torch.Tensor], spec: AttentionSpec):
    """(projection weights, (q_norm weight, k_norm weight) or (None, None))."""
    if spec.qk_norm_eps is None:
        return list(weights), (None, None)
    return list(weights[:-2]), tuple(weights[-2:])


def _head_norm(t: torch.Tensor, weight: torch.Tensor | None, spec: AttentionSpec) -> torch.Tensor:
    return t if weight is None else NORMS[spec.qk_norm_kind](t, weight, spec.qk_norm_eps)


def _head_norm_backward(pre: torch.Tensor, weight: torch.Tensor, spec: AttentionSpec,
                        grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Gradients of the per-head norm w.r.t. its input ``pre`` (recomputed, not saved: DESIGN 4)
    and its weight, by autograd over the forward's own ops."""
    with torch.enable_grad():
        pre = pre.detach().requires_grad_()
        weight = weight.detach().requires_grad_()
        return torch.autograd.grad(_head_norm(pre, weight, spec), (pre, weight), grad)


class _KVGathers:
    """The whole-sequence K/V of each key/value head j (one tensor per row group), gathered from
    every rank's own tokens. ``start(j)`` issues head j's all-gathers without waiting, so that
    they run while the previous head's attention computes (on CUDA the NCCL stream does the
    transfer); ``get(j)`` waits and puts the tokens in order; ``drop(j)`` after the head's last
    round frees them. At most two heads' K/V exist at once: one in use, one arriving."""

    def __init__(self, kv_all: torch.Tensor, groups: list[_RowGroup], spec: AttentionSpec,
                 group: dist.ProcessGroup) -> None:
        self.kv_all, self.groups, self.spec, self.group = kv_all, groups, spec, group
        self._pending: dict[int, list[comm.PendingSequence]] = {}
        self._ready: dict[int, list[torch.Tensor]] = {}

    def start(self, j: int) -> None:
        if j >= len(self.kv_all) or j in self._pending or j in self._ready:
            return
        self._pending[j] = [comm.start_all_gather_sequence(self.kv_all[j][:, g.rows], self.group,
                                                           3, self.spec.layout, g.docs)
                            for g in self.groups]

    def get(self, j: int) -> list[torch.Tensor]:
        if j not in self._ready:
            self.start(j)  # not started ahead: gather now
            self._ready[j] = [p.wait() for p in self._pending.pop(j)]
        return self._ready[j]

    def drop(self, j: int) -> None:
        self._ready.pop(j, None)


def _attend(r: int, q_all: torch.Tensor, out_all: torch.Tensor, lse_all: torch.Tensor,
            kvs: _KVGathers) -> None:
    """Round ``r``'s attention: the local queries of head group r against the whole sequence's
    K/V of its key/value head j (from ``kvs``, dropped after j's last round); writes
    ``out_all[r]`` and ``lse_all[r]``."""
    spec = kvs.spec
    R = spec.kv_replicas
    j = r // R
    for g, kv in zip(kvs.groups, kvs.get(j)):
        o, lse = flash.attention_forward(q_all[r][g.rows], kv[0], kv[1], g.pieces,
                                         spec.softmax_scale, softcap=spec.softcap)
        out_all[r][g.rows], lse_all[r][g.rows] = o, lse
    if r % R == R - 1:
        kvs.drop(j)


def _attend_backward(r: int, do: torch.Tensor, q_all: torch.Tensor, out_all: torch.Tensor,
                     lse_all: torch.Tensor, kvs: _KVGathers, dkv_sum: dict[int, torch.Tensor]
                     ) -> tuple[torch.Tensor, Callable[[], torch.Tensor] | None]:
    """Backward of :func:`_attend` for round ``r`` given its output gradient ``do``: dQ of the
    round (before RoPE's backward) and, in the last round of key/value head j, a function that
    returns dK/dV of this rank's own tokens (summed in float32 over j's rounds and pieces, cast
    once, and reduce-scattered over every rank's queries: the reduce-scatter is started here and
    runs while the caller goes on with the next round), else None."""
    spec, group = kvs.spec, kvs.group
    R = spec.kv_replicas
    j, first, last = r // R, r % R == 0, r % R == R - 1
    dq_parts = []
    for i, (g, kv) in enumerate(zip(kvs.groups, kvs.get(j))):
        dq_g, dkv_sum[i] = flash.attention_backward(
            do[g.rows], q_all[r][g.rows], kv, out_all[r][g.rows], lse_all[r][g.rows], g.pieces,
            spec.softmax_scale, softcap=spec.softcap, dkv=None if first else dkv_sum[i])
        dq_parts.append((g.rows, dq_g))
    dq = _by_rows(dq_parts, q_all[r])
    if not last:
        return dq, None
    kvs.drop(j)  # the full-sequence K/V and dK/dV of one head never coexist with the next's dK/dV
    like = kvs.kv_all[j]
    scatters = [(g.rows, comm.start_reduce_scatter_sequence(dkv_sum.pop(i).to(like.dtype), group,
                                                            3, spec.layout, g.docs))
                for i, g in enumerate(kvs.groups)]
    return dq, lambda: _by_rows([(rows, p.wait()) for rows, p in scatters], like)


class _TSPAttentionFn(torch.autograd.Function):
    """Round r uses rank r's query heads; with nkv < D, rounds r of one key/value head
    (``kv_replicas`` consecutive rounds) share that head's K/V: it is computed, gathered (and in
    the backward, its gradient reduce-scattered) once per head, not once per round.

    Overlap (DESIGN 3.1): while round r attends, the K/V all-gather of round r+1 and the owner
    broadcast of round r+2 are in flight; in the backward, the K/V of the next key/value head
    are gathered and the dK/dV of the previous one reduce-scattered while round r computes."""

    @staticmethod
    def forward(ctx, x, cos, sin, spec: AttentionSpec, group, docs, kv_sink, *weights):
        B, L, _ = x.shape
        nq, nkv, d = spec.local_heads, spec.local_kv_heads, spec.head_dim
        D, R = spec.tsp_size, spec.kv_replicas
        groups = _row_groups(docs, L * D, dist.get_rank(group), spec)
        proj, (qn, kn) = _split_norms(weights, spec)
        shards = _Shards(proj, spec, group)
        q_all = x.new_empty(D, B, nq, L, d)
        kv_all = x.new_empty(D // R, 2, B, nkv, L, d)
        out_all = x.new_empty(D, B, nq, L, d)
        lse_all = x.new_empty(D, B, nq, L, dtype=torch.float64 if x.dtype == torch.float64
                              else torch.float32)
        y = x.new_zeros(x.shape)  # contiguous, whatever x's strides
        kvs = _KVGathers(kv_all, groups, spec, group)

        def project(r: int, buf: torch.Tensor) -> torch.Tensor:
            """Round r's queries and, in the first round of its key/value head, that head's K/V,
            whose gather starts at once; returns the round's output projection."""
            wq, wk, wv, wo, bq, bk, bv = shards.unpack(r, buf)
            q_all[r] = rope.apply(_head_norm(_heads(F.linear(x, wq, bq), nq), qn, spec), cos, sin)
            if r % R == 0:
                j = r // R
                kv_all[j, 0] = rope.apply(_head_norm(_heads(F.linear(x, wk, bk), nkv), kn, spec),
                                          cos, sin)
                kv_all[j, 1] = _heads(F.linear(x, wv, bv), nkv)
                kvs.start(j)
            return wo

        def attend(r: int, wo: torch.Tensor) -> None:
            _attend(r, q_all, out_all, lse_all, kvs)
            y.view(B * L, -1).addmm_(_flat(out_all[r]).reshape(B * L, -1), wo.t())

        previous = None
        for r, buf in _Rounds(shards.round_pack.pack(shards.round), group):
            wo = project(r, buf)  # receiving buf started round r+1's broadcast
            if previous is not None:
                attend(*previous)
            previous = (r, wo)
        attend(*previous)
        if kv_sink is not None:  # prefill: this rank's own tokens' K/V of every key/value head
            kv_sink(kv_all)
        ctx.spec, ctx.group, ctx.groups = spec, group, groups
        ctx.save_for_backward(x, cos, sin, q_all, kv_all, out_all, lse_all, *weights)
        return y

    @staticmethod
    def backward(ctx, dy):
        spec, group, groups = ctx.spec, ctx.group, ctx.groups
        x, cos, sin, q_all, kv_all, out_all, lse_all, *weights = ctx.saved_tensors
        B, L, h = x.shape
        nq, nkv, R = spec.local_heads, spec.local_kv_heads, spec.kv_replicas
        proj, (qn, kn) = _split_norms(weights, spec)
        norm_grads = [None, None]  # q_norm, k_norm: summed over the rounds
        shards = _Shards(proj, spec, group)
        kv_grads = shards.kv_grad_buffers() if shards.sliced else []
        dy = dy.contiguous()
        x2, dy2 = x.reshape(B * L, h), dy.reshape(B * L, h)
        dx = x.new_zeros(x.shape)
        dx2 = dx.view(B * L, h)
        reduces = _OwnerReduces(group)
        kvs = _KVGathers(kv_all, groups, spec, group)
        dkv_sum: dict[int, torch.Tensor] = {}

        def finish(r: int, grads: list, dkv: Callable[[], torch.Tensor] | None, wk: torch.Tensor,
                   wv: torch.Tensor, bk: torch.Tensor | None) -> None:
            """Round r's tail, one round late so that its dK/dV reduce-scatter overlapped the
            next round: the key/value projection's backward, then the round's weight gradients
            on their way to the owner."""
            if dkv is not None:
                dkv = dkv()
                dk = rope.apply_backward(dkv[0], cos, sin)
                if kn is not None:
                    dk, g = _head_norm_backward(_heads(F.linear(x, wk, bk), nkv), kn, spec, dk)
                    norm_grads[1] = g if norm_grads[1] is None else norm_grads[1] + g
                shards.add_kv_grads(r // R, _flat(dk).reshape(B * L, -1),
                                    _flat(dkv[1]).reshape(B * L, -1), x2, wk, wv, dx2, grads,
                                    kv_grads)
            reduces.send(r, shards.round_pack.pack(shards.round_grads(grads)))

        kvs.start(0)
        previous = None
        for r, buf in _Rounds(shards.round_pack.pack(shards.round), group):
            wq, wk, wv, wo, bq, bk, _ = shards.unpack(r, buf)
            if r % R == R - 1:
                kvs.start(r // R + 1)  # the next head's K/V arrive while this round computes
            o = out_all[r]
            do = _heads(F.linear(dy, wo.t()), nq).contiguous()
            dq, dkv = _attend_backward(r, do, q_all, out_all, lse_all, kvs, dkv_sum)
            dq = rope.apply_backward(dq, cos, sin)
            if qn is not None:
                dq, g = _head_norm_backward(_heads(F.linear(x, wq, bq), nq), qn, spec, dq)
                norm_grads[0] = g if norm_grads[0] is None else norm_grads[0] + g
            dq = _flat(dq).reshape(B * L, -1)
            dx2.addmm_(dq, wq)
            grads = [dq.t() @ x2, None, None, dy2.t() @ _flat(o).reshape(B * L, -1),
                     dq.sum(0) if shards.bias else None, None, None]
            if previous is not None:
                finish(*previous)
            previous = (r, grads, dkv, wk, wv, bk)
        finish(*previous)
        grads = shards.own_grads(shards.round_pack.unpack(reduces.finish()), kv_grads)
        if qn is not None:
            grads = [*grads, *norm_grads]
        return (dx, None, None, None, None, None, None, *grads)


def _by_rows(parts: list[tuple[slice | list[int], torch.Tensor]], like: torch.Tensor
             ) -> torch.Tensor:
    """Reassemble per-row-group results along the batch dim (dim 0, or 1 for stacked K/V)."""
    if len(parts) == 1:  # one layout for the whole batch: no reassembly
        return parts[0][1]
    out = torch.empty_like(like)
    for rows, t in parts:
        if like.dim() == 5:  # [2, B, heads, L, d]
            out[:, rows] = t
        else:
            out[rows] = t
    return out


class TSPAttention(ShardedModule):
    """Multi-head / grouped-query attention with TSP: rank p owns query heads
    [p*nq/D, (p+1)*nq/D), the key/value heads they use (with fewer key/value heads than ranks, an
    even 1/D slice of the key/value rows instead, so no weight is stored twice), and the matching
    columns of o_proj. Parameters carry Hugging Face names and shapes: ``q_proj.weight``
    [nq*d, h], ``k_proj.weight``, ``v_proj.weight`` [nkv*d, h], ``o_proj.weight`` [h, nq*d],
    optional biases, and with ``qk_norm_eps`` the per-head RMSNorm weights ``q_norm.weight``,
    ``k_norm.weight`` [d] (replicated; applied to every query/key head before RoPE, Qwen3), or
    with ``qk_norm_all_heads`` norms over all heads of a token, [nq*d] and [nkv*d] (OLMo 2; the
    phased schedule of :mod:`tsp_core.attention_phased`).

    ``forward(x, position_ids)`` takes this rank's tokens [B, S/D, hidden] and their *global*
    positions [B, S/D] and returns this rank's output tokens. A model that computes its own rotary
    cos/sin passes ``position_embeddings=(cos, sin)`` instead.
    """

    def __init__(self, mesh: TSPMesh, hidden_size: int, num_heads: int,
                 num_kv_heads: int | None = None, head_dim: int | None = None, *,
                 qkv_bias: bool = False, o_bias: bool = False, rope_theta: float = 10000.0,
                 causal: bool = True, sliding_window: int | None = None,
                 scale: float | None = None, qk_norm_eps: float | None = None,
                 qk_norm_kind: str = "llama", softcap: float | None = None,
                 qk_norm_all_heads: bool = False, dtype: torch.dtype | None = None,
                 device: torch.device | str | None = None, init_seed: int | None = 0) -> None:
        super().__init__()
        num_kv_heads = num_kv_heads or num_heads
        if head_dim is None:
            if hidden_size % num_heads:
                raise ValueError(f"num_attention_heads ({num_heads}) must divide hidden_size "
                                 f"({hidden_size}) unless head_dim is given")
            head_dim = hidden_size // num_heads
        check_attention_shape(mesh.size, hidden_size, num_heads, num_kv_heads, head_dim)
        self.mesh = mesh
        self.spec = AttentionSpec(hidden_size, num_heads, num_kv_heads, head_dim, mesh.size,
                                  mesh.layout, causal, sliding_window, scale, qk_norm_eps,
                                  qk_norm_kind, softcap=softcap,
                                  qk_norm_all_heads=qk_norm_all_heads)
        self.register_buffer("inv_freq", rope.default_inv_freq(head_dim, rope_theta),
                             persistent=False)
        q, kv = num_heads * head_dim, num_kv_heads * head_dim
        self.full_shapes = {"q_proj.weight": (q, hidden_size), "k_proj.weight": (kv, hidden_size),
                            "v_proj.weight": (kv, hidden_size), "o_proj.weight": (hidden_size, q)}
        if qkv_bias:
            self.full_shapes.update({"q_proj.bias": (q,), "k_proj.bias": (kv,), "v_proj.bias": (kv,)})
        if o_bias:
            self.full_shapes["o_proj.bias"] = (hidden_size,)
        if qk_norm_eps is not None:
            widths = (q, kv) if qk_norm_all_heads else (head_dim, head_dim)
            self.full_shapes.update({n: (w,) for n, w in zip(self.NORMS, widths)})
        ones = self.NORMS if qk_norm_kind != "gemma" else ()  # gemma's: an offset from one
        full = init_full(self.full_shapes, init_seed, dtype, device, ones=ones)
        for n in self.NORMS if qk_norm_kind == "gemma" and qk_norm_eps is not None else ():
            full[n].zero_()
        self._create(full)

    def extra_repr(self) -> str:
        s = self.spec
        return (f"hidden_size={s.hidden_size}, heads={s.num_heads}/{s.num_kv_heads}, "
                f"head_dim={s.head_dim}, tsp_size={s.tsp_size}, sliding_window={s.sliding_window}")

    NORMS = ("q_norm.weight", "k_norm.weight")

    def shard_spec(self, name: str, rank: int) -> ShardSpec:
        s = self.spec
        if name == "o_proj.bias" or name in self.NORMS:
            return REPLICATED
        if name.startswith(("k_proj", "v_proj")) and s.kv_replicas > 1:
            return chunk_spec(s.num_kv_heads * s.head_dim, rank, s.tsp_size)  # see _Shards
        dim = 1 if name == "o_proj.weight" else 0
        return even_spec(self.full_shapes[name][dim], rank, s.tsp_size, dim)

    def _weight_names(self) -> list[str]:
        names = ["q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight"]
        return names + (["q_proj.bias", "k_proj.bias", "v_proj.bias"]
                        if "q_proj.bias" in self.full_shapes else [])

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor | None = None, *,
                position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
                docs: Sequence[Sequence[int]] | None = None,
                kv_sink: Callable[[torch.Tensor], None] | None = None) -> torch.Tensor:
        """``docs``: for packed rows, each row's document lengths (as ``shard_batch`` pads them:
        multiples of 2D); attention then stays inside each document. ``kv_sink`` (prefill for
        :mod:`tsp_core.decode`) is called once with ``kv_all`` [G, 2, B, local_kv_heads, S/D,
        head_dim], G = D / kv_replicas key/value head groups in order: the K/V (RoPE applied) of
        this rank's own tokens for every key/value head, all computed here, none received from
        another rank."""
        s = self.spec
        if x.dim() != 3 or x.shape[-1] != s.hidden_size:
            raise ValueError(f"input of shape {tuple(x.shape)} does not match the layer: expected "
                             f"[batch, local_seq, hidden_size={s.hidden_size}]")
        if x.shape[1] % (2 if s.layout == "zigzag" else 1):
            raise ValueError(f"local sequence length ({x.shape[1]}) must be even under the zigzag "
                             f"layout (2 chunks per rank); shard with tsp_core.shard_batch")
        if docs is not None:
            docs = tuple(tuple(int(n) for n in row) for row in docs)
            if len(docs) != x.shape[0] or any(sum(row) != x.shape[1] * s.tsp_size for row in docs):
                raise ValueError(f"docs {docs} do not describe {x.shape[0]} rows of "
                                 f"{x.shape[1] * s.tsp_size} tokens; pass shard_batch's tsp_docs")
        if position_embeddings is None:
            if position_ids is None:
                raise ValueError("pass the global position_ids of the local tokens (from "
                                 "tsp_core.shard_batch) or position_embeddings=(cos, sin)")
            if position_ids.dim() == 1:
                position_ids = position_ids.unsqueeze(0).expand(x.shape[0], -1)
            if tuple(position_ids.shape) != tuple(x.shape[:2]):
                raise ValueError(f"position_ids of shape {tuple(position_ids.shape)} do not match "
                                 f"the input's [batch, local_seq] = {tuple(x.shape[:2])}")
            position_embeddings = rope.cos_sin(position_ids, self.inv_freq, 1.0, x.dtype)
        norms = list(self.NORMS) if s.qk_norm_eps is not None else []
        x, weights, context = schedule_inputs(self, self._weight_names() + norms, x)
        if norms:  # replicated: every rank normalises its own tokens, gradients summed
            weights[-2:] = [comm.sum_grad(w, self.mesh.group) for w in weights[-2:]]
        cos, sin = (t.to(x.dtype) for t in position_embeddings)
        if s.qk_norm_all_heads:
            from .attention_phased import PhasedAttentionFn as fn  # imports this module
        else:
            fn = _TSPAttentionFn
        with context:
            y = fn.apply(x, cos, sin, s, self.mesh.group, docs, kv_sink, *weights)
        if "o_proj.bias" in self.full_shapes:
            y = y + local_replicated(self.o_proj.bias, self.mesh)
        return y
