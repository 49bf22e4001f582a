"""Fine-tune a pretrained causal LM with TSP through the Lightning Trainer (docs/recipes.md).

    torchrun --nproc-per-node 8 examples/recipes/lightning_finetune.py \
        --model /models/Llama-3.1-8B --data tokens.bin --out runs/llama8b
    python examples/recipes/lightning_finetune.py ...      (Lightning starts the 8 processes)

The switch: ``import tsp_lightning`` and ``Trainer(strategy="tsp")`` (TSP over the processes of a
node; ``--tsp D``, ``--activation-offload`` and ``--tile-tokens N`` pass
``TSPStrategy(tsp_size=D, activation_offload=True, tile_tokens=N)``: docs/long-context.md). The
model is loaded in ``configure_model`` with ``tsp_transformers.load_pretrained`` on the
strategy's mesh, each rank reading only its slices of the safetensors files; the strategy then
leaves it as it is and shards every batch.
bf16 (``precision="bf16-true"``) on CUDA, activation checkpointing, AdamW, a checkpoint every
``--save-every`` steps (a tsp_core checkpoint directory, resumable at any TSP degree),
``--resume`` from the latest, and TSP's figures in the CSV log (``<out>/lightning_logs``).
Data format and flags: common.py.
"""

from __future__ import annotations

import os

import lightning as L
import torch
from common import TokenRows, data_parallel_sampler, long_context, parse_args, report
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from torch.utils.data import DataLoader

import tsp_core
import tsp_lightning  # registers strategy="tsp"
from tsp_transformers import load_pretrained

PRECISION = {"bfloat16": "bf16-true", "float32": "32-true", "float64": "64-true"}


class FineTune(L.LightningModule):
    def __init__(self, a) -> None:
        super().__init__()
        self.a, self.model = a, None

    def configure_model(self) -> None:
        if self.model is None:  # the strategy's mesh exists from here on; the strategy leaves
            self.model = load_pretrained(self.a.model, mesh=self.trainer.strategy.tsp_mesh,
                                         dtype=self.a.torch_dtype,   # a converted model alone
                                         **long_context(self.a))
            self.model.activation_checkpointing_enable(
                activation_checkpointing_kwargs={"use_reentrant": False})
            self.model.train()

    def training_step(self, batch, batch_idx):
        loss = self.model(**batch).loss                  # batch already sharded by the strategy
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.a.lr, weight_decay=0.0)

    def train_dataloader(self) -> DataLoader:
        # called after a resumed checkpoint is restored: start after the rows already trained
        # on (Lightning restarts a plain loader's epoch). Our own sampler keeps the file's order
        # (Lightning's injected one shuffles training data): every rank of a TSP group the same
        # rows, each data-parallel replica its own
        mesh = self.trainer.strategy.tsp_mesh
        rows = TokenRows(self.a, self.model.config.vocab_size,
                         start=self.trainer.global_step * self.a.batch * mesh.dp_size)
        return DataLoader(rows, batch_size=self.a.batch, sampler=data_parallel_sampler(rows, mesh))


class PrintRows(Callback):
    """Each step's loss and TSP's figures (from the monitor, which runs first) as common.report
    prints them."""

    def __init__(self, a, monitor: tsp_lightning.TSPMonitor) -> None:
        self.a, self.monitor = a, monitor

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        report(self.a, trainer.global_step, float(outputs["loss"]), self.monitor.last,
               log_file=False)                            # the CSV logger has them


def nodes() -> int:
    """Nodes of the job: torchrun's WORLD_SIZE / LOCAL_WORLD_SIZE, else Slurm's node count."""
    if "LOCAL_WORLD_SIZE" in os.environ:
        return int(os.environ["WORLD_SIZE"]) // int(os.environ["LOCAL_WORLD_SIZE"])
    return int(os.environ.get("SLURM_JOB_NUM_NODES", "1"))


def main(argv: list[str] | None = None) -> None:
    a = parse_args(__doc__, argv, extra=(("--nodes", dict(type=int, default=nodes())),))
    options = dict(tsp_size=a.tsp if a.tsp_given else None, **long_context(a))
    # the name when nothing is set: Lightning refuses precision="64-true" for a strategy object
    strategy = tsp_lightning.TSPStrategy(**options) if any(options.values()) else "tsp"  # <- switch
    monitor = tsp_lightning.TSPMonitor()
    checkpoints = ModelCheckpoint(dirpath=os.path.join(a.out, "checkpoints"), save_top_k=-1,
                                  every_n_train_steps=a.save_every)
    trainer = L.Trainer(accelerator="gpu" if torch.cuda.is_available() else "cpu",
                        devices=int(os.environ.get("LOCAL_WORLD_SIZE", torch.cuda.device_count()
                                                   or 2)),
                        num_nodes=a.nodes, strategy=strategy, precision=PRECISION[a.dtype],
                        max_steps=a.steps, gradient_clip_val=1.0, log_every_n_steps=1,
                        logger=CSVLogger(a.out), callbacks=[monitor, PrintRows(a, monitor),
                                                            checkpoints],
                        use_distributed_sampler=False, enable_progress_bar=False)
    latest = tsp_core.latest_checkpoint(checkpoints.dirpath) if a.resume else None
    trainer.fit(FineTune(a), ckpt_path=latest)


if __name__ == "__main__":
    with tsp_core.run_cleanly():  # barrier, destroy the groups, exit 0 (docs/cluster.md)
        main()
