"""Draw the fold (docs/img/fold.png): for D ranks, which tokens each rank holds, whose attention
weight shard is broadcast in which round with the K/V all-gathered per head group, and the MLP
weight shards travelling around the ring while the tokens stay (docs/design.md "Mesh and layout",
"Attention", "Gated MLP").

Why it lives in docs/scripts/: the picture is part of the docs and is regenerated with them, so
the script ships beside them in the repository; it is not part of the ``tsp_core`` package (which
must not need matplotlib) nor a ``tsp`` command. Run it from the repository root:

    python docs/scripts/draw_fold.py [--size 4] [--out docs/img/fold.png]

The chunk-to-rank labels come from ``tsp_core.distributed.chunks`` (the same functions the batch
sharding and the K/V all-gather use), never typed in here, so the picture follows the code;
tests/project/test_fold_picture.py checks that, and that the round and ring orders drawn here are
the ones ``tsp_core.layers.attention.rounds`` and ``tsp_core.distributed.comm`` run. The PNG is
written without a timestamp or a software version in its metadata, so a rerun with the same
matplotlib gives the same bytes.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.axes import Axes  # noqa: E402
from matplotlib.colors import to_rgb  # noqa: E402
from matplotlib.patches import FancyArrowPatch, Rectangle  # noqa: E402

from tsp_core.distributed.chunks import num_chunks, rank_chunks  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
OUT = ROOT / "docs" / "img" / "fold.png"
LAYOUT = "zigzag"
PALETTE = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f")


def chunk_owner(size: int) -> list[int]:
    """The rank that owns each global chunk, from the layout code."""
    owner = [-1] * num_chunks(size, LAYOUT)
    for r in range(size):
        for k in rank_chunks(r, size, LAYOUT):
            owner[k] = r
    return owner


def round_source(round_: int) -> int:
    """The rank whose attention shard round ``round_`` broadcasts (rounds.py ``Rounds``)."""
    return round_


def ring_holder(rank: int, step: int, size: int) -> int:
    """Whose MLP shard ``rank`` computes with at ring step ``step`` (comm.ring_over_shards)."""
    return (rank - step) % size


def _fill(color: str, amount: float = 0.6) -> tuple[float, float, float]:
    """``color`` mixed with white, for box fills that keep dark text readable."""
    return tuple(c + (1 - c) * amount for c in to_rgb(color))


def _box(ax: Axes, x: float, y: float, w: float, h: float, text: str, color: str, *,
         bold: bool = False, size: float = 10, fill: float = 0.6) -> None:
    ax.add_patch(Rectangle((x, y), w, h, facecolor=_fill(color, fill), edgecolor=color,
                           linewidth=2.6 if bold else 1.2))
    ax.text(x + w / 2, y + h / 2, text, ha="center", va="center", fontsize=size,
            fontweight="bold" if bold else "normal")


def _arrow(ax: Axes, a: tuple[float, float], b: tuple[float, float], color: str, *,
           rad: float = 0.0, width: float = 1.6) -> None:
    ax.add_patch(FancyArrowPatch(a, b, arrowstyle="-|>", mutation_scale=13, color=color,
                                 linewidth=width, connectionstyle=f"arc3,rad={rad}", zorder=3))


def _chunk_label(k: int) -> str:
    return f"c{k}"


def _tokens(ax: Axes, size: int, x: float, top: float, row_h: float, title: str) -> None:
    """A column of each rank's own chunks (local order), which never move."""
    ax.text(x + 1.1, top + 0.25, title, ha="center", va="bottom", fontsize=10, style="italic")
    for p in range(size):
        y = top - (p + 1) * row_h
        for i, k in enumerate(rank_chunks(p, size, LAYOUT)):
            _box(ax, x + 1.1 * i, y + 0.1, 1.0, row_h - 0.2, _chunk_label(k), PALETTE[p], size=9)


def _rank_labels(ax: Axes, size: int, x: float, top: float, row_h: float) -> None:
    for p in range(size):
        ax.text(x, top - (p + 0.5) * row_h, f"rank {p}", ha="right", va="center", fontsize=11,
                color=PALETTE[p], fontweight="bold")


