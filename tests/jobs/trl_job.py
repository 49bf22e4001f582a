"""A TRL SFT or DPO job on a tiny Llama saved with save_pretrained (and a word-level tokenizer):
TRL's own ``SFTTrainer`` (``--mode plain``, one process: the reference; under torchrun: DDP),
``tsp_trl.TSPSFTTrainer`` (``--mode tsp`` under torchrun, with ``--tsp_size``) or the natural
composition a user would write,
``class (TSPTrainer, SFTTrainer)`` with ``TSPSFTConfig`` (``--mode natural``: it must refuse), or
``TSPTrainer`` mixed into a Trainer whose loss is built from the logits (``--mode logits_loss``: it
must refuse at the first step). Every rank writes every training log row (loss, grad_norm,
mean_token_accuracy, entropy, num_tokens, DPO's rewards, log-probs and mean logits) to
``rank<R>.json`` in --out, or the error it raised, and the final full weights it holds
(``rank<R>_weights.pt``: each data-parallel replica's own, gathered over its TSP group).

``--mode dpo_plain`` / ``dpo_tsp``: TRL's ``DPOTrainer`` / ``tsp_trl.TSPDPOTrainer`` on preference
pairs (the reference model built by the trainer from the policy's path).

``--data``: ``plain`` (rows of different lengths, padded), ``completion`` (the same rows with the
loss on their second half only: labels -100 on the prompt), ``prompt_completion`` (the same halves
as a prompt/completion text dataset, which TRL tokenizes and masks itself).

``--case "NAME ARGS..."`` (repeatable): one more run in the same processes with ARGS added,
results in --out/NAME.

``--eval_rows N``: after training, ``trainer.evaluate()`` on N more rows (or preference pairs) of
the same kind (another seed); its metrics go to ``rank<R>.json`` under "eval".

``--trl_defaults true`` (in a case): the case's config keeps the precision TRL's config declares
(``bf16``, ``gradient_checkpointing``), whatever the command line before ``--case`` set them to;
every rank records what the trainer ran with (``precision``).

Every rank also writes the full gradients of the first step before clipping
(``rank<R>_grads0.pt``). With ``--torch_compile_backend`` (the config's own argument) it also
records ``compiled``: which decoder layers were compiled and dynamo's graph breaks."""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass, field

import torch
from datasets import Dataset
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    HfArgumentParser,
    Trainer,
)
from trl import DPOTrainer, SFTTrainer
from trl.trainer.sft_trainer import DataCollatorForLanguageModeling

import tsp_core
from tests.jobs.trainer_job import compiled_layers, record_first_gradients, save_tensors
from tests.jobs.trl_rows import LOGGED, Rows, preference_rows, run_cases, sft_rows  # noqa: F401
from tsp_core.models import TSPCausalLM
from tsp_transformers import TSPTrainer
from tsp_trl import TSPDPOConfig, TSPDPOTrainer, TSPSFTConfig, TSPSFTTrainer

REFUSED = ("natural", "logits_loss")  # modes whose ValueError is the result


@dataclass
class JobArgs:
    model_path: str = field(default="")
    out: str = field(default="")
    mode: str = field(default="plain")
    data: str = field(default="plain")
    rows: int = field(default=12)
    dtype: str = field(default="float32")
    eval_rows: int = field(default=0)
    trl_defaults: bool = field(default=False)
    case: list[str] = field(default_factory=list)


class NaturalSFTTrainer(TSPTrainer, SFTTrainer):
    """What a user would write first (issue #36): TSPTrainer mixed into TRL's SFTTrainer."""


