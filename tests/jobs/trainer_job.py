"""A transformers Trainer job (plain Trainer, or TSPTrainer with --tsp_size) on a tiny Llama
saved with save_pretrained; run with python (1 process) or torchrun. Every rank writes what the
Trainer logged (loss, grad_norm per step) to ``rank<R>.json`` in --out, the final full weights
it holds (``rank<R>_weights.pt``: each data-parallel replica's own, gathered over its TSP group)
and, with clipping on, the full gradients of the first step before clipping
(``rank<R>_grads0.pt``), so that every replica's are checked, not only replica 0's.

``--case "NAME ARGS..."`` (repeatable, under torchrun): one more Trainer run in the same processes
with ARGS added to the command line's, results in --out/NAME, output_dir/NAME.

``--plain true``: transformers' own ``Trainer`` (the reference for what the Trainer reports).
``--plain_args true``: ``TSPTrainer`` given a plain ``TrainingArguments`` (the one switch: TSP's
fields take their defaults); every rank records the TSP degree the trainer chose (``tsp_size``).
``--figures true``: every rank also records what the Trainer derived from the number of processes
(``figures``: the training arithmetic, the batches and samples behind each ``*_per_second``
of training, evaluation and a final ``predict()`` on the evaluation rows,
``total_flos``, the evaluation progress bar's total), and rank 0 the hyperparameters of the model
card and the saved ``config.json``; the model's config then starts without ``architectures`` and
``dtype``, as one built from a config (run_clm.py training from scratch) does, so ``config.json``
gets them from saving alone.

``--clm_logging true``: logging configured as Hugging Face's ``run_clm.py`` configures it (the root
logger at WARNING with a handler on stdout, transformers at INFO on the main process); every rank
also records the Trainer's first log row (``first_row``).

``--torch_compile_backend eager`` (the Trainer's own argument): every rank also records
``compiled``: which decoder layers were compiled, the class of every model
``compute_loss`` was given (an ``OptimizedModule`` would be a whole-model compile), and dynamo's
graph breaks; dynamo's ``trace_autograd_ops`` is restored and its caches reset afterwards, so
the cases that follow in the same processes run as before.

``--lora R``: the model trained is a PeftModel with a LoRA adapter of rank R on the seven
projections (``hf_models.lora_model``, seeded with ``--seed``); the weights recorded are its
adapters alone (``rank<R>_weights.pt``).

``--eval_first true``: ``evaluate()`` before ``train()`` too (``eval_loss0``). Under FSDP2
(``--fsdp full_shard --fsdp_config '{"fsdp_version": 2}'``) every rank also records the bytes of
parameter storage it holds and how its FSDP2 units were configured (``fsdp``)."""

from __future__ import annotations

import json
import logging
import os
import shlex
import sys
from dataclasses import dataclass, field

import torch
import transformers.trainer as hf_trainer
from transformers import (
    AutoModelForCausalLM,
    DataCollatorWithFlattening,
    HfArgumentParser,
    Trainer,
    TrainerCallback,
    TrainingArguments,
)

import tsp_core
from tests.jobs.accelerate_job import fsdp_units, layer_compiled
from tests.support.gather import full_grads, storage_bytes
from tests.support.metrics_check import StepCounters
from tsp_core.distributed.mesh import get_mesh
from tsp_core.distributed.model_state import find_model_state
from tsp_core.models import TSPCausalLM
from tsp_transformers import TSPTrainer, TSPTrainingArguments


@dataclass
class JobArgs:
    model_path: str = field(default="")
    out: str = field(default="")
    resume: str = field(default="")
    packed: bool = field(default=False)
    num_docs: int = field(default=16)
    rows: int = field(default=8)
    dtype: str = field(default="float32")
    eval_first: bool = field(default=False)
    plain: bool = field(default=False)
    plain_args: bool = field(default=False)
    figures: bool = field(default=False)
    clm_logging: bool = field(default=False)
    lora: int = field(default=0)
    case: list[str] = field(default_factory=list)


def packed_documents(vocab: int, n: int) -> list[list[int]]:
    """``n`` documents of lengths 1..39 (DataCollatorWithFlattening packs them into rows)."""
    gen = torch.Generator().manual_seed(5)
    lengths = torch.randint(1, 40, (n,), generator=gen).tolist()
    return [torch.randint(0, vocab, (k,), generator=gen).tolist() for k in lengths]


