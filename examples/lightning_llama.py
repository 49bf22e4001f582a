"""Lightning + TSP: the usual LightningModule around a Hugging Face Llama; one import and
``strategy="tsp"`` turn TSP on.

    python examples/lightning_llama.py                          (Lightning starts 2 CPU processes)
    torchrun --standalone --nproc_per_node 2 examples/lightning_llama.py

The module's ``model`` attribute holds the transformers model, so the strategy converts it and
shards every batch; ``training_step`` is the same code that runs without TSP.
"""

from __future__ import annotations

import argparse
import os

import lightning as L
import torch
import tsp_lightning  # noqa: F401  (registers strategy="tsp")
from torch.utils.data import DataLoader, Dataset
from transformers import LlamaConfig, LlamaForCausalLM

import tsp_core


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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--strategy", default="tsp", help='"tsp", or "auto" for the plain run')
    ap.add_argument("--devices", type=int, default=int(os.environ.get("LOCAL_WORLD_SIZE", 2)))
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--precision", default="32-true")
    a = ap.parse_args()
    config = LlamaConfig(vocab_size=4096, hidden_size=256, intermediate_size=704,
                         num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
                         max_position_embeddings=a.seq)
    trainer = L.Trainer(accelerator="cpu", devices=a.devices, strategy=a.strategy,
                        precision=a.precision, max_steps=a.steps, logger=False,
                        enable_checkpointing=False, gradient_clip_val=1.0, log_every_n_steps=1)
    trainer.fit(LitLlama(config), DataLoader(RandomTokens(64, a.seq, config.vocab_size),
                                              batch_size=2))
    if trainer.global_rank == 0:
        print(f"final train_loss {float(trainer.callback_metrics['train_loss']):.4f}")


if __name__ == "__main__":
    with tsp_core.run_cleanly():  # barrier, destroy the groups, exit 0 (docs/cluster.md)
        main()
