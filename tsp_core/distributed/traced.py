""":mod:`tsp_core.comm`'s collectives while ``torch.compile`` traces them (docs/design.md
"Compiled layers").

Dynamo cannot trace a c10d collective that returns a ``Work`` (``async_op=True``), a ``P2POp``,
``dist.reduce``, Python counters or a host clock, and each of those broke a decoder layer's graph
into pieces. And a TSP layer's graph differs by rank (a rank broadcasts its own shard and receives
the others', reduces onto itself or for another rank), so the compiler must not drop, merge,
hoist or reorder a collective by what this rank's graph alone shows: a pure functional collective
whose result this rank never reads is dead code to it, while the other ranks wait for it.

So while tracing, each collective is one custom op here (``tsp_comm::*``) that returns a new
tensor and is registered as an ordered effect: AOT autograd threads an effect token through all of
them, so every rank's compiled graph issues them in program order, none is removed as dead code or
merged with another, and a backward's collective stays in the backward. Its implementation, run
at every call of the compiled graph, is :mod:`comm`'s own eager collective (registered here by
:mod:`comm` at import), synchronous: the same collectives, counted with the same bytes in the same
order as eager, through the same guard. What the traced path gives up is the overlap of the eager
schedules' async prefetches, and the host wait time is counted inside the ops."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch._library.effects import EffectType
from torch.distributed.distributed_c10d import _resolve_process_group

# kind -> comm's eager collective, filled by comm when it is imported
EAGER: dict[str, Callable] = {}


def tracing() -> bool:
    """Whether ``torch.compile`` is tracing the running code."""
    return torch.compiler.is_compiling()


class Outside:
    """What the eager code around a compiled layer saw just before calling it, and the graph
    cannot ask itself: set by the call (:mod:`tsp_core.models.compiled`), read while tracing.
    Dynamo guards on each value it reads here, so a graph traced for one value never runs for
    another (an activation checkpoint's recompute gets its own graph)."""

    in_backward: bool = False


def in_backward() -> bool:
    """Whether autograd's engine is running a backward on this thread (a forward called now is
    an activation checkpoint's recompute)."""
    if tracing():
        return Outside.in_backward
    return torch._C._current_graph_task_id() != -1


@torch.library.custom_op("tsp_comm::broadcast", mutates_args=())
def _broadcast(t: torch.Tensor, src: int, group_name: str) -> torch.Tensor:
    out = t.clone()
    EAGER["broadcast"](out, src, _resolve_process_group(group_name))
    return out


@torch.library.custom_op("tsp_comm::reduce", mutates_args=())
def _reduce(t: torch.Tensor, dst: int, group_name: str) -> torch.Tensor:
    out = t.clone()
    EAGER["reduce"](out, dst, _resolve_process_group(group_name))
    return out


@torch.library.custom_op("tsp_comm::all_reduce", mutates_args=())
def _all_reduce(t: torch.Tensor, op: str, group_name: str) -> torch.Tensor:
    out = t.clone()
    EAGER["all_reduce"](out, _resolve_process_group(group_name), op=getattr(dist.ReduceOp, op))
    return out


@torch.library.custom_op("tsp_comm::all_gather", mutates_args=())
def _all_gather(inp: torch.Tensor, size: int, group_name: str) -> torch.Tensor:
    out = inp.new_empty(size * inp.numel())
    EAGER["all_gather"](out, inp, _resolve_process_group(group_name))
    return out


@torch.library.custom_op("tsp_comm::reduce_scatter", mutates_args=())
def _reduce_scatter(inp: torch.Tensor, size: int, group_name: str) -> torch.Tensor:
    out = inp.new_empty(inp.numel() // size)
    EAGER["reduce_scatter"](out, inp, _resolve_process_group(group_name))
    return out


@torch.library.custom_op("tsp_comm::all_to_all", mutates_args=())
def _all_to_all(inp: torch.Tensor, out_rows: int, out_splits: list[int] | None,
                in_splits: list[int] | None, group_name: str) -> torch.Tensor:
    out = inp.new_empty(out_rows, *inp.shape[1:])
    EAGER["all_to_all"](out, inp, _resolve_process_group(group_name), out_splits, in_splits)
    return out


@torch.library.custom_op("tsp_comm::ring_pass", mutates_args=())
def _ring_pass(send: torch.Tensor, reverse: bool, tag: int, group_name: str) -> torch.Tensor:
    recv = torch.empty_like(send)
    EAGER["ring_pass"](send, recv, _resolve_process_group(group_name), reverse=reverse, tag=tag)
    return recv


@_broadcast.register_fake
def _(t, src, group_name):
    return torch.empty_like(t)


@_reduce.register_fake
def _(t, dst, group_name):
    return torch.empty_like(t)


@_all_reduce.register_fake
def _(t, op, group_name):
    return torch.empty_like(t)


@_all_gather.register_fake
def _(inp, size, group_name):
    return inp.new_empty(size * inp.numel())


@_reduce_scatter.register_fake
def _(inp, size, group_name):
    return inp.new_empty(inp.numel() // size)


@_all_to_all.register_fake
def _(inp, out_rows, out_splits, in_splits, group_name):
    return inp.new_empty(out_rows, *inp.shape[1:])


@_ring_pass.register_fake
def _(send, reverse, tag, group_name):
    return torch.empty_like(send)


for _op in (_broadcast, _reduce, _all_reduce, _all_gather, _reduce_scatter, _all_to_all,
            _ring_pass):
    _op.register_effect(EffectType.ORDERED)


class Pending:
    """A traced collective's result, copied into the caller's buffer ``out`` at ``wait()`` (where
    the eager code waits for its ``Work``), or at once for a synchronous call."""

    def __init__(self, out: torch.Tensor, result: torch.Tensor) -> None:
        self.out, self.result = out, result

    def wait(self) -> None:
        if self.result is None:
            return
        self.out.copy_(self.result.view(self.out.shape))
        self.result = None


def finish(out: torch.Tensor, result: torch.Tensor, async_op: bool) -> Pending | None:
    pending = Pending(out, result)
    if async_op:
        return pending
    pending.wait()
    return None


def broadcast(t: torch.Tensor, src: int, group: dist.ProcessGroup) -> torch.Tensor:
    return torch.ops.tsp_comm.broadcast(t, src, group.group_name)


def reduce(t: torch.Tensor, dst: int, group: dist.ProcessGroup) -> torch.Tensor:
    return torch.ops.tsp_comm.reduce(t, dst, group.group_name)


def all_reduce(t: torch.Tensor, op: str, group: dist.ProcessGroup) -> torch.Tensor:
    return torch.ops.tsp_comm.all_reduce(t, op, group.group_name)


def all_gather(inp: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    return torch.ops.tsp_comm.all_gather(inp.reshape(-1), dist.get_world_size(group),
                                         group.group_name)


def reduce_scatter(inp: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    return torch.ops.tsp_comm.reduce_scatter(inp.reshape(-1), dist.get_world_size(group),
                                             group.group_name)


def all_to_all(out: torch.Tensor, inp: torch.Tensor, group: dist.ProcessGroup,
               out_splits: list[int] | None, in_splits: list[int] | None) -> torch.Tensor:
    return torch.ops.tsp_comm.all_to_all(inp, out.shape[0], out_splits, in_splits,
                                         group.group_name)


def ring_pass(send: torch.Tensor, group: dist.ProcessGroup, reverse: bool,
              tag: int) -> torch.Tensor:
    return torch.ops.tsp_comm.ring_pass(send, reverse, tag, group.group_name)

