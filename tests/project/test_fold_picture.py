"""The fold picture (docs/img/fold.png, drawn by docs/scripts/draw_fold.py) shows what the code
does: the script runs and writes a PNG with no timestamp in it (a rerun gives the same bytes), the
chunk-to-rank labels it draws follow the layout code (they change when the code's assignment
changes, and they equal what ``shard_sequence`` keeps on each rank), and the round and ring orders
it draws are the ones the attention rounds and the MLP ring run, simulated here for D = 4 ranks in
threads with the collectives replaced by in-memory copies (the real loops, no process group).

The committed PNG is not compared byte for byte: matplotlib's output differs across versions."""

from __future__ import annotations

import threading
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from tests.support import launch
from tsp_core.distributed import comm
from tsp_core.layers.attention import rounds
from tsp_core.sequence.layout import shard_sequence

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "docs" / "scripts" / "draw_fold.py"
D = 4


@pytest.fixture(scope="module")
def draw_fold():
    return launch.load_script(SCRIPT, "draw_fold")


def png_chunks(data: bytes) -> list[bytes]:
    """The chunk types of a PNG file, in order."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    out, i = [], 8
    while i < len(data):
        n = int.from_bytes(data[i:i + 4], "big")
        out.append(data[i + 4:i + 8])
        i += 12 + n
    return out


def sequence_labels(fig) -> set[str]:
    """The labels of the whole-sequence row of panel 1: "c<chunk>\\nrank <owner>"."""
    return {t.get_text() for t in fig.axes[0].texts if "\nrank " in t.get_text()}


def test_the_script_writes_a_png_without_a_timestamp(draw_fold, tmp_path):
    first = draw_fold.draw(tmp_path / "a.png", D).read_bytes()
    kinds = png_chunks(first)
    assert kinds[0] == b"IHDR" and kinds[-1] == b"IEND" and b"IDAT" in kinds
    assert not {b"tIME", b"tEXt", b"iTXt", b"zTXt"} & set(kinds), kinds
    assert draw_fold.draw(tmp_path / "b.png", D).read_bytes() == first
    assert (ROOT / "docs" / "img" / "fold.png").is_file()


def test_the_chunk_labels_come_from_the_layout_code(draw_fold, monkeypatch):
    tokens = torch.arange(2 * D).unsqueeze(0)  # one token per chunk: token k is chunk k
    expected = {f"c{k}\nrank {p}" for p in range(D)
                for k in shard_sequence(tokens, p, D).flatten().tolist()}
    fig = draw_fold.build_figure(D)
    assert sequence_labels(fig) == expected
    # a different assignment in the code changes the picture: nothing is typed into the script
    monkeypatch.setattr(draw_fold, "rank_chunks", lambda r, size, layout: (2 * r, 2 * r + 1))
    fig = draw_fold.build_figure(D)
    assert sequence_labels(fig) == {f"c{k}\nrank {k // 2}" for k in range(2 * D)}


def run_ranks(body) -> list:
    """``body(rank)`` on D threads at once; their results in rank order."""
    out, errors = [None] * D, []

    def run(rank: int) -> None:
        try:
            out[rank] = body(rank)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(r,)) for r in range(D)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors, errors
    return out


def fake_dist(me: threading.local) -> SimpleNamespace:
    return SimpleNamespace(get_world_size=lambda group: D, get_rank=lambda group: me.rank)


def test_the_rounds_drawn_are_the_broadcasts_the_attention_runs(draw_fold, monkeypatch):
    me, barrier, sent = threading.local(), threading.Barrier(D, timeout=20), {}

    def broadcast(buf, src, group, async_op):
        call = me.calls = getattr(me, "calls", -1) + 1
        if me.rank == src:
            sent[call] = buf

        def wait():
            barrier.wait()
            if me.rank != src:
                buf.copy_(sent[call])
            barrier.wait()
        return SimpleNamespace(wait=wait)

    monkeypatch.setattr(rounds, "dist", fake_dist(me))
    monkeypatch.setattr(rounds, "comm", SimpleNamespace(broadcast=broadcast))

    def body(rank: int) -> list[int]:
        me.rank = rank
        # each rank's own shard holds its rank: what arrives in round r says whose it is
        return [int(buf.item()) for _, buf in rounds.Rounds(torch.tensor([float(rank)]), None)]

    arrived = run_ranks(body)
    assert arrived == [[draw_fold.round_source(r) for r in range(D)]] * D, arrived


def test_the_ring_drawn_is_the_ring_the_mlp_runs(draw_fold, monkeypatch):
    me, barrier, mailbox = threading.local(), threading.Barrier(D, timeout=20), {}

    class Hop:
        def __init__(self, group, tag):
            pass

        def start(self, buf):
            mailbox[(me.rank + 1) % D] = buf.clone()  # ring_pass sends to the next rank

        def wait(self):
            barrier.wait()
            got = mailbox[me.rank]
            barrier.wait()
            return got

    monkeypatch.setattr(comm, "dist", fake_dist(me))
    monkeypatch.setattr(comm, "RingHop", Hop)

    def body(rank: int) -> list[int]:
        me.rank = rank
        held: list[int] = []
        comm.ring_over_shards(torch.tensor([float(rank)]), None,
                              lambda owner, shard: held.append(int(shard.item())))
        return held

    held = run_ranks(body)
    assert held == [[draw_fold.ring_holder(p, s, D) for s in range(D)] for p in range(D)], held
