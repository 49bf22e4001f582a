"""The round machinery both TSP attention schedules share (docs/design.md "Attention"): the
layer's :class:`AttentionSpec`, each owner's packed weight shard broadcast round by round, the
owner reduces of round gradients, the K/V all-gathers per key/value head group, and one round's
flash attention forward and backward over the gathered K/V of this rank's rows.

Nothing here keeps a tensor from another rank beyond its round: the schedules' autograd
functions decide what is saved (docs/design.md "Memory rules").
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from ...distributed import comm
from ...distributed.chunks import row_segments
from ...distributed.flat_pack import FlatPack
from .. import flash, rope
from ..dropout import AttentionDropout
from ..lora import LowRank
from ..nf4 import NF4Shard, pack_of
from ..norm import NORMS
from .parts import AttentionParts


@dataclass(frozen=True)
class AttentionSpec:
    """Static shape and parts of one TSP attention layer over ``tsp_size`` ranks: the resolved
    :class:`~.parts.AttentionShape` numbers and the layer's :class:`~.parts.AttentionParts`,
    which the schedules read."""

    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    tsp_size: int
    layout: str = "zigzag"
    parts: AttentionParts = field(default_factory=AttentionParts)
    # the LoRA adapters of this call (tsp_core.layers.lora): their tensors follow the weights
    lora: LowRank = field(default_factory=LowRank)

    @property
    def local_heads(self) -> int:
        return self.num_heads // self.tsp_size

    @property
    def local_kv_heads(self) -> int:
        return max(1, self.num_kv_heads // self.tsp_size)

    def q_rows(self, r: int) -> slice:
        """The query projection's output rows of round r's heads ([query | gate] with the gate)."""
        width = self.local_heads * self.head_dim * (2 if self.parts.output_gate else 1)
        return slice(r * width, (r + 1) * width)

    def kv_rows(self, j: int) -> slice:
        """The key (or value) projection's output rows of key/value head group j."""
        width = self.local_kv_heads * self.head_dim
        return slice(j * width, (j + 1) * width)

    def o_cols(self, r: int) -> slice:
        """The output projection's input columns of round r's heads."""
        width = self.local_heads * self.head_dim
        return slice(r * width, (r + 1) * width)

    @property
    def kv_replicas(self) -> int:
        """How many ranks hold a copy of the same key/value head (MQA-like: nkv < D)."""
        return max(1, self.tsp_size // self.num_kv_heads)

    @property
    def softmax_scale(self) -> float:
        scale = self.parts.scale
        return scale if scale is not None else self.head_dim ** -0.5


def split_heads(t: torch.Tensor, n: int) -> torch.Tensor:
    """[B, L, n*d] -> [B, n, L, d]"""
    B, L, _ = t.shape
    return t.view(B, L, n, -1).transpose(1, 2)


def join_heads(t: torch.Tensor) -> torch.Tensor:
    """[B, n, L, d] -> [B, L, n*d]"""
    B, n, L, d = t.shape
    return t.transpose(1, 2).reshape(B, L, n * d)


def split_gate(raw: torch.Tensor, spec: AttentionSpec, heads: int
               ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The query projection's output [..., heads * q_width] -> (queries [..., heads * d], the
    output gate [..., heads * d] or None without ``AttentionParts.output_gate``): with the gate
    each head's 2d rows are [query | gate], as Hugging Face's Qwen3.5 chunks them."""
    if not spec.parts.output_gate:
        return raw, None
    q, gate = raw.unflatten(-1, (heads, 2 * spec.head_dim)).chunk(2, dim=-1)
    return q.flatten(-2), gate.flatten(-2)


def join_gate(dq: torch.Tensor, dgate: torch.Tensor | None, spec: AttentionSpec,
              heads: int) -> torch.Tensor:
    """The backward of :func:`split_gate`: the gradients of the queries and of the gate
    [..., heads * d] -> the query projection output's [..., heads * 2d] (dq as is without a
    gate)."""
    if dgate is None:
        return dq
    d = spec.head_dim
    return torch.cat((dq.unflatten(-1, (heads, d)), dgate.unflatten(-1, (heads, d))),
                     dim=-1).flatten(-2)


def gated(out: torch.Tensor, gate: torch.Tensor | None) -> torch.Tensor:
    """The attention output [..., heads * d] times sigmoid(gate) (Qwen3.5's order, in the
    output's dtype); as is without a gate."""
    return out if gate is None else out * torch.sigmoid(gate)


def gated_backward(grad: torch.Tensor, out: torch.Tensor, gate: torch.Tensor | None
                   ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Gradients of :func:`gated` w.r.t. the attention output and the gate, from the gradient
    ``grad`` of its result; the gate is recomputed by the caller from this rank's tokens."""
    if gate is None:
        return grad, None
    s = torch.sigmoid(gate)
    return grad * s, grad * out * s * (1 - s)


class Rounds:
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


class OwnerReduces:
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
class RowGroup:
    """Rows of the batch that share one token layout (packed rows may differ)."""

    rows: slice | list[int]
    docs: tuple[int, ...] | None
    pieces: list
    positions: tuple[int, ...] = ()  # the local tokens' global positions in the row, in order


def row_groups(docs: tuple[tuple[int, ...], ...] | None, seq: int, rank: int,
                spec: AttentionSpec) -> list[RowGroup]:
    def group(rows: slice | list[int], d: tuple[int, ...] | None) -> RowGroup:
        segs = row_segments(d or (seq,), rank, spec.tsp_size, spec.layout)
        mask = spec.parts.mask
        pieces = flash.plan_pieces(segs, seq, mask.causal, mask.sliding_window, mask.chunk_size)
        positions = (tuple(i for a, b, _ in segs for i in range(a, b))
                     if spec.parts.query_scale is not None else ())
        return RowGroup(rows, d, pieces, positions)

    if docs is None:
        return [group(slice(None), None)]
    by_docs: dict[tuple[int, ...], list[int]] = {}
    for b, d in enumerate(docs):
        by_docs.setdefault(tuple(d), []).append(b)
    if len(by_docs) == 1:
        (d,) = by_docs
        return [group(slice(None), d)]
    return [group(rows, d) for d, rows in by_docs.items()]


def query_scale(spec: AttentionSpec, positions: torch.Tensor, like: torch.Tensor
                ) -> torch.Tensor | None:
    """The per-token query factors of ``positions`` (any shape) in ``like``'s dtype widened to
    float32 at least, on its device; None without a query scale (``AttentionParts.query_scale``)."""
    scale = spec.parts.query_scale
    if scale is None:
        return None
    wide = torch.promote_types(like.dtype, torch.float32)
    return scale(positions.to(like.device), wide).to(wide)


def scale_queries(q: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    """q [..., L, d] times ``scale`` [L] per token, in the scale's (wider) dtype, cast back, as
    Hugging Face's Llama 4 does; also the backward (the factor does not depend on q)."""
    if scale is None:
        return q
    return (q.to(scale.dtype) * scale[:, None]).to(q.dtype)


def _group_scale(g: RowGroup, spec: AttentionSpec, like: torch.Tensor) -> torch.Tensor | None:
    """Row group ``g``'s query factors [L] (None without a query scale)."""
    if spec.parts.query_scale is None:
        return None
    return query_scale(spec, torch.tensor(g.positions, dtype=torch.long), like)


class Shards:
    """This rank's attention weights, split into what each round broadcasts and where the round's
    key/value projection comes from.

    With at least as many key/value heads as ranks, a round's packed shard holds all four
    projections of that rank's heads. With fewer (nkv < D, MQA/GQA), each rank stores an even
    slice of the key/value rows instead of a copy of a whole head, so every weight exists once
    (gradient norms, checkpoints and optimizer state count it once); the slices are all-gathered
    once per pass, the rounds broadcast only the query and output projections, and the weight
    gradients of the slices are reduce-scattered back at the end.

    With sinks (``Mask.sinks``: the last of ``weights``), each round's pack ends with its owner's
    sinks (one logit per head of the group: :meth:`round_sinks`), and their gradient goes back to
    the owner with the round's other gradients (:meth:`round_grads`)."""

    def __init__(self, weights: Sequence[torch.Tensor], spec: AttentionSpec,
                 group: dist.ProcessGroup, split_out: bool = False) -> None:
        weights = list(weights)
        self.sinks = weights.pop() if spec.parts.mask.sinks else None
        if spec.parts.takes_kv:  # (wq, wo[, bq]): no K/V projection, as slices without any
            wq, wo, *bq = weights
            weights = [wq, wq[:0], wq[:0], wo] + ([bq[0], bq[0][:0], bq[0][:0]] if bq else [])
        wq, wk, wv, wo, *b = weights
        self.spec, self.group, self.bias = spec, group, bool(b)
        self.sliced = spec.kv_replicas > 1 or spec.parts.takes_kv
        self.round = [wq, wo, *b[:1]] if self.sliced else list(weights)
        # split_out: the output projection goes round by round on its own (phased.py)
        self.split_out = split_out
        if split_out:
            self.round = [w for w in self.round if w is not wo]
            self.out_pack = FlatPack([wo.shape])
        if self.sinks is not None:
            self.round.append(self.sinks)
        self.round_pack = pack_of(self.round)  # NF4 shards travel packed (..nf4)
        self.kv_rows = spec.num_kv_heads * spec.head_dim
        self.kv_full: list[torch.Tensor] = []
        if self.sliced and not spec.parts.takes_kv:
            kv = [wk, wv, *b[1:]]
            if any(isinstance(w, NF4Shard) for w in kv):
                raise NotImplementedError("NF4 key/value slices (fewer key/value heads than "
                                          "ranks) are not supported: docs/lora.md \"QLoRA\"")
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
        if self.sinks is not None:
            parts.pop()
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

    def round_sinks(self, buf: torch.Tensor) -> torch.Tensor:
        """The sinks [heads of the group] in round buffer ``buf`` (its owner's)."""
        return self.round_pack.unpack(buf)[-1]

    def round_grads(self, grads: list[torch.Tensor | None],
                    sinks_grad: torch.Tensor | None = None) -> list[torch.Tensor]:
        """Of round weight gradients (wq, wk, wv, wo, bq, bk, bv) and, with sinks, the round's
        sinks gradient, those the round's owner receives (in ``round_pack`` order)."""
        gq, gk, gv, go, bq, bk, bv = grads
        out = [] if self.split_out else [go]
        tail = [] if self.sinks is None else [sinks_grad]
        if self.sliced:
            return [gq, *out] + ([bq] if self.bias else []) + tail
        return [gq, gk, gv, *out] + ([bq, bk, bv] if self.bias else []) + tail

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
        tail = [] if self.sinks is None else [own.pop()]
        if self.split_out:
            own.insert(1 if self.sliced else 3, go)
        if not self.sliced:
            return own + tail
        if self.spec.parts.takes_kv:  # the weights it has: (wq, wo[, bq])
            return own + tail
        gk, gv, *gb = self.scatter_kv_grads(kv_grads)
        gq, go, *gbq = own
        return [gq, gk, gv, go] + ([gbq[0], gb[0], gb[1]] if self.bias else []) + tail

    def kv_grad_buffers(self) -> list[torch.Tensor]:
        """Zeroed padded full-row accumulators for the key/value weight gradients (sliced)."""
        if self.spec.parts.takes_kv:
            return []
        D = self.spec.tsp_size
        return [t.new_zeros(D * s[0], *s[1:]) for t, s in zip(self.kv_full, self.kv_pack.shapes)]

    def scatter_kv_grads(self, full: list[torch.Tensor]) -> list[torch.Tensor]:
        """Sum every rank's key/value gradient rows and keep this rank's slice."""
        D = self.spec.tsp_size
        send = torch.cat([t.reshape(D, -1) for t in full], dim=1)
        out = send.new_empty(self.kv_pack.numel)
        comm.reduce_scatter(out, send, self.group)
        return self.kv_pack.unpack(out)


def split_norms(weights: Sequence[torch.Tensor], spec: AttentionSpec):
    """(projection weights, (q_norm weight, k_norm weight) or (None, None)); a KV-shared layer
    has no k_norm (None)."""
    if spec.parts.qk_norm is None:
        return list(weights), (None, None)
    if spec.parts.takes_kv:
        return list(weights[:-1]), (weights[-1], None)
    return list(weights[:-2]), tuple(weights[-2:])


def _head_norm(t: torch.Tensor, weight: torch.Tensor | None, spec: AttentionSpec) -> torch.Tensor:
    norm = spec.parts.qk_norm
    return t if weight is None else NORMS[norm.kind](t, weight, norm.eps)


def _after_rope(spec: AttentionSpec) -> bool:
    """Whether the per-head q/k norm comes after RoPE (``QKNorm.after_rope``)."""
    return spec.parts.qk_norm is not None and spec.parts.qk_norm.after_rope


def rotated(t: torch.Tensor, weight: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
             spec: AttentionSpec) -> torch.Tensor:
    """q or k heads [B, heads, L, d], per-head normed (``weight`` None: not) and rotated, in the
    family's order: the norm before RoPE, or after it (``QKNorm.after_rope``)."""
    pairs = spec.parts.rotary.interleaved
    if _after_rope(spec):
        return _head_norm(rope.apply(t, cos, sin, pairs), weight, spec)
    return rope.apply(_head_norm(t, weight, spec), cos, sin, pairs)


def rotated_backward(pre: torch.Tensor | None, weight: torch.Tensor | None, cos: torch.Tensor,
                      sin: torch.Tensor, spec: AttentionSpec,
                      grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Gradients of :func:`rotated` w.r.t. its input ``pre`` (recomputed by the caller, only
    when there is a norm) and the norm weight (None without one)."""
    pairs = spec.parts.rotary.interleaved
    if weight is None:
        return rope.apply_backward(grad, cos, sin, pairs), None
    if _after_rope(spec):
        grad, g = _head_norm_backward(rope.apply(pre, cos, sin, pairs), weight, spec, grad)
        return rope.apply_backward(grad, cos, sin, pairs), g
    grad = rope.apply_backward(grad, cos, sin, pairs)
    return _head_norm_backward(pre, weight, spec, grad)


def _head_norm_backward(pre: torch.Tensor, weight: torch.Tensor, spec: AttentionSpec,
                        grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Gradients of the per-head norm w.r.t. its input ``pre`` (recomputed, not saved:
    docs/design.md "Memory rules") and its weight, by autograd over the forward's own ops."""
    with torch.enable_grad():
        pre = pre.detach().requires_grad_()
        weight = weight.detach().requires_grad_()
        # a norm without a weight (Llama 4's L2 norm: an empty placeholder) gets zeros
        return torch.autograd.grad(_head_norm(pre, weight, spec), (pre, weight), grad,
                                   allow_unused=True, materialize_grads=True)


class KVGathers:
    """The whole-sequence K/V of each key/value head j (one tensor per row group), gathered from
    every rank's own tokens, and in the backward their gradients sent back to the token owners.

    ``start(j)`` issues head j's all-gathers without waiting, so that they run while the previous
    head's attention computes (on CUDA the NCCL stream does the transfer); ``get(j)`` waits and
    puts the tokens in order; ``drop(j)`` after the head's last round frees them. Backward:
    ``scatter(j, accs)`` casts head j's float32 dK/dV accumulators once, frees them and starts
    their reduce-scatters;
    ``halfway(j)``, called when half of a round of head j has computed, waits for the previous
    head's reduce-scatter and only then starts head j+1's gather; ``scattered(j)`` returns head
    j's dK/dV of this rank's own tokens. So besides the K/V in use (and in the backward its
    accumulator) at most one more head's whole-sequence buffer exists at a time: the next head's
    K/V arriving, or the previous head's dK/dV leaving (docs/memory.md "The attention backward's
    floor")."""

    def __init__(self, kv_all: torch.Tensor, groups: list[RowGroup], spec: AttentionSpec,
                 group: dist.ProcessGroup) -> None:
        self.kv_all, self.groups, self.spec, self.group = kv_all, groups, spec, group
        self._pending: dict[int, list[comm.PendingSequence]] = {}
        self._ready: dict[int, list[torch.Tensor]] = {}
        self._scatters: dict[int, list[tuple[slice | list[int], comm.PendingSequence]]] = {}
        self._scattered: dict[int, torch.Tensor] = {}

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

    def scatter(self, j: int, accs: dict[int, torch.Tensor]) -> None:
        """Start head j's reduce-scatters, one per row group i from ``accs.pop(i)``."""
        self._scatters[j] = [
            (g.rows, comm.start_reduce_scatter_sequence(accs.pop(i).to(self.kv_all.dtype),
                                                        self.group, 3, self.spec.layout, g.docs))
            for i, g in enumerate(self.groups)]

    def halfway(self, j: int) -> None:
        for i in list(self._scatters):
            self._retire(i)
        self.start(j + 1)

    def scattered(self, j: int) -> torch.Tensor:
        if j in self._scatters:
            self._retire(j)
        return self._scattered.pop(j)

    def _retire(self, j: int) -> None:
        parts = self._scatters.pop(j)
        self._scattered[j] = by_rows([(rows, p.wait()) for rows, p in parts], self.kv_all[j])


def _check_round_sinks(spec: AttentionSpec, sinks: torch.Tensor | None) -> None:
    if spec.parts.mask.sinks and sinks is None:
        raise RuntimeError("this layer has attention sinks but its schedule passed none to the "
                           "round's attention: TSPAttention runs sinks on the phased schedule")


def _call_dropout(dropout: AttentionDropout | None, r: int, i: int
                  ) -> AttentionDropout | None:
    """The attention dropout of round ``r``'s row group ``i``: a mask of its own per call."""
    return None if dropout is None else dropout.at(r, i)


def attend_round(r: int, q_all: torch.Tensor, out_all: torch.Tensor, lse_all: torch.Tensor,
            kvs: KVGathers, sinks: torch.Tensor | None = None,
            dropout: AttentionDropout | None = None) -> None:
    """Round ``r``'s attention: the local queries of head group r against the whole sequence's
    K/V of its key/value head j (from ``kvs``, dropped after j's last round); writes
    ``out_all[r]`` and ``lse_all[r]`` (with ``sinks``, the group's sink logits, both include the
    sink: flash.add_sinks). ``dropout``: the layer call's attention dropout (flash.py)."""
    spec = kvs.spec
    _check_round_sinks(spec, sinks)
    R = spec.kv_replicas
    j = r // R
    for i, (g, kv) in enumerate(zip(kvs.groups, kvs.get(j))):
        q = scale_queries(q_all[r][g.rows], _group_scale(g, spec, q_all))
        o, lse = flash.attention_forward(q, kv[0], kv[1], g.pieces,
                                         spec.softmax_scale, softcap=spec.parts.mask.softcap,
                                         sinks=sinks, dropout=_call_dropout(dropout, r, i))
        out_all[r][g.rows], lse_all[r][g.rows] = o, lse
    if r % R == R - 1:
        kvs.drop(j)


def attend_round_backward(r: int, do: torch.Tensor, q_all: torch.Tensor, out_all: torch.Tensor,
                     lse_all: torch.Tensor, kvs: KVGathers, dkv_sum: dict[int, torch.Tensor],
                     dropout: AttentionDropout | None = None) -> torch.Tensor:
    """Backward of :func:`attend_round` for round ``r`` given its output gradient ``do``: returns dQ
    of the round (before RoPE's backward). The dK/dV of key/value head j are summed in float32
    over j's rounds and pieces (``dkv_sum``, one accumulator per row group); halfway through the
    round the previous head's reduce-scatter is waited for and the next head's gather started
    (:meth:`KVGathers.halfway`); after j's last round its K/V are dropped and its dK/dV sent to
    the token owners (``kvs.scattered(j)`` returns them, for the caller's key/value projection
    backward one round later). With sinks, ``out_all``/``lse_all`` already include them (the
    pieces' backward needs nothing more); their own gradient is flash.sink_backward's."""
    spec = kvs.spec
    R = spec.kv_replicas
    j, first, last = r // R, r % R == 0, r % R == R - 1
    dq_parts = []
    for i, (g, kv) in enumerate(zip(kvs.groups, kvs.get(j))):
        scale = _group_scale(g, spec, q_all)  # the queries attended scaled: so is their grad
        dq_g, dkv_sum[i] = flash.attention_backward(
            do[g.rows], scale_queries(q_all[r][g.rows], scale), kv, out_all[r][g.rows],
            lse_all[r][g.rows], g.pieces, spec.softmax_scale, softcap=spec.parts.mask.softcap,
            dkv=None if first else dkv_sum[i],
            halfway=(lambda: kvs.halfway(j)) if i == 0 else None,
            dropout=_call_dropout(dropout, r, i))
        dq_parts.append((g.rows, scale_queries(dq_g, scale)))
    del kv  # the loop's last K/V: dropped below after j's last round
    dq = by_rows(dq_parts, q_all[r])
    if last:
        kvs.drop(j)  # the full-sequence K/V and dK/dV of one head never coexist with the next's
        kvs.scatter(j, dkv_sum)
    return dq


def by_rows(parts: list[tuple[slice | list[int], torch.Tensor]], like: torch.Tensor
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
