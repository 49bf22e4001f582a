"""TSPAttention against a single-process reference in float64 (docs/design.md "How correctness is
proven"), on a 4-process pool: tsp 1, 2 and 4 run as meshes (4 x 1), (2 x 2) and (1 x 4)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.distributed as dist

from tests.support import dist_pool, reference
from tests.support.reference import assert_close
from tsp_core import TSPAttention, comm
from tsp_core.distributed.params import local
from tsp_core.layers.attention import (
    AttentionParts,
    AttentionShape,
    KVSharing,
    Mask,
    QKNorm,
    ValueNorm,
    Values,
)
from tsp_core.sequence.layout import pad_to_multiple, position_ids, shard_sequence

HIDDEN, HEAD_DIM = 24, 8


class Softsign(Values):
    """A value part no model has, written here as a family would write its own: only ``apply``.
    The schedules and their backward run it through the ``values`` slot unchanged."""

    def apply(self, v: torch.Tensor) -> torch.Tensor:
        return v / (1 + v.abs())


# each values part with its reference, written from the math
VALUES = {
    "norm": (ValueNorm(1e-6, "gemma"),                 # Gemma 4's v_norm: RMS without a scale
             lambda v: v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + 1e-6)),
    "softsign": (Softsign(), lambda v: v / (1 + v.abs())),
}


def full_weights(nq: int, nkv: int, qkv_bias: bool, o_bias: bool, seed: int = 1,
                 head_dim: int = HEAD_DIM, qk_norm: str | None = None, gate: bool = False):
    """``gate``: q_proj's rows per head are [query | output gate] (Qwen3.5)."""
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64) * 0.3  # noqa: E731
    q_rows = nq * head_dim * (2 if gate else 1)
    w = {"q_proj.weight": r(q_rows, HIDDEN), "k_proj.weight": r(nkv * head_dim, HIDDEN),
         "v_proj.weight": r(nkv * head_dim, HIDDEN), "o_proj.weight": r(HIDDEN, nq * head_dim)}
    if qkv_bias:
        w.update({"q_proj.bias": r(q_rows), "k_proj.bias": r(nkv * head_dim),
                  "v_proj.bias": r(nkv * head_dim)})
    if o_bias:
        w["o_proj.bias"] = r(HIDDEN)
    if qk_norm is not None:  # offsets from one (Gemma's numerics: float64 stays float64)
        widths = (nq * head_dim, nkv * head_dim) if qk_norm == "all" else (head_dim, head_dim)
        w.update({"q_norm.weight": r(widths[0]), "k_norm.weight": r(widths[1])})
    return w


