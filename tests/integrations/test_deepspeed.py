"""DeepSpeed (DS_ACCELERATOR=cpu, gloo): tsp_deepspeed.initialize matches one process (float32,
1e-5: DeepSpeed's gradient norm is float32 arithmetic even for float64 parameters) with
DeepSpeed's gradient clipping active and plain SGD: DeepSpeed's norm on every rank, losses and
final full weights, with ZeRO 0, 2, 3 at tsp 2 and ZeRO 2 at dp 2 x tsp 2 with 1 key/value head,
ZeRO 3 at tsp 4 with 1 and ZeRO 1 at tsp 4 with 2; ZeRO-1 at dp 2 x tsp 2 (AdamW) keeps a quarter
of the optimizer state per rank; checkpoints resume exactly. DeepSpeed's bf16 ("bf16": {"enabled":
true}, ZeRO 2) at tsp 2 stays within bf16's bounds (tests/support/precision.py) of the same bf16
configuration without TSP (plain deepspeed.initialize, data parallel 2) and is not float32. The
runs share one launch per process count (tests/jobs/deepspeed_job.py runs them one after
another)."""

from __future__ import annotations

import glob
import json
import os

import pytest
import torch

from tests.support import launch
from tests.support.reference import assert_close

JOB = os.path.join(launch.JOBS, "deepspeed_job.py")


# SGD at lr 0.5 with DeepSpeed clipping at 0.5 (norms 1.4-2.4: it acts at every step): each update
# is lr x clip x g/|g|, so the weights check the gradient's direction and DeepSpeed's norm (the one
# it clipped by) its size
SGD = "--optimizer sgd --lr 0.5 --clip 0.5"
STAGES = [(2, 0, 2, 1), (2, 2, 2, 1), (2, 3, 2, 1), (4, 2, 2, 1), (4, 3, 4, 1), (4, 1, 4, 2)]
# bf16 at tsp 2 and the same configuration without TSP on the same 2 processes (data parallel 2,
# a row each of the same 2-row global batches)
BF16 = {"bf16-tsp2": f"--stage 2 --tsp 2 --bf16 {SGD}",
        "bf16-plain": f"--stage 2 --plain --micro-batch 1 --bf16 {SGD}"}


def stage_case(stage: int, tsp: int, kv_heads: int) -> str:
    return f"stage{stage}-tsp{tsp}-kv{kv_heads}"


def cases(procs: int, out: str) -> dict[str, str]:
    """Every run of this file on ``procs`` processes, by name, in launch order. 4 processes:
    first the run that measures the optimizer state (MemTracker, before any other case has built
    an optimizer) after the dp_shard refusal; 2 processes: a run saving a checkpoint at step 2
    and one resuming from it. Then the ZeRO stages; on 2 processes last the bf16 pair
    (:data:`BF16`)."""
    found = {"quarter": "--stage 1 --tsp 2 --refuse-dp-shard"} if procs == 4 else {}
    if procs == 2:
        found["full"] = "--stage 2 --save-at 2"
        found["resumed"] = f"--stage 2 --save-at 2 --resume {os.path.join(out, 'full', 'ckpt')}"
    for p, stage, tsp, kv_heads in STAGES:
        if p == procs:
            found[stage_case(stage, tsp, kv_heads)] = \
                f"--stage {stage} --tsp {tsp} --kv-heads {kv_heads} {SGD}"
    return {**found, **BF16} if procs == 2 else found


class Launches:
    """One torchrun launch per process count, doing every case of :func:`cases` (a launch costs
    more than a case), started on first use; each test reads its cases' files."""

    def __init__(self, root) -> None:
        self.root, self.done = root, {}

    def out(self, procs: int, case: str) -> str:
        if procs not in self.done:
            self.done[procs] = None  # a launch that fails fails its first test, and is not rerun
            out = str(self.root / f"procs{procs}")
            args = [f"--case={name}={opts}" for name, opts in cases(procs, out).items()]
            launch.run(launch.torchrun(procs, launch.EXIT_CLEANLY, JOB, "--out", out, *args),
                       procs, timeout=900, DS_ACCELERATOR="cpu")
            self.done[procs] = out
        assert self.done[procs], f"the {procs}-process launch failed (its first test shows how)"
        return os.path.join(self.done[procs], case)


@pytest.fixture(scope="module")
def launches(tmp_path_factory) -> Launches:
    return Launches(tmp_path_factory.mktemp("deepspeed"))


def result(out: str) -> tuple[dict, dict]:
    """Rank 0's losses, norms and optimizer bytes, and its final full weights."""
    with open(os.path.join(out, "result.json")) as f:
        return json.load(f), torch.load(os.path.join(out, "rank0_weights.pt"))


