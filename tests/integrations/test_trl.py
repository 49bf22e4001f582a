"""TRL under TSP (tsp_trl): ``TSPSFTConfig`` keeps SFTConfig's defaults in either composition order;
``TSPSFTTrainer`` at tsp 2 matches TRL's own ``SFTTrainer`` on one process on the same global batch
(plain SGD at a constant lr, clipping acting at every step): the loss per step, grad_norm,
``mean_token_accuracy``, ``entropy``, ``num_tokens``, and every rank's first gradients and final
weights (each data-parallel replica's own), on padded rows,
completion-only rows (labels -100 on the prompt, and a prompt/completion dataset TRL masks itself)
and TRL's padding-free packed rows, with gradient accumulation, at dp 2 x tsp 2 on padded,
prompt/completion and packed rows, and in float64 against the math itself (grad_norm, entropy and
weights to 1e-10); ``trainer.evaluate()`` at tsp 2 and dp 2 x tsp 2 matches one process's (at
dp 2 x tsp 2 the entropy and token accuracy, per step over the global batch with the repeated
row ignored, the math's in float64). With
``average_tokens_across_devices=False`` it matches one process at tsp 2 and, at dp 2 x tsp 2, TRL's
own SFTTrainer under DDP on 2 replicas (each replica's loss its own tokens' mean). With TRL's
own precision defaults (bf16=True, gradient_checkpointing=True) TSPSFTTrainer and TSPDPOTrainer
at tsp 2 match SFTTrainer and DPOTrainer with those defaults on one process within bf16's
bounds.
``TSPDPOTrainer`` (its reference model a TSP model too) at tsp 2 and dp 2 x tsp 2 matches
``DPOTrainer`` on one process: the loss, rewards (chosen, rejected, margins, accuracies),
log-probs, mean logits, entropy, token accuracy and count per step, grad_norm, the first
gradients and the final weights; its ``evaluate()`` at tsp 2 matches ``DPOTrainer.evaluate()`` on
one process (the loss, rewards, log-probs, mean logits, entropy, token accuracy and count), and
at dp 2 x tsp 2 DPOTrainer's under DDP on 2 replicas. The natural composition
``class (TSPTrainer, SFTTrainer)`` refuses on every rank, naming the class and the supported
trainers, before any step, and so does TSPTrainer mixed into a Trainer whose loss does not come
from the TSP model's forward."""

from __future__ import annotations

import dataclasses
import json
import os
import sys

import pytest
import torch

pytest.importorskip("trl")

from tests.support import hf_models, launch, precision  # noqa: E402
from tests.support.reference import assert_close  # noqa: E402

JOB = os.path.join(launch.JOBS, "trl_job.py")
STEPS = 3
# float32; SGD at a constant lr 0.5 with clipping at 0.5 (the gradient norms are 1.6-2.1: it
# acts at every step), rows in order, 4 rows a step: each update is lr x clip x g/|g|, so the
# weights check the gradient's direction and grad_norm its size (AdamW would hide a scale error)
COMMON = ["--max_steps", str(STEPS), "--per_device_train_batch_size", "4", "--optim", "sgd",
          "--learning_rate", "0.5", "--lr_scheduler_type", "constant", "--max_grad_norm", "0.5",
          "--train_sampling_strategy", "sequential", "--save_strategy", "no", "--logging_steps",
          "1", "--report_to", "none", "--use_cpu", "--bf16", "false", "--gradient_checkpointing",
          "false", "--seed", "0", "--dataset_num_proc", "1"]

# TRL's padding-free packing: the rows packed into one row of at most 48 tokens per batch
# (position_ids restarting at 0 per document, cu_seq_lens_q/k, max_length_q/k, seq_idx)
PACKED = "--packing true --max_length 48"
# for dp 2: 19 rows pack into 8 rows of 31..48 tokens, so each of the 3 steps takes 4 whole
# packed rows (12 rows pack into 5: a step of 1 row, which data parallel would fill up with rows
# repeated from the start, a global batch one process never sees)
PACKED_DP = f"--rows 19 {PACKED}"
# gradient accumulation: 2 micro-batches of 2 rows a step (the same 4 rows a step)
ACCUM = "--gradient_accumulation_steps 2 --per_device_train_batch_size 2"
# trainer.evaluate() after training on 5 other rows, 2 a batch per replica (the last batch
# uneven: at dp 2 the data loader fills it up with rows repeated from the start)
EVAL = "--eval_rows 5 --per_device_eval_batch_size 2"
# each replica's loss the mean over its own tokens (DDP then averages the replicas' gradients)
NO_AVG = "--average_tokens_across_devices false"
# the precision TRL's configs declare (bf16=True, gradient_checkpointing=True), not COMMON's
DEFAULTS = "--trl_defaults true"


