"""Zigzag and contiguous layouts, padding, label shift and shard_batch (pure functions)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from tsp_core.distributed.chunks import local_segments
from tsp_core.sequence.layout import (
    IGNORE_INDEX,
    pad_to_multiple,
    position_ids,
    shard_batch,
    shard_sequence,
    shift_labels,
    to_rank_order,
    unshard_sequence,
)


def fake_mesh(rank: int, size: int, layout: str = "zigzag"):
    return SimpleNamespace(rank=rank, size=size, layout=layout)


def test_zigzag_chunks():
    # S = 16, D = 4: chunks of 2; rank 1 owns chunks 1 and 6
    assert local_segments(16, 1, 4) == [(2, 4), (12, 14)]
    assert local_segments(16, 0, 4) == [(0, 2), (14, 16)]
    assert local_segments(16, 3, 4, "contiguous") == [(12, 16)]
    assert position_ids(16, 1, 4).tolist() == [2, 3, 12, 13]


@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
@pytest.mark.parametrize("size", [1, 2, 3, 4])
def test_round_trip(layout, size):
    seq = 24
    x = torch.arange(2 * seq * 3).view(2, seq, 3)
    pieces = [shard_sequence(x, r, size, 1, layout) for r in range(size)]
    assert all(p.shape == (2, seq // size, 3) for p in pieces)
    assert torch.equal(unshard_sequence(torch.cat(pieces, 1), size, 1, layout), x)
    assert torch.equal(to_rank_order(x, size, 1, layout), torch.cat(pieces, 1))
    # every token exactly once, with its own global position
    pos = torch.cat([position_ids(seq, r, size, layout) for r in range(size)])
    assert sorted(pos.tolist()) == list(range(seq))
    assert torch.equal(torch.cat(pieces, 1)[0, :, 0] // 3, pos)


def test_zigzag_balances_causal_work():
    seq, size = 64, 4
    work = [sum(int(p) + 1 for p in position_ids(seq, r, size)) for r in range(size)]
    assert len(set(work)) == 1, work


def test_uneven_length_is_rejected():
    with pytest.raises(ValueError, match=r"sequence length \(10\) must be a multiple of 8"):
        shard_sequence(torch.zeros(1, 10), 0, 4)


def test_shift_and_pad():
    labels = torch.tensor([[5, 6, 7]])
    assert shift_labels(labels).tolist() == [[6, 7, IGNORE_INDEX]]
    assert pad_to_multiple(labels, 2, -1).tolist() == [[5, 6, 7, -1]]


@pytest.mark.parametrize("size", [1, 2, 4])
def test_shard_batch_pads_and_shifts(size):
    seq = 13
    ids = torch.arange(100, 100 + 2 * seq).view(2, seq)
    mask = torch.ones_like(ids)
    out = [shard_batch({"input_ids": ids, "labels": ids, "attention_mask": mask},
                       fake_mesh(r, size))
           for r in range(size)]
    padded = -(-seq // (2 * size)) * (2 * size)
    full = {k: unshard_sequence(torch.cat([o[k] for o in out], 1), size) for k in out[0]
            if not k.startswith("tsp_")}
    assert all(o["tsp_docs"].tolist() == [[padded], [padded]] for o in out)
    assert torch.equal(full["input_ids"][:, :seq], ids)
    assert torch.equal(full["position_ids"], torch.arange(padded).expand(2, -1))
    expected = torch.full((2, padded), IGNORE_INDEX)
    expected[:, : seq - 1] = ids[:, 1:]
    assert torch.equal(full["shift_labels"], expected)
    assert full["attention_mask"][:, :seq].all() and not full["attention_mask"][:, seq:].any()


def test_shard_batch_errors():
    mesh = fake_mesh(0, 4)
    with pytest.raises(ValueError,
                       match=r"sequence length \(7\) is shorter than 2\*tsp_size \(8\)"):
        shard_batch({"input_ids": torch.zeros(1, 7, dtype=torch.long)}, mesh)
    with pytest.raises(ValueError, match=r"labels has shape \(1, 15\) but input_ids has \(1, 16\)"):
        shard_batch({"input_ids": torch.zeros(1, 16, dtype=torch.long),
                     "labels": torch.zeros(1, 15, dtype=torch.long)}, mesh)
    with pytest.raises(ValueError, match=r"does not know how to shard \['pixel_values'\]"):
        shard_batch({"input_ids": torch.zeros(1, 16, dtype=torch.long), "pixel_values": 1}, mesh)
    with pytest.raises(ValueError, match=r"attention_mask rows \[1\] have a 0 before a 1"):
        shard_batch({"input_ids": torch.zeros(2, 8, dtype=torch.long),
                     "attention_mask": torch.tensor([[1] * 6 + [0] * 2, [0] * 2 + [1] * 6])}, mesh)
    with pytest.raises(ValueError, match=r"\[batch, seq\]"):
        shard_batch({"input_ids": torch.zeros(16, dtype=torch.long)}, mesh)


def test_fingerprint_sees_every_input_of_a_row():
    """``tsp_fingerprint`` (one per row) is the same on every rank of the group and the row's
    changes with its tokens, its labels, its attention mask or its packing alone, so ranks given
    batches that differ in any one of them are told apart (docs/design.md "Input checks")."""
    ids = torch.arange(100, 132).view(2, 16)
    base = {"input_ids": ids, "labels": ids.clone(), "attention_mask": torch.ones_like(ids),
            "position_ids": torch.arange(16).repeat(2, 1)}
    prints = [shard_batch(base, fake_mesh(r, 2))["tsp_fingerprint"] for r in range(2)]
    assert torch.equal(prints[0], prints[1])
    changes = {"input_ids": (3, torch.tensor([7])), "labels": (3, torch.tensor([IGNORE_INDEX])),
               "attention_mask": (14, torch.tensor([0, 0])),  # right padding
               "position_ids": (9, torch.arange(7))}          # a second document from token 9
    for key, (start, values) in changes.items():
        batch = {k: v.clone() for k, v in base.items()}
        batch[key][1, start:start + len(values)] = values
        got = shard_batch(batch, fake_mesh(0, 2))["tsp_fingerprint"]
        assert got[1] != prints[0][1], (key, got, prints[0])
