"""Accelerate: the example script with TSPAccelerator on 2 processes started by
``accelerate launch`` matches the unchanged script (plain Accelerator) on one process; inside the
script, save_state / load_state must round-trip exactly (it exits non-zero otherwise). A script
clipping with ``accelerator.clip_grad_norm_`` (tests/accelerate_job.py) matches one process in
float64 with clipping active and plain SGD (norms, first gradients, losses, weights) at
dp 2 x tsp 2 (TSP_SIZE from the launch environment) and tsp 4 with 1 and 2 key/value heads."""

from __future__ import annotations

import json
import os
import sys

import torch

from . import launch
from .reference import assert_close

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "examples", "accelerate_llama.py")
EXIT_CLEANLY = os.path.join(ROOT, "tests", "exit_cleanly.py")


def run(cmd: list[str], **extra_env: str) -> str:
    """``cmd`` must end cleanly on every rank (``--num_processes``, else one)."""
    ranks = int(cmd[cmd.index("--num_processes") + 1]) if "--num_processes" in cmd else 1
    return launch.run(cmd, ranks, **extra_env).stdout


def load(out: str):
    with open(os.path.join(out, "losses.json")) as f:
        return json.load(f), torch.load(os.path.join(out, "weights.pt"))


def test_accelerate_launch_matches_one_process(tmp_path):
    plain, tsp = tmp_path / "plain", tmp_path / "tsp"
    plain.mkdir()
    tsp.mkdir()
    run([sys.executable, EXIT_CLEANLY, SCRIPT, "--plain", "--out", str(plain)])
    accelerate = os.path.join(os.path.dirname(sys.executable), "accelerate")
    stdout = run([accelerate, "launch", "--multi_gpu", "--num_processes", "2", EXIT_CLEANLY,
                  SCRIPT, "--out", str(tsp)])
    assert "processes 2, TSP degree 2" in stdout, stdout
    (ref_losses, ref_weights), (losses, weights) = load(str(plain)), load(str(tsp))
    assert len(losses) == len(ref_losses) == 6
    for step, (a, b) in enumerate(zip(losses, ref_losses)):
        assert abs(a - b) <= 1e-5 * abs(b), f"step {step}: {a} vs {b}"
    # Weights after 6 AdamW steps at lr 1e-3: the plain model's loss is HF's float32
    # cross-entropy, TSP's the fused online log-sum-exp; their ~1e-7 rounding differences in the
    # gradients are divided by sqrt(v) per element, so elements with tiny gradients move by up to
    # ~2e-5 differently (measured; the same happens in float64, where HF still takes the loss in
    # float32). 1e-4 is 1.7% of the largest possible movement (6 x lr).
    assert sorted(weights) == sorted(ref_weights)
    for name, t in ref_weights.items():
        assert_close(weights[name], t, 1e-4, name)


JOB = os.path.join(ROOT, "tests", "accelerate_job.py")


def job_run(out: str, kv_heads: int) -> list[dict]:
    """Every rank's losses and norms for one model; rank 0's with the weights and gradients."""
    import glob

    runs = []
    for fn in sorted(glob.glob(os.path.join(out, "rank*.json"))):
        with open(fn) as f:
            res = json.load(f)
        runs.append({key: res[key][str(kv_heads)] for key in ("losses", "norms")})
    runs[0]["weights"] = torch.load(os.path.join(out, f"weights_kv{kv_heads}.pt"))
    grads = os.path.join(out, f"grads0_kv{kv_heads}.pt")
    if os.path.exists(grads):
        runs[0]["grads0"] = torch.load(grads)
    return runs


def reference(kv_heads: int, rows_per_step: int, dtype=torch.float64, clip: float = 0.5,
              steps: int = 4, family: str = "llama") -> dict:
    """One process on the global batch of each step: the data-parallel replicas' batches of
    accelerate_job's sequential loader, consecutive rows."""
    from . import hf_models
    from .accelerate_job import rows

    data = rows(16)
    batches = [data[rows_per_step * k: rows_per_step * (k + 1)] for k in range(steps)]
    return hf_models.sgd_reference(hf_models.build(family, dtype, kv_heads=kv_heads), batches,
                                   lr=0.5, clip=clip)


