"""Lightning + TSP: the usual LightningModule around a Hugging Face Llama; one import and
``strategy="tsp"`` turn TSP on.

    python examples/lightning_llama.py                          (Lightning starts 2 CPU processes)
    torchrun --standalone --nproc_per_node 2 examples/lightning_llama.py
    python examples/lightning_llama.py --fabric                 (the same training with Fabric)

The module's ``model`` attribute holds the transformers model, so the strategy converts it and
shards every batch; ``training_step`` is the same code that runs without TSP. The strategy logs
TSP's figures (``tsp/comm_mib``, ``tsp/wait_frac``, ``tsp/tokens_per_s``, peak memory:
docs/monitoring.md) to the Trainer's logger (a CSVLogger in ``--log-dir`` here) every
``log_every_n_steps``; with Fabric the loop logs them itself with ``fabric.log_dict``. Rank 0
prints the last figures at the end.
"""

from __future__ import annotations

import argparse
import os

import lightning as L
import torch
from lightning.pytorch.loggers import CSVLogger
from torch.utils.data import DataLoader, Dataset
from transformers import LlamaConfig, LlamaForCausalLM

import tsp_core
import tsp_lightning  # registers strategy="tsp"


class RandomTokens(Dataset):
    def __init__(self, rows: int, seq: int, vocab: int) -> None:
        self.ids = torch.randint(0, vocab, (rows, seq), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


class LitLlama(L.LightningModule):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model = LlamaForCausalLM(config)

    def training_step(self, batch, batch_idx):
        loss = self.model(**batch).loss          # unchanged with or without TSP
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=3e-4)


def train_with_fabric(a, config: LlamaConfig) -> None:
    """The same training as a Fabric loop: ``fabric.log_dict`` sends TSP's figures to the logger."""
    fabric = L.Fabric(accelerator="cpu", devices=a.devices, strategy=a.strategy,
                      precision=a.precision, loggers=CSVLogger(a.log_dir, name="fabric"))
    fabric.launch()
    torch.manual_seed(0)
    model = fabric.setup_module(LlamaForCausalLM(config))
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=3e-4))
    loader = fabric.setup_dataloaders(DataLoader(RandomTokens(64, a.seq, config.vocab_size),
                                                 batch_size=2))
    meter = tsp_core.metrics.StepMetrics(getattr(fabric.strategy, "tsp_mesh", None))
    meter.start()
    for step, batch in zip(range(1, a.steps + 1), loader):
        loss = model(**batch).loss               # unchanged with or without TSP
        fabric.backward(loss)
        fabric.clip_gradients(model, optimizer, max_norm=1.0)
        optimizer.step()
        optimizer.zero_grad()
        figures = meter.read(step)               # per step since the previous read
        fabric.log_dict({"train_loss": loss.item(), **figures}, step=step)
    fabric.logger.finalize("success")            # Fabric's CSVLogger writes its file here
    if fabric.global_rank == 0:
        print(f"final train_loss {loss.item():.4f}")
        print(tsp_core.metrics.summary(figures))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--strategy", default="tsp", help='"tsp", or "auto" for the plain run')
    ap.add_argument("--devices", type=int, default=int(os.environ.get("LOCAL_WORLD_SIZE", 2)))
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--precision", default="32-true")
    ap.add_argument("--log-dir", default="lightning_logs")
    ap.add_argument("--fabric", action="store_true", help="train with Fabric instead")
    a = ap.parse_args()
    config = LlamaConfig(vocab_size=4096, hidden_size=256, intermediate_size=704,
                         num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
                         max_position_embeddings=a.seq)
    if a.fabric:
        return train_with_fabric(a, config)
    trainer = L.Trainer(accelerator="cpu", devices=a.devices, strategy=a.strategy,
                        precision=a.precision, max_steps=a.steps,
                        logger=CSVLogger(a.log_dir, name="trainer"), enable_checkpointing=False,
                        gradient_clip_val=1.0, log_every_n_steps=1)
    trainer.fit(LitLlama(config), DataLoader(RandomTokens(64, a.seq, config.vocab_size),
                                              batch_size=2))
    if trainer.global_rank == 0:
        print(f"final train_loss {float(trainer.callback_metrics['train_loss']):.4f}")
        monitor = next((c for c in trainer.callbacks if isinstance(c, tsp_lightning.TSPMonitor)),
                       None)
        if monitor is not None:
            print(tsp_core.metrics.summary(monitor.last))


if __name__ == "__main__":
    with tsp_core.run_cleanly():  # barrier, destroy the groups, exit 0 (docs/cluster.md)
        main()
