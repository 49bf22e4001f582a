"""DESIGN 4 proven by measurement: one 7B-shaped attention + MLP block (h=4096, 32 heads,
intermediate 16384, bf16, batch 1) at 131072 tokens, simulated for rank 0 under FakeTensorMode with
the fake process group and MemTracker. A kept remote weight shard or a kept gathered K/V does not
shrink with D, so it would break the D=8 / D=4 ratio."""

from __future__ import annotations

import json
import subprocess
import sys

GIB = 1024 ** 3


def simulate(*args: str) -> list[dict]:
    # the simulation owns the default process group (fake backend): run it in its own process
    out = subprocess.run([sys.executable, "-m", "tsp_core.plan.simulate", "--json", *args],
                         check=True, capture_output=True, text=True, timeout=600)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_block_peak_shrinks_with_degree():
    d4, d8 = simulate("--shape", "7b", "--seq", "131072", "--degree", "4,8")
    assert (d4["degree"], d8["degree"]) == (4, 8)
    ratio = d8["peak_bytes"] / d4["peak_bytes"]
    assert ratio <= 0.55, f"peak at D=8 is {ratio:.3f} of D=4 (limit 0.55): {d4} {d8}"
    assert d8["peak_bytes"] <= 3.0 * GIB, f"peak at D=8 is {d8['peak_bytes'] / GIB:.3f} GiB > 3.0"
    # parameters are exactly this rank's shards: attention 4h^2/D + MLP 3Fh/D, bf16
    h, f = 4096, 16384
    for rec in (d4, d8):
        assert rec["breakdown"]["Parameter"] == (4 * h * h + 3 * f * h) // rec["degree"] * 2
