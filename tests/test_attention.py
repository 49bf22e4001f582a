"""TSPAttention against a single-process reference in float64 (DESIGN 7), on a 4-process pool:
tsp 1, 2 and 4 run as meshes (4 x 1), (2 x 2) and (1 x 4)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from tsp_core import TSPAttention, comm
from tsp_core.layout import pad_to_multiple, position_ids, shard_sequence

from . import dist_pool, reference
from .reference import assert_close

HIDDEN, HEAD_DIM = 24, 8


@pytest.fixture(scope="module")
def pool():
    p = dist_pool.DistPool(4)
    yield p
    p.close()


def full_weights(nq: int, nkv: int, qkv_bias: bool, o_bias: bool, seed: int = 1):
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64) * 0.3  # noqa: E731
    w = {"q_proj.weight": r(nq * HEAD_DIM, HIDDEN), "k_proj.weight": r(nkv * HEAD_DIM, HIDDEN),
         "v_proj.weight": r(nkv * HEAD_DIM, HIDDEN), "o_proj.weight": r(HIDDEN, nq * HEAD_DIM)}
    if qkv_bias:
        w.update({"q_proj.bias": r(nq * HEAD_DIM), "k_proj.bias": r(nkv * HEAD_DIM),
                  "v_proj.bias": r(nkv * HEAD_DIM)})
    if o_bias:
        w["o_proj.bias"] = r(HIDDEN)
    return w


def run_parity(tsp: int, nq: int, nkv: int, seq: int, batch: int, qkv_bias: bool = False,
               o_bias: bool = False, window: int | None = None, layout: str = "zigzag",
               causal: bool = True) -> None:
    mesh = dist_pool.mesh(tsp, layout)
    D, p = mesh.size, mesh.rank
    w = full_weights(nq, nkv, qkv_bias, o_bias)
    layer = TSPAttention(mesh, HIDDEN, nq, nkv, HEAD_DIM, qkv_bias=qkv_bias, o_bias=o_bias,
                         sliding_window=window, causal=causal, dtype=torch.float64)
    layer.load_full(w)

    gen = torch.Generator().manual_seed(2)
    x = torch.randn(batch, seq, HIDDEN, generator=gen, dtype=torch.float64)
    dy = torch.randn(batch, seq, HIDDEN, generator=gen, dtype=torch.float64)
    ref_w = {k: v.clone().requires_grad_() for k, v in w.items()}
    x_ref = x.clone().requires_grad_()
    y_ref = reference.attention(x_ref, ref_w, nq, nkv, HEAD_DIM, causal=causal, window=window)
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
    dict(nq=8, nkv=4, seq=16, batch=2, qkv_bias=True, o_bias=True),
    dict(nq=8, nkv=2, seq=13, batch=2),                       # needs padding at every D > 1
    dict(nq=4, nkv=2, seq=32, batch=1, window=5),             # sliding window < chunk
    dict(nq=4, nkv=2, seq=24, batch=1, window=9),
]


@pytest.mark.parametrize("tsp", [1, 2, 4])
@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(f"{k}{v}" for k, v in c.items()))
def test_parity_float64(pool, tsp, case):
    pool.run(run_parity, tsp, **case)


@pytest.mark.parametrize("tsp", [2, 4])
def test_parity_contiguous_layout(pool, tsp):
    pool.run(run_parity, tsp, nq=8, nkv=2, seq=16, batch=1, layout="contiguous")
    pool.run(run_parity, tsp, nq=8, nkv=8, seq=16, batch=1, layout="contiguous", causal=False)


def count_collectives(tsp: int, nq: int, nkv: int, seq: int, batch: int, qkv_bias: bool):
    mesh = dist_pool.mesh(tsp)
    layer = TSPAttention(mesh, HIDDEN, nq, nkv, HEAD_DIM, qkv_bias=qkv_bias, dtype=torch.float64)
    x = torch.randn(batch, seq // tsp, HIDDEN, dtype=torch.float64, requires_grad=True)
    pos = position_ids(seq, mesh.rank, tsp)
    with comm.track() as fwd:
        y = layer(x, pos)
    with comm.track() as bwd:
        y.sum().backward()
    return dict(fwd.calls), dict(bwd.calls), dict(fwd.bytes), dict(bwd.bytes)


@pytest.mark.parametrize("tsp,nq,nkv,bias", [(2, 8, 8, False), (4, 8, 2, True), (4, 4, 1, False)])
def test_collective_counts(pool, tsp, nq, nkv, bias):
    D, seq, batch = tsp, 16, 2
    fwd, bwd, fwd_bytes, bwd_bytes = pool.run(count_collectives, tsp, nq, nkv, seq, batch, bias)[0]
    replicas = max(1, D // nkv)
    assert fwd == {"broadcast": D, "all_gather": D}, fwd
    expected_bwd = {"broadcast": D, "all_gather": D, "reduce_scatter": D, "reduce": D}
    if replicas > 1:
        expected_bwd["all_reduce"] = 1
    assert bwd == expected_bwd, bwd
    # bytes: one packed shard per broadcast, packed local K|V per gather (float64)
    nq_l, nkv_l = nq // D, max(1, nkv // D)
    shard = (2 * nq_l + 2 * nkv_l) * HEAD_DIM * HIDDEN + (bias * (nq_l + 2 * nkv_l) * HEAD_DIM)
    kv = 2 * batch * seq * nkv_l * HEAD_DIM
    frac = (D - 1) / D
    assert fwd_bytes["broadcast"] == pytest.approx(D * frac * shard * 8)
    assert fwd_bytes["all_gather"] == pytest.approx(D * frac * kv * 8)
    assert bwd_bytes["reduce"] == pytest.approx(D * frac * shard * 8)
    assert bwd_bytes["reduce_scatter"] == pytest.approx(D * frac * kv * 8)