def draw_tokens(ax: Axes, size: int) -> None:
    """Panel 1: the sequence cut into 2D chunks, and the two each rank holds."""
    owner, n = chunk_owner(size), num_chunks(size, LAYOUT)
    ax.set_title(f"1. Tokens: the sequence is cut into 2D = {n} chunks; rank p holds chunks p "
                 f"and 2D-1-p (equal causal work on every rank)", loc="left", fontsize=12)
    ax.text(-0.2, size + 0.5, "sequence", ha="right", va="center", fontsize=11)
    for k in range(n):
        _box(ax, k, size + 0.1, 1.0, 0.8, f"{_chunk_label(k)}\nrank {owner[k]}",
             PALETTE[owner[k]], size=9)
    _rank_labels(ax, size, -0.2, size, 1.0)
    for p in range(size):
        for k in rank_chunks(p, size, LAYOUT):
            _box(ax, k, size - p - 0.9, 1.0, 0.8, _chunk_label(k), PALETTE[p], size=9)
    ax.text(n + 0.4, size / 2, "positions (RoPE) stay global;\nlabels are shifted before "
            "sharding,\nso no rank needs a neighbour's token", ha="left", va="center",
            fontsize=10)
    ax.set_xlim(-1.6, n + 5.5)
    ax.set_ylim(-0.2, size + 1.2)


def draw_attention(ax: Axes, size: int) -> None:
    """Panel 2: round r broadcasts rank r's packed attention shard; K/V of head group r are
    all-gathered; every rank keeps its own tokens."""
    owner, n = chunk_owner(size), num_chunks(size, LAYOUT)
    ax.set_title("2. Attention: in round r, rank r broadcasts its shard [Wq|Wk|Wv|Wo] of head "
                 "group r; the K/V of that group are all-gathered", loc="left", fontsize=12)
    top, x0, col_w = size + 0.0, 3.2, n * 0.34 + 0.6
    _rank_labels(ax, size, -0.2, top, 1.0)
    _tokens(ax, size, 0.0, top, 1.0, "own tokens (stay)")
    for r in range(size):
        src = round_source(r)
        x = x0 + r * col_w
        ax.text(x + (col_w - 0.6) / 2, top + 0.25, f"round {r}", ha="center", va="bottom",
                fontsize=11, fontweight="bold")
        for p in range(size):
            y = top - (p + 1) * 1.0 + 0.12
            text = f"W{src}  (sends)" if p == src else f"W{src}"
            _box(ax, x, y, col_w - 0.6, 0.76, text, PALETTE[src], bold=p == src, size=10)
        # the broadcast: one line down the right edge from the sender into every other rank
        right = x + col_w - 0.6
        rows = [top - p - 0.5 for p in range(size)]
        ax.plot([right + 0.22, right + 0.22], [min(rows), max(rows)], color=PALETTE[src],
                linewidth=1.6)
        ax.plot([right, right + 0.22], [rows[src], rows[src]], color=PALETTE[src], linewidth=1.6)
        for p in range(size):
            if p != src:
                _arrow(ax, (right + 0.22, rows[p]), (right, rows[p]), PALETTE[src], width=1.4)
        # K/V of head group r, every chunk computed by the rank that owns those tokens
        y = -0.95
        w = (col_w - 0.6) / n
        for k in range(n):
            ax.add_patch(Rectangle((x + k * w, y), w, 0.55, facecolor=_fill(PALETTE[owner[k]]),
                                   edgecolor=PALETTE[owner[k]], linewidth=1.0))
            ax.text(x + (k + 0.5) * w, y + 0.275, str(k), ha="center", va="center", fontsize=7)
        ax.text(x + (col_w - 0.6) / 2, y - 0.12, f"K{src}, V{src}: all chunks,\non every rank",
                ha="center", va="top", fontsize=9)
    ax.text(0.0, -0.68, "all-gathered\nK/V (chunk:\ncolour = the\nrank that\ncomputed it)",
            ha="left", va="center", fontsize=8.5)
    ax.text(x0, -2.35, "Each round: every rank projects Q, K, V of head group r for its own "
            "tokens, attends its queries to the gathered K/V,\nand adds A_r Wo_r^T to its own "
            "output (no all-reduce).\nThe next rounds' broadcast and K/V all-gather are in "
            "flight while a round computes.", ha="left", va="top", fontsize=10)
    ax.set_xlim(-1.6, x0 + size * col_w + 0.2)
    ax.set_ylim(-3.2, top + 0.9)