def reference(rows: int):
    """One process, the whole global batch: AdamW(lr 1e-3, weight decay 0.01), clipping at 1.0."""
    from tests.jobs.deepspeed_job import batches
    from tests.support.hf_models import build

    model = build("llama", torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    losses = []
    for ids in batches(4, rows):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    state = sum(t.numel() * t.element_size() for s in opt.state.values() for t in s.values()
                if t.dim() > 0)
    return losses, model.state_dict(), state


def assert_matches(res: dict, weights: dict, ref) -> None:
    losses, ref_weights, _ = ref
    for step, (a, b) in enumerate(zip(res["losses"], losses)):
        assert abs(a - b) <= 1e-5 * abs(b), f"step {step}: {a} vs {b}"
    assert sorted(weights) == sorted(ref_weights)
    for name, t in ref_weights.items():
        assert_close(weights[name], t, 1e-5, name)


def ranks(out) -> list[dict]:
    """Every rank's records with its own final full weights (gathered over its TSP group): every
    replica's are compared, not only replica 0's."""
    runs = []
    for r in range(len(glob.glob(os.path.join(out, "rank*.json")))):
        with open(os.path.join(out, f"rank{r}.json")) as f:
            runs.append(json.load(f))
        runs[-1]["weights"] = torch.load(os.path.join(out, f"rank{r}_weights.pt"))
    return runs


@pytest.mark.parametrize("procs,stage,tsp,kv_heads", STAGES)
def test_zero_stages_match_one_process(launches, procs, stage, tsp, kv_heads):
    from tests.jobs.deepspeed_job import batches
    from tests.support.hf_models import assert_matches_reference, build, sgd_reference

    out = launches.out(procs, stage_case(stage, tsp, kv_heads))
    dp = procs // tsp
    ref = sgd_reference(build("llama", torch.float32, kv_heads=kv_heads), batches(4, 2 * dp),
                        lr=0.5, clip=0.5)
    assert min(ref["norms"]) > 0.5, ref["norms"]
    runs = ranks(out)
    assert len(runs) == procs
    for r, run in enumerate(runs):  # every rank's own weights
        assert_matches_reference(run, ref, 1e-5, what=f"rank {r}: ",
                                 keys=("losses", "norms", "weights"))


def test_zero1_keeps_a_quarter_of_the_optimizer_state(launches):
    # first, in the same processes: a model parallelized with a dp_shard mesh (FSDP2 over the 2
    # data-parallel ranks) is refused on every rank before any collective, with the model left
    # as it was, saying what to do
    out = launches.out(4, "quarter")
    res, _ = result(out)
    ref = reference(4)
    runs = ranks(out)
    for run in runs:  # rank 0's losses, every rank's own weights
        assert_matches(res, run["weights"], ref)
    assert_zero1_quarter(runs, ref[2])
    for run in runs:
        refusal = run["dp_shard_refusal"]
        assert refusal["collectives"] == {} and refusal["unchanged"], refusal
        assert refusal["message"].startswith(
            "tsp_deepspeed got a mesh with dp_shard=2 (dims ('dp_replicate', 'dp_shard', "
            "'tsp')): DeepSpeed's ZeRO shards the model and optimizer state over the "
            "data-parallel ranks itself"), refusal
        assert ("Build it without dp_shard, tsp_core.init_mesh(tsp_size=2) (data parallel 2)"
                in refusal["message"]), refusal


def assert_zero1_quarter(runs: list[dict], one_process_bytes: int) -> None:
    """Every rank's optimizer state, measured by MemTracker in the job (dp 2 x tsp 2): AdamW's two
    float32 moments of half (ZeRO-1 over dp) of this rank's TSP share (half of every matrix, the
    replicated norms whole), plus at most DeepSpeed's alignment padding of its flat partition (to
    a multiple of 2 x dp elements); about a quarter of one process's state."""
    from tests.support.hf_models import build

    model = build("llama", torch.float32)
    total = sum(t.numel() for t in model.parameters())
    norms = sum(t.numel() for n, t in model.named_parameters() if "norm" in n)
    want = 2 * 4 * ((total - norms) // 2 + norms) // 2
    assert len(runs) == 4
    for r, run in enumerate(runs):
        got = run["optimizer_bytes"]
        assert want <= got <= want + 2 * 4 * 4, (r, got, want, got / one_process_bytes)


def test_checkpoint_resume_is_exact(launches):
    # the resumed run is a new engine on a freshly built model in the same processes: only the
    # checkpoint on disk carries the first run's state to it
    full, full_w = result(launches.out(2, "full"))
    resumed, resumed_w = result(launches.out(2, "resumed"))
    assert len(full["losses"]) == 4 and len(resumed["losses"]) == 2, (full, resumed)
    assert resumed["losses"] == full["losses"][2:]  # bit for bit
    # The final weights agree to the last bit or two (measured: at most 1.2e-7, one float32 ulp
    # of the norm weights near 1.0): after load_checkpoint, DeepSpeed's Adam takes its step
    # count from the checkpoint, and the bias correction of the last update rounds differently.
    for name, t in full_w.items():
        assert_close(resumed_w[name], t, 2e-7, name)


def plain_bf16_run(out: str) -> dict:
    """The bf16 run without TSP as one run of the global batches: every rank logged the loss of
    its own row (each 24 tokens: their mean is the global batch's) and the same global norm;
    rank 0 wrote the module's weights."""
    runs = ranks(out)
    assert len(runs) == 2, f"{len(runs)} ranks wrote results, not 2"
    for step, step_losses in enumerate(zip(*(run["losses"] for run in runs))):
        # the ranks took different rows
        assert len(set(step_losses)) == len(runs), f"step {step}: rank losses {step_losses}"
    for r, run in enumerate(runs):
        assert run["norms"] == runs[0]["norms"], f"rank {r}: norms {run['norms']} vs rank 0's"
    losses = [sum(step) / len(runs) for step in zip(*(run["losses"] for run in runs))]
    return {"losses": losses, "norms": runs[0]["norms"], "weights": result(out)[1]}


def assert_stored_bf16(weights: dict, what: str) -> None:
    dtypes = {str(t.dtype) for t in weights.values()}
    assert dtypes == {"torch.bfloat16"}, f"{what}: final weights {dtypes}, not bf16: bf16 off"


def assert_not_float32(run: dict, exact: dict, what: str) -> None:
    """bf16 moved the losses off float32's (measured: up to 4.4e-5 relative; the first step's
    only 2.1e-7, by chance) and every step's norm (1.3e-4 to 4.9e-4); a float32 TSP run is within
    1.2e-7 of both."""
    def off(key):
        return [abs(a - b) / abs(b) for a, b in zip(run[key], exact[key])]

    assert max(off("losses")) >= 1e-6, f"{what}: losses {off('losses')} off float32's: not bf16"
    assert min(off("norms")) >= 1e-5, f"{what}: norms {off('norms')} off float32's: not bf16"


def test_bf16_matches_deepspeed_without_tsp(launches):
    """ZeRO 2 (it runs bf16 on CPU: the module is cast to bf16, ZeRO keeps float32 master
    weights), clipped SGD at tsp 2 against plain DeepSpeed at data parallel 2 with the same bf16
    config: the two round in different places (TSP's slices and float32 islands against Hugging
    Face's whole matrices), so they agree within bf16's bounds, not exactly. DeepSpeed keeps the
    gradients in its buffers: the weights check their directions, the norms their sizes
    (first_gradients=False); the module is stored in bf16 in both runs (the proof that bf16 ran:
    stored_bf16). The bf16 reference is itself held to float32's within the same bounds, and the
    TSP run must be off float32's: a run that ignored bf16 matches it to 1.2e-7 (measured)."""
    from tests.jobs.deepspeed_job import batches
    from tests.support.hf_models import build, sgd_reference
    from tests.support.precision import assert_within_bf16

    init = build("llama", torch.float32).state_dict()  # the job's model: same seed, 2 KV heads
    ref = plain_bf16_run(launches.out(2, "bf16-plain"))
    assert min(ref["norms"]) > 0.5, f"clipping at 0.5 never acts: norms {ref['norms']}"
    runs = ranks(launches.out(2, "bf16-tsp2"))
    assert len(runs) == 2, f"{len(runs)} ranks wrote results, not 2"
    assert_stored_bf16(ref["weights"], "without TSP")
    for r, run in enumerate(runs):  # every rank's own gathered weights
        assert_stored_bf16(run["weights"], f"tsp 2 rank {r}")
        assert_within_bf16(run, ref, init, f"tsp 2 rank {r}",
                           first_gradients=False, stored_bf16=True)
    exact = sgd_reference(build("llama", torch.float32), batches(4, 2), lr=0.5, clip=0.5)
    assert_within_bf16(ref, exact, init, "without TSP vs float32", first_gradients=False,
                       stored_bf16=True)
    for r, run in enumerate(runs):
        assert_not_float32(run, exact, f"tsp 2 rank {r}")