def test_config_keeps_sft_defaults_in_either_order():
    from trl import SFTConfig

    from tsp_transformers import TSPTrainingArguments

    @dataclasses.dataclass
    class SFTFirst(SFTConfig, TSPTrainingArguments):
        pass

    @dataclasses.dataclass
    class TSPFirst(TSPTrainingArguments, SFTConfig):
        pass

    sft_fields = {f.name: f for f in dataclasses.fields(SFTConfig)}
    ref = SFTConfig(output_dir="o", use_cpu=True)
    for cls in (SFTFirst, TSPFirst):
        fields = {f.name: f for f in dataclasses.fields(cls)}
        assert set(fields) == set(sft_fields) | {"tsp_size", "tsp_seq_len", "tsp_memory_gb",
                                                 "tsp_metrics", "tsp_tile_tokens",
                                                 "tsp_activation_offload"}, cls
        for name, f in sft_fields.items():  # the declared defaults, field by field
            assert (fields[name].default, fields[name].default_factory) == \
                (f.default, f.default_factory), (cls.__name__, name)
        args = cls(output_dir="o", use_cpu=True, tsp_size="2")
        for name in sft_fields:  # and what __post_init__ made of them
            assert getattr(args, name) == getattr(ref, name), (cls.__name__, name)
        assert args.tsp_size == 2
        # the defaults the issue found reset: SFTConfig's, not TrainingArguments'
        assert (args.learning_rate, args.bf16, args.gradient_checkpointing,
                args.logging_steps) == (2e-5, True, True, 10), cls.__name__


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> str:
    """A tiny Llama (vocabulary 96, 2 key/value heads) and a word-level tokenizer over its
    ids (0..2 special), saved as SFTTrainer loads them."""
    return hf_models.save_with_word_tokenizer(hf_models.build("llama", torch.float32),
                                              str(tmp_path_factory.mktemp("llama_sft")))


@pytest.fixture(scope="module")
def one_process(tmp_path_factory, saved) -> str:
    """TRL's own SFTTrainer (and DPOTrainer) on one process: every case the TSP runs check."""
    out = tmp_path_factory.mktemp("sft_one")
    launch.run([sys.executable, launch.EXIT_CLEANLY, JOB, "--model_path", saved, *COMMON,
                "--output_dir", str(out / "o"), "--out", str(out), "--case", f"plain {EVAL}",
                "completion --data completion", "prompt_completion --data prompt_completion",
                f"packed {PACKED}", f"packed_dp {PACKED_DP}", f"accum {ACCUM}",
                f"dpo --mode dpo_plain {EVAL}", f"defaults {DEFAULTS}",
                f"dpo_defaults --mode dpo_plain {DEFAULTS}"], 1,
               timeout=400)
    return str(out)


@pytest.fixture(scope="module")
def two_processes(tmp_path_factory, saved) -> str:
    """One 2-process launch: TSPSFTTrainer at tsp 2 on every dataset (the plain one then
    evaluated), with gradient accumulation, DPO (then evaluated), both with TRL's precision
    defaults, with
    ``average_tokens_across_devices=False``, float64, TRL's own SFTTrainer under DDP on 2
    replicas of 2 rows with that setting (the reference of dp 2 x tsp 2), TRL's DPOTrainer under
    DDP on 2 replicas then evaluated (the reference of dp 2 x tsp 2's DPO eval metrics),
    TSPSFTTrainer with ``torch_compile_backend="eager"`` (each decoder layer compiled), then
    the natural composition and a Trainer whose loss is built from the logits."""
    out = tmp_path_factory.mktemp("sft_tsp2")
    launch.run(launch.torchrun(2, launch.EXIT_CLEANLY, JOB, "--model_path", saved, *COMMON,
                               "--output_dir", str(out / "o"), "--out", str(out), "--case",
                               f"plain --mode tsp --tsp_size 2 {EVAL}",
                               f"accum --mode tsp --tsp_size 2 {ACCUM}",
                               "completion --mode tsp --tsp_size 2 --data completion",
                               "prompt_completion --mode tsp --tsp_size 2 --data "
                               "prompt_completion",
                               f"packed --mode tsp --tsp_size 2 {PACKED}",
                               f"dpo --mode dpo_tsp --tsp_size 2 {EVAL}",
                               f"no_avg --mode tsp --tsp_size 2 {NO_AVG}",
                               f"no_avg_accum --mode tsp --tsp_size 2 {ACCUM} {NO_AVG}",
                               f"ddp_no_avg --mode plain --per_device_train_batch_size 2 {NO_AVG}",
                               f"dpo_ddp --mode dpo_plain --per_device_train_batch_size 2 {EVAL}",
                               "float64 --mode tsp --tsp_size 2 --dtype float64",
                               "compiled --mode tsp --tsp_size 2 --torch_compile_backend eager",
                               f"defaults --mode tsp --tsp_size 2 {DEFAULTS}",
                               f"dpo_defaults --mode dpo_tsp --tsp_size 2 {DEFAULTS}",
                               "natural --mode natural --tsp_size 2",
                               "logits_loss --mode logits_loss --tsp_size 2"), 2, timeout=400)
    return str(out)


