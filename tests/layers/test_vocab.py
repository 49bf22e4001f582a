"""Vocabulary-sharded embedding and fused LM-head loss against plain PyTorch in float64,
including a vocabulary that does not divide by D and a shard made only of padding."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from tests.support import dist_pool
from tests.support.reference import assert_close
from tsp_core import comm
from tsp_core.layers.vocab import TSPEmbedding, TSPLMHead
from tsp_core.sequence.layout import shard_sequence

HIDDEN = 8


def run_parity(tsp: int, vocab: int, tied: bool, padding_idx: int | None,
               softcap: float | None = None) -> dict:
    mesh = dist_pool.mesh(tsp)
    D, p = mesh.size, mesh.rank
    gen = torch.Generator().manual_seed(5)
    emb_w = torch.randn(vocab, HIDDEN, generator=gen, dtype=torch.float64)
    head_w = emb_w if tied else torch.randn(vocab, HIDDEN, generator=gen, dtype=torch.float64)
    ids = torch.randint(0, vocab, (2, 16), generator=gen)
    labels = torch.randint(0, vocab, (2, 16), generator=gen)
    labels[0, :5] = -100
    dy = torch.randn(2, 16, HIDDEN, generator=gen, dtype=torch.float64)

    emb = TSPEmbedding(mesh, vocab, HIDDEN, padding_idx, dtype=torch.float64)
    emb.load_full({"weight": emb_w})
    head = TSPLMHead(mesh, vocab, HIDDEN, tied_to=emb if tied else None, dtype=torch.float64)
    if not tied:
        head.load_full({"weight": head_w})
    head.logits_softcap = softcap  # Gemma 2's final logit soft-capping (None: off)

    def capped(logits: torch.Tensor) -> torch.Tensor:
        return logits if softcap is None else torch.tanh(logits / softcap) * softcap

    ref_e = emb_w.clone().requires_grad_()
    ref_h = ref_e if tied else head_w.clone().requires_grad_()
    x_ref = F.embedding(ids, ref_e, padding_idx=padding_idx)
    loss_ref = F.cross_entropy(capped(F.linear(x_ref + dy, ref_h)).flatten(0, 1),
                               labels.flatten(), reduction="sum")
    loss_ref.backward()

    with comm.track() as stats:
        x = emb(shard_sequence(ids, p, D))
        loss = head.loss_sum(x + shard_sequence(dy, p, D), shard_sequence(labels, p, D))
        total = comm.sum_over(loss, [mesh.group])
        total.backward()
    # the collectives first, so that a rank whose assert fails leaves none waiting
    emb_grad = emb.full_tensors(grads=True)["weight"]
    head_grad = None if tied else head.full_tensors(grads=True)["weight"]
    logits = head(x.detach())  # without labels: the whole vocabulary for the local tokens
    assert_close(x, shard_sequence(x_ref.detach(), p, D), 1e-12, "embedding rows")
    assert_close(total.detach(), loss_ref.detach(), 1e-10, "loss")
    assert_close(emb_grad, ref_e.grad, 1e-10, "embedding grad")
    if not tied:
        assert_close(head_grad, ref_h.grad, 1e-10, "head grad")
    assert_close(logits, shard_sequence(capped(F.linear(x_ref.detach(), ref_h.detach())), p, D),
                 1e-12, "logits")
    dist.barrier()
    return dict(stats.calls)


@pytest.mark.parametrize("tsp", [1, 2, 4])
@pytest.mark.parametrize("vocab,tied,padding_idx",
                         [(32, False, None), (13, True, 3), (5, False, 0)])
def test_parity_float64(pool, tsp, vocab, tied, padding_idx):
    D = tsp
    # embedding: counts, ids, rows forward + rows backward; loss: D-1 hops forward, D-1 weight
    # hops + D gradient hops backward; the test's own sum: 1 all-reduce (nothing at D = 1)
    want = {"all_to_all": 4, "ring_pass": 3 * D - 2, "all_reduce": 1} if D > 1 else {}
    for rank, calls in enumerate(pool.run(run_parity, tsp, vocab, tied, padding_idx)):
        assert calls == want, (rank, calls)


@pytest.mark.parametrize("tsp", [1, 2, 4])
@pytest.mark.parametrize("vocab,tied", [(32, False), (13, True)])
def test_parity_softcapped_logits(pool, tsp, vocab, tied):
    # logits of about 3 (unit rows, 8 wide) soft-capped at 2: tanh far from linear, in the loss,
    # its gradients (the cap's 1 - tanh^2) and the logits
    pool.run(run_parity, tsp, vocab, tied, None, 2.0)


def bad_ids() -> str:
    mesh = dist_pool.mesh(4)
    emb = TSPEmbedding(mesh, 10, HIDDEN)
    ids = torch.zeros(1, 4, dtype=torch.long)
    if mesh.rank == 2:
        ids[0, 1] = 10
    with pytest.raises(ValueError,
                       match=r"token ids out of range \[0, 10\) on TSP rank\(s\) \[2\]") as e:
        emb(ids)
    return str(e.value)


def test_bad_ids_fail_on_every_rank(pool):
    msgs = pool.run(bad_ids)
    assert "this rank has 0...10" in msgs[2]


def loss_peak(tsp: int, tile_tokens: int) -> tuple[int, int]:
    from torch.distributed._tools.mem_tracker import MemTracker

    mesh = dist_pool.mesh(tsp)
    tokens, V, h = 1024, 4096, 16
    head = TSPLMHead(mesh, V, h, dtype=torch.float32, tile_tokens=tile_tokens)
    hidden = torch.randn(1, tokens, h, requires_grad=True)
    labels = torch.randint(0, V, (1, tokens))
    tracker = MemTracker()
    tracker.track_external(head, hidden)
    with tracker:
        head.loss_sum(hidden, labels).backward()
    (snap,) = tracker.get_tracker_snapshot("peak").values()
    dist.barrier()
    return int(snap["Total"]), tokens * V * 4


def test_loss_never_holds_the_local_logits(pool):
    # tiles of 8 tokens (tests/layers/test_tiles.py holds the working set per tile)
    for rank, (peak, logits_bytes) in enumerate(pool.run(loss_peak, 2, 8)):
        # inputs and the weight shard are tracked too (~0.3 MiB); [tokens, V] float32 is 16 MiB
        assert peak < 0.1 * logits_bytes, (rank, peak, logits_bytes)


def run_token_stats(tsp: int, vocab: int, softcap: float | None) -> dict:
    """``TSPLMHead.token_stats`` against plain float64 math on the full logits: per token the
    label's log-probability (and its gradient, through a per-token weighting, to the hidden
    states and the head), the entropy, the top-1 hit and the mean logit, zero on ignored
    labels."""
    mesh = dist_pool.mesh(tsp)
    D, p = mesh.size, mesh.rank
    gen = torch.Generator().manual_seed(7)
    head_w = torch.randn(vocab, HIDDEN, generator=gen, dtype=torch.float64)
    hidden = torch.randn(2, 16, HIDDEN, generator=gen, dtype=torch.float64)
    labels = torch.randint(0, vocab, (2, 16), generator=gen)
    labels[0, :5] = -100
    # a tie for the top-1 rule: the label's logit equal to an earlier column's (argmax takes the
    # first), and one equal to a later column's (still the top-1). The tied columns are +-2 and
    # the hidden state a quarter of them: their logit (HIDDEN = 8) is exact whatever the shape or
    # order of the matmul that computes it (a tie of inexact logits breaks by the rounding of
    # each rank's kernel), and 5.7 standard deviations above the other columns'
    signs = torch.randint(0, 2, (HIDDEN,), generator=gen, dtype=torch.float64) * 2 - 1
    head_w[0] = head_w[vocab - 1] = 2 * signs
    hidden[1, 0] = 0.25 * head_w[0]
    labels[1, 0] = vocab - 1
    hidden[1, 1] = hidden[1, 0]
    labels[1, 1] = 0
    weights = torch.randn(2, 16, generator=gen, dtype=torch.float64)  # d(sum)/d log p per token
    head = TSPLMHead(mesh, vocab, HIDDEN, dtype=torch.float64)
    head.load_full({"weight": head_w})
    head.logits_softcap = softcap

    ref_h = head_w.clone().requires_grad_()
    ref_x = hidden.clone().requires_grad_()
    logits = F.linear(ref_x, ref_h)
    if softcap is not None:
        logits = torch.tanh(logits / softcap) * softcap
    logp_all = torch.log_softmax(logits, -1)
    keep = labels != -100
    ref_logp = torch.where(keep, logp_all.gather(-1, labels.clamp(min=0)[..., None])[..., 0], 0)
    ref_entropy = torch.where(keep, -(logp_all.exp() * logp_all).sum(-1), 0).detach()
    ref_top1 = keep & (logits.argmax(-1) == labels)
    ref_mean = torch.where(keep, logits.mean(-1), 0).detach()
    (ref_logp * weights).sum().backward()

    x = shard_sequence(hidden, p, D).clone().requires_grad_()
    logp, entropy, top1, mean = head.token_stats(x, shard_sequence(labels, p, D))
    (logp * shard_sequence(weights, p, D)).sum().backward()
    head_grad = head.full_tensors(grads=True)["weight"]  # collective: before any rank may fail
    assert_close(logp.detach(), shard_sequence(ref_logp.detach(), p, D), 1e-12, "log-probs")
    assert_close(entropy, shard_sequence(ref_entropy, p, D), 1e-12, "entropy")
    assert_close(mean, shard_sequence(ref_mean, p, D), 1e-12, "mean logits")
    assert torch.equal(top1, shard_sequence(ref_top1, p, D)), (top1, shard_sequence(ref_top1, p, D))
    assert_close(x.grad, shard_sequence(ref_x.grad, p, D), 1e-10, "hidden grad")
    assert_close(head_grad, ref_h.grad, 1e-10, "head grad")
    dist.barrier()
    return {"ties": shard_sequence(ref_top1, p, D).tolist()}


@pytest.mark.parametrize("tsp", [1, 2, 4])
@pytest.mark.parametrize("vocab,softcap", [(32, None), (13, None), (13, 2.0)])
def test_token_stats_float64(pool, tsp, vocab, softcap):
    # 13 at D = 4: rows padded to 16, the last shard holds one real row
    results = pool.run(run_token_stats, tsp, vocab, softcap)
    if tsp == 1:  # the planted ties: the later equal column is not the top-1, the first is
        ties = results[0]["ties"]
        assert ties[1][0] is False and ties[1][1] is True, ties[1][:2]
