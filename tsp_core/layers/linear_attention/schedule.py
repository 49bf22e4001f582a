"""The TSP schedule of a Gated DeltaNet layer (docs/design.md "Gated DeltaNet"): rank r's head
group is broadcast in round r; every rank projects its own tokens, convolves them with a halo of
the preceding tokens, computes each of its chunks' map ``S -> A S + B``; one all-gather of the
round's maps, a prefix scan in sequence order gives each own chunk its incoming state; the chunk's
outputs, the gated norm and the output projection's columns are added locally (no all-reduce).

Before the rounds, one all-gather of every chunk's last ``kernel - 1`` input tokens (a chunk
shorter than that gives all its tokens) serves every round's halo: the halo is projected with the
round's weights like the own tokens.

Backward (one ``torch.autograd.Function``, docs/design.md "Memory rules"): only the input, this
rank's own weight shard and the norm weight are saved. The halo tails are gathered again, each
round's weights broadcast again, the round's local computation rerun under autograd and its maps
gathered again; the gradient of this rank's outputs with respect to every chunk's map (the scan
in reverse) is reduce-scattered to the maps' owners, which carry it into their projections; the
round's weight gradients are reduced to their owner and the halo gradients, after the last round,
reduce-scattered back to the tails' owners.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ...distributed import comm
from ...distributed.chunks import check_seq_len, num_chunks, rank_chunks
from ...distributed.flat_pack import FlatPack
from ..attention.rounds import OwnerReduces, Rounds
from .delta_rule import apply_map, chunk_map, chunk_rule, compute_dtype, gated_norm, l2norm


@dataclass(frozen=True)
class DeltaNetSpec:
    """Static shape of one Gated DeltaNet layer under TSP."""

    hidden_size: int
    num_k_heads: int
    num_v_heads: int
    head_k_dim: int
    head_v_dim: int
    conv_kernel: int
    tsp_size: int
    layout: str = "zigzag"
    eps: float = 1e-6

    @property
    def local_k_heads(self) -> int:
        return self.num_k_heads // self.tsp_size

    @property
    def local_v_heads(self) -> int:
        return self.num_v_heads // self.tsp_size

    @property
    def halo(self) -> int:
        return self.conv_kernel - 1

    def round_shapes(self) -> list[tuple[int, ...]]:
        """One round's weights, in :class:`FlatPack` order: in_proj q, k, v, z, b, a rows, the
        conv1d q, k, v channels [c, 1, kernel], A_log, dt_bias, out_proj columns."""
        h, K = self.hidden_size, self.conv_kernel
        qk, v, n = self.local_k_heads * self.head_k_dim, self.local_v_heads * self.head_v_dim, \
            self.local_v_heads
        return [(qk, h), (qk, h), (v, h), (v, h), (n, h), (n, h), (qk, 1, K), (qk, 1, K),
                (v, 1, K), (n,), (n,), (h, v)]


@dataclass(frozen=True)
class _Unit:
    """One chunk of this rank's tokens: rows ``rows`` of the batch, local tokens
    [start, start + length), chunk ``local`` (0 or 1) of this rank in sequence ``seq`` (a
    document of a group of rows sharing their documents)."""

    rows: tuple[int, ...]
    start: int
    length: int
    seq: int
    local: int


def chunk_units(docs, batch: int, local_len: int, spec: DeltaNetSpec) -> tuple[list[_Unit], int]:
    """The chunks of this rank's tokens, the same list on every rank (only the chunk index each
    ``local`` stands for differs), and the number of sequences. Rows with the same documents
    share their units; an unpacked batch is one document per row."""
    D = spec.tsp_size
    rows_docs = docs or [(local_len * D,)] * batch
    groups: dict[tuple[int, ...], list[int]] = {}
    for b, row in enumerate(rows_docs):
        groups.setdefault(tuple(row), []).append(b)
    units, seq = [], 0
    per_rank = len(rank_chunks(0, D, spec.layout))
    for row, members in groups.items():
        start = 0
        for n in row:
            c = check_seq_len(n, D, spec.layout)
            for i in range(per_rank):
                units.append(_Unit(tuple(members), start, c, seq, i))
                start += c
            seq += 1
    return units, seq


class ChunkLayout:
    """Where each chunk of each sequence is: its owner and local index, and the offsets of each
    unit's piece in the flat buffers that the maps and tails all-gathers move."""

    def __init__(self, units: list[_Unit], spec: DeltaNetSpec, me: int) -> None:
        D = spec.tsp_size
        self.units, self.spec, self.me = units, spec, me
        self.n_chunks = num_chunks(D, spec.layout)
        self.owner = {}
        for q in range(D):
            for i, j in enumerate(rank_chunks(q, D, spec.layout)):
                self.owner[j] = (q, i)
        self.index = {(u.seq, u.local): k for k, u in enumerate(units)}
        self.tail = [min(u.length, spec.halo) for u in units]
        self.map_shape = [(len(u.rows), spec.local_v_heads, spec.head_k_dim,
                           spec.head_k_dim + spec.head_v_dim) for u in units]

    def chunk(self, u: _Unit, rank: int | None = None) -> int:
        return rank_chunks(self.me if rank is None else rank, self.spec.tsp_size,
                           self.spec.layout)[u.local]

    def source(self, seq: int, j: int) -> tuple[int, int]:
        """(owner rank, unit index) of chunk ``j`` of sequence ``seq``."""
        q, i = self.owner[j]
        return q, self.index[(seq, i)]