def runs(out: str, ranks: int) -> list[dict]:
    found = []
    for r in range(ranks):
        with open(os.path.join(out, f"rank{r}.json")) as f:
            found.append(json.load(f))
    return found


def tensors(out: str, rank: int) -> dict:
    """The final full weights and first gradients ``rank`` wrote (every rank writes its own:
    each data-parallel replica's are checked)."""
    return {key: torch.load(os.path.join(out, f"rank{rank}_{key}.pt"))
            for key in ("weights", "grads0")}


# float32's unit roundoff u. The first gradients of two float32 runs that sum in different orders
# (TSP's sequence and vocabulary slices against one process's whole matrices) differ by
# independent roundings: about k = 20 matmuls per gradient (tests/support/precision.py's count),
# each a float32 sum of up to n ~ 100 terms whose rounding grows as sqrt(n) u, in both runs:
# sqrt(2 k n) u = 63 u = 3.8e-6 norm-wise over all gradients (measured 3.5 to 6 u). A gradient
# of the wrong scale (2, 1/D) or from the wrong rows is off by 10% to 100%
U32 = 2.0 ** -24
G32 = (2 * 20 * 100) ** 0.5 * U32


def assert_tensors_as_one_process(got: dict, want: dict, what: str,
                                  weights_tol: float = 1e-5) -> None:
    """A rank's final weights (to ``weights_tol`` of max(1, |w|)) and first gradients (within
    G32 norm-wise, :data:`G32`) against one process's."""
    for key in ("grads0", "weights"):
        assert sorted(got[key]) == sorted(want[key]), \
            (what, key, sorted(set(got[key]) ^ set(want[key])))
    off = precision.relative_error(got["grads0"], want["grads0"])
    worst = max(want["grads0"], key=lambda n: precision.relative_error(
        {n: got["grads0"][n]}, {n: want["grads0"][n]}))
    assert off <= G32, f"{what}: first gradients {off:.2e} from one process's (> G32 " \
                       f"{G32:.2e}; worst {worst})"
    for name, w in want["weights"].items():
        assert_close(got["weights"][name], w, weights_tol, f"{what}: {name}")


def assert_as_one_process(out: str, ref_out: str, ranks: int, what: str) -> None:
    """Every rank's log rows, final weights and first gradients against one process: loss,
    grad_norm and entropy to 1e-5 relative (float32, the two heads sum in different orders), the
    accuracy and token count exactly, the weights to 1e-5 (of max(1, |w|)), the first gradients
    within :data:`G32`."""
    (ref,) = runs(ref_out, 1)
    assert len(ref["rows"]) == STEPS, ref
    assert min(row["grad_norm"] for row in ref["rows"]) > 0.5, ("clipping must act", ref)
    assert any(row["mean_token_accuracy"] > 0 for row in ref["rows"]), ref
    want = tensors(ref_out, 0)
    for r in range(ranks):  # the first gradients first: the cause of any later difference
        assert_tensors_as_one_process(tensors(out, r), want, f"{what} rank {r}")
    for r, run in enumerate(runs(out, ranks)):
        assert len(run["rows"]) == STEPS, (what, r, run)
        for step, (got, want) in enumerate(zip(run["rows"], ref["rows"])):
            assert set(got) == set(want), (what, r, step, got, want)
            for key in ("loss", "grad_norm", "entropy"):
                assert abs(got[key] - want[key]) <= 1e-5 * abs(want[key]), \
                    f"{what} rank {r}, step {step}: {key} {got[key]} vs {want[key]}"
            for key in ("mean_token_accuracy", "num_tokens"):
                assert got[key] == want[key], \
                    f"{what} rank {r}, step {step}: {key} {got[key]} vs {want[key]}"


