"""Accelerate: the example script with TSPAccelerator on 2 processes started by
``accelerate launch`` matches the unchanged script (plain Accelerator) on one process; inside the
script, save_state / load_state must round-trip exactly (it exits non-zero otherwise)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import torch

from .reference import assert_close

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "examples", "accelerate_llama.py")
EXIT_CLEANLY = os.path.join(ROOT, "tests", "exit_cleanly.py")


def run(cmd: list[str], **extra_env: str) -> str:
    env = dict(os.environ, OMP_NUM_THREADS="1", **extra_env)
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return proc.stdout


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


def test_tsp_size_from_the_launch_environment_with_data_parallel(tmp_path):
    # 4 processes, TSP_SIZE=2 in the launching environment: TSP degree 2 x data parallel 2
    # (gradients summed over the data-parallel dim); the save_state / load_state round trip holds
    accelerate = os.path.join(os.path.dirname(sys.executable), "accelerate")
    stdout = run([accelerate, "launch", "--multi_gpu", "--num_processes", "4", EXIT_CLEANLY,
                  SCRIPT, "--out", str(tmp_path)], TSP_SIZE="2")
    assert "processes 4, TSP degree 2" in stdout, stdout


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