def rows(vocab: int, n: int) -> torch.Tensor:
    """The training rows (``--train_sampling_strategy sequential`` takes them in order, each
    data-parallel replica its own batches in turn)."""
    return torch.randint(0, vocab, (n, 24), generator=torch.Generator().manual_seed(5))


class LogRecorder(TrainerCallback):
    """The logged losses, gradient norms and TSP figures (``tsp/...``), and each optimizer
    step's own collectives and tokens (``StepCounters``)."""

    def __init__(self) -> None:
        self.losses: list[float] = []
        self.norms: list[float] = []
        self.metric_rows: list[dict] = []
        self.counters = StepCounters()
        self.eval_batches: list[int] = []
        self.first_row: dict | None = None

    def on_prediction_step(self, args, state, control, eval_dataloader=None, **kwargs):
        if not self.eval_batches or self.eval_batches[-1] != len(eval_dataloader):
            self.eval_batches.append(len(eval_dataloader))  # the progress bar's total

    def on_step_begin(self, args, state, control, **kwargs):
        self.counters.begin()

    def on_step_end(self, args, state, control, **kwargs):
        self.counters.end()

    def on_log(self, args, state, control, logs=None, **kwargs):
        if self.first_row is None:
            self.first_row = dict(logs)
        if logs and "loss" in logs:
            self.losses.append(logs["loss"])
            if "grad_norm" in logs:
                self.norms.append(logs["grad_norm"])
            tsp = {k: v for k, v in logs.items() if k.startswith("tsp/")}
            if tsp:
                self.metric_rows.append(tsp)


def record_first_gradients(trainer) -> dict:
    """The full gradients the first clipping sees (every rank gathers; ``_clip_grad_norm`` is
    where the Trainer clips)."""
    first: dict = {}
    clip = trainer._clip_grad_norm

    def recording(model):
        if not first:
            first["grads"] = full_grads(trainer.model)
        return clip(model)

    trainer._clip_grad_norm = recording
    return first


def record_training_losses(trainer) -> list[float]:
    """Each training micro-step's loss as ``compute_loss`` returns it, in the model's dtype (the
    logged loss is summed in a float32 tensor)."""
    losses: list[float] = []
    real = trainer.compute_loss

    def recording(model, inputs, *args, **kwargs):
        out = real(model, inputs, *args, **kwargs)
        if model.training:
            losses.append((out[0] if isinstance(out, tuple) else out).item())
        return out

    trainer.compute_loss = recording
    return losses


def record_model_classes(trainer) -> set[str]:
    """The class names of the models ``compute_loss`` is given (the Trainer's wrapped model)."""
    classes: set[str] = set()
    real = trainer.compute_loss

    def recording(model, *args, **kwargs):
        classes.add(type(model).__name__)
        return real(model, *args, **kwargs)

    trainer.compute_loss = recording
    return classes


def compiled_layers(model) -> list[bool]:
    """Per decoder layer of the TSP model: whether it was compiled (``layer_compiled``)."""
    layers = model.model.layers if isinstance(model, TSPCausalLM) else []
    return [layer_compiled(layer) for layer in layers]


def offload_stats(model) -> dict | None:
    """The host offload's counts (``tsp_core.models.offload``), None without offload."""
    state = find_model_state(model)
    offload = None if state is None else state.offload
    return None if offload is None else dict(offload.stats)


SPEED: list[dict] = []  # what the Trainer passed to speed_metrics, in order
REAL_SPEED_METRICS = hf_trainer.speed_metrics


def recording_speed_metrics(split, start_time, num_samples=None, num_steps=None, **kw):
    """``speed_metrics`` (installed by :func:`main`), noting the samples and steps behind each
    ``*_per_second`` figure."""
    SPEED.append({"split": split, "samples": num_samples, "steps": num_steps})
    return REAL_SPEED_METRICS(split, start_time, num_samples=num_samples, num_steps=num_steps,
                              **kw)


def record_training_values(trainer) -> dict:
    """``set_initial_training_values``' answer: epochs, update steps per epoch, examples,
    samples, total batch, batches per epoch, max_steps."""
    seen: dict = {}
    real = trainer.set_initial_training_values

    def recording(*a, **kw):
        values = real(*a, **kw)
        seen.update(zip(("num_train_epochs", "update_steps_per_epoch", "num_examples",
                         "num_train_samples", "total_train_batch_size", "steps_in_epoch",
                         "max_steps"), values))
        return values

    trainer.set_initial_training_values = recording
    return seen


