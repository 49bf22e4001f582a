"""A Lightning (Trainer or Fabric) training job on a tiny random-init HF Llama, run as a script so
that Lightning starts its own processes (or under torchrun, which several runs can share: each
``--case "NAME ARGS..."`` is one more Trainer or Fabric run in the same processes, its results in
``--out``/NAME; a case with ``--fails`` must raise, and each rank records its error instead). Every
rank writes its per-step losses, logged losses and gradient norms
(``rank<R>.json``), the final full weights it holds and, with ``--record-grads``, the first
step's full gradients before clipping (``rank<R>_weights.pt``, ``rank<R>_grads0.pt``: each
data-parallel replica's own, gathered over its TSP group, so a replica that diverged shows).
``--compile BACKEND``: the TSP strategy's ``compile=BACKEND``; every rank also records which
decoder layers were compiled (:func:`layer_compiled`), the class of the strategy's model and
dynamo's graph breaks (``compiled``), and dynamo's ``trace_autograd_ops`` is restored and its
caches reset afterwards. ``--compile-module``: ``trainer.fit(torch.compile(module))``,
Lightning's way.
``--lora R``: the model a PEFT ``PeftModel`` (:func:`tests.support.hf_models.lora_model`); each
rank also records which parameters had a gradient at the first step and which have optimizer
state after the run.

The gradient norm is the one Lightning clips with: ``torch.nn.utils.clip_grad_norm_`` is wrapped
to record what it returns (Trainer: Lightning's precision plugin calls it; Fabric:
``fabric.clip_gradients`` returns it); under DeepSpeed it is the engine's
``get_global_grad_norm()``."""

from __future__ import annotations

import argparse
import json
import os
import shlex

import lightning as L
import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler
from transformers import DataCollatorWithFlattening

import tsp_core
import tsp_lightning  # registers strategy="tsp"
from tests.support.gather import full_grads
from tests.support.hf_models import build, lora_model
from tests.support.metrics_check import StepCounters
from tsp_core.distributed.model_state import find_model_state
from tsp_core.models import TSPCausalLM

VOCAB, SEQ = 96, 24

MOMENTUM = 0.9  # --optimizer sgd-momentum

NORMS: list[float] = []   # what torch.nn.utils.clip_grad_norm_ returned, per call (main() only)


def record_clip_grad_norm() -> None:
    """Wrap ``torch.nn.utils.clip_grad_norm_`` (Lightning's precision plugin looks it up at each
    call) so that the norm it clips by is recorded in :data:`NORMS`."""
    clip = torch.nn.utils.clip_grad_norm_

    def recording(*args, **kwargs):
        norm = clip(*args, **kwargs)
        NORMS.append(float(norm))
        return norm

    torch.nn.utils.clip_grad_norm_ = recording


def build_llama(kv_heads: int = 2, family: str = "llama"):
    return build(family, torch.float32, kv_heads=kv_heads)