@pytest.fixture(scope="module")
def four_processes(tmp_path_factory, saved) -> str:
    """dp 2 x tsp 2: each data-parallel replica takes 2 of each step's 4 rows (pairs, packed
    rows); the plain and DPO runs then evaluated; with ``average_tokens_across_devices=False``."""
    out = tmp_path_factory.mktemp("sft_dp2")
    launch.run(launch.torchrun(4, launch.EXIT_CLEANLY, JOB, "--model_path", saved, *COMMON,
                               "--per_device_train_batch_size", "2", "--output_dir",
                               str(out / "o"), "--out", str(out), "--case",
                               f"plain --mode tsp --tsp_size 2 {EVAL}",
                               "prompt_completion --mode tsp --tsp_size 2 --data "
                               "prompt_completion",
                               f"packed_dp --mode tsp --tsp_size 2 {PACKED_DP}",
                               f"no_avg --mode tsp --tsp_size 2 {NO_AVG}",
                               f"dpo --mode dpo_tsp --tsp_size 2 {EVAL}"),
               4, timeout=400)
    return str(out)


@pytest.mark.parametrize("data", ["plain", "completion", "prompt_completion", "packed", "accum"])
def test_sft_tsp2_matches_one_process(two_processes, one_process, data):
    assert_as_one_process(os.path.join(two_processes, data), os.path.join(one_process, data),
                          2, f"tsp 2, {data} rows")


def test_sft_compiled_tsp2_equals_eager(two_processes):
    # TSPSFTConfig(torch_compile_backend="eager") at tsp 2 on the plain rows: on every rank
    # both decoder layers compiled (dynamo's graph, whole: the wiring TSPTrainer gives TRL; the
    # backends' own numbers are tests/models/test_compiled*.py's) with no graph break, and every
    # logged row (loss, grad_norm, entropy, mean_token_accuracy, num_tokens), the first gradients
    # and the final weights equal to the eager plain case's bit for bit
    for r in range(2):
        run = runs(os.path.join(two_processes, "compiled"), 2)[r]
        eager = runs(os.path.join(two_processes, "plain"), 2)[r]
        assert run["compiled"] == {"layers": [True, True], "breaks": {}}, (r, run["compiled"])
        assert run["rows"] == eager["rows"] and len(run["rows"]) > 0, r
        got, want = (tensors(os.path.join(two_processes, c), r) for c in ("compiled", "plain"))
        for key in ("weights", "grads0"):
            for name, t in want[key].items():
                assert torch.equal(got[key][name], t), f"rank {r}: {key} {name} differs"


def assert_evaluate_as_one_process(out: str, ref_out: str, ranks: int, what: str,
                                   relative: tuple[str, ...], exact: tuple[str, ...]) -> None:
    """``trainer.evaluate()`` after the plain run's training against one process's: SFT
    evaluates with no num_items_in_batch, each batch's loss the mean over its own labelled
    tokens."""
    (ref,) = runs(ref_out, 1)
    want = {k: v for k, v in ref["eval"].items() if "runtime" not in k and "per_second" not in k}
    assert set(want) == {"eval_loss", "eval_entropy", "eval_mean_token_accuracy",
                         "eval_num_tokens"}, want
    assert want["eval_mean_token_accuracy"] > 0, want
    for r, run in enumerate(runs(out, ranks)):
        got = {k: v for k, v in run["eval"].items() if k in want}
        assert set(got) == set(want), (what, r, run["eval"])
        for key in relative:
            assert abs(got[key] - want[key]) <= 1e-5 * abs(want[key]), \
                f"{what}, rank {r}: {key} {got[key]} vs {want[key]}"
        for key in exact:
            assert got[key] == want[key], f"{what}, rank {r}: {key} {got[key]} vs {want[key]}"


def test_sft_evaluate_tsp2_matches_one_process(two_processes, one_process):
    assert_evaluate_as_one_process(
        os.path.join(two_processes, "plain"), os.path.join(one_process, "plain"), 2,
        "evaluate at tsp 2", ("eval_loss", "eval_entropy"),
        ("eval_mean_token_accuracy", "eval_num_tokens"))


def eval_metrics_reference(weights: dict, steps: list[list[int]]) -> dict:
    """SFT's eval entropy and token accuracy from the math, in float64: the unmodified model
    with ``weights``, each step's entropy and top-1 summed over its rows' labelled tokens and
    divided by their count, averaged over the steps (``steps``: the eval rows of each step)."""
    from tests.jobs.trl_job import sft_rows

    model = hf_models.build("llama", torch.float32).double()
    model.load_state_dict({k: v.double() for k, v in weights.items()})
    rows = [r["input_ids"] for r in sft_rows(model.config.vocab_size, 5, False, 7)]
    entropy, accuracy = [], []
    with torch.no_grad():
        for step in steps:
            ent = top1 = count = 0
            for k in step:
                ids = torch.tensor(rows[k])
                logits = model(input_ids=ids[None]).logits[0, :-1]
                logp = torch.log_softmax(logits, -1)
                ent += -(logp.exp() * logp).sum().item()
                top1 += (logits.argmax(-1) == ids[1:]).sum().item()
                count += len(ids) - 1
            entropy.append(ent / count)
            accuracy.append(top1 / count)
    return {"eval_entropy": sum(entropy) / len(steps),
            "eval_mean_token_accuracy": sum(accuracy) / len(steps)}