def model_card_hyperparameters(path: str) -> dict:
    """The ``- name: value`` lines under "Training hyperparameters" of a model card."""
    with open(os.path.join(path, "README.md")) as f:
        text = f.read().split("### Training hyperparameters", 1)[1].split("###", 1)[0]
    pairs = (line[2:].split(": ", 1) for line in text.splitlines() if line.startswith("- "))
    return {k: v for k, v in pairs}


def figures(trainer, train_metrics: dict, training: dict, log: LogRecorder) -> dict:
    """What the Trainer derived from the number of processes; rank 0 also the model card's
    hyperparameters and the saved config.json (``save_model`` gathers on every rank)."""
    out = {"total_flos": train_metrics["total_flos"], "training": training,
           "eval_batches": log.eval_batches,
           "max_steps": trainer.state.max_steps, "epochs": trainer.state.num_train_epochs}
    trainer.predict(trainer.eval_dataset)  # test_*_per_second
    out["speed"] = list(SPEED)
    saved = os.path.join(trainer.args.output_dir, "final")
    trainer.save_model(saved)
    if trainer.args.process_index == 0:
        trainer.create_model_card()
        out["model_card"] = model_card_hyperparameters(trainer.args.output_dir)
        with open(os.path.join(saved, "config.json")) as f:
            out["config"] = json.load(f)
    return out


def configure_logging_as_run_clm(args: TSPTrainingArguments) -> None:
    """What Hugging Face's examples/pytorch/language-modeling/run_clm.py does first."""
    import transformers

    logging.basicConfig(format="%(asctime)s - %(levelname)s - %(name)s - %(message)s",
                        datefmt="%m/%d/%Y %H:%M:%S", handlers=[logging.StreamHandler(sys.stdout)])
    if args.should_log:
        transformers.utils.logging.set_verbosity_info()
    log_level = args.get_process_log_level()
    logging.getLogger("run_clm").setLevel(log_level)
    transformers.utils.logging.set_verbosity(log_level)
    transformers.utils.logging.enable_default_handler()
    transformers.utils.logging.enable_explicit_format()


def mesh_timeouts(model) -> dict[str, float] | None:
    """The seconds each process group of the TSP model's mesh waits in a collective."""
    if not isinstance(model, TSPCausalLM):
        return None
    dm = get_mesh(model).device_mesh
    return {name: dm.get_group(name)._get_backend(torch.device("cpu")).options._timeout
            .total_seconds() for name in dm.mesh_dim_names}


def train(job: JobArgs, args: TSPTrainingArguments) -> None:
    """One Trainer run; dynamo's settings as they were afterwards (a compiled case turns
    ``trace_autograd_ops`` on for the process)."""
    if not args.torch_compile:
        return run(job, args)
    traces_autograd = torch._dynamo.config.trace_autograd_ops
    torch._dynamo.utils.counters.clear()
    try:
        run(job, args)
    finally:
        torch._dynamo.config.trace_autograd_ops = traces_autograd
        torch._dynamo.reset()


def run(job: JobArgs, args: TSPTrainingArguments) -> None:
    if job.clm_logging:
        configure_logging_as_run_clm(args)
    model = AutoModelForCausalLM.from_pretrained(job.model_path, dtype=getattr(torch, job.dtype))
    if job.lora:
        model = with_lora(model, job.lora, args.seed)
    if job.figures:
        model.config.architectures, model.config.dtype = None, None
    if job.packed:  # documents of different lengths, several per row
        data = [{"input_ids": d} for d in packed_documents(model.config.vocab_size, job.num_docs)]
        collator = DataCollatorWithFlattening()
    else:
        data = [{"input_ids": r, "labels": r} for r in rows(model.config.vocab_size, job.rows)]
        collator = None
    log = LogRecorder()
    full_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    SPEED.clear()
    trainer = (Trainer if job.plain else TSPTrainer)(
        model=model, args=args, train_dataset=data, eval_dataset=data[:4], callbacks=[log],
        data_collator=collator)
    first = record_first_gradients(trainer)
    exact_losses = record_training_losses(trainer)
    training = record_training_values(trainer)
    classes = record_model_classes(trainer)
    extra = {"eval_loss0": trainer.evaluate()["eval_loss"]} if job.eval_first else {}
    train_metrics = trainer.train(resume_from_checkpoint=job.resume or None).metrics
    metrics = trainer.evaluate()
    if args.torch_compile:
        extra["compiled"] = {"layers": compiled_layers(trainer.model), "classes": sorted(classes),
                             "breaks": dict(torch._dynamo.utils.counters["graph_break"])}
    if job.figures:
        extra["figures"] = figures(trainer, train_metrics, training, log)
    if job.clm_logging:
        extra["first_row"] = log.first_row
    model = trainer.model
    if trainer.accelerator.is_fsdp2:
        extra["fsdp"] = {"storage": storage_bytes(model), "full": full_bytes, **fsdp_units(model)}
    weights = final_weights(model)
    rank = trainer.args.process_index
    os.makedirs(job.out, exist_ok=True)
    with open(os.path.join(job.out, f"rank{rank}.json"), "w") as f:
        json.dump({"losses": log.losses, "norms": log.norms, "eval_loss": metrics["eval_loss"],
                   "metric_rows": log.metric_rows, "step_counts": log.counters.steps,
                   "tsp_size": get_mesh(model).size if converted(model) else 1,
                   "mesh_timeouts": mesh_timeouts(model), "exact_losses": exact_losses,
                   "offload": offload_stats(model), **extra}, f)
    save_tensors(job.out, rank, weights, first.get("grads"))