def test_data_parallel_and_tsp4_match_one_process(tmp_path):
    # 4 processes started by accelerate launch, two runs: TSP_SIZE=2 from the launching
    # environment (dp 2 x tsp 2: gradients summed over the data-parallel dim), 1 key/value head;
    # then tsp_size=4 with one model of 1 and one of 2 key/value heads. float64, SGD at lr 0.5,
    # clipping at 0.5 (norms 1.3-2.3: it acts at every step), so the weights check the
    # gradients' directions and the norms their sizes; the first gradients are compared too.
    from . import hf_models

    sgd = "--dtype float64 --optimizer sgd --lr 0.5 --clip 0.5"
    accelerate = os.path.join(os.path.dirname(sys.executable), "accelerate")
    stdout = run([accelerate, "launch", "--multi_gpu", "--num_processes", "4", EXIT_CLEANLY,
                  JOB, "--out", str(tmp_path), "--case", f"dp2 {sgd} --kv-heads 1 --metrics "
                  f"--round-trip",
                  "--case", f"tsp4 {sgd} --tsp-size 4 --kv-heads 1,2",
                  "--case", f"granite {sgd} --tsp-size 4 --kv-heads 2 --family granite "
                  f"--clip 0.2"],
                 TSP_SIZE="2")
    assert "processes 4, distributed DistributedType.MULTI_CPU, TSP degree 2" in stdout, stdout
    assert "processes 4, distributed DistributedType.MULTI_CPU, TSP degree 4" in stdout, stdout
    cases = [("dp2", 1, reference(1, rows_per_step=4)), ("tsp4", 1, reference(1, rows_per_step=2)),
             # Granite: embedding, residual, attention and logits multipliers (its gradient norms
             # are 0.41-0.43: clipped at 0.2)
             ("granite", 2, reference(2, rows_per_step=2, family="granite", clip=0.2)),
             ("tsp4", 2, reference(2, rows_per_step=2))]
    for name, kv, ref in cases:
        assert min(ref["norms"]) > (0.2 if name == "granite" else 0.5), ref["norms"]  # clips
        runs = job_run(str(tmp_path / name), kv)
        assert len(runs) == 4 and "grads0" in runs[0], name
        for r, rank_run in enumerate(runs):
            hf_models.assert_matches_reference(rank_run, ref, 1e-8, 1e-9,
                                               what=f"{name}, {kv} kv heads, rank {r}: ")
    assert_logged_metrics(str(tmp_path / "dp2"))


def assert_logged_metrics(out: str) -> None:
    """tsp_metrics() every 2 optimizer steps (save_state and load_state between steps 2-3 and
    4-5 must not count), against each step's own counters on every rank; rank 0's are what the
    tracker received."""
    import glob

    from . import metrics_check

    runs = []
    for fn in sorted(glob.glob(os.path.join(out, "rank*.json"))):
        with open(fn) as f:
            runs.append(json.load(f))
    for r, run in enumerate(runs):
        assert len(run["step_counts"]) == 6 and len(run["metric_rows"]) == 3, (r, run)
        metrics_check.assert_windows(run["metric_rows"], run["step_counts"], 2, f"rank {r}")
    with open(os.path.join(out, "tracker.jsonl")) as f:
        logged = [json.loads(line) for line in f]
    assert [row.pop("step") for row in logged] == [2, 4, 6], logged
    assert logged == runs[0]["metric_rows"], (logged, runs[0]["metric_rows"])


def test_packed_batches(tmp_path):
    # the first step's batch packs documents 0 and 1 of the example into one row; its loss is the
    # unmodified model's on each document alone
    import runpy

    import torch.nn.functional as F
    from transformers import LlamaConfig, LlamaForCausalLM

    accelerate = os.path.join(os.path.dirname(sys.executable), "accelerate")
    stdout = run([accelerate, "launch", "--multi_gpu", "--num_processes", "2", EXIT_CLEANLY,
                  SCRIPT, "--packed", "--out", str(tmp_path)])
    assert "processes 2, TSP degree 2" in stdout, stdout
    with open(os.path.join(tmp_path, "losses.json")) as f:
        first = json.load(f)[0]
    docs = runpy.run_path(SCRIPT)["documents"](32)[:2]
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128,
                                         num_hidden_layers=2, num_attention_heads=4,
                                         num_key_value_heads=2, max_position_embeddings=64))
    total, count = 0.0, 0
    with torch.no_grad():
        for d in docs:
            t = torch.tensor(d["input_ids"])[None]
            total += F.cross_entropy(model(input_ids=t).logits[0, :-1], t[0, 1:],
                                     reduction="sum").item()
            count += t.shape[1] - 1
    assert abs(first - total / count) <= 1e-5 * total / count, (first, total / count)