def _tails(x: torch.Tensor, lay: ChunkLayout) -> torch.Tensor:
    """This rank's chunks' last ``kernel - 1`` tokens (all of a shorter chunk), flat."""
    parts = [x[list(u.rows), u.start + u.length - t:u.start + u.length].reshape(-1)
             for u, t in zip(lay.units, lay.tail)]
    return torch.cat(parts) if parts else x.new_zeros(0)


def _split_flat(flat: torch.Tensor, sizes: list[int]) -> list[torch.Tensor]:
    return list(flat.split(sizes))


def _halos(tails_all: torch.Tensor, lay: ChunkLayout, h: int) -> list[torch.Tensor]:
    """Each own chunk's halo [rows, kernel - 1, h]: the preceding tokens of its sequence, from
    as many preceding chunks as it takes, zeros before the sequence's start (the convolution's
    causal padding)."""
    K1 = lay.spec.halo
    sizes = [len(u.rows) * t * h for u, t in zip(lay.units, lay.tail)]
    per_rank = [_split_flat(tails_all[q], sizes) for q in range(tails_all.shape[0])]
    out = []
    for u in lay.units:
        pieces, need, j = [], K1, lay.chunk(u) - 1
        while need > 0 and j >= 0:
            q, k = lay.source(u.seq, j)
            t = per_rank[q][k].view(len(u.rows), lay.tail[k], h)
            take = min(need, t.shape[1])
            pieces.insert(0, t[:, t.shape[1] - take:])
            need, j = need - take, j - 1
        if need > 0:
            pieces.insert(0, tails_all.new_zeros(len(u.rows), need, h))
        out.append(torch.cat(pieces, dim=1))
    return out


def _gather_tails(x: torch.Tensor, lay: ChunkLayout, group) -> torch.Tensor:
    own = _tails(x, lay).contiguous()
    out = own.new_empty(lay.spec.tsp_size, own.numel())
    if own.numel():
        comm.all_gather(out, own, group)
    return out


@dataclass
class _Prepared:
    """One unit's inputs to the delta rule in the compute dtype ([rows, heads, T, d]) and its
    output gate z [rows, T, heads, d_v]."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    g: torch.Tensor
    beta: torch.Tensor
    z: torch.Tensor


def _prepare(x: torch.Tensor, halo: torch.Tensor, u: _Unit, w: list[torch.Tensor],
             spec: DeltaNetSpec, valid: torch.Tensor | None = None) -> _Prepared:
    """Projections, causal convolution over halo + own tokens, SiLU, the decay and beta, the
    key heads repeated to the value heads, q and k L2-normalised and q scaled: Hugging Face's
    ``Qwen3_5GatedDeltaNet.forward`` up to the delta rule, for one head group. ``valid``
    [rows, T] (prefill): tokens past a row's prompt get beta 0 and decay 1, so they leave the
    state as the prompt's last token left it."""
    wq, wk, wv, wz, wb, wa, cq, ck, cv, a_log, dt_bias, _ = w
    xu = x[list(u.rows), u.start:u.start + u.length]
    xs = torch.cat([halo.to(xu.dtype), xu], dim=1)
    mixed = F.linear(xs, torch.cat([wq, wk, wv])).transpose(1, 2)
    conv = torch.cat([cq, ck, cv])
    mixed = F.silu(F.conv1d(mixed, conv, groups=conv.shape[0])).transpose(1, 2)
    R, T = xu.shape[:2]
    nk, nv, dk, dv = spec.local_k_heads, spec.local_v_heads, spec.head_k_dim, spec.head_v_dim
    q, k, v = mixed.split([nk * dk, nk * dk, nv * dv], dim=-1)
    cd = compute_dtype(x.dtype)
    beta = torch.sigmoid(F.linear(xu, wb))
    g = -a_log.to(cd).exp() * Softplus.apply(F.linear(xu, wa).to(cd) + dt_bias)
    if valid is not None:
        beta, g = beta * valid[..., None].to(beta.dtype), g * valid[..., None].to(g.dtype)
    rep = nv // nk
    q, k = (t.reshape(R, T, nk, dk).repeat_interleave(rep, dim=2) for t in (q, k))
    q, k, v, g, beta = (t.transpose(1, 2).to(cd) for t in (q, k, v.reshape(R, T, nv, dv), g, beta))
    q, k = l2norm(q), l2norm(k)
    z = F.linear(xu, wz).reshape(R, T, nv, dv)
    return _Prepared(q * dk ** -0.5, k, v, g, beta, z)


