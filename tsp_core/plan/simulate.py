"""Per-rank memory of TSP layers at any scale, measured on one CPU: the real code of rank 0 of a
D-rank world runs under ``FakeTensorMode`` with the ``fake`` process-group backend, and
``MemTracker`` records every tensor it allocates (DESIGN 4).

Run as ``python -m tsp_core.plan.simulate --seq 131072 --degree 4,8``; it owns the default process
group of its process, so call it in a fresh process.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist
from torch import nn

GIB = 1024 ** 3


@dataclass(frozen=True)
class BlockShape:
    hidden_size: int = 4096
    num_heads: int = 32
    num_kv_heads: int = 32
    intermediate_size: int = 16384


SHAPES = {"7b": BlockShape(), "tiny": BlockShape(64, 4, 2, 128)}


class TSPBlock(nn.Module):
    """Attention then gated MLP, each with a residual: the two TSP layers of a decoder block."""

    def __init__(self, mesh, shape: BlockShape, dtype: torch.dtype) -> None:
        super().__init__()
        from ..attention import TSPAttention
        from ..mlp import TSPGatedMLP

        self.attn = TSPAttention(mesh, shape.hidden_size, shape.num_heads, shape.num_kv_heads,
                                 dtype=dtype, init_seed=None)
        self.mlp = TSPGatedMLP(mesh, shape.hidden_size, shape.intermediate_size, dtype=dtype,
                               init_seed=None)

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        h = x + self.attn(x, position_ids)
        return h + self.mlp(h)


@dataclass
class MemoryReport:
    degree: int
    seq: int
    batch: int
    peak_bytes: int
    breakdown: dict[str, int]

    @property
    def peak_gib(self) -> float:
        return self.peak_bytes / GIB


def simulate_block(degree: int, seq: int, shape: BlockShape = SHAPES["7b"], batch: int = 1,
                   dtype: torch.dtype = torch.bfloat16) -> MemoryReport:
    """Peak memory of rank 0 over one forward + backward of a TSP block at TSP degree ``degree``."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.mem_tracker import MemTracker
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from ..layout import position_ids
    from ..mesh import init_mesh

    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group("fake", rank=0, world_size=degree, store=FakeStore())
    try:
        mesh = init_mesh(degree)
        with FakeTensorMode():
            block = TSPBlock(mesh, shape, dtype)
            tracker = MemTracker()
            tracker.track_external(block)
            with tracker:
                x = torch.randn(batch, seq // degree, shape.hidden_size, dtype=dtype,
                                requires_grad=True)
                pos = position_ids(seq, mesh.rank, degree, mesh.layout)
                block(x, pos).sum().backward()
            peak = tracker.get_tracker_snapshot("peak")
    finally:
        dist.destroy_process_group()
    (snap,) = peak.values()
    breakdown = {str(getattr(k, "value", k)): int(v) for k, v in snap.items() if k != "Total"}
    return MemoryReport(degree, seq, batch, int(snap["Total"]), breakdown)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="7b")
    ap.add_argument("--seq", default="131072", help="comma-separated sequence lengths")
    ap.add_argument("--degree", default="4,8", help="comma-separated TSP degrees")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--json", action="store_true", help="print JSON records instead of a table")
    args = ap.parse_args(argv)
    reports = [simulate_block(d, s, SHAPES[args.shape], args.batch)
               for s in map(int, args.seq.split(",")) for d in map(int, args.degree.split(","))]
    if args.json:
        print(json.dumps([asdict(r) | {"peak_gib": r.peak_gib} for r in reports]))
        return
    kinds = sorted({k for r in reports for k in r.breakdown})
    print(f"{'seq':>8} {'D':>3} {'peak GiB':>9} " + " ".join(f"{k:>11}" for k in kinds))
    for r in reports:
        print(f"{r.seq:>8} {r.degree:>3} {r.peak_gib:>9.3f} "
              + " ".join(f"{r.breakdown.get(k, 0) / GIB:>11.3f}" for k in kinds))


if __name__ == "__main__":
    main()