def test_sft_evaluate_dp2_tsp2_matches_one_process_and_the_math(four_processes, one_process):
    # each replica's batch of 2 is one process's batch of 2 (rows 0-1 | 2-3, then 4 and a
    # repeated row the TSP loss ignores), so eval_loss is one process's. SFT's eval entropy and
    # accuracy are per step over the global batch: rows 0-3, then row 4 (the repeated row
    # ignored there too), not one process's steps (rows 0-1, 2-3, 4) nor DDP's (which counts the
    # repeated row: measured 3e-5 higher entropy): from the math in float64 on one process's
    # final weights (dp 2 x tsp 2's are within 1e-5 of them), the entropy to 1e-6 relative
    # (measured 1e-8), the accuracy to 1e-7 (float32's division of equal counts)
    one = os.path.join(one_process, "plain")
    out = os.path.join(four_processes, "plain")
    assert_evaluate_as_one_process(out, one, 4, "evaluate at dp 2 x tsp 2", ("eval_loss",),
                                   ("eval_num_tokens",))
    want = eval_metrics_reference(tensors(one, 0)["weights"], [[0, 1, 2, 3], [4]])
    (one_run,) = runs(one, 1)
    assert abs(one_run["eval"]["eval_entropy"] - want["eval_entropy"]) > \
        1e-6 * want["eval_entropy"], ("the steps must matter", one_run["eval"], want)
    for r, run in enumerate(runs(out, 4)):
        for key, tol in (("eval_entropy", 1e-6), ("eval_mean_token_accuracy", 1e-7)):
            got = run["eval"][key]
            assert abs(got - want[key]) <= tol * want[key], \
                f"evaluate at dp 2 x tsp 2, rank {r}: {key} {got} vs {want[key]}"


def assert_refused_on_every_rank(found: list[dict], message: str) -> None:
    """Every rank raised before its first optimizer step, with ``message`` first and the
    trainers that work named."""
    for r, run in enumerate(found):
        assert "error" in run, f"rank {r} trained instead of refusing: {run}"
        assert run["steps"] == 0, (r, run)
        assert run["error"].startswith(message), (r, run["error"])
        assert "tsp_trl.TSPSFTTrainer / tsp_trl.TSPDPOTrainer" in run["error"], (r, run["error"])


def test_natural_composition_refuses_on_every_rank(two_processes):
    assert_refused_on_every_rank(runs(os.path.join(two_processes, "natural"), 2),
                                 "NaturalSFTTrainer: the model's forward was replaced by "
                                 "_fused_forward of trl/trainer/utils.py")


def test_a_loss_not_from_the_tsp_forward_refuses_on_every_rank(two_processes):
    # TSPTrainer mixed into a Trainer that builds its loss from the logits (its forward is not
    # replaced): the first step raises on every rank, before any optimizer step
    assert_refused_on_every_rank(runs(os.path.join(two_processes, "logits_loss"), 2),
                                 "LogitsLossTrainer: its loss did not come from the TSP model's "
                                 "forward with labels")


@pytest.mark.parametrize("data", ["plain", "prompt_completion", "packed_dp"])
def test_sft_dp2_tsp2_matches_one_process(four_processes, one_process, data):
    assert_as_one_process(os.path.join(four_processes, data), os.path.join(one_process, data),
                          4, f"dp 2 x tsp 2, {data} rows")


@pytest.mark.parametrize("case, ref", [("no_avg", "plain"), ("no_avg_accum", "accum")])
def test_sft_tsp2_without_token_averaging_matches_one_process(two_processes, one_process, case,
                                                              ref):
    # average_tokens_across_devices=False at dp 1: the replica's mean is the global batch's, so
    # one process's run, also with gradient accumulation (the count spans the step's
    # micro-batches). It was twice the loss and grad_norm at tsp 2: each rank's sum divided by
    # the Trainer's count over D, then summed over the group
    assert_as_one_process(os.path.join(two_processes, case), os.path.join(one_process, ref), 2,
                          f"tsp 2, average_tokens_across_devices=False, {case}")


