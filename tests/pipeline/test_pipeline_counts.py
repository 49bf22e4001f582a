"""The collective counts of one pipeline step equal docs/pipeline.md's formula, on every rank:
calls AND bytes of every kind, pp 2 x tsp 2 (4 processes), 4 micro-batches, under 1F1B and
Interleaved1F1B (2 stages per rank).

The formula's parts are computed independently of the pipeline: TSP's own collectives of a stage
are those of each micro-batch's forward and backward through a plain ``tsp_core.parallelize``'d
Llama holding as many decoder layers as the stage, run on the same ranks' stage mesh (its base
model from token ids on the first stage, from hidden states otherwise; the last stage adds the
final norm and the vocabulary-parallel head's summed cross-entropy). The
pipeline's extras are written out from comm's byte conventions (an all-reduce moves 2 (d - 1) / d
of its buffer, a broadcast (d - 1) / d): on the last stage's ranks one all-reduce of the label
count per stage-mesh dim and one ``sum_over`` of each micro-batch's loss, on every rank one
broadcast of the loss over the pipeline group, and the point-to-point transfers of [b, S/D, h]
shards (M forward sends per stage but the last, M gradient sends per stage but the first, as many
receives). The step counted is the second (the first also runs torch's one-time handshake).

Beside the formula, for 1F1B the pipeline's own part (what a rank moves beyond its stage's plain
TSP passes) is written out by hand as plain numbers (PIPELINE_OWN_1F1B): a collective added to
the pipeline and to the formula alike still fails there."""

from __future__ import annotations

import copy
from collections import Counter

import pytest
import torch
import torch.distributed as dist

from tests.pipeline.test_pipeline import ROWS, SEQ, M, batches, tiny_llama

TSP, PP = 2, 2
FLOAT64 = 8  # bytes of the float64 scalars (label count, loss) and of the activations' elements


# Written out by hand: 1F1B at pp 2 x tsp 2, stage s on pipeline rank s; M = 4 micro-batches of
# ROWS / M = 8 / 4 = 2 rows; SEQ 16 over 2 TSP ranks is 8 tokens a rank; h 32; float64. One shard
# [2, 16 / 2, 32] is 512 elements x 8 bytes = 4096 bytes. Per rank, beyond its stage's plain TSP
# passes (calls; bytes as tsp_core.comm counts them: a send or receive its whole buffer, a
# broadcast over d ranks (d - 1) / d of it, an all-reduce 2 (d - 1) / d):
PIPELINE_OWN_1F1B = {
    0: {("send", "calls"): 4,        # 4 micro-batches' activation shards forward to stage 1
        ("send", "bytes"): 16384,    # 4 x 4096
        ("recv", "calls"): 4,        # their 4 gradient shards back from stage 1
        ("recv", "bytes"): 16384,    # 4 x 4096
        ("broadcast", "calls"): 1,   # the step's loss (a float64 scalar) from stage 1, pp group
        ("broadcast", "bytes"): 4},  # 8 x (2 - 1) / 2
    1: {("send", "calls"): 4,        # 4 gradient shards back to stage 0
        ("send", "bytes"): 16384,    # 4 x 4096
        ("recv", "calls"): 4,        # 4 activation shards from stage 0
        ("recv", "bytes"): 16384,    # 4 x 4096
        ("broadcast", "calls"): 1,   # the step's loss to stage 0
        ("broadcast", "bytes"): 4,   # 8 x (2 - 1) / 2
        # over the stage's TSP group of 2: the global batch's label count once and each of the
        # 4 micro-batches' summed loss, float64 scalars
        ("all_reduce", "calls"): 5,  # 1 + 4
        ("all_reduce", "bytes"): 40},  # 5 x 8 x 2 x (2 - 1) / 2
}


def _counts(stats) -> dict[str, tuple[int, float]]:
    return {kind: (stats.calls[kind], stats.bytes[kind]) for kind in stats.calls}


def _stage_reference(stage_mesh, layers: int, first: bool, last: bool,
                     micros: list[dict]) -> Counter:
    """Calls and bytes by kind of the forward and backward of each micro-batch of ``micros``
    through a plain TSP Llama of ``layers`` decoder layers on ``stage_mesh``, holding what the
    stage holds (the final norm only on the last stage), after one warm-up pass. The embedding's
    all-to-all moves as many rows as each micro-batch's tokens ask of each vocabulary shard, so
    every micro-batch is run, not one times M."""
    from transformers import LlamaForCausalLM

    import tsp_core
    from tsp_core import comm
    from tsp_core.distributed.mesh import TSPMesh

    config = copy.deepcopy(tiny_llama().config)
    config.num_hidden_layers = layers
    torch.manual_seed(3)
    model = LlamaForCausalLM(config).to(torch.float64)
    plain = TSPMesh(stage_mesh.device_mesh, stage_mesh.dim, stage_mesh.layout)
    tsp_core.parallelize(model, plain)
    if not last:
        model.model.norm = torch.nn.Identity()

    def run(micro: dict) -> None:
        sharded = tsp_core.shard_batch(micro, plain)
        ids = sharded["input_ids"]
        if first:
            inputs = {"input_ids": ids}
        else:
            inputs = {"inputs_embeds": torch.randn(*ids.shape, config.hidden_size,
                                                   dtype=torch.float64, requires_grad=True)}
        hidden = model.model(position_ids=sharded["position_ids"], use_cache=False,
                             **inputs).last_hidden_state
        if last:
            out = model.lm_head.loss_sum(model.lm_head.scale_input(hidden),
                                         sharded["shift_labels"])
        else:
            out = (hidden * torch.randn_like(hidden)).sum()
        out.backward()

    run(micros[0])  # warm-up
    ref = Counter()
    with comm.track() as stats:
        for micro in micros:
            run(micro)
    for kind, (calls, nbytes) in _counts(stats).items():
        _add(ref, kind, calls, nbytes)
    return ref


