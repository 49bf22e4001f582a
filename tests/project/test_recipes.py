"""The GPU recipes (examples/recipes/, docs/recipes.md) run on CPU: 2 processes (TSP degree 2,
gloo), float64, a tiny Llama written with save_pretrained, a uint32 .npy token file, 64 tokens a
row.

Each recipe runs in a launch started as docs/recipes.md starts it (torchrun, ``accelerate
launch``; tests/jobs/recipe_job.py; the torchrun recipes one after another in one launch):
``main`` to step 2, saving a checkpoint there, then ``main --resume`` to step 4, which builds
everything again and continues from that checkpoint. Every
printed loss must equal one process training the unmodified model on the same rows in file order
(AdamW, gradient clipping at 1.0, as every recipe does), in float64: steps 1 and 2 from the first
run, steps 3 and 4 from the resumed one (step 4's loss shows step 3's update, so the optimizer
state). The learning rate (1e-2) moves the loss by far more than the
tolerance, so a resume that lost the weights, the optimizer state or its place in the data fails.
Each launch must end cleanly on both ranks, write the checkpoint the recipe promises, and report
TSP's figures per step (printed, and in the file of the framework's logger)."""

from __future__ import annotations

import csv
import json
import math
import os
import re

import numpy as np
import pytest
import torch

from tests.support import launch
from tests.support.hf_models import reference_loss

SEQ, BATCH, LR, CLIP = 64, 2, 1e-2, 1.0
CONFIG = dict(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ)
JOB = os.path.join(launch.JOBS, "recipe_job.py")


# the recipes torchrun starts share one launch, in this order (DeepSpeed last: its engine is
# the one whose global state lasts)
TORCHRUN = ["pytorch", "trainer", "lightning", "deepspeed"]


def launcher(names: list[str]) -> list[str]:
    """2 processes on one node, started as docs/recipes.md starts the recipes (``accelerate
    launch`` for Accelerate, torchrun for the others), running tests/jobs/recipe_job.py."""
    if names == ["accelerate"]:
        return [os.path.join(launch.BIN, "accelerate"), "launch", "--multi_gpu",
                "--num_processes", "2", JOB, "accelerate"]
    return launch.torchrun(2, JOB, ",".join(names))


# where each recipe's step-2 checkpoint lands, and the file its logger writes
CHECKPOINT = {"pytorch": "step_2/tsp_checkpoint.json",
              "trainer": "checkpoint-2/optimizer_dcp/tsp_checkpoint.json",
              "lightning": "checkpoints/epoch=0-step=2.ckpt/tsp_checkpoint.json",
              "accelerate": "step_2/tsp_model/tsp_checkpoint.json",
              "deepspeed": "step_2"}
LOG_FILE = {"lightning": "lightning_logs/version_0/metrics.csv"}
# the Trainer logs its loss in float32; DeepSpeed's Adam updates float64 weights through its own
# arithmetic (its loss at step 3 measured 5e-10 relative from torch's AdamW at lr 1e-5)
TOLERANCE = {"trainer": 1e-6, "deepspeed": 1e-7}


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """The tiny pretrained model, its token file and the one-process losses of steps 1-4."""
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    root = tmp_path_factory.mktemp("recipes")
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**CONFIG)).save_pretrained(root / "model")
    tokens = np.random.default_rng(0).integers(0, CONFIG["vocab_size"], 8 * SEQ, dtype=np.uint32)
    np.save(root / "tokens.npy", tokens)
    rows = torch.from_numpy(tokens.astype(np.int64)).view(-1, SEQ)

    model = AutoModelForCausalLM.from_pretrained(root / "model", dtype=torch.float64,
                                                 attn_implementation="sdpa")
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    losses = []
    for step in range(4):
        ids = rows[step * BATCH:(step + 1) * BATCH]      # dp 1: the file's rows in order
        loss = reference_loss(model, ids, ids)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    with torch.no_grad():
        untrained = AutoModelForCausalLM.from_pretrained(root / "model", dtype=torch.float64,
                                                         attn_implementation="sdpa")
        ids = rows[2 * BATCH:3 * BATCH]
        assert abs(reference_loss(untrained, ids, ids).item() - losses[2]) > 1e-3, \
            "two steps did not move the loss: a resume from fresh weights would pass"
    return root, losses


