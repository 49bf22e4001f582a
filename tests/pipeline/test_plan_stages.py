"""``tsp plan --pp``: a stage is ranked with the busiest stage's layers on gpus / pp GPUs; the
pipeline adds 1F1B's micro-batches in flight to the memory and its bubble to the step time."""

from __future__ import annotations

import argparse

import pytest

from tsp_core.plan.command import add_arguments, model_shape
from tsp_core.plan.cost import plan
from tsp_core.plan.hardware import DEVICES, Cluster
from tsp_core.plan.stages import bubble, stage_view, with_pipeline


def test_stage_view_and_pipeline_cost():
    shape = model_shape("llama-3.1-405b", None)
    cluster = Cluster(DEVICES["h100"], gpus_per_node=8, nodes=16)
    stage, stage_cluster, layers = stage_view(shape, cluster, 16)
    assert (layers, stage.num_layers, stage_cluster.gpus) == (8, 8, 8)  # (126 + 2) / 16 units
    with pytest.raises(ValueError, match=r"--pp \(3\) must divide the nodes \(16\)"):
        stage_view(shape, cluster, 3)
    ranked, _ = plan(stage, 131072, stage_cluster)
    c = next(c for c in ranked if c.layout == "tsp" and c.degree == 8)
    p = with_pipeline(c, stage, 131072, 1, 16, 64, 80e9 * 0.9, 1 << 24)
    layer_input = 131072 / 8 * 16384 * 2  # one checkpointed layer input, bytes per rank
    assert p.memory_gib - c.memory_gib == pytest.approx(15 * 8 * layer_input / 2 ** 30)
    assert p.step_s == pytest.approx((64 + 15) * c.step_s)
    assert p.tokens_per_s == pytest.approx(p.active_replicas * 64 * 131072 / p.step_s)
    assert bubble(16, 64) == pytest.approx(15 / 79)


def test_plan_command_takes_pp(capsys):
    from tsp_core.plan.command import main

    ap = argparse.ArgumentParser()
    add_arguments(ap)
    args = ap.parse_args(["--model", "llama-3.1-405b", "--seq", "131072", "--gpus", "128",
                          "--gpus-per-node", "8", "--gpu", "h100", "--pp", "8", "--top", "3"])
    assert main(args) == 0
    out = capsys.readouterr().out
    assert ("pipeline 8 stages on 16 GPUs each, the busiest of 16 layers, 32 micro-batches "
            "(1F1B bubble 17.9%)") in out, out
    assert "choice: tsp at D=16" in out, out
    args = ap.parse_args(["--model", "llama-3.1-405b", "--gpus", "128", "--gpus-per-node", "8",
                          "--gpu", "h100", "--pp", "8", "--microbatches", "4"])
    with pytest.raises(ValueError, match=r"--microbatches \(4\) must be at least --pp \(8\)"):
        main(args)


def test_simulate_adds_the_micro_batches_in_flight(capsys):
    import types

    from tsp_core.tools.cli import in_flight_bytes
    from tsp_core.tools.cli import main as tsp

    stage = types.SimpleNamespace(name="tsp", tp=8, cp=1, seq=131072, batch=1, layers=8,
                                  dtype="bfloat16")
    assert in_flight_bytes(stage, 16384, 16, 64) == 15 * 8 * (131072 // 8) * 16384 * 2  # 60 GiB
    assert in_flight_bytes(dataclasses_replace(stage, name="tp-sp"), 16384, 16, 64) == \
        15 * 8 * (131072 // 8) * 16384 * 2  # sequence parallel: the same S/D x h per layer
    assert in_flight_bytes(stage, 16384, 16, 4) == 3 * 8 * (131072 // 8) * 16384 * 2
    assert tsp(["simulate", "--model", "tiny", "--seq", "256", "--degree", "2", "--layouts",
                "tsp", "--pp", "2", "--jobs", "1"]) == 0
    out = capsys.readouterr()
    assert "model tiny: 1 layers" in out.err, out.err  # (2 + 2) / 2 units: 1 decoder layer
    head, row = out.out.splitlines()[-2:]
    assert head.split()[-4:] == ["in", "flight", "pp", "peak"], head
    peak, flight, pp_peak = (float(row.split()[i]) for i in (3, -2, -1))
    assert abs(pp_peak - peak - flight) <= 0.01, row
    with pytest.raises(SystemExit, match=r"--pp \(2\) simulates the busiest stage"):
        tsp(["simulate", "--model", "tiny", "--layers", "2", "--pp", "2"])


def dataclasses_replace(ns, **kw):
    import types

    return types.SimpleNamespace(**{**vars(ns), **kw})
