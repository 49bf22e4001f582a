"""A TRL GRPO job on a tiny Llama saved with save_pretrained (and a word-level tokenizer): TRL's
own ``GRPOTrainer`` (``--mode plain``: one process, the reference) or ``tsp_trl.TSPGRPOTrainer``
(``--mode tsp`` under torchrun, tsp_size 2), one run per ``--case NAME`` in the same processes
(:data:`CASES`), results in ``--out/NAME/rank<R>.json``: every training log row, the completion
tokens of every generation, the calls each rank made to each reward function, or the error the
case raised (with the collectives this rank had issued through tsp_core's comm until then).

Float32, SGD at a constant lr 0.5 with clipping at 0.5, 3 steps of 4 completions (2 prompts of
different lengths x 2 generations), completions of at most 8 tokens sampled at temperature 0.9,
top-k 50, top-p 0.95 and min-p 0.05; beta 0.04 (a reference model TRL builds from the path);
the reward a deterministic function of the completion text (case ``rewards``: two, weighted).
Case ``grads64``: float64, prompts of 4 words, one step without clipping, every parameter's
gradient saved before the optimizer step (``rank<R>_grads.pt``); the one-process reference with
TRL's head kernel computed in float64 (:class:`ExactHead`)."""

from __future__ import annotations

import argparse
import json
import os

import torch
import trl.trainer.utils as trl_utils
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
from trl import GRPOConfig, GRPOTrainer

from tests.support.gather import full_grads
from tsp_core.distributed import comm
from tsp_trl import TSPGRPOConfig, TSPGRPOTrainer

STEPS = 3
COMMON = dict(
    max_steps=STEPS, per_device_train_batch_size=4, num_generations=2, max_completion_length=8,
    optim="sgd", learning_rate=0.5, lr_scheduler_type="constant", max_grad_norm=0.5,
    logging_steps=1, report_to="none", use_cpu=True, bf16=False, gradient_checkpointing=False,
    seed=0, save_strategy="no", beta=0.04, temperature=0.9, top_k=50, top_p=0.95, min_p=0.05)
# the TSP-only cases must raise, on every rank, before any collective
CASES = {
    "dapo": {},  # TRL's default loss_type
    "grpo": {"loss_type": "grpo"},
    "dr_grpo": {"loss_type": "dr_grpo"},
    # bnpo normalises each micro-batch by its own tokens (dapo: the accumulated batch's)
    "bnpo": {"loss_type": "bnpo", "per_device_train_batch_size": 2,
             "gradient_accumulation_steps": 2},
    # two reward functions (REWARD_FUNCS), weighted; advantages over the whole batch's std
    "rewards": {"reward_weights": [1.0, 0.5], "scale_rewards": "batch"},
    # the loss on the completion tokens at or above the replica's median entropy
    "entropy": {"top_entropy_quantile": 0.5},
    # 2 micro-batches of 2 completions a step: dapo's normaliser spans the accumulated batch
    "accum": {"per_device_train_batch_size": 2, "gradient_accumulation_steps": 2},
    # each generation used for 2 steps: old log-probs, importance ratios and clipping act
    "iterations": {"num_iterations": 2},
    # data parallel (2 processes; 2 replicas of tsp 2): each group of 4 spans both replicas
    "dp": {"per_device_train_batch_size": 2, "num_generations": 4},
    # the entropy quantile over both replicas' completion tokens (of different counts)
    "dp_entropy": {"per_device_train_batch_size": 2, "num_generations": 4,
                   "top_entropy_quantile": 0.5},
    # float64, one step without clipping: every parameter's gradient before the optimizer step
    "grads64": {"max_steps": 1, "max_grad_norm": 0.0},
    "bad_num_generations": {"num_generations": 3},
    "use_vllm": {"use_vllm": True},
    # the longest prompt (6 tokens) + 251 > the tiny Llama's max_position_embeddings (256)
    "too_long": {"max_completion_length": 251},
    # a generation batch of 6 over a global batch of 4 (1 replica x 4), not whole steps
    "bad_generation_batch": {"generation_batch_size": 6},
    # 1 x 1 replica x 3 steps: 3 completions, not whole groups of 2
    "bad_steps_per_generation": {"per_device_train_batch_size": 1, "steps_per_generation": 3},
    # both sizes given: TRL's own refusal
    "both_sizes": {"generation_batch_size": 8, "steps_per_generation": 2},
}
REFUSALS = ("bad_num_generations", "use_vllm", "too_long", "bad_generation_batch",
            "bad_steps_per_generation", "both_sizes")
DTYPES = {"grads64": torch.float64}  # else float32
REWARD_FUNCS = {"rewards": 2}  # else 1 (even_fraction)
# prompts of one length: no left padding, so no row is rotated (tsp_trl.grpo.completion_stats);
# a rotated row's tokens sit at other positions, where Hugging Face's and TSP's float32 rotary
# tables round differently (~1e-7 relative), which the float32 cases cover
PROMPT_WORDS = {"grads64": 4}


class Rows(TrainerCallback):
    def __init__(self) -> None:
        self.rows: list[dict] = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss" in logs:
            self.rows.append({k: v for k, v in logs.items() if isinstance(v, (int, float))})


