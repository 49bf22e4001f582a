"""What a parallelized model carries: one typed object, :class:`TSPModelState`, instead of
attributes hung on the model.

The runtime (the model's forward and loss), the tools (generation, checkpoints, the planner) and
the framework adapters all need to know a few things about a converted model: its mesh and
policy, the long-context options it was converted with, whether FSDP2 or an engine syncs its
data-parallel gradients, the counters a trainer's guard reads. They read and write them here,
through :func:`model_state`, so that every such fact has one documented name that an import
(and the import-graph test) can see. The object lives at the bottom layer because every package
above reads it; it imports nothing above :mod:`tsp_core.distributed`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from .mesh import TSPMesh

ATTRIBUTE = "_tsp_state"  # the one attribute a converted model carries


@dataclass
class TSPModelState:
    """The state of one model converted by ``tsp_core.parallelize`` (or cut into stages by
    ``tsp_core.pipeline``). Fields a framework adapter may set are marked so; the rest are
    written by tsp_core when it converts the model."""

    mesh: TSPMesh
    policy: Any  # the DecoderPolicy that described the model (tsp_core.models.policies)
    base_class: type  # the unmodified model's class: checkpoints name it
    # rotaries whose frequencies depend on the sequence length (they take the global one)
    ropes: list = field(default_factory=list)
    tile_tokens: int | None = None  # the long-context options it was converted with
    activation_offload: bool = False
    offload: Any = None  # tsp_core.models.offload.ActivationOffload, when installed
    fsdp: bool = False  # FSDP2 shards it over "dp_shard" and sums data-parallel gradients
    gradient_sync: Any = None  # the hook handle that sums data-parallel gradients, if any
    partial: bool = False  # a pipeline rank: it holds some stages only
    # a pipeline's gather of every rank's stages into one full state dict
    gather_stages: Callable[..., Any] | None = None
    # a parameter whose optimizer state checkpoints keep under another name (a pipeline's
    # last-stage copy of a tied embedding: the embedding's)
    optimizer_names: dict[str, str] = field(default_factory=dict)
    shards_inputs: bool = False  # shard_full_batches installed its hook
    forward_calls: int = 0  # forwards run (input errors name the call)
    loss_calls: int = 0  # forwards that computed the loss (TSPTrainer's bypass guard reads it)
    # set by an adapter: the loss's gradient is multiplied by this while its value stays the
    # same (an engine that averages data-parallel gradients, DeepSpeed, sets the dp size)
    grad_scale: float = 1
    # set by an adapter: the fused LM head returns full-sequence fields (TRL's DPO)
    fused_full: bool = False

    def long_context(self) -> dict[str, Any]:
        """The long-context options, as ``parallelize`` takes them."""
        return {"tile_tokens": self.tile_tokens, "activation_offload": self.activation_offload}


def model_state(model: nn.Module) -> TSPModelState:
    """The state of a converted model; a ``ValueError`` naming the class for any other."""
    state = find_model_state(model)
    if state is None:
        raise ValueError(f"{type(model).__name__} was not parallelized with tsp_core.parallelize")
    return state


def find_model_state(model: Any) -> TSPModelState | None:
    """The state of a converted model, None for any other object."""
    return getattr(model, ATTRIBUTE, None)


def attach_model_state(model: nn.Module, state: TSPModelState) -> TSPModelState:
    """Give ``model`` its state (once: a converted model is never converted again)."""
    if find_model_state(model) is not None:
        raise ValueError(f"{type(model).__name__} already has a TSP state: it is converted")
    object.__setattr__(model, ATTRIBUTE, state)
    return state
