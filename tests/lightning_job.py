"""A Lightning (Trainer or Fabric) training job on a tiny random-init HF Llama, run as a script so
that Lightning starts its own processes. Rank 0 writes the per-step losses, the logged losses and
the final full weights to --out."""

from __future__ import annotations

import argparse
import json
import os

import lightning as L
import torch
import tsp_lightning  # registers strategy="tsp"
from torch.utils.data import DataLoader, Dataset, DistributedSampler
from transformers import DataCollatorWithFlattening

import tsp_core
from tsp_core.parallelize import TSPCausalLM

VOCAB, SEQ = 96, 24


def build_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64))


class Sequences(Dataset):
    """``rows`` sequences, batches of 2."""

    def __init__(self, rows: int = 4) -> None:
        gen = torch.Generator().manual_seed(11)
        self.ids = torch.randint(0, VOCAB, (rows, SEQ), generator=gen)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


class Documents(Dataset):
    """``rows`` documents of different lengths, packed into rows by DataCollatorWithFlattening."""

    def __init__(self, rows: int = 4) -> None:
        gen = torch.Generator().manual_seed(12)
        lengths = torch.randint(1, 30, (rows,), generator=gen).tolist()
        self.docs = [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in lengths]

    def __len__(self) -> int:
        return len(self.docs)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.docs[i]}


class LitLlama(L.LightningModule):
    def __init__(self, unsupported_model: bool = False) -> None:
        super().__init__()
        if unsupported_model:  # a transformers model no TSP policy describes
            from transformers import GPT2Config, GPT2LMHeadModel

            self.model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=VOCAB))
        else:
            self.model = build_llama()
        self.losses: list[float] = []
        self.logged: list[float] = []

    def training_step(self, batch, batch_idx):
        loss = self.model(**batch).loss
        self.log("train_loss", loss, on_step=True, sync_dist=True)
        self.losses.append(loss.item())
        return loss

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", self.model(**batch).loss, sync_dist=True)

    def test_step(self, batch, batch_idx):
        self.log("test_loss", self.model(**batch).loss, sync_dist=True)

    def predict_step(self, batch, batch_idx):
        return self.model(**{k: v for k, v in batch.items() if k != "shift_labels"}).logits.shape

    def on_train_batch_end(self, outputs, batch, batch_idx) -> None:
        self.logged.append(float(self.trainer.callback_metrics["train_loss"]))

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def full_weights(model) -> dict:
    if isinstance(model, TSPCausalLM):
        return tsp_core.full_state_dict(model, rank0_only=True)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def run_trainer(a) -> dict:
    module = LitLlama(a.bad_model)
    data = Documents(a.rows) if a.packed else Sequences(a.rows)
    collate = DataCollatorWithFlattening() if a.packed else None
    single = a.strategy == "auto"
    # distributed runs get Lightning's injected sampler (data parallel only, shuffled, seed 0);
    # the one-process reference gets the same sampler explicitly, so both see the same order
    sampler = DistributedSampler(data, num_replicas=1, rank=0, shuffle=True) if single else None
    strategy = tsp_lightning.TSPStrategy(tsp_size=a.tsp_size) if a.tsp_size else a.strategy
    # with --ckpt-dir: a checkpoint after every epoch (2 steps), once the epoch has ended
    callbacks = [L.pytorch.callbacks.ModelCheckpoint(
        dirpath=a.ckpt_dir, filename="{epoch}", every_n_epochs=1, save_top_k=-1,
        save_on_train_epoch_end=True)] if a.ckpt_dir else []
    trainer = L.Trainer(accelerator="cpu", devices=a.devices, strategy=strategy,
                        precision=a.precision, max_steps=a.steps, logger=False,
                        enable_checkpointing=bool(a.ckpt_dir), enable_progress_bar=False,
                        enable_model_summary=False, gradient_clip_val=a.clip,
                        use_distributed_sampler=not single, callbacks=callbacks)
    trainer.fit(module, DataLoader(data, batch_size=2, sampler=sampler, collate_fn=collate),
                ckpt_path=a.resume)
    weights = full_weights(module.model)
    loader = DataLoader(data, batch_size=2, collate_fn=collate)
    val = trainer.validate(module, loader, verbose=False)[0]["val_loss"]
    test = trainer.test(module, loader, verbose=False)[0]["test_loss"]
    shapes = [list(s) for s in trainer.predict(module, loader)]
    if a.export:
        trainer.strategy.export_hf(a.export)
    return dict(losses=module.losses, logged=module.logged, weights=weights, val=val, test=test,
                predict_shapes=shapes, rank=trainer.global_rank)


def run_fabric(a) -> dict:
    fabric = L.Fabric(accelerator="cpu", devices=a.devices, strategy=a.strategy,
                      precision=a.precision)
    fabric.launch()
    model = build_llama()
    model = fabric.setup_module(model)
    opt = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-3))
    loader = fabric.setup_dataloaders(DataLoader(Sequences(), batch_size=2))
    losses = []
    while len(losses) < a.steps:
        for batch in loader:
            loss = model(**batch).loss
            fabric.backward(loss)
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
            if len(losses) == a.steps:
                break
    return dict(losses=losses, logged=losses, weights=full_weights(model.module),
                rank=fabric.global_rank)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", choices=["trainer", "fabric"], default="trainer")
    ap.add_argument("--strategy", default="tsp")
    ap.add_argument("--devices", type=int, default=2)
    ap.add_argument("--precision", default="32-true")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--clip", type=float, default=None)
    ap.add_argument("--resume", default=None)
    ap.add_argument("--ckpt-dir", default=None)
    ap.add_argument("--rows", type=int, default=4)
    ap.add_argument("--packed", action="store_true")
    ap.add_argument("--export", default=None)
    ap.add_argument("--tsp-size", type=int, default=None)
    ap.add_argument("--bad-model", action="store_true")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    res = run_trainer(a) if a.mode == "trainer" else run_fabric(a)
    if res["rank"] == 0:
        os.makedirs(a.out, exist_ok=True)
        torch.save(res.pop("weights"), os.path.join(a.out, "weights.pt"))
        with open(os.path.join(a.out, "result.json"), "w") as f:
            json.dump(res, f)


if __name__ == "__main__":
    main()
    # Lightning starts the other ranks by re-running this script, so every rank ends here: tear the
    # groups down together and skip interpreter finalisation, where gloo can abort (see
    # tests/exit_cleanly.py)
    from exit_cleanly import finish

    finish(0)
