"""TSPGatedDeltaNet (Qwen3.5's linear-attention layer) against Hugging Face's layer on one process,
in float64, on a 4-process pool: tsp 1, 2 and 4 run as meshes (4 x 1), (2 x 2) and (1 x 4).

The reference is Hugging Face's ``Qwen3_5GatedDeltaNet`` with its float32 islands (the torch
fallback of the gated delta rule, the gated norm, the decay's casts) kept in float64 by
tests/support/delta_net_reference.py: a copy of Hugging Face's code that changes only those
casts, and equals the unmodified layer exactly in float32 (checked here)."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from tests.support import dist_pool
from tests.support.delta_net_reference import hf_layer
from tests.support.reference import assert_close
from tsp_core import comm
from tsp_core.layers.linear_attention import TSPGatedDeltaNet
from tsp_core.layers.linear_attention.traffic import delta_net_collectives
from tsp_core.sequence.layout import pad_to_multiple, shard_sequence

HIDDEN = 32


def _config(nk: int, nv: int, dk: int, dv: int, kernel: int) -> dict:
    return dict(hidden_size=HIDDEN, linear_num_key_heads=nk, linear_num_value_heads=nv,
                linear_key_head_dim=dk, linear_value_head_dim=dv, linear_conv_kernel_dim=kernel)


def _tsp_layer(mesh, cfg, ref, dtype: torch.dtype = torch.float64) -> TSPGatedDeltaNet:
    layer = TSPGatedDeltaNet(mesh, cfg.hidden_size, cfg.linear_num_key_heads,
                             cfg.linear_num_value_heads, cfg.linear_key_head_dim,
                             cfg.linear_value_head_dim, cfg.linear_conv_kernel_dim,
                             cfg.rms_norm_eps, dtype=dtype)
    layer.load_full(ref.state_dict())
    return layer


# CASES[0] (4 key heads of 8, 8 value heads of 6, kernel 4, hidden 32, 2 rows of 32 tokens,
# float64) at D = 2, (calls, bytes per rank) written out by hand beside the formula
# (delta_net_collectives), so that a collective added to both fails. A round's weights (2 key
# heads, 4 value heads): in_proj q, k 16 x 32 each, v, z 24 x 32 each, b, a 4 x 32 each, conv
# 16, 16 and 24 channels x 4, A_log and dt_bias 4 each, out_proj 32 x 24: 3816 elements, half
# of them from the other rank (8 bytes): 15264 per broadcast, 2 rounds. Zigzag chunks of 8
# tokens, 2 per rank, each a unit of both rows: the maps [2 rows, 4 heads, 8, 8 + 6] = 896
# elements a unit, 1792 a rank; each round (2) gathers both ranks' 3584, half from the other
# rank: 14336 bytes a round, 28672 in all; the halo tails (3 = kernel - 1 tokens of each unit's
# 2 rows, 32 wide: 384 a rank, 768 gathered) once, at half: 3072 bytes (3 all-gathers, 31744
# bytes); the backward reduce-scatters the same; the gated norm's weight (6) all-reduced at
# 2 (D-1)/D: 48 bytes
DELTA_NET_BY_HAND_D2 = {
    "forward": {"broadcast": (2, 30528), "all_gather": (3, 31744)},
    "backward": {"broadcast": (2, 30528), "all_gather": (3, 31744),
                 "reduce_scatter": (3, 31744), "reduce": (2, 30528), "all_reduce": (1, 48)},
}


def run_parity(tsp: int, nk: int, nv: int, seq: int, batch: int, dk: int = 8, dv: int = 6,
               kernel: int = 4, docs: tuple[int, ...] | None = None,
               float32: bool = False) -> None:
    """Output, input gradient and every weight's gradient at 1e-10 on every rank, and the
    layer's collectives those of the formula (calls and bytes by kind). With
    ``docs`` (document lengths of every row, each a multiple of 2 * tsp), the rows are packed:
    the reference runs each document alone through Hugging Face's layer. ``float32``: against
    the unmodified Hugging Face layer in float32, to 2e-5 of each tensor's largest entry."""
    mesh = dist_pool.mesh(tsp)
    D, p = mesh.size, mesh.rank
    dtype, tol = (torch.float32, 2e-5) if float32 else (torch.float64, 1e-10)
    ref, cfg = hf_layer(_config(nk, nv, dk, dv, kernel), dtype, faithful=not float32)
    layer = _tsp_layer(mesh, cfg, ref, dtype)
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(batch, seq, HIDDEN, generator=gen, dtype=torch.float64).to(dtype)
    dy = torch.randn(batch, seq, HIDDEN, generator=gen, dtype=torch.float64).to(dtype)
    x_ref = x.clone().requires_grad_()
    if docs is None:
        y_ref = ref(x_ref)
    else:  # every document alone: the state and the convolution start afresh
        assert sum(docs) == seq, (docs, seq)
        y_ref = torch.cat([ref(part) for part in x_ref.split(list(docs), dim=1)], dim=1)
    y_ref.backward(dy)

    shard = lambda t: shard_sequence(pad_to_multiple(t, D, 0, 1), p, D, 1,  # noqa: E731
                                     docs=docs)
    real = shard(torch.ones(1, seq, 1, dtype=torch.bool))[0, :, 0]
    x_loc = shard(x).requires_grad_()
    row_docs = None if docs is None else [docs] * batch
    with comm.track() as fwd:
        y = layer(x_loc, docs=row_docs)
    with comm.track() as bwd:
        y.backward(shard(dy))
    # the collectives of docs/design.md's formula, exactly (tsp_core.layers.linear_attention
    # .traffic): calls and bytes by kind
    want = delta_net_collectives(layer.spec, batch, x_loc.shape[1], x.dtype,
                                 None if docs is None else tuple(row_docs))
    for what, stats in (("forward", fwd), ("backward", bwd)):
        got = {k: (stats.calls[k], stats.bytes[k]) for k in stats.calls}
        assert got == want[what], f"D={D} {what}: counted {got}, formula {want[what]}"
        if D == 2 and (nk, nv, seq, batch, dk, dv, kernel, docs, float32) == (
                4, 8, 32, 2, 8, 6, 4, None, False):  # CASES[0]
            assert got == DELTA_NET_BY_HAND_D2[what], \
                f"{what}: counted {got}, by hand {DELTA_NET_BY_HAND_D2[what]}"
    assert_close(y[:, real], shard(y_ref.detach())[:, real], tol, "output")
    assert_close(x_loc.grad[:, real], shard(x_ref.grad)[:, real], tol, "input grad")
    grads = layer.full_tensors(grads=True)
    names = dict(ref.named_parameters())
    assert sorted(grads) == sorted(names), f"gradients for {sorted(grads)}, weights {sorted(names)}"
    for name, g in grads.items():
        assert_close(g, names[name].grad, tol, f"grad of {name}")
    dist.barrier()