def test_sft_dp2_tsp2_without_token_averaging_matches_ddp(four_processes, two_processes,
                                                          one_process):
    # average_tokens_across_devices=False at dp 2: each replica's loss the mean over its own
    # tokens, the gradient the mean over the replicas, as TRL's SFTTrainer under DDP on 2
    # replicas of the same 2 rows each (its rank 0's log rows and weights); a mean of two means
    # is not the global mean, so that reference must differ from one process's
    ddp = os.path.join(two_processes, "ddp_no_avg")
    (ref,), (one,) = runs(ddp, 1), runs(os.path.join(one_process, "plain"), 1)
    assert all(abs(a["loss"] - b["loss"]) > 1e-5 * abs(b["loss"])
               for a, b in zip(ref["rows"], one["rows"])), (ref["rows"], one["rows"])
    assert_as_one_process(os.path.join(four_processes, "no_avg"), ddp, 4,
                          "dp 2 x tsp 2, average_tokens_across_devices=False")


# DPO's figures: rewards = beta x (sum of ~50 float32 log-probs - the reference's), a difference
# of numbers of ~50 whose float32 rounding (~3e-6) times beta 0.1 is ~3e-7: held to 1e-6
# absolute (measured 2e-7), as are the mean logits (~1e-2); the rest as SFT's
DPO_RELATIVE = ("loss", "grad_norm", "entropy", "logps/chosen", "logps/rejected")
DPO_ABSOLUTE = ("rewards/chosen", "rewards/rejected", "rewards/margins", "logits/chosen",
                "logits/rejected")
DPO_EXACT = ("rewards/accuracies", "mean_token_accuracy", "num_tokens")


def assert_dpo_as_one_process(out: str, ref_out: str, ranks: int, what: str) -> None:
    (ref,) = runs(ref_out, 1)
    assert len(ref["rows"]) == STEPS, ref
    assert min(row["grad_norm"] for row in ref["rows"]) > 0.5, ("clipping must act", ref)
    assert ref["rows"][-1]["rewards/margins"] > 0.05, ("the preference must be learnt", ref)
    want = tensors(ref_out, 0)
    for r in range(ranks):
        assert_tensors_as_one_process(tensors(out, r), want, f"{what} rank {r}")
    for r, run in enumerate(runs(out, ranks)):
        assert run["ref_is_tsp"], (what, r, "the reference model must be a TSP model")
        assert len(run["rows"]) == STEPS, (what, r, run)
        for step, (got, want) in enumerate(zip(run["rows"], ref["rows"])):
            assert set(got) == set(want) == {*DPO_RELATIVE, *DPO_ABSOLUTE, *DPO_EXACT}, \
                (what, r, step, sorted(got), sorted(want))
            for key in DPO_RELATIVE:
                assert abs(got[key] - want[key]) <= 1e-5 * abs(want[key]), \
                    f"{what} rank {r}, step {step}: {key} {got[key]} vs {want[key]}"
            for key in DPO_ABSOLUTE:
                assert abs(got[key] - want[key]) <= 1e-6, \
                    f"{what} rank {r}, step {step}: {key} {got[key]} vs {want[key]}"
            for key in DPO_EXACT:
                assert got[key] == want[key], \
                    f"{what} rank {r}, step {step}: {key} {got[key]} vs {want[key]}"


def test_dpo_tsp2_matches_one_process(two_processes, one_process):
    assert_dpo_as_one_process(os.path.join(two_processes, "dpo"),
                              os.path.join(one_process, "dpo"), 2, "DPO at tsp 2")


def test_dpo_dp2_tsp2_matches_one_process(four_processes, one_process):
    assert_dpo_as_one_process(os.path.join(four_processes, "dpo"),
                              os.path.join(one_process, "dpo"), 4, "DPO at dp 2 x tsp 2")


def assert_dpo_evaluate_as(out: str, ref_out: str, ranks: int, what: str) -> None:
    """``trainer.evaluate()`` after training, on 5 other pairs, 2 a batch (the last one
    uneven): eval_loss and DPO's eval metrics of every rank against the reference run's, with
    the training rows' tolerances."""
    (ref,) = [run for r, run in enumerate(runs(ref_out, 1)) if r == 0]
    keys = {f"eval_{k}" for k in (*DPO_RELATIVE, *DPO_ABSOLUTE, *DPO_EXACT) if k != "grad_norm"}
    want = {k: v for k, v in ref["eval"].items() if "runtime" not in k and "per_second" not in k}
    assert set(want) == keys, sorted(set(want) ^ keys)
    assert 0 < want["eval_rewards/accuracies"] < 1, want
    for r, run in enumerate(runs(out, ranks)):
        got = {k: v for k, v in run["eval"].items() if k in want}
        assert set(got) == keys, (r, run["eval"])
        for key in want:
            bare = key[len("eval_"):]
            tol = (0 if bare in DPO_EXACT else 1e-6 if bare in DPO_ABSOLUTE
                   else 1e-5 * abs(want[key]))
            assert abs(got[key] - want[key]) <= tol, \
                f"{what}, rank {r}: {key} {got[key]} vs {want[key]}"


