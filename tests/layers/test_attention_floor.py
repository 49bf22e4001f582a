"""The attention backward at its floor (docs/memory.md "The attention backward's floor"): beyond
the local activations of its own tokens it holds one head group's gathered K/V, its dK/dV
accumulator and one more K/V-sized buffer (the next group's K/V arriving, or the previous
group's dK/dV leaving), nothing else that grows with the sequence.

Measured, not read from the code: one TSP attention layer of the Llama-3.1-8B shape (h 4096,
32/8 heads, head_dim 128; and with 2 key/value heads) as rank 0 of D ranks, under
FakeTensorMode with the fake process group and MemTracker (as ``tsp simulate``), at S and at
4S, in the session's simulation workers. What the backward adds from its start to its peak
must grow from S to 4S by at most the growth of ``backward_floor_bytes`` (plus SLACK), and by
at least the growth of its whole-sequence part (the measurement sees the K/V). Each rule broken
on purpose grows by more and fails."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

# (hidden, query heads, key/value heads, head_dim, D): the Llama-3.1-8B attention at D = 4 (two
# key/value heads per rank), and with 2 key/value heads (kv_replicas 2: two rounds share a head,
# the key/value weights are sliced); D = 4 keeps the rounds, and the test's time, short
SHAPES = {"llama-3.1-8b D4": (4096, 32, 8, 128, 4), "2 kv heads D4": (4096, 32, 2, 128, 4)}
SEQ = 65536
# slack on the growth from S to 4S: 16 bytes per token of the sequence, 1/64 of the smallest
# broken variant below (gather_beside_scatter: one more K/V of two heads, 1024 bytes per token)
SLACK_PER_TOKEN = 16

_KEPT: list = []  # what a broken variant keeps alive until the backward ends


@contextlib.contextmanager
def broken(variant: str | None) -> Iterator[None]:
    """The attention backward with one of its memory rules broken on purpose:

    - ``"keep_kv"``: every head group's gathered K/V kept until the backward ends (never
      dropped after its last round: what plain autograd over the rounds would save);
    - ``"fp32_per_block"``: each kernel call's dK/dV put in a whole-sequence float32 buffer of
      its own, kept until the round's attention backward sums them;
    - ``"gather_beside_scatter"``: the next group's K/V gather started while the previous
      group's dK/dV are still in flight (both whole-sequence buffers at once).
    """
    import torch

    from tsp_core.layers import flash
    from tsp_core.layers.attention import rounds

    saved = [(rounds.KVGathers, "drop", rounds.KVGathers.drop),
             (rounds.KVGathers, "halfway", rounds.KVGathers.halfway),
             (flash, "attention_backward", flash.attention_backward),
             (flash, "_piece_bwd", flash._piece_bwd)]
    if variant == "keep_kv":
        rounds.KVGathers.drop = lambda self, j: _KEPT.append(self._ready.get(j))
    elif variant == "gather_beside_scatter":
        rounds.KVGathers.halfway = lambda self, j: self.start(j + 1)
    elif variant == "fp32_per_block":
        backward, piece_bwd, current = flash.attention_backward, flash._piece_bwd, []

        def attention_backward(do, q, kv, *args, **kwargs):
            current.append(kv)
            try:
                return backward(do, q, kv, *args, **kwargs)
            finally:
                current.pop()
                _KEPT.clear()

        def per_block(*args, **kwargs):
            out = piece_bwd(*args, **kwargs)
            kv = current[-1]
            _KEPT.append(kv.new_zeros(kv.shape, dtype=torch.float32))
            return out

        flash.attention_backward, flash._piece_bwd = attention_backward, per_block
    elif variant is not None:
        raise ValueError(variant)
    try:
        yield
    finally:
        for owner, name, fn in saved:
            setattr(owner, name, fn)
        _KEPT.clear()


def backward_adds(shape: tuple[int, ...], seq: int, variant: str | None) -> int:
    """Bytes one attention layer's backward adds from its start to its peak (bf16), rank 0 of
    a D-rank fake world; runs in a worker process that owns the default process group."""
    os.environ["OMP_NUM_THREADS"] = "1"
    import torch
    import torch.distributed as dist
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.mem_tracker import MemTracker, _ModState
    from torch.testing._internal.distributed.fake_pg import FakeStore

    import tsp_core
    from tsp_core.layers.attention import AttentionShape, TSPAttention

    torch.set_num_threads(1)
    hidden, nq, nkv, head_dim, D = shape
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=D)
    try:
        mesh = tsp_core.init_mesh(D)
        with FakeTensorMode(), broken(variant):
            layer = TSPAttention(mesh, AttentionShape(hidden, nq, nkv, head_dim),
                                 dtype=torch.bfloat16)
            tracker = MemTracker()
            tracker.track_external(layer)
            with tracker:
                x = torch.empty(1, seq // D, hidden, dtype=torch.bfloat16, requires_grad=True)
                dy = torch.empty_like(x)
                layer(x, tsp_core.position_ids(seq, 0, D)[None]).backward(dy)
            snaps = tracker.memory_tracking[layer].snapshots
            (start,) = snaps[_ModState.PRE_BW][0].values()
            (peak,) = snaps[_ModState.PEAK_BW][0].values()
            return int(peak["Total"]) - int(start["Total"])
    finally:
        dist.destroy_process_group()


def floor_growth(shape: tuple[int, ...]) -> tuple[int, int]:
    """(growth of backward_floor_bytes, growth of its whole-sequence part) from SEQ to 4 SEQ."""
    from tsp_core.layers.attention import backward_floor_bytes
    from tsp_core.layers.attention.floor import whole_sequence_bytes

    hidden, nq, nkv, head_dim, D = shape
    kv, q = max(1, nkv // D), nq // D
    floor = [backward_floor_bytes(s, D, head_dim, kv, q, hidden) for s in (SEQ, 4 * SEQ)]
    whole = [whole_sequence_bytes(s, head_dim, kv) for s in (SEQ, 4 * SEQ)]
    return floor[1] - floor[0], whole[1] - whole[0]


VARIANTS = (None, "keep_kv", "fp32_per_block", "gather_beside_scatter")


def test_attention_backward_grows_only_by_its_floor(simulations):
    """From S to 4S the backward's added peak grows by the floor's growth (within SLACK), and
    at least by its whole-sequence part; keeping every group's K/V, a whole-sequence float32
    dK/dV per kernel call, or a gather started beside a reduce-scatter in flight each grow by
    more than the floor allows."""
    runs = [(name, seq, variant) for name in SHAPES for variant in VARIANTS
            for seq in (SEQ, 4 * SEQ) if variant is None or name == "llama-3.1-8b D4"]
    # in the session's simulation workers (tests/support/simulations.py)
    added = list(simulations.map(backward_adds, *zip(*[(SHAPES[n], s, v) for n, s, v in runs])))
    got = dict(zip(runs, added))
    slack = 3 * SEQ * SLACK_PER_TOKEN
    for name, shape in SHAPES.items():
        floor, whole = floor_growth(shape)
        for variant in VARIANTS:
            if (name, SEQ, variant) not in got:
                continue
            growth = got[name, 4 * SEQ, variant] - got[name, SEQ, variant]
            what = (f"{name} {variant or 'as written'}: the backward adds {got[name, SEQ, variant]}"
                    f" bytes at S={SEQ}, {got[name, 4 * SEQ, variant]} at 4S: growth {growth}, "
                    f"floor's {floor} (+ slack {slack}), whole-sequence part {whole}")
            if variant is None:
                assert whole <= growth <= floor + slack, what
            else:
                assert growth > floor + slack, what
