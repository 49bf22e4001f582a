"""The adapters when the ranks of a TSP group get different batches: under torchrun with 2
processes (tsp 2), one tiny run each of TSPTrainer (a dataset whose rows depend on the rank: a
custom loader), TSPAccelerator (the same) and Lightning's Trainer with strategy "tsp" (a
``DistributedSampler`` over the whole world, with ``use_distributed_sampler=False``), in the same
processes. Each must raise the fingerprint error at its first step on every rank; each rank writes
the messages (``rank<R>.json`` in ``--out``) and how many steps ran."""

from __future__ import annotations

import argparse
import json
import os

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, DistributedSampler

from tests.support.hf_models import build

STEPS: list[str] = []


def rows(seed: int, n: int = 4) -> list[dict]:
    ids = torch.randint(0, 96, (n, 16), generator=torch.Generator().manual_seed(seed))
    return [{"input_ids": r, "labels": r} for r in ids]


def first_error(name: str, run) -> str:
    """Run one adapter; it must raise the agreed ValueError before any step finished."""
    before = len(STEPS)
    try:
        run()
    except ValueError as e:
        assert len(STEPS) == before, f"{name}: {len(STEPS) - before} steps ran before the error"
        return str(e)
    raise AssertionError(f"{name}: no error with different batches on the ranks of a TSP group")


def trainer(out: str) -> None:
    from transformers import TrainerCallback

    from tsp_transformers import TSPTrainer, TSPTrainingArguments

    class Steps(TrainerCallback):
        def on_step_end(self, *args, **kwargs):
            STEPS.append("trainer")

    args = TSPTrainingArguments(output_dir=os.path.join(out, "trainer"), tsp_size=2, max_steps=2,
                                per_device_train_batch_size=2, report_to=[], save_strategy="no",
                                use_cpu=True, disable_tqdm=True)
    data = rows(seed=10 + dist.get_rank() if dist.is_initialized() else 10)
    TSPTrainer(model=build("llama", torch.float32), args=args, train_dataset=data,
               callbacks=[Steps()]).train()


def accelerate() -> None:
    from accelerate.state import AcceleratorState

    from tsp_accelerate import TSPAccelerator

    AcceleratorState._reset_state()  # the Trainer's accelerator state: a new one for this run
    acc = TSPAccelerator(tsp_size=2)
    model = build("llama", torch.float32)
    model, opt = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    loader = acc.prepare(DataLoader(rows(seed=20 + dist.get_rank()), batch_size=2))
    for batch in loader:
        acc.backward(model(**batch).loss)
        opt.step()
        opt.zero_grad()
        STEPS.append("accelerate")


def lightning() -> None:
    import lightning as L

    from tsp_lightning import TSPStrategy

    class Lit(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = build("llama", torch.float32)

        def training_step(self, batch, batch_idx):
            return self.model(**batch).loss

        def on_train_batch_end(self, *args) -> None:
            STEPS.append("lightning")

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    data = rows(seed=30, n=8)
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=TSPStrategy(tsp_size=2),
                        max_steps=2, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False,
                        use_distributed_sampler=False)
    # the usual mistake: a sampler over every rank, not over the data-parallel ranks
    trainer.fit(Lit(), DataLoader(data, batch_size=2, sampler=DistributedSampler(data,
                                                                                 shuffle=False)))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    out = ap.parse_args().out
    msgs = {"trainer": first_error("trainer", lambda: trainer(out)),
            "accelerate": first_error("accelerate", accelerate),
            "lightning": first_error("lightning", lightning)}
    with open(os.path.join(out, f"rank{dist.get_rank()}.json"), "w") as f:
        json.dump(msgs, f)


if __name__ == "__main__":
    main()
