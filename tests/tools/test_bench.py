"""``tsp bench``: a real 2-process run of every layout (gloo), end to end through the console
entry point: table, JSON and PNG, and measured bytes per layer equal to the formula of
docs/design.md "Communication per layer"."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest


def test_bench_runs_every_layout(tmp_path):
    out_json, out_png = tmp_path / "bench.json", tmp_path / "bench.png"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    run = subprocess.run(
        [sys.executable, "-m", "tsp_core.tools.cli", "bench", "--layouts", "tsp,tp,tp-sp,cp,tp+cp",
         "--degree", "2", "--seq", "128,256", "--model", "tiny", "--steps", "1",
         "--json", str(out_json), "--plot", str(out_png)],
        capture_output=True, text=True, timeout=600, env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    # tp+cp has no T x S split of 2 ranks with T, S > 1: said, not silently dropped
    assert "skipped tp+cp" in run.stderr
    # a progress line per case as it finishes, with the seconds since the start (as tsp simulate)
    assert re.search(r"^\[8/8 \d+s\] ", run.stderr, re.M), run.stderr
    records = json.loads(out_json.read_text())["records"]
    assert [(r["layout"], r["seq"]) for r in records] == [
        (name, seq) for seq in (128, 256) for name in ("tsp", "tp", "tp-sp", "cp")]
    for r in records:
        assert r["tokens_per_s"] > 0 and len(r["peak_bytes"]) == 2 and min(r["peak_bytes"]) > 0
        assert abs(r["layer_forward_bytes"] / r["formula_layer_forward_bytes"] - 1) < 0.02, r
        # every layout's collectives are timed, DTensor's too: each waits on some
        assert r["wait_fraction"] > 0, r
    assert out_png.stat().st_size > 10_000
    for r in records:
        assert f"{r['layout']:<15} {r['seq']:>6}" in run.stdout


def test_bench_refuses_no_warmup_before_any_process_starts():
    from tsp_core.tools.bench import BenchConfig

    with pytest.raises(ValueError, match=r"warmup \(0\) and steps \(4\) must be at least 1"):
        BenchConfig(warmup=0)