def printed_rows(stdout: str) -> list[dict]:
    return [json.loads(line[len("recipe "):]) for line in stdout.splitlines()
            if line.startswith("recipe {")]


def run(names: list[str], root, out: str) -> dict[str, list[dict]]:
    """Each recipe's two runs (steps 1-2, then --resume to step 4), all in one launch, its files
    in ``out/NAME``: the rows each printed, by recipe."""
    cmd = launcher(names) + ["--model", str(root / "model"), "--data", str(root / "tokens.npy"),
                             "--seq", str(SEQ), "--batch", str(BATCH), "--lr", str(LR),
                             "--dtype", "float64", "--save-every", "2", "--out", out]
    proc = launch.run(cmd, 2, timeout=900, DS_ACCELERATOR="cpu")
    parts = re.split(r"^recipe_job: (\w+)\n", proc.stdout, flags=re.M)
    assert parts[1::2] == names, proc.stdout[-3000:]
    return {name: printed_rows(text) for name, text in zip(parts[1::2], parts[2::2])}


@pytest.fixture(scope="module")
def launched(trained, tmp_path_factory):
    """Every recipe run: the printed rows and the output folder of each, by name (the ones
    torchrun starts in one launch, started on first use; Accelerate's in its own)."""
    root, _ = trained
    base, found = tmp_path_factory.mktemp("recipe_runs"), {}

    def get(name: str) -> tuple[list[dict], str]:
        if name not in found:
            names = TORCHRUN if name in TORCHRUN else [name]
            found.update(run(names, root, str(base)))
        return found[name], str(base / name)

    return get


def assert_figures(rows: list[dict]) -> None:
    """TSP's figures of one step of 2 x 64 tokens that sent something, peak memory included."""
    for row in rows:
        assert row.get("tsp/steps") == 1.0 and row.get("tsp/tokens") == BATCH * SEQ, row
        assert row.get("tsp/comm_mib", 0) > 0 and row.get("tsp/tokens_per_s", 0) > 0, row
        assert row.get("tsp/peak_rss_mib", row.get("tsp/peak_rss_mib_since_start", 0)) > 0, row


def logged_comm(path: str) -> list[float]:
    """The tsp/comm_mib values the framework's logger wrote (metrics.jsonl or Lightning's CSV)."""
    with open(path) as f:
        if path.endswith(".csv"):
            return [float(r["tsp/comm_mib"]) for r in csv.DictReader(f) if r.get("tsp/comm_mib")]
        return [json.loads(line)["tsp/comm_mib"] for line in f if line.strip()]


@pytest.mark.parametrize("name", ["pytorch", "trainer", "lightning", "accelerate", "deepspeed"])
def test_recipe_trains_saves_and_resumes(trained, launched, name):
    _, ref = trained
    tol = TOLERANCE.get(name, 1e-10)

    rows, out = launched(name)
    # steps 1-2, then the resumed run continues at step 3 (a resume that restarted would print
    # steps 1-4 again)
    assert [row["step"] for row in rows] == [1, 2, 3, 4], rows
    assert os.path.exists(os.path.join(out, CHECKPOINT[name])), sorted(os.listdir(out))
    assert_figures(rows)
    # the resumed run adds its rows after the first run's (a row per step where the recipe
    # writes one, JSONLinesTracker(append=True) for Accelerate); the other loggers, at least
    # the resumed run's 2 steps
    logged = logged_comm(os.path.join(out, LOG_FILE.get(name, "metrics.jsonl")))
    assert len(logged) == 4 if name in ("pytorch", "accelerate") else len(logged) >= 2, logged

    for row, expected in zip(rows, ref):
        assert math.isfinite(row["loss"]), row
        assert abs(row["loss"] - expected) <= tol * abs(expected), \
            f"{name} step {row['step']}: printed loss {row['loss']!r}, one process {expected!r}"
