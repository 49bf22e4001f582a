"""Evaluation with metrics through the transformers Trainer: the plain Trainer on one process
(python), or TSPTrainer with --tsp_size under torchrun, on a tiny float64 Llama saved with
save_pretrained. Five rows of 23 tokens (23 pads to 24 under TSP; batches of 2 leave an uneven final
batch, and at dp 2 rows repeated to fill it). Runs, in order: evaluate() with logit-based metrics,
evaluate() with preprocess_logits_for_metrics returning argmax ids, evaluate() without
compute_metrics and with prediction_loss_only (loss only), predict() with and without labels, and
predict() on packed rows (DataCollatorWithFlattening). Every rank writes what it computed to
--out/rank{N}.json (+ .npz of the predictions)."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

import numpy as np
import torch
from transformers import AutoModelForCausalLM, DataCollatorWithFlattening, HfArgumentParser

import tsp_core
from tsp_transformers import TSPTrainer, TSPTrainingArguments

ROWS, SEQ = 5, 23
PACKED_LENGTHS = (5, 9, 3, 8)  # 2 documents per eval batch: packed rows of 14 and 11 tokens


@dataclass
class JobArgs:
    model_path: str = field(default="")
    out: str = field(default="")


def packed_documents(vocab: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(12)
    return [torch.randint(0, vocab, (n,), generator=gen) for n in PACKED_LENGTHS]


def log_softmax(x: np.ndarray) -> np.ndarray:
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


def token_metrics(p) -> dict:
    """Next-token accuracy and the mean log-probability of the label: a wrong logit changes it."""
    logits, labels = p.predictions[:, :-1], p.label_ids[:, 1:]
    mask = labels != -100
    safe = np.where(mask, labels, 0)[..., None]
    picked = np.take_along_axis(log_softmax(logits), safe, -1)[..., 0]
    return {"accuracy": float((logits.argmax(-1) == labels)[mask].mean()),
            "label_logprob": float(picked[mask].mean())}


def argmax_ids(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return logits.argmax(-1)


def id_metrics(p) -> dict:
    ids, labels = p.predictions[:, :-1], p.label_ids[:, 1:]
    mask = labels != -100
    order = np.arange(1, ids.size + 1).reshape(ids.shape)  # a wrong id or order changes it
    return {"accuracy": float((ids == labels)[mask].mean()), "rows": int(ids.shape[0]),
            "id_checksum": float((ids * order).sum())}


def main() -> None:
    job, args = HfArgumentParser((JobArgs, TSPTrainingArguments)).parse_args_into_dataclasses()
    model = AutoModelForCausalLM.from_pretrained(job.model_path, dtype=torch.float64)
    gen = torch.Generator().manual_seed(11)
    ids = torch.randint(0, model.config.vocab_size, (ROWS, SEQ), generator=gen)
    data = [{"input_ids": r, "labels": r} for r in ids]
    trainer = TSPTrainer(model=model, args=args, eval_dataset=data, compute_metrics=token_metrics)

    calls = {"n": 0}
    real = tsp_core.full_logits

    def counted(*a, **kw):
        calls["n"] += 1
        return real(*a, **kw)

    tsp_core.full_logits = counted
    out: dict = {"metrics": trainer.evaluate()}
    out["metrics_calls"] = calls["n"]
    trainer.compute_metrics, trainer.preprocess_logits_for_metrics = id_metrics, argmax_ids
    out["argmax"] = trainer.evaluate()
    trainer.compute_metrics, trainer.preprocess_logits_for_metrics = None, None
    calls["n"] = 0
    out["loss_only"] = trainer.evaluate()
    trainer.compute_metrics = token_metrics
    trainer.args.prediction_loss_only = True
    out["prediction_loss_only"] = trainer.evaluate()
    out["loss_only_calls"] = calls["n"]  # neither of the two computed any logits
    trainer.args.prediction_loss_only = False
    pred = trainer.predict(data)
    unlabelled = trainer.predict([{"input_ids": r} for r in ids])
    out["predict_metrics"] = pred.metrics
    docs = packed_documents(model.config.vocab_size)
    trainer.data_collator, trainer.compute_metrics = DataCollatorWithFlattening(), None
    packed = trainer.predict([{"input_ids": d.tolist()} for d in docs])
    for name, m in out.items():
        if isinstance(m, dict):
            out[name] = {k: v for k, v in m.items() if not k.endswith(("_runtime", "_per_second"))}
    rank = trainer.args.process_index
    os.makedirs(job.out, exist_ok=True)
    with open(os.path.join(job.out, f"rank{rank}.json"), "w") as f:
        json.dump(out, f)
    np.savez(os.path.join(job.out, f"rank{rank}.npz"), predictions=pred.predictions,
             label_ids=pred.label_ids, unlabelled=unlabelled.predictions, packed=packed.predictions,
             input_ids=ids.numpy())


if __name__ == "__main__":
    main()
