"""Every example script, run for a few steps with the command its docstring documents (plus its
own steps option), ends cleanly on every rank (tests/support/launch.py) and prints the losses of one
process, to the printed precision: a reference computed here from the example's model config,
data, optimizer and clipping (Lightning: the final loss; DeepSpeed, Accelerate: every step), the
main job's own one-process column, or the plain Trainer. Each reference moves the loss by much
more than the tolerance, so a run that did not train fails. (On random tokens AdamW's first steps
raise the loss of these models; "moved", not "fell", is what is checked.)

The Trainer example also runs with gradient accumulation: 2 micro-batches of 1 row on TSP
(2 processes) against the plain Trainer with batches of 2 rows on one process (its other
documented command): the same logged losses and gradient norms at every step and the same final
weights.

The main job also runs with FSDP2 (``--tsp 2 --dp-shard 2``, 4 processes: each data-parallel rank
its own row, the losses still the one-process ones on the whole batch) and in bfloat16 (losses
within bfloat16's rounding of a float32 reference, and not equal to it); its argument checks
(``check_args``) run in this process. DeepSpeed runs with ZeRO-2 and ZeRO-3, one launch for
both."""

from __future__ import annotations

import functools
import json
import math
import os
import re
import sys

import pytest
import torch

from tests.support import launch

EXAMPLES = os.path.join(launch.ROOT, "examples")
BIG = dict(vocab_size=4096, hidden_size=256, intermediate_size=704, num_hidden_layers=4,
           num_attention_heads=8, num_key_value_heads=4)   # lightning, hf_trainer, deepspeed


def example(name: str) -> str:
    return os.path.join(EXAMPLES, name)


def floats(pattern: str, text: str) -> list[float]:
    found = [float(v) for v in re.findall(pattern, text)]
    assert found, f"nothing printed matches {pattern!r}:\n{text[-3000:]}"
    return found


def train_reference(model, batches, lr: float, weight_decay: float, clip: float | None):
    """Losses of AdamW steps of ``model`` on ``batches`` (ids, also the labels), one process."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay)
    losses = []
    for ids in batches:
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def assert_losses(printed: list[float], ref: list[float], tol: float) -> None:
    assert len(printed) == len(ref), (printed, ref)
    for step, (a, b) in enumerate(zip(printed, ref)):
        assert abs(a - b) <= tol, f"step {step}: printed loss {a} vs one process {b}"
    assert abs(ref[-1] - ref[0]) > 10 * tol, f"training did not move the loss: {ref}"


def logged_tsp_rows(csv_file) -> list[dict]:
    """The rows of a Lightning CSVLogger file that carry TSP's figures."""
    import csv

    with open(csv_file) as f:
        rows = [{k: float(v) for k, v in row.items() if k.startswith("tsp/") and v}
                for row in csv.DictReader(f)]
    return [row for row in rows if row]


def assert_tsp_rows(rows: list[dict], steps: int, tokens: int) -> None:
    """One row per step (logged every step), each of one step of ``tokens`` tokens that sent
    something; their exactness against comm's counters is tests/metrics_check's."""
    assert [row["tsp/steps"] for row in rows] == [1.0] * steps, rows
    for row in rows:
        assert row["tsp/tokens"] == tokens and row["tsp/comm_mib"] > 0, row
        assert abs(row["tsp/tokens_per_s"] * row["tsp/step_s"] - tokens) <= 1e-9 * tokens, row


def lightning_reference(steps: int, seq: int, shuffle: bool) -> list[float]:
    """examples/lightning_llama.py's training on one process, its rows in the order of a
    one-replica DistributedSampler (Lightning's Trainer shuffles with seed 0, Fabric does not)."""
    from torch.utils.data import DistributedSampler
    from transformers import LlamaConfig, LlamaForCausalLM

    ids = torch.randint(0, 4096, (64, seq), generator=torch.Generator().manual_seed(0))
    order = list(DistributedSampler(range(64), num_replicas=1, rank=0, shuffle=shuffle, seed=0))
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(max_position_embeddings=seq, **BIG))
    return train_reference(model, [ids[order[2 * s:2 * s + 2]] for s in range(steps)], 3e-4,
                           0.01, clip=1.0)


