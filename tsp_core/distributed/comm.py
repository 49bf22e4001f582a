"""Every collective TSP issues, with call and byte counters.

Bytes are the per-rank traffic of the standard ring algorithms (what NCCL calls bus bytes), one
rule for every kind so that layouts can be compared: broadcast, reduce, all-gather (of the output)
and reduce-scatter (of the input) move (D-1)/D of the buffer per rank, all-to-all the larger of
what the rank sends to and receives from the others ((D-1)/D of the buffer when the splits are
even), all-reduce 2(D-1)/D, a ring hop the whole buffer. A group of one rank issues nothing and
counts nothing. ``wait_seconds`` is the host time spent blocked in collectives: inside a synchronous
call, or in ``wait()`` of an async one (on CUDA, NCCL returns before the transfer ends, so there it
is the host's wait, not the GPU stream's).

While ``torch.compile`` traces, each raw collective becomes an ordered op of :mod:`.traced`
whose body is this module's own eager collective: a compiled layer counts, guards and orders its
collectives as eager does.

Raw functions (``broadcast``, ``reduce``, ...) are used inside the schedules' own autograd
Functions; the autograd-aware ones (``owner_broadcast``, ``gather_sequence``, ``ring_shift``,
``all_to_all``, ``sum_grad``) are for code that lets autograd run the backward.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from . import guard, traced
from .chunks import local_segments
from .torch_features import one_buffer_collective


@dataclass(eq=False)  # trackers are told apart by identity
class CommStats:
    """Calls and per-rank bytes by kind, seconds blocked in collectives, and (``keep_log``) the
    ordered log of (kind, bytes)."""

    calls: Counter = field(default_factory=Counter)
    bytes: Counter = field(default_factory=Counter)
    log: list[tuple[str, float]] = field(default_factory=list)
    wait_seconds: float = 0.0
    keep_log: bool = True

    def record(self, kind: str, nbytes: float) -> None:
        self.calls[kind] += 1
        self.bytes[kind] += nbytes
        if self.keep_log:
            self.log.append((kind, nbytes))

    @property
    def total_bytes(self) -> float:
        return float(sum(self.bytes.values()))


# the process-wide counters keep no log: a long run would keep one entry per collective forever
_TRACKERS: list[CommStats] = [CommStats(keep_log=False)]


def global_stats() -> CommStats:
    """Counters since the process started (or the last :func:`reset_global_stats`); no log."""
    return _TRACKERS[0]


def reset_global_stats() -> None:
    _TRACKERS[0] = CommStats(keep_log=False)


@contextlib.contextmanager
def track() -> Iterator[CommStats]:
    """Count the collectives issued inside the ``with`` block."""
    stats = CommStats()
    _TRACKERS.append(stats)
    try:
        yield stats
    finally:
        _TRACKERS.remove(stats)


def _record(kind: str, nbytes: float) -> None:
    for t in _TRACKERS:
        t.record(kind, nbytes)


@contextlib.contextmanager
def _blocked() -> Iterator[None]:
    """Add the time spent inside the block to every tracker's ``wait_seconds``."""
    start = time.perf_counter()
    try:
        yield
    finally:
        waited = time.perf_counter() - start
        for t in _TRACKERS:
            t.wait_seconds += waited


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class Handle:
    """Result of an async call: ``wait()`` blocks until every underlying request finished (a
    backend error names the collective: :mod:`tsp_core.guard`)."""

    def __init__(self, works: Sequence[object] = (), call: guard.Call | None = None) -> None:
        self._works = [w for w in works if w is not None]
        self._call = call

    def wait(self) -> None:
        if not self._works:
            return
        try:
            with _blocked():
                for w in self._works:
                    w.wait()
        except RuntimeError as e:
            if self._call is None:
                raise
            guard.failed(self._call, e)
        self._works = []


def _run(kind: str, nbytes: float, call, async_op: bool,
         group: dist.ProcessGroup | None = None) -> Handle | None:
    _record(kind, nbytes)
    checked = guard.before(kind, group, nbytes)
    try:
        if async_op:
            work = call(async_op)
        else:
            with _blocked():
                work = call(async_op)
    except RuntimeError as e:
        guard.failed(checked, e)
    if async_op:
        return Handle([work], checked)
    return None


