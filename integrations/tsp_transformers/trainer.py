"""``TSPTrainingArguments`` and ``TSPTrainer``: the transformers Trainer with TSP switched on by
one argument (``tsp_size``, also ``--tsp_size`` through ``HfArgumentParser``).

The Trainer's model is converted before the Trainer sees it; its Accelerator is a
:class:`tsp_accelerate.TSPAccelerator` (so every rank of a TSP group gets the same batches and no
DDP wraps the model); batches are sharded by the model itself. With ``fsdp=...`` and
``fsdp_config={"fsdp_version": 2}`` the model is converted on the accelerator's mesh instead and
FSDP2 shards every rank's TSP shards over the world_size / tsp_size data-parallel ranks
(``TSPAccelerator``'s FSDP2 path; options TSP cannot honour are refused before any collective).
Saving writes an ordinary Hugging Face checkpoint plus the optimizer as a
``tsp_core.save_checkpoint`` directory (Hugging Face names and shapes), so a run resumes at any
TSP degree and data-parallel size; resuming and ``load_best_model_at_end`` read the weights
shard-on-read from ``model.safetensors``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
import transformers.trainer as hf_trainer
from torch.distributed.checkpoint.state_dict import (
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)
from transformers import Trainer, TrainerCallback, TrainingArguments

import tsp_core
from tsp_accelerate import TSPAccelerator
from tsp_accelerate.accelerator import check_fsdp_plugin, check_fsdp_version, fsdp_sizes
from tsp_core.distributed.mesh import get_mesh
from tsp_core.distributed.metrics import StepMetrics
from tsp_core.models.parallelize import TSPCausalLM, shard_full_batches
from tsp_core.plan.auto import TSPChoice, choose_tsp_size, is_auto, log_choice
from tsp_core.state.resharding import MARKER as RESHARDABLE_MARKER

OPTIMIZER_DIR = "optimizer_dcp"
SCHEDULER_NAME = "scheduler.pt"


@dataclass
class TSPTrainingArguments(TrainingArguments):
    tsp_size: str = field(default="1", metadata={
        "help": "TSP degree: how many processes share each weight matrix and each sequence "
                "(1 = off). Must divide the number of processes; data parallel takes the rest. "
                "'auto': the smallest degree inside a node that fits in memory (the planner)."})
    tsp_seq_len: int | None = field(default=None, metadata={
        "help": "sequence length tsp_size='auto' plans for (default: TSP_SEQ_LEN, else the "
                "model's max_position_embeddings)"})
    tsp_memory_gb: float | None = field(default=None, metadata={
        "help": "memory per GPU (GB) tsp_size='auto' plans for (default: TSP_MEMORY_GB, else "
                "detected)"})
    tsp_metrics: bool = field(default=True, metadata={
        "help": "add TSP's per-step figures (tsp/comm_mib, tsp/wait_frac, tsp/tokens_per_s, "
                "peak memory: docs/monitoring.md) to the training logs every logging_steps"})

    def __post_init__(self) -> None:
        super().__post_init__()
        if not is_auto(self.tsp_size):
            self.tsp_size = int(self.tsp_size)  # "2" from the command line, 2 from code


def resolve_tsp_size(args: TSPTrainingArguments, model: Any) -> TSPChoice:
    """The degree ``TSPTrainer`` builds its mesh with: ``args.tsp_size``, or for "auto" the
    planner's choice for ``model``'s config, ``args.tsp_seq_len`` (or ``TSP_SEQ_LEN`` / the
    config's max_position_embeddings) and ``per_device_train_batch_size`` sequences per step,
    inside the node's processes (``LOCAL_WORLD_SIZE``). The same on every rank."""
    local = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1")))
    return choose_tsp_size(args.tsp_size, model_config=getattr(model, "config", None),
                           local_processes=local, seq_len=args.tsp_seq_len,
                           memory_gb=args.tsp_memory_gb, batch=args.per_device_train_batch_size)


class _OpenMetricsWindow(TrainerCallback):
    """Starts the trainer's metrics window when training starts (or resumes)."""

    def __init__(self, meter: StepMetrics) -> None:
        self.meter = meter

    def on_train_begin(self, args, state, control, **kwargs):
        self.meter.start(state.global_step)


class TSPTrainer(Trainer):
    """``Trainer`` with TSP when the resolved ``args.tsp_size`` exceeds 1 (``tsp_choice``);
    otherwise exactly ``Trainer``. With ``args.tsp_metrics`` every training log (each
    ``logging_steps``) also carries TSP's per-step figures since the previous one
    (``tsp_core.metrics``; evaluation and checkpoint saving left out), so every ``report_to``
    integration receives them."""

    def __init__(self, model=None, args: TSPTrainingArguments | None = None, *rest: Any,
                 **kwargs: Any) -> None:
        self.tsp_choice = None
        if args is not None and hasattr(args, "tsp_size"):
            self.tsp_choice = resolve_tsp_size(args, model)  # before any collective, every rank
            log_choice(self.tsp_choice)
        self._tsp = self.tsp_choice is not None and self.tsp_choice.size > 1
        self._tsp_fsdp = self._tsp and getattr(args, "fsdp_plugin_args", None) is not None
        if self._tsp_fsdp:
            self._check_fsdp(args, model)  # before any collective, every rank
        if self._tsp and not self._tsp_fsdp:
            _ = args.world_size  # initialises the process group from the launcher's environment
            mesh = tsp_core.init_mesh(self.tsp_choice.size)
            if not isinstance(model, TSPCausalLM):
                tsp_core.parallelize(model, mesh)
            shard_full_batches(model)
        # with FSDP2 the model is converted on the accelerator's mesh as soon as the Trainer has
        # created it (create_accelerator_and_postprocess), before it looks at the model
        super().__init__(model, args, *rest, **kwargs)
        self._tsp_meter = None
        if self._tsp and getattr(self.args, "tsp_metrics", False):
            self._tsp_meter = StepMetrics(get_mesh(self.model))
            self.add_callback(_OpenMetricsWindow(self._tsp_meter))
        if self._tsp and self.args.label_names is None:
            # the TSP forward also names shift_labels; batches carry "labels" (shifted on the
            # full sequence when the model shards them)
            self.label_names = ["labels"]

    def _check_fsdp(self, args: TSPTrainingArguments, model: Any) -> None:
        """FSDP2 (``fsdp=...``, ``fsdp_config={"fsdp_version": 2}``) over the data-parallel
        ranks: refuse what TSP cannot honour, with the numbers and the fix."""
        from accelerate.utils import FullyShardedDataParallelPlugin

        if model is None or not hasattr(model, "config"):
            raise ValueError("TSPTrainer with FSDP2 converts the model it is given: pass model=, "
                             "not model_init=")
        if args.parallelism_config is not None:
            raise ValueError("TSPTrainer builds its own parallelism (data parallel x tsp_size); "
                             "with FSDP2 it shards over all world_size / tsp_size data-parallel "
                             "ranks: leave parallelism_config unset")
        check_fsdp_version(args.fsdp_plugin_args.get("fsdp_version", 1))
        check_fsdp_plugin(FullyShardedDataParallelPlugin(**args.fsdp_plugin_args))
        fsdp_sizes(int(os.environ.get("WORLD_SIZE", "1")), self.tsp_choice.size, None)

    def create_accelerator_and_postprocess(self) -> None:
        if not self._tsp:
            return super().create_accelerator_and_postprocess()
        tsp_size = self.tsp_choice.size

        class _Accelerator(TSPAccelerator):
            def __init__(self, *a: Any, **kw: Any) -> None:
                kw.pop("parallelism_config", None)
                super().__init__(*a, tsp_size=tsp_size, **kw)


        original = hf_trainer.Accelerator  # the Trainer builds its accelerator from this name
        hf_trainer.Accelerator = _Accelerator
        try:
            out = super().create_accelerator_and_postprocess()
        finally:
            hf_trainer.Accelerator = original
        if self._tsp_fsdp:
            # TSP, then FSDP2 over "dp_shard" per decoder layer and the root, with the fsdp
            # config's reshard_after_forward and the mixed precision (bf16=/fp16=) the Trainer
            # gave the plugin; Accelerate's own FSDP2 preparation then leaves the model alone
            self.accelerator.tsp_parallelize(self.model)
            shard_full_batches(self.model)
            self.model._tp_size = tsp_size  # what the Trainer's get_tp_size reads
        return out

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        out = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        if not self._tsp:
            return out
        loss = out[0] if return_outputs else out
        if (self.args.average_tokens_across_devices and num_items_in_batch is not None
                and (self.model_accepts_loss_kwargs or self.compute_loss_func)):
            # the Trainer scaled the loss by the data-parallel size for DDP's averaging; the TSP
            # loss is already the global mean and tsp_core sums data-parallel gradients
            loss = loss / (self.accelerator.num_processes // self.get_tp_size())
        return (loss, out[1]) if return_outputs else loss

    # ------------------------------------------------------------------ metrics
    def log(self, logs: dict[str, float], *args: Any, **kwargs: Any) -> None:
        """The Trainer's log; a training row (it has ``loss``) also gets TSP's figures."""
        if self._tsp_meter is not None and "loss" in logs:
            logs = {**logs, **self._tsp_meter.read(self.state.global_step)}
        return super().log(logs, *args, **kwargs)

    def evaluate(self, *args: Any, **kwargs: Any):
        with tsp_core.metrics.paused():  # not a training step's work
            return super().evaluate(*args, **kwargs)

    def _save_checkpoint(self, *args: Any, **kwargs: Any):
        with tsp_core.metrics.paused():
            return super()._save_checkpoint(*args, **kwargs)

    # ------------------------------------------------------------------ evaluation
    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        """The Trainer's step with TSP: the loss alone goes the Trainer's own way (no logits are
        computed or gathered); with metrics, ``tsp_core.full_logits`` gives every rank the
        logits of the whole sequence in the original order (what the model returns on one
        process), which the Trainer then gathers over data parallel only."""
        if not self._tsp:
            return super().prediction_step(model, inputs, prediction_loss_only, ignore_keys)
        inputs = self._ignore_repeated_rows(inputs)
        if prediction_loss_only:
            return super().prediction_step(model, inputs, prediction_loss_only, ignore_keys)
        inputs = self._prepare_inputs(inputs)
        names = self.label_names
        has_labels = bool(names) and all(inputs.get(k) is not None for k in names)
        extra = {}
        if has_labels and self.model_accepts_loss_kwargs:
            extra["num_items_in_batch"] = self._get_num_items_in_batch([inputs], self.args.device)
        with torch.no_grad(), self.compute_loss_context_manager():
            out = tsp_core.full_logits(model, inputs, **extra)
        if not has_labels:
            return None, out.logits, None
        labels = tuple(inputs[k] for k in names)
        return out.loss.detach(), out.logits, labels[0] if len(labels) == 1 else labels

    def _ignore_repeated_rows(self, inputs: dict[str, Any]) -> dict[str, Any]:
        """With data parallel, Accelerate fills the final uneven eval batch with rows repeated
        from the start (every replica steps together) and ``gather_for_metrics`` drops them
        from what it gathers. The TSP loss is one mean over the whole mesh, so their labels are
        ignored here too: ``eval_loss`` counts each row once, as on one process."""
        state = self.accelerator.gradient_state
        labels = inputs.get("labels")
        if labels is None or not state.end_of_dataloader or state.remainder <= 0:
            return inputs
        data_rank = self.accelerator.process_index // self.tsp_choice.size
        real = min(labels.shape[0], max(0, state.remainder - data_rank * labels.shape[0]))
        if real == labels.shape[0]:
            return inputs
        labels = labels.clone()
        labels[real:] = -100
        return {**inputs, "labels": labels}

    # ------------------------------------------------------------------ checkpoints
    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        if not self._tsp:
            return super().save_model(output_dir, _internal_call)
        output_dir = output_dir or self.args.output_dir
        tsp_core.save_pretrained(self.model, output_dir)  # every rank gathers, rank 0 writes
        if self.args.should_save:
            if self.processing_class is not None:
                self.processing_class.save_pretrained(output_dir)
            torch.save(self.args, os.path.join(output_dir, "training_args.bin"))
        self.accelerator.wait_for_everyone()

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        if not self._tsp:
            return super()._save_optimizer_and_scheduler(output_dir)
        # the weights are in model.safetensors already: the optimizer alone, reshardable
        tsp_core.save_checkpoint(os.path.join(output_dir, OPTIMIZER_DIR), self.model,
                                 self.optimizer, model_state=False)
        if self.args.should_save:
            torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, SCHEDULER_NAME))

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        """A TSP checkpoint's optimizer state at any TSP degree and data-parallel size, into
        TSPTrainer or (tsp_size 1) the plain Trainer's optimizer; the plain Trainer's own files
        as the Trainer reads them."""
        tsp_state = checkpoint is not None and os.path.isfile(
            os.path.join(checkpoint, OPTIMIZER_DIR, RESHARDABLE_MARKER))
        if not tsp_state and (not self._tsp or checkpoint is None):
            return super()._load_optimizer_and_scheduler(checkpoint)
        if tsp_state:
            tsp_core.load_checkpoint(os.path.join(checkpoint, OPTIMIZER_DIR), self.model,
                                     self.optimizer, model_state=False)
        elif os.path.isdir(os.path.join(checkpoint, OPTIMIZER_DIR)):  # older: local, same degree
            state = {"optimizer": get_optimizer_state_dict(self.model, self.optimizer)}
            dcp.load(state, checkpoint_id=os.path.join(checkpoint, OPTIMIZER_DIR))
            set_optimizer_state_dict(self.model, self.optimizer, state["optimizer"])
        elif os.path.isfile(os.path.join(checkpoint, hf_trainer.OPTIMIZER_NAME)):
            raise ValueError(f"{checkpoint} was written by the plain Trainer (its "
                             f"{hf_trainer.OPTIMIZER_NAME} holds the optimizer state of the "
                             f"unmodified model): TSPTrainer resumes from its own checkpoints; "
                             f"start from the weights alone with model_init or from_pretrained")
        else:
            return  # no optimizer state (save_only_model): as the Trainer, nothing to load
        self.lr_scheduler.load_state_dict(
            torch.load(os.path.join(checkpoint, SCHEDULER_NAME), weights_only=False))

    def _load_best_model(self) -> None:
        """The best checkpoint's ``model.safetensors``, each rank reading its own slices (the
        Trainer's own ``load_state_dict`` of the full tensors does not fit sharded parameters)."""
        if not self._tsp:
            return super()._load_best_model()
        hf_trainer.logger.info(f"Loading best model from {self.state.best_model_checkpoint} "
                               f"(score: {self.state.best_metric}).")
        tsp_core.load_full_state_dict(self.model, self.state.best_model_checkpoint)

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model=None) -> None:
        if not self._tsp:
            return super()._load_from_checkpoint(resume_from_checkpoint, model)
        tsp_core.load_full_state_dict(model or self.model, resume_from_checkpoint)