def test_lightning_example(tmp_path):
    # `python examples/lightning_llama.py`: Lightning starts 2 processes (TSP 2, dp 1); its
    # training loader gets Lightning's DistributedSampler (1 replica, shuffled, seed 0). The
    # strategy's TSPMonitor writes TSP's figures to the CSVLogger every step
    steps, seq = 3, 128
    proc = launch.run([sys.executable, example("lightning_llama.py"), "--steps", str(steps),
                       "--seq", str(seq), "--log-dir", str(tmp_path)], ranks=2)
    final = floats(r"final train_loss (\S+)", proc.stdout)
    ref = lightning_reference(steps, seq, shuffle=True)
    assert abs(final[-1] - ref[-1]) <= 1e-4, (final, ref)   # printed with 4 decimals
    assert abs(ref[-1] - ref[0]) > 1e-3, ref
    assert "tsp metrics (this rank): 1 steps" in proc.stdout, proc.stdout[-2000:]
    assert_tsp_rows(logged_tsp_rows(tmp_path / "trainer" / "version_0" / "metrics.csv"), steps,
                    2 * seq)


def test_lightning_fabric_example(tmp_path):
    # `python examples/lightning_llama.py --fabric`: the same training as a Fabric loop (its
    # injected sampler keeps the loader's order), fabric.log_dict with TSP's figures every step
    steps, seq = 3, 128
    proc = launch.run([sys.executable, example("lightning_llama.py"), "--fabric", "--steps",
                       str(steps), "--seq", str(seq), "--log-dir", str(tmp_path)], ranks=2)
    final = floats(r"final train_loss (\S+)", proc.stdout)
    ref = lightning_reference(steps, seq, shuffle=False)
    assert abs(final[-1] - ref[-1]) <= 1e-4, (final, ref)
    assert "tsp metrics (this rank): 1 steps" in proc.stdout, proc.stdout[-2000:]
    assert_tsp_rows(logged_tsp_rows(tmp_path / "fabric" / "version_0" / "metrics.csv"), steps,
                    2 * seq)


@pytest.fixture(scope="module")
def deepspeed_runs() -> dict[int, str]:
    """The documented 4-process DeepSpeed runs, ZeRO-2 (the default) then ``--stage 3``, one after
    the other in one launch (tests/jobs/example_job.py): rank 0's stdout of each, by stage."""
    steps = ["--tsp", "2", "--steps", "3", "--seq", "128"]
    proc = launch.run(launch.torchrun(4, os.path.join(launch.JOBS, "example_job.py"),
                                      example("deepspeed_llama.py"), *steps, "--then", *steps,
                                      "--stage", "3"), ranks=4, timeout=900, DS_ACCELERATOR="cpu")
    # rank 0 announces each run and prints what the tests read
    parts = re.split(r"^example_job: run \d+\n", proc.stdout, flags=re.M)
    assert len(parts) == 3, proc.stdout[-3000:]
    return {2: parts[1], 3: parts[2]}


@functools.cache
def deepspeed_reference(steps: int, seq: int) -> list[float]:
    """One process on both replicas' batches (FusedAdam: weight decay 0); the same for both
    stages, so computed once."""
    from transformers import LlamaConfig, LlamaForCausalLM

    gens = [torch.Generator().manual_seed(1 + dp_rank) for dp_rank in range(2)]
    batches = [torch.cat([torch.randint(0, 4096, (2, seq), generator=g) for g in gens])
               for _ in range(steps)]
    torch.manual_seed(0)
    return train_reference(LlamaForCausalLM(LlamaConfig(**BIG)), batches, 3e-4, 0.0, clip=1.0)


