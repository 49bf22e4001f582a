"""TSPGatedMLP and TSPPlainMLP (the ungated MLP, xIELU) against a single-process reference in
float64, and the ring schedule's hop counts."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from tests.support import dist_pool, reference
from tests.support.reference import assert_close
from tsp_core import TSPGatedMLP, comm
from tsp_core.layers.mlp import TSPPlainMLP
from tsp_core.sequence.layout import shard_sequence

HIDDEN, FFN = 16, 48


def run_parity(tsp: int, activation: str, bias: bool, seq: int, batch: int) -> None:
    mesh = dist_pool.mesh(tsp)
    D, p = mesh.size, mesh.rank
    gen = torch.Generator().manual_seed(3)
    r = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64) * 0.5  # noqa: E731
    w = {"gate_proj.weight": r(FFN, HIDDEN), "up_proj.weight": r(FFN, HIDDEN),
         "down_proj.weight": r(HIDDEN, FFN)}
    if bias:
        w.update({"gate_proj.bias": r(FFN), "up_proj.bias": r(FFN), "down_proj.bias": r(HIDDEN)})
    layer = TSPGatedMLP(mesh, HIDDEN, FFN, activation=activation, bias=bias, dtype=torch.float64)
    layer.load_full(w)
    x = r(batch, seq, HIDDEN)
    dy = r(batch, seq, HIDDEN)
    ref_w = {k: v.clone().requires_grad_() for k, v in w.items()}
    x_ref = x.clone().requires_grad_()
    reference.gated_mlp(x_ref, ref_w, activation).backward(dy)

    x_loc = shard_sequence(x, p, D).requires_grad_()
    y = layer(x_loc)
    y.backward(shard_sequence(dy, p, D))
    assert_close(y, shard_sequence(reference.gated_mlp(x, w, activation), p, D), 1e-10, "output")
    assert_close(x_loc.grad, shard_sequence(x_ref.grad, p, D), 1e-10, "input grad")
    grads = layer.full_tensors(grads=True)
    assert sorted(grads) == sorted(w)
    for name, g in grads.items():
        assert_close(g, ref_w[name].grad, 1e-10, f"grad of {name}")
    dist.barrier()


@pytest.mark.parametrize("tsp", [1, 2, 4])
@pytest.mark.parametrize("activation,bias", [("silu", False), ("gelu_tanh", True)])
def test_parity_float64(pool, tsp, activation, bias):
    pool.run(run_parity, tsp, activation, bias, seq=16, batch=2)


def count_hops(tsp: int):
    mesh = dist_pool.mesh(tsp)
    layer = TSPGatedMLP(mesh, HIDDEN, FFN, dtype=torch.float64)
    x = torch.randn(2, 16 // tsp, HIDDEN, dtype=torch.float64, requires_grad=True)
    with comm.track() as fwd:
        y = layer(x)
    with comm.track() as bwd:
        y.sum().backward()
    return dict(fwd.calls), dict(bwd.calls), fwd.bytes["ring_pass"], bwd.bytes["ring_pass"]


@pytest.mark.parametrize("tsp", [1, 2, 4])
def test_ring_hops(pool, tsp):
    D = tsp
    shard_bytes = 3 * FFN // D * HIDDEN * 8
    for rank, (fwd, bwd, fwd_bytes, bwd_bytes) in enumerate(pool.run(count_hops, tsp)):
        # forward: D-1 weight hops; backward: D-1 weight hops + D gradient hops (last to owner)
        assert fwd == ({"ring_pass": D - 1} if D > 1 else {}), (rank, fwd)
        assert bwd == ({"ring_pass": 2 * D - 1} if D > 1 else {}), (rank, bwd)
        assert fwd_bytes == (D - 1) * shard_bytes, (rank, fwd_bytes)
        assert bwd_bytes == ((2 * D - 1) * shard_bytes if D > 1 else 0), (rank, bwd_bytes)


# ------------------------------------------------------------------ the plain (ungated) MLP

def run_plain_parity(tsp: int, activation: str, bias: bool, tile: int) -> None:
    """TSPPlainMLP (Apertus's ``down(act(up(x)))``) against the same math on one process in
    float64, xIELU being transformers' own ``XIELUActivation`` (alpha_p, alpha_n, beta and eps
    away from their defaults): output, input gradient and every parameter's gradient (alpha_p's
    and alpha_n's summed over the ranks), in tiles of ``tile`` tokens."""
    from transformers.activations import XIELUActivation

    mesh = dist_pool.mesh(tsp)
    D, p = mesh.size, mesh.rank
    gen = torch.Generator().manual_seed(5)
    r = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64) * 0.5  # noqa: E731
    w = {"up_proj.weight": r(FFN, HIDDEN), "down_proj.weight": r(HIDDEN, FFN)}
    if bias:
        w.update({"up_proj.bias": r(FFN), "down_proj.bias": r(HIDDEN)})
    act = torch.nn.SiLU()
    full = dict(w)
    if activation == "xielu":
        act = XIELUActivation(alpha_p_init=0.7, alpha_n_init=0.9, beta=0.45, eps=-1e-3,
                              dtype=torch.float64)
        full.update({f"act_fn.{n}": t.detach().clone() for n, t in act.named_parameters()})
        full.update({f"act_fn.{n}": t.clone() for n, t in act.named_buffers()})
    layer = TSPPlainMLP(mesh, HIDDEN, FFN, activation=activation, bias=bias, dtype=torch.float64,
                        tile_tokens=tile)
    layer.load_full(full)

    def reference_mlp(x, w):
        up = F.linear(x, w["up_proj.weight"], w.get("up_proj.bias"))
        return F.linear(act(up), w["down_proj.weight"], w.get("down_proj.bias"))

    x, dy = r(2, 16, HIDDEN), r(2, 16, HIDDEN)
    ref_w = {k: v.clone().requires_grad_() for k, v in w.items()}
    x_ref = x.clone().requires_grad_()
    reference_mlp(x_ref, ref_w).backward(dy)
    ref_grads = {n: t.grad for n, t in ref_w.items()}
    ref_grads.update({f"act_fn.{n}": t.grad for n, t in act.named_parameters()})
    x_loc = shard_sequence(x, p, D).requires_grad_()
    y = layer(x_loc)
    y.backward(shard_sequence(dy, p, D))
    with torch.no_grad():
        expected = reference_mlp(x, w)
    assert_close(y, shard_sequence(expected, p, D), 1e-10, "output")
    assert_close(x_loc.grad, shard_sequence(x_ref.grad, p, D), 1e-10, "input grad")
    grads = layer.full_tensors(grads=True)
    assert sorted(grads) == sorted(ref_grads)
    for name, g in grads.items():
        assert_close(g, ref_grads[name], 1e-10, f"grad of {name}")
    dist.barrier()


@pytest.mark.parametrize("tsp,activation,bias", [(1, "xielu", True), (2, "xielu", False),
                                                 (4, "xielu", True), (2, "silu", True)])
def test_plain_parity_float64(pool, tsp, activation, bias):
    # tiles of 3 tokens: several per rank (16 local tokens at tsp 1, 4 at tsp 4), the last shorter
    pool.run(run_plain_parity, tsp, activation, bias, 3)
