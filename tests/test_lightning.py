"""Lightning: Trainer(strategy="tsp") and Fabric(strategy="tsp") on 2 CPU processes started by
Lightning itself match one process; resume is exact; bad configurations fail fast everywhere."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from .reference import assert_close

JOB = os.path.join(os.path.dirname(__file__), "lightning_job.py")


def run_job(out: str, *args: str, expect_ok: bool = True) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, JOB, "--out", out, *args], capture_output=True,
                          text=True, timeout=240, env=env)
    if expect_ok:
        assert proc.returncode == 0, proc.stderr[-4000:]
    return proc


def result(out: str) -> tuple[dict, dict]:
    with open(os.path.join(out, "result.json")) as f:
        res = json.load(f)
    return res, torch.load(os.path.join(out, "weights.pt"))


def assert_same(run: tuple[dict, dict], ref: tuple[dict, dict], tol: float = 1e-5) -> None:
    (res, weights), (ref_res, ref_weights) = run, ref
    assert len(res["losses"]) == len(ref_res["losses"])
    for step, (a, b) in enumerate(zip(res["losses"], ref_res["losses"])):
        assert abs(a - b) <= tol * abs(b), f"step {step}: loss {a} vs {b}"
    assert sorted(weights) == sorted(ref_weights)
    for name, t in ref_weights.items():
        assert_close(weights[name], t, tol, name)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("ref"))
    run_job(out, "--strategy", "auto", "--devices", "1", "--clip", "0.5")
    return result(out)


def test_trainer_matches_one_process(tmp_path, reference):
    # gradient clipping on in both runs (clip_grad_norm_ over DTensor parameters)
    run_job(str(tmp_path), "--devices", "2", "--clip", "0.5")
    run = result(str(tmp_path))
    assert_same(run, reference)
    # the logged train loss is the true (global) loss, not a rank's share
    for logged, true in zip(run[0]["logged"], reference[0]["losses"]):
        assert abs(logged - true) <= 1e-5 * abs(true)
    # validate and test see sharded batches too; predict returns the local tokens' logits
    for key in ("val", "test"):
        assert abs(run[0][key] - reference[0][key]) <= 1e-5 * abs(reference[0][key]), key
    assert reference[0]["predict_shapes"][0] == [2, 24, 96]
    assert all(shape == [2, 12, 96] for shape in run[0]["predict_shapes"])


def test_resume_is_exact(tmp_path):
    # One batch per epoch (2 sequences), so Lightning's own data-loader resume semantics (it
    # does not replay a shuffled, non-stateful sampler mid-run) cannot change what steps 3-4 see;
    # what is tested is the sharded weights and optimizer state through the DCP checkpoint.
    ckpts = tmp_path / "ckpts"
    common = ("--devices", "2", "--clip", "0.5", "--rows", "2")
    run_job(str(tmp_path / "a"), *common, "--ckpt-dir", str(ckpts))
    uninterrupted = result(str(tmp_path / "a"))
    step2 = ckpts / "epoch=1.ckpt"
    assert step2.is_dir(), f"a sharded (torch.distributed.checkpoint) folder: {sorted(ckpts.iterdir())}"
    run_job(str(tmp_path / "b"), *common, "--resume", str(step2))
    res, weights = result(str(tmp_path / "b"))
    assert len(res["losses"]) == 2, res
    assert_same(({"losses": res["losses"]}, weights),
                ({"losses": uninterrupted[0]["losses"][2:]}, uninterrupted[1]), tol=1e-6)


def doc_by_doc_loss(docs: list[list[int]], model) -> float:
    """The unmodified model on each document alone: the mean next-token loss over all of them
    (the HF model on the packed row is no reference: its attention crosses documents)."""
    import torch.nn.functional as F

    total, count = 0.0, 0
    with torch.no_grad():
        for d in docs:
            t = torch.tensor(d)[None]
            total += F.cross_entropy(model(input_ids=t).logits[0, :-1], t[0, 1:],
                                     reduction="sum").item()
            count += len(d) - 1
    return total / count


def test_packed_batches(tmp_path):
    # one step on one DataCollatorWithFlattening row of 2 documents (order does not matter)
    from .lightning_job import Documents, build_llama

    run_job(str(tmp_path), "--devices", "2", "--packed", "--rows", "2", "--steps", "1")
    res, _ = result(str(tmp_path))
    want = doc_by_doc_loss(Documents(2).docs, build_llama())
    assert abs(res["losses"][0] - want) <= 1e-5 * want, (res["losses"], want)


def test_fabric_matches_one_process(tmp_path):
    run_job(str(tmp_path / "ref"), "--mode", "fabric", "--strategy", "auto", "--devices", "1")
    run_job(str(tmp_path / "tsp"), "--mode", "fabric", "--devices", "2")
    assert_same(result(str(tmp_path / "tsp")), result(str(tmp_path / "ref")))


@pytest.mark.parametrize("precision", ["bf16-mixed", "bf16-true"])
def test_bf16_precisions_train(tmp_path, reference, precision):
    run_job(str(tmp_path), "--devices", "2", "--precision", precision, "--steps", "2")
    res, _ = result(str(tmp_path))
    for a, b in zip(res["losses"], reference[0]["losses"]):
        assert abs(a - b) <= 0.02 * abs(b), f"{precision}: loss {a} vs float32 {b}"


def test_export_hf_checkpoint(tmp_path, reference):
    from transformers import AutoModelForCausalLM

    run_job(str(tmp_path), "--devices", "2", "--clip", "0.5", "--export", str(tmp_path / "hf"))
    model = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"))
    want = reference[1]
    for name, t in model.state_dict().items():
        assert_close(t, want[name], 1e-5, name)


@pytest.mark.parametrize("args,message", [
    (["--tsp-size", "3"], r"tsp_size \(3\) must divide the world size \(2\)"),
    (["--bad-model"], r"no TSP policy for GPT2LMHeadModel \(model_type='gpt2'\); supported"),
    (["--precision", "16-true"], r"precision='16-true' is not supported by the TSP strategy"),
])
def test_bad_configuration_fails_fast(tmp_path, args, message):
    import re

    proc = run_job(str(tmp_path), "--devices", "2", *args, expect_ok=False)
    assert proc.returncode != 0
    assert re.search(message, proc.stderr), proc.stderr[-3000:]
