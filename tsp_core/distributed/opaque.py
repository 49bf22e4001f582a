"""Pieces of a compiled layer whose sizes depend on the data, run whole as one op
(docs/design.md "Compiled layers").

A mixture-of-experts layer groups each rank's tokens by the experts the router chose: how many
rows each expert gets, and how many rows travel to each rank, are known only when the routing is.
A graph cannot be traced through Python loops over those counts. So while ``torch.compile``
traces, such a piece is one custom op, ``tsp_opaque::run``, whose implementation is the piece's
own eager code, run at every call of the compiled graph: its collectives go through :mod:`comm`
as eagerly (counted, guarded, with their async overlap), and what it keeps for its backward comes
out as tensors (a count fixed by the routing is a dynamic size of the graph). The op is an ordered
effect, as :mod:`.traced`'s collectives are, since it issues collectives that other ranks wait
for. Outside tracing :func:`run` calls the piece directly.

A piece is registered once by name with :func:`opaque`: its eager function ``fn(statics,
tensors) -> list[Tensor]`` and ``shapes(statics, tensors) -> list[Tensor]``, which makes the
outputs' empty tensors from the inputs' (fake ones while tracing; a size known only from the data
from :func:`dynamic_size`). ``statics`` (the layer's spec, its process group, a tile size) are
not tensors: they are kept in a table here and the op receives their key, an int the compiled
graph holds as a constant, the same for every layer of a kind."""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass

import torch
from torch._library.effects import EffectType

from .traced import tracing

Piece = Callable[[tuple, Sequence[torch.Tensor]], list[torch.Tensor]]


@dataclass(frozen=True)
class _Opaque:
    fn: Piece
    shapes: Piece


_PIECES: dict[str, _Opaque] = {}
_STATICS: list[tuple] = []
_KEYS: dict[tuple, int] = {}
_INTERNED: dict[Hashable, Hashable] = {}


def opaque(name: str, fn: Piece, shapes: Piece) -> None:
    """Register the piece ``name``: ``fn`` its eager code, ``shapes`` its outputs' shapes."""
    _PIECES[name] = _Opaque(fn, shapes)


def run(name: str, statics: tuple[Hashable, ...], tensors: Sequence[torch.Tensor]
        ) -> list[torch.Tensor]:
    """The outputs of piece ``name`` on ``tensors``: its eager code, as one op while tracing."""
    if not tracing():
        return _PIECES[name].fn(statics, tensors)
    return torch.ops.tsp_opaque.run(name, _key(*statics), list(tensors))


def interned(static: Hashable) -> Hashable:
    """The one object equal to ``static`` that :func:`run` is given: while tracing, a static
    that is not a number or a string is told apart by its identity (guarded), so the layers of a
    kind share one compiled graph only if their equal statics are one object."""
    return _INTERNED.setdefault(static, static)


def dynamic_size() -> torch.SymInt:
    """A size known only from the data, for a piece's ``shapes`` while tracing."""
    return torch.library.get_ctx().new_dynamic_size()


def _key(*statics: Hashable) -> int:
    if statics not in _KEYS:
        _KEYS[statics] = len(_STATICS)
        _STATICS.append(statics)
    return _KEYS[statics]


def prepare_tracing() -> None:
    """Before anything is compiled: :func:`_key` runs while tracing and its result is a
    constant of the graph (dynamo's ``assume_constant_result``). Not done at import: importing
    dynamo costs every process about a second of CPU."""
    torch._dynamo.assume_constant_result(_key)


@torch.library.custom_op("tsp_opaque::run", mutates_args=())
def _run(name: str, key: int, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    # a custom op's outputs must not alias its inputs or each other: such an output is copied
    seen = {t.untyped_storage().data_ptr() for t in tensors}
    outs = []
    for t in _PIECES[name].fn(_STATICS[key], tensors):
        ptr = t.untyped_storage().data_ptr()
        outs.append(t.clone() if ptr in seen else t)
        seen.add(ptr)
    return outs


@_run.register_fake
def _(name, key, tensors):
    return _PIECES[name].shapes(_STATICS[key], tensors)


_run.register_effect(EffectType.ORDERED)
