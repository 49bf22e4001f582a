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


def test_an_uneven_cut_written_out_by_hand():
    """Llama-3.1-8B (32 layers, h 4096) in 4 stages on 4 nodes of 8 H100s, 16 micro-batches of one
    8192-token row, the stage at tsp D = 8: every expected number written out from the sizes
    (the test above checks the same quantities as formulas of the planner's own figures)."""
    import types

    from tsp_core.pipeline import balanced_split, split_layers
    from tsp_core.tools.cli import in_flight_bytes

    # 32 layers + the embedding + the head = 34 units; 34 = 4 x 8 + 2: 9, 9, 8, 8 units, the
    # first and the last stage a decoder layer fewer: 8, 9, 8, 7 layers, the busiest 9; the
    # pipeline's default cut and the planner's are the same
    assert balanced_split(32, 4) == [8, 9, 8, 7]
    assert split_layers(32, 4) == split_layers(32, 4, [8, 9, 8, 7]) == [
        range(0, 8), range(8, 17), range(17, 25), range(25, 32)]
    shape = model_shape("llama-3.1-8b", None)
    stage, stage_cluster, layers = stage_view(shape, Cluster(DEVICES["h100"], 8, 4), 4)
    assert (layers, stage.num_layers, stage_cluster.gpus) == (9, 9, 8)  # 32 GPUs / 4 stages
    ranked, _ = plan(stage, 8192, stage_cluster)
    c = next(c for c in ranked if c.layout == "tsp" and c.degree == 8)
    p = with_pipeline(c, stage, 8192, 1, 4, 16, 80e9 * 0.9, 1 << 22)
    # 1F1B's first stage holds min(16, 4) - 1 = 3 micro-batches more of checkpointed layer
    # inputs: 3 x 9 layers x 8192 / 8 = 1024 tokens a rank x 4096 x 2 bytes (bf16)
    in_flight = 226_492_416  # 3 x 9 x 1024 x 4096 x 2
    assert (p.memory_gib - c.memory_gib) * 2 ** 30 == pytest.approx(in_flight)
    record = types.SimpleNamespace(name="tsp", tp=8, cp=1, seq=8192, batch=1, layers=9,
                                   dtype="bfloat16")
    assert in_flight_bytes(record, 4096, 4, 16) == in_flight
    # 16 micro-batches through 4 stages take 16 + 4 - 1 = 19 stage steps, 3 of them idle; one
    # replica (8 GPUs a stage at D = 8) trains 16 x 8192 = 131072 tokens a step
    assert p.step_s == pytest.approx(19 * c.step_s)
    assert bubble(4, 16) == pytest.approx(3 / 19)
    assert (c.replicas, p.active_replicas) == (1, 1)
    assert p.tokens_per_s * p.step_s == pytest.approx(131_072)


# (decoder layers, stages) -> the default cut, written out by hand from the units (layers + 2):
# every stage ceil(units / stages) units or one fewer, the stages holding one fewer the last ones
# that keep a decoder layer so. Units per stage in the comments.
BY_HAND = {
    (6, 2): [3, 3],              # 8 units divide: 4, 4 (unchanged from the even cut)
    (6, 4): [1, 2, 2, 1],        # 8 divide: 2, 2, 2, 2
    (126, 16): [7] + [8] * 14 + [7],  # 128 divide: 8 each (Llama-3.1-405B)
    (3, 1): [3],                 # one stage holds everything: 5
    (32, 4): [8, 9, 8, 7],       # 34: 9, 9, 8, 8 (torchtitan's cut)
    (7, 4): [2, 2, 2, 1],        # 9: 3, 2, 2, 2
    (4, 4): [1, 1, 1, 1],        # 6: 2, 1, 1, 2 (the ends keep a layer; no other cut)
    (5, 4): [1, 2, 1, 1],        # 7: 2, 2, 1, 2 (the last keeps its layer: stage 2 is lighter)
    (6, 6): [1, 1, 1, 1, 1, 1],  # 8: 2, 1, 1, 1, 1, 2
    (9, 4): [2, 3, 3, 1],        # 11: 3, 3, 3, 2
    (10, 3): [3, 4, 3],          # 12 divide: 4, 4, 4
    (11, 3): [4, 4, 3],          # 13: 5, 4, 4
}


def cuts(layers: int, stages: int):
    """Every cut of ``layers`` decoder layers into ``stages`` stages of at least one each."""
    if stages == 1:
        yield [layers]
        return
    for first in range(1, layers - stages + 2):
        for rest in cuts(layers - first, stages - 1):
            yield [first, *rest]


