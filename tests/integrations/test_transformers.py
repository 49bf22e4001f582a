"""Transformers: TSPTrainer on torchrun processes matches one process in float64 with
``max_grad_norm`` clipping active and plain SGD: the logged losses and grad_norm, the first
step's gradients and the final weights of every rank (each data-parallel replica's own), at
tsp 2, dp 2 x tsp 2 (also with FSDP2 over dp_shard 2, each rank holding 1/4 of the model) and
tsp 4 with 1 and 2 key/value heads (a tiny Llama saved with save_pretrained); what the Trainer
reports (total_flos, the steps and samples behind ``*_per_second``, the training arithmetic, the
model card, the saved config.json) is what the plain Trainer reports for the same global batch;
the degree tsp_size="auto" chose is said under run_clm.py's logging; packed batches
(DataCollatorWithFlattening: 4 float64 steps, every rank's losses, first gradients and weights
against the unmodified model run on each document alone); resuming from a checkpoint is exact,
and a LoRA run (a PeftModel) saved at tsp 2 resumes at tsp 4 with plain PEFT's steps and adapters;
a Qwen2 checkpoint (with biases) loads shard-on-read into a TSP model with the plain model's
logits; bf16=True (with and without gradient checkpointing) matches the plain Trainer in bf16 on
one process within bf16's bounds; torch_compile_backend="eager" compiles each decoder layer
and trains as eager TSP bit for bit; fp16=True and a torch_compile_mode are refused."""

from __future__ import annotations

import glob
import json
import os
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from tests.support import dist_pool, hf_models, launch, metrics_check, precision
from tests.support.reference import assert_close

JOB = os.path.join(launch.JOBS, "trainer_job.py")


def torchrun(*args: str, procs: int = 2) -> None:
    launch.run(launch.torchrun(procs, launch.EXIT_CLEANLY, JOB, *args), procs, timeout=400)


def full_run(out) -> list[dict]:
    """Every rank's logged values, final full weights and first gradients (each rank wrote its
    own: every data-parallel replica's are checked)."""
    runs = []
    for r in range(len(glob.glob(os.path.join(out, "rank*.json")))):
        with open(os.path.join(out, f"rank{r}.json")) as f:
            run = json.load(f)
        run["weights"] = torch.load(os.path.join(out, f"rank{r}_weights.pt"))
        run["grads0"] = torch.load(os.path.join(out, f"rank{r}_grads0.pt"))
        runs.append(run)
    return runs


def save(tmp_path_factory, kv_heads: int | None, family: str = "llama") -> str:
    path = str(tmp_path_factory.mktemp(f"{family}_kv{kv_heads}"))
    hf_models.build(family, torch.float32, kv_heads=kv_heads).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def saved_llama(tmp_path_factory) -> str:
    return save(tmp_path_factory, 2)


@pytest.fixture(scope="module")
def saved_mqa(tmp_path_factory) -> str:
    return save(tmp_path_factory, 1)


@pytest.fixture(scope="module")
def saved_qwen3(tmp_path_factory) -> str:
    return save(tmp_path_factory, None, "qwen3")


def common(model: str, out_dir) -> list[str]:
    return ["--model_path", model, "--max_steps", "4", "--per_device_train_batch_size", "2",
            "--learning_rate", "1e-3", "--logging_steps", "1", "--report_to", "none", "--use_cpu",
            "--seed", "0", "--output_dir", str(out_dir)]


# float64, plain SGD at a constant lr 0.5, clipping at 0.5 (the gradient norms are 1.4-2.3: it
# acts at every step), rows in order: each update is lr x clip x g/|g|, so the weights check the
# gradient's direction and the logged grad_norm its size; the first gradients are compared too
SGD = ["--dtype", "float64", "--optim", "sgd", "--learning_rate", "0.5", "--lr_scheduler_type",
       "constant", "--max_grad_norm", "0.5", "--train_sampling_strategy", "sequential",
       "--save_strategy", "no"]


