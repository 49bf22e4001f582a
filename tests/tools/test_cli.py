"""The installed ``tsp`` console script (the venv's ``bin/tsp``, as a user runs it, not
``python -m``): ``plan``, ``simulate`` and ``bench`` once each on the tiny model, their output
checked against numbers computed here from the model's shape; ``--version`` and every ``--help``
(the whole description, each option's default)."""

from __future__ import annotations

import importlib.metadata
import json
import os
import re
import subprocess
import sys
import tomllib

from tests.support import launch

TSP = os.path.join(launch.BIN, "tsp")
# tsp_core.plan.simulate.MODELS["tiny"]: Llama, untied embeddings
H, F, LAYERS, HEADS, KV_HEADS, VOCAB = 64, 256, 2, 4, 4, 512


def tsp(*args: str) -> subprocess.CompletedProcess:
    proc = subprocess.run([TSP, *args], capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    return proc


def test_plan(tmp_path):
    # 0.0066 GB per GPU: D=1 (estimated 6.2 MB at 1024 tokens) cannot fit, so every choice has
    # D >= 2 (the largest at D=2, cp's, is estimated 5.8 MB)
    out = tmp_path / "plan.json"
    proc = tsp("plan", "--model", "tiny", "--seq", "1024", "--gpus", "8", "--gpus-per-node", "8",
               "--gpu", "h100", "--memory-gb", "0.0066", "--json", str(out))
    plan = json.loads(out.read_text())
    usable = 0.0066e9 * 0.9
    for c in plan["ranking"]:
        assert c["fits"] == (c["memory_gib"] * 2 ** 30 <= usable), c
    assert not any(c["fits"] for c in plan["ranking"] if c["degree"] == 1)
    best = max((c for c in plan["ranking"] if c["fits"]), key=lambda c: c["tokens_per_s"])
    assert plan["choice"] == best and best["degree"] >= 2
    assert f"choice: {best['label']} at D={best['degree']} x {best['replicas']} replicas" \
        in proc.stdout, proc.stdout
    assert f"cannot run: tsp at 8: D (8) must divide num_attention_heads ({HEADS})" in proc.stdout


def test_simulate(tmp_path):
    # one rank of 2 under fake tensors, bf16, no optimizer: TSP keeps half of every large matrix
    # and all of the (replicated) norms; the gradients at the end take the same bytes
    out = tmp_path / "sim.json"
    proc = tsp("simulate", "--model", "tiny", "--seq", "256", "--degree", "2", "--layouts", "tsp",
               "--optimizer", "none", "--recompute", "none", "--jobs", "1", "--json", str(out))
    (rec,) = json.loads(out.read_text())
    large = 2 * VOCAB * H + LAYERS * ((2 * HEADS + 2 * KV_HEADS) * (H // HEADS) * H + 3 * F * H)
    norms = (2 * LAYERS + 1) * H
    params = (large // 2 + norms) * 2   # bytes of bf16
    assert (rec["layout"], rec["degree"], rec["seq"]) == ("tsp", 2, 256)
    assert rec["breakdown"]["parameters"] == params, (rec["breakdown"], params)
    assert rec["phases"]["end"]["gradients"] == params
    assert rec["peak_bytes"] > params
    assert "tsp                 256   2" in proc.stdout, proc.stdout


def test_bench(tmp_path):
    # 2 real processes: the bytes one TSP layer sends in forward are the formula's of docs/design.md
    # "Communication per layer" (D-1)/D * (W_att + W_mlp + 2 B S h / g) elements (g = heads per kv
    # head), float32
    out = tmp_path / "bench.json"
    seq = 64
    proc = tsp("bench", "--model", "tiny", "--degree", "2", "--seq", str(seq), "--layouts", "tsp",
               "--steps", "1", "--warmup", "1", "--json", str(out))
    (rec,) = json.loads(out.read_text())["records"]
    g = HEADS // KV_HEADS
    elements = (2 - 1) / 2 * ((2 + 2 / g) * H * H + 3 * F * H + 2 * seq * H / g)
    assert rec["layer_forward_bytes"] == elements * 4, rec
    assert rec["tokens_per_s"] > 0 and len(rec["peak_bytes"]) == 2 and min(rec["peak_bytes"]) > 0
    assert f"{'tsp':<15} {seq:>6}" in proc.stdout, proc.stdout
    # the progress line on stderr as the case finishes: [done/cases, seconds since the start]
    assert re.search(rf"^\[1/1 \d+s\] {'tsp':<15} {seq:>6} ", proc.stderr, re.M), proc.stderr


def test_simulate_a_config_json(tmp_path):
    # `--model PATH/config.json`: any supported family, built from its config (a tiny Gemma 3:
    # tied embeddings, head_dim 24, 4 norms per layer, per-head q/k norms); TSP keeps half of
    # every large matrix and all of the replicated norms, in bf16
    import torch

    from tests.support import hf_models

    config = hf_models.build("gemma3", torch.float32).config
    config.save_pretrained(tmp_path / "gemma3")
    out = tmp_path / "sim.json"
    tsp("simulate", "--model", str(tmp_path / "gemma3" / "config.json"), "--seq", "256",
        "--degree", "2", "--layouts", "tsp", "--optimizer", "none", "--jobs", "1",
        "--json", str(out))
    (rec,) = json.loads(out.read_text())
    h, d, L = config.hidden_size, config.head_dim, config.num_hidden_layers
    nq, nkv, F, V = (config.num_attention_heads, config.num_key_value_heads,
                     config.intermediate_size, config.vocab_size)
    large = V * h + L * (2 * (nq + nkv) * d * h + 3 * F * h)
    replicated = (4 * L + 1) * h + L * 2 * d
    assert rec["breakdown"]["parameters"] == (large // 2 + replicated) * 2, rec["breakdown"]
    proc = subprocess.run([TSP, "simulate", "--model", str(tmp_path / "none.json")],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "unknown model" in proc.stderr and "config.json" in proc.stderr


def cli_module(*args: str) -> subprocess.CompletedProcess:
    """``python -m tsp_core.tools.cli ARGS``, the entry point the console script calls."""
    proc = subprocess.run([sys.executable, "-m", "tsp_core.tools.cli", *args], capture_output=True,
                          text=True, timeout=120, cwd=launch.ROOT,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0 and not proc.stderr, (args, proc.returncode, proc.stderr[-3000:])
    return proc


def test_version_is_the_package_version():
    # one version everywhere: tsp_core.__version__, which pyproject reads as the distribution's
    # version (so the installed metadata says the same), and `tsp --version` prints
    import tsp_core

    project = tomllib.loads(open(os.path.join(launch.ROOT, "pyproject.toml")).read())
    assert "version" in project["project"]["dynamic"], project["project"]
    assert project["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "tsp_core.__version__"}
    installed = importlib.metadata.version("tsp-parallel")
    assert installed == tsp_core.__version__, (
        f"installed metadata says {installed}, tsp_core.__version__ is {tsp_core.__version__}: "
        "reinstall (pip install -e .)")
    expected = f"tsp {tsp_core.__version__}\n"
    assert cli_module("--version").stdout == expected
    assert tsp("--version").stdout == expected  # the installed console script


def help_blocks(text: str) -> dict[str, str]:
    """An argparse help's "options:" section: each option's first flag -> its whole entry."""
    section = text.split("\noptions:\n", 1)[1]
    blocks: dict[str, str] = {}
    for line in section.splitlines():
        if line.startswith("  -"):
            flag = line.split()[0].rstrip(",")
            blocks[flag] = line
        elif line.startswith("   "):
            blocks[flag] += " " + line.strip()
    return {flag: " ".join(entry.split()) for flag, entry in blocks.items()}


def test_help_shows_the_whole_description_and_every_default():
    # `tsp --help` prints the module's whole description, line by line; every subcommand's help
    # names each option's default: the value when there is one (as the user would type it), in
    # words when there is none (None means "not given")
    from tsp_core.tools import cli

    top = cli_module("--help").stdout
    for line in cli.__doc__.strip('"').splitlines():
        assert line in top, (line, top)
    commands = cli.parser()._subparsers._group_actions[0].choices
    assert set(commands) == {"simulate", "bench", "plan"}, commands
    for name, sub in commands.items():
        text = cli_module(name, "--help").stdout
        assert " ".join(sub.description.split()) in " ".join(text.split()), (name, text)
        blocks = help_blocks(text)
        for action in sub._actions:
            if not action.option_strings or action.dest == "help":
                continue
            entry = blocks[action.option_strings[0]]
            default = action.default
            if default is None:
                assert "default" in entry, (name, entry)
                continue
            shown = ",".join(map(str, default)) if isinstance(default, tuple) else str(default)
            assert f"(default: {shown})" in entry, (name, entry)
            if name == "simulate" and action.dest in ("seq", "model"):
                assert entry.endswith({"seq": "(default: 131072)", "model": "(default: 7b)"}[
                    action.dest]), entry


def test_a_missing_extra_is_named():
    # the base install is torch alone: `tsp plan` without transformers says which extra to install
    code = ("import sys; sys.modules['transformers'] = None\n"
            "from tsp_core.tools.cli import main\n"
            "sys.exit(main(['plan', '--model', 'tiny', '--gpu', 'h100', '--gpus-per-node', '8']))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, cwd=launch.ROOT, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert proc.stderr == ("tsp plan: error: it needs transformers, which is not installed: "
                           "pip install 'tsp-parallel[transformers]'\n"), proc.stderr