class Sequences(Dataset):
    """``rows`` sequences of random tokens, or with ``pattern`` of a repeated pattern a model can
    learn (row i counts up from i modulo 12: the next token follows from the current one)."""

    def __init__(self, rows: int = 4, pattern: bool = False) -> None:
        gen = torch.Generator().manual_seed(11)
        if pattern:
            self.ids = (torch.arange(rows)[:, None] + torch.arange(SEQ)[None]) % 12
        else:
            self.ids = torch.randint(0, VOCAB, (rows, SEQ), generator=gen)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def global_batches(ids: torch.Tensor, dp: int, steps: int, shuffle: bool,
                   batch: int = 2) -> list[torch.Tensor]:
    """The rows each step trains on, over all data-parallel replicas: what a
    ``DistributedSampler(num_replicas=dp, seed=0)`` per replica gives, epoch e with
    ``set_epoch(e)`` (Lightning's injected sampler shuffles training data; Fabric's keeps a
    sequential loader's order), ``batch`` rows per replica and step."""
    samplers = [DistributedSampler(range(len(ids)), num_replicas=dp, rank=r, shuffle=shuffle,
                                   seed=0) for r in range(dp)]
    out, epoch = [], 0
    while len(out) < steps:
        lists = []
        for s in samplers:
            s.set_epoch(epoch)
            lists.append(list(s))
        for k in range(len(lists[0]) // batch):
            out.append(torch.cat([ids[rows[k * batch:(k + 1) * batch]] for rows in lists]))
        epoch += 1
    return out[:steps]


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


def strategy_name(a) -> str:
    """``--strategy``, or with ``--tsp-size D`` (or ``--timeout``) the TSP strategy registered
    under a name with that size: the Trainer refuses precision="64-true" for a
    ``ModelParallelStrategy`` *instance* (it checks the flag before the strategy is set up), not
    for a registered name such as "tsp"."""
    if not a.tsp_size and a.timeout is None:
        return a.strategy
    from datetime import timedelta

    from lightning.pytorch.strategies import StrategyRegistry

    name = (f"tsp_size_{a.tsp_size or 'all'}" + ("_no_metrics" if a.metrics_off else "")
            + (f"_compile_{a.compile}" if a.compile else "")
            + ("_fsdp" if a.fsdp else "") + (f"_mp_{a.fsdp_mp}" if a.fsdp_mp else "")
            + (f"_timeout_{a.timeout}" if a.timeout else "")
            + ("_offload" if a.activation_offload else ""))
    timeout = {} if a.timeout is None else {"timeout": timedelta(seconds=a.timeout)}
    StrategyRegistry.register(name, tsp_lightning.TSPStrategy, override=True, tsp_size=a.tsp_size,
                              metrics=not a.metrics_off, fsdp=a.fsdp, **fsdp_options(a),
                              activation_offload=a.activation_offload,
                              compile=a.compile or False, **timeout)
    return name


def group_timeouts(strategy) -> dict[str, float]:
    """The seconds each process group of the strategy's mesh (and the default group) waits for
    the other ranks in a collective."""
    dm = strategy.tsp_mesh.device_mesh
    groups = {"world": torch.distributed.group.WORLD,
              **{name: dm.get_group(name) for name in dm.mesh_dim_names}}
    return {name: g._get_backend(torch.device("cpu")).options._timeout.total_seconds()
            for name, g in groups.items()}


def fsdp_options(a) -> dict:
    """``--fsdp-mp bf16``: FSDP2 computes with bf16 parameters, reduces gradients in float32."""
    if not a.fsdp_mp:
        return {}
    from torch.distributed.fsdp import MixedPrecisionPolicy

    return {"fsdp_mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                                   reduce_dtype=torch.float32)}


def make_optimizer(params, a):
    if a.optimizer == "sgd":  # plain SGD: the update is lr x the (clipped) gradient
        return torch.optim.SGD(params, lr=a.lr)
    if a.optimizer == "sgd-momentum":  # scale-faithful too, with a state per trained parameter
        return torch.optim.SGD(params, lr=a.lr, momentum=MOMENTUM)
    return torch.optim.AdamW(params, lr=a.lr)


class LitLlama(L.LightningModule):
    def __init__(self, a) -> None:
        super().__init__()
        if a.bad_model:  # a transformers model no TSP policy describes
            from transformers import GPT2Config, GPT2LMHeadModel

            self.model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2,
                                                    vocab_size=VOCAB))
        else:
            self.model = build_llama(a.kv_heads, a.family)
            if a.activation_offload:  # what offload needs: checkpointed decoder layers
                self.model.activation_checkpointing_enable()
            if a.lora:  # a PeftModel: the strategy converts it with its adapters
                self.model = lora_model(self.model, a.lora)
        self.a = a
        self.losses: list[float] = []
        self.logged: list[float] = []
        self.engine_norms: list[float] = []
        self.grads0: dict | None = None
        self.grad_numel = 0
        self.grad_names: list[str] = []   # the parameters with a gradient at the first step

    def on_before_batch_transfer(self, batch, dataloader_idx: int):
        recorder = next((c for c in self.trainer.callbacks if isinstance(c, RecordSteps)), None)
        if recorder is not None and self.trainer.training:
            recorder.counters.begin()
        return batch

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

    def on_before_optimizer_step(self, optimizer) -> None:
        # before clipping; under DeepSpeed the gradients live in its buffers (norm only)
        if self.a.record_grads and self.grads0 is None:
            self.grads0 = full_grads(self.model)
            self.grad_numel = grad_numel(self.model)
        if self.a.lora and not self.grad_names:
            self.grad_names = sorted(n for n, p in self.model.named_parameters()
                                     if p.grad is not None)

    def on_train_batch_end(self, outputs, batch, batch_idx) -> None:
        self.logged.append(float(self.trainer.callback_metrics["train_loss"]))
        engine = getattr(self.trainer.strategy, "deepspeed_engine", None)
        if engine is not None:
            self.engine_norms.append(float(engine.get_global_grad_norm()))

    def configure_optimizers(self):
        return make_optimizer(self.parameters(), self.a)