def test_default_cut_by_hand_and_the_most_balanced():
    """The default cut (tsp_core.pipeline.balanced_split) against the table written out by hand,
    and against every cut of up to 12 layers: no cut has a cheaper busiest stage, nor fewer
    stages at that cost (its sorted costs are the smallest, largest first), and of the cuts as
    balanced it is the one whose earlier stages hold the units (the largest costs, first stage
    first: torchtitan's order). The pipeline and the planner both take it."""
    from tsp_core.pipeline import balanced_split, split_layers
    from tsp_core.pipeline.split import stage_costs

    for (layers, stages), want in BY_HAND.items():
        assert balanced_split(layers, stages) == want, (layers, stages)
        assert [len(r) for r in split_layers(layers, stages)] == want, (layers, stages)
        if (layers + 2) % stages == 0:  # an even case: every stage the same units
            assert stage_costs(want) == [(layers + 2) // stages] * stages, (layers, stages)
    for layers in range(1, 13):
        for stages in range(1, layers + 1):
            got = balanced_split(layers, stages)
            assert sum(got) == layers and min(got) >= 1, (layers, stages, got)
            every = list(cuts(layers, stages))
            balance = min(sorted(stage_costs(c), reverse=True) for c in every)
            assert sorted(stage_costs(got), reverse=True) == balance, (layers, stages, got)
            best = max((c for c in every if sorted(stage_costs(c), reverse=True) == balance),
                       key=stage_costs)
            assert got == best, (layers, stages, got, best)
            assert max(stage_costs(got)) == -(-(layers + 2) // stages)  # ceil(units / stages)
    # the planner's busiest stage is the default cut's
    shape = model_shape("llama-3.1-8b", None)
    for pp in (2, 4, 8):
        _, _, busiest = stage_view(shape, Cluster(DEVICES["h100"], 8, 8), pp)
        assert busiest == max(balanced_split(32, pp)), pp
    # impossible requests are still refused, with the numbers and the fix
    with pytest.raises(ValueError, match=r"the model has 3 decoder layers, fewer than the 4 "
                                         r"pipeline stages asked for \(every stage holds at least "
                                         r"one\); use fewer stages \(pp_size x stages_per_rank\)"):
        split_layers(3, 4)
    with pytest.raises(ValueError, match=r"the pipeline needs at least one stage, got 0"):
        split_layers(3, 0)
    with pytest.raises(ValueError, match=r"layer_split \[1, 3\] must give 2 stages of at least "
                                         r"one decoder layer each, 5 layers in all \(it gives 2 "
                                         r"stages, 4 layers\)"):
        split_layers(5, 2, [1, 3])
    with pytest.raises(ValueError, match=r"the model has 32 decoder layers, fewer than --pp "
                                         r"\(64\) stages"):
        stage_view(shape, Cluster(DEVICES["h100"], 8, 64), 64)


def test_an_uneven_default_cut_is_said_once_on_rank_0(caplog, capsys):
    """One line on global rank 0 where the units do not divide (a warning of the
    tsp_core.pipeline logger when logging has a handler, as under pytest, else a [tsp] line on
    stderr); nothing on other ranks, nothing for an even cut."""
    import logging

    from tsp_core.pipeline.split import logger, report_split

    with caplog.at_level(logging.WARNING, logger="tsp_core.pipeline"):
        report_split(5, 4, rank=0)
        report_split(5, 4, rank=1)
        report_split(6, 4, rank=0)
    assert [r.getMessage() for r in caplog.records] == [
        "pipeline: 5 decoder layers + the embedding + the head = 7 units do not divide into 4 "
        "stages; the most balanced cut is layer_split=[1, 2, 1, 1] (units per stage "
        "[2, 2, 1, 2]); pass layer_split for another"]
    handlers, propagate = logger.handlers, logger.propagate
    try:  # no handler anywhere: stderr
        logger.handlers, logger.propagate = [], False
        assert not logger.hasHandlers()
        report_split(32, 4, rank=0)
        report_split(32, 4, rank=3)
    finally:
        logger.handlers, logger.propagate = handlers, propagate
    assert capsys.readouterr().err.splitlines() == [
        "[tsp] pipeline: 32 decoder layers + the embedding + the head = 34 units do not divide "
        "into 4 stages; the most balanced cut is layer_split=[8, 9, 8, 7] (units per stage "
        "[9, 9, 8, 8]); pass layer_split for another"]


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
