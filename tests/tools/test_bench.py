"""``tsp bench``: a real 2-process run of every layout (gloo), end to end through the console
entry point: table, JSON and PNG, and measured bytes per layer equal to the formula of
docs/design.md "Communication per layer". ``tsp bench --compile``'s cases on the session's pool
of 2: tp-sp's layers compiled whole (aot_eager) give eager's losses bit for bit."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
import torch


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


def compiled_and_eager_tp_sp() -> list:
    """``tsp bench --compile``'s cases for tp-sp, eager then compiled with aot_eager, on a rank of
    the pool (what each bench worker runs per case); and TSP's layers compiled by the same
    ``build(..., compile=)`` (built only: tests/models/test_compiled.py runs them)."""
    from transformers import LlamaForCausalLM

    from tsp_core.baselines import build, layout_specs
    from tsp_core.plan.simulate import model_config
    from tsp_core.tools import bench_compile as bc

    cfg = bc.CompileBenchConfig(layouts="tp-sp", seq=64, steps=1, warmup=1, backend="aot_eager")
    records = [bc.measure(cfg, "tp-sp", mode, torch.device("cpu"))
               for mode in ("eager", "compiled")]
    torch.manual_seed(0)
    with bc.cold_compiles():
        pm = build(LlamaForCausalLM(model_config("tiny", seq=64)), layout_specs("tsp", 2)[0],
                   compile="aot_eager")
        tsp_compiled = [getattr(type(layer), "compiled_by", None) == "aot_eager"
                        for layer in pm.layers]
    return [records, tsp_compiled]


def test_bench_compile_compares_one_compiled_unit_with_eager(pools):
    from tsp_core.tools import bench_compile as bc

    for rank, (records, tsp_compiled) in enumerate(pools.of(2).run(compiled_and_eager_tp_sp)):
        eager, compiled = records
        assert (eager.mode, eager.graphs, compiled.mode) == ("eager", 0, "compiled"), records
        # every decoder layer traced whole into one graph (fullgraph), no break
        assert compiled.graphs >= 1 and compiled.graph_breaks == 0, compiled
        # aot_eager splits the same graph without code generation: the same losses, bit for bit
        assert compiled.losses == eager.losses and len(eager.losses) == 2, records
        assert all(r.tokens_per_s > 0 and len(r.step_seconds) == 1 for r in records)
        assert tsp_compiled == [True, True], f"rank {rank}: TSP's layers not compiled"
    (row,) = bc.summary(records)
    assert row["layout"] == "tp-sp" and row["loss_gap"] == 0 and row["ratio"] > 0, row
    assert "compiled/eager" in bc.table(records)


def test_bench_compile_refuses_before_any_process_starts():
    from tsp_core.tools import bench_compile as bc
    from tsp_core.tools import cli

    assert bc.cases_of(bc.CompileBenchConfig()) == [
        ("tsp", "eager"), ("tsp", "compiled"), ("tp-sp", "eager"), ("tp-sp", "compiled")]
    args = cli.parser().parse_args(["bench", "--compile", "--seq", "64,128"])
    with pytest.raises(ValueError, match=r"--compile runs one sequence length \(got --seq 64,128"):
        cli.bench_main(args)