@pytest.mark.parametrize("stage", [2, 3], ids=["zero2", "zero3"])
def test_deepspeed_example(deepspeed_runs, stage):
    # the documented 4-process runs: TSP 2 x data parallel 2, ZeRO-2 (the default) and
    # `--stage 3` (parameters partitioned over the data-parallel ranks too); every step's printed
    # loss is the global mean over both replicas' batches
    steps, seq = 3, 128
    stdout = deepspeed_runs[stage]
    printed = floats(r"step \d+ loss (\S+)", stdout)
    assert f"TSP degree 2 x data parallel 2, ZeRO stage {stage}\n" in stdout, stdout
    assert f"tsp metrics (this rank): {steps} steps" in stdout, stdout[-2000:]
    assert_losses(printed, deepspeed_reference(steps, seq), 1e-4)   # printed with 4 decimals


def test_accelerate_example(tmp_path):
    # `accelerate launch --multi_gpu --num_processes 2`: 4 steps, save_state, 2 steps, load_state,
    # the same 2 steps again (the script checks they repeat); it prints the 6 losses
    from transformers import LlamaConfig, LlamaForCausalLM

    accelerate = os.path.join(launch.BIN, "accelerate")
    proc = launch.run([accelerate, "launch", "--multi_gpu", "--num_processes", "2",
                       example("accelerate_llama.py"), "--out", str(tmp_path)], ranks=2)
    assert "processes 2, TSP degree 2" in proc.stdout, proc.stdout
    assert "tsp metrics (this rank): 1 steps" in proc.stdout, proc.stdout[-2000:]
    with open(tmp_path / "metrics.jsonl") as f:
        logged = [json.loads(line) for line in f]
    assert [row["step"] for row in logged] == list(range(1, 9)), logged
    assert_tsp_rows(logged, 8, 2 * 64)     # 4 + 2 steps, then the 2 steps again after load_state
    (line,) = re.findall(r"^losses (.*)$", proc.stdout, re.M)
    printed = [float(v) for v in line.split()]
    ids = torch.randint(0, 128, (32, 64), generator=torch.Generator().manual_seed(1))
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128,
                                         num_hidden_layers=2, num_attention_heads=4,
                                         num_key_value_heads=2, max_position_embeddings=64))
    ref = train_reference(model, [ids[2 * s:2 * s + 2] for s in range(6)], 1e-3, 0.01, clip=None)
    assert_losses(printed, ref, 1e-5 * ref[0])   # printed with 6 decimals


def trainer_logs(stdout: str) -> list[tuple[float, float]]:
    """(loss, grad_norm) of every step the Trainer logged (4 significant digits)."""
    return [(float(a), float(b)) for a, b in
            re.findall(r"\{'loss': '([^']+)', 'grad_norm': '([^']+)'", stdout)]


def test_hf_trainer_example_with_gradient_accumulation(tmp_path):
    from safetensors.torch import load_file

    steps = ["--max_steps", "2"]
    plain, tsp = launch.run_together(  # the two runs are independent
        ([sys.executable, example("hf_trainer_llama.py"), *steps, "--output_dir",
          str(tmp_path / "plain")], 1),
        (launch.torchrun(2, example("hf_trainer_llama.py"), "--tsp_size", "2", *steps,
                         "--per_device_train_batch_size", "1", "--gradient_accumulation_steps",
                         "2", "--output_dir", str(tmp_path / "tsp")), 2))
    assert "tsp metrics (this rank): 1 steps" in tsp.stdout, tsp.stdout[-2000:]
    ref, got = trainer_logs(plain.stdout), trainer_logs(tsp.stdout)
    assert len(ref) == len(got) == 2, (plain.stdout[-2000:], tsp.stdout[-2000:])
    for step, ((loss, norm), (ref_loss, ref_norm)) in enumerate(zip(got, ref)):
        # one unit of the 4th significant digit: a gradient twice too large (micro-batch means
        # summed) or half (a dp average) is far outside
        assert abs(loss - ref_loss) <= 1e-3 * ref_loss, f"step {step}: loss {loss} vs {ref_loss}"
        assert abs(norm - ref_norm) <= 1e-3 * ref_norm, f"step {step}: grad norm {norm} vs " \
                                                        f"{ref_norm}"
    assert ref[1][0] != ref[0][0]
    a = load_file(str(tmp_path / "tsp" / "final" / "model.safetensors"))
    b = load_file(str(tmp_path / "plain" / "final" / "model.safetensors"))
    start = load_file(str(tmp_path / "plain" / "initial_model" / "model.safetensors"))
    assert sorted(a) == sorted(b)
    # 2 AdamW steps (lr 5e-05, then 2.5e-05) move each weight by up to 7.5e-05; elements with tiny
    # gradients move by up to ~3e-06 differently (rounding, divided by sqrt(v)); measured
    moved = max((b[k] - start[k]).abs().max().item() for k in b)
    assert moved > 5e-5, moved
    for name in b:
        err = (a[name] - b[name]).abs().max().item()
        assert err <= 1e-5, f"{name}: final weights differ by {err}"


