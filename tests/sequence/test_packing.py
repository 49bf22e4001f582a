"""Packed rows (several documents per row): float64 parity with the single-process model run on
each document separately (loss, logits of every token, every gradient), balanced causal work for
any mix of document lengths, and bad packing metadata rejected."""

from __future__ import annotations

import copy
import random
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import tsp_core
from tests.support import dist_pool, gather, hf_models
from tests.support.reference import assert_close
from tsp_core.distributed.chunks import row_segments
from tsp_core.layers.flash import plan_pieces
from tsp_core.sequence.layout import shard_batch

ROWS = ([1, 5, 17, 64, 200], [200, 64, 17, 5, 1])


def packed_row(lengths: list[int], vocab: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    docs = [torch.randint(0, vocab, (n,), generator=gen) for n in lengths]
    ids = torch.cat(docs)[None]
    # DataCollatorWithFlattening's convention: positions restart, first token of each doc -100
    labels = torch.cat([torch.cat([torch.tensor([-100]), d[1:]]) for d in docs])[None]
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    return docs, ids, labels, positions


def packed_parity(family: str, tsp: int) -> None:
    mesh = dist_pool.mesh(tsp)
    ref = hf_models.build(family, torch.float64)
    model = tsp_core.parallelize(copy.deepcopy(ref), mesh)
    vocab = ref.config.vocab_size
    rows = [packed_row(lengths, vocab, seed) for seed, lengths in enumerate(ROWS)]

    # reference: every document on its own through the unmodified model
    total, count, logits_ref = 0.0, 0, []
    for docs, _, _, _ in rows:
        per_doc = []
        for d in docs:
            lg = ref(input_ids=d[None]).logits[0]
            per_doc.append(lg)
            if len(d) > 1:
                total = total + F.cross_entropy(lg[:-1], d[1:], reduction="sum")
                count += len(d) - 1
        logits_ref.append(per_doc)
    loss_ref = total / count
    loss_ref.backward()

    # TSP: data-parallel replicas take one row each; a single replica takes both rows
    dp, dp_rank = mesh.dp_size, mesh.device_mesh.get_coordinate()[0]
    mine = [dp_rank] if dp == 2 else [0, 1]
    batch = {k: torch.cat([rows[i][j] for i in mine]) for k, j in
             (("input_ids", 1), ("labels", 2), ("position_ids", 3))}
    sharded = shard_batch(batch, mesh)
    loss = model(**sharded).loss
    assert abs(loss.item() - loss_ref.item()) <= 1e-9 * abs(loss_ref.item()), (loss, loss_ref)
    loss.backward()
    got = gather.full_grads(model)
    for name, p in ref.named_parameters():
        assert_close(got[name], p.grad, 1e-9, f"grad of {name}")

    # logits of every real token, placed where the padded, sharded layout put it
    with torch.no_grad():
        logits = model(**{k: v for k, v in sharded.items() if k != "shift_labels"}).logits
    for b, i in enumerate(mine):
        padded = [n for n in sharded["tsp_docs"][b].tolist() if n]
        expected = torch.zeros(sum(padded), vocab, dtype=torch.float64)
        real = torch.zeros(sum(padded), dtype=torch.bool)
        start = 0
        for j, n in enumerate(padded):
            if j < len(ROWS[i]):
                expected[start:start + ROWS[i][j]] = logits_ref[i][j].detach()
                real[start:start + ROWS[i][j]] = True
            start += n
        index = torch.cat([torch.arange(a, c) for a, c, _ in
                           row_segments(padded, mesh.rank, mesh.size)])
        keep = real[index]
        assert_close(logits[b][keep], expected[index][keep], 1e-10, "logits")
    dist.barrier()


@pytest.mark.parametrize("tsp", [2, 4])
@pytest.mark.parametrize("family", ["llama", "mistral", "qwen3", "gemma2", "olmo2"])  # windows 7, 9
def test_packed_rows_match_documents_run_alone(pool, family, tsp):
    pool.run(packed_parity, family, tsp)


@pytest.mark.parametrize("size", [2, 4, 8])
def test_causal_work_is_balanced(size):
    rnd = random.Random(0)
    for _ in range(100):
        lengths = [rnd.choice([rnd.randint(1, 8), rnd.randint(1, 64), rnd.randint(1, 600)])
                   for _ in range(rnd.randint(2, 12))]
        pos = torch.cat([torch.arange(n) for n in lengths])[None]
        out = shard_batch({"input_ids": torch.zeros_like(pos), "position_ids": pos},
                          SimpleNamespace(rank=0, size=size, layout="zigzag"))
        padded = [n for n in out["tsp_docs"][0].tolist() if n]
        work = []
        for p in range(size):
            pieces = plan_pieces(row_segments(padded, p, size), sum(padded), True, None)
            work.append(sum((pc.q1 - pc.q0) * (pc.k1 - pc.k0) if pc.mask == "full"
                            else (pc.q1 - pc.q0) * (pc.q1 - pc.q0 + 1) // 2 for pc in pieces))
        mean = sum(work) / size
        assert max(abs(w - mean) for w in work) <= 0.1 * mean, (lengths, work)


def test_bad_packing_metadata():
    mesh = SimpleNamespace(rank=0, size=2, layout="zigzag")
    ids = torch.zeros(1, 10, dtype=torch.long)
    with pytest.raises(ValueError, match=r"cu_seqlens of row 0 must start at 0 and end at the row "
                                         r"length \(10\), got \[0, 4, 9\]"):
        shard_batch({"input_ids": ids, "cu_seqlens": torch.tensor([0, 4, 9])}, mesh)
    with pytest.raises(ValueError, match=r"cu_seqlens of row 0 must strictly increase"):
        shard_batch({"input_ids": ids, "cu_seqlens": torch.tensor([0, 6, 4, 10])}, mesh)
    with pytest.raises(ValueError, match=r"position_ids of row 0 start at 3"):
        shard_batch({"input_ids": ids, "position_ids": torch.arange(3, 13)[None]}, mesh)
    with pytest.raises(ValueError, match=r"go from 2 to 5 at index 3"):
        pos = torch.tensor([[0, 1, 2, 5, 6, 0, 1, 2, 3, 4]])
        shard_batch({"input_ids": ids, "position_ids": pos}, mesh)
    with pytest.raises(ValueError, match=r"cu_seqlens describes 1 rows, input_ids has 2"):
        shard_batch({"input_ids": torch.zeros(2, 10, dtype=torch.long),
                     "cu_seqlens": torch.tensor([0, 10])}, mesh)
    # cu_seqlens and restarting position_ids describe the same packing
    a = shard_batch({"input_ids": ids, "cu_seqlens": torch.tensor([0, 3, 10])}, mesh)
    b = shard_batch({"input_ids": ids, "position_ids": torch.tensor([[0, 1, 2] + list(range(7))])},
                    mesh)
    assert all(torch.equal(a[k], b[k]) for k in a)