class RecordSteps(L.Callback):
    """Each step's collectives and tokens (``StepCounters``: from the training batch's transfer,
    where the strategy shards it, ``LitLlama.on_before_batch_transfer``) and, after the
    TSPMonitor that runs before it, every row the monitor logged on this rank."""

    def __init__(self, monitor) -> None:
        self.monitor, self.counters, self.rows = monitor, StepCounters(), []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.counters.end()
        if self.monitor.last and (not self.rows or self.monitor.last is not self.rows[-1]):
            self.rows.append(self.monitor.last)


def grad_numel(model) -> int:
    """How many gradient elements this rank stores (local tensors)."""
    from tsp_core.distributed.params import local

    return sum(local(p.grad).numel() for p in model.parameters() if p.grad is not None)


def storage(model) -> dict:
    """How many parameter elements this rank stores (local tensors), how many the model has
    (full shapes), and how many modules FSDP2 wraps."""
    from torch.distributed.fsdp import FSDPModule

    from tsp_core.distributed.params import local

    params = list(model.parameters())
    return dict(local_numel=sum(local(p).numel() for p in params),
                full_numel=sum(p.numel() for p in params),
                fsdp_modules=sum(isinstance(m, FSDPModule) for m in model.modules()))


def state_names(trainer, module) -> list[str]:
    """The names of the model's parameters that have optimizer state, over every optimizer."""
    names = {id(p): n for n, p in module.model.named_parameters()}
    return sorted(names.get(id(p), "<not a model parameter>") for opt in trainer.optimizers
                  for p, state in opt.state.items() if state)


def layer_compiled(layer) -> bool:
    """Whether a decoder layer was compiled (its class a compiled subclass of its own)."""
    from tsp_core.models.compiled import compiled_by

    return compiled_by(layer) is not None


def offload_stats(model) -> dict | None:
    """The host offload's counts (``tsp_core.models.offload``), None without offload."""
    state = find_model_state(model)
    offload = None if state is None else state.offload
    return None if offload is None else dict(offload.stats)


def full_weights(model) -> dict:
    """This rank's full weights: of a TSP model gathered over its group (a collective: every
    rank calls it, and every rank keeps the result, so each replica's are compared); a
    converted PeftModel's too (its TSP model is inside it)."""
    if any(isinstance(m, TSPCausalLM) for m in model.modules()):
        return tsp_core.full_state_dict(model)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def run_trainer(a) -> dict:
    module = LitLlama(a)
    data = Documents(a.rows) if a.packed else Sequences(a.rows, a.pattern)
    collate = DataCollatorWithFlattening() if a.packed else None
    single = a.strategy == "auto"
    # distributed runs get Lightning's injected sampler (data parallel only, shuffled, seed 0);
    # the one-process reference gets the same sampler explicitly, so both see the same order
    sampler = DistributedSampler(data, num_replicas=1, rank=0, shuffle=True) if single else None
    strategy = strategy_name(a)
    # with --ckpt-dir: a checkpoint after every epoch (2 steps), once the epoch has ended
    callbacks = [L.pytorch.callbacks.ModelCheckpoint(
        dirpath=a.ckpt_dir, filename="{epoch}", every_n_epochs=1, save_top_k=-1,
        save_on_train_epoch_end=True)] if a.ckpt_dir else []
    logger, val = False, None
    if a.metrics:  # TSP's figures in a CSV file every 2 steps, validation and a checkpoint between
        monitor = tsp_lightning.TSPMonitor()
        recorder = RecordSteps(monitor)
        callbacks = [monitor, recorder, L.pytorch.callbacks.ModelCheckpoint(
            dirpath=os.path.join(a.out, "ckpt"), every_n_train_steps=3, save_top_k=-1)]
        logger = L.pytorch.loggers.CSVLogger(a.out, name="csv", version=0)
        val = DataLoader(data, batch_size=2, collate_fn=collate)
    elif a.metrics_off:  # a logger, and the strategy's metrics=False: no TSP figures in it
        logger = L.pytorch.loggers.CSVLogger(a.out, name="csv", version=0)
    trainer = L.Trainer(accelerator="cpu", devices=a.devices, strategy=strategy,
                        precision=a.precision, max_steps=a.steps, logger=logger,
                        enable_checkpointing=bool(a.ckpt_dir or a.metrics),
                        enable_progress_bar=False, log_every_n_steps=2,
                        enable_model_summary=False, gradient_clip_val=a.clip,
                        use_distributed_sampler=not single, callbacks=callbacks)
    NORMS.clear()
    fitted = torch.compile(module) if a.compile_module else module
    trainer.fit(fitted, DataLoader(data, batch_size=2, sampler=sampler, collate_fn=collate),
                val_dataloaders=val, ckpt_path=a.resume)
    norms = module.engine_norms or list(NORMS)
    weights = full_weights(module.model)
    res = dict(losses=module.losses, logged=module.logged, norms=norms, weights=weights,
               grads0=module.grads0, rank=trainer.global_rank, grad_numel=module.grad_numel,
               group_timeouts=group_timeouts(trainer.strategy)
               if isinstance(trainer.strategy, tsp_lightning.TSPStrategy) else None,
               offload=offload_stats(module.model), **storage(module.model))
    if a.compile:
        layers = module.model.model.layers
        res["compiled"] = {
            "layers": [layer_compiled(layer) for layer in layers],
            "classes": [type(trainer.strategy.model).__name__, type(module.model).__name__],
            "whole": module._compiler_ctx is not None,  # Lightning's mark of torch.compile
            "breaks": dict(torch._dynamo.utils.counters["graph_break"])}
    if a.lora:  # what was trained: only the adapters may have gradients and optimizer state
        res["grad_names"], res["state_names"] = module.grad_names, state_names(trainer, module)
    if a.metrics:
        res["metric_rows"], res["step_counts"] = recorder.rows, recorder.counters.steps
    if a.evaluate:
        loader = DataLoader(data, batch_size=2, collate_fn=collate)
        res["val"] = trainer.validate(module, loader, verbose=False)[0]["val_loss"]
        res["test"] = trainer.test(module, loader, verbose=False)[0]["test_loss"]
        res["predict_shapes"] = [list(s) for s in trainer.predict(module, loader)]
    if a.export:
        trainer.strategy.export_hf(a.export)
    return res


