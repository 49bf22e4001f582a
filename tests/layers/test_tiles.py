"""Token tiles (tsp_core.layers.tiles, docs/design.md "Long context"): the gated MLP, the
mixture-of-experts ring and the vocabulary-parallel loss take a rank's tokens a tile at a time.

- Exactness: in float64, tiles several times smaller than the local tokens give the untiled
  numbers and the plain-math ones (forward and every gradient) at tsp 1 and 2: the MLP (SiLU,
  tanh-GELU with biases), both mixture-of-experts schedules, the loss and the token statistics.
- Memory, under fake tensors (a simulation worker, the fake process group, MemTracker): what the
  MLP and the loss add while they run is the same at S and 4S local tokens with a fixed tile, up
  to the [tokens, h] rows of their own outputs and per-token scalars; it grows with S untiled and
  when the tile is ignored (the broken variant, run here); one tile's working set is at most
  MLP_TILE_TENSORS [tile, F/D] tensors (the plain MLP's with xIELU: PLAIN_TILE_TENSORS, its
  tile chosen smaller by plain_tile_tokens), LOSS_TILE_TENSORS [tile, V/D] float32 ones.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from tests.support import dist_pool, reference
from tests.support.reference import assert_close
from tsp_core import comm
from tsp_core.layers import tiles
from tsp_core.layers.mlp import PLAIN_TILE_TENSORS, TSPGatedMLP, TSPPlainMLP, plain_tile_tokens
from tsp_core.layers.moe import MoESpec, dispatch_combine
from tsp_core.layers.moe.ring import RingExpertsFn
from tsp_core.layers.vocab import TSPLMHead
from tsp_core.sequence.layout import shard_sequence

HIDDEN, FFN, BATCH, SEQ = 8, 12, 2, 24   # 48 tokens: 24 local at tsp 2
TILE = 5                                 # several times smaller than the local tokens
UNTILED = 1 << 30
TOL = 1e-12


def _rand(gen: torch.Generator):
    return lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64) * 0.5  # noqa: E731


# --------------------------------------------------------------------------- exactness

def mlp_exact(tsp: int, activation: str, bias: bool) -> None:
    mesh = dist_pool.mesh(tsp)
    D, p = mesh.size, mesh.rank
    r = _rand(torch.Generator().manual_seed(11))
    w = {"gate_proj.weight": r(FFN, HIDDEN), "up_proj.weight": r(FFN, HIDDEN),
         "down_proj.weight": r(HIDDEN, FFN)}
    if bias:
        w.update({"gate_proj.bias": r(FFN), "up_proj.bias": r(FFN), "down_proj.bias": r(HIDDEN)})
    x, dy = r(BATCH, SEQ, HIDDEN), r(BATCH, SEQ, HIDDEN)
    ref_w = {k: v.clone().requires_grad_() for k, v in w.items()}
    x_ref = x.clone().requires_grad_()
    y_ref = reference.gated_mlp(x_ref, ref_w, activation)
    y_ref.backward(dy)
    assert len(tiles.token_tiles(BATCH * SEQ // D, TILE)) >= 4

    runs = {}
    for tile in (TILE, UNTILED):
        layer = TSPGatedMLP(mesh, HIDDEN, FFN, activation=activation, bias=bias,
                            dtype=torch.float64, tile_tokens=tile)
        layer.load_full(w)
        x_loc = shard_sequence(x, p, D).requires_grad_()
        y = layer(x_loc)
        y.backward(shard_sequence(dy, p, D))
        runs[tile] = (y.detach(), x_loc.grad, layer.full_tensors(grads=True))
    for tile, (y, dx, grads) in runs.items():
        what = f"tile {tile}"
        assert_close(y, shard_sequence(y_ref.detach(), p, D), TOL, f"{what}: output")
        assert_close(dx, shard_sequence(x_ref.grad, p, D), TOL, f"{what}: input grad")
        assert sorted(grads) == sorted(w)
        for name, g in grads.items():
            assert_close(g, ref_w[name].grad, TOL, f"{what}: grad of {name}")
            assert_close(g, runs[UNTILED][2][name], TOL, f"{what} vs untiled: grad of {name}")
        assert_close(y, runs[UNTILED][0], TOL, f"{what} vs untiled: output")
        assert_close(dx, runs[UNTILED][1], TOL, f"{what} vs untiled: input grad")
    dist.barrier()


def moe_exact(tsp: int) -> None:
    """Both schedules' experts (the ring's ``RingExpertsFn``, the expert schedule's
    ``dispatch_combine``) on given routing: float64 routing weights (a leaf, so their gradient is
    compared too) and each token's top 2 of 4 experts."""
    mesh = dist_pool.mesh(tsp)
    D, p = mesh.size, mesh.rank
    E, k, Fe, N = 4, 2, 8, BATCH * SEQ
    gen = torch.Generator().manual_seed(12)
    r = _rand(gen)
    x, dy = r(N, HIDDEN), r(N, HIDDEN)
    weights = torch.rand(N, k, generator=gen, dtype=torch.float64)
    experts = torch.rand(N, E, generator=gen).topk(k, -1).indices
    full = {"gate": r(E, Fe, HIDDEN), "up": r(E, Fe, HIDDEN), "down": r(E, HIDDEN, Fe)}

    ref = {n: t.clone().requires_grad_() for n, t in full.items()}
    x_ref, w_ref = x.clone().requires_grad_(), weights.clone().requires_grad_()
    y_ref = torch.zeros(N, HIDDEN, dtype=torch.float64)
    for e in range(E):
        tok, slot = torch.where(experts == e)
        xe = x_ref[tok]
        m = F.silu(xe @ ref["gate"][e].t()) * (xe @ ref["up"][e].t())
        y_ref = y_ref.index_add(0, tok, (m @ ref["down"][e].t()) * w_ref[tok, slot, None])
    y_ref.backward(dy)

    mine = slice(p * N // D, (p + 1) * N // D)   # this rank's tokens
    cols = slice(p * Fe // D, (p + 1) * Fe // D)  # this rank's channels of every expert
    spec = MoESpec(HIDDEN, Fe, E, k, D)
    assert len(tiles.token_tiles(N // D * k // E, TILE)) >= 2  # rows per expert, balanced
    runs = {}
    for tile in (TILE, UNTILED):
        own = {"gate": full["gate"][:, cols].clone().requires_grad_(),
               "up": full["up"][:, cols].clone().requires_grad_(),
               "down": full["down"][:, :, cols].clone().requires_grad_()}
        x_loc, w_loc = x[mine].clone().requires_grad_(), weights[mine].clone().requires_grad_()
        y = RingExpertsFn.apply(x_loc, w_loc, experts[mine], spec, mesh.group, tile,
                                 own["gate"], own["up"], own["down"])
        y.backward(dy[mine])
        runs[tile] = {"y": y.detach(), "x": x_loc.grad, "w": w_loc.grad,
                      **{n: t.grad for n, t in own.items()}}
    want = {"y": y_ref.detach()[mine], "x": x_ref.grad[mine], "w": w_ref.grad[mine],
            "gate": ref["gate"].grad[:, cols], "up": ref["up"].grad[:, cols],
            "down": ref["down"].grad[:, :, cols]}
    for tile, got in runs.items():
        for name, t in got.items():
            assert_close(t, want[name], TOL, f"ring, tile {tile}: {name}")
            assert_close(t, runs[UNTILED][name], TOL, f"ring, tile {tile} vs untiled: {name}")

    # the expert schedule: rank p owns experts [p E/D, (p+1) E/D) whole, rows travel to them
    owned = slice(p * E // D, (p + 1) * E // D)
    runs = {}
    for tile in (TILE, UNTILED):
        gate_up = torch.cat([full["gate"], full["up"]], 1)[owned].clone().requires_grad_()
        down = full["down"][owned].clone().requires_grad_()
        x_loc, w_loc = x[mine].clone().requires_grad_(), weights[mine].clone().requires_grad_()
        y = dispatch_combine(x_loc, w_loc, experts[mine], (gate_up, down), spec, mesh.group,
                             tile)
        y.backward(dy[mine])
        runs[tile] = {"y": y.detach(), "x": x_loc.grad, "w": w_loc.grad,
                      "gate_up": gate_up.grad, "down": down.grad}
    want = {"y": y_ref.detach()[mine], "x": x_ref.grad[mine], "w": w_ref.grad[mine],
            "gate_up": torch.cat([ref["gate"].grad, ref["up"].grad], 1)[owned],
            "down": ref["down"].grad[owned]}
    for tile, got in runs.items():
        for name, t in got.items():
            assert_close(t, want[name], TOL, f"expert, tile {tile}: {name}")
            assert_close(t, runs[UNTILED][name], TOL, f"expert, tile {tile} vs untiled: {name}")
    dist.barrier()


def loss_exact(tsp: int, vocab: int, softcap: float | None) -> None:
    """The loss (``loss_sum``) and the token statistics, tiled and untiled, against plain
    float64 math on the full logits: values and the gradients of the hidden states and head."""
    mesh = dist_pool.mesh(tsp)
    D, p = mesh.size, mesh.rank
    gen = torch.Generator().manual_seed(13)
    r = _rand(gen)
    head_w, hidden = r(vocab, HIDDEN) * 4, r(BATCH, SEQ, HIDDEN)
    labels = torch.randint(0, vocab, (BATCH, SEQ), generator=gen)
    labels[0, :5] = -100
    per_token = r(BATCH, SEQ)  # d(sum)/d log p per token, for the token statistics

    ref_h, ref_x = head_w.clone().requires_grad_(), hidden.clone().requires_grad_()
    logits = F.linear(ref_x, ref_h)
    if softcap is not None:
        logits = torch.tanh(logits / softcap) * softcap
    keep = labels != -100
    loss_ref = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum")
    logp_all = torch.log_softmax(logits, -1)
    ref_logp = torch.where(keep, logp_all.gather(-1, labels.clamp(min=0)[..., None])[..., 0], 0)
    ref_entropy = torch.where(keep, -(logp_all.exp() * logp_all).sum(-1), 0).detach()
    ref_mean = torch.where(keep, logits.mean(-1), 0).detach()
    ref_top1 = keep & (logits.argmax(-1) == labels)
    g_loss = torch.autograd.grad(loss_ref, [ref_x, ref_h], retain_graph=True)
    g_stats = torch.autograd.grad((ref_logp * per_token).sum(), [ref_x, ref_h])
    assert len(tiles.token_tiles(BATCH * SEQ // D, TILE)) >= 4

    runs = {}
    for tile in (TILE, UNTILED):
        head = TSPLMHead(mesh, vocab, HIDDEN, dtype=torch.float64, tile_tokens=tile)
        head.load_full({"weight": head_w})
        head.logits_softcap = softcap
        x = shard_sequence(hidden, p, D).requires_grad_()
        total = comm.sum_over(head.loss_sum(x, shard_sequence(labels, p, D)), [mesh.group])
        total.backward()
        loss_grads = (x.grad, head.full_tensors(grads=True)["weight"])
        head.zero_grad()
        x2 = shard_sequence(hidden, p, D).requires_grad_()
        logp, entropy, top1, mean = head.token_stats(x2, shard_sequence(labels, p, D))
        (logp * shard_sequence(per_token, p, D)).sum().backward()
        runs[tile] = {"loss": total.detach(), "dx": loss_grads[0], "dw": loss_grads[1],
                      "logp": logp.detach(), "entropy": entropy, "mean": mean,
                      "stats dx": x2.grad, "stats dw": head.full_tensors(grads=True)["weight"]}
        assert torch.equal(top1, shard_sequence(ref_top1, p, D)), f"tile {tile}: top-1"
    want = {"loss": loss_ref.detach(), "dx": shard_sequence(g_loss[0], p, D), "dw": g_loss[1],
            "logp": shard_sequence(ref_logp.detach(), p, D),
            "entropy": shard_sequence(ref_entropy, p, D), "mean": shard_sequence(ref_mean, p, D),
            "stats dx": shard_sequence(g_stats[0], p, D), "stats dw": g_stats[1]}
    for tile, got in runs.items():
        for name, t in got.items():
            assert_close(t, want[name], TOL, f"tile {tile}: {name}")
            assert_close(t, runs[UNTILED][name], TOL, f"tile {tile} vs untiled: {name}")
    dist.barrier()


@pytest.mark.parametrize("tsp", [1, 2])
def test_tiles_are_exact_float64(pools, tsp):
    pool = pools.of(2)
    for activation, bias in (("silu", False), ("gelu_tanh", True)):
        pool.run(mlp_exact, tsp, activation, bias)
    pool.run(moe_exact, tsp)
    # 13 at tsp 2: rows padded to 14; logits of about 4 capped at 2: tanh far from linear
    for vocab, softcap in ((32, None), (13, 2.0)):
        pool.run(loss_exact, tsp, vocab, softcap)


def refuse_bad_tiles(values: list) -> None:
    mesh = dist_pool.mesh(1)
    for make in (lambda t: TSPGatedMLP(mesh, HIDDEN, FFN, tile_tokens=t),
                 lambda t: TSPLMHead(mesh, 16, HIDDEN, tile_tokens=t)):
        for value in values:
            with pytest.raises(ValueError, match=rf"tile_tokens \({value!r}\) must be a positive"):
                make(value)
            module = make(None)
            with pytest.raises(ValueError, match=rf"tile_tokens \({value!r}\) must be a positive"):
                module.tile_tokens = value
            assert module.tile_tokens is None


def test_modules_refuse_a_bad_tile(pools):
    pools.of(2).run(refuse_bad_tiles, [0, -3, 2.5, True])


def test_chosen_tiles_fit_the_bound():
    # Llama-3.1-8B at D = 8 in bf16: F/D = 1792, V/D = 16032
    mlp, loss = tiles.mlp_tile_tokens(1792, torch.bfloat16), tiles.loss_tile_tokens(16032,
                                                                                     torch.bfloat16)
    assert (mlp, loss) == (12416, 1280)
    assert tiles.MLP_TILE_TENSORS * mlp * 1792 * 2 <= tiles.TILE_BYTES
    assert tiles.LOSS_TILE_TENSORS * loss * 16032 * 4 <= tiles.TILE_BYTES
    assert tiles.loss_tile_tokens(16032, torch.float64) == 640
    assert tiles.mlp_tile_tokens(1 << 30, torch.float32) == 1  # never below one token
    # the plain MLP's tile: its activation's tensors under the same bound (xIELU: half the tile)
    for activation, tensors in PLAIN_TILE_TENSORS.items():
        tile = plain_tile_tokens(1792, torch.bfloat16, activation)
        assert tensors * tile * 1792 * 2 <= tiles.TILE_BYTES, (activation, tile)
    assert plain_tile_tokens(1792, torch.bfloat16, "xielu") == 6144


# --------------------------------------------------------------------------- memory

MEM_H, MEM_F, MEM_V, MEM_D = 64, 4096, 4096, 2  # F/D = V/D = 2048: a tile row is 32 h
MEM_TILE, MEM_S = 128, 1024


@contextlib.contextmanager
def tile_ignored(broken: bool) -> Iterator[None]:
    """The broken variant: the MLP and the loss take all their tokens as one tile."""
    from tsp_core.layers import mlp, vocab

    saved = mlp.token_tiles, vocab.token_tiles
    if broken:
        mlp.token_tiles = vocab.token_tiles = lambda n, tile: [slice(0, n)]
    try:
        yield
    finally:
        mlp.token_tiles, vocab.token_tiles = saved


def working_sets(cases: list[tuple[int, int, bool]]) -> list[dict[str, int]]:
    """Per (local tokens, tile, tile ignored): bytes the MLP and the loss add while their forward
    and their backward run (bf16 model), rank 0 of a 2-rank fake process group under
    FakeTensorMode. The MLP's from its own module snapshots, as ``tsp simulate`` reads them;
    the loss's from a tracker around each pass (it is not a module's forward)."""
    import os

    os.environ["OMP_NUM_THREADS"] = "1"
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.mem_tracker import MemTracker, _ModState
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from tsp_core import init_mesh
    from tsp_core.plan.simulate import _private_sharding_propagation

    torch.set_num_threads(1)

    def total(snapshot: dict) -> int:
        (per_kind,) = snapshot.values()
        return int(per_kind["Total"])

    def added(tracker, module, start, peak) -> int:
        snaps = tracker.memory_tracking[module].snapshots
        return total(snaps[peak][0]) - total(snaps[start][0])

    dist.init_process_group("fake", rank=0, world_size=MEM_D, store=FakeStore())
    out = []
    try:
        mesh = init_mesh(MEM_D)
        bf16 = torch.bfloat16
        with FakeTensorMode(), _private_sharding_propagation():
            # tanh-GELU: the activation whose derivative needs the most temporaries
            mlp = TSPGatedMLP(mesh, MEM_H, MEM_F, activation="gelu_tanh", dtype=bf16,
                              init_seed=None)
            plain = TSPPlainMLP(mesh, MEM_H, MEM_F, activation="xielu", dtype=bf16,
                                init_seed=None)  # Apertus's: the plain MLP's most temporaries
            head = TSPLMHead(mesh, MEM_V, MEM_H, dtype=bf16, init_seed=None)
            head.logits_softcap = 30.0  # the cap's tanh: the loss's most temporaries
            for tokens, tile, broken in cases:
                mlp.tile_tokens = plain.tile_tokens = head.tile_tokens = tile
                x = torch.empty(1, tokens, MEM_H, dtype=bf16, requires_grad=True)
                labels = torch.zeros(1, tokens, dtype=torch.long)
                with tile_ignored(broken):
                    tracker = MemTracker()
                    with tracker:
                        y = mlp(x)
                        y.backward(torch.empty_like(y))
                    row = {"mlp forward": added(tracker, mlp, _ModState.PRE_FW,
                                                _ModState.PEAK_FW),
                           "mlp backward": added(tracker, mlp, _ModState.PRE_BW,
                                                 _ModState.PEAK_BW)}
                    del y
                    tracker = MemTracker()
                    with tracker:
                        y = plain(x)
                        y.backward(torch.empty_like(y))
                    row["plain forward"] = added(tracker, plain, _ModState.PRE_FW,
                                                 _ModState.PEAK_FW)
                    row["plain backward"] = added(tracker, plain, _ModState.PRE_BW,
                                                  _ModState.PEAK_BW)
                    del y
                    hidden = torch.empty(1, tokens, MEM_H, dtype=bf16, requires_grad=True)
                    fw = MemTracker()
                    with fw:
                        loss = head.loss_sum(hidden, labels)
                    bw = MemTracker()
                    with bw:
                        loss.backward()
                    row["loss forward"] = total(fw.get_tracker_snapshot("peak"))
                    row["loss backward"] = total(bw.get_tracker_snapshot("peak"))
                out.append(row)
    finally:
        dist.destroy_process_group()
    return out


def row_allowance(tokens: int) -> int:
    """What may grow with ``tokens`` more local tokens: [tokens, h] rows of the inputs and outputs
    (the output, the input gradient and the input, as the tracker counts them: at most 4) and
    64 bytes of per-token scalars (the loss's running max, sum, target, log-sum-exp, masks)."""
    return (4 * MEM_H * 2 + 64) * tokens


def growth_violations(small: dict, large: dict, extra_tokens: int) -> list[str]:
    """Each measured part that grew from S to 4S tokens by more than the rows it may add."""
    allow = row_allowance(extra_tokens)
    return [f"{k}: {small[k]} -> {large[k]} bytes (+{large[k] - small[k]} > {allow})"
            for k in small if large[k] - small[k] > allow]


def test_working_sets_bounded_by_the_tile_not_the_tokens(simulations):
    S, t = MEM_S, MEM_TILE
    cases = [(S, t, False), (4 * S, t, False), (4 * S, 2 * t, False),
             (S, UNTILED, False), (4 * S, UNTILED, False),
             (S, t, True), (4 * S, t, True)]
    # in one of the session's simulation workers (tests/support/simulations.py)
    small, large, large_2t, untiled_s, untiled_4s, broken_s, broken_4s = \
        simulations.submit(working_sets, cases).result()

    # tiled: the same at S and 4S, up to the [tokens, h] rows and per-token scalars
    assert growth_violations(small, large, 3 * S) == [], (small, large)
    # untiled, and with the tile ignored (the broken variant): every part grows with the tokens
    for name, (a, b) in {"untiled": (untiled_s, untiled_4s),
                         "tile ignored": (broken_s, broken_4s)}.items():
        grew = {v.split(":")[0] for v in growth_violations(a, b, 3 * S)}
        assert grew == set(small), (name, a, b)

    # one tile's working set: doubling the tile adds at most the stated tensors of a tile
    mlp_tile = t * (MEM_F // MEM_D) * 2                # [t, F/D] bf16
    loss_tile = t * (MEM_V // MEM_D) * 4               # [t, V/D] float32
    rows = 4 * t * MEM_H * 2                           # [t, h] inputs and outputs of a tile
    plain = PLAIN_TILE_TENSORS["xielu"]  # above MLP_TILE_TENSORS: plain_tile_tokens widens
    for part, bound in (("mlp forward", tiles.MLP_TILE_TENSORS * mlp_tile),
                        ("mlp backward", tiles.MLP_TILE_TENSORS * mlp_tile),
                        ("plain forward", plain * mlp_tile),
                        ("plain backward", plain * mlp_tile),
                        ("loss forward", tiles.LOSS_TILE_TENSORS * loss_tile),
                        ("loss backward", tiles.LOSS_TILE_TENSORS * loss_tile)):
        assert large_2t[part] - large[part] <= bound + rows, (part, large, large_2t, bound)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float64])
def test_tiled_norm_keeps_only_its_input_and_gives_autograds_numbers(dtype):
    # the decoder's RMSNorms run in tiles and keep only their input: plain autograd of the
    # float32-upcasting norm keeps float32 copies about three times the input
    from tsp_core.layers.norm import NORMS, WEIGHTLESS, _TiledNorm

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 13, 64, generator=gen, dtype=torch.float64).to(dtype).requires_grad_()
    g = torch.randn(2, 13, 64, generator=gen, dtype=torch.float64).to(dtype)
    for kind in (k for k in NORMS if k not in WEIGHTLESS):  # a layer's norms have a weight
        w = (1 + 0.1 * torch.randn(64, generator=gen, dtype=torch.float64)).to(dtype)
        w.requires_grad_()
        saved: list[int] = []

        def keep(t: torch.Tensor, saved: list[int] = saved) -> torch.Tensor:
            saved.append(t.numel() * t.element_size())
            return t

        with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
            plain = NORMS[kind](x, w, 1e-6)
        plain_saved, saved[:] = sum(saved), []
        want = torch.autograd.grad(plain, (x, w), g)
        for tile in (1, 5, 26, 100):
            with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
                out = _TiledNorm.apply(x, w, kind, 1e-6, tile)
            kept, saved[:] = sum(saved), []
            got = torch.autograd.grad(out, (x, w), g)
            where = f"{kind} {dtype} tile {tile}"
            assert kept == x.numel() * x.element_size() + w.numel() * w.element_size(), where
            if dtype != torch.float64:  # the float32 copies plain autograd keeps
                assert kept < plain_saved / 2, (where, kept, plain_saved)
            assert torch.equal(out, plain) and torch.equal(got[0], want[0]), where
            tol = {torch.bfloat16: 2e-2, torch.float32: 1e-6, torch.float64: 1e-13}[dtype]
            err = (got[1].double() - want[1].double()).abs().max() / want[1].double().abs().max()
            assert err <= tol, (where, float(err))
