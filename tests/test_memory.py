"""DESIGN 4 proven by measurement: whole Llama-family models simulated for rank 0 under
FakeTensorMode with the fake process group and MemTracker (``tsp simulate``), one training step
with AdamW state and full recompute. A kept remote weight shard or gathered K/V would not shrink
with D and would break the ratios below."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

GIB = 1024 ** 3


def simulate(tmp_path, *args: str) -> list[dict]:
    # each simulation owns the default process group (fake backend) of a fresh process
    out = tmp_path / "sim.json"
    subprocess.run([sys.executable, "-m", "tsp_core.cli", "simulate", "--json", str(out), *args],
                   check=True, capture_output=True, text=True, timeout=600)
    return json.loads(out.read_text())


def test_tsp_peak_halves_when_degree_doubles(tmp_path):
    # the 7B shape (h=4096, 32 heads, intermediate 16384, vocab 32000, bf16) with 2 of its layers
    d4, d8 = simulate(tmp_path, "--model", "7b", "--layers", "2", "--seq", "131072",
                      "--degree", "4,8", "--layouts", "tsp", "--recompute", "full")
    assert (d4["degree"], d8["degree"]) == (4, 8)
    ratio = d8["peak_bytes"] / d4["peak_bytes"]
    assert 0.5 * 0.85 <= ratio <= 0.5 * 1.15, f"D=8 / D=4 peak = {ratio:.3f}, not 1/2 within 15%"
    h, f, v, layers = 4096, 16384, 32000, 2
    for rec in (d4, d8):
        d = rec["degree"]
        own = 2 * v * h // d + layers * (4 * h * h + 3 * f * h) // d + (2 * layers + 1) * h
        assert rec["breakdown"]["parameters"] == own * 2, rec  # exactly this rank's bf16 shards
        # AdamW: two bf16 moments per element and a float32 step count per tensor (embedding,
        # LM head, final norm; per layer q, k, v, o, gate, up, down and two norms)
        assert rec["breakdown"]["optimizer_states"] == 2 * own * 2 + 4 * (3 + 9 * layers), rec


def test_every_layout_keeps_its_share_of_the_model(tmp_path):
    recs = simulate(tmp_path, "--model", "tiny", "--seq", "512", "--degree", "4",
                    "--layouts", "tsp,tp,tp-sp,cp,tp+cp,tp-sp+cp", "--recompute", "none")
    by = {r["layout"]: r for r in recs}
    assert list(by) == ["tsp", "tp", "tp-sp", "cp", "tp+cp(2x2)", "tp-sp+cp(2x2)"]
    params = {k: r["breakdown"]["parameters"] for k, r in by.items()}
    # tiny: h=64, intermediate 256, 2 layers, vocab 512; 1/D of every matrix, norms replicated
    h, f, v, layers = 64, 256, 512, 2
    matrices, norms = 2 * v * h + layers * (4 * h * h + 3 * f * h), (2 * layers + 1) * h
    for name, t in (("tsp", 4), ("tp", 4), ("tp-sp", 4), ("cp", 1), ("tp+cp(2x2)", 2),
                    ("tp-sp+cp(2x2)", 2)):
        assert params[name] == (matrices // t + norms) * 2, (name, params)
    for r in recs:  # the peak is the sum of what was alive at that moment, by category
        assert r["peak_bytes"] == sum(r["breakdown"].values()), r


@pytest.mark.parametrize("bad,message", [(["--layouts", "tp+cp", "--degree", "3"], "3 has none"),
                                         (["--model", "13b"], "unknown model")])
def test_simulate_rejects_bad_requests(tmp_path, bad, message):
    out = subprocess.run([sys.executable, "-m", "tsp_core.cli", "simulate", "--seq", "64", *bad],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode != 0 and message in out.stderr, out.stderr[-2000:]
