""":mod:`tsp_core.comm`'s collectives while ``torch.compile`` traces them (docs/design.md
"Compiled layers").

Dynamo cannot trace a c10d collective that returns a ``Work`` (``async_op=True``), a ``P2POp``,
``dist.reduce``, Python counters or a host clock, and each of those broke a decoder layer's graph
into pieces. While tracing, :mod:`comm` therefore issues:

- the functional collectives of ``torch.distributed._functional_collectives`` (broadcast,
  all-gather, reduce-scatter, all-reduce, all-to-all, and the ring's send/receive pairs as one
  ``batch_p2p_ops``), each returning a new tensor that a :class:`Pending` copies into the caller's
  buffer where the eager code waits, so the compiled graph issues the same collectives in the same
  order and the compiler sees where each result is first needed;
- the owner reduce as an opaque custom op (``tsp_comm::reduce_``), since torch has no functional
  reduce: the same c10d reduce as eager, issued synchronously;
- (in :mod:`comm`) the counting as a side-effecting custom op (``tsp_comm::record``) that runs
  :mod:`comm`'s own counters, and the collective guard's numbering, on every call of the
  compiled graph, not once per trace.

What the traced path does not do: it measures no ``wait_seconds`` (the host clock cannot run
inside a graph), and a backend error is raised by the functional collective as is, not renamed by
:mod:`tsp_core.guard`.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch.distributed.distributed_c10d import _resolve_process_group


def tracing() -> bool:
    """Whether ``torch.compile`` is tracing the running code."""
    return torch.compiler.is_compiling()


@torch.library.custom_op("tsp_comm::reduce_", mutates_args=("t",))
def reduce_(t: torch.Tensor, dst: int, group_name: str) -> None:
    """c10d's in-place reduce onto group rank ``dst``, synchronous."""
    dist.reduce(t, group=_resolve_process_group(group_name), group_dst=dst)


@reduce_.register_fake
def _(t: torch.Tensor, dst: int, group_name: str) -> None:
    return None


class Pending:
    """A traced collective's result, copied into the caller's buffer ``out`` at ``wait()`` (the
    point where the eager code waits for its ``Work``)."""

    def __init__(self, out: torch.Tensor, result: torch.Tensor | None,
                 also: tuple[torch.Tensor, ...] = ()) -> None:
        self.out, self.result, self.also = out, result, also

    def wait(self) -> None:
        if self.result is None:
            return
        for t in self.also:  # a ring hop's send
            funcol.wait_tensor(t)
        self.out.copy_(funcol.wait_tensor(self.result).view(self.out.shape))
        self.result, self.also = None, ()


def _finish(out: torch.Tensor, result: torch.Tensor | None, async_op: bool,
            also: tuple[torch.Tensor, ...] = ()) -> Pending | None:
    pending = Pending(out, result, also)
    if async_op:
        return pending
    pending.wait()
    return None


def broadcast(t: torch.Tensor, src: int, group: dist.ProcessGroup, async_op: bool):
    return _finish(t, funcol.broadcast(t, src, group), async_op)


def reduce(t: torch.Tensor, dst: int, group: dist.ProcessGroup, async_op: bool):
    torch.ops.tsp_comm.reduce_(t, dst, group.group_name)
    return _finish(t, None, async_op)


def all_reduce(t: torch.Tensor, group: dist.ProcessGroup, async_op: bool, op: str):
    return _finish(t, funcol.all_reduce(t, op, group), async_op)


def all_gather(out: torch.Tensor, inp: torch.Tensor, group: dist.ProcessGroup, async_op: bool):
    return _finish(out, funcol.all_gather_single(inp.reshape(-1), 0, group), async_op)


def reduce_scatter(out: torch.Tensor, inp: torch.Tensor, group: dist.ProcessGroup,
                   async_op: bool):
    return _finish(out, funcol.reduce_scatter_single(inp.reshape(-1), "sum", 0, group), async_op)


def all_to_all(out: torch.Tensor, inp: torch.Tensor, group: dist.ProcessGroup,
               out_splits: list[int] | None, in_splits: list[int] | None, async_op: bool):
    return _finish(out, funcol.all_to_all_single(inp, out_splits, in_splits, group), async_op)


def ring_pass(send: torch.Tensor, recv: torch.Tensor, group: dist.ProcessGroup, to: int,
              frm: int, tag: int, async_op: bool):
    """One ring hop as a functional send/receive pair (``to``/``frm``: group ranks)."""
    peers = [dist.get_global_rank(group, to), dist.get_global_rank(group, frm)]
    sent, got = funcol.batch_p2p_ops_inplace(["isend", "irecv"], peers, [tag, tag],
                                             [send, recv], group)
    return _finish(recv, got, async_op, (sent,))


def dynamo_settings():
    """The dynamo settings a TSP decoder layer is traced under (a context manager): the layers'
    hand-written backwards recompute small pieces with ``torch.autograd.grad`` (a norm's tiles,
    an activation), which dynamo traces only with ``trace_autograd_ops`` on."""
    return torch._dynamo.config.patch(trace_autograd_ops=True)