def run_fabric(a) -> dict:
    strategy = (tsp_lightning.TSPFabricStrategy(tsp_size=a.tsp_size, fsdp=a.fsdp,
                                                activation_offload=a.activation_offload,
                                                compile=a.compile or False, **fsdp_options(a))
                if a.tsp_size else a.strategy)
    precision: dict = {"precision": a.precision}
    if a.precision == "64-true":  # Fabric refuses the flag with any ModelParallelStrategy
        from lightning.fabric.plugins import DoublePrecision

        precision = {"plugins": DoublePrecision()}
    fabric = L.Fabric(accelerator="cpu", devices=a.devices, strategy=strategy, **precision)
    fabric.launch()
    model = build_llama(a.kv_heads)
    if a.activation_offload:
        model.activation_checkpointing_enable()
    model = fabric.setup_module(model)
    opt = fabric.setup_optimizers(make_optimizer(model.parameters(), a))
    # Fabric's injected sampler splits the data over data-parallel ranks, unshuffled
    loader = fabric.setup_dataloaders(DataLoader(Sequences(a.rows, a.pattern), batch_size=2))
    losses, norms, grads0, grads_stored = [], [], None, 0
    while len(losses) < a.steps:
        for batch in loader:
            loss = model(**batch).loss
            fabric.backward(loss)
            if a.record_grads and grads0 is None:
                grads0, grads_stored = full_grads(model.module), grad_numel(model.module)
            if a.clip is not None:
                norms.append(float(fabric.clip_gradients(model, opt, max_norm=a.clip)))
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
            if len(losses) == a.steps:
                break
    res = dict(losses=losses, logged=losses, norms=norms, weights=full_weights(model.module),
               grads0=grads0, rank=fabric.global_rank, grad_numel=grads_stored,
               offload=offload_stats(model.module), **storage(model.module))
    if a.compile:
        layers = model.module.model.layers
        res["compiled"] = {
            "layers": [layer_compiled(layer) for layer in layers],
            "classes": [type(model._forward_module).__name__],  # what Fabric's module runs
            "breaks": dict(torch._dynamo.utils.counters["graph_break"])}
    return res


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", choices=["trainer", "fabric"], default="trainer")
    ap.add_argument("--strategy", default="tsp")
    ap.add_argument("--devices", type=int, default=2)
    ap.add_argument("--precision", default="32-true")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--clip", type=float, default=None)
    ap.add_argument("--optimizer", choices=["adamw", "sgd", "sgd-momentum"], default="adamw")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--family", default="llama", help="a tests/hf_models family")
    ap.add_argument("--record-grads", action="store_true")
    ap.add_argument("--evaluate", action="store_true", help="validate, test and predict after fit")
    ap.add_argument("--resume", default=None)
    ap.add_argument("--ckpt-dir", default=None)
    ap.add_argument("--rows", type=int, default=4)
    ap.add_argument("--pattern", action="store_true", help="learnable rows (see Sequences)")
    ap.add_argument("--packed", action="store_true")
    ap.add_argument("--export", default=None)
    ap.add_argument("--metrics-off", action="store_true",
                    help="a CSVLogger (out/csv) with TSPStrategy(metrics=False)")
    ap.add_argument("--metrics", action="store_true",
                    help="TSPMonitor into a CSVLogger (out/csv), validation each epoch, a "
                         "checkpoint at step 3; record each step's counters")
    ap.add_argument("--tsp-size", type=int, default=None)
    ap.add_argument("--timeout", type=int, default=None,
                    help="TSPStrategy(timeout=timedelta(seconds=N))")
    ap.add_argument("--fsdp", action="store_true",
                    help="TSPStrategy(fsdp=True): FSDP2 over the data-parallel dim too")
    ap.add_argument("--fsdp-mp", choices=["bf16"], default=None,
                    help="with --fsdp: FSDP2's MixedPrecisionPolicy (fsdp_options)")
    ap.add_argument("--activation-offload", action="store_true",
                    help="TSPStrategy / TSPFabricStrategy(activation_offload=True), the model's "
                         "decoder layers checkpointed")
    ap.add_argument("--lora", type=int, default=0, metavar="R",
                    help="the model a PEFT PeftModel (lora_model): rank-R LoRA on the seven "
                         "projections; records which parameters have gradients and optimizer "
                         "state")
    ap.add_argument("--compile", default=None, help="the TSP strategy's compile= (a backend)")
    ap.add_argument("--compile-module", action="store_true",
                    help="trainer.fit(torch.compile(module)): Lightning's way, refused")
    ap.add_argument("--bad-model", action="store_true")
    ap.add_argument("--fails", action="store_true",
                    help="a case that must raise: each rank records the error (rank<R>.json's "
                         "'error') and the next case runs")
    ap.add_argument("--out", default=None)
    ap.add_argument("--case", action="append", default=[],
                    help='"NAME ARGS...": one more run in these processes (under torchrun)')
    return ap


