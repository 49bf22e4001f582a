"""``TSPSFTConfig`` and ``TSPSFTTrainer``: TRL's SFTTrainer under TSP (``tsp_size``), exact
against one process: the loss from the vocabulary-parallel head's per-token log-probabilities
summed over the TSP group, SFT's metrics (``mean_token_accuracy``, ``entropy``, ``num_tokens``)
over the global batch. With ``average_tokens_across_devices=False`` each replica's loss is the
mean over its own tokens and the gradient the mean over replicas, as SFTTrainer's under DDP."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import trl.trainer.sft_trainer as trl_sft
from transformers import set_seed
from trl import SFTConfig, SFTTrainer
from trl.trainer.utils import get_config_model_id

from tsp_core.distributed import comm
from tsp_core.distributed.mesh import get_mesh
from tsp_transformers import TSPTrainer, TSPTrainingArguments
from tsp_transformers.trainer import requested_tsp_size

from .adapters import apply_peft_config
from .fused_head import metrics_summed_over, native_fused_head, refuse_aux_loss


@dataclass
class TSPSFTConfig(SFTConfig, TSPTrainingArguments):
    """``SFTConfig`` (its own defaults) plus ``tsp_size`` and TSP's other fields."""


def default_config(model: Any, cls: type, suffix: str) -> TSPTrainingArguments:
    """What TRL's trainer builds when given no arguments (``<model name>-SFT``), as ``cls``:
    leaving the arguments out still means TSP with its defaults, as it does for TSPTrainer."""
    name = model if isinstance(model, str) else get_config_model_id(model.config)
    return cls(f"{name.split('/')[-1]}-{suffix}")


def check_model_object(model: Any, args: Any, trainer: str) -> None:
    """TSP converts the model object it is given: a model name or path is refused (before any
    collective) with the fix."""
    size = requested_tsp_size(args)
    if isinstance(model, str) and size != 1:
        raise ValueError(f"{trainer} with tsp_size={size} converts the model it is "
                         f"given: load {model!r} first (AutoModelForCausalLM.from_pretrained, "
                         f"or tsp_transformers.load_pretrained to read it shard by shard)")


class TSPSFTTrainer(TSPTrainer, SFTTrainer):
    """``SFTTrainer`` with TSP when ``args.tsp_size`` > 1 (``TSPSFTConfig``); otherwise exactly
    ``SFTTrainer``. The TSP model answers TRL's ``fused_lm_head=True`` itself, from its
    vocabulary-parallel head (TRL's ``add_fused_lm_head`` leaves it alone); the loss SFT builds
    from this rank's tokens is summed over the TSP group, and so are the sums behind its
    metrics before TRL gathers them over data parallel. ``peft_config=`` (LoRA) is applied
    before the conversion, as SFTTrainer applies it (:func:`.adapters.apply_peft_config`)."""

    _per_replica_token_counts = True  # compute_loss: average_tokens_across_devices=False
    tsp_args_class = TSPSFTConfig  # what a plain SFTConfig / TrainingArguments becomes

    def __init__(self, model: Any = None, args: TSPSFTConfig | None = None, *rest: Any,
                 **kwargs: Any) -> None:
        args = default_config(model, TSPSFTConfig, "SFT") if args is None else args
        check_model_object(model, args, type(self).__name__)
        if kwargs.get("peft_config") is not None and requested_tsp_size(args) != 1:
            # PEFT before the TSP conversion, as SFTTrainer would apply it, after seeding torch
            # with args.seed as it does; TRL gets the PeftModel it would have built (docs/lora.md)
            set_seed(args.seed)
            model = apply_peft_config(model, kwargs["peft_config"], args)
            kwargs["peft_config"] = None
        with native_fused_head(trl_sft):
            super().__init__(model, args, *rest, **kwargs)
        if not self._tsp:
            return
        refuse_aux_loss(self)
        self._tp_size = get_mesh(self.model).size  # see metrics_summed_over

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if not self._tsp:
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        mesh = get_mesh(self.model)
        counted = num_items_in_batch is not None
        if not counted:
            if self.model.training:
                raise ValueError(f"{type(self).__name__}: the Trainer passed no "
                                 f"num_items_in_batch to a training step (model_accepts_loss_"
                                 f"kwargs={self.model_accepts_loss_kwargs}); under TSP the loss "
                                 f"needs the global batch's token count: use a model class "
                                 f"whose accepts_loss_kwargs is not False")
            # evaluation (SFT's prediction_step counts nothing): SFT would divide this rank's
            # tokens by this rank's count; the count of the replica's whole batch (every rank
            # of the group holds it) makes the sum over the group the replica's mean, as SFT's
            # on one process
            num_items_in_batch = label_count(inputs)
        per_replica = counted and not self.args.average_tokens_across_devices
        if per_replica:
            # the Trainer counted this replica's tokens (every rank of the group holds them
            # whole) and divided the count by its tp size, D: the replica's count again, so the
            # sum over the group is the replica's own mean, as SFT's on each DDP replica
            count = torch.as_tensor(num_items_in_batch) * self.get_tp_size()
            num_items_in_batch = torch.round(count)
        with metrics_summed_over(self.accelerator, mesh.group):
            out = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        loss = out[0] if return_outputs else out
        if per_replica:
            loss = comm.sum_over(loss, [mesh.group])  # this replica's mean
            if mesh.dp_size > 1:
                # DDP averages the replicas' gradients, tsp_core sums them: the gradient of
                # the mean over replicas, the value (what the Trainer averages and logs) kept
                loss = loss / mesh.dp_size + (loss - loss / mesh.dp_size).detach()
        elif counted:
            # SFT's loss sums this rank's tokens: the global sum over the whole mesh, as the
            # TSP forward's loss (every rank logs it); the backward passes the gradient
            # through, and tsp_core sums the data-parallel gradients
            loss = comm.sum_over(loss, mesh.all_groups)
        else:
            if self.args.average_tokens_across_devices and not (
                    self.model_accepts_loss_kwargs or self.compute_loss_func):
                # SFT scaled the loss by the data-parallel size for DDP's averaging of a
                # global count; TSPTrainer undoes that only for a model taking loss kwargs
                loss = loss / mesh.dp_size
            loss = comm.sum_over(loss, [mesh.group])  # this replica's mean
        return (loss, out[1]) if return_outputs else loss


def label_count(inputs: dict[str, Any]) -> torch.Tensor:
    """The labelled tokens of a batch every rank of the TSP group holds whole: what SFT's
    ``label_mask`` counts over the full sequences (the Trainer's own count, before it sums over
    data parallel)."""
    labels = inputs.get("shift_labels")
    if labels is None:
        labels = inputs["labels"][..., 1:]
    return labels.ne(-100).sum()