def _done(async_op: bool) -> Handle | None:
    return Handle() if async_op else None


def count_point_to_point(ops: list) -> list:
    """Count ``torch.distributed.P2POp`` sends and receives that another library issues (torch's
    pipeline schedules batch them themselves: :mod:`tsp_core.pipeline`'s stages pass theirs
    through here), kinds "send" and "recv", the whole buffer each (one hop); returns ``ops``."""
    for op in ops:
        _record("send" if op.op is dist.isend else "recv", _nbytes(op.tensor))
    return ops


# ---------------------------------------------------------------- raw, counted collectives

def broadcast(t: torch.Tensor, src: int, group: dist.ProcessGroup, async_op: bool = False):
    """In-place broadcast from group rank ``src``."""
    d = dist.get_world_size(group)
    if d == 1:
        return _done(async_op)
    if traced.tracing():
        return traced.broadcast(t, src, group, async_op)
    return _run("broadcast", _nbytes(t) * (d - 1) / d,
                lambda a: dist.broadcast(t, group=group, group_src=src, async_op=a),
                async_op, group)


def reduce(t: torch.Tensor, dst: int, group: dist.ProcessGroup, async_op: bool = False):
    """In-place sum onto group rank ``dst`` (other ranks' buffers are undefined afterwards)."""
    d = dist.get_world_size(group)
    if d == 1:
        return _done(async_op)
    if traced.tracing():
        return traced.reduce(t, dst, group, async_op)
    return _run("reduce", _nbytes(t) * (d - 1) / d,
                lambda a: dist.reduce(t, group=group, group_dst=dst, async_op=a), async_op, group)


def all_reduce(t: torch.Tensor, group: dist.ProcessGroup, async_op: bool = False,
               op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM):
    """In-place sum (or ``op``) over the group."""
    d = dist.get_world_size(group)
    if d == 1:
        return _done(async_op)
    if traced.tracing():
        return traced.all_reduce(t, op.name, group, async_op)
    return _run("all_reduce", 2 * _nbytes(t) * (d - 1) / d,
                lambda a: dist.all_reduce(t, op=op, group=group, async_op=a), async_op, group)


def all_gather(out: torch.Tensor, inp: torch.Tensor, group: dist.ProcessGroup,
               async_op: bool = False):
    """``out`` (D times ``inp``'s size, contiguous) receives every rank's ``inp`` in rank order."""
    d = dist.get_world_size(group)
    if d == 1:
        out.copy_(inp.reshape(out.shape))
        return _done(async_op)
    if traced.tracing():
        return traced.all_gather(out, inp, group, async_op)
    return _run("all_gather", _nbytes(out) * (d - 1) / d,
                lambda a: one_buffer_collective("all_gather_single", "all_gather_into_tensor")(
                    out.view(-1), inp.reshape(-1), group=group, async_op=a), async_op, group)


def reduce_scatter(out: torch.Tensor, inp: torch.Tensor, group: dist.ProcessGroup,
                   async_op: bool = False):
    """``out`` receives this rank's 1/D block of the sum of every rank's ``inp``."""
    d = dist.get_world_size(group)
    if d == 1:
        out.copy_(inp.reshape(out.shape))
        return _done(async_op)
    if traced.tracing():
        return traced.reduce_scatter(out, inp, group, async_op)
    return _run("reduce_scatter", _nbytes(inp) * (d - 1) / d,
                lambda a: one_buffer_collective("reduce_scatter_single", "reduce_scatter_tensor")(
                    out.view(-1), inp.reshape(-1), group=group, async_op=a), async_op, group)


