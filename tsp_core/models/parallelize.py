"""Turn a Hugging Face decoder-only causal LM into a TSP model, in place, in four stages:

1. read the model into one spec per layer (:mod:`.reading`);
2. check everything that can fail, before anything changes (:mod:`.checks`);
3. build the TSP modules from the specs (:mod:`.build`);
4. wrap: swap them in, make the model a TSP causal LM with its state, FSDP2 or data-parallel
   gradient sync (:mod:`.wrap`; the runtime is :mod:`.runtime`);
5. (``compile``) compile each decoder layer (:mod:`.compiled`).

Attention and MLP become TSP modules holding this rank's slice of the model's own weights, the
embedding and LM head are vocabulary-sharded, norms are replicated; every parameter is a DTensor
with its Hugging Face name and (full) shape. The model's forward then takes the output of
:func:`tsp_core.shard_batch` and returns a ``CausalLMOutputWithPast`` whose loss is the global
mean, identical on every rank.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from ..distributed.mesh import TSPMesh
from .build import ModulePlan, plan_modules
from .checks import check_model, check_options
from .compiled import check_compile, compile_layers
from .lora import PeftAdapters, read_peft
from .policies import DecoderPolicy, find_policy
from .reading import moe_schedule_for, placement, read_model
from .wrap import apply_plan, wrap_model


def parallelize(model: nn.Module, mesh: TSPMesh, *, policy: DecoderPolicy | None = None,
                moe_schedule: str = "auto", moe_tokens_per_rank: int | None = None,
                mp_policy: Any = None, reshard_after_forward: bool = True,
                tile_tokens: int | None = None, activation_offload: bool = False,
                compile: bool | str = False) -> nn.Module:
    """Convert ``model`` in place to TSP on ``mesh`` and return it. A model whose parameters are
    all on the meta device gets uninitialised shards (fill them with load_full_state_dict).

    When the mesh shards data parallel too (``init_mesh(..., dp_shard=N)``, N > 1), FSDP2's
    ``fully_shard`` then splits each rank's TSP shards over "dp_shard", per decoder layer and the
    root (:mod:`tsp_core.distributed.fsdp`): ``mp_policy`` is its ``MixedPrecisionPolicy`` (e.g.
    bf16 parameters, float32 gradient reduction) and ``reshard_after_forward`` its option of that
    name. Build the optimizer after this call.

    With data parallelism every replica must hold the same weights (build the model from the
    same seed on every rank, or load it): checked with one small all-gather before the model
    changes (:mod:`tsp_core.models.replicas`), since DDP's broadcast of rank 0's weights does not
    happen here.

    Mixture-of-experts layers (:mod:`tsp_core.layers.moe`) run ``moe_schedule`` "expert" (whole
    experts per rank, routed tokens move) or "ring" (every expert's channels split, weights move);
    "auto" picks per layer the one that moves fewer bytes for ``moe_tokens_per_rank`` (batch x
    sequence / tsp_size of the run), "expert" when that is not given.

    Long context (docs/long-context.md): the MLP, the experts and the loss run over a rank's
    tokens ``tile_tokens`` at a time (None: chosen from the model's sizes so that a tile's working
    set stays under :data:`tsp_core.layers.tiles.TILE_BYTES`); ``activation_offload`` keeps each
    checkpointed decoder layer's saved input in host memory between its forward and its backward
    (:mod:`tsp_core.models.offload`; needs activation checkpointing:
    ``model.activation_checkpointing_enable()``).

    A PEFT ``PeftModel`` with LoRA adapters (docs/lora.md) is converted as the Hugging Face model
    inside it, its adapters replicated on every rank and applied to each rank's own tokens, its
    base weights frozen; the PeftModel itself is returned.

    ``compile`` compiles each decoder layer with ``torch.compile(fullgraph=True)``: True with
    torch's default backend (inductor), or a backend's name (docs/design.md "Compiled layers":
    what is tested, and what is not yet)."""
    check_options(mesh, mp_policy, tile_tokens, moe_schedule)
    check_compile(compile)
    adapters = read_peft(model, mesh, policy)  # a PeftModel: its LoRA adapters (docs/lora.md)
    if adapters is None:
        convert(model, mesh, policy, moe_schedule, moe_tokens_per_rank, mp_policy,
                reshard_after_forward, tile_tokens, activation_offload)
        compile_layers(model, compile)                                   # 5. compile
        return model
    with adapters.unwrapped() as hf_model:  # the PEFT layers' base Linears in their place
        convert(hf_model, mesh, policy, moe_schedule, moe_tokens_per_rank, mp_policy,
                reshard_after_forward, tile_tokens, activation_offload, adapters)
        compile_layers(hf_model, compile)
    return model


def convert(model: nn.Module, mesh: TSPMesh, policy: DecoderPolicy | None, moe_schedule: str,
            moe_tokens_per_rank: int | None, mp_policy: Any, reshard_after_forward: bool,
            tile_tokens: int | None, activation_offload: bool,
            adapters: PeftAdapters | None = None) -> None:
    """The four stages on a Hugging Face model (with a PeftModel's ``adapters``, their
    schedules checked before anything changes, attached before the wrap)."""
    policy = policy or find_policy(model)
    moe_schedule = moe_schedule_for(model, mesh, policy, moe_schedule, moe_tokens_per_rank)
    spec = read_model(model, mesh, policy)                               # 1. read
    check_model(model, mesh, policy, spec, moe_schedule)                 # 2. check
    empty = next(model.parameters()).is_meta  # weights come later, from load_full_state_dict
    plan = plan_modules(model, ModulePlan(mesh, policy, spec, placement(model, mesh), empty,
                                          moe_schedule))                 # 3. build
    hosts = adapters.check(plan) if adapters is not None else {}
    apply_plan(model, plan)                                              # 4. wrap
    if adapters is not None:
        adapters.attach(hosts, mesh)
    wrap_model(model, plan, tile_tokens, activation_offload, mp_policy, reshard_after_forward)