def reference(kv_heads: int | None, dp: int, rows: int = 8, steps: int = 4,
              family: str = "llama") -> dict:
    """One process, float64, on the global batch of each step: the rows the data-parallel
    replicas took in turn (2 each, in order; the data repeat after ``rows``)."""
    data = torch.randint(0, 96, (rows, 24), generator=torch.Generator().manual_seed(5))
    data = torch.cat([data] * (steps * 2 * dp // rows + 1))
    batches = [data[2 * dp * k: 2 * dp * (k + 1)] for k in range(steps)]
    model = hf_models.build(family, torch.float64, kv_heads=kv_heads)
    ref = hf_models.sgd_reference(model, batches, lr=0.5, clip=0.5)
    with torch.no_grad():
        ref["eval_loss"] = hf_models.reference_loss(model, data[:4], data[:4]).item()
    return ref


def assert_every_rank(runs: list[dict], ref: dict, what: str) -> None:
    """The logged losses and grad_norm of every rank (the Trainer logs them on every rank),
    the gathered gradients and weights: norms to 1e-9 relative, the rest to 1e-8; the logged
    loss to 1e-7, because the Trainer sums it in a float32 tensor (for any model)."""
    assert min(ref["norms"]) > 0.5, f"clipping at 0.5 must act: {ref['norms']}"
    for r, run in enumerate(runs):
        hf_models.assert_matches_reference(run, ref, 1e-8, 1e-9, what=f"{what} rank {r}: ",
                                           loss_tol=1e-7)


def assert_offload_exact(runs: list[dict], ref: dict, what: str) -> None:
    """With ``tsp_activation_offload`` and gradient checkpointing every rank moved each decoder
    layer's input to the host and back at every step (on the CPU they stay in place, the same
    code path), and the losses ``compute_loss`` returned and the first step's gradients are
    the unmodified model's to 1e-10."""
    layers, steps = hf_models.COMMON["num_hidden_layers"], len(ref["losses"])
    for r, run in enumerate(runs):
        assert run["offload"] == {"offloaded": layers * steps, "brought_back": layers * steps,
                                  "prefetched": (layers - 1) * steps}, (what, r, run["offload"])
        hf_models.assert_matches_reference({"losses": run["exact_losses"],
                                            "grads0": run["grads0"]}, ref, 1e-10,
                                           what=f"{what} rank {r}: ", keys=("losses", "grads0"))


# what the Trainer derives from the number of processes, on every rank, and rank 0's model card
# fields that count processes or batches (the evaluation batch of 1 row makes the evaluation steps
# count: 4 rows are 4 steps on one replica, 2 on two)
FIGURES = ("total_flos", "training", "speed", "eval_batches", "max_steps", "epochs")
CARD = ("num_devices", "train_batch_size", "eval_batch_size", "total_train_batch_size",
        "total_eval_batch_size")
REPORTING = ["--per_device_eval_batch_size", "1", "--figures", "true"]
# the 4-process dp 2 x tsp 2 case, and the plain Trainer on 2 processes with the same arguments
DP2 = ("--rows 16 --eval_strategy steps --eval_steps 2 --save_strategy steps --save_steps 3 "
       + " ".join(REPORTING))


# DataCollatorWithFlattening: each step's 2 documents (of 15, 16 | 23, 31 | 3, 17 | 32, 12
# tokens) flattened into one row, position_ids restarting at 0 per document; evaluated on the
# first 4 documents in one row
PACKED = f"--packed true --num_docs {2 * 4}"
PACKED_DP2 = f"--packed true --num_docs {4 * 4}"  # dp 2: each step's 4 documents, 2 a replica
REBALANCE = "--train_sampling_strategy batch_rebalance"  # the Trainer's sampler splits by rank
# mixed precision as a GPU user runs it: float32 weights, bf16 autocast (Accelerate's wrappers
# around the model's forward), SGD's steps otherwise as above
BF16 = "--dtype float32 --bf16 true"
# a PeftModel (LoRA r 4, A and B random, seed 0) trained by AdamW (weight decay 0) at lr 1e-3
# decaying linearly over the 4 steps, clipped at 0.5 (the norms are 0.52-1.8: it acts at every
# step); "lora" (tsp 2) saves a checkpoint after step 2, which "lora_resumed" resumes at tsp 4
LORA = "--lora 4 --optim adamw_torch --learning_rate 1e-3 --lr_scheduler_type linear"
LORA_CHECKPOINT = os.path.join("o", "lora", "checkpoint-2")  # in two_processes' directory
# the Trainer's own defaults in float32 (AdamW, linear decay, clipping at 1.0, shuffled rows), SGD's
# overrides undone: "resume_full" saves a checkpoint after step 2, which "resumed" (a later case of
# the same launch, so the same degree) resumes
DEFAULTS = ("--dtype float32 --optim adamw_torch_fused --learning_rate 1e-3 --lr_scheduler_type "
            "linear --max_grad_norm 1.0 --train_sampling_strategy random")
RESUME_CHECKPOINT = os.path.join("o", "resume_full", "checkpoint-2")


@pytest.fixture(scope="module")
def two_processes(tmp_path_factory, saved_mqa, saved_llama) -> str:
    """One 2-process launch: TSPTrainer at tsp 2; the plain Trainer at dp 2 (what dp 2 x tsp 2
    must report); both again with batch_rebalance; tsp_size="auto" under run_clm.py's logging
    (planned for 24 tokens x 2 rows in 0.6 MB: 0.94 MB at D=1 does not fit 0.9 x 0.6 MB, 0.46 MB
    at D=2 does), one step; TSPTrainer given a plain TrainingArguments (the one switch);
    tsp_activation_offload with gradient checkpointing; bf16 (mixed precision), with and without
    gradient checkpointing; packed batches (DataCollatorWithFlattening, 2 documents a step); a
    PeftModel (LoRA) saving a checkpoint after step 2; a run with the Trainer's defaults saving a
    checkpoint after step 2, then resumed from it; torch_compile with the eager backend
    (last: it compiles)."""
    out = tmp_path_factory.mktemp("two_processes")
    proc = launch.run(launch.torchrun(2, launch.EXIT_CLEANLY, JOB, *common(saved_mqa, out / "o"),
                                      *SGD, "--out", str(out), "--case",
                                      "tsp2 --tsp_size 2 " + " ".join(REPORTING),
                                      f"plain_dp2 --plain true {DP2}",
                                      f"rebalance --tsp_size 2 {REBALANCE}",
                                      f"rebalance_plain_dp2 --plain true --rows 16 {REBALANCE}",
                                      "auto --tsp_size auto --tsp_seq_len 24 --tsp_memory_gb "
                                      "0.0006 --max_steps 1 --clm_logging true",
                                      "switch --plain_args true --ddp_timeout 123",
                                      "offload --tsp_size 2 --tsp_activation_offload true "
                                      "--gradient_checkpointing true",
                                      f"bf16 --tsp_size 2 {BF16}",
                                      f"bf16_gc --tsp_size 2 {BF16} --gradient_checkpointing "
                                      "true",
                                      f"packed --tsp_size 2 {PACKED}",
                                      f"lora --tsp_size 2 {LORA} --save_strategy steps "
                                      "--save_steps 2",
                                      f"resume_full --tsp_size 2 --model_path {saved_llama} "
                                      f"{DEFAULTS} --save_strategy steps --save_steps 2",
                                      f"resumed --tsp_size 2 --model_path {saved_llama} "
                                      f"{DEFAULTS} --resume {out / RESUME_CHECKPOINT}",
                                      "compiled --tsp_size 2 --torch_compile_backend eager"),
                      2, timeout=400)
    with open(out / "output.txt", "w") as f:
        f.write(proc.stdout + proc.stderr)
    return str(out)


@pytest.fixture(scope="module")
def one_process(tmp_path_factory, saved_mqa) -> str:
    """transformers' own Trainer on one process, with tsp2's, rebalance's and the bf16 cases'
    arguments."""
    out = tmp_path_factory.mktemp("one_process")
    launch.run([sys.executable, launch.EXIT_CLEANLY, JOB, *common(saved_mqa, out / "o"), *SGD,
                "--plain", "true", "--out", str(out), "--case", " ".join(["plain", *REPORTING]),
                f"rebalance {REBALANCE}", f"bf16 {BF16}",
                f"bf16_gc {BF16} --gradient_checkpointing true"], 1, timeout=400)
    return str(out)


def assert_losses_as_plain(runs: list[dict], plain: dict, what: str) -> None:
    """Every rank logged the plain Trainer's losses (its float32 logits: to 1e-6)."""
    assert len(plain["losses"]) == 4, plain
    for r, run in enumerate(runs):
        assert len(run["losses"]) == 4, (what, r, run["losses"])
        for step, (a, b) in enumerate(zip(run["losses"], plain["losses"])):
            assert abs(a - b) <= 1e-6 * b, f"{what} rank {r}, step {step}: loss {a} vs {b}"


def assert_same_batches(runs: list[dict], ref: dict, what: str) -> None:
    """The plain Trainer trained on the reference's global batches: its loss casts the logits to
    float32, also for a float64 model, so it agrees with the float64 reference to ~1e-8 only."""
    for r, run in enumerate(runs):
        hf_models.assert_matches_reference(run, ref, 1e-6, what=f"{what} rank {r}: ")


def assert_reports_as_plain(runs: list[dict], plain: dict, what: str) -> None:
    """Every rank's figures are the plain Trainer's (rank 0's); rank 0's model card fields and
    saved config.json, field by field."""
    want = plain["figures"]
    for r, run in enumerate(runs):
        got = run["figures"]
        for key in FIGURES:
            assert got[key] == want[key], f"{what} rank {r}: {key} {got[key]} != {want[key]}"
    got = runs[0]["figures"]
    for key in CARD:
        card, plain_card = got["model_card"].get(key), want["model_card"].get(key)
        assert card == plain_card, f"{what}: model card {key}: {card} != {plain_card}"
    for key in sorted(set(got["config"]) | set(want["config"])):
        assert got["config"].get(key) == want["config"].get(key), \
            f"{what}: config.json {key}: {got['config'].get(key)} != {want['config'].get(key)}"


def test_tsp_trainer_matches_one_process(two_processes, one_process):
    # tsp 2 with 1 key/value head: each rank holds half of its rows
    runs = full_run(os.path.join(two_processes, "tsp2"))
    assert len(runs) == 2
    ref = reference(kv_heads=1, dp=1)
    assert_every_rank(runs, ref, "tsp 2, 1 kv head")
    for run in runs:
        assert abs(run["eval_loss"] - ref["eval_loss"]) <= 1e-8 * ref["eval_loss"], run
    plain = full_run(os.path.join(one_process, "plain"))
    assert_same_batches(plain, ref, "the plain Trainer, one process")
    assert_reports_as_plain(runs, plain[0], "tsp 2 against one process")
    # batch_rebalance: the TSP group shares the replica's rows (else the batch check raises)
    rebalanced = full_run(os.path.join(one_process, "rebalance"))[0]
    assert_losses_as_plain(full_run(os.path.join(two_processes, "rebalance")), rebalanced,
                           "batch_rebalance, tsp 2")
    sequential = ref["losses"]
    assert any(abs(a - b) > 1e-4 for a, b in zip(rebalanced["losses"], sequential)), \
        ("batch_rebalance must take other rows than the sequential order", sequential)
    # the one switch: Trainer replaced by TSPTrainer, the arguments a plain TrainingArguments
    # (no tsp_size): TSP over every process of the node, one process's losses and weights
    switch = full_run(os.path.join(two_processes, "switch"))
    assert [run["tsp_size"] for run in runs + switch] == [2, 2, 2, 2], "the TSP degree"
    # the Trainer's ddp_timeout reaches every process group of the mesh it builds
    assert [run["mesh_timeouts"] for run in runs + switch] == \
        [{"dp": 1800.0, "tsp": 1800.0}] * 2 + [{"dp": 123.0, "tsp": 123.0}] * 2, "ddp_timeout"
    assert_every_rank(switch, ref, "TSPTrainer(args=TrainingArguments(...)), 2 processes")
    # TSPTrainingArguments(tsp_activation_offload=True, gradient_checkpointing=True)
    offload = full_run(os.path.join(two_processes, "offload"))
    assert_offload_exact(offload, ref, "tsp_activation_offload")
    assert_every_rank(offload, ref, "tsp_activation_offload")


def test_bf16_matches_one_process_in_bf16(two_processes, one_process):
    # TrainingArguments(bf16=True), the way every GPU user trains (Accelerate sets autocast and
    # convert_outputs_to_fp32 around the model's forward, which the bypass guard must see
    # through), with and without gradient checkpointing, at tsp 2 against the plain Trainer
    # with the same arguments on one process: every rank's logged losses and grad_norm, the
    # first gradients, the weights after 4 clipped SGD steps and eval_loss within bf16's bounds
    # (tests/support/precision.py); and bf16 really ran (first gradients >= 0.1 u from float64's)
    exact = reference(kv_heads=1, dp=1)
    init = hf_models.build("llama", torch.float32, kv_heads=1).state_dict()
    for name in ("bf16", "bf16_gc"):
        (plain,) = full_run(os.path.join(one_process, name))
        precision.assert_within_bf16(plain, exact, init, f"{name}, one process")
        runs = full_run(os.path.join(two_processes, name))
        assert len(runs) == 2, name
        for r, run in enumerate(runs):
            precision.assert_within_bf16(run, plain, init, f"{name}, tsp 2, rank {r}",
                                         exact=exact)
            assert abs(run["eval_loss"] - plain["eval_loss"]) <= 2 * precision.G * \
                plain["eval_loss"], (name, r, run["eval_loss"], plain["eval_loss"])
        assert {w.dtype for w in runs[0]["weights"].values()} == {torch.float32}, name
        print(f"{name}: " + precision.summary(runs[0], plain, init, exact))


def test_torch_compile_compiles_each_decoder_layer(two_processes):
    # TrainingArguments(torch_compile_backend="eager") at tsp 2, float64, 4 clipped SGD
    # steps: on every rank each decoder layer was compiled (compile_layers' mark) with no graph
    # break, the model the Trainer trained was the TSP model itself (not an OptimizedModule:
    # no whole-model compile by the Trainer or Accelerate), and the losses compute_loss returned,
    # the first gradients and the final weights are eager TSP's (the tsp2 case) bit for bit,
    # and the unmodified model's on one process to 1e-8
    eager = full_run(os.path.join(two_processes, "tsp2"))
    runs = full_run(os.path.join(two_processes, "compiled"))
    assert len(runs) == 2
    for r, (run, ref) in enumerate(zip(runs, eager)):
        assert run["compiled"] == {"layers": [True, True], "classes": ["TSPLlamaForCausalLM"],
                                   "breaks": {}}, (r, run["compiled"])
        assert run["exact_losses"] == ref["exact_losses"], (r, run["exact_losses"],
                                                            ref["exact_losses"])
        for key in ("grads0", "weights"):
            for name, t in ref[key].items():
                assert torch.equal(run[key][name], t), f"rank {r}: {key} {name} differs"
    assert_every_rank(runs, reference(kv_heads=1, dp=1), "torch_compile, tsp 2")


def test_auto_choice_is_said_under_run_clm_logging(two_processes):
    # run_clm.py leaves the root logger at WARNING with a handler on stdout: the choice is said
    # there, once (rank 0), and the first log row carries the degree on every rank
    with open(os.path.join(two_processes, "output.txt")) as f:
        output = f.read()
    said = [line for line in output.splitlines() if "tsp_size='auto' chose D=2" in line]
    assert len(said) == 1 and "WARNING - tsp_core.auto - " in said[0], said or output[-3000:]
    for r, run in enumerate(full_run(os.path.join(two_processes, "auto"))):
        assert run["first_row"].get("tsp_size") == 2, (r, run["first_row"])


@pytest.fixture(scope="module")
def four_processes(tmp_path_factory, saved_mqa, saved_llama, saved_qwen3, two_processes) -> str:
    """One torchrun launch of 4 processes, eight Trainer runs: dp 2 x tsp 2 (each data-parallel
    replica its own rows) with 1 key/value head, reporting what the plain Trainer on 2
    processes reports, and again with batch_rebalance; tsp 4 with 1 and with 2, a Qwen3
    (per-head q/k norms, head_dim 24, biases, a sliding layer) at tsp 4, packed rows at
    dp 2 x tsp 2 (DataCollatorWithFlattening: each replica flattens its 2 documents), the LoRA
    run two_processes saved at tsp 2 resumed from its step-2 checkpoint at tsp 4, and (last:
    Accelerate's state stays FSDP for the process) FSDP2 dp_shard 2 x tsp 2 from
    TSPTrainingArguments(fsdp="full_shard", fsdp_config={"fsdp_version": 2}), evaluated before
    training too (the Trainer then prepares the model without its optimizer), with 2
    accumulated micro-batches of 1 row per step (FSDP2's gradient sync off for the first:
    Accelerate's no_sync) for dp2's batches."""
    out = tmp_path_factory.mktemp("four_processes")
    checkpoint = os.path.join(two_processes, LORA_CHECKPOINT)
    torchrun(*common(saved_mqa, out / "o"), *SGD, "--out", str(out), "--case",
             # TSP's logged figures, with an evaluation after step 2 and a checkpoint after
             # step 3 that must not count
             f"dp2 --tsp_size 2 {DP2}",
             f"rebalance_dp2 --tsp_size 2 --rows 16 {REBALANCE}",
             "tsp4_kv1 --tsp_size 4",
             f"tsp4_kv2 --tsp_size 4 --model_path {saved_llama} --tsp_metrics false",
             f"qwen3 --tsp_size 4 --model_path {saved_qwen3}",
             f"packed_dp2 --tsp_size 2 {PACKED_DP2}",
             f"lora_resumed --tsp_size 4 {LORA} --resume {checkpoint}",
             "fsdp --tsp_size 2 --rows 16 --fsdp full_shard --fsdp_config "
             "'{\"fsdp_version\": 2}' --eval_first true --per_device_train_batch_size 1 "
             "--gradient_accumulation_steps 2", procs=4)
    return str(out)


def test_data_parallel_and_tsp4_match_one_process(four_processes, two_processes):
    tmp_path = Path(four_processes)
    from tests.jobs.trainer_job import packed_documents

    dp2 = reference(kv_heads=1, dp=2, rows=16)
    packed = packed_reference(packed_documents(96, 16), steps=4, per_step=4)
    cases = {"dp2": dp2, "tsp4_kv1": reference(kv_heads=1, dp=1),
             "tsp4_kv2": reference(kv_heads=2, dp=1),
             "qwen3": reference(kv_heads=None, dp=1, family="qwen3"), "fsdp": dp2,
             "packed_dp2": packed}
    for name, ref in cases.items():
        runs = full_run(tmp_path / name)
        assert len(runs) == 4, name
        assert_every_rank(runs, ref, name)
    for r, run in enumerate(full_run(tmp_path / "packed_dp2")):
        assert abs(run["eval_loss"] - packed["eval_loss"]) <= 1e-8 * packed["eval_loss"], \
            f"packed rows at dp 2 x tsp 2, rank {r}: {run['eval_loss']} vs {packed['eval_loss']}"
    # FSDP2: each rank holds 1/(tsp x dp_shard) = 1/4 of the model (the norms, which TSP
    # replicates and FSDP2 halves, add 0.4%), in TSP's units (each decoder layer and the root);
    # eval_loss before and after training is one process's
    data = torch.randint(0, 96, (16, 24), generator=torch.Generator().manual_seed(5))[:4]
    with torch.no_grad():
        loss0 = hf_models.reference_loss(hf_models.build("llama", torch.float64, kv_heads=1),
                                         data, data).item()
    for r, run in enumerate(full_run(tmp_path / "fsdp")):
        fsdp = run["fsdp"]
        floor = fsdp["full"] / 4
        assert floor <= fsdp["storage"] <= 1.01 * floor, (r, fsdp)
        assert fsdp["units"] == 3 and fsdp["reshard"] == [True, True], (r, fsdp)
        for key, want in (("eval_loss0", loss0), ("eval_loss", dp2["eval_loss"])):
            assert abs(run[key] - want) <= 1e-8 * want, (r, key, run[key], want)
    assert all("fsdp" not in run for run in full_run(tmp_path / "dp2"))
    # what dp 2 x tsp 2 reports is what the plain Trainer on 2 processes reports
    plain = full_run(os.path.join(two_processes, "plain_dp2"))
    assert_same_batches(plain, dp2, "the plain Trainer, dp 2")
    assert_reports_as_plain(full_run(tmp_path / "dp2"), plain[0], "dp 2 x tsp 2 against dp 2")
    # batch_rebalance: each replica its own share of the rows, as each plain rank
    assert_losses_as_plain(full_run(tmp_path / "rebalance_dp2"),
                           full_run(os.path.join(two_processes, "rebalance_plain_dp2"))[0],
                           "batch_rebalance, dp 2 x tsp 2")
    for r, run in enumerate(full_run(tmp_path / "dp2")):
        assert len(run["metric_rows"]) == 4, run["metric_rows"]
        metrics_check.assert_windows(run["metric_rows"], run["step_counts"], 2, f"rank {r}")
    for r, run in enumerate(full_run(tmp_path / "tsp4_kv1")):  # logged, and the same way
        metrics_check.assert_windows(run["metric_rows"], run["step_counts"], 1, f"tsp 4 rank {r}")
    for r, run in enumerate(full_run(tmp_path / "tsp4_kv2")):  # tsp_metrics false: no tsp/* keys
        assert run["metric_rows"] == [], (f"tsp_metrics false, rank {r}", run["metric_rows"][:1])


def document_loss(model, docs: list[list[int]]) -> tuple[torch.Tensor, int]:
    """The summed float64 cross-entropy of the unmodified model run on each document alone (HF's
    model on the flattened row would let them attend to each other) and the tokens scored."""
    import torch.nn.functional as F

    total, count = 0.0, 0
    for d in docs:
        t = torch.tensor(d)[None]
        total = total + F.cross_entropy(model(input_ids=t).logits[0, :-1], t[0, 1:],
                                        reduction="sum")
        count += len(d) - 1
    return total, count


def packed_reference(docs: list[list[int]], steps: int, per_step: int) -> dict:
    """One process, float64, SGD's arguments: each step's documents (in order) scored alone, the
    loss their tokens' mean (the Trainer's count of the flattened row's labels), clipped plain
    SGD; the evaluation loss over the first 4 documents after training."""
    model = hf_models.build("llama", torch.float64, kv_heads=1)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    out: dict = {"losses": [], "norms": [], "grads0": None}
    for step in range(steps):
        total, count = document_loss(model, docs[per_step * step: per_step * (step + 1)])
        (total / count).backward()
        if out["grads0"] is None:
            out["grads0"] = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
        out["norms"].append(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5).item())
        opt.step()
        opt.zero_grad()
        out["losses"].append((total / count).item())
    out["weights"] = {k: v.detach().clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        total, count = document_loss(model, docs[:4])
    out["eval_loss"] = (total / count).item()
    return out


def test_packed_batches_with_data_collator_with_flattening(two_processes):
    # 4 float64 steps of clipped SGD on packed rows at tsp 2: every rank's logged losses and
    # grad_norm, first gradients and final weights, and eval_loss, against the unmodified model
    # run on each document alone (a backward-only error on packed rows shows in the gradients)
    from tests.jobs.trainer_job import packed_documents

    docs = packed_documents(96, 8)
    assert [len(d) for d in docs] == [15, 16, 23, 31, 3, 17, 32, 12], [len(d) for d in docs]
    ref = packed_reference(docs, steps=4, per_step=2)
    runs = full_run(os.path.join(two_processes, "packed"))
    assert len(runs) == 2
    assert_every_rank(runs, ref, "packed rows, tsp 2")
    for r, run in enumerate(runs):
        assert abs(run["eval_loss"] - ref["eval_loss"]) <= 1e-8 * ref["eval_loss"], \
            f"packed rows, rank {r}: eval_loss {run['eval_loss']} vs {ref['eval_loss']}"


def test_resume_from_checkpoint_is_exact(two_processes):
    # the Trainer's defaults (float32 AdamW) at tsp 2, resumed at tsp 2 from checkpoint-2: every
    # rank's steps 3-4 and final weights bit for bit
    checkpoint = Path(two_processes) / RESUME_CHECKPOINT
    assert (checkpoint / "model.safetensors").exists() and (checkpoint / "optimizer_dcp").is_dir()
    full = full_run(os.path.join(two_processes, "resume_full"))
    resumed = full_run(os.path.join(two_processes, "resumed"))
    assert len(full) == len(resumed) == 2
    for r, (a, b) in enumerate(zip(full, resumed)):  # every rank's losses and final weights
        assert len(a["losses"]) == 4 and b["losses"] == a["losses"][2:], \
            (r, a["losses"], b["losses"])
        assert sorted(b["weights"]) == sorted(a["weights"]), r
        for name, t in a["weights"].items():
            assert torch.equal(b["weights"][name], t), (r, name)


class LinearDecayAdamW(torch.optim.AdamW):
    """AdamW as the Trainer builds it for ``--optim adamw_torch`` (weight decay 0), its lr
    decayed linearly to 0 over the 4 steps as ``--lr_scheduler_type linear`` decays it."""

    def __init__(self, params, lr: float) -> None:
        super().__init__(params, lr=lr, weight_decay=0.0)
        self.first_lr, self.taken = lr, 0

    def step(self, closure=None):
        for group in self.param_groups:
            group["lr"] = self.first_lr * (1 - self.taken / 4)
        self.taken += 1
        return super().step(closure)


def lora_reference() -> dict:
    """Plain PEFT on one process, float64: the saved Llama (1 key/value head) as the job's
    PeftModel (``hf_models.lora_model``, r 4, seed 0), :class:`LinearDecayAdamW` clipped at 0.5,
    2 rows a step in order; the weights kept are the adapters'."""
    data = torch.randint(0, 96, (8, 24), generator=torch.Generator().manual_seed(5))
    model = hf_models.lora_model(hf_models.build("llama", torch.float64, kv_heads=1), 4, seed=0)
    ref = hf_models.sgd_reference(model, list(data.split(2)), lr=1e-3, clip=0.5,
                                  optimizer=LinearDecayAdamW)
    ref["weights"] = {k: v for k, v in ref["weights"].items() if "lora_" in k}
    return ref


def test_lora_run_resumes_at_another_degree_exactly(two_processes, four_processes):
    """A PeftModel's checkpoint holds PEFT's adapter files and the optimizer, no
    model.safetensors; TSPTrainer resumes it as the Trainer resumes one (the adapter file into
    the active adapter), here at tsp 4 from the step-2 checkpoint of a tsp 2 run. Against plain
    PEFT on one process in float64, on every rank: the tsp 2 run's losses, gradient norms,
    first adapter gradients and final adapters, and the resumed run's steps 3 and 4 (losses,
    norms) and final adapters, to 1e-10 (the optimizer's moments and the lr schedule resumed
    too: AdamW from fresh moments, or the lr of step 1, would move the adapters otherwise)."""
    ref = lora_reference()
    assert min(ref["norms"]) > 0.5 and len(ref["weights"]) == 28, (ref["norms"], ref["weights"])
    checkpoint = Path(two_processes) / LORA_CHECKPOINT
    assert (checkpoint / "adapter_model.safetensors").is_file() and \
        not (checkpoint / "model.safetensors").exists(), sorted(os.listdir(checkpoint))
    full = full_run(os.path.join(two_processes, "lora"))
    assert len(full) == 2
    for r, run in enumerate(full):
        hf_models.assert_matches_reference({**run, "losses": run["exact_losses"]}, ref, 1e-10,
                                           what=f"LoRA at tsp 2, rank {r}: ")
    resumed = full_run(os.path.join(four_processes, "lora_resumed"))
    assert len(resumed) == 4
    steps_3_4 = {**ref, "losses": ref["losses"][2:], "norms": ref["norms"][2:]}
    for r, run in enumerate(resumed):
        assert run["tsp_size"] == 4, (r, run["tsp_size"])
        hf_models.assert_matches_reference({**run, "losses": run["exact_losses"]}, steps_3_4,
                                           1e-10, what=f"LoRA resumed at tsp 4, rank {r}: ",
                                           keys=("losses", "norms", "weights"))


def shard_on_read(tsp: int, path: str) -> int:
    from transformers import AutoModelForCausalLM

    from tsp_core import shard_batch
    from tsp_core.sequence.layout import shard_sequence
    from tsp_transformers import load_pretrained

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


def flops_parameters(tsp: int, families: tuple[str, ...]) -> list[tuple[str, int, int]]:
    """(family, TSPTrainer's count on the converted model, Hugging Face's on the unmodified)."""
    import tsp_core
    from tsp_transformers.trainer import non_embedding_parameters

    out = []
    for family in families:
        model = hf_models.build(family, torch.float32)
        want = model.num_parameters(exclude_embeddings=True)
        assert non_embedding_parameters(model) == want, family
        tsp_core.parallelize(model, dist_pool.mesh(tsp))
        out.append((family, non_embedding_parameters(model), want))
    return out


@pytest.mark.parametrize("tsp", [2, 4])
def test_flops_count_the_unmodified_models_parameters(pool, tsp):
    # total_flos counts Hugging Face's non-embedding parameters: full shapes, not shards or
    # vocabulary padding (llama-tied: 101 rows, tied to the head), fused tensors whole (phi3)
    families = ("llama", "llama-tied", "qwen2", "phi3")
    for rank in pool.run(flops_parameters, tsp, families):
        for family, got, want in rank:
            assert got == want, f"tsp {tsp}, {family}: {got} != {want}"


def test_fsdp_options_tsp_cannot_honour_are_refused(monkeypatch, tmp_path):
    # TSPTrainer refuses, naming the fix and the numbers, before any collective (on a fake
    # 4-process world: TrainingArguments itself sets up the process group)
    from accelerate.state import AcceleratorState
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from tsp_transformers import TSPTrainer, TSPTrainingArguments

    for key, value in (("WORLD_SIZE", "4"), ("LOCAL_WORLD_SIZE", "4"), ("RANK", "0"),
                       ("LOCAL_RANK", "0"), ("FSDP_CPU_RAM_EFFICIENT_LOADING", "false")):
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("ACCELERATE_USE_FSDP", raising=False)
    cases = [("full_shard", {"fsdp_version": 1}, 2, "FSDP2 only, not fsdp_version=1"),
             ("full_shard offload", {"fsdp_version": 2}, 2, "fsdp='offload'"),
             ("full_shard", {"fsdp_version": 2, "cpu_ram_efficient_loading": True}, 2,
              "cpu_ram_efficient_loading"),
             ("full_shard", {"fsdp_version": 2, "activation_checkpointing": True}, 2,
              "activation_checkpointing"),
             ("full_shard", {"fsdp_version": 2}, 4,
              r"tsp_size \(4\) x dp_replicate_size \(1\) takes all 4 processes \(dp_shard 1\)")]
    dist.init_process_group("fake", rank=0, world_size=4, store=FakeStore())
    try:
        for fsdp, config, tsp, words in cases:
            args = TSPTrainingArguments(output_dir=str(tmp_path), tsp_size=tsp, fsdp=fsdp,
                                        fsdp_config=config, use_cpu=True, report_to="none")
            with pytest.raises(ValueError, match=words):
                TSPTrainer(model=hf_models.build("llama", torch.float32), args=args)
    finally:
        dist.destroy_process_group()
        AcceleratorState._reset_state(True)


def test_older_transformers_is_refused(monkeypatch, tmp_path):
    """Under an older transformers the Trainer counts every process as a replica (measured with
    5.17.0: total_train_batch_size 4 instead of 2 at tsp 2, the evaluation loss halved), so
    TSPTrainer refuses it, naming both versions, before any process group (tsp_size 1 stays the
    plain Trainer, which needs nothing of TSP)."""
    import transformers

    from tsp_transformers import TSPTrainer, TSPTrainingArguments
    from tsp_transformers.trainer import MIN_TRANSFORMERS, require_transformers

    require_transformers(MIN_TRANSFORMERS)
    with pytest.raises(RuntimeError, match=rf"needs transformers >= {MIN_TRANSFORMERS}; this is "
                                           r"transformers 5\.17\.0"):
        require_transformers("5.17.0")
    args = TSPTrainingArguments(output_dir=str(tmp_path), tsp_size=2, use_cpu=True,
                                report_to="none")
    for key, value in (("WORLD_SIZE", "2"), ("LOCAL_WORLD_SIZE", "2"), ("RANK", "0"),
                       ("LOCAL_RANK", "0")):  # as torchrun's first rank sees it
        monkeypatch.setenv(key, value)
    monkeypatch.setattr(transformers, "__version__", "5.17.0")
    with pytest.raises(RuntimeError, match="transformers 5.17.0"):
        TSPTrainer(model=hf_models.build("llama", torch.float32), args=args)
    assert not dist.is_initialized(), "refused after starting a process group"


# Arguments TSPTrainer refuses before any process group, on the first rank of a 2-process launch:
# - average_tokens_across_devices=False made the loss, grad_norm and eval_loss tsp_size x dp_size
#   too large (measured at tsp 2 in float64: training loss 9.1085 against 4.5543, grad_norm 4.353
#   against 2.176, eval_loss 8.533 against 4.267; tsp_trl.TSPSFTTrainer supports it:
#   tests/integrations/test_trl.py);
# - fp16=True on the CPU: the plain Trainer accepts it and trains in float32 (Accelerate runs no
#   fp16 autocast and no GradScaler there; measured: the losses equal float32's to the last bit)
REFUSED_ARGUMENTS = [
    ({"average_tokens_across_devices": False},
     r"average_tokens_across_devices=False is not supported with tsp_size 2"),
    ({"fp16": True}, r"TSPTrainer: fp16 mixed precision on the CPU would train in float32.* Use "
                     r"bf16"),
    # a compile mode: TSP compiles each decoder layer with torch.compile's default mode
    ({"torch_compile_mode": "max-autotune"},
     r"TSPTrainer compiles each decoder layer with tsp_core.parallelize\(\.\.\., "
     r"compile='inductor'\), which cannot honour mode='max-autotune' \(the Trainer's "
     r"torch_compile_mode"),
]


@pytest.mark.parametrize("arguments, words", REFUSED_ARGUMENTS)
def test_arguments_tsp_cannot_honour_are_refused(monkeypatch, tmp_path, arguments, words):
    from tsp_transformers import TSPTrainer, TSPTrainingArguments

    args = TSPTrainingArguments(output_dir=str(tmp_path), tsp_size=2, use_cpu=True,
                                report_to="none", **arguments)
    for key, value in (("WORLD_SIZE", "2"), ("LOCAL_WORLD_SIZE", "2"), ("RANK", "0"),
                       ("LOCAL_RANK", "0")):  # as torchrun's first rank sees it
        monkeypatch.setenv(key, value)
    with pytest.raises(ValueError, match=words):
        TSPTrainer(model=hf_models.build("llama", torch.float32), args=args)
    assert not dist.is_initialized(), "refused after starting a process group"


def test_unset_tsp_size_is_every_process_of_a_node(monkeypatch, tmp_path):
    """TSPTrainer's degree follows the other adapters' rule: tsp_size, else TSP_SIZE, else every
    process of a node; a plain TrainingArguments (or TRL's SFTConfig) becomes TSP's class with
    every field kept and TSP's at their defaults; another arguments class is refused with the
    class to compose. No process group starts."""
    from transformers import TrainingArguments
    from trl import SFTConfig

    from tsp_transformers.trainer import (
        TSPTrainingArguments,
        requested_tsp_size,
        resolve_tsp_size,
        with_tsp_fields,
    )
    from tsp_trl import TSPSFTConfig
    from tsp_trl.sft import check_model_object

    for key in ("TSP_SIZE", "ACCELERATE_USE_PARALLELISM_CONFIG", "WORLD_SIZE"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")  # a node's processes (as torchrun sets it)
    out = str(tmp_path)
    args = TSPTrainingArguments(output_dir=out, use_cpu=True)
    assert args.tsp_size is None
    choice = resolve_tsp_size(args, None)
    assert (choice.size, choice.reason) == (4, "tsp_size unset: every process of a node (4)")
    plain = TrainingArguments(output_dir=out, use_cpu=True, learning_rate=0.5, optim="sgd",
                              lr_scheduler_type="constant", max_grad_norm=0.5,
                              report_to="none", seed=3)
    converted = with_tsp_fields(plain, TSPTrainingArguments)
    assert type(converted) is TSPTrainingArguments and converted.tsp_size is None
    want = {**plain.to_dict(), "tsp_size": None, "tsp_seq_len": None, "tsp_memory_gb": None,
            "tsp_metrics": True, "tsp_tile_tokens": None, "tsp_activation_offload": False}
    assert converted.to_dict() == want
    assert resolve_tsp_size(converted, None).size == requested_tsp_size(plain) == 4
    with pytest.raises(ValueError, match=r"TSPSFTTrainer with tsp_size=4 converts the model"):
        check_model_object("some/model", plain, "TSPSFTTrainer")
    monkeypatch.setenv("TSP_SIZE", "2")
    assert resolve_tsp_size(converted, None).size == requested_tsp_size(plain) == 2
    assert resolve_tsp_size(TSPTrainingArguments(output_dir=out, use_cpu=True, tsp_size=1),
                            None).size == 1
    monkeypatch.setenv("TSP_SIZE", "1")
    check_model_object("some/model", plain, "TSPSFTTrainer")  # no TSP: a path is fine
    sft = with_tsp_fields(SFTConfig(output_dir=out, use_cpu=True), TSPSFTConfig)
    assert type(sft) is TSPSFTConfig and (sft.learning_rate, sft.tsp_size) == (2e-5, None)
    # no arguments at all: TRL's own default (<model name>-SFT), still with TSP's defaults.
    # TRL's configs default to bf16, which TrainingArguments refuses without a GPU: as on one
    import transformers.training_args

    from tsp_trl import TSPDPOConfig, TSPDPOTrainer, TSPSFTTrainer
    from tsp_trl.sft import default_config
    monkeypatch.setattr(transformers.training_args, "is_torch_bf16_gpu_available", lambda: True)
    for cls, suffix in ((TSPSFTConfig, "SFT"), (TSPDPOConfig, "DPO")):
        made = default_config("org/some-model", cls, suffix)
        assert type(made) is cls and made.output_dir == f"some-model-{suffix}"
        assert resolve_tsp_size(made, None).size == 1  # TSP_SIZE=1 above
    monkeypatch.setenv("TSP_SIZE", "2")
    for trainer in (TSPSFTTrainer, TSPDPOTrainer):
        with pytest.raises(ValueError, match=rf"{trainer.__name__} with tsp_size=2 converts"):
            trainer("org/some-model")

    class MyArgs(TrainingArguments):
        pass

    with pytest.raises(TypeError, match=r"got MyArgs; .*@dataclass class MyArgs\(MyArgs, "
                                        r"TSPTrainingArguments\)"):
        with_tsp_fields(MyArgs(output_dir=out, use_cpu=True), TSPTrainingArguments)
    assert not dist.is_initialized()


def converted_model_keeps_its_degree(out: str) -> None:
    """A model parallelize already converted (load_pretrained does) keeps its mesh: its degree
    is the choice, whatever the node's process count; a tsp_size or TSP_SIZE that differs is
    refused, naming both."""
    import tsp_core
    from tsp_transformers.trainer import TSPTrainingArguments, resolve_tsp_size

    model = tsp_core.parallelize(hf_models.build("llama", torch.float32), dist_pool.mesh(2))
    saved = {k: os.environ.get(k) for k in ("LOCAL_WORLD_SIZE", "TSP_SIZE")}
    try:
        os.environ["LOCAL_WORLD_SIZE"] = "4"
        os.environ.pop("TSP_SIZE", None)
        args = TSPTrainingArguments(output_dir=out, use_cpu=True, report_to="none")
        choice = resolve_tsp_size(args, model)
        assert (choice.size, choice.reason) == (2, "the model was converted with tsp_size 2")
        args.tsp_size = 4
        with pytest.raises(ValueError, match=r"tsp_size \(4\) differs from the TSP degree \(2\)"):
            resolve_tsp_size(args, model)
        args.tsp_size = None
        os.environ["TSP_SIZE"] = "1"
        with pytest.raises(ValueError, match=r"tsp_size \(1\) differs from the TSP degree \(2\)"):
            resolve_tsp_size(args, model)
    finally:
        for k, v in saved.items():
            os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)
    dist.barrier()


def test_a_converted_model_keeps_its_degree(pools, tmp_path):
    pools.of(2).run(converted_model_keeps_its_degree, str(tmp_path))


def adapter_checkpoint_refusals(out: str) -> None:
    """TSPTrainer's resume of a PeftModel (``peft_resume.adapter_loader``) refuses, on every rank
    with no collective, an adapter file of another rank r (naming the shapes) and a directory
    without adapter files or model.safetensors; a file of this model's shapes loads."""
    import tsp_core
    from tsp_core.models.lora import adapter_state_dict
    from tsp_transformers.peft_resume import adapter_loader

    model = tsp_core.parallelize(hf_models.lora_model(hf_models.build("llama", torch.float64),
                                                      4, seed=0), dist_pool.mesh(2))
    other_r, same = os.path.join(out, "r2"), os.path.join(out, "r4")
    if dist.get_rank() == 0:
        hf_models.lora_model(hf_models.build("llama", torch.float64), 2).save_pretrained(other_r)
        hf_models.lora_model(hf_models.build("llama", torch.float64), 4, seed=3).save_pretrained(
            same)
        os.makedirs(os.path.join(out, "empty"))
    dist.barrier()
    with tsp_core.comm.track() as stats:
        with pytest.raises(ValueError, match=r"r2/adapter_model.safetensors does not match this "
                           r"PeftModel's adapter 'default': .*lora_A.weight has shape \(2, 64\) "
                           r"in the file, \(4, 64\) here"):
            adapter_loader(model, other_r)
        with pytest.raises(FileNotFoundError, match="holds neither model.safetensors nor PEFT's "
                                                    "adapter_model.safetensors"):
            adapter_loader(model, os.path.join(out, "empty"))
        adapter_loader(model, same)()
    assert dict(stats.calls) == {}, stats.calls
    want = hf_models.lora_model(hf_models.build("llama", torch.float64), 4, seed=3)
    got = adapter_state_dict(model)
    for name, t in want.named_parameters():
        if "lora_" in name:
            assert torch.equal(got[name], t), name
    dist.barrier()


def test_adapter_checkpoint_refusals(pools, tmp_path):
    pools.of(2).run(adapter_checkpoint_refusals, str(tmp_path))
