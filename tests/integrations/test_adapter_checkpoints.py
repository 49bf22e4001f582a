"""Adapter checkpoints that reshard: Lightning (Trainer and Fabric), Accelerate and TSPTrainer save
at TSP degree 2 (data parallel 1) and resume at degree 1 (one process; also the unmodified model)
and at degree 2 x data parallel 2; the continued run matches the uninterrupted one. TSPTrainer's
``load_best_model_at_end`` restores the best step's weights exactly.

Three launches of tests/jobs/adapter_checkpoint_job.py run every adapter in turn: 2 processes (the
uninterrupted 4-step runs, each saving after step 2 as its users do), 1 process and 4 processes
(steps 3-4 from those checkpoints). Everything is float64; compared per resumed step: the loss,
the norm of the full gradient (a gradient D or dp times too large shows here, where AdamW would
hide it in the weights) and the learning rate; then the final full weights. Tolerance 1e-10
(measured: 0 to 2e-16); the Trainer's logged losses are float32, so 1e-6 there.

What keeps the data the same: every global batch has the same rows at every data-parallel size,
each replica taking its share. Lightning: one global batch of 4 rows per epoch from the sampler
Lightning injects (shuffled with seed 0 + epoch; dp replicas take every dp-th row) and the
checkpoint at an epoch end; Lightning restarts a non-stateful loader's epoch on resume instead of
fast-forwarding it, so with more batches per epoch a resumed run sees other data, with or without
TSP. The plain-model resume gets the same sampler explicitly. Fabric: batches built per step.
Accelerate: ``split_batches=True``, 2 rows per step in order. Trainer: its seeded sampler, 2 rows
per step (``per_device_train_batch_size`` 2 / dp), the batches already done skipped on resume.

Broken variants (``TSP_TEST_BREAK`` in the environment, read by the job: ``drop-optimizer``,
``local-layout``, ``best-model``) make these tests fail; see the job's ``break_on_purpose``.
"""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch

from tests.support import launch
from tests.support.reference import assert_close

JOB = os.path.join(launch.JOBS, "adapter_checkpoint_job.py")
SAVE_AT, STEPS = 2, 4


def run_job(processes: int, *args: str) -> None:
    launcher = [sys.executable] if processes == 1 else launch.torchrun(processes)
    launch.run([*launcher, launch.EXIT_CLEANLY, JOB, *args], processes, timeout=600)


def results(out) -> tuple[dict, dict]:
    with open(os.path.join(out, "result.json")) as f:
        return json.load(f), torch.load(os.path.join(out, "weights.pt"))


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    """The three launches: 'save' (tsp 2, dp 1), 'tsp1' (one process), 'tsp2dp2' (4 processes),
    and the checkpoint directory."""
    root = tmp_path_factory.mktemp("adapter_ckpt")
    ckpt = str(root / "ckpt")
    out = {}
    for name, processes, phase in (("save", 2, "save"), ("tsp1", 1, "resume"),
                                   ("tsp2dp2", 4, "resume")):
        run_job(processes, "--phase", phase, "--ckpt", ckpt, "--out", str(root / name))
        out[name] = results(root / name)
    out["ckpt"] = ckpt
    return out


def assert_continues(runs: dict, base: str, resumed: list[tuple[str, str]],
                     final: dict | None = None, keys=("losses", "norms", "lrs"),
                     tol: float = 1e-10) -> None:
    """Each resumed run (launch, name) ran steps SAVE_AT+1..STEPS like the uninterrupted ``base``:
    same ``keys`` per step, same final weights (``final``: the uninterrupted run's weights)."""
    ref, ref_weights = runs["save"][0][base], final or runs["save"][1][base]
    for launch_name, name in resumed:
        res, weights = runs[launch_name][0][name], runs[launch_name][1][name]
        for key in keys:
            if key not in ref:
                continue
            want = ref[key][SAVE_AT:]
            assert len(res[key]) == len(want) == STEPS - SAVE_AT, (name, key, res[key], want)
            for step, (a, b) in enumerate(zip(res[key], want), SAVE_AT + 1):
                assert abs(a - b) <= tol * abs(b), f"{name}: step {step} {key} {a} vs {b}"
        assert sorted(weights) == sorted(ref_weights), name
        for k, t in ref_weights.items():
            assert_close(weights[k], t, 1e-10, f"{name}: final {k}")