class Softplus(torch.autograd.Function):
    """``F.softplus`` (its numbers, forward and backward) whose backward takes the gradient
    contiguous. The gradient arrives transposed (from the decay's transpose in
    :func:`_prepare`); on that and a contiguous input, a compiled graph's fake
    ``softplus_backward`` takes the input's layout and the CPU kernel the gradient's, so the
    compiled backward's view of the result failed at run time (Gated DeltaNet under
    ``parallelize(..., compile=...)``)."""

    @staticmethod
    def forward(ctx, u: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(u)
        return F.softplus(u)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        u, = ctx.saved_tensors
        return torch.ops.aten.softplus_backward(grad.contiguous(), u.contiguous(), 1, 20)


def _output(p: _Prepared, state: torch.Tensor, w: list[torch.Tensor], norm_w: torch.Tensor,
            spec: DeltaNetSpec, dtype: torch.dtype) -> torch.Tensor:
    """One unit's contribution [rows, T, h]: the delta rule from ``state``, the gated norm, the
    round's out_proj columns."""
    out, _ = chunk_rule(p.q, p.k, p.v, p.g, p.beta, state)
    out = out.transpose(1, 2).to(dtype)
    out = gated_norm(out, p.z, norm_w, spec.eps)
    return F.linear(out.flatten(2), w[-1])


def _incoming(maps_all: torch.Tensor, lay: ChunkLayout) -> list[torch.Tensor]:
    """Each own chunk's incoming state: the maps of its sequence's earlier chunks composed in
    sequence order from a zero state (a prefix scan over the gathered maps)."""
    spec = lay.spec
    sizes = [torch.Size(s).numel() for s in lay.map_shape]
    per_rank = [_split_flat(maps_all[q], sizes) for q in range(maps_all.shape[0])]
    wanted: dict[int, dict[int, int]] = {}
    for k, u in enumerate(lay.units):
        wanted.setdefault(u.seq, {})[lay.chunk(u)] = k
    out: list[torch.Tensor | None] = [None] * len(lay.units)
    for seq, own in wanted.items():
        state = None
        for j in range(max(own) + 1):
            if j in own:
                shape = lay.map_shape[own[j]]
                out[own[j]] = (maps_all.new_zeros(*shape[:3], spec.head_v_dim) if state is None
                               else state)
            q, k = lay.source(seq, j)
            m = per_rank[q][k].view(lay.map_shape[k])
            state = m[..., spec.head_k_dim:] if state is None else apply_map(m, state)
    return out


def _final(maps_all: torch.Tensor, lay: ChunkLayout) -> torch.Tensor:
    """The state after the last chunk of sequence 0 (prefill: one sequence of every row)."""
    sizes = [torch.Size(s).numel() for s in lay.map_shape]
    per_rank = [_split_flat(maps_all[q], sizes) for q in range(maps_all.shape[0])]
    state = None
    for j in range(lay.n_chunks):
        q, k = lay.source(0, j)
        m = per_rank[q][k].view(lay.map_shape[k])
        state = m[..., lay.spec.head_k_dim:] if state is None else apply_map(m, state)
    return state


def _valid(u: _Unit, lay: ChunkLayout, lengths: torch.Tensor | None) -> torch.Tensor | None:
    """Which of a unit's tokens lie inside their row's prompt (prefill), None: all."""
    if lengths is None:
        return None
    pos = lay.chunk(u) * u.length + torch.arange(u.length, device=lengths.device)
    return pos[None] < lengths[list(u.rows)][:, None]


def _round(x, tails_all, w, norm_w, lay: ChunkLayout, group, spec: DeltaNetSpec, lengths=None):
    """One round's local work up to the maps: (prepared units, own maps flat, gathered maps)."""
    h = spec.hidden_size
    halos = _halos(tails_all, lay, h)
    preps = [_prepare(x, halo, u, w, spec, _valid(u, lay, lengths))
             for u, halo in zip(lay.units, halos)]
    own = torch.cat([chunk_map(p.q, p.k, p.v, p.g, p.beta).reshape(-1) for p in preps])
    gathered = own.new_empty(spec.tsp_size, own.numel())
    comm.all_gather(gathered, own.detach().contiguous(), group)
    return preps, own, gathered


def run_forward(x, norm_w, spec: DeltaNetSpec, group, docs, weights, lengths=None):
    """The forward schedule: (output, None), or with ``lengths`` [B] (prefill: each row's prompt
    length; unpacked rows) (output, the state after each row's prompt of this rank's own head
    group [B, nv/D, d_k, d_v], composed from the gathered maps of its own round)."""
    me = dist.get_rank(group)
    lay = ChunkLayout(chunk_units(docs, x.shape[0], x.shape[1], spec)[0], spec, me)
    pack = FlatPack(spec.round_shapes())
    tails_all = _gather_tails(x, lay, group)
    y, final = torch.zeros_like(x), None
    for r, buf in Rounds(pack.pack(weights), group):
        w = pack.unpack(buf)
        preps, _own, gathered = _round(x, tails_all, w, norm_w, lay, group, spec, lengths)
        for u, p, s in zip(lay.units, preps, _incoming(gathered, lay)):
            y[list(u.rows), u.start:u.start + u.length] += _output(p, s, w, norm_w, spec,
                                                                   x.dtype)
        if lengths is not None and r == me:
            final = _final(gathered, lay)
    return y, final


class GatedDeltaNetFn(torch.autograd.Function):
    """The schedule above; ``weights`` are this rank's shards in :meth:`DeltaNetSpec.round_shapes`
    order, ``norm_w`` the replicated gated-norm weight (its gradient summed by the caller)."""

    @staticmethod
    def forward(ctx, x, norm_w, spec: DeltaNetSpec, group, docs, *weights):
        y, _ = run_forward(x, norm_w, spec, group, docs, weights)
        ctx.save_for_backward(x, norm_w, *weights)
        ctx.spec, ctx.group, ctx.docs = spec, group, docs
        return y

    @staticmethod
    def backward(ctx, dy):
        x, norm_w, *weights = ctx.saved_tensors
        spec, group = ctx.spec, ctx.group
        lay = ChunkLayout(chunk_units(ctx.docs, x.shape[0], x.shape[1], spec)[0], spec,
                      dist.get_rank(group))
        pack = FlatPack(spec.round_shapes())
        x_leaf = x.detach().requires_grad_()
        norm_leaf = norm_w.detach().requires_grad_()
        tails_leaf = _gather_tails(x, lay, group).requires_grad_()
        dx, d_norm, d_tails = torch.zeros_like(x), torch.zeros_like(norm_w), \
            torch.zeros_like(tails_leaf)
        reduces = OwnerReduces(group)
        for r, buf in Rounds(pack.pack(weights), group):
            w_leaf = buf.detach().requires_grad_()
            with torch.enable_grad():
                w = pack.unpack(w_leaf)
                preps, own, gathered = _round(x_leaf, tails_leaf, w, norm_leaf, lay, group, spec)
                maps_leaf = gathered.requires_grad_()
                total = sum((_output(p, s, w, norm_leaf, spec, x.dtype)
                             * dy[list(u.rows), u.start:u.start + u.length]).sum()
                            for u, p, s in zip(lay.units, preps, _incoming(maps_leaf, lay)))
                d_maps, = torch.autograd.grad(total, maps_leaf, retain_graph=True,
                                              allow_unused=True)
            d_own = torch.empty_like(own)
            comm.reduce_scatter(d_own, (d_maps if d_maps is not None
                                        else torch.zeros_like(gathered)).contiguous(), group)
            leaves = [x_leaf, w_leaf, tails_leaf, norm_leaf]
            grads = torch.autograd.grad([total, own], leaves, [torch.ones_like(total), d_own],
                                        allow_unused=True)
            for acc, g in ((dx, grads[0]), (d_tails, grads[2]), (d_norm, grads[3])):
                if g is not None:
                    acc += g
            reduces.send(r, grads[1] if grads[1] is not None else torch.zeros_like(buf))
        mine = reduces.finish()
        if d_tails.numel():
            own_tails = d_tails.new_empty(d_tails.shape[1])
            comm.reduce_scatter(own_tails, d_tails.contiguous(), group)
            offset = 0
            for u, t in zip(lay.units, lay.tail):
                n = len(u.rows) * t * x.shape[2]
                dx[list(u.rows), u.start + u.length - t:u.start + u.length] += \
                    own_tails[offset:offset + n].view(len(u.rows), t, x.shape[2])
                offset += n
        return (dx, d_norm, None, None, None, *pack.unpack(mine))
