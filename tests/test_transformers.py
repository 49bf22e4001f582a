"""Transformers: TSPTrainer(tsp_size=2) on 2 processes (torchrun) matches the plain Trainer on one
process on a tiny Llama saved with save_pretrained; resuming from a checkpoint is exact; a Qwen2
checkpoint (with biases) loads shard-on-read into a TSP model with the plain model's logits."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

from . import dist_pool, hf_models
from .reference import assert_close

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
JOB = os.path.join(ROOT, "tests", "trainer_job.py")
EXIT_CLEANLY = os.path.join(ROOT, "tests", "exit_cleanly.py")


def run(cmd: list[str]) -> None:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]


def torchrun(*args: str) -> None:
    run([os.path.join(os.path.dirname(sys.executable), "torchrun"), "--standalone",
         "--nproc_per_node", "2", EXIT_CLEANLY, JOB, *args])


def result(out) -> tuple[dict, dict]:
    with open(os.path.join(out, "result.json")) as f:
        return json.load(f), torch.load(os.path.join(out, "weights.pt"))


@pytest.fixture(scope="module")
def saved_llama(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("llama"))
    hf_models.build("llama", torch.float32).save_pretrained(path)
    return path


def common(model: str, out_dir) -> list[str]:
    return ["--model_path", model, "--max_steps", "4", "--per_device_train_batch_size", "2",
            "--learning_rate", "1e-3", "--logging_steps", "1", "--report_to", "none", "--use_cpu",
            "--seed", "0", "--output_dir", str(out_dir)]


def test_tsp_trainer_matches_plain_trainer(tmp_path, saved_llama):
    run([sys.executable, EXIT_CLEANLY, JOB, *common(saved_llama, tmp_path / "o1"),
         "--save_strategy", "no",
         "--out", str(tmp_path / "plain")])
    torchrun(*common(saved_llama, tmp_path / "o2"), "--save_strategy", "no", "--tsp_size", "2",
             "--out", str(tmp_path / "tsp"))
    (ref, ref_w), (res, w) = result(tmp_path / "plain"), result(tmp_path / "tsp")
    assert len(res["losses"]) == len(ref["losses"]) == 4
    for step, (a, b) in enumerate(zip(res["losses"], ref["losses"])):  # the logged losses
        assert abs(a - b) <= 1e-5 * abs(b), f"step {step}: logged loss {a} vs {b}"
    assert abs(res["eval_loss"] - ref["eval_loss"]) <= 1e-5 * abs(ref["eval_loss"])
    assert sorted(w) == sorted(ref_w)
    for name, t in ref_w.items():
        assert_close(w[name], t, 1e-5, name)


def test_packed_batches_with_data_collator_with_flattening(tmp_path, saved_llama):
    # one step on one flattened row of 2 documents: the logged loss is the loss of the unmodified
    # model run on each document alone (the HF model on the packed row would let them mix)
    import torch.nn.functional as F
    from transformers import AutoModelForCausalLM

    from .trainer_job import packed_documents

    args = [*common(saved_llama, tmp_path / "o"), "--packed", "true", "--num_docs", "2",
            "--save_strategy", "no", "--tsp_size", "2", "--out", str(tmp_path / "tsp")]
    args[args.index("--max_steps") + 1] = "1"
    torchrun(*args)
    res, _ = result(tmp_path / "tsp")
    model = AutoModelForCausalLM.from_pretrained(saved_llama)
    total, count = 0.0, 0
    with torch.no_grad():
        for d in packed_documents(model.config.vocab_size, 2):
            t = torch.tensor(d)[None]
            total += F.cross_entropy(model(input_ids=t).logits[0, :-1], t[0, 1:],
                                     reduction="sum").item()
            count += len(d) - 1
    assert abs(res["losses"][0] - total / count) <= 1e-5 * total / count, (res, total / count)


def test_resume_from_checkpoint_is_exact(tmp_path, saved_llama):
    args = ["--tsp_size", "2"]
    torchrun(*common(saved_llama, tmp_path / "a"), *args, "--save_strategy", "steps",
             "--save_steps", "2", "--out", str(tmp_path / "ra"))
    ckpt = tmp_path / "a" / "checkpoint-2"
    assert (ckpt / "model.safetensors").exists() and (ckpt / "optimizer_dcp").is_dir()
    torchrun(*common(saved_llama, tmp_path / "b"), *args, "--save_strategy", "no",
             "--resume", str(ckpt), "--out", str(tmp_path / "rb"))
    (full, full_w), (resumed, resumed_w) = result(tmp_path / "ra"), result(tmp_path / "rb")
    assert resumed["losses"] == full["losses"][2:]
    for name, t in full_w.items():
        assert torch.equal(resumed_w[name], t), name


@pytest.fixture(scope="module")
def pool():
    p = dist_pool.DistPool(4)
    yield p
    p.close()


def shard_on_read(tsp: int, path: str) -> int:
    from transformers import AutoModelForCausalLM
    from tsp_transformers import load_pretrained

    from tsp_core import shard_batch
    from tsp_core.layout import shard_sequence

    mesh = dist_pool.mesh(tsp)
    if dist.get_rank() == 0:
        hf_models.build("qwen2", torch.float64).save_pretrained(path)
    dist.barrier()
    plain = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64)
    model = load_pretrained(path, mesh=mesh, dtype=torch.float64)
    ids = torch.randint(0, 96, (2, 24), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        want = plain(input_ids=ids).logits
        got = model(**shard_batch({"input_ids": ids}, mesh)).logits
    assert_close(got, shard_sequence(want, mesh.rank, mesh.size), 1e-10, "logits")
    # and back: save_pretrained of the TSP model writes an ordinary checkpoint
    out = path + "-back"
    model.save_pretrained(out)
    dist.barrier()
    again = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float64)
    for name, t in plain.state_dict().items():
        assert torch.equal(again.state_dict()[name], t), name
    dist.barrier()
    return sum(p.to_local().numel() for p in model.parameters())


@pytest.mark.parametrize("tsp", [2, 4])
def test_qwen2_loads_shard_on_read(pool, tmp_path, tsp):
    local = pool.run(shard_on_read, tsp, str(tmp_path / "qwen2"))
    total = sum(p.numel() for p in hf_models.build("qwen2", torch.float32).parameters())
    assert max(local) < total / tsp * 1.5, (local, total)
