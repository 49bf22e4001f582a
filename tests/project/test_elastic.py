"""Elastic resume: examples/train_llama.py under ``torchrun --max-restarts 2`` with a checkpoint
every 2 steps; rank 1 SIGKILLs itself at step 3 of the first attempt. torchrun restarts both
workers, they resume from the last complete checkpoint (step 2; a torn save and an unfinished one in
the same directory are skipped), and the final float32 weights are bit-identical to an uninterrupted
run."""

from __future__ import annotations

import os
import subprocess

import torch

from tests.support import launch

SCRIPT = os.path.join(launch.ROOT, "examples", "train_llama.py")
SMALL = ["--layers", "2", "--hidden", "64", "--heads", "4", "--kv-heads", "2", "--ffn", "128",
         "--vocab", "128", "--seq", "64", "--batch", "2", "--steps", "6", "--checkpoint-every", "2"]


def torchrun(out: str, **env: str) -> str:
    # the documented command; the script ends through tsp_core.run_cleanly
    os.makedirs(out, exist_ok=True)
    proc = launch.run(launch.torchrun(2, "--max-restarts", "2", SCRIPT, *SMALL, "--checkpoint-dir",
                                      os.path.join(out, "ckpt"), "--resume", "--final-weights",
                                      os.path.join(out, "final.pt")),
                      ranks=2, expect_clean=False, timeout=240, **env)
    with open(os.path.join(out, "torchrun.log"), "w") as f:
        f.write(proc.stdout + proc.stderr)
    # an attempt that lost a rank fails loudly (the survivor's traceback is expected there); the
    # last attempt is what torchrun's stderr holds after its last "failed (exitcode: ...)" line
    last = proc.stderr.rsplit("failed (exitcode: ", 1)[-1]
    launch.assert_clean(subprocess.CompletedProcess(proc.args, proc.returncode, "", last), 2)
    return proc.stdout + proc.stderr


def test_killed_rank_restarts_and_ends_with_identical_weights(tmp_path):
    plain, killed = str(tmp_path / "plain"), str(tmp_path / "killed")
    log = torchrun(plain)
    assert "attempt 0: starting at step 0" in log and "attempt 1" not in log, log[-3000:]

    # a torn save (data, no marker) and an unfinished one, both "newer" than anything real
    os.makedirs(os.path.join(killed, "ckpt", "step_000099"))
    with open(os.path.join(killed, "ckpt", "step_000099", ".metadata"), "wb") as f:
        f.write(b"torn")
    os.makedirs(os.path.join(killed, "ckpt", "step_000100.partial"))
    log = torchrun(killed, TSP_TEST_KILL="1:3")
    assert "attempt 0: starting at step 0" in log, log[-3000:]
    assert "step 2 loss" in log and "rank 1 SIGKILLs itself at step 3" in log, log[-3000:]
    assert "attempt 2" not in log, log[-3000:]
    want = f"attempt 1: starting at step 2 from {os.path.join(killed, 'ckpt', 'step_000002')}"
    assert want in log, log[-3000:]
    assert sorted(os.listdir(os.path.join(killed, "ckpt"))) == [
        "step_000002", "step_000004", "step_000006", "step_000099", "step_000100.partial"]

    a = torch.load(os.path.join(plain, "final.pt"))
    b = torch.load(os.path.join(killed, "final.pt"))
    # 2 layers of 9, embedding, norm, head
    assert sorted(a) == sorted(b) and len(a) == 2 * 9 + 3, sorted(a)
    assert a["model.norm.weight"].dtype == torch.float32
    for name in a:
        assert torch.equal(a[name], b[name]), f"{name} differs after the restart"
