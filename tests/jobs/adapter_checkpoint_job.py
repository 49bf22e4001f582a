"""Adapter checkpoints that reshard: one script, one launch per world size, every adapter in turn.

``--phase save`` (2 processes, TSP degree 2, data parallel 1): each adapter trains 4 steps from the
same float64 model and global batches, saving its checkpoint after step 2 the way its users do;
the 4 steps are the uninterrupted run. ``--phase resume`` (1 process: TSP degree 1, and plain
models; 4 processes: TSP degree 2 x data parallel 2) loads those checkpoints and trains steps 3-4.
Global batches are the same at every data-parallel size (each replica takes its share of the
rows; see tests/integrations/test_adapter_checkpoints.py for how each framework's sampler gives
that). Every rank writes, per run, its per-step losses, full-gradient norms (and learning rates)
and its final full weights to ``--out`` (``result-<rank>.json``, ``weights-<rank>.pt``), so the
test checks every rank's. Each ``--broken "KINDS --ckpt DIR --out DIR"`` is one more pass of the
phase in the same processes with deliberately broken variants applied (comma-separated KINDS, see
:func:`break_on_purpose`), its results in its own ``--out``; the test expects its own comparisons
to fail on them. A broken run that raises records the error (``errors``, by framework) instead of
its results. Each framework's broken runs follow its good ones and are mended before the next
framework runs, so a good run never sees a broken variant (and no launch is paid for them).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException
from torch.utils.data import DataLoader, DistributedSampler

import tsp_core
from tests.support import hf_models
from tsp_core.distributed.params import ShardedModule
from tsp_core.models import TSPCausalLM

# vocabulary 101, padded to 102 at tsp 2: the local layout is not the full one
FAMILY = "llama-tied"
# float64 models; Lightning's "32-true" leaves the module's dtype as it is (its
# ModelParallelStrategy refuses "64-true")
STEPS, SAVE_AT, BEST = 4, 2, 2
SEQ = 16


def world() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def rank() -> int:
    return int(os.environ.get("RANK", "0"))


def tsp_degree() -> int:
    return 1 if world() == 1 else 2


def rows(n: int) -> torch.Tensor:
    return torch.randint(0, 101, (n, SEQ), generator=torch.Generator().manual_seed(7))


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    return getattr(model, "module", model)


def full_grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Gradients under the parameters' Hugging Face names and full shapes (every rank gathers)."""
    model = unwrap(model)
    names = dict(model.named_parameters())
    if not any(isinstance(m, ShardedModule) for m in model.modules()):
        return {n: p.grad for n, p in names.items()}
    out = {}
    for prefix, m in model.named_modules(remove_duplicate=False):
        if isinstance(m, ShardedModule):
            for name, g in m.full_tensors(grads=True).items():
                out[f"{prefix}.{name}" if prefix else name] = g
    return {n: g for n, g in out.items() if n in names}


def grad_norm(model: torch.nn.Module) -> float:
    """The full gradient's norm: a gradient D or dp times too large shows here (AdamW would hide
    it in the weights)."""
    return torch.linalg.vector_norm(torch.stack(
        [torch.linalg.vector_norm(g) for g in full_grads(model).values()])).item()