class LogitsLoss(Trainer):
    """A Trainer whose loss is built its own way from the logits (no labels reach the model),
    as a trainer that scores the head's output itself would."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        inputs = {k: v for k, v in inputs.items() if k != "labels"}
        return model(**inputs).logits.float().logsumexp(-1).mean()


class LogitsLossTrainer(TSPTrainer, LogitsLoss):
    """TSPTrainer mixed into it: the guard must refuse at the first step."""


def sft_dataset(job: JobArgs, vocab: int, n: int, seed: int) -> Dataset:
    """``n`` SFT rows of the kind ``--data`` names."""
    if job.data == "prompt_completion":  # TRL tokenizes them; loss on the completion only
        def words(ids: list[int]) -> str:
            return " ".join(f"t{i}" for i in ids)

        return Dataset.from_list([
            {"prompt": words(r["input_ids"][:len(r["input_ids"]) // 2]),
             "completion": words(r["input_ids"][len(r["input_ids"]) // 2:])}
            for r in sft_rows(vocab, n, False, seed)])
    return Dataset.from_list(sft_rows(vocab, n, job.data == "completion", seed))


def train(job: JobArgs, args: TSPSFTConfig | TSPDPOConfig) -> None:
    model = AutoModelForCausalLM.from_pretrained(job.model_path, dtype=getattr(torch, job.dtype))
    tokenizer = AutoTokenizer.from_pretrained(job.model_path)
    vocab = model.config.vocab_size
    if job.mode.startswith("dpo"):
        data = Dataset.from_list(preference_rows(vocab, job.rows))
    else:
        data = sft_dataset(job, vocab, job.rows, 5)
    eval_data = None
    if job.eval_rows:
        eval_data = (Dataset.from_list(preference_rows(vocab, job.eval_rows, 8))
                     if job.mode.startswith("dpo") else sft_dataset(job, vocab, job.eval_rows, 7))
    log = Rows()
    rank = int(os.environ.get("RANK", "0"))
    precision = {"bf16": args.bf16, "gradient_checkpointing": args.gradient_checkpointing}
    os.makedirs(job.out, exist_ok=True)
    extra = {}
    if args.torch_compile:  # this case's graphs and breaks alone
        torch._dynamo.reset()
        torch._dynamo.utils.counters.clear()
    try:
        if job.mode == "logits_loss":
            trainer = LogitsLossTrainer(
                model=model, args=args, train_dataset=data, callbacks=[log],
                data_collator=DataCollatorForLanguageModeling(tokenizer.pad_token_id))
        else:
            trainer_class = {"plain": SFTTrainer, "tsp": TSPSFTTrainer,
                             "natural": NaturalSFTTrainer, "dpo_plain": DPOTrainer,
                             "dpo_tsp": TSPDPOTrainer}[job.mode]
            trainer = trainer_class(model=model, args=args, train_dataset=data,
                                    eval_dataset=eval_data, processing_class=tokenizer,
                                    callbacks=[log])
        first = record_first_gradients(trainer)
        trainer.train()
        if args.torch_compile:
            extra["compiled"] = {"layers": compiled_layers(trainer.model),
                                 "breaks": dict(torch._dynamo.utils.counters["graph_break"])}
        if eval_data is not None:
            extra["eval"] = {k: v for k, v in trainer.evaluate().items()
                             if k.startswith("eval_") and isinstance(v, (int, float))}
    except ValueError as e:
        if job.mode not in REFUSED:
            raise
        with open(os.path.join(job.out, f"rank{rank}.json"), "w") as f:
            json.dump({"error": str(e), "steps": len(log.rows)}, f)
        return
    model = trainer.model
    weights = (tsp_core.full_state_dict(model) if isinstance(model, TSPCausalLM)
               else {k: v.detach().clone() for k, v in model.state_dict().items()})
    if getattr(trainer, "ref_model", None) is not None:
        extra["ref_is_tsp"] = isinstance(trainer.ref_model, TSPCausalLM)
    with open(os.path.join(job.out, f"rank{rank}.json"), "w") as f:
        json.dump({"rows": log.rows, "precision": precision, **extra}, f)
    save_tensors(job.out, rank, weights, first["grads"])


def parse(argv: list[str]):
    """JobArgs and the trainer's config: TSPDPOConfig for the ``dpo_*`` modes, else
    TSPSFTConfig."""
    modes = [argv[i + 1] for i, a in enumerate(argv[:-1]) if a == "--mode"]
    dpo = bool(modes) and modes[-1].startswith("dpo")
    parser = HfArgumentParser((JobArgs, TSPDPOConfig if dpo else TSPSFTConfig))
    return parser.parse_args_into_dataclasses(args=argv)


PRECISION_FLAGS = ("--bf16", "--gradient_checkpointing")


def without_precision(argv: list[str]) -> list[str]:
    """``argv`` without the precision flags and their values (:data:`PRECISION_FLAGS`)."""
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg in PRECISION_FLAGS:
            skip = True
        else:
            out.append(arg)
    return out


def main() -> None:
    argv = sys.argv[1:]
    job, args = parse(argv[:argv.index("--case") + 2] if "--case" in argv else argv)
    if not job.case:
        return train(job, args)
    # a case with TRL's own precision defaults drops the command line's precision flags
    run_cases(argv, parse, train,
              lambda case, base: without_precision(base) if case.trl_defaults else base)


if __name__ == "__main__":
    main()