def run_parity(tsp: int, nq: int, nkv: int, seq: int, batch: int, qkv_bias: bool = False,
               o_bias: bool = False, window: int | None = None, layout: str = "zigzag",
               causal: bool = True, head_dim: int = HEAD_DIM, qk_norm: str | None = None,
               chunk: int | None = None, sinks: bool = False, values: str | None = None,
               k_eq_v: bool = False, gate: bool = False) -> None:
    mesh = dist_pool.mesh(tsp, layout)
    D, p = mesh.size, mesh.rank
    w = full_weights(nq, nkv, qkv_bias, o_bias, head_dim=head_dim, qk_norm=qk_norm, gate=gate)
    if k_eq_v:  # Gemma 4: no value projection, the values are the raw key projection
        w = {k: t for k, t in w.items() if not k.startswith("v_proj.")}
    if sinks:  # logits of a few units: the sink takes a large share of each row
        w["sinks"] = 2 * torch.randn(nq, generator=torch.Generator().manual_seed(3),
                                     dtype=torch.float64)
    norm = (None if qk_norm is None else
            QKNorm("gemma", 1e-6, scope="token" if qk_norm == "all" else "head"))
    values_part, values_ref = VALUES[values] if values is not None else (Values(), None)
    parts = AttentionParts(qk_norm=norm, values=values_part,
                           mask=Mask(causal, window, chunk, sinks), values_from_keys=k_eq_v,
                           output_gate=gate)
    layer = TSPAttention(mesh, AttentionShape(HIDDEN, nq, nkv, head_dim, qkv_bias, o_bias), parts,
                         dtype=torch.float64)
    layer.load_full(w)
    if sinks:  # sharded with the query heads
        assert tuple(local(layer.sinks).shape) == (nq // D,), tuple(local(layer.sinks).shape)

    gen = torch.Generator().manual_seed(2)
    x = torch.randn(batch, seq, HIDDEN, generator=gen, dtype=torch.float64)
    dy = torch.randn(batch, seq, HIDDEN, generator=gen, dtype=torch.float64)
    ref_w = {k: v.clone().requires_grad_() for k, v in w.items()}
    x_ref = x.clone().requires_grad_()
    y_ref = reference.attention(x_ref, ref_w, nq, nkv, head_dim, causal=causal, window=window,
                                chunk=chunk, qk_norm=qk_norm, values=values_ref,
                                output_gate=gate)
    y_ref.backward(dy)

    # pad at the end (causal: padding cannot reach real tokens); zero upstream grad on padding
    shard = lambda t: shard_sequence(pad_to_multiple(t, D, 0, 1, layout), p, D, 1, layout)  # noqa: E731
    real = shard(torch.ones(1, seq, 1, dtype=torch.bool))[0, :, 0]
    x_loc = shard(x).requires_grad_()
    y = layer(x_loc, position_ids(x_loc.shape[1] * D, p, D, layout))
    y.backward(shard(dy))

    assert_close(y[:, real], shard(y_ref.detach())[:, real], 1e-10, "output")
    assert_close(x_loc.grad[:, real], shard(x_ref.grad)[:, real], 1e-10, "input grad")
    grads = layer.full_tensors(grads=True)
    assert sorted(grads) == sorted(w), f"gradients for {sorted(grads)}, weights {sorted(w)}"
    for name, g in grads.items():
        assert_close(g, ref_w[name].grad, 1e-10, f"grad of {name}")
    dist.barrier()


CASES = [
    dict(nq=8, nkv=8, seq=16, batch=1),
    dict(nq=8, nkv=2, seq=16, batch=2),                       # GQA, g = 4
    dict(nq=4, nkv=1, seq=24, batch=1),                       # MQA: nkv < D at D = 2, 4
    dict(nq=4, nkv=1, seq=16, batch=2, qkv_bias=True),        # MQA slices with biases
    dict(nq=4, nkv=1, seq=16, batch=1, head_dim=6),           # 6 K/V rows: D = 4 pads a slice
    dict(nq=8, nkv=4, seq=16, batch=2, qkv_bias=True, o_bias=True),
    dict(nq=8, nkv=2, seq=13, batch=2),                       # needs padding at every D > 1
    dict(nq=4, nkv=2, seq=32, batch=1, window=5),             # sliding window < chunk
    dict(nq=4, nkv=2, seq=24, batch=1, window=9),
    dict(nq=8, nkv=2, seq=16, batch=2, qkv_bias=True, qk_norm="head"),
    # norms over all heads of a token (OLMo 2: the phased schedule), with K/V slices at D = 4
    dict(nq=8, nkv=2, seq=13, batch=2, qkv_bias=True, o_bias=True, qk_norm="all"),
    dict(nq=4, nkv=1, seq=32, batch=1, window=5, qk_norm="all"),
    # Llama 4's chunked attention: zigzag chunks (of 4, 6, 12 tokens) cross chunk boundaries
    dict(nq=4, nkv=2, seq=24, batch=2, chunk=5),
    # gpt-oss's sinks: with a sliding window, GQA and biases; with K/V
    # slices at D = 4, padding and chunks; with per-head q/k norms
    dict(nq=8, nkv=2, seq=24, batch=2, qkv_bias=True, o_bias=True, window=5, sinks=True),
    dict(nq=4, nkv=1, seq=13, batch=1, chunk=4, sinks=True),
    dict(nq=8, nkv=4, seq=16, batch=1, qk_norm="head", sinks=True),
    # Gemma 4: the unscaled value norm with per-head q/k norms and a sliding window; the values
    # from the key projection (attention_k_eq_v) with and without it, with biases and K/V slices
    dict(nq=8, nkv=2, seq=16, batch=2, qkv_bias=True, qk_norm="head", window=5, values="norm"),
    dict(nq=4, nkv=1, seq=13, batch=1, qkv_bias=True, qk_norm="head", values="norm", k_eq_v=True),
    dict(nq=8, nkv=4, seq=16, batch=1, k_eq_v=True),
    # the values slot under the phased schedule too (norms over a token's heads), and a part
    # written in this file (Softsign) under both schedules, with K/V slices at D = 4
    dict(nq=8, nkv=2, seq=13, batch=2, qkv_bias=True, qk_norm="all", values="norm"),
    dict(nq=4, nkv=1, seq=13, batch=1, qk_norm="all", values="softsign"),
    dict(nq=8, nkv=2, seq=16, batch=2, qkv_bias=True, window=5, values="softsign"),
    # Qwen3.5's output gate ([query | gate] rows per head in q_proj): with per-head q/k norms,
    # GQA and biases; with K/V slices at D = 4, padding and a sliding window
    dict(nq=8, nkv=2, seq=16, batch=2, qkv_bias=True, qk_norm="head", gate=True),
    dict(nq=4, nkv=1, seq=13, batch=1, o_bias=True, window=5, gate=True),
]


@pytest.mark.parametrize("tsp", [1, 2, 4])
@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(f"{k}{v}" for k, v in c.items()))
def test_parity_float64(pool, tsp, case):
    pool.run(run_parity, tsp, **case)