def test_dpo_evaluate_tsp2_matches_one_process(two_processes, one_process):
    assert_dpo_evaluate_as(os.path.join(two_processes, "dpo"), os.path.join(one_process, "dpo"),
                           2, "DPO evaluate at tsp 2")


def test_dpo_evaluate_dp2_tsp2_matches_ddp(four_processes, two_processes, one_process):
    # at dp 2 DPO's eval metrics gather every replica's pairs per step (the last step's
    # repeated pair too): DPOTrainer under DDP on 2 replicas, trained on the same global batches
    # (its weights one process's), is the reference
    ddp = os.path.join(two_processes, "dpo_ddp")
    for r in range(2):
        assert_tensors_as_one_process(tensors(ddp, r), tensors(os.path.join(one_process, "dpo"),
                                                               0), f"DPO DDP rank {r}")
    assert_dpo_evaluate_as(os.path.join(four_processes, "dpo"), ddp, 4,
                           "DPO evaluate at dp 2 x tsp 2")


def as_run(out: str, rank: int = 0) -> dict:
    """A rank's log rows as losses and norms per step, with the first gradients and final
    weights it gathered (tests/support/precision.py's form)."""
    (found,) = [run for r, run in enumerate(runs(out, rank + 1)) if r == rank]
    return {"losses": [row["loss"] for row in found["rows"]],
            "norms": [row["grad_norm"] for row in found["rows"]], "rows": found["rows"],
            "precision": found["precision"], **tensors(out, rank)}


# bf16 runs' figures beyond losses and norms: those of one sign, relative (2 G); DPO's rewards
# (beta x a difference of sums of ~50 log-probs) and mean logits (logits of both signs) cancel,
# so their value can be near 0 while their rounding stays that of their size: 2 G of the largest
# value over the run; counts and the accuracies exactly (measured equal at every step: an argmax
# could flip between two logits within bf16's rounding of each other, which would show here as
# one scored token of the step, a count the log rows do not carry)
BF16_RELATIVE = ("entropy", "logps/chosen", "logps/rejected")
BF16_SCALED = ("rewards/chosen", "rewards/rejected", "rewards/margins", "logits/chosen",
               "logits/rejected")
BF16_EXACT = ("num_tokens", "rewards/accuracies", "mean_token_accuracy")


def assert_rows_within_bf16(got: list[dict], want: list[dict], what: str) -> None:
    """Every logged figure but the loss and grad_norm (:func:`precision.assert_within_bf16`)."""
    scale = {key: max(abs(row[key]) for row in want) for key in BF16_SCALED if key in want[0]}
    for step, (a, b) in enumerate(zip(got, want)):
        assert set(a) == set(b), (what, step, sorted(a), sorted(b))
        for key in set(b) & set(BF16_RELATIVE):
            assert abs(a[key] - b[key]) <= 2 * precision.G * abs(b[key]), \
                f"{what} step {step}: {key} {a[key]} vs {b[key]}"
        for key, size in scale.items():
            assert abs(a[key] - b[key]) <= 2 * precision.G * size, \
                f"{what} step {step}: {key} {a[key]} vs {b[key]} (largest {size})"
        for key in set(b) & set(BF16_EXACT):
            assert a[key] == b[key], f"{what} step {step}: {key} {a[key]} vs {b[key]}"


@pytest.mark.parametrize("case, float32_case", [("defaults", "plain"), ("dpo_defaults", "dpo")])
def test_trl_precision_defaults_tsp2_match_one_process(two_processes, one_process, case,
                                                       float32_case):
    # SFTConfig's and DPOConfig's own defaults, bf16=True and gradient_checkpointing=True (on a
    # GPU the first thing a TRL user runs): TSPSFTTrainer / TSPDPOTrainer at tsp 2 against
    # SFTTrainer / DPOTrainer with the same defaults on one process, within bf16's bounds
    # (tests/support/precision.py): every rank's logged loss, grad_norm, entropy, token accuracy
    # and DPO's rewards and log-probs, the first gradients and the weights after 3 clipped SGD
    # steps; both really ran bf16 (first gradients >= 0.1 u from the float32 run's)
    init = hf_models.build("llama", torch.float32).state_dict()
    float32 = as_run(os.path.join(one_process, float32_case))
    plain = as_run(os.path.join(one_process, case))
    assert plain["precision"] == {"bf16": True, "gradient_checkpointing": True}, plain
    assert min(plain["norms"]) > 0.5, ("clipping must act", plain["norms"])
    precision.assert_within_bf16(plain, float32, init, f"{case}, one process", exact=float32)
    for r in range(2):
        run = as_run(os.path.join(two_processes, case), r)
        what = f"{case}, tsp 2, rank {r}"
        assert run["precision"] == plain["precision"], (what, run["precision"])
        precision.assert_within_bf16(run, plain, init, what, exact=float32)
        assert_rows_within_bf16(run["rows"], plain["rows"], what)
        if r == 0:
            print(f"{case}: " + precision.summary(run, plain, init, float32))