TINY = ["--layers", "1", "--hidden", "64", "--heads", "4", "--kv-heads", "4", "--ffn", "128",
        "--vocab", "128", "--seq", "64", "--steps", "3", "--warmup", "1"]   # ./run main's options


def main_job(procs: int, *args: str) -> str:
    """`./run main` (torchrun, NPROC processes) with a tiny model: its stdout."""
    return launch.run(["./run", "main", *TINY, *args], ranks=procs, NPROC=str(procs),
                      TSP_VENV=sys.prefix).stdout


def loss_table(stdout: str) -> list[tuple[int, float, float]]:
    """(step, HF 1 process, TSP) of each row of the main job's loss table."""
    rows = re.findall(r"^\s+(\d+)\s+(\S+)\s+(\S+)\s*$", stdout, re.M)
    return [(int(step), float(hf), float(tsp)) for step, hf, tsp in rows]


def main_job_reference(dtype: torch.dtype, batch: int) -> list[float]:
    """The main job's training (TINY, default --lr 1e-3, AdamW's default weight decay 0.01) on
    one process in ``dtype``: its batches are drawn from seed 1, its model from seed 0."""
    from transformers import LlamaConfig, LlamaForCausalLM

    gen = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, 128, (batch, 64), generator=gen) for _ in range(3)]
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128,
                                         num_hidden_layers=1, num_attention_heads=4,
                                         num_key_value_heads=4, max_position_embeddings=64))
    return train_reference(model.to(dtype), batches, 1e-3, 0.01, clip=None)


def test_main_job():
    # `./run main` with the tiny model: the TSP column of the loss table equals the one-process
    # HF column, the script's own reference, which is this test's float32 reference
    out = main_job(2, "--baselines", "")
    rows = loss_table(out)
    assert [r[0] for r in rows] == [0, 1, 2], out
    for (step, hf, tsp), want in zip(rows, main_job_reference(torch.float32, 1)):
        assert abs(hf - want) <= 1e-5 * want, f"step {step}: HF column {hf} vs reference {want}"
        assert abs(tsp - hf) <= 1e-5 * hf, f"step {step}: {tsp} vs {hf}"
    assert rows[-1][1] != rows[0][1]
    assert "TSP, 2 processes" in out
    # tokens/s, MiB sent/step, wait % (some: the ranks exchange K/V and weights), peak MiB/rank
    (wait,) = re.findall(r"^TSP, 2 processes\s+\d+\s+[\d.]+\s+([\d.]+)\s+[\d.]+, [\d.]+$",
                         out, re.M)
    assert float(wait) > 0, out


def test_main_job_with_fsdp2():
    # `NPROC=4 ./run main --tsp 2 --dp-shard 2` (the example's documented FSDP2 run): TSP 2 x
    # FSDP2 2; --batch defaults to one row per data-parallel rank, so the global batch is 2 rows
    # and each replica trains on its own; the printed TSP loss is the global mean, the HF column's
    # loss on both rows, and both are the float32 reference's
    out = main_job(4, "--tsp", "2", "--dp-shard", "2")
    assert "batch 2 x 64 tokens; TSP degree 2, data parallel 2 (FSDP2 over 2)" in out, out
    assert re.search(r"^TSP \+ FSDP2 x 2, 4 processes\s+\d+", out, re.M), out
    rows = loss_table(out)
    ref = main_job_reference(torch.float32, 2)
    assert [r[0] for r in rows] == [0, 1, 2], out
    for (step, hf, tsp), want in zip(rows, ref):
        assert abs(hf - want) <= 1e-5 * want, f"step {step}: HF column {hf} vs reference {want}"
        assert abs(tsp - hf) <= 1e-5 * hf, f"step {step}: TSP + FSDP2 {tsp} vs HF {hf}"
    assert abs(ref[-1] - ref[0]) > 100 * 1e-5 * ref[0], ref


