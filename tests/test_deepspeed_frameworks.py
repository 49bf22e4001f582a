"""DeepSpeed through the frameworks (DS_ACCELERATOR=cpu, gloo, 2 processes): Lightning's
``strategy="tsp_deepspeed"`` (ZeRO-2) and Accelerate's DeepSpeed path with ``TSPAccelerator``
(``accelerate launch --use_deepspeed --zero_stage 2``, also dp 2 x tsp 2 on 4 processes) match
one plain process, with clipping done by DeepSpeed and active (gradient norms above the
threshold)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
import torch

from .reference import assert_close
from .test_lightning import assert_same, result
from .test_lightning import run_job as run_lightning_job

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
JOB = os.path.join(ROOT, "tests", "accelerate_deepspeed_job.py")
EXIT_CLEANLY = os.path.join(ROOT, "tests", "exit_cleanly.py")


def test_lightning_zero2_matches_one_process(tmp_path, monkeypatch):
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    # clipping at 0.5 (Lightning hands gradient_clip_val to DeepSpeed's config) changes the
    # weights by 4e-4 against no clipping in this job (measured): the norm must be right
    run_lightning_job(str(tmp_path / "ref"), "--strategy", "auto", "--devices", "1", "--clip", "0.5")
    run_lightning_job(str(tmp_path / "ds"), "--strategy", "tsp_deepspeed", "--devices", "2",
                      "--clip", "0.5")
    ref, run = result(str(tmp_path / "ref")), result(str(tmp_path / "ds"))
    assert_same(run, ref)
    for logged, true in zip(run[0]["logged"], ref[0]["losses"]):
        assert abs(logged - true) <= 1e-5 * abs(true)
    # trainer.validate / test / predict after fit go through tsp_deepspeed.initialize too
    for key in ("val", "test"):
        assert abs(run[0][key] - ref[0][key]) <= 1e-5 * abs(ref[0][key]), key
    assert all(shape == [2, 12, 96] for shape in run[0]["predict_shapes"])


def test_lightning_unsupported_precision_fails_at_setup(tmp_path, monkeypatch):
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    proc = run_lightning_job(str(tmp_path), "--strategy", "tsp_deepspeed", "--devices", "2",
                             "--precision", "bf16-mixed", "--steps", "1", expect_ok=False)
    assert proc.returncode != 0
    assert re.search(r"precision='bf16-mixed' is not supported by the TSP DeepSpeed strategy; "
                     r"use one of \['32-true'\]", proc.stderr), proc.stderr[-3000:]


def run(cmd: list[str], **extra_env: str) -> str:
    env = dict(os.environ, OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu", **extra_env)
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return proc.stdout


def load(out) -> tuple[dict, dict]:
    with open(os.path.join(out, "losses.json")) as f:
        return json.load(f), torch.load(os.path.join(out, "weights.pt"))


@pytest.mark.parametrize("procs", [2, 4])
def test_accelerate_deepspeed_zero2_matches_one_process(tmp_path, procs):
    # 4 processes: TSP_SIZE=2, so ZeRO-2 over 2 data-parallel ranks, each taking its batch of 2
    # rows; the one process takes both batches at once
    plain, tsp = tmp_path / "plain", tmp_path / "tsp"
    plain.mkdir()
    tsp.mkdir()
    run([sys.executable, EXIT_CLEANLY, JOB, "--plain", "--batch", str(procs), "--out", str(plain)])
    accelerate = os.path.join(os.path.dirname(sys.executable), "accelerate")
    stdout = run([accelerate, "launch", "--use_deepspeed", "--zero_stage", "2", "--num_processes",
                  str(procs), EXIT_CLEANLY, JOB, "--out", str(tsp)], TSP_SIZE="2")
    assert f"processes {procs}, distributed DistributedType.DEEPSPEED, TSP degree 2" in stdout, stdout
    (ref, ref_weights), (res, weights) = load(plain), load(tsp)
    assert len(res["losses"]) == len(ref["losses"]) == 4
    for key in ("losses", "grad_norms"):
        for step, (a, b) in enumerate(zip(res[key], ref[key])):
            assert abs(a - b) <= 1e-5 * abs(b), f"{key}, step {step}: {a} vs {b}"
    # DeepSpeed's norm over the TSP shards is the one-process norm, and above 1.0: clipping acts
    assert min(ref["grad_norms"]) > 1.0, ref["grad_norms"]
    assert sorted(weights) == sorted(ref_weights)
    for name, t in ref_weights.items():
        assert_close(weights[name], t, 1e-5, name)