@pytest.mark.parametrize("tsp", [2, 4])
def test_parity_contiguous_layout(pool, tsp):
    pool.run(run_parity, tsp, nq=8, nkv=2, seq=16, batch=1, layout="contiguous")
    pool.run(run_parity, tsp, nq=8, nkv=8, seq=16, batch=1, layout="contiguous", causal=False)


def run_kv_route(tsp: int, nq: int, nkv: int, seq: int, batch: int, qkv_bias: bool = False,
                 qk_norm: str | None = None) -> None:
    """Two layers on one route (``KVSharing`` "store" then "reuse", as a sharing policy gives
    them) against the reference of the math: the reusing layer's queries attend with the storing
    layer's keys (after its key norm and RoPE) and values, and the gradient of both layers'
    outputs reaches the storing layer's K/V projections."""
    mesh = dist_pool.mesh(tsp, "zigzag")
    D, p = mesh.size, mesh.rank
    shape = AttentionShape(HIDDEN, nq, nkv, HEAD_DIM, qkv_bias)
    norm = None if qk_norm is None else QKNorm("gemma", 1e-6)
    w_store = full_weights(nq, nkv, qkv_bias, False, seed=1, qk_norm=qk_norm)
    w_reuse = {k: t for k, t in full_weights(nq, nkv, qkv_bias, False, seed=4,
                                             qk_norm=qk_norm).items()
               if k.startswith(("q_proj.", "o_proj.", "q_norm."))}  # no K/V of its own
    store, reuse = (TSPAttention(mesh, shape, AttentionParts(qk_norm=norm,
                                                             kv_sharing=KVSharing(role, "a")),
                                 dtype=torch.float64) for role in ("store", "reuse"))
    store.load_full(w_store)
    reuse.load_full(w_reuse)

    gen = torch.Generator().manual_seed(2)
    x, dy_store, dy_reuse = (torch.randn(batch, seq, HIDDEN, generator=gen, dtype=torch.float64)
                             for _ in range(3))
    ref_store = {k: v.clone().requires_grad_() for k, v in w_store.items()}
    ref_reuse = {k: v.clone().requires_grad_() for k, v in w_reuse.items()}
    borrowed = {k: t for k, t in ref_store.items()
                if k.startswith(("k_proj.", "v_proj.", "k_norm."))}
    x_ref = x.clone().requires_grad_()
    y_store = reference.attention(x_ref, ref_store, nq, nkv, HEAD_DIM, qk_norm=qk_norm)
    y_reuse = reference.attention(x_ref, {**ref_reuse, **borrowed}, nq, nkv, HEAD_DIM,
                                  qk_norm=qk_norm)
    ((y_store * dy_store).sum() + (y_reuse * dy_reuse).sum()).backward()

    shard = lambda t: shard_sequence(pad_to_multiple(t, D, 0, 1), p, D, 1)  # noqa: E731
    real = shard(torch.ones(1, seq, 1, dtype=torch.bool))[0, :, 0]
    x_loc = shard(x).requires_grad_()
    pos = position_ids(x_loc.shape[1] * D, p, D)
    y, kv_all = store(x_loc, pos)
    y2 = reuse(x_loc, pos, shared_kv=kv_all)
    ((y * shard(dy_store)).sum() + (y2 * shard(dy_reuse)).sum()).backward()

    assert_close(y[:, real], shard(y_store.detach())[:, real], 1e-10, "storing layer's output")
    assert_close(y2[:, real], shard(y_reuse.detach())[:, real], 1e-10, "reusing layer's output")
    assert_close(x_loc.grad[:, real], shard(x_ref.grad)[:, real], 1e-10, "input grad")
    for layer, ref in ((store, ref_store), (reuse, ref_reuse)):
        grads = layer.full_tensors(grads=True)
        assert sorted(grads) == sorted(ref), f"gradients for {sorted(grads)}, weights {sorted(ref)}"
        for name, g in grads.items():
            assert_close(g, ref[name].grad, 1e-10, f"grad of {name}")
    dist.barrier()