CASES = [
    dict(nk=4, nv=8, seq=32, batch=2),                  # value heads repeat key heads (x2)
    dict(nk=4, nv=4, seq=13, batch=1, kernel=2),        # padding at D = 2, 4
    # zigzag chunks of 2 tokens (seq 16, D = 4) and of 1 token (seq 8) under a kernel of 4:
    # each halo comes from two and three preceding chunks
    dict(nk=4, nv=8, seq=16, batch=1),
    dict(nk=4, nv=4, seq=8, batch=2, dk=4, dv=4),
    # chunks longer than Hugging Face's 64-token sub-chunks at D = 1
    dict(nk=4, nv=4, seq=144, batch=1, dk=4, dv=4),
    # packed rows: documents of 8, 16 and 8 tokens (chunks of 1, 2 and 1 token at D = 4)
    dict(nk=4, nv=8, seq=32, batch=2, docs=(8, 16, 8)),
    dict(nk=4, nv=4, seq=48, batch=1, kernel=2, docs=(16, 32)),
    # float32 against Hugging Face's unmodified layer (its float32 islands are float32 here)
    dict(nk=4, nv=8, seq=40, batch=2, float32=True),
]


@pytest.mark.parametrize("tsp", [1, 2, 4])
@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(f"{k}{v}" for k, v in c.items()))
def test_parity_float64(pool, tsp, case):
    pool.run(run_parity, tsp, **case)