def test_padding_free_keys_must_match_the_position_ids():
    from tsp_core.models import check_padding_free

    pos = torch.tensor([[0, 1, 2, 0, 1, 0]])
    good = torch.tensor([0, 3, 5, 6], dtype=torch.int32)
    check_padding_free({"cu_seq_lens_q": good, "cu_seq_lens_k": good, "seq_idx": None},
                       {"position_ids": pos})
    with pytest.raises(ValueError, match=r"cu_seq_lens_k \[0, 2, 5, 6\] does not match the "
                                         r"documents of position_ids \(they restart at "
                                         r"\[0, 3, 5\], row length 6\)"):
        check_padding_free({"cu_seq_lens_q": good,
                            "cu_seq_lens_k": torch.tensor([0, 2, 5, 6])}, {"position_ids": pos})
    with pytest.raises(ValueError, match="without position_ids"):
        check_padding_free({"cu_seq_lens_q": good}, {})


def float64_reference() -> dict:
    """One process in float64 on the plain rows: each step's 4 rows right-padded as SFT's
    collator pads them (labels -100 on the padding), the mean cross-entropy over the global
    batch's labelled tokens, and SFT's metrics from the full logits (entropy and top-1 per
    labelled position, the token count from the rows' lengths); gradients clipped at 0.5, SGD
    at lr 0.5 (COMMON's)."""
    import torch.nn.functional as F

    from tests.jobs.trl_job import sft_rows

    model = hf_models.build("llama", torch.float32).double()
    rows = [r["input_ids"] for r in sft_rows(model.config.vocab_size, 12, False)]
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    out, tokens, grads0 = [], 0, None
    for step in range(STEPS):
        batch = rows[4 * step: 4 * step + 4]
        width = max(map(len, batch))
        ids = torch.tensor([r + [1] * (width - len(r)) for r in batch])
        labels = torch.tensor([r + [-100] * (width - len(r)) for r in batch])[:, 1:]
        logits = model(input_ids=ids).logits[:, :-1]
        keep = labels != -100
        logp = torch.log_softmax(logits, -1)
        loss = F.nll_loss(logp[keep], labels[keep])
        loss.backward()
        if grads0 is None:
            grads0 = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        opt.step()
        opt.zero_grad()
        tokens += sum(map(len, batch))
        with torch.no_grad():
            entropy = -(logp.exp() * logp).sum(-1)[keep].mean()
            top1 = (logits.argmax(-1) == labels)[keep].double().mean()
        out.append({"loss": loss.item(), "grad_norm": norm.item(), "entropy": entropy.item(),
                    "mean_token_accuracy": top1.item(), "num_tokens": float(tokens)})
    return {"rows": out, "grads0": grads0,
            "weights": {k: v.detach().clone() for k, v in model.state_dict().items()}}


def test_sft_tsp2_float64_matches_exact_math(two_processes):
    # TRL's own kernel accumulates in float32 even for a float64 model, so the float64 reference
    # is the math itself. The logged loss to 1e-7 (the Trainer sums it in float32), the token
    # accuracy to 1e-7 (SFT divides two integer counts in float32: the counts are equal); every
    # rank's first gradients and final weights to 1e-10
    ref = float64_reference()
    assert min(row["grad_norm"] for row in ref["rows"]) > 0.5, ("clipping must act", ref["rows"])
    out = os.path.join(two_processes, "float64")
    for r, run in enumerate(runs(out, 2)):
        assert len(run["rows"]) == STEPS, (r, run)
        for step, (got, want) in enumerate(zip(run["rows"], ref["rows"])):
            for key, tol in (("loss", 1e-7), ("grad_norm", 1e-10), ("entropy", 1e-10),
                             ("mean_token_accuracy", 1e-7), ("num_tokens", 0)):
                assert abs(got[key] - want[key]) <= tol * abs(want[key]), \
                    f"float64 rank {r}, step {step}: {key} {got[key]} vs {want[key]}"
    for r in range(2):
        got = tensors(out, r)
        for key in ("grads0", "weights"):
            assert sorted(got[key]) == sorted(ref[key]), (r, key)
            for name, w in ref[key].items():
                assert_close(got[key][name], w, 1e-10, f"float64 rank {r}: {key} {name}")