class FirstGradients(TrainerCallback):
    """Every parameter's full gradient (gathered from the shards under TSP) by Hugging Face
    name, saved to ``path`` before the first optimizer step."""

    def __init__(self, path: str) -> None:
        self.path = path

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        if state.global_step == 0:
            grads = {n: g.detach().cpu() for n, g in full_grads(model).items()}
            torch.save(grads, self.path)


class ExactHead:
    """TRL's chunked log-probability kernel (``trl.kernels.ChunkedLogProbFunction``: same
    arguments, same outputs) as plain autograd on the full logits in the hidden states' dtype.
    TRL's kernel accumulates in float32 whatever the dtype, so the float64 reference runs
    GRPOTrainer with this head instead."""

    @staticmethod
    def apply(hidden, weight, bias, targets, temperature, chunk_size, softcap=None,
              logit_scale=1.0, outputs=()):
        z = hidden @ weight.t() + (0 if bias is None else bias)
        z = z * logit_scale
        if softcap is not None:
            z = softcap * torch.tanh(z / softcap)
        z = z / temperature
        log_p = torch.log_softmax(z, -1)
        logprobs = log_p.gather(-1, targets[:, None])[:, 0]
        entropy = -(log_p.exp() * log_p).sum(-1) if "entropy" in outputs else None
        with torch.no_grad():
            sq = torch.logsumexp(2 * log_p, -1) if "log_sum_sq_probs" in outputs else None
            mean = z.mean(-1) if "mean_logits" in outputs else None
            top1 = z.argmax(-1) == targets if "is_top1" in outputs else None
        return logprobs, entropy, sq, mean, top1


def prompts(n: int = 8, words: int | None = None) -> Dataset:
    """``n`` prompts of 2 to 6 words, or all of ``words`` words (ids 3..95; 0..2 are the
    tokenizer's special tokens)."""
    gen = torch.Generator().manual_seed(3)
    rows = []
    for i in range(n):
        ids = torch.randint(3, 96, (words or 2 + i % 5,), generator=gen).tolist()
        rows.append({"prompt": " ".join(f"t{t}" for t in ids)})
    return Dataset.from_list(rows)


def counted_rewards(calls: list[int]) -> list:
    """``len(calls)`` reward functions of the completion text, the i-th counting its calls in
    ``calls[i]``: the fraction of words with an even id, then the fraction of the 8 tokens used
    (names as TRL logs them: ``rewards/<name>/mean``)."""
    def even_fraction(completions, **kwargs):
        calls[0] += 1
        words = [c.split() for c in completions]
        return [sum(int(w[1:]) % 2 == 0 for w in ws) / max(1, len(ws)) for ws in words]

    def length_fraction(completions, **kwargs):
        calls[1] += 1
        return [len(c.split()) / 8 for c in completions]

    return [even_fraction, length_fraction][:len(calls)]


def run_case(job: argparse.Namespace, name: str) -> None:
    rank = int(os.environ.get("RANK", "0"))
    out = os.path.join(job.out, name)
    os.makedirs(out, exist_ok=True)
    calls, log, completions = [0] * REWARD_FUNCS.get(name, 1), Rows(), []
    tsp = job.mode == "tsp"
    options = dict(COMMON, output_dir=os.path.join(out, "o"), **CASES[name])
    before = sum(comm.global_stats().calls.values())
    kernel = trl_utils._ChunkedLogProbFunction
    if not tsp and name in DTYPES:
        trl_utils._ChunkedLogProbFunction = ExactHead
    try:
        config = TSPGRPOConfig(tsp_size=2, **options) if tsp else GRPOConfig(**options)
        model = AutoModelForCausalLM.from_pretrained(job.model_path,
                                                     dtype=DTYPES.get(name, torch.float32))
        trainer_class = TSPGRPOTrainer if tsp else GRPOTrainer
        callbacks = [log]
        if name in DTYPES:
            callbacks.append(FirstGradients(os.path.join(out, f"rank{rank}_grads.pt")))
        trainer = trainer_class(model=model, reward_funcs=counted_rewards(calls), args=config,
                                train_dataset=prompts(words=PROMPT_WORDS.get(name)),
                                processing_class=AutoTokenizer.from_pretrained(job.model_path),
                                callbacks=callbacks)
    except ValueError as e:
        if name not in REFUSALS:
            raise
        issued = sum(comm.global_stats().calls.values()) - before
        result = {"error": str(e), "collectives": issued}
    else:
        generate = trainer._generate_single_turn

        def recording(*args, **kwargs):
            ids, logprobs = generate(*args, **kwargs)
            completions.append([list(map(int, c)) for c in ids])
            return ids, logprobs

        trainer._generate_single_turn = recording
        trainer.train()
        result = {"rows": log.rows, "completions": completions, "reward_calls": calls}
    finally:
        trl_utils._ChunkedLogProbFunction = kernel
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)


def main() -> None:
    from accelerate.state import AcceleratorState

    parser = argparse.ArgumentParser()
    parser.add_argument("--model_path", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--mode", choices=("plain", "tsp"), required=True)
    parser.add_argument("--case", nargs="+", required=True)
    job = parser.parse_args()
    for name in job.case:
        AcceleratorState._reset_state(False)  # a new accelerator per case
        run_case(job, name)


if __name__ == "__main__":
    main()