def test_reference_is_hugging_face_in_float32():
    """The float64-faithful copy differs from Hugging Face's layer only in its casts: in float32
    the two give the same bits."""
    kw = _config(2, 4, 8, 6, 4)
    ours, _ = hf_layer(kw, torch.float32)
    theirs, _ = hf_layer(kw, torch.float32, faithful=False)
    x = torch.randn(2, 70, HIDDEN, generator=torch.Generator().manual_seed(3))
    assert torch.equal(ours(x), theirs(x))


# ------------------------------------------------------------------------- the memory rule

# Qwen3.5-9B's Gated DeltaNet (h 4096, 16 key heads repeated to 32 value heads of 128, kernel 4)
# as rank 0 of D = 4, bf16, at 2048 tokens
MEM_SHAPE = dict(hidden=4096, nk=16, nv=32, dk=128, dv=128, kernel=4, D=4, seq=2048)
_KEPT: list = []  # what the broken variant keeps alive until the backward ends


def forward_keeps(variant: str | None) -> tuple[int, int]:
    """(bytes the layer's forward leaves alive for its backward, the output's bytes), measured
    under FakeTensorMode with the fake process group and MemTracker (as ``tsp simulate``) in a
    worker process that owns the default process group. ``variant="keep_maps"``: every round's
    gathered maps (other ranks' chunks' maps) kept until the backward ends, what plain autograd
    over the rounds would save."""
    os.environ["OMP_NUM_THREADS"] = "1"
    import torch.distributed as dist
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.mem_tracker import MemTracker, _ModState
    from torch.testing._internal.distributed.fake_pg import FakeStore

    import tsp_core
    from tsp_core.layers.linear_attention import schedule

    torch.set_num_threads(1)
    s = MEM_SHAPE
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=s["D"])
    original = schedule._round
    if variant == "keep_maps":
        def keeping(*args, **kwargs):
            out = original(*args, **kwargs)
            _KEPT.append(out[2])
            return out

        schedule._round = keeping
    try:
        mesh = tsp_core.init_mesh(s["D"])
        with FakeTensorMode():
            layer = TSPGatedDeltaNet(mesh, s["hidden"], s["nk"], s["nv"], s["dk"], s["dv"],
                                     s["kernel"], dtype=torch.bfloat16)
            tracker = MemTracker()
            tracker.track_external(layer)
            with tracker:
                x = torch.empty(1, s["seq"] // s["D"], s["hidden"], dtype=torch.bfloat16,
                                requires_grad=True)
                y = layer(x)
                y.backward(torch.empty_like(y))
            snaps = tracker.memory_tracking[layer].snapshots
            (before,) = snaps[_ModState.PRE_FW][0].values()
            (after,) = snaps[_ModState.POST_FW][0].values()
            return int(after["Total"]) - int(before["Total"]), y.numel() * y.element_size()
    finally:
        schedule._round = original
        _KEPT.clear()
        dist.destroy_process_group()


def test_forward_keeps_only_local_tensors(simulations):
    """The forward leaves alive its output and nothing else (it saves the local input, its own
    weight shards and the norm weight, all alive before it ran; the halo tails and every round's
    maps are gathered again in the backward). Keeping the gathered maps of every round breaks
    it by D rounds of D ranks' maps."""
    # in the session's simulation workers (tests/support/simulations.py): each measurement
    # owns the default process group while it runs, and puts back what its variant replaced
    (kept, out), (broken, _) = simulations.map(forward_keeps, (None, "keep_maps"))
    s = MEM_SHAPE
    slack = s["seq"] // s["D"] * 16  # 16 bytes per local token: index tensors, scalars
    assert out <= kept <= out + slack, (kept, out)
    # float32 maps [A | B] of every chunk: 2 D chunks of the round's 32 / D value heads
    maps = s["D"] * 2 * s["D"] * (s["nv"] // s["D"]) * s["dk"] * (s["dk"] + s["dv"]) * 4
    assert broken - kept >= maps, ("keep_maps not seen", broken, kept, maps)