def draw_mlp(ax: Axes, size: int) -> None:
    """Panel 3: the gated MLP's weight shards pass around the ring, one hop per step."""
    ax.set_title("3. Gated MLP: the weight shards [Wg|Wu|Wd] travel around the ring "
                 "(rank p sends to p+1); the tokens stay", loc="left", fontsize=12)
    top, x0, col_w = size + 0.0, 3.2, 2.6
    _rank_labels(ax, size, -0.2, top, 1.0)
    _tokens(ax, size, 0.0, top, 1.0, "own tokens (stay)")
    for step in range(size):
        x = x0 + step * col_w
        ax.text(x + (col_w - 0.9) / 2, top + 0.25, f"step {step}", ha="center", va="bottom",
                fontsize=11, fontweight="bold")
        for p in range(size):
            s = ring_holder(p, step, size)
            y = top - (p + 1) * 1.0 + 0.12
            _box(ax, x, y, col_w - 0.9, 0.76, f"W{s}" + ("  (own)" if s == p else ""),
                 PALETTE[s], bold=s == p, size=10)
            if step + 1 < size:
                nxt = (p + 1) % size
                a = (x + col_w - 0.9, y + 0.38)
                if nxt > p:
                    _arrow(ax, a, (x + col_w, y - 1.0 + 0.38), PALETTE[s], width=1.2)
                else:  # the wrap-around hop, up the gap into the top of rank 0's box
                    gap = x + col_w - 0.45
                    ax.plot([a[0], gap, gap, x + col_w + 0.35], [a[1], a[1], top + 0.05,
                            top + 0.05], color=PALETTE[s], linewidth=1.1, linestyle="--",
                            zorder=3)
                    _arrow(ax, (x + col_w + 0.35, top + 0.05), (x + col_w + 0.35, top - 0.12),
                           PALETTE[s], width=1.1)
    ax.text(x0, -0.35, f"After {size} steps every rank has used every shard on its own tokens. "
            "In the backward the shards circulate again, each followed by its\ngradient "
            "accumulator; one last hop brings the summed gradient to the shard's owner.",
            ha="left", va="top", fontsize=10)
    ax.set_xlim(-1.6, x0 + size * col_w + 0.2)
    ax.set_ylim(-1.4, top + 0.9)


def build_figure(size: int = 4) -> plt.Figure:
    """The three panels for a TSP group of ``size`` ranks."""
    fig, axes = plt.subplots(3, 1, figsize=(13, 14.5),
                             gridspec_kw={"height_ratios": [size + 1.4, size + 4.1, size + 2.3]})
    for ax, draw in zip(axes, (draw_tokens, draw_attention, draw_mlp)):
        draw(ax, size)
        ax.set_aspect("equal")
        ax.axis("off")
    fig.suptitle(f"The fold: D = {size} ranks, each holding 1/D of the tokens and 1/D of "
                 "every weight", fontsize=14, fontweight="bold")
    fig.tight_layout()
    return fig


def draw(out: Path = OUT, size: int = 4) -> Path:
    """Write the picture to ``out`` (PNG, no timestamp or version in its metadata)."""
    fig = build_figure(size)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=90, metadata={"Software": None})
    plt.close(fig)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", type=int, default=4, help="ranks in the TSP group (default 4)")
    parser.add_argument("--out", type=Path, default=OUT, help=f"PNG to write (default {OUT})")
    args = parser.parse_args(argv)
    print(draw(args.out, args.size))


if __name__ == "__main__":
    main()