SEVEN = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@pytest.fixture(scope="module")
def bf16_and_lora_runs(tmp_path_factory) -> dict[str, str]:
    """Two runs of the main job's script (`./run main`'s, TINY) in one 2-process launch
    (tests/jobs/example_job.py): ``--dtype bfloat16 --baselines ''``, then ``--lora 4 --dtype
    float64 --adapter-dir DIR``; rank 0's stdout of each, and DIR."""
    adapter = str(tmp_path_factory.mktemp("lora") / "adapter")
    proc = launch.run(launch.torchrun(
        2, os.path.join(launch.JOBS, "example_job.py"), example("train_llama.py"), *TINY,
        "--dtype", "bfloat16", "--baselines", "", "--then", *TINY, "--lora", "4", "--dtype",
        "float64", "--adapter-dir", adapter), ranks=2)
    parts = re.split(r"^example_job: run \d+\n", proc.stdout, flags=re.M)
    assert len(parts) == 3, proc.stdout[-3000:]
    return {"bf16": parts[1], "lora": parts[2], "adapter": adapter}


def test_main_job_in_bfloat16(bf16_and_lora_runs):
    # `./run main --dtype bfloat16` (its script and arguments, in the launch shared with the LoRA
    # run): every column's model in bfloat16. Against the float32
    # reference each printed loss (HF and TSP columns) is within 1e-3: the largest difference
    # measured over these 3 steps was 2.7e-4 (the HF column at step 1; TSP vs HF 2.7e-4 too), so
    # 1e-3 is 3.7x that, a quarter of bfloat16's spacing at the loss's size (2^-6 = 1.6e-2 between
    # 4 and 8) and under a tenth of how far training moves the reference (3.8e-2). Finite, and
    # not equal to float32 to the printed 6 decimals: a --dtype that was ignored fails
    out = bf16_and_lora_runs["bf16"]
    assert "vocab 128, bfloat16;" in out, out
    rows = loss_table(out)
    ref = main_job_reference(torch.float32, 1)
    assert [r[0] for r in rows] == [0, 1, 2], out
    tol = 1e-3
    for (step, hf, tsp), want in zip(rows, ref):
        assert math.isfinite(hf) and math.isfinite(tsp), f"step {step}: {hf}, {tsp}"
        assert abs(hf - want) <= tol, f"step {step}: HF column {hf} vs float32 {want}"
        assert abs(tsp - want) <= tol, f"step {step}: TSP column {tsp} vs float32 {want}"
    assert max(abs(r[1] - w) for r, w in zip(rows, ref)) > 1e-5, (rows, ref)
    assert abs(ref[-1] - ref[0]) > 10 * tol, ref