def with_lora(model, r: int, seed: int):
    """``--lora R``: the model as a PeftModel with a LoRA adapter of rank R on the seven
    projections (``hf_models.lora_model``: A and B random from ``seed``, the same on every rank
    and in the test's one-process reference)."""
    from tests.support.hf_models import lora_model

    return lora_model(model, r, seed)


def converted(model) -> bool:
    """Whether ``model`` (or the model inside a PeftModel) is a TSP model."""
    return isinstance(getattr(getattr(model, "base_model", None), "model", model), TSPCausalLM)


def final_weights(model) -> dict:
    """The full weights after training (every rank of a TSP group gathers); of a PeftModel its
    adapters alone, by the PeftModel's parameter names (its base is frozen)."""
    from tsp_core.models.lora import adapter_state_dict, is_peft_model

    if is_peft_model(model):
        if converted(model):
            return adapter_state_dict(model)
        return {k: v.detach().clone() for k, v in model.state_dict().items() if "lora_" in k}
    if isinstance(model, TSPCausalLM):
        return tsp_core.full_state_dict(model)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def save_tensors(out: str, rank: int, weights: dict, grads: dict | None) -> None:
    """This rank's final full weights and first gradients (``rank<R>_weights.pt``,
    ``rank<R>_grads0.pt``): every rank writes its own, so a replica that diverged shows."""
    torch.save(weights, os.path.join(out, f"rank{rank}_weights.pt"))
    if grads is not None:
        torch.save(grads, os.path.join(out, f"rank{rank}_grads0.pt"))


def main() -> None:
    hf_trainer.speed_metrics = recording_speed_metrics
    parser = HfArgumentParser((JobArgs, TSPTrainingArguments))
    argv = sys.argv[1:]
    job, args = parser.parse_args_into_dataclasses(args=argv)
    if not job.case:
        return train(job, args)
    plain_parser = HfArgumentParser((JobArgs, TrainingArguments))  # no --tsp_* flags
    base = argv[:argv.index("--case")]  # --case takes the rest of the command line
    fsdp = False
    for spec in job.case:
        from accelerate.state import AcceleratorState

        name, *extra = shlex.split(spec)
        # an FSDP plugin leaves ACCELERATE_USE_FSDP=true behind, which would make the next
        # case's Accelerator build one
        os.environ.pop("ACCELERATE_USE_FSDP", None)
        case, case_args = parser.parse_args_into_dataclasses(args=[*base, *extra])
        if case.plain_args:
            case, case_args = plain_parser.parse_args_into_dataclasses(args=[*base, *extra])
            assert type(case_args) is TrainingArguments, type(case_args)
        case.out = os.path.join(job.out, name)
        case_args.output_dir = os.path.join(args.output_dir, name)
        # the Trainer's Accelerator keeps its parallelism config in a process-wide state: a new
        # TSP size needs a new one (the process group stays); after FSDP2 the partial state
        # too (it keeps the FSDP distributed type, without the plugin)
        AcceleratorState._reset_state(fsdp)
        fsdp = case_args.fsdp_plugin_args is not None
        train(case, case_args)


if __name__ == "__main__":
    main()
