"""``./run gpu-check --device cpu``: the GPU acceptance script runs end to end on CPU at small
shapes (every check present and passing, the JSON and the markdown report written into
``--out``), on torch 2.11's API (what torch 2.12 added is hidden in every process of the run, as
the GPU image lacks it: tests/tools/older_torch.py), and its checks can fail: a flash kernel whose
output is 1% off is caught, and the command then exits 1."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from tests.support.launch import ROOT
from tests.tools import older_torch
from tsp_core.layers import flash
from tsp_core.tools.gpu_check import flash_part, runner

FLASH_CASES = ["mask.causal", "mask.full", "mask.anticausal", "zigzag.D2", "zigzag.D4",
               "zigzag.D8", "window", "packed", "packed.window", "gqa", "mqa"]
MODEL_CHECKS = [f"b.{what}.{dt}" for dt in ("float32", "bfloat16")
                for what in ("generate", "train.loss", "train.weights")]
LAYER_CHECKS = ["c.time", "c.tflops", "c.memory.attention_forward", "c.memory.attention_backward",
                "c.memory.mlp_forward", "c.memory.mlp_backward", "c.memory.step_peak", "d.time",
                "d.tflops", "summary.c_vs_d"]


@pytest.fixture(scope="module")
def cpu_run(tmp_path_factory):
    """``./run gpu-check --device cpu --out DIR`` with this interpreter's environment (TSP_VENV)
    and torch 2.12's additions hidden."""
    folder = tmp_path_factory.mktemp("gpu_check")
    env = older_torch.env(folder / "older_torch", OMP_NUM_THREADS="1", TSP_VENV=sys.prefix)
    run = subprocess.run([os.path.join(ROOT, "run"), "gpu-check", "--device", "cpu", "--out",
                          str(folder / "out")], capture_output=True, text=True, timeout=300,
                         env=env, cwd=ROOT)
    return run, folder / "out" / "gpu-check.json"


def test_cpu_run_passes_every_check(cpu_run):
    run, out = cpu_run
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    data = json.loads(out.read_text())
    assert data["device"]["type"] == "cpu" and data["device"]["torch"] == torch.__version__
    for c in data["checks"]:
        assert {"name", "ok", "tolerance", "measured"} <= set(c), c
        assert c["ok"] is True, c
        assert c["measured"] is not None, c
        assert c["tolerance"] is None or c["measured"] <= c["tolerance"], c
    assert data["summary"] == {**data["summary"], "checks": len(data["checks"]), "failed": 0}
    # every line of the summary is printed
    assert all(c["name"] in run.stdout for c in data["checks"])
    assert out.with_suffix(".md").exists()
    assert "| a.flash.zigzag.D8.float32 | yes |" in out.with_suffix(".md").read_text()


def test_cpu_run_is_on_the_torch_2_11_api(cpu_run):
    """Every Python process of the run (the runner, (c)'s and (d)'s workers, ...) lacked what
    torch 2.11 lacks: ./run and the runner kept the environment."""
    _, out = cpu_run
    seen = older_torch.log(out.parent.parent / "older_torch")
    assert len(seen) >= 3, seen
    assert all(sorted(absent) == sorted(older_torch.every_name()) for absent in seen), seen


def test_cpu_run_has_every_check(cpu_run):
    _, out = cpu_run
    data = json.loads(out.read_text())
    names = {c["name"] for c in data["checks"]}
    dtypes = data["config"]["a"]["dtypes"]
    assert {"float32", "bfloat16"} <= set(dtypes), dtypes  # the CPU flash kernel runs both
    want = {f"a.flash.{case}.{dt}" for case in FLASH_CASES for dt in dtypes}
    missing = (want | set(MODEL_CHECKS) | set(LAYER_CHECKS)) - names
    assert not missing, sorted(missing)
    # the layer parts ran the scaled-down shape, recorded
    assert data["config"]["c"]["local_tokens"] == data["config"]["c"]["seq"] // 8


def scaled_forward(monkeypatch):
    """A flash forward whose output is 1% too large (the LSE untouched)."""
    real = flash.attention_forward

    def wrong(*args, **kwargs):
        out, lse = real(*args, **kwargs)
        return out * (1 + 1e-2), lse

    monkeypatch.setattr(flash, "attention_forward", wrong)


def test_a_wrong_kernel_is_caught(monkeypatch):
    case = next(c for c in flash_part.cases(256) if c.name == "zigzag.D4")
    assert flash_part.check_case(case, "float32", "cpu").ok
    scaled_forward(monkeypatch)
    check = flash_part.check_case(case, "float32", "cpu")
    assert not check.ok and check.measured > 100 * check.tolerance, check
    assert check.detail["errors"]["out"] > 5e-3, check


def test_a_failing_check_exits_1(monkeypatch, tmp_path, capsys):
    scaled_forward(monkeypatch)
    out = tmp_path / "a.json"
    assert runner.main(["--device", "cpu", "--parts", "a", "--json", str(out)]) == 1
    data = json.loads(out.read_text())
    failed = [c["name"] for c in data["checks"] if not c["ok"]]
    assert "a.flash.mask.causal.float32" in failed and data["summary"]["failed"] == len(failed)
    assert "FAIL a.flash.mask.causal.float32" in capsys.readouterr().out