def lora_reference(adapter: str) -> dict:
    """`train_llama.py --lora 4 --dtype float64` (TINY) on one process with plain PEFT and
    Hugging Face: the same base and adapters (seed 0, get_peft_model's defaults), batches (seed
    1) and AdamW, the loss in float64; the script's 3 steps then its 2 extra (timed) steps on
    batch 0. Its printed trainable-parameter line, losses, and trained logits on batch 0; and
    the adapter the script saved in ``adapter``, loaded by ``PeftModel.from_pretrained`` onto
    the unmodified base: its logits and loss on batch 0, and the base's own logits."""
    import contextlib
    import io

    import torch.nn.functional as F
    from peft import LoraConfig, PeftModel, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    def base():
        torch.manual_seed(0)
        return LlamaForCausalLM(LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128,
                                            num_hidden_layers=1, num_attention_heads=4,
                                            num_key_value_heads=4, max_position_embeddings=64)
                                ).to(torch.float64)

    gen = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, 128, (1, 64), generator=gen) for _ in range(3)]
    ref = get_peft_model(base(), LoraConfig(r=4, lora_alpha=8, target_modules=SEVEN))
    with contextlib.redirect_stdout(io.StringIO()) as line:
        ref.print_trainable_parameters()
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, weight_decay=0.01)
    losses = []
    for ids in batches + batches[:1] * 2:  # the loss in float64 (Hugging Face's is float32)
        logits = ref(input_ids=ids).logits
        loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    ids = batches[0]
    loaded = PeftModel.from_pretrained(base(), adapter)
    with torch.no_grad():
        logits = [m(input_ids=ids).logits for m in (ref, loaded, base())]
    loss = F.cross_entropy(logits[1][0, :-1], ids[0, 1:]).item()
    return dict(line=line.getvalue().strip(), losses=losses[:3], trained=logits[0],
                loaded=logits[1], loaded_loss=loss, base=logits[2])


def test_main_job_trains_a_lora_adapter(bf16_and_lora_runs):
    # `./run main --lora 4` (float64): the trainable-parameter line, the TSP column's losses and
    # the adapter written by save_pretrained against plain PEFT on one process (lora_reference):
    # loaded onto the unmodified base, it gives the one-process trained PeftModel's logits and
    # the loss the script printed for its TSP model after training
    from tests.support.reference import relative_error

    out, adapter = bf16_and_lora_runs["lora"], bf16_and_lora_runs["adapter"]
    ref = lora_reference(adapter)
    assert ref["line"].startswith("trainable params: ") and ref["line"] in out, (ref["line"], out)
    rows = loss_table(out)
    assert [r[0] for r in rows] == [0, 1, 2], out
    for (step, hf, tsp), want in zip(rows, ref["losses"]):
        assert abs(hf - want) <= 1e-5 * want, f"step {step}: HF column {hf} vs reference {want}"
        assert abs(tsp - want) <= 1e-5 * want, f"step {step}: TSP {tsp} vs reference {want}"
    assert abs(ref["losses"][-1] - ref["losses"][0]) > 1e-3, ref["losses"]
    err = relative_error(ref["loaded"], ref["trained"])
    assert err <= 1e-10, f"the saved adapter's logits off the one-process run's by {err:.2e}"
    moved = relative_error(ref["base"], ref["trained"])
    assert moved > 1e-4, f"training left the adapter at zero ({moved:.2e})"
    (printed,) = floats(r"LoRA after training: loss (\S+) on batch 0; adapter saved", out)
    assert abs(printed - ref["loaded_loss"]) <= 2e-6, (printed, ref["loaded_loss"])


def train_llama():
    """examples/train_llama.py as a module (its main runs only as a script)."""
    return launch.load_script(example("train_llama.py"), "train_llama")


