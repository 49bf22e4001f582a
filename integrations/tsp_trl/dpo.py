"""``TSPDPOConfig`` and ``TSPDPOTrainer``: TRL's DPOTrainer under TSP (``tsp_size``).

DPO's loss is not a sum over tokens: each sequence's summed log-probability goes through a
sigmoid. So the TSP model returns TRL's fused fields for the full sequence, gathered over the
group in the original order (``tsp_core.models.runtime.fused_output``, ``[batch, seq - 1]``
floats per field, never the head or the logits); every rank of the group then computes the same
loss, rewards and metrics as one process on the replica's rows, and each backpropagates through
its own tokens. The reference model is a TSP model on the same mesh (TRL builds it from the
policy's path, or pass ``ref_model=``), or its log-probabilities are precomputed
(``precompute_ref_log_probs``) by the TSP policy. With ``peft_config=`` (LoRA) the policy is
the converted PeftModel and the reference is that model with its adapter disabled, as
DPOTrainer's on one process (:class:`_DPOFromPeftConfig`), unless ``ref_model=`` is given: TRL
then scores the reference with that model, and so does TSP (converted like any reference)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import trl.trainer.dpo_trainer as trl_dpo
from torch import nn
from transformers import set_seed
from trl import DPOConfig, DPOTrainer

import tsp_core
from tsp_core.distributed.mesh import get_mesh
from tsp_core.models import shard_full_batches
from tsp_transformers import TSPTrainer, TSPTrainingArguments
from tsp_transformers.trainer import requested_tsp_size

from .adapters import apply_peft_config, built_peft_model, refuse_peft_model
from .fused_head import native_fused_head, refuse_aux_loss
from .sft import check_model_object, default_config


@dataclass
class TSPDPOConfig(DPOConfig, TSPTrainingArguments):
    """``DPOConfig`` (its own defaults) plus ``tsp_size`` and TSP's other fields."""


class _DPOFromPeftConfig(DPOTrainer):
    """DPOTrainer below TSPTrainer (which converts the model it is given) in TSPDPOTrainer's
    bases. When TSPDPOTrainer built the PeftModel from ``peft_config`` before the conversion,
    DPOTrainer is given what it is given on one process, the model (the one inside the
    converted PeftModel) and ``peft_config``, and its ``get_peft_model`` returns the converted
    PeftModel (:func:`.adapters.built_peft_model`): TRL's ``peft_config=`` path, whose reference
    is the policy with its adapter disabled. Handed the PeftModel itself, TRL would take it for
    an adapter to train further and add a frozen copy of it, a second adapter, as the
    reference."""

    def __init__(self, model: Any = None, args: Any = None, ref_model: Any = None,
                 **kwargs: Any) -> None:
        built = self.__dict__.pop("_built_peft", None)
        if built is None:
            super().__init__(model, args=args, ref_model=ref_model, **kwargs)
            return
        assert model is built, "TSPTrainer hands on the model it converted"
        with built_peft_model(trl_dpo, built, kwargs["peft_config"]):
            super().__init__(built.get_base_model(), args=args, ref_model=ref_model, **kwargs)


class TSPDPOTrainer(TSPTrainer, _DPOFromPeftConfig):
    """``DPOTrainer`` with TSP when ``args.tsp_size`` > 1 (``TSPDPOConfig``); otherwise exactly
    ``DPOTrainer``. ``peft_config=`` (LoRA) is applied before the conversion, as DPOTrainer
    applies it (its seed, its checks); a PeftModel without ``peft_config`` trains with a
    ``ref_model=`` (TRL's reference then), and without one is refused (TRL's reference for it
    would be a second adapter). A ``ref_model=`` is the reference in every case, as in TRL: it
    is converted on the policy's mesh, never replaced by the adapter disabled."""

    def __init__(self, model: Any = None, ref_model: Any = None,
                 args: TSPDPOConfig | None = None, **kwargs: Any) -> None:
        args = default_config(model, TSPDPOConfig, "DPO") if args is None else args
        check_model_object(model, args, type(self).__name__)
        peft_config = kwargs.get("peft_config")
        if requested_tsp_size(args) != 1:
            refuse_peft_model(model, peft_config, ref_model, type(self).__name__)
            if peft_config is not None:
                # DPOTrainer seeds torch with args.seed just before its get_peft_model: the
                # adapters of one process, on every rank
                set_seed(args.seed)
                model = self._built_peft = apply_peft_config(model, peft_config, args)
        with native_fused_head(trl_dpo, self._to_tsp, full=True):
            super().__init__(model, args=args, ref_model=ref_model, **kwargs)
        if not self._tsp:
            return
        refuse_aux_loss(self)
        # the fused fields are the full sequences, the same on every rank of the group: the
        # data-parallel gather of TSPAccelerator counts each token once
        self._tp_size = 1

    tsp_args_class = TSPDPOConfig  # what a plain DPOConfig / TrainingArguments becomes

    def _to_tsp(self, model: nn.Module) -> None:
        """The reference model, on the policy's mesh (every rank, before any step); without
        TSP (the resolved size is 1) left as it is."""
        if not self._tsp:
            return
        tsp_core.parallelize(model, get_mesh(self.model))
        shard_full_batches(model)
        model.requires_grad_(False)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if not self._tsp:
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        # DPO's loss is a mean over this replica's sequences (DPO takes no num_items_in_batch)
        out = super().compute_loss(model, inputs, return_outputs, None)
        loss = out[0] if return_outputs else out
        dp = get_mesh(self.model).dp_size
        if dp > 1 and self.model.training:
            # DDP would average the replicas' gradients, tsp_core sums them: the gradient of the
            # mean, the value (what the Trainer logs) unchanged
            loss = loss / dp + (loss - loss / dp).detach()
        return (loss, out[1]) if return_outputs else loss
