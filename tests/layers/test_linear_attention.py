"""TSPGatedDeltaNet (Qwen3.5's linear-attention layer) against Hugging Face's layer on one process,
in float64, on a 4-process pool: tsp 1, 2 and 4 run as meshes (4 x 1), (2 x 2) and (1 x 4).

The reference is Hugging Face's ``Qwen3_5GatedDeltaNet`` with its float32 islands (the torch
fallback of the gated delta rule, the gated norm, the decay's casts) kept in float64 by
tests/support/delta_net_reference.py: a copy of Hugging Face's code that changes only those
casts, and equals the unmodified layer exactly in float32 (checked here)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from tests.support import dist_pool
from tests.support.delta_net_reference import hf_layer
from tests.support.reference import assert_close
from tsp_core.layers.linear_attention import TSPGatedDeltaNet
from tsp_core.sequence.layout import pad_to_multiple, shard_sequence

HIDDEN = 32


def _config(nk: int, nv: int, dk: int, dv: int, kernel: int) -> dict:
    return dict(hidden_size=HIDDEN, linear_num_key_heads=nk, linear_num_value_heads=nv,
                linear_key_head_dim=dk, linear_value_head_dim=dv, linear_conv_kernel_dim=kernel)


def _tsp_layer(mesh, cfg, ref) -> TSPGatedDeltaNet:
    layer = TSPGatedDeltaNet(mesh, cfg.hidden_size, cfg.linear_num_key_heads,
                             cfg.linear_num_value_heads, cfg.linear_key_head_dim,
                             cfg.linear_value_head_dim, cfg.linear_conv_kernel_dim,
                             cfg.rms_norm_eps, dtype=torch.float64)
    layer.load_full(ref.state_dict())
    return layer


def run_parity(tsp: int, nk: int, nv: int, seq: int, batch: int, dk: int = 8, dv: int = 6,
               kernel: int = 4, docs: tuple[int, ...] | None = None) -> None:
    """Output, input gradient and every weight's gradient at 1e-10 on every rank. With
    ``docs`` (document lengths of every row, each a multiple of 2 * tsp), the rows are packed:
    the reference runs each document alone through Hugging Face's layer."""
    mesh = dist_pool.mesh(tsp)
    D, p = mesh.size, mesh.rank
    ref, cfg = hf_layer(_config(nk, nv, dk, dv, kernel))
    layer = _tsp_layer(mesh, cfg, ref)
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(batch, seq, HIDDEN, generator=gen, dtype=torch.float64)
    dy = torch.randn(batch, seq, HIDDEN, generator=gen, dtype=torch.float64)
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
    y = layer(x_loc, docs=None if docs is None else [docs] * batch)
    y.backward(shard(dy))
    assert_close(y[:, real], shard(y_ref.detach())[:, real], 1e-10, "output")
    assert_close(x_loc.grad[:, real], shard(x_ref.grad)[:, real], 1e-10, "input grad")
    grads = layer.full_tensors(grads=True)
    names = dict(ref.named_parameters())
    assert sorted(grads) == sorted(names), f"gradients for {sorted(grads)}, weights {sorted(names)}"
    for name, g in grads.items():
        assert_close(g, names[name].grad, 1e-10, f"grad of {name}")
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