BAD_ARGS = [  # (arguments, processes, what the message says)
    ("--steps 2", 2, r"--steps \(2\) must be larger than --warmup \(2\).*pass --steps 3 or more, "
                     r"or --warmup 1 or less"),
    ("--steps 0", 2, r"--steps \(0\) must be at least 1"),
    ("--tsp 3", 4, r"--tsp \(3\) must divide the number of processes \(4\)"),
    ("--seq 6 --tsp 4", 4, r"--seq \(6\) must be at least 2 x --tsp = 8.*pass --seq 8"),
    ("--tsp 1 --batch 3", 2, r"--batch \(3\) must be a multiple of the data-parallel size \(2 = "
                             r"2 processes / --tsp 1\).*pass --batch 2"),
    ("--tsp 2 --dp-shard 3", 8, r"--dp-shard \(3\) must divide the data-parallel size \(4 = 8 "
                                r"processes / --tsp 2\); pass a divisor of 4"),
    ("--tsp 1 --baselines tp", 2, r"--baselines \(tp\) run only without data parallel, and this "
                                  r"run has 2 data-parallel ranks; pass --baselines '' or --tsp 2"),
    ("--checkpoint-dir d --baselines cp", 2, r"--baselines \(cp\) do not run in elastic mode"),
    ("--baselines tp,foo", 2, r"--baselines \(tp,foo\): unknown layout 'foo'"),
    ("--heads 6 --hidden 96 --kv-heads 6", 4, r"--tsp \(4\) must divide --heads \(6\)"),
    ("--heads 4 --kv-heads 3", 2, r"--kv-heads \(3\) must divide --heads \(4\)"),
    ("--hidden 250", 2, r"--heads \(8\) must divide --hidden \(250\)"),
    ("--kv-heads 2 --heads 12 --hidden 96 --ffn 96 --seq 48", 3,
     r"--kv-heads \(2\) and --tsp \(3\): one must divide the other"),
    ("--ffn 700", 8, r"--tsp \(8\) must divide --ffn \(700\)"),
    ("--seq 2050", 2, r"baseline cp takes sequences whose length is a multiple of 4.*pass --seq "
                      r"2052"),
    ("--kv-heads 1", 2, r"baseline tp splits --kv-heads \(1\) over 2 ranks"),  # TSP takes it
    ("--resume", 2, r"--resume: only in elastic mode; add --checkpoint-dir"),
    ("--checkpoint-dir d --checkpoint-every 0", 2, r"--checkpoint-every \(0\) must be at least 1"),
    ("--lora 0", 2, r"--lora \(0\) is the adapters' rank: pass 1 or more"),
    ("--lora 4 --pp 2", 4, r"--lora \(4\) with --pp \(2\): the pipeline run trains every weight; "
                           r"pass --pp 1"),
    ("--lora 4 --tsp 2 --dp-shard 2", 4, r"--lora \(4\) with --dp-shard \(2\): LoRA under TSP "
                                         r"takes no FSDP2 yet"),
    ("--lora 4 --baselines tp", 2, r"--baselines \(tp\) train every weight and --lora \(4\) an "
                                   r"adapter; pass --baselines '' with --lora"),
]


def test_main_job_checks_its_arguments(monkeypatch, capsys):
    # every bad combination is refused by check_args with the numbers and the fix; main refuses
    # `./run main --steps 2` (2 processes; it used to crash at the end with "no median for empty
    # data") with exit status 2 before it builds the mesh (the process group)
    module = train_llama()
    for args, procs, pattern in BAD_ARGS:
        with pytest.raises(ValueError, match=pattern):
            module.check_args(module.parser().parse_args(args.split()), procs)
    # the defaults pass: ./run main (2 processes), NPROC=4 ./run main; and with data parallel,
    # one row per data-parallel rank and no baselines
    for procs in (1, 2, 4):
        got = module.check_args(module.parser().parse_args([]), procs)
        assert (got.tsp, got.batch, got.baselines) == (procs, 1, "tp,tp-sp,cp"), got
    got = module.check_args(module.parser().parse_args("--lora 8".split()), 2)
    assert (got.tsp, got.batch, got.baselines) == (2, 1, ""), got  # --lora runs no baselines
    got = module.check_args(module.parser().parse_args("--tsp 2 --dp-shard 2".split()), 8)
    assert (got.tsp, got.batch, got.baselines) == (2, 4, ""), got
    # elastic mode (tests/project/test_elastic.py's command) runs no baselines
    got = module.check_args(module.parser().parse_args("--checkpoint-dir d --steps 1".split()), 2)
    assert (got.tsp, got.batch, got.baselines) == (2, 1, ""), got

    def no_mesh(*_args, **_kwargs):
        raise AssertionError("init_mesh was called before the arguments were checked")

    monkeypatch.setattr(module.tsp_core, "init_mesh", no_mesh)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setattr(sys, "argv", ["train_llama.py", "--steps", "2"])
    with pytest.raises(SystemExit) as exit_:
        module.main()
    assert exit_.value.code == 2
    assert "error: --steps (2) must be larger than --warmup (2)" in capsys.readouterr().err