def _add(into: Counter, kind: str, calls: int, nbytes: float) -> None:
    into[(kind, "calls")] += calls
    into[(kind, "bytes")] += nbytes


def counts_run(schedule: str) -> dict:
    """On each rank: the counts of the pipeline's second step (comm.track and the process-wide
    counters alike) and the formula's, both as {(kind, "calls"|"bytes"): number}."""
    import tsp_core
    from tests.pipeline.test_pipeline import _mesh
    from tsp_core import comm

    mesh = _mesh(TSP, PP)
    pipe = tsp_core.pipeline(tiny_llama(), mesh, microbatches=M, schedule=schedule)
    steps = batches()
    pipe.step(steps[0])
    before = copy.deepcopy(comm.global_stats())
    with comm.track() as stats:
        pipe.step(steps[1])
    after = comm.global_stats()
    got = Counter()
    for kind, (calls, nbytes) in _counts(stats).items():
        _add(got, kind, calls, nbytes)
    moved = Counter()  # the process-wide counters must have moved as much
    for kind in set(after.calls) | set(before.calls):
        _add(moved, kind, after.calls[kind] - before.calls[kind],
             after.bytes[kind] - before.bytes[kind])

    # the formula
    stages, d_pp = pipe.num_stages, dist.get_world_size(mesh.pp_group)
    rows = ROWS // M
    micros = [{k: v[i * rows:(i + 1) * rows] for k, v in steps[1].items()} for i in range(M)]
    shard = rows * (SEQ // TSP) * tiny_llama().config.hidden_size * FLOAT64  # [b, S/D, h]
    want, own = Counter(), Counter()
    for s in pipe.stage_indices:
        first, last = s == 0, s == stages - 1
        # TSP's own: each micro-batch's pass through the stage
        own.update(_stage_reference(pipe.stage_mesh, len(pipe.layer_split[s]), first, last,
                                    micros))
        transfers = M * ((not last) + (not first))  # activations forward, gradients back
        _add(want, "send", transfers, transfers * shard)
        _add(want, "recv", transfers, transfers * shard)
        if last:
            for group in pipe.stage_mesh.all_groups:
                d = dist.get_world_size(group)
                if d > 1:  # the label count once, each micro-batch's loss sum_over
                    _add(want, "all_reduce", 1 + M, (1 + M) * 2 * FLOAT64 * (d - 1) / d)
    _add(want, "broadcast", 1, FLOAT64 * (d_pp - 1) / d_pp)  # the loss over the pipeline
    want.update(own)
    beyond = Counter(got)  # what the pipeline moves beyond its stages' plain TSP passes
    beyond.subtract(own)
    nonzero = lambda c: {k: v for k, v in c.items() if v}  # noqa: E731
    return dict(got=nonzero(got), want=nonzero(want), moved=nonzero(moved),
                beyond=nonzero(beyond), stages=pipe.stage_indices)


@pytest.mark.parametrize("schedule", ["1F1B", "Interleaved1F1B"])
def test_step_counts_equal_the_documented_formula(pools, schedule):
    per_rank = pools.of(4, timeout=150).run(counts_run, schedule)
    for rank, run in enumerate(per_rank):
        assert run["got"] == run["want"], (rank, run["stages"], run["got"], run["want"])
        assert run["moved"] == run["got"], (rank, run["moved"], run["got"])
        assert {"all_gather", "broadcast", "all_reduce", "send"} <= {k for k, _ in run["want"]}
    stages = 2 if schedule == "1F1B" else 4
    sends = sum(run["got"][("send", "calls")] for run in per_rank)
    assert sends == 2 * (stages - 1) * M * TSP  # docs/pipeline.md: per TSP position, TSP of them
    if schedule == "1F1B":
        for rank, run in enumerate(per_rank):
            (stage,) = run["stages"]
            assert run["beyond"] == PIPELINE_OWN_1F1B[stage], \
                (f"rank {rank} (stage {stage}) moves beyond its stage's TSP passes "
                 f"{run['beyond']}, not the hand-written {PIPELINE_OWN_1F1B[stage]}")