@pytest.mark.parametrize("tsp", [1, 2, 4])
def test_kv_route_matches_the_math(pool, tsp):
    pool.run(run_kv_route, tsp, nq=8, nkv=2, seq=16, batch=2)
    # K/V slices at D = 4 (nkv < D), biases, per-head q/k norms, padding
    pool.run(run_kv_route, tsp, nq=4, nkv=1, seq=13, batch=1, qkv_bias=True, qk_norm="head")


def count_collectives(tsp: int, nq: int, nkv: int, seq: int, batch: int, qkv_bias: bool,
                      all_heads: bool = False, sinks: bool = False, gate: bool = False):
    mesh = dist_pool.mesh(tsp)
    norm = QKNorm(eps=1e-6, scope="token") if all_heads else None
    parts = AttentionParts(qk_norm=norm, mask=Mask(sinks=sinks), output_gate=gate)
    layer = TSPAttention(mesh, AttentionShape(HIDDEN, nq, nkv, HEAD_DIM, qkv_bias), parts,
                         dtype=torch.float64)
    x = torch.randn(batch, seq // tsp, HIDDEN, dtype=torch.float64, requires_grad=True)
    pos = position_ids(seq, mesh.rank, tsp)
    with comm.track() as fwd:
        y = layer(x, pos)
    with comm.track() as bwd:
        y.sum().backward()
    return dict(fwd.calls), dict(bwd.calls), dict(fwd.bytes), dict(bwd.bytes)


class _Waited:
    """A ``torch.distributed`` work whose first ``wait()`` is logged (gloo's work objects take no
    new attributes, so the test hands this to the code instead)."""

    def __init__(self, work: object, log: Callable[[], None]) -> None:
        self.work, self.log = work, log

    def wait(self, *args, **kwargs):
        if self.log is not None:
            self.log, log = None, self.log
            log()
        return self.work.wait(*args, **kwargs)


def overlap_events(tsp: int, nq: int, nkv: int) -> list[str]:
    """The order in which one layer's forward and backward start and wait for their collectives
    and compute attention. "bcast", "gather", "rs": the schedule starts a round's owner broadcast,
    a K/V all-gather, a dK/dV reduce-scatter (through comm); "bcast_done", "gather_done",
    "rs_done": that transfer is waited for, logged where ``torch.distributed``'s work is waited
    for, or where a blocking call returns, so that a wait inside comm before the handle is
    returned shows as early as it happens; "attend", "attend_bwd": one round's attention forward
    and backward starts ("attend_bwd_end": that backward returns); "backward" between the
    passes."""
    from tsp_core.layers import flash

    mesh = dist_pool.mesh(tsp)
    layer = TSPAttention(mesh, AttentionShape(HIDDEN, nq, nkv, HEAD_DIM), dtype=torch.float64)
    x = torch.randn(1, 16 // tsp, HIDDEN, dtype=torch.float64, requires_grad=True)
    events: list[str] = []
    issuing: list[str | None] = []  # the schedule collective being started: names its transfers

    def logged(name, fn):
        def call(*args, **kwargs):
            events.append(name)
            return fn(*args, **kwargs)
        return call

    def bracketed(name, fn):
        def call(*args, **kwargs):
            events.append(name)
            out = fn(*args, **kwargs)
            events.append(name + "_end")
            return out
        return call

    def started(name, fn):
        def call(*args, **kwargs):
            events.append(name)
            issuing.append(name)
            try:
                return fn(*args, **kwargs)
            finally:
                issuing.pop()
        return call

    def transfer(fn):
        def call(*args, async_op: bool = False, **kwargs):
            if not issuing or issuing[-1] is None:  # not a schedule collective (the K/V weight
                return fn(*args, async_op=async_op, **kwargs)  # slices'), or called inside one
            done = issuing[-1] + "_done"
            issuing.append(None)
            try:
                work = fn(*args, async_op=async_op, **kwargs)
            finally:
                issuing.pop()
            if not async_op:  # a blocking call: done on return
                events.append(done)
                return work
            return _Waited(work, lambda: events.append(done))
        return call

    patches = [(comm, "broadcast", started("bcast", comm.broadcast)),
               (comm, "start_all_gather_sequence",
                started("gather", comm.start_all_gather_sequence)),
               (comm, "start_reduce_scatter_sequence",
                started("rs", comm.start_reduce_scatter_sequence)),
               (flash, "attention_forward", logged("attend", flash.attention_forward)),
               (flash, "attention_backward", bracketed("attend_bwd", flash.attention_backward))]
    patches += [(dist, name, transfer(getattr(dist, name))) for name in
                ("broadcast", "all_gather_single", "all_gather_into_tensor",
                 "reduce_scatter_single", "reduce_scatter_tensor") if hasattr(dist, name)]
    saved = [(owner, name, getattr(owner, name)) for owner, name, _ in patches]
    for owner, name, fn in patches:
        setattr(owner, name, fn)
    try:
        y = layer(x, position_ids(16, mesh.rank, tsp))
        events.append("backward")
        y.sum().backward()
    finally:
        for owner, name, fn in saved:
            setattr(owner, name, fn)
    return events


@pytest.mark.parametrize("tsp,nq,nkv", [(4, 8, 8), (4, 8, 2), (2, 4, 4)])
def test_collectives_overlap_the_rounds(pool, tsp, nq, nkv):
    """While round r attends, the K/V all-gather of round r+1 and the owner broadcast of round
    r+2 are in flight: started before, waited for only after it. In the backward the next round's
    broadcast is in flight during the round's attention backward; a head's dK/dV reduce-scatter,
    started after its last round, is waited for inside the attention backward of the next head's
    first round, and only then, inside that same call, is the gather of the head after it started:
    a gather and a reduce-scatter are never in flight together (docs/design.md "Overlap";
    docs/memory.md "The attention backward's floor"). A wait before the schedule needs the data (a
    blocking call, or a handle waited for inside comm) puts a "_done" too early and fails here."""
    D, R = tsp, max(1, tsp // nkv)
    heads = D // R
    for events in pool.run(overlap_events, tsp, nq, nkv):
        cut = events.index("backward")
        fwd, bwd = events[:cut], events[cut + 1:]
        at = [i for i, e in enumerate(fwd) if e == "attend"]
        assert len(at) == D, fwd
        for r, i in enumerate(at):
            assert fwd[:i].count("bcast") >= min(D, r + 3), (r, fwd)
            assert fwd[:i].count("gather") >= min(heads, (r + 1) // R + 1), (r, fwd)
            # waited for: the K/V of the heads used so far, the shards of rounds 0..r+1
            assert fwd[:i].count("gather_done") == r // R + 1, (r, fwd)
            assert fwd[:i].count("bcast_done") == min(D, r + 2), (r, fwd)
        assert fwd.count("gather_done") == heads and fwd.count("bcast_done") == D, fwd
        at = [i for i, e in enumerate(bwd) if e == "attend_bwd"]
        end = [i for i, e in enumerate(bwd) if e == "attend_bwd_end"]
        done = [i for i, e in enumerate(bwd) if e == "rs_done"]
        gathers = [i for i, e in enumerate(bwd) if e == "gather"]
        assert len(at) == len(end) == D and bwd.count("rs") == len(done) == heads, bwd
        assert len(gathers) == heads, bwd
        for r, (i, e) in enumerate(zip(at, end)):
            j = r // R
            assert bwd[:i].count("bcast") >= min(D, r + 2), (r, bwd)
            assert bwd[:i].count("gather_done") == j + 1, (r, bwd)
            assert bwd[:i].count("bcast_done") == r + 1, (r, bwd)
            if r % R:
                continue
            if j > 0:  # head j-1's dK/dV arrive during head j's first attention backward
                assert i < done[j - 1] < e, (r, " ".join(bwd))
            if j + 1 < heads:  # then head j+1's gather starts, in the same call
                assert i < gathers[j + 1] < e and (j == 0 or done[j - 1] < gathers[j + 1]), (r, bwd)
        for g in gathers:  # never a K/V gather started beside a dK/dV reduce-scatter in flight
            assert bwd[:g].count("rs") == bwd[:g].count("rs_done"), bwd
        assert bwd.count("gather_done") == heads and bwd.count("bcast_done") == D, bwd


@pytest.mark.parametrize("tsp,nq,nkv,bias,all_heads,sinks",
                         [(2, 8, 8, False, False, False), (4, 8, 2, True, False, False),
                          (4, 4, 1, False, False, False), (4, 8, 4, True, False, False),
                          (2, 4, 1, True, False, False), (4, 8, 4, True, True, False),
                          (4, 4, 1, True, True, False), (4, 8, 2, True, False, True),
                          (2, 4, 4, False, False, True)])
def test_collective_counts(pool, tsp, nq, nkv, bias, all_heads, sinks):
    """Exact calls and bytes of one layer on every rank. With nkv >= D a round broadcasts all four
    projections of a head group; with nkv < D the rounds broadcast q/o only, the key/value slices
    are all-gathered once per pass (and their gradients reduce-scattered once), and each
    key/value head's K/V is gathered once, not once per round that uses it. With q/k norms over
    all heads (the phased schedule) the output projection goes in rounds of its own: twice the
    broadcasts and reduces, the same bytes; the norms' replicated weight gradients are summed.
    With attention sinks (the default schedule) each round's shard carries its owner's sinks
    (one logit per head) and their gradient: no collective more, nq/D numbers more per round."""
    D, seq, batch = tsp, 16, 2
    replicas = max(1, D // nkv)
    sliced = int(replicas > 1)
    heads_gathered = D // replicas
    nq_l, nkv_l = nq // D, max(1, nkv // D)
    if sliced:
        shard = 2 * nq_l * HEAD_DIM * HIDDEN + bias * nq_l * HEAD_DIM
        per = -(-nkv * HEAD_DIM // D)
        kv_weights = D * (2 * per * HIDDEN + bias * 2 * per)  # all-gathered [D, slices]
    else:
        shard = (2 * nq_l + 2 * nkv_l) * HEAD_DIM * HIDDEN + bias * (nq_l + 2 * nkv_l) * HEAD_DIM
        kv_weights = 0
    shard += sinks * nq_l
    kv = 2 * batch * seq * nkv_l * HEAD_DIM
    frac = (D - 1) / D
    rounds = D * (1 + all_heads)
    norms = {"all_reduce": 2} if all_heads else {}
    for fwd, bwd, fwd_bytes, bwd_bytes in pool.run(count_collectives, tsp, nq, nkv, seq, batch,
                                                   bias, all_heads, sinks):
        assert fwd == {"broadcast": rounds, "all_gather": heads_gathered + sliced}, fwd
        assert bwd == {"broadcast": rounds, "all_gather": heads_gathered + sliced,
                       "reduce_scatter": heads_gathered + sliced, "reduce": rounds, **norms}, bwd
        if all_heads:
            assert bwd_bytes["all_reduce"] == pytest.approx(
                2 * (nq + nkv) * HEAD_DIM * 8 * frac)
        assert fwd_bytes["broadcast"] == pytest.approx(D * frac * shard * 8)
        assert fwd_bytes["all_gather"] == pytest.approx(
            (heads_gathered * kv + kv_weights) * frac * 8)
        assert bwd_bytes["reduce"] == pytest.approx(D * frac * shard * 8)
        assert bwd_bytes["reduce_scatter"] == pytest.approx(
            (heads_gathered * kv + kv_weights) * frac * 8)


def counts_with_and_without_gate(tsp: int, nq: int, nkv: int, bias: bool):
    return [count_collectives(tsp, nq, nkv, 16, 2, bias, gate=gate) for gate in (False, True)]


@pytest.mark.parametrize("tsp,nq,nkv,bias", [(4, 8, 2, True), (4, 4, 1, False)])
def test_output_gate_adds_no_collective(pool, tsp, nq, nkv, bias):
    """The output gate (Qwen3.5) travels inside the query shard: the same calls in both passes,
    and only the broadcasts and owner reduces grow, by the gate's rows of q_proj (nq/D heads of
    head_dim rows, plus their biases) per round; the K/V all-gathers and reduce-scatters are
    unchanged."""
    D = tsp
    extra = D * (D - 1) / D * (nq // D) * HEAD_DIM * (HIDDEN + bias) * 8
    for plain, gated in pool.run(counts_with_and_without_gate, tsp, nq, nkv, bias):
        assert plain[:2] == gated[:2], (plain[:2], gated[:2])  # calls, forward and backward
        for before, after in ((plain[2], gated[2]), (plain[3], gated[3])):  # bytes
            assert sorted(before) == sorted(after), (before, after)
            for name in before:
                grow = extra if name in ("broadcast", "reduce") else 0
                assert after[name] == pytest.approx(before[name] + grow), (name, before, after)


def saved_for_backward(tsp: int, gate: bool) -> int:
    """Bytes of the distinct storages one layer's forward saves for its backward (every tensor
    autograd packs: the schedule's ``save_for_backward`` and whatever runs around it)."""
    mesh = dist_pool.mesh(tsp)
    layer = TSPAttention(mesh, AttentionShape(HIDDEN, 8, 2, HEAD_DIM, qkv_bias=True),
                         AttentionParts(qk_norm=QKNorm(eps=1e-6), output_gate=gate),
                         dtype=torch.float64)
    x = torch.randn(2, 32 // tsp, HIDDEN, dtype=torch.float64, requires_grad=True)
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = layer(x, position_ids(32, mesh.rank, tsp))
    y.sum().backward()
    return sum(storages.values())


def test_output_gate_keeps_nothing_more_for_backward(pool):
    """The memory rule with the output gate: the forward keeps only this rank's own q_proj shard
    grown by its gate rows ((nq/D) head_dim (hidden + 1) numbers); the gate itself, [B, S/D,
    (nq/D) head_dim] of this rank's tokens per round, is recomputed in the backward, not
    kept."""
    for tsp in (2, 4):
        for plain, gated in zip(*(pool.run(saved_for_backward, tsp, g) for g in (False, True))):
            assert gated - plain == 8 // tsp * HEAD_DIM * (HIDDEN + 1) * 8, (tsp, plain, gated)


def test_size_errors_list_exactly_the_sizes_that_work():
    # each check names the sizes that would pass it, exactly those it accepts (raised before
    # any collective: these checks need no process group)
    from types import SimpleNamespace

    from tsp_core.layers.attention import check_attention_shape
    from tsp_core.layers.mlp import TSPGatedMLP
    from tsp_core.layers.moe import check_moe_shape
    from tsp_core.layers.sizes import valid_tsp_sizes

    with pytest.raises(ValueError, match=r"^tsp_size \(8\) must divide num_attention_heads "
                                         r"\(12\); valid tsp_size values for 12 query and 12 "
                                         r"key/value heads: 1, 2, 3, 4, 6, 12$"):
        check_attention_shape(8, 768, 12, 12, 64)
    with pytest.raises(ValueError, match=r"^num_key_value_heads \(4\) and tsp_size \(6\): one "
                                         r"must divide the other, .*; valid tsp_size values for "
                                         r"12 query and 4 key/value heads: 1, 2, 4, 12$"):
        check_attention_shape(6, 768, 12, 4, 64)
    for nq, nkv, want in ((12, 12, [1, 2, 3, 4, 6, 12]), (12, 4, [1, 2, 4, 12]),
                          (32, 8, [1, 2, 4, 8, 16, 32]), (8, 1, [1, 2, 4, 8]), (6, 3, [1, 3, 6])):
        assert valid_tsp_sizes(nq, nkv) == want, (nq, nkv)
        for d in range(1, 2 * nq + 1):
            try:
                check_attention_shape(d, 8 * nq, nq, nkv, 8)
                accepted = True
            except ValueError as e:
                accepted = False
                assert str(e).endswith(f"{nkv} key/value heads: {', '.join(map(str, want))}"), e
            assert accepted == (d in want), (nq, nkv, d)
    with pytest.raises(ValueError, match=r"^tsp_size \(4\) must divide intermediate_size \(66\); "
                                         r"valid tsp_size values for intermediate_size 66: 1, 2, "
                                         r"3, 6, 11, 22, 33, 66$"):
        TSPGatedMLP(SimpleNamespace(size=4), 64, 66)
    for d in range(1, 13):  # experts owned whole: the divisors of 6
        try:
            check_moe_shape(d, 6, 2)
            accepted = True
        except ValueError as e:
            accepted = False
            assert "; valid tsp_size values for 6 experts: 1, 2, 3, 6; or moe_schedule" in str(e)
        assert accepted == (d in (1, 2, 3, 6)), d


def test_chunk_errors_before_any_collective():
    # raised when the layer is built (a mesh with no process group behind it)
    from types import SimpleNamespace

    with pytest.raises(ValueError, match=r"^attention_chunk_size \(4\) needs causal attention "
                                         r"\(causal=False\) and a chunk of at least 1 token$"):
        TSPAttention(SimpleNamespace(size=2), AttentionShape(16, 4, 2, 8),
                     AttentionParts(mask=Mask(causal=False, chunk_size=4)))
    with pytest.raises(ValueError, match=r"^attention_chunk_size \(0\) needs causal"):
        TSPAttention(SimpleNamespace(size=2), AttentionShape(16, 4, 2, 8),
                     AttentionParts(mask=Mask(chunk_size=0)))


def test_parts_refuse_unsupported_combinations_in_one_place():
    # AttentionParts.check, the one refusal point, names what no schedule runs (the phased
    # schedule of q/k norms over a token's heads has no output gate, KV sharing,
    # weightless norm or norm after RoPE), before any collective; TSPAttention raises the same,
    # and the messages live in parts.py only
    from pathlib import Path
    from types import SimpleNamespace

    import tsp_core

    shape, token = AttentionShape(16, 4, 2, 8), QKNorm(eps=1e-6, scope="token")
    cases = [
        (AttentionParts(qk_norm=token, output_gate=True),
         r"^output_gate \(a per-head output gate\) is implemented on the default schedule only, "
         r"not with qk_norm_all_heads$"),
        (AttentionParts(qk_norm=token, kv_sharing=KVSharing("store", 0)),
         r"^KV-shared layers \(KVSharing\) are implemented on the default schedule"),
        (AttentionParts(qk_norm=QKNorm("l2", scope="token")),
         r"^the 'l2' q/k norm \(no weight\) is per head; qk_norm_all_heads is not implemented"),
        (AttentionParts(qk_norm=QKNorm(scope="token", after_rope=True)),
         r"^qk_norm_after_rope is implemented for per-head q/k norms only"),
        (AttentionParts(qk_norm=QKNorm("rms")), r"^unknown q/k norm kind 'rms'; one of \["),
        (AttentionParts(mask=Mask(causal=False, chunk_size=4)),
         r"^attention_chunk_size \(4\) needs causal attention \(causal=False\)"),
    ]
    for parts, message in cases:
        with pytest.raises(ValueError, match=message):
            parts.check(shape, 2)
        with pytest.raises(ValueError, match=message):
            TSPAttention(SimpleNamespace(size=2), shape, parts)
    assert AttentionParts(qk_norm=token, mask=Mask(sinks=True)).check(shape, 2) == shape
    root = Path(tsp_core.__file__).parent
    for phrase in ("schedule only, not with qk_norm_all_heads", "and a chunk of at least 1 token",
                   "implemented for per-head q/k norms only", "is not implemented for it"):
        holders = sorted(f.relative_to(root).as_posix() for f in root.rglob("*.py")
                         if phrase in f.read_text())
        assert holders == ["layers/attention/parts.py"], (phrase, holders)
