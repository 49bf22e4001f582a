"""The TRL jobs' data, log rows and ``--case`` runs (tests/jobs/trl_job.py, trl_lora_job.py),
free of tsp_core: a job's one-process reference run, TRL alone, imports these and never
tsp_core."""

from __future__ import annotations

import os
import shlex

import torch
from transformers import TrainerCallback

LOGGED = ("loss", "grad_norm", "mean_token_accuracy", "entropy", "num_tokens", "rewards/chosen",
          "rewards/rejected", "rewards/margins", "rewards/accuracies", "logps/chosen",
          "logps/rejected", "logits/chosen", "logits/rejected")


def sft_rows(vocab: int, n: int, completion: bool, seed: int = 5) -> list[dict]:
    """``n`` pre-tokenized rows of lengths 9..29 (ids from 3: 0..2 are the tokenizer's special
    tokens); ``completion``: labels -100 on each row's first half (the prompt)."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(9, 30, (n,), generator=gen).tolist()
    out = []
    for k in lengths:
        ids = torch.randint(3, vocab, (k,), generator=gen).tolist()
        row = {"input_ids": ids}
        if completion:
            row["labels"] = [-100] * (k // 2) + ids[k // 2:]
        out.append(row)
    return out


class Rows(TrainerCallback):
    """The training log rows (those with a loss)."""

    def __init__(self) -> None:
        self.rows: list[dict] = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss" in logs:
            self.rows.append({k: logs[k] for k in LOGGED if k in logs})


def preference_rows(vocab: int, n: int, seed: int = 6) -> list[dict]:
    """``n`` preference pairs: a prompt of 3..11 tokens, a chosen and a rejected completion of
    2..13 tokens each (text of the tokenizer's words; DPO tokenizes it and adds EOS)."""
    gen = torch.Generator().manual_seed(seed)

    def ids(lo: int, hi: int) -> list[int]:
        k = int(torch.randint(lo, hi, (1,), generator=gen))
        return torch.randint(3, vocab, (k,), generator=gen).tolist()

    def text(lo: int, hi: int) -> str:  # the word-level tokenizer's words: "t<id>"
        return " ".join(f"t{i}" for i in ids(lo, hi))

    return [{"prompt": text(3, 12), "chosen": text(2, 14), "rejected": text(2, 14)}
            for _ in range(n)]


def run_cases(argv: list[str], parse, train, base_of=None) -> None:
    """Each ``--case "NAME ARGS..."`` of ``argv`` (they take the rest of the command line) as one
    more run in these processes: the arguments before them plus ARGS (``base_of(case, base)``:
    other arguments before them for a case that asks), parsed by ``parse``, trained by
    ``train``, its results in the job's --out/NAME and output_dir/NAME."""
    from accelerate.state import AcceleratorState

    base = argv[:argv.index("--case")]
    job, args = parse(base)
    for spec in argv[argv.index("--case") + 1:]:
        name, *extra = shlex.split(spec)
        case, case_args = parse([*base, *extra])
        if base_of is not None and base_of(case, base) is not base:
            case, case_args = parse([*base_of(case, base), *extra])
        case.out = os.path.join(job.out, name)
        case_args.output_dir = os.path.join(args.output_dir, name)
        AcceleratorState._reset_state(False)  # a new TSP size needs a new parallelism config
        train(case, case_args)
