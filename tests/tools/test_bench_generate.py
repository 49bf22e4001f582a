"""``tsp bench --mode generate``: a real 2-process run of TSP, the tensor-parallel baseline and one
process through the console entry point; TSP and TP generate the one-process tokens, and TSP's
per-rank KV cache is half of the one-process cache (within one token)."""

from __future__ import annotations

import json
import os
import subprocess
import sys


def test_bench_generate_mode(tmp_path):
    out_json = tmp_path / "gen.json"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    run = subprocess.run(
        [sys.executable, "-m", "tsp_core.tools.cli", "bench", "--mode", "generate", "--degree", "2",
         "--seq", "64", "--new-tokens", "4", "--steps", "1", "--json", str(out_json)],
        capture_output=True, text=True, timeout=300, env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    records = {r["layout"]: r for r in json.loads(out_json.read_text())["records"]}
    assert sorted(records) == ["single", "tp", "tsp"]
    single, tsp, tp = records["single"], records["tsp"], records["tp"]
    assert tsp["same_tokens_as_single"] is True and tp["same_tokens_as_single"] is True
    for r in records.values():
        assert r["prefill_tokens_per_s"] > 0 and r["decode_tokens_per_s"] > 0, r
        assert len(r["kv_bytes"]) == 2 and min(r["kv_bytes"]) > 0, r
    # 64 prompt tokens + 3 fed back: HF holds 67 tokens, TSP's ranks 34 and 33
    token = single["kv_bytes"][0] / 67
    assert sorted(tsp["kv_bytes"]) == [33 * token, 34 * token], tsp["kv_bytes"]
    assert tp["kv_bytes"] == [single["kv_bytes"][0] / 2] * 2   # TP splits the heads
    # TSP decode: embed, 4 per layer (2 layers), logits; no weight collective
    assert tsp["decode_calls_per_token"] == 10 and tp["decode_calls_per_token"] == 6
    assert "tsp " in run.stdout and "decode tok/s" in run.stdout