def all_to_all(out: torch.Tensor, inp: torch.Tensor, group: dist.ProcessGroup,
               out_splits: list[int] | None = None, in_splits: list[int] | None = None,
               async_op: bool = False):
    """``all_to_all_single`` along dim 0 with optional split sizes (rows to / from each rank).
    Counted: the larger of the bytes this rank sends to the other ranks and receives from them
    ((D-1)/D of the buffer with even splits; with skewed splits, e.g. routed tokens all bound for
    one rank's experts, what really crosses this rank's link)."""
    d = dist.get_world_size(group)
    if d == 1:
        out.copy_(inp)
        return _done(async_op)
    me, row = dist.get_rank(group), math.prod(inp.shape[1:]) * inp.element_size()
    ins = in_splits or [inp.shape[0] // d] * d
    outs = out_splits or [out.shape[0] // d] * d
    nbytes = max(sum(ins) - ins[me], sum(outs) - outs[me]) * row
    if traced.tracing():
        return traced.all_to_all(out, inp, group, out_splits, in_splits, async_op)
    return _run("all_to_all", nbytes,
                lambda a: dist.all_to_all_single(out, inp, out_splits, in_splits, group=group,
                                                 async_op=a), async_op, group)


def ring_pass(send: torch.Tensor, recv: torch.Tensor, group: dist.ProcessGroup, *,
              reverse: bool = False, tag: int = 0, async_op: bool = False):
    """One ring hop: send ``send`` to the next rank and fill ``recv`` from the previous one
    (the other way round with ``reverse``)."""
    d = dist.get_world_size(group)
    if d == 1:
        recv.copy_(send)
        return _done(async_op)
    me = dist.get_rank(group)
    to, frm = ((me - 1) % d, (me + 1) % d) if reverse else ((me + 1) % d, (me - 1) % d)
    if traced.tracing():
        return traced.ring_pass(send, recv, group, reverse, tag, async_op)
    _record("ring_pass", _nbytes(send))
    checked = guard.before("ring_pass", group, _nbytes(send))
    ops = [dist.P2POp(dist.isend, send, group=group, group_peer=to, tag=tag),
           dist.P2POp(dist.irecv, recv, group=group, group_peer=frm, tag=tag)]
    try:
        handle = Handle(dist.batch_isend_irecv(ops), checked)
    except RuntimeError as e:
        guard.failed(checked, e)
    if async_op:
        return handle
    handle.wait()
    return None


# what each traced collective runs at every call of a compiled graph (:mod:`traced`)
traced.EAGER.update(broadcast=broadcast, reduce=reduce, all_reduce=all_reduce,
                    all_gather=all_gather, reduce_scatter=reduce_scatter, all_to_all=all_to_all,
                    ring_pass=ring_pass)


# ------------------------------------------------------------------- ring schedules

_WEIGHT_TAG, _GRAD_TAG = 1, 2


class RingHop:
    """Async ring hops of a buffer: ``start(buf)`` sends it to the next rank and receives the
    previous rank's into a fresh buffer; ``wait()`` returns that buffer."""

    def __init__(self, group: dist.ProcessGroup, tag: int) -> None:
        self.group, self.tag, self._pending = group, tag, None

    def start(self, buf: torch.Tensor) -> None:
        recv = torch.empty_like(buf)
        self._pending = (recv, ring_pass(buf, recv, self.group, tag=self.tag, async_op=True))

    def wait(self) -> torch.Tensor:
        recv, handle = self._pending
        handle.wait()
        self._pending = None
        return recv


def ring_over_shards(own: torch.Tensor, group: dist.ProcessGroup,
                     compute: Callable[[int, torch.Tensor], None]) -> None:
    """Visit every rank's shard: at step k this rank holds the shard of rank (me - k) mod D and
    calls ``compute(owner, shard)`` while that shard already travels on to the next rank
    (double-buffered: D-1 hops, each overlapping one step's compute)."""
    d, me = dist.get_world_size(group), dist.get_rank(group)
    hop = RingHop(group, _WEIGHT_TAG)
    cur = own
    for step in range(d):
        if step + 1 < d:
            hop.start(cur)
        compute((me - step) % d, cur)
        if step + 1 < d:
            cur = hop.wait()


def ring_over_shards_with_grads(own: torch.Tensor, group: dist.ProcessGroup,
                                contribute: Callable[[int, torch.Tensor], torch.Tensor]
                                ) -> torch.Tensor:
    """The backward of :func:`ring_over_shards`: the shards circulate again (prefetched) and
    ``contribute(owner, shard)`` returns this rank's gradient for that shard, packed like it. An
    accumulator follows each shard, every rank adding its contribution; one last hop brings the
    complete sum to the owner. Returns the gradient of ``own`` (D-1 weight hops, D gradient
    hops)."""
    d, me = dist.get_world_size(group), dist.get_rank(group)
    weights, grads = RingHop(group, _WEIGHT_TAG), RingHop(group, _GRAD_TAG)
    cur = own
    acc = None
    for step in range(d):
        if step + 1 < d:
            weights.start(cur)
        acc = contribute((me - step) % d, cur)
        if step > 0:
            acc.add_(grads.wait())
        if d > 1:
            grads.start(acc)  # after the last step this hop delivers the finished sum
        if step + 1 < d:
            cur = weights.wait()
    return grads.wait() if d > 1 else acc


# ------------------------------------------------------- sequence gather / scatter (raw)

def _moves(seq_len: int, d: int, layout: str,
           docs: Sequence[int] | None) -> list[tuple[int, int, int, int]]:
    """(rank, local offset, global start, length) of every local segment of every rank."""
    out = []
    for r in range(d):
        offset = 0
        for a, b in local_segments(seq_len, r, d, layout, docs):
            out.append((r, offset, a, b - a))
            offset += b - a
    return out


def _zigzag_halves(full: torch.Tensor, buf: torch.Tensor, dim: int, d: int):
    """Views that move an unpacked zigzag row between global order (``full``) and rank order
    (``buf`` [d, ..., local, ...]) in two copies instead of 2d: the first halves of the sequence
    are the ranks' first chunks in rank order, the second halves their second chunks in reverse
    rank order (``rev``)."""
    chunk = full.shape[dim] // (2 * d)
    halves = full.unflatten(dim, (2, d, chunk))
    local = buf.unflatten(dim + 1, (2, chunk))
    rev = torch.arange(d - 1, -1, -1, device=full.device)
    return ((halves.select(dim, 0), halves.select(dim, 1)),
            (local.select(dim + 1, 0).movedim(0, dim), local.select(dim + 1, 1).movedim(0, dim)),
            rev)


class PendingSequence:
    """An async sequence gather or reduce-scatter in flight: ``wait()`` blocks until it is done
    and returns the result (in global token order for a gather, this rank's tokens for a
    reduce-scatter), once; the transfer buffers are released then."""

    def __init__(self, handle: Handle | None, finish: Callable[[], torch.Tensor],
                 keep: tuple[torch.Tensor, ...] = ()) -> None:
        self._handle, self._finish = handle, finish
        self._keep = keep  # the transfer's buffers stay alive until it is done

    def wait(self) -> torch.Tensor:
        if self._finish is None:
            raise RuntimeError("this sequence collective was already waited for")
        if self._handle is not None:
            self._handle.wait()
        finish, self._finish, self._handle = self._finish, None, None
        result = finish()
        self._keep = ()
        return result


def start_all_gather_sequence(x: torch.Tensor, group: dist.ProcessGroup, dim: int, layout: str,
                              docs: Sequence[int] | None = None) -> PendingSequence:
    """Start gathering the full sequence (in global token order) from every rank's local tokens
    along ``dim``; ``docs`` gives the document lengths of a packed row (the same for every row of
    ``x``). The reordering into token order runs in ``wait()``."""
    d = dist.get_world_size(group)
    if d == 1:
        return PendingSequence(None, lambda: x)
    buf, src = x.new_empty((d, *x.shape)), x.contiguous()
    handle = all_gather(buf, src, group, async_op=True)

    def finish() -> torch.Tensor:
        shape = list(x.shape)
        shape[dim] *= d
        full = x.new_empty(shape)
        if docs is None and layout == "zigzag":
            (first, second), (mine, theirs), rev = _zigzag_halves(full, buf, dim, d)
            first.copy_(mine)
            second.index_copy_(dim, rev, theirs)
            return full
        for r, offset, start, n in _moves(shape[dim], d, layout, docs):
            full.narrow(dim, start, n).copy_(buf[r].narrow(dim, offset, n))
        return full

    return PendingSequence(handle, finish, (src,))


def all_gather_sequence(x: torch.Tensor, group: dist.ProcessGroup, dim: int, layout: str,
                        docs: Sequence[int] | None = None) -> torch.Tensor:
    """Full sequence (in global token order) from every rank's local tokens along ``dim``."""
    return start_all_gather_sequence(x, group, dim, layout, docs).wait()


def start_reduce_scatter_sequence(full: torch.Tensor, group: dist.ProcessGroup, dim: int,
                                  layout: str, docs: Sequence[int] | None = None
                                  ) -> PendingSequence:
    """Start summing a full-sequence tensor over the group onto its tokens' owners; ``wait()``
    returns this rank's tokens. ``full`` may be freed by the caller once this returns (the
    transfer works on a rank-ordered copy)."""
    d = dist.get_world_size(group)
    if d == 1:
        return PendingSequence(None, lambda: full)
    shape = list(full.shape)
    shape[dim] //= d
    buf = full.new_empty((d, *shape))
    if docs is None and layout == "zigzag":
        (first, second), (mine, theirs), rev = _zigzag_halves(full, buf, dim, d)
        mine.copy_(first)
        theirs.index_copy_(dim, rev, second)
    else:
        for r, offset, start, n in _moves(full.shape[dim], d, layout, docs):
            buf[r].narrow(dim, offset, n).copy_(full.narrow(dim, start, n))
    out = full.new_empty(shape)
    handle = reduce_scatter(out, buf, group, async_op=True)
    return PendingSequence(handle, lambda: out, (buf,))


def reduce_scatter_sequence(full: torch.Tensor, group: dist.ProcessGroup, dim: int, layout: str,
                            docs: Sequence[int] | None = None) -> torch.Tensor:
    """This rank's tokens of the sum over the group of a full-sequence tensor."""
    return start_reduce_scatter_sequence(full, group, dim, layout, docs).wait()


# ------------------------------------------------------------- autograd-aware collectives

class _OwnerBroadcast(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, src, group):
        ctx.src, ctx.group = src, group
        out = x.clone()
        broadcast(out, src, group)
        return out

    @staticmethod
    def backward(ctx, g):
        g = g.contiguous().clone()
        reduce(g, ctx.src, ctx.group)
        if dist.get_rank(ctx.group) != ctx.src:
            g.zero_()
        return g, None, None


def owner_broadcast(x: torch.Tensor, src: int, group: dist.ProcessGroup) -> torch.Tensor:
    """Every rank gets the owner's ``x``; the backward sums gradients onto the owner."""
    return _OwnerBroadcast.apply(x, src, group)


class _GatherSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, dim, layout):
        ctx.group, ctx.dim, ctx.layout = group, dim, layout
        return all_gather_sequence(x, group, dim, layout)

    @staticmethod
    def backward(ctx, g):
        grad = reduce_scatter_sequence(g.contiguous(), ctx.group, ctx.dim, ctx.layout)
        return grad, None, None, None


def gather_sequence(x: torch.Tensor, group: dist.ProcessGroup, dim: int = 1,
                    layout: str = "zigzag") -> torch.Tensor:
    """Full sequence from local tokens; the backward reduce-scatters gradients to token owners."""
    return _GatherSequence.apply(x, group, dim, layout)


class _RingShift(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        x = x.contiguous()
        out = torch.empty_like(x)
        ring_pass(x, out, group)
        return out

    @staticmethod
    def backward(ctx, g):
        g = g.contiguous()
        out = torch.empty_like(g)
        ring_pass(g, out, ctx.group, reverse=True)
        return out, None


def ring_shift(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """The previous rank's ``x``; the backward sends gradients back the other way."""
    return _RingShift.apply(x, group)


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, out_splits, in_splits):
        ctx.group, ctx.out_splits, ctx.in_splits = group, out_splits, in_splits
        rows = sum(out_splits) if out_splits is not None else x.shape[0]
        out = x.new_empty((rows, *x.shape[1:]))
        all_to_all(out, x.contiguous(), group, out_splits, in_splits)
        return out

    @staticmethod
    def backward(ctx, g):
        rows = sum(ctx.in_splits) if ctx.in_splits is not None else g.shape[0]
        out = g.new_empty((rows, *g.shape[1:]))
        all_to_all(out, g.contiguous(), ctx.group, ctx.in_splits, ctx.out_splits)
        return out, None, None, None


def all_to_all_rows(x: torch.Tensor, group: dist.ProcessGroup, out_splits: list[int] | None = None,
                    in_splits: list[int] | None = None) -> torch.Tensor:
    """Exchange rows of ``x`` (dim 0) between ranks; the backward sends gradients back."""
    return _AllToAll.apply(x, group, out_splits, in_splits)


class _SumOver(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, groups):
        out = x.clone()
        for g in groups:
            all_reduce(out, g)
        return out

    @staticmethod
    def backward(ctx, g):
        return g, None


def sum_over(x: torch.Tensor, groups: Sequence[dist.ProcessGroup]) -> torch.Tensor:
    """Sum of ``x`` over the groups (in turn), on every rank. The backward passes the gradient
    through unchanged: every rank backpropagates its own copy of the same total, so each rank's
    share of it gets the gradient once (Megatron's "reduce from model-parallel region")."""
    return _SumOver.apply(x, tuple(groups))


class _SumGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        g = g.contiguous().clone()
        all_reduce(g, ctx.group)
        return g, None


def sum_grad(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Identity whose backward sums the gradient over the group: a replicated parameter used by
    every rank on different tokens gets the gradient of all tokens."""
    return _SumGrad.apply(x, group)


# ------------------------------------------- DTensor's collectives (the tensor-parallel baselines)

def _group_size(group_name: str) -> int:
    from torch.distributed.distributed_c10d import _resolve_process_group

    return dist.get_world_size(_resolve_process_group(group_name))


def _functional_bytes(name: str, args: tuple) -> tuple[str, float] | None:
    """(kind, per-rank bytes) of one ``_c10d_functional`` op by this module's ring rule."""
    if name in ("all_reduce", "all_reduce_"):
        t, _op, group = args[:3]
        d = _group_size(group)
        return "all_reduce", 2 * _nbytes(t) * (d - 1) / d
    if name == "all_gather_into_tensor":
        t, d = args[0], args[1]
        return "all_gather", _nbytes(t) * (d - 1)  # output is d times the input
    if name == "reduce_scatter_tensor":
        t, d = args[0], args[2]
        return "reduce_scatter", _nbytes(t) * (d - 1) / d
    if name == "all_to_all_single":
        t, group = args[0], args[3]
        d = _group_size(group)
        return "all_to_all", _nbytes(t) * (d - 1) / d
    if name == "broadcast":
        t, group = args[0], args[2]
        d = _group_size(group)
        return "broadcast", _nbytes(t) * (d - 1) / d
    return None


@contextlib.contextmanager
def count_functional_collectives() -> Iterator[None]:
    """Record the collectives DTensor issues (``torch.ops._c10d_functional``, as used by
    ``torch.distributed.tensor.parallel``) in the same counters and by the same byte rule as this
    module's own, and the host time spent in them and in their ``wait_tensor`` as
    ``wait_seconds``, so that every layout of a benchmark is measured one way. Wrap forward and
    backward; the counted ops still run unchanged."""
    from torch.distributed.tensor import DTensor
    from torch.utils._python_dispatch import TorchDispatchMode

    class _Counter(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if any(issubclass(t, DTensor) for t in types):
                return NotImplemented  # let DTensor run the op: its collectives come back here
            if func.namespace == "_c10d_functional":
                name = func._overloadpacket.__name__
                if name.endswith("_coalesced"):
                    raise NotImplementedError(f"counting {name} is not implemented")
                counted = _functional_bytes(name, args)
                if counted is not None:
                    _record(*counted)
                with _blocked():  # launching a collective, or waiting for one (wait_tensor)
                    return func(*args, **(kwargs or {}))
            return func(*args, **(kwargs or {}))

    with _Counter():
        yield
