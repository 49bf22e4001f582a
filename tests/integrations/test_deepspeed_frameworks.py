"""DeepSpeed through the frameworks (DS_ACCELERATOR=cpu, gloo, 2 processes): Lightning's
``strategy="tsp_deepspeed"`` (ZeRO-2) and Accelerate's DeepSpeed path with ``TSPAccelerator``
(``accelerate launch --use_deepspeed --zero_stage 2``, also dp 2 x tsp 2 on 4 processes) match
one process (float32, 1e-5), with 1 key/value head, clipping done by DeepSpeed and active
(gradient norms above the threshold) and plain SGD: DeepSpeed's norm, losses and final weights
on every rank (each rank's own, gathered over its TSP group)."""

from __future__ import annotations

import os
import re

import pytest
import torch

from tests.integrations.test_lightning import run_job as run_lightning_job
from tests.support import launch

JOB = os.path.join(launch.JOBS, "accelerate_job.py")


def test_lightning_zero2_matches_one_process(tmp_path, monkeypatch):
    from tests.integrations.test_lightning import assert_every_rank, full_run, mean_batch_loss
    from tests.integrations.test_lightning import reference as lightning_reference

    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    # Lightning hands gradient_clip_val to DeepSpeed's config; SGD at lr 0.5 with clipping at 0.5
    # (norms 1.7-2.3): the weights check the gradient's direction, DeepSpeed's norm its size
    run_lightning_job(str(tmp_path), "--strategy", "tsp_deepspeed", "--devices", "2",
                      "--kv-heads", "1", "--optimizer", "sgd", "--lr", "0.5", "--clip", "0.5",
                      "--evaluate")
    ref = lightning_reference(kv_heads=1, rows=4, dp=1, shuffle=True, dtype=torch.float32)
    runs = full_run(str(tmp_path))
    assert len(runs) == 2
    # (DeepSpeed keeps the gradients in its buffers: no first-step gradients to compare)
    assert_every_rank(runs, ref, "tsp_deepspeed", tol=1e-5, norm_tol=1e-5, grads=False)
    # trainer.validate / test / predict after fit go through tsp_deepspeed.initialize too
    from tests.jobs.lightning_job import Sequences

    want = mean_batch_loss(ref["model"], Sequences(4).ids)
    for run in runs:
        for key in ("val", "test"):
            assert abs(run[key] - want) <= 1e-5 * want, (key, run[key], want)
        assert all(shape == [2, 12, 96] for shape in run["predict_shapes"])


def test_lightning_unsupported_precision_fails_at_setup(tmp_path, monkeypatch):
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    proc = run_lightning_job(str(tmp_path), "--strategy", "tsp_deepspeed", "--devices", "2",
                             "--precision", "bf16-mixed", "--steps", "1", expect_ok=False)
    assert proc.returncode != 0
    assert re.search(r"precision='bf16-mixed' is not supported by the TSP DeepSpeed strategy; "
                     r"use one of \['32-true'\]", proc.stderr), proc.stderr[-3000:]


def run(cmd: list[str], **extra_env: str) -> str:
    """``cmd`` must end cleanly on every rank (``--num_processes``, else one)."""
    ranks = int(cmd[cmd.index("--num_processes") + 1]) if "--num_processes" in cmd else 1
    return launch.run(cmd, ranks, DS_ACCELERATOR="cpu", **extra_env).stdout


@pytest.mark.parametrize("procs", [2, 4])
def test_accelerate_deepspeed_zero2_matches_one_process(tmp_path, procs):
    # 4 processes: TSP_SIZE=2, so ZeRO-2 over 2 data-parallel ranks, each taking its batch of 2
    # rows; the one process takes both batches at once. Clipping is DeepSpeed's, at the 1.0
    # Accelerate fills in (norms 1.3-2.3, so it acts), SGD at lr 0.5; inside the script
    # save_state / load_state must round-trip (Accelerate's own, through engine.save_checkpoint)
    from tests.integrations.test_accelerate import job_run
    from tests.integrations.test_accelerate import reference as accelerate_reference
    from tests.support.hf_models import assert_matches_reference

    accelerate = os.path.join(launch.BIN, "accelerate")
    stdout = run([accelerate, "launch", "--use_deepspeed", "--zero_stage", "2", "--num_processes",
                  str(procs), launch.EXIT_CLEANLY, JOB, "--kv-heads", "1", "--round-trip",
                  "--out", str(tmp_path)], TSP_SIZE="2")
    assert f"processes {procs}, distributed DistributedType.DEEPSPEED, TSP degree 2" in stdout, \
        stdout
    ref = accelerate_reference(1, rows_per_step=procs, dtype=torch.float32, clip=1.0)
    assert min(ref["norms"]) > 1.0, ref["norms"]
    runs = job_run(str(tmp_path), 1)
    assert len(runs) == procs
    for r, rank_run in enumerate(runs):  # every rank's own weights
        assert_matches_reference(rank_run, ref, 1e-5, what=f"rank {r}: ",
                                 keys=("losses", "norms", "weights"))
