""":mod:`tsp_core.comm`'s collectives while ``torch.compile`` traces them (docs/design.md
"Compiled layers").

Dynamo cannot trace a c10d collective that returns a ``Work`` (``async_op=True``), a ``P2POp``,
``dist.reduce``, Python counters or a host clock, and each of those broke a decoder layer's graph
into pieces. And a TSP layer's graph differs by rank (a rank broadcasts its own shard and receives
the others', reduces onto itself or for another rank), so the compiler must not drop, merge,
hoist or reorder a collective by what this rank's graph alone shows: a pure functional collective
whose result this rank never reads is dead code to it, while the other ranks wait for it.

So while tracing, each collective is two custom ops here (``tsp_comm::*``), registered as
ordered effects: a start op that launches :mod:`comm`'s own eager collective (registered here by
:mod:`comm` at import) asynchronously into a buffer of its own and returns a key, and
``tsp_comm::wait``, placed where the eager code waits for the collective's ``Work``, which returns
that buffer. AOT autograd threads an effect token through all of them, so every rank's compiled
graph issues and waits for them in program order, none is removed as dead code or merged with
another, and a backward's collective stays in the backward. At every call of the compiled graph
they run the same collectives, counted with the same bytes in the same order as eager, through
the same guard, with the same compute between a start and its wait (the eager schedules'
prefetch); the result is copied once more, into the caller's buffer."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch._library.effects import EffectType
from torch.distributed.distributed_c10d import _resolve_process_group

# kind -> comm's eager collective, filled by comm when it is imported
EAGER: dict[str, Callable] = {}

# collectives started by a compiled graph and not yet waited for: key -> (result, comm Handle)
_IN_FLIGHT: dict[int, tuple[torch.Tensor, Any]] = {}
_KEYS = itertools.count()


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



# ------------------------------------------------------------------ the ops a graph holds
# Each start op launches comm's eager collective asynchronously into a buffer of its own and
# returns a key; ``tsp_comm::wait`` waits for that collective and returns the buffer. The tensors
# the collective reads while in flight are passed to the wait too, so a compiler that reuses
# buffers keeps them alive and unchanged until then.

def _launch(result: torch.Tensor, handle: Any) -> torch.Tensor:
    key = next(_KEYS)
    _IN_FLIGHT[key] = (result, handle)
    return torch.tensor(key, dtype=torch.int64)


def _group(name: str) -> dist.ProcessGroup:
    return _resolve_process_group(name)


@torch.library.custom_op("tsp_comm::broadcast", mutates_args=())
def _broadcast(t: torch.Tensor, src: int, group_name: str) -> torch.Tensor:
    out = t.clone()
    return _launch(out, EAGER["broadcast"](out, src, _group(group_name), async_op=True))


@torch.library.custom_op("tsp_comm::reduce", mutates_args=())
def _reduce(t: torch.Tensor, dst: int, group_name: str) -> torch.Tensor:
    out = t.clone()
    return _launch(out, EAGER["reduce"](out, dst, _group(group_name), async_op=True))


@torch.library.custom_op("tsp_comm::all_reduce", mutates_args=())
def _all_reduce(t: torch.Tensor, op: str, group_name: str) -> torch.Tensor:
    out = t.clone()
    return _launch(out, EAGER["all_reduce"](out, _group(group_name), async_op=True,
                                            op=getattr(dist.ReduceOp, op)))


@torch.library.custom_op("tsp_comm::all_gather", mutates_args=())
def _all_gather(inp: torch.Tensor, size: int, group_name: str) -> torch.Tensor:
    out = inp.new_empty(size * inp.numel())
    return _launch(out, EAGER["all_gather"](out, inp, _group(group_name), async_op=True))


@torch.library.custom_op("tsp_comm::reduce_scatter", mutates_args=())
def _reduce_scatter(inp: torch.Tensor, size: int, group_name: str) -> torch.Tensor:
    out = inp.new_empty(inp.numel() // size)
    return _launch(out, EAGER["reduce_scatter"](out, inp, _group(group_name), async_op=True))


@torch.library.custom_op("tsp_comm::all_to_all", mutates_args=())
def _all_to_all(inp: torch.Tensor, out_rows: int, out_splits: list[int] | None,
                in_splits: list[int] | None, group_name: str) -> torch.Tensor:
    out = inp.new_empty(out_rows, *inp.shape[1:])
    return _launch(out, EAGER["all_to_all"](out, inp, _group(group_name), out_splits, in_splits,
                                            async_op=True))


@torch.library.custom_op("tsp_comm::ring_pass", mutates_args=())
def _ring_pass(send: torch.Tensor, reverse: bool, tag: int, group_name: str) -> torch.Tensor:
    recv = torch.empty_like(send)
    return _launch(recv, EAGER["ring_pass"](send, recv, _group(group_name), reverse=reverse,
                                            tag=tag, async_op=True))


@torch.library.custom_op("tsp_comm::wait", mutates_args=())
def _wait(key: torch.Tensor, reading: list[torch.Tensor], shape: list[int], dtype: torch.dtype,
          device: torch.device) -> torch.Tensor:
    result, handle = _IN_FLIGHT.pop(int(key))
    handle.wait()
    return result


def _key(*args: Any) -> torch.Tensor:
    return torch.empty((), dtype=torch.int64)


for _op in (_broadcast, _reduce, _all_reduce, _all_gather, _reduce_scatter, _all_to_all,
            _ring_pass):
    _op.register_fake(_key)
    _op.register_effect(EffectType.ORDERED)


@_wait.register_fake
def _(key, reading, shape, dtype, device):
    return torch.empty(shape, dtype=dtype, device=device)


_wait.register_effect(EffectType.ORDERED)


# ------------------------------------------------------------- what comm calls while tracing

class Pending:
    """A traced collective in flight: ``wait()`` (where the eager code waits for its ``Work``)
    adds the graph's wait op and copies its result into the caller's buffer ``out``."""

    def __init__(self, out: torch.Tensor, key: torch.Tensor,
                 reading: Sequence[torch.Tensor], shape: Sequence[int]) -> None:
        self.out, self.key, self.reading, self.shape = out, key, list(reading), list(shape)

    def wait(self) -> None:
        if self.key is None:
            return
        result = torch.ops.tsp_comm.wait(self.key, self.reading, self.shape, self.out.dtype,
                                         self.out.device)
        self.out.copy_(result.view(self.out.shape))
        self.key, self.reading = None, []


def _started(out: torch.Tensor, key: torch.Tensor, async_op: bool,
             reading: Sequence[torch.Tensor] = (), shape: Sequence[int] | None = None
             ) -> Pending | None:
    pending = Pending(out, key, reading, out.shape if shape is None else shape)
    if async_op:
        return pending
    pending.wait()
    return None


def broadcast(t: torch.Tensor, src: int, group: dist.ProcessGroup,
              async_op: bool) -> Pending | None:
    return _started(t, torch.ops.tsp_comm.broadcast(t, src, group.group_name), async_op)


def reduce(t: torch.Tensor, dst: int, group: dist.ProcessGroup, async_op: bool) -> Pending | None:
    return _started(t, torch.ops.tsp_comm.reduce(t, dst, group.group_name), async_op)


def all_reduce(t: torch.Tensor, op: str, group: dist.ProcessGroup,
               async_op: bool) -> Pending | None:
    return _started(t, torch.ops.tsp_comm.all_reduce(t, op, group.group_name), async_op)


def all_gather(out: torch.Tensor, inp: torch.Tensor, group: dist.ProcessGroup,
               async_op: bool) -> Pending | None:
    flat = inp.reshape(-1)
    key = torch.ops.tsp_comm.all_gather(flat, dist.get_world_size(group), group.group_name)
    return _started(out, key, async_op, (flat,), [out.numel()])


def reduce_scatter(out: torch.Tensor, inp: torch.Tensor, group: dist.ProcessGroup,
                   async_op: bool) -> Pending | None:
    flat = inp.reshape(-1)
    key = torch.ops.tsp_comm.reduce_scatter(flat, dist.get_world_size(group), group.group_name)
    return _started(out, key, async_op, (flat,), [out.numel()])


def all_to_all(out: torch.Tensor, inp: torch.Tensor, group: dist.ProcessGroup,
               out_splits: list[int] | None, in_splits: list[int] | None,
               async_op: bool) -> Pending | None:
    key = torch.ops.tsp_comm.all_to_all(inp, out.shape[0], out_splits, in_splits,
                                        group.group_name)
    return _started(out, key, async_op, (inp,))


def ring_pass(send: torch.Tensor, recv: torch.Tensor, group: dist.ProcessGroup, reverse: bool,
              tag: int, async_op: bool) -> Pending | None:
    key = torch.ops.tsp_comm.ring_pass(send, reverse, tag, group.group_name)
    return _started(recv, key, async_op, (send,))
