"""TRL's fused LM head, answered by the TSP model itself.

TRL's trainers call ``add_fused_lm_head(model)``, which replaces ``model.forward`` with one that
runs the backbone and scores the labels from ``get_output_embeddings().weight`` on one rank. A TSP
model answers ``model(..., labels=..., fused_lm_head=True)`` natively from its
vocabulary-parallel head (``tsp_core.models.runtime.fused_output``), so for it the trainers'
call must leave the forward alone; what it asked for is checked instead. The per-token fields are
this rank's tokens: what TRL sums (the loss, SFT's metrics) is then summed over the TSP group
here.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from types import ModuleType
from typing import Any

import torch
from accelerate.utils import recursively_apply

from tsp_core.distributed import comm
from tsp_core.distributed.model_state import model_state
from tsp_core.models import TSPCausalLM

# the per-token fields the TSP head computes (TRL's "log_sum_sq_probs": not yet)
NATIVE_OUTPUTS = ("log_probs", "entropy", "is_top1", "mean_logits")


def check_fused_request(model: Any, temperature: float = 1.0, cast_lm_head_to_fp32: bool = False,
                        outputs: tuple[str, ...] = ("log_probs",)) -> None:
    """What ``add_fused_lm_head`` asked of a TSP model, refused with the fix where the TSP head
    does not compute it (the same on every rank: no collective)."""
    missing = sorted(set(outputs) - set(NATIVE_OUTPUTS))
    if missing:
        raise ValueError(f"{type(model).__name__}: the trainer asks the fused LM head for "
                         f"{missing}; the TSP head computes {list(NATIVE_OUTPUTS)}")
    if temperature != 1.0:
        raise ValueError(f"{type(model).__name__}: the fused LM head's temperature "
                         f"({temperature}) is not implemented by the TSP head; use 1.0")
    del cast_lm_head_to_fp32  # the TSP head accumulates in float32 (float64 models: float64)


@contextlib.contextmanager
def native_fused_head(module: ModuleType, convert: Callable[[Any], None] | None = None,
                      full: bool = False) -> Iterator[None]:
    """While a TRL trainer's ``__init__`` runs: its module's ``add_fused_lm_head`` leaves a TSP
    model's forward alone (the model answers ``fused_lm_head=True`` itself; ``full``: with
    full-sequence fields: the state's ``fused_full``, read by
    ``tsp_core.models.runtime.fused_output``). Any other model (the reference model TRL builds)
    is first converted by ``convert`` when given, else patched as TRL does."""
    original = module.add_fused_lm_head

    def add_fused_lm_head(model: Any, *args: Any, **kwargs: Any) -> None:
        if not isinstance(model, TSPCausalLM) and convert is not None:
            convert(model)
        if isinstance(model, TSPCausalLM):
            model_state(model).fused_full = full
            return check_fused_request(model, *args, **kwargs)
        return original(model, *args, **kwargs)

    module.add_fused_lm_head = add_fused_lm_head
    try:
        yield
    finally:
        module.add_fused_lm_head = original


@contextlib.contextmanager
def metrics_summed_over(accelerator: Any, group: Any) -> Iterator[None]:
    """While TRL computes a step's metrics: ``accelerator.gather_for_metrics`` first sums each
    tensor over the TSP group (every rank holds the sums over its own tokens), then gathers one
    copy per data-parallel replica as ``TSPAccelerator`` does. A count every rank of the group
    holds whole (SFT's token count from the full batch) comes out D times: the trainer divides
    it by its ``_tp_size``, which tsp_trl sets to D."""
    gather = accelerator.gather_for_metrics

    def summed(data: Any, *args: Any, **kwargs: Any) -> Any:
        def over_group(t: torch.Tensor) -> torch.Tensor:
            t = t.detach().clone()
            comm.all_reduce(t, group)
            return t

        return gather(recursively_apply(over_group, data), *args, **kwargs)

    accelerator.gather_for_metrics = summed
    try:
        yield
    finally:
        del accelerator.gather_for_metrics


def refuse_aux_loss(trainer: Any) -> None:
    """The MoE auxiliary loss is not summed over the TSP group by tsp_trl's trainers yet: refuse
    it by name (every rank, before the first step) rather than train with a wrong one."""
    if trainer.aux_loss_enabled:
        raise ValueError(f"{type(trainer).__name__}: the MoE auxiliary loss "
                         f"(config.output_router_logits) is not yet supported under TSP by "
                         f"tsp_trl; set model.config.output_router_logits = False")
