"""Collectives that fail with a message instead of hanging silently.

Every collective of :mod:`tsp_core.comm` is numbered per process group. Two modes:

- default: a backend error (a gloo/NCCL timeout, a peer that died) is re-raised as
  :class:`CollectiveError` naming the collective: its kind, its call number on the group, the
  group's size and global ranks, and its bytes. No extra communication.
- debug (``TSP_DEBUG_COLLECTIVES=1`` in the environment): before each collective, every rank of the
  group all-gathers a small signature (call number, kind, bytes) and compares them, so ranks that
  run different schedules (different code paths, models or inputs) all raise
  :class:`CollectiveMismatch` naming every rank's op instead of blocking in mismatched collectives.
  It costs one small all-gather per collective: for debugging, not for production runs.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import NoReturn

import torch
import torch.distributed as dist

from .torch_features import one_buffer_collective

ENV = "TSP_DEBUG_COLLECTIVES"
KINDS = ("broadcast", "reduce", "all_reduce", "all_gather", "reduce_scatter", "all_to_all",
         "ring_pass")
# split sizes legitimately differ between ranks: bytes not compared
_SIZED_PER_RANK = ("all_to_all",)

_calls: dict[dist.ProcessGroup, int] = {}


class CollectiveError(RuntimeError):
    """A collective failed or timed out; the message names it."""


class CollectiveMismatch(RuntimeError):
    """Ranks of one group issued different collectives (debug mode)."""


def debug_enabled() -> bool:
    """Whether ``TSP_DEBUG_COLLECTIVES`` asks for the cross-rank check (read on every call, so a
    test or a debugging session can switch it on and off)."""
    return os.environ.get(ENV, "0").strip().lower() not in ("", "0", "false", "no")


def reset() -> None:
    """Forget the call numbers (after a failed collective, the ranks' counts may disagree)."""
    _calls.clear()


@dataclass(frozen=True)
class Call:
    """One collective as this rank issued it."""

    kind: str
    number: int
    group: dist.ProcessGroup
    nbytes: float

    def describe(self) -> str:
        ranks = dist.get_process_group_ranks(self.group)
        return (f"{self.kind} (call #{self.number} on this group of {len(ranks)} ranks, global "
                f"ranks {ranks}; {self.nbytes:.0f} bytes of traffic)")


def before(kind: str, group: dist.ProcessGroup, nbytes: float) -> Call:
    """Number the call and, in debug mode, check that every rank of ``group`` issues the same one.
    Every rank of the group gets the same verdict, so all raise together."""
    number = _calls.get(group, 0) + 1
    _calls[group] = number
    call = Call(kind, number, group, nbytes)
    if debug_enabled():
        _compare(call)
    return call


def failed(call: Call, err: BaseException) -> NoReturn:
    """Re-raise a backend error with the collective named."""
    raise CollectiveError(
        f"TSP collective {call.describe()} failed: {err}\nIf it timed out, another rank of the "
        f"group did not reach the same collective: it died, is stuck, or runs a different schedule "
        f"(different inputs, model or code path). Rerun with {ENV}=1 to get an error naming the "
        f"first mismatched collective on every rank.") from err


def _device(group: dist.ProcessGroup) -> torch.device:
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _compare(call: Call) -> None:
    d = dist.get_world_size(call.group)
    code = KINDS.index(call.kind)
    sig = torch.tensor([call.number, code, round(call.nbytes)], dtype=torch.int64,
                       device=_device(call.group))
    out = sig.new_empty(3 * d)
    one_buffer_collective("all_gather_single", "all_gather_into_tensor")(out, sig, group=call.group)
    rows = [tuple(r) for r in out.view(d, 3).tolist()]
    if call.kind in _SIZED_PER_RANK and all(r[1] == code for r in rows):
        rows = [(n, c, -1) for n, c, _ in rows]
    if len(set(rows)) == 1:
        return
    ranks = dist.get_process_group_ranks(call.group)
    by_sig: dict[tuple, list[int]] = {}
    for r, row in enumerate(rows):
        by_sig.setdefault(row, []).append(ranks[r])
    ops = "; ".join(f"global rank(s) {rs} issued {KINDS[c]} (call #{n}"
                    + (f", {b} bytes of traffic)" if b >= 0 else ")")
                    for (n, c, b), rs in by_sig.items())
    raise CollectiveMismatch(
        f"collective mismatch on a group of {d} ranks (global ranks {ranks}): {ops}. The ranks run "
        f"different schedules: check that every rank of the group got the same model, the same "
        f"batch shapes and the same code path (found by {ENV}=1; call numbers count this group's "
        f"TSP collectives since the start or guard.reset()).")
