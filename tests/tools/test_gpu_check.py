"""``./run gpu-check --device cpu``: the GPU acceptance script runs end to end on CPU at small
shapes (every check present and passing, the JSON and the markdown report written into
``--out``), on torch 2.11's API (what torch 2.12 added is hidden in every process of the run, as
the GPU image lacks it: tests/tools/older_torch.py), and its checks can fail: a flash kernel whose
output is 1% off is caught, and the command then exits 1; part (e)'s exactness checks catch an
offload that brings back a wrong layer input or moves none, and tiles that drop tokens or do not
tile."""

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
from tsp_core.tools.gpu_check import compile_part, flash_part, long_context_part, runner

FLASH_CASES = ["mask.causal", "mask.full", "mask.anticausal", "zigzag.D2", "zigzag.D4",
               "zigzag.D8", "window", "packed", "packed.window", "gqa", "mqa"]
MODEL_CHECKS = ([f"b.{what}.{dt}" for dt in ("float32", "bfloat16")
                 for what in ("generate", "train.loss", "train.weights")] +
                [f"b.train.{what}.fp16-mixed" for what in ("loss", "weights")])
LAYER_CHECKS = ["c.time", "c.tflops", "c.memory.attention_forward", "c.memory.attention_backward",
                "c.memory.mlp_forward", "c.memory.mlp_backward", "c.memory.step_peak", "d.time",
                "d.tflops", "summary.c_vs_d"]
LONG_CONTEXT_CHECKS = (["e.offload.exact"] +
                       [f"e.tiles.{kind}.{what}" for kind in ("mlp", "loss")
                        for what in ("exact", "smaller", "time", "time_untiled", "cost", "peak",
                                     "peak_untiled")] +
                       [f"e.offload.{what}" for what in (
                           "time_off", "time_on", "exposed", "copy_time", "d2h_gbps", "h2d_gbps",
                           "kept_off", "kept_on", "peak_off", "peak_on")])


@pytest.fixture(scope="module")
def cpu_run(tmp_path_factory):
    """``./run gpu-check --device cpu --out DIR`` with this interpreter's environment (TSP_VENV)
    and torch 2.12's additions hidden; parts (a) to (e): (f)'s aot_eager compile of a TSP layer
    would add its seconds for what tests/models/test_compiled.py already compiles
    (test_f_compares_compiled_with_eager runs (f)'s comparison)."""
    folder = tmp_path_factory.mktemp("gpu_check")
    env = older_torch.env(folder / "older_torch", OMP_NUM_THREADS="1", TSP_VENV=sys.prefix)
    run = subprocess.run([os.path.join(ROOT, "run"), "gpu-check", "--device", "cpu", "--out",
                          str(folder / "out"), "--parts", "a,b,c,d,e"], capture_output=True,
                         text=True, timeout=300, env=env, cwd=ROOT)
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
    missing = (want | set(MODEL_CHECKS) | set(LAYER_CHECKS) | set(LONG_CONTEXT_CHECKS)) - names
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


def test_e_catches_a_wrong_or_idle_offload(monkeypatch):
    """e.offload.exact passes with offload as written, and fails when the offload brings back
    a layer input 1% off, or keeps every input where it is (a comparison that proves nothing)."""
    from tsp_core.models import offload
    from tsp_core.tools.gpu_check.model_part import one_process_world

    small = long_context_part.SHAPES["cpu"]
    with one_process_world("cpu") as mesh:
        models = {on: long_context_part.converted(small, torch.float64, "cpu", mesh, on)
                  for on in (False, True)}
        batch = long_context_part.token_batch(small, "cpu", mesh)
        check = long_context_part.check_offload_exact(models, batch)
        assert check.ok and check.detail["moved"]["offloaded"] == small.layers, check

        real = offload._to_host
        monkeypatch.setattr(offload, "_to_host", lambda t: real(t) * (1 + 1e-2))
        check = long_context_part.check_offload_exact(models, batch)
        assert not check.ok and check.measured > 100 * check.tolerance, check

        monkeypatch.setattr(offload, "_to_host", real)
        monkeypatch.setattr(offload.ActivationOffload, "_pack", lambda self, t: t)
        check = long_context_part.check_offload_exact(models, batch)
        assert not check.ok and "moved 0 layer inputs" in check.note, check


def test_e_catches_wrong_tiles(monkeypatch):
    """e.tiles.*.exact fails when the tiles leave out the last tokens; e.tiles.*.smaller when
    the MLP and the loss run all their tokens as one tile."""
    from tsp_core.layers import mlp, vocab
    from tsp_core.tools.gpu_check.model_part import one_process_world

    small = long_context_part.SHAPES["cpu"]
    real = mlp.token_tiles
    names = [f"e.tiles.{kind}.{what}" for kind in ("mlp", "loss")
             for what in ("exact", "smaller")]
    with one_process_world("cpu") as mesh:
        model = long_context_part.converted(small, torch.float32, "cpu", mesh, False)
        checks = long_context_part.check_tiles_exact(model, "cpu")
        assert [c.name for c in checks] == names and all(c.ok for c in checks), checks

        for module in (mlp, vocab):  # tiles smaller than the tokens leave out the last one
            monkeypatch.setattr(module, "token_tiles",
                                lambda n, tile: real(n, tile)[:-1] if tile < n else [slice(0, n)])
        exact = [c for c in long_context_part.check_tiles_exact(model, "cpu")
                 if c.name.endswith(".exact")]
        assert len(exact) == 2, exact
        assert all(not c.ok and c.measured > 1e3 * c.tolerance for c in exact), exact

        for module in (mlp, vocab):  # one tile of every token, whatever the tile size
            monkeypatch.setattr(module, "token_tiles", lambda n, tile: [slice(0, n)])
        failed = [c.name for c in long_context_part.check_tiles_exact(model, "cpu") if not c.ok]
        assert failed == ["e.tiles.mlp.smaller", "e.tiles.loss.smaller"], failed


def test_f_compares_compiled_with_eager(monkeypatch):
    """Part (f)'s comparison with both sides eager (``backend=False``: no compile's cost here;
    the compile is tests/models/test_compiled.py's): every figure, the losses equal; and a
    compiled loss 0.1% off fails f.loss."""
    names = ["f.eager.tokens_per_s", "f.compiled.tokens_per_s", "f.ratio", "f.compile_seconds",
             "f.loss", "f.input_grad"]
    checks, figures = compile_part.run("cpu", log=lambda _: None, backend=False)
    assert [c.name for c in checks] == names and all(c.ok for c in checks), checks
    assert checks[4].measured == 0 and figures["graphs"] == 0, checks[4]

    real, calls = compile_part.run_mode, []

    def off(*args, **kwargs):
        res = real(*args, **kwargs)
        calls.append(1)
        if len(calls) == 2:  # the compiled side
            res["loss"] *= 1 + 1e-3
        return res

    monkeypatch.setattr(compile_part, "run_mode", off)
    checks, _ = compile_part.run("cpu", log=lambda _: None, backend=False)
    (loss,) = [c for c in checks if c.name == "f.loss"]
    assert not loss.ok and abs(loss.measured - 1e-3) < 1e-6, loss