def write(res: dict, out: str) -> None:
    os.makedirs(out, exist_ok=True)
    weights, grads0 = res.pop("weights"), res.pop("grads0")
    with open(os.path.join(out, f"rank{res['rank']}.json"), "w") as f:
        json.dump(res, f)
    rank = res["rank"]
    torch.save(weights, os.path.join(out, f"rank{rank}_weights.pt"))
    if grads0 is not None:
        torch.save(grads0, os.path.join(out, f"rank{rank}_grads0.pt"))


def main() -> None:
    record_clip_grad_norm()
    ap = parser()
    a = ap.parse_args()
    runs = [(a.out, a)] if not a.case else []
    for spec in a.case:
        name, *extra = shlex.split(spec)
        runs.append((os.path.join(a.out, name),
                     ap.parse_args([*extra, "--out", os.path.join(a.out, name)])))
    for out, args in runs:
        if args.fails:
            write_error(args, out)
            continue
        write(run(args), out)


def run(a) -> dict:
    """One Trainer or Fabric run; with ``--compile``, dynamo's settings as they were
    afterwards (compiling turns ``trace_autograd_ops`` on for the process)."""
    if not a.compile:
        return run_trainer(a) if a.mode == "trainer" else run_fabric(a)
    traces_autograd = torch._dynamo.config.trace_autograd_ops
    torch._dynamo.utils.counters.clear()
    try:
        return run_trainer(a) if a.mode == "trainer" else run_fabric(a)
    finally:
        torch._dynamo.config.trace_autograd_ops = traces_autograd
        torch._dynamo.reset()


def write_error(a, out: str) -> None:
    """A case that must fail (``--fails``): its run's error on this rank, or its results if it
    ran (the test then fails naming them), in ``out``/rank<R>.json; the processes go on."""
    try:
        res = run(a)
    except Exception as e:  # every rank must raise on its own, before any collective
        res = dict(error=f"{type(e).__name__}: {e}", rank=int(os.environ.get("RANK", "0")),
                   weights={}, grads0=None)
    write(res, out)


if __name__ == "__main__":
    main()
    # Lightning starts the other ranks by re-running this script, so every rank ends here: tear the
    # groups down together and skip interpreter finalisation, where gloo can abort (see
    # tests/support/exit_cleanly.py)
    from tests.support.exit_cleanly import finish

    finish(0)