def test_lightning_trainer_resumes_at_other_degrees(runs):
    # ModelCheckpoint's directory (save_distributed_checkpoint=True) into tsp 1 and tsp 2 x dp 2;
    # the one-file checkpoint (save_distributed_checkpoint=False) into the unmodified model under
    # Lightning's own single-device strategy, and into tsp 2 x dp 2
    step2 = os.path.join(runs["ckpt"], "lightning", "epoch=1.ckpt")
    assert os.path.isfile(os.path.join(step2, "tsp_checkpoint.json")), os.listdir(step2)
    assert os.path.isfile(os.path.join(runs["ckpt"], "lightning-onefile.ckpt"))
    assert_continues(runs, "lightning", [("tsp1", "lightning_tsp1"),
                                         ("tsp1", "lightning_plain_onefile"),
                                         ("tsp2dp2", "lightning_tsp2"),
                                         ("tsp2dp2", "lightning_tsp2_onefile")])


def test_fabric_resumes_at_other_degrees(runs):
    # fabric.save's directory into tsp 1 and tsp 2 x dp 2; the one-file checkpoint into the
    # unmodified model under Fabric's single-device strategy, and into tsp 2 x dp 2
    assert os.path.isfile(os.path.join(runs["ckpt"], "fabric", "tsp_checkpoint.json"))
    assert_continues(runs, "fabric", [("tsp1", "fabric_tsp1"), ("tsp1", "fabric_plain_onefile"),
                                      ("tsp2dp2", "fabric_tsp2"),
                                      ("tsp2dp2", "fabric_tsp2_onefile")])


def test_accelerate_resumes_at_other_degrees(runs):
    # save_state's directory: tsp_core's checkpoint of model and optimizer (SGD with momentum)
    # beside Accelerate's own files; also into the unmodified model with a plain SGD and StepLR
    state = os.path.join(runs["ckpt"], "accelerate")
    for name in ("tsp_model/tsp_checkpoint.json", "scheduler.bin", "random_states_0.pkl",
                 "random_states_1.pkl"):
        assert os.path.isfile(os.path.join(state, name)), (name, os.listdir(state))
    assert_continues(runs, "accelerate", [("tsp1", "accelerate_tsp1"),
                                          ("tsp1", "accelerate_plain"),
                                          ("tsp2dp2", "accelerate_tsp2")])


def checkpoint_weights(runs: dict, step: int) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(os.path.join(runs["ckpt"], "trainer", f"checkpoint-{step}",
                                  "model.safetensors"))


def test_tsp_trainer_resumes_at_other_degrees(runs):
    # checkpoint-2 of the save run (model.safetensors + the optimizer as a tsp_core checkpoint)
    # into the plain Trainer (tsp_size 1, one process) and into tsp 2 x dp 2; the uninterrupted
    # run's final weights are its checkpoint-4 (it then loaded its best model)
    final = checkpoint_weights(runs, STEPS)
    for launch_name, name in (("tsp1", "trainer_tsp1"), ("tsp2dp2", "trainer_tsp2")):
        weights = runs[launch_name][1][name]
        runs[launch_name][1][name] = {k: weights[k] for k in final}  # the tied lm_head is not saved
    assert_continues(runs, "trainer", [("tsp1", "trainer_tsp1"), ("tsp2dp2", "trainer_tsp2")],
                     final=final, keys=("losses",), tol=1e-6)


def test_tsp_trainer_load_best_model_at_end(runs):
    # a metric that is best at step 2 of 4: the final model is checkpoint-2's, bit for bit
    res, weights = runs["save"][0]["trainer_best"], runs["save"][1]["trainer_best"]
    assert res["best"].endswith("checkpoint-2"), res
    best, last = checkpoint_weights(runs, 2), checkpoint_weights(runs, STEPS)
    for k, t in best.items():
        assert torch.equal(weights[k], t), f"{k} is not the best checkpoint's"
    assert max((best[k] - last[k]).abs().max().item() for k in best) > 1e-3  # a real difference