def full_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    model = unwrap(model)
    if any(isinstance(m, ShardedModule) for m in model.modules()):
        return tsp_core.full_state_dict(model)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def loss_of(model: torch.nn.Module, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The TSP model's loss; for a plain model the float64 cross-entropy of its logits
    (transformers' own loss casts logits to float32)."""
    if any(isinstance(m, TSPCausalLM) for m in unwrap(model).modules()):
        return model(input_ids=ids, labels=labels).loss
    return hf_models.reference_loss(unwrap(model), ids, labels)


# ------------------------------------------------------------------------------ Lightning

def train(model, opt, steps, loss_at, backward, sched=None, after=None) -> dict:
    """One run of ``steps``: the loss of each step (``loss_at(step)``), ``backward`` of it, the
    gradient norm, the optimizer (and scheduler) step; ``after(step)`` ends each step (saving).
    Returns the losses, norms (and learning rates) of the steps."""
    out: dict = {"losses": [], "norms": []} | ({"lrs": []} if sched else {})
    for step in steps:
        loss = loss_at(step)
        backward(loss)
        out["norms"].append(grad_norm(model))
        opt.step()
        if sched is not None:
            sched.step()
            out["lrs"].append(sched.get_last_lr()[0])
        opt.zero_grad()
        out["losses"].append(loss.item())
        if after is not None:
            after(step)
    return out


def lightning_runs(a, results: dict) -> None:
    import lightning as L

    import tsp_lightning

    class Lit(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = hf_models.build(FAMILY, torch.float64)
            self.losses: list[float] = []
            self.norms: list[float] = []
            self.lrs: list[float] = []

        def training_step(self, batch, batch_idx):
            if isinstance(self.model, TSPCausalLM):
                loss = self.model(**batch).loss
            else:
                loss = hf_models.reference_loss(self.model, batch["input_ids"], batch["labels"])
            self.losses.append(loss.item())
            return loss

        def on_before_optimizer_step(self, optimizer) -> None:
            self.norms.append(grad_norm(self.model))
            self.lrs.append(optimizer.param_groups[0]["lr"])

        def configure_optimizers(self):
            opt = torch.optim.AdamW(self.parameters(), lr=1e-2)
            sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    class OneFile(L.Callback):
        """A one-file checkpoint (save_distributed_checkpoint=False) at the same point as the
        ModelCheckpoint's directory."""

        def __init__(self, path: str) -> None:
            self.path = path

        def on_train_epoch_end(self, trainer, module) -> None:
            if trainer.global_step == SAVE_AT:
                trainer.strategy._save_distributed_checkpoint = False
                try:
                    trainer.save_checkpoint(self.path)
                finally:
                    trainer.strategy._save_distributed_checkpoint = True

    # one global batch of 4 rows per epoch (each data-parallel replica takes every dp-th row of
    # the sampler's permutation); the checkpoint is written at the end of epoch 1 (step 2).
    # Lightning does not fast-forward a non-stateful loader on resume: it restarts the epoch's
    # iterator and counts the batches already done, so with more batches per epoch a resumed run
    # sees other batches than the uninterrupted one, with or without TSP (seen here)
    data = [{"input_ids": r, "labels": r} for r in rows(4)]
    ckpt = os.path.join(a.ckpt, "lightning")
    onefile = os.path.join(a.ckpt, "lightning-onefile.ckpt")

    def fit(name: str, strategy, resume: str | None, callbacks=()) -> None:
        plain = strategy == "auto"
        dp = world() // (1 if plain else strategy._tensor_parallel_size)
        module = Lit()
        sampler = DistributedSampler(data, num_replicas=1, rank=0, shuffle=True) if plain else None
        trainer = L.Trainer(accelerator="cpu", devices=world(), strategy=strategy,
                            precision="32-true", max_steps=STEPS, logger=False,
                            enable_checkpointing=bool(callbacks), enable_progress_bar=False,
                            enable_model_summary=False, use_distributed_sampler=not plain,
                            callbacks=list(callbacks))
        trainer.fit(module, DataLoader(data, batch_size=4 // dp, sampler=sampler), ckpt_path=resume)
        results[name] = dict(losses=module.losses, norms=module.norms, lrs=module.lrs,
                             weights=full_weights(module.model))

    if a.phase == "save":
        fit("lightning", tsp_lightning.TSPStrategy(tsp_size=2), None, [
            L.pytorch.callbacks.ModelCheckpoint(dirpath=ckpt, filename="{epoch}", every_n_epochs=1,
                                                save_top_k=-1, save_on_train_epoch_end=True),
            OneFile(onefile)])
        return
    step2 = os.path.join(ckpt, "epoch=1.ckpt")
    fit(f"lightning_tsp{tsp_degree()}", tsp_lightning.TSPStrategy(tsp_size=tsp_degree()), step2)
    if world() == 1:  # the one-file checkpoint into the unmodified model (strategy "auto")
        fit("lightning_plain_onefile", "auto", onefile)
    else:
        fit("lightning_tsp2_onefile", tsp_lightning.TSPStrategy(tsp_size=2), onefile)


# ------------------------------------------------------------------------------ Fabric

def fabric_run(a, results: dict) -> None:
    import lightning as L

    from tsp_lightning import TSPFabricStrategy

    path, onefile = os.path.join(a.ckpt, "fabric"), os.path.join(a.ckpt, "fabric-onefile.ckpt")

    def run(name: str, tsp: int | None, resume: str | None) -> None:
        """``tsp=None``: the unmodified model under Fabric's own single-device strategy."""
        strategy = "auto" if tsp is None else TSPFabricStrategy(tsp_size=tsp)
        fabric = L.Fabric(accelerator="cpu", devices=world(), strategy=strategy,
                          precision="32-true")
        fabric.launch()
        model = fabric.setup_module(hf_models.build(FAMILY, torch.float64))
        opt = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-2))
        state = {"model": model, "optimizer": opt, "step": 0}
        if resume:
            fabric.load(resume, state)
        dp, dp_rank = world() // (tsp or 1), rank() // (tsp or 1)

        def loss_at(step: int) -> torch.Tensor:
            ids = rows(2 * STEPS)[2 * step:2 * step + 2].chunk(dp)[dp_rank]  # this replica's rows
            return loss_of(model, ids, ids)  # the TSP model shards full-sequence batches itself

        def save(step: int) -> None:
            if resume is None and step + 1 == SAVE_AT:
                state["step"] = SAVE_AT
                fabric.save(path, state)
                fabric.strategy._save_distributed_checkpoint = False  # and as one file
                fabric.save(onefile, state)
                fabric.strategy._save_distributed_checkpoint = True

        out = train(model, opt, range(state["step"], STEPS), loss_at, fabric.backward, after=save)
        results[name] = dict(**out, weights=full_weights(model))

    if a.phase == "save":
        run("fabric", 2, None)
    elif world() == 1:
        run("fabric_tsp1", 1, path)
        run("fabric_plain_onefile", None, onefile)
    else:
        run("fabric_tsp2", 2, path)
        run("fabric_tsp2_onefile", 2, onefile)


# ------------------------------------------------------------------------------ Accelerate

def accelerate_run(a, results: dict) -> None:
    from accelerate import DataLoaderConfiguration

    from tsp_accelerate import TSPAccelerator

    tsp = tsp_degree()
    # split_batches: the loader's batch is the global batch (2 rows), split over the data-parallel
    # replicas, and a prepared scheduler steps once per optimizer step, at every dp size. (Without
    # it Accelerate keeps the per-replica batch and steps the scheduler once per replica: a larger
    # global batch and a faster schedule at dp 2, by design.)
    accelerator = TSPAccelerator(tsp_size=tsp,
                                 dataloader_config=DataLoaderConfiguration(split_batches=True))

    def build(model):
        # SGD with momentum: the update is proportional to the gradient, so a wrong gradient
        # scale shows in the weights; the momentum buffers are the optimizer state to carry over
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        return opt, torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.7)

    model = hf_models.build(FAMILY, torch.float64)
    opt, sched = build(model)
    data = [{"input_ids": r, "labels": r} for r in rows(2 * STEPS)]
    # in order, 2 rows per step; at dp 2 each replica gets one of them (Accelerate's split)
    loader = DataLoader(data, batch_size=2)
    model, opt, loader, sched = accelerator.prepare(model, opt, loader, sched)
    path = os.path.join(a.ckpt, "accelerate")
    start = 0
    if a.phase == "resume":
        accelerator.load_state(path)
        start = SAVE_AT
        loader = accelerator.skip_first_batches(loader, SAVE_AT)
    batches = iter(loader)

    def save(step: int) -> None:
        if a.phase == "save" and step + 1 == SAVE_AT:
            accelerator.save_state(path)

    out = train(model, opt, range(start, STEPS), lambda _: model(**next(batches)).loss,
                accelerator.backward, sched, save)
    name = "accelerate" if a.phase == "save" else f"accelerate_tsp{tsp}"
    results[name] = dict(**out, weights=full_weights(model))

    if a.phase == "resume" and world() == 1:
        # the same checkpoint into the unmodified model and a plain optimizer and scheduler
        plain = hf_models.build(FAMILY, torch.float64, seed=5)
        plain_opt, plain_sched = build(plain)
        tsp_core.load_checkpoint(os.path.join(path, "tsp_model"), plain, plain_opt)
        plain_sched.load_state_dict(torch.load(os.path.join(path, "scheduler.bin")))
        def plain_loss(step: int) -> torch.Tensor:
            ids = rows(2 * STEPS)[2 * step:2 * step + 2]
            return hf_models.reference_loss(plain, ids, ids)

        out = train(plain, plain_opt, range(SAVE_AT, STEPS), plain_loss, torch.Tensor.backward,
                    plain_sched)
        results["accelerate_plain"] = dict(**out, weights=full_weights(plain))


# ------------------------------------------------------------------------------ TSPTrainer

def trainer_best(a, results: dict) -> None:
    """``load_best_model_at_end`` with a metric that makes step 2 of 4 the best."""
    from transformers import TrainerCallback

    from tsp_transformers import TSPTrainer, TSPTrainingArguments

    class Pick(TrainerCallback):
        """``eval_pick``: highest at step BEST (added to the metrics ``evaluate`` returns)."""

        def on_evaluate(self, args, state, control, metrics=None, **kwargs):
            metrics["eval_pick"] = -abs(state.global_step - BEST)

    out = os.path.join(a.ckpt, "trainer")
    args = TSPTrainingArguments(
        output_dir=out, tsp_size=str(tsp_degree()), max_steps=STEPS, per_device_train_batch_size=2,
        learning_rate=1e-2, eval_strategy="steps", eval_steps=1, save_strategy="steps",
        save_steps=1, load_best_model_at_end=True, metric_for_best_model="pick",
        greater_is_better=True, report_to="none", use_cpu=True, logging_steps=1, seed=0)
    data = [{"input_ids": r, "labels": r} for r in rows(2 * STEPS)]
    trainer = TSPTrainer(model=hf_models.build(FAMILY, torch.float64), args=args,
                         train_dataset=data, eval_dataset=data[:2], callbacks=[Pick()])
    trainer.train()
    results["trainer_best"] = dict(best=trainer.state.best_model_checkpoint,
                                   weights=full_weights(trainer.model))
    results["trainer"] = logged(trainer)  # weights: checkpoint-4


def logged(trainer, after: int = 0) -> dict[str, list[float]]:
    """The Trainer's logged losses (rounded to float32), gradient norms (the full gradient's,
    before clipping: float64) and learning rates of the steps after ``after`` (a resumed
    Trainer's history starts with the checkpoint's)."""
    rows = [e for e in trainer.state.log_history if "loss" in e and e["step"] > after]
    return dict(losses=[e["loss"] for e in rows], norms=[e["grad_norm"] for e in rows],
                lrs=[e["learning_rate"] for e in rows])


def float64_loss(outputs, labels, num_items_in_batch=None):
    """The plain Trainer's loss in float64 (transformers' own casts logits to float32)."""
    logits = outputs.logits[:, :-1].flatten(0, 1)
    total = torch.nn.functional.cross_entropy(logits, labels[:, 1:].flatten(), reduction="sum")
    return total / (num_items_in_batch if num_items_in_batch is not None else labels[:, 1:].numel())


def trainer_resume(a, results: dict) -> None:
    """TSPTrainer resumes the save phase's checkpoint-2 at TSP degree 1 (the plain Trainer: one
    process) or 2 x data parallel 2, with the global batch of 2 rows kept."""
    from tsp_transformers import TSPTrainer, TSPTrainingArguments

    tsp = tsp_degree()
    dp = world() // tsp
    args = TSPTrainingArguments(
        output_dir=os.path.join(a.ckpt, f"trainer-resumed-{world()}"), tsp_size=str(tsp),
        max_steps=STEPS, per_device_train_batch_size=2 // dp, learning_rate=1e-2,
        save_strategy="no", report_to="none", use_cpu=True, logging_steps=1, seed=0)
    data = [{"input_ids": r, "labels": r} for r in rows(2 * STEPS)]
    trainer = TSPTrainer(model=hf_models.build(FAMILY, torch.float64, seed=5), args=args,
                         train_dataset=data,
                         compute_loss_func=float64_loss if tsp == 1 else None)
    trainer.train(resume_from_checkpoint=os.path.join(a.ckpt, "trainer", f"checkpoint-{SAVE_AT}"))
    results[f"trainer_tsp{tsp}"] = dict(**logged(trainer, SAVE_AT),
                                        weights=full_weights(trainer.model))


def local_save_state(self, output_dir: str, **kwargs) -> str:
    """TSPAccelerator.save_state as it was: DCP of the local (padded) model and optimizer state."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    state = {}
    for i, (model, optims) in enumerate(self._checkpoint_pairs()):
        state[f"model_{i}"] = get_model_state_dict(model)
        if optims:
            state[f"optimizer_{i}"] = get_optimizer_state_dict(model, optims[0])
    dcp.save(state, checkpoint_id=os.path.join(output_dir, "dcp"))
    if self.is_main_process:
        torch.save({"step": self.step, "schedulers": [s.state_dict() for s in self._schedulers]},
                   os.path.join(output_dir, "accelerator_state.pt"))
    self.wait_for_everyone()
    return output_dir


def local_load_state(self, input_dir: str, **kwargs) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    pairs = self._checkpoint_pairs()
    state = {}
    for i, (model, optims) in enumerate(pairs):
        state[f"model_{i}"] = get_model_state_dict(model)
        if optims:
            state[f"optimizer_{i}"] = get_optimizer_state_dict(model, optims[0])
    dcp.load(state, checkpoint_id=os.path.join(input_dir, "dcp"))
    for i, (model, optims) in enumerate(pairs):
        set_model_state_dict(model, state[f"model_{i}"])
        if optims:
            set_optimizer_state_dict(model, optims[0], state[f"optimizer_{i}"])
    extra = torch.load(os.path.join(input_dir, "accelerator_state.pt"), weights_only=False)
    self.step = extra["step"]
    for sched, sd in zip(self._schedulers, extra["schedulers"]):
        sched.load_state_dict(sd)


def break_on_purpose(kind: str) -> list[tuple[object, str, object]]:
    """Broken variants: ``drop-optimizer`` (loads leave the optimizer state fresh), ``local-layout``
    (the Lightning strategies save and load through their base class again, TSPAccelerator as it
    did before: DCP of the padded local DTensors, which load only at the degree that wrote them),
    ``best-model`` (TSPTrainer does not load the best checkpoint at the end: the last weights
    stay). Returns what it replaced, for :func:`mend`: the same process runs good passes too."""
    import tsp_core.state.resharding as resharding

    replaced: list[tuple[object, str, object]] = []

    def replace(owner: object, name: str, value: object) -> None:
        replaced.append((owner, name, vars(owner).get(name, _INHERITED)))
        setattr(owner, name, value)

    if kind == "drop-optimizer":
        real = resharding.load_checkpoint

        def no_optimizer(path, model, optimizer=None, **kw):
            return real(path, model, None, **kw) if kw.get("model_state", True) else {}
        replace(resharding, "load_checkpoint", no_optimizer)
        replace(tsp_core, "load_checkpoint", no_optimizer)
    elif kind == "local-layout":
        from lightning.fabric.strategies import ModelParallelStrategy as FabricMP
        from lightning.pytorch.strategies import ModelParallelStrategy

        from tsp_accelerate import TSPAccelerator
        from tsp_lightning import TSPFabricStrategy, TSPStrategy

        for name in ("save_checkpoint", "load_checkpoint", "lightning_module_state_dict",
                     "optimizer_state"):
            replace(TSPStrategy, name, getattr(ModelParallelStrategy, name))
        for name in ("save_checkpoint", "load_checkpoint"):
            replace(TSPFabricStrategy, name, getattr(FabricMP, name))
        replace(TSPAccelerator, "save_state", local_save_state)
        replace(TSPAccelerator, "load_state", local_load_state)
    elif kind == "best-model":
        from tsp_transformers import TSPTrainer

        replace(TSPTrainer, "_load_best_model", lambda self: None)
    elif kind:
        raise ValueError(kind)
    return replaced


_INHERITED = object()  # an attribute the owner did not hold itself (a class's inherited one)


def mend(replaced: list[tuple[object, str, object]]) -> None:
    """Put back what :func:`break_on_purpose` replaced, last first."""
    for owner, name, original in reversed(replaced):
        if original is _INHERITED:
            delattr(owner, name)
        else:
            setattr(owner, name, original)


# Accelerate first: in one process it must not find a process group (it would wrap the model in
# DDP); Lightning and Fabric reuse the one that exists
FRAMEWORKS = {"accelerate": accelerate_run, "lightning": lightning_runs, "fabric": fabric_run,
              "trainer": trainer_best}


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser()
    ap.add_argument("--phase", choices=["save", "resume"], required=True)
    ap.add_argument("--ckpt", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--only", default=",".join(FRAMEWORKS))
    ap.add_argument("--broken", action="append", default=[],
                    help='"KINDS --ckpt DIR --out DIR [--only F,G]": one more pass of the same '
                         "phase in these processes with the broken variants KINDS (comma-"
                         "separated, see break_on_purpose) applied, its results in its --out")
    return ap


def passes(ap: argparse.ArgumentParser) -> list[argparse.Namespace]:
    """The good pass (the command line's, ``kinds`` empty) and each ``--broken`` one (``kinds``:
    its broken variants)."""
    a = ap.parse_args()
    out = [argparse.Namespace(**vars(a), kinds=[])]
    for spec in a.broken:
        kinds, *rest = shlex.split(spec)
        b = ap.parse_args(["--phase", a.phase, *rest])
        out.append(argparse.Namespace(**vars(b), kinds=kinds.split(",")))
    return out


def run_pass(a: argparse.Namespace, name: str, results: dict, errors: dict) -> None:
    """Framework ``name``'s runs of pass ``a``, its broken variants applied and then mended. A
    broken run may raise (DCP's CheckpointException is no Exception): its error is recorded,
    and the test sees the missing results; a good run's error ends the job."""
    run = trainer_resume if a.phase == "resume" and name == "trainer" else FRAMEWORKS[name]
    replaced = [r for kind in a.kinds for r in break_on_purpose(kind)]
    try:
        run(a, results)
    except (Exception, CheckpointException) as e:
        if not a.kinds:
            raise
        errors[name] = f"{type(e).__name__}: {e}"[-500:]  # the cause is at the end
    finally:
        mend(replaced)


def main() -> None:
    todo = passes(parser())
    outcome = [({}, {}) for _ in todo]  # per pass: results, errors
    # framework by framework, each one's good pass first (Accelerate's passes before any other
    # framework's: in one process they must not find a process group)
    for name in FRAMEWORKS:
        for a, (results, errors) in zip(todo, outcome):
            if name in a.only.split(","):
                run_pass(a, name, results, errors)
    for a, (results, errors) in zip(todo, outcome):
        os.makedirs(a.out, exist_ok=True)
        weights = {k: r.pop("weights") for k, r in results.items() if "weights" in r}
        torch.save(weights, os.path.join(a.out, f"weights-{rank()}.pt"))
        with open(os.path.join(a.out, f"result-{rank()}.json"), "w") as f:
            json.dump({**results, "errors": errors}, f)
    if dist.is_initialized():
        dist.barrier()


if __name__ == "__main__":
    main()
