"""``initialize``: ``deepspeed.initialize`` with TSP (docs/deepspeed.md).

- The model is converted with ``tsp_core.parallelize``; its DTensor parameters become plain
  local tensors, which DeepSpeed's flat buffers take. Shards are marked
  ``tensor_model_parallel = True`` so that DeepSpeed's gradient norm (clipping is on by default)
  sums them over the TSP group and counts replicated ones once.
- An mpu (:class:`TSPMPU`) gives DeepSpeed the data-parallel and TSP groups, so ZeRO partitions
  and reduces over the data-parallel axis only, and its initial parameter broadcast stays inside
  each data-parallel group. No sequence-parallel getters: their presence switches DeepSpeed to
  Ulysses.
- DeepSpeed averages data-parallel gradients, while the TSP loss is already the global mean, so
  the model scales its loss's gradient (not its value) by the data-parallel size, and tsp_core's
  own data-parallel gradient sum is switched off.
- Under ZeRO-3 the TSP modules read their children's parameters (``q_proj.weight``, ...) in their
  own forward, so those are registered as external parameters of the TSP module.
- Frameworks that call ``deepspeed.initialize`` themselves (Lightning's DeepSpeedStrategy,
  Accelerate) pass no mpu; inside :func:`routed` their call goes through :func:`initialize`.
  Their model may wrap (a LightningModule) a model they converted already: its mesh is used.
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

import tsp_core
from tsp_core.distributed.data_parallel import remove_gradient_sync
from tsp_core.distributed.mesh import TSPMesh, get_mesh
from tsp_core.distributed.model_state import model_state
from tsp_core.distributed.params import ShardedModule
from tsp_core.layers.tiles import check_tile_tokens
from tsp_core.models import TSPCausalLM
from tsp_core.models.offload import check_converted
from tsp_core.plan.auto import TSPChoice, is_auto, log_choice, resolve_degree


def check_mesh(mesh: TSPMesh) -> None:
    """DeepSpeed takes one data-parallel group, and its ZeRO partitions the model state over it
    itself: any other mesh is refused, the same on every rank, before anything changes."""
    if mesh.shard_dim is not None:
        raise ValueError(
            f"tsp_deepspeed got a mesh with dp_shard={mesh.fsdp_size} (dims "
            f"{mesh.device_mesh.mesh_dim_names}): DeepSpeed's ZeRO shards the model and optimizer "
            f"state over the data-parallel ranks itself, so the mesh must not shard them too. "
            f"Build it without dp_shard, tsp_core.init_mesh(tsp_size={mesh.size}) (data parallel "
            f"{mesh.dp_size}), and parallelize with that (or pass the unconverted model); choose "
            f"how much ZeRO shards with zero_optimization.stage in the DeepSpeed config")
    if len(mesh.other_dims) != 1:
        raise ValueError(f"DeepSpeed takes one data-parallel dim; the mesh has {mesh.other_dims}: "
                         f"build it with tsp_core.init_mesh(tsp_size={mesh.size})")


class TSPMPU:
    """The model-parallel unit DeepSpeed asks for: data-parallel and TSP groups."""

    def __init__(self, mesh: TSPMesh) -> None:
        check_mesh(mesh)
        self.mesh, self._dm, (self._dp_dim,) = mesh, mesh.device_mesh, mesh.other_dims

    def get_data_parallel_group(self):
        return self._dm.get_group(self._dp_dim)

    def get_data_parallel_world_size(self) -> int:
        return self.mesh.dp_size

    def get_data_parallel_rank(self) -> int:
        return self._dm.get_local_rank(self._dp_dim)

    def get_model_parallel_group(self):
        return self.mesh.group

    def get_model_parallel_world_size(self) -> int:
        return self.mesh.size

    def get_model_parallel_rank(self) -> int:
        return self.mesh.rank

    get_tensor_model_parallel_group = get_model_parallel_group
    get_tensor_model_parallel_world_size = get_model_parallel_world_size
    get_tensor_model_parallel_rank = get_model_parallel_rank


def _plain_parameters(model: nn.Module) -> dict[str, nn.Parameter]:
    """Replace every DTensor parameter by its local tensor; shards get tensor_model_parallel."""
    for module in model.modules():
        for name, p in list(module.named_parameters(recurse=False)):
            if isinstance(p, DTensor):
                plain = nn.Parameter(p.to_local().detach(), requires_grad=p.requires_grad)
                plain.tensor_model_parallel = any(pl.is_shard() for pl in p.placements)
                setattr(module, name, plain)
    tied = [m for m in model.modules() if getattr(m, "tied", False)]
    for head in tied:  # the LM head shares the embedding's (now plain) parameter again
        embed = next(m for m in model.modules() if isinstance(m, tsp_core.TSPEmbedding))
        head.weight = embed.weight
    return dict(model.named_parameters())


def resolve_tsp_size(model: nn.Module, size: Any, section: dict, config: dict) -> TSPChoice:
    """The degree to convert with: ``size`` (argument or ``"tsp": {"size": ...}``); None =
    ``TSP_SIZE`` from the environment, else every process of the node; ``"auto"`` = the
    planner's smallest degree inside a node that fits in memory, for the model's config,
    ``"tsp": {"seq_len": S, "memory_gb": M}`` (or ``TSP_SEQ_LEN`` / the config's
    max_position_embeddings, ``TSP_MEMORY_GB`` / detected) and
    ``train_micro_batch_size_per_gpu`` sequences. The same on every rank, before any
    collective."""
    local = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1")))
    micro = config.get("train_micro_batch_size_per_gpu")
    return resolve_degree(size, local_processes=local, model_config=getattr(model, "config", None),
                          seq_len=section.get("seq_len"), memory_gb=section.get("memory_gb"),
                          batch=micro if isinstance(micro, int) else 1)


def _convert(model: nn.Module, size: Any, section: dict, config: dict,
             long_context: dict[str, Any]) -> tuple[nn.Module, TSPMesh]:
    """The TSP model in ``model`` (converted here unless a framework did already) and its mesh.
    ``long_context``: ``tsp_core.parallelize``'s ``tile_tokens`` and ``activation_offload``,
    which a model converted already must have been converted with."""
    converted = [m for m in model.modules() if isinstance(m, TSPCausalLM)]
    if converted:
        mesh = get_mesh(converted[0])
        if size is not None and not is_auto(size) and int(size) != mesh.size:
            raise ValueError(f"tsp_size ({size}) differs from the TSP degree ({mesh.size}) the "
                             f"model was converted with; leave tsp_size unset or convert with "
                             f"{size}")
        check_converted(converted[0], **long_context)
        return converted[0], mesh
    choice = resolve_tsp_size(model, size, section, config)
    log_choice(choice)
    mesh = tsp_core.init_mesh(choice.size)
    return tsp_core.parallelize(model, mesh, **long_context), mesh


def _count_data_parallel_ranks(config: dict, mesh: TSPMesh) -> None:
    """DeepSpeed requires train_batch_size = micro batch x accumulation x data-parallel size.
    Accelerate fills it in counting every process, which under TSP is never right: that exact
    value is replaced (any other is left for DeepSpeed to judge)."""
    micro = config.get("train_micro_batch_size_per_gpu")
    steps = config.get("gradient_accumulation_steps", 1)
    if mesh.size > 1 and isinstance(micro, int) and isinstance(steps, int) \
            and config.get("train_batch_size") == micro * steps * mesh.device_mesh.size():
        config["train_batch_size"] = micro * steps * mesh.dp_size


def initialize(model: nn.Module, config: dict | str | None = None, tsp_size: int | None = None,
               model_parameters: Any = None, *, tile_tokens: int | None = None,
               activation_offload: bool = False, **kwargs: Any):
    """``deepspeed.initialize(model=..., config=..., ...)`` with TSP; returns what it returns.
    ``tsp_size`` may also come from a ``"tsp": {"size": D}`` section of the config (also given as
    ``config_params``); default: every process of the node; ``"auto"``: :func:`resolve_tsp_size`.
    ``tile_tokens`` and ``activation_offload`` (also ``"tsp": {"tile_tokens": T,
    "activation_offload": true}``) are ``tsp_core.parallelize``'s (docs/long-context.md;
    offload needs activation checkpointing: ``model.activation_checkpointing_enable()``).
    ``model_parameters`` (parameters or param groups of the model as built) and the param groups
    of an ``optimizer`` built on them are mapped to the converted model's parameters by name."""
    if config is None:
        config = kwargs.pop("config_params", None)
    if isinstance(config, (str, os.PathLike)):
        with open(config) as f:
            config = json.load(f)
    config = dict(config or {})
    section = config.pop("tsp", {})
    long_context = {"tile_tokens": tile_tokens if tile_tokens is not None
                    else section.get("tile_tokens"),
                    "activation_offload": bool(activation_offload
                                               or section.get("activation_offload", False))}
    check_tile_tokens(long_context["tile_tokens"])  # before any collective
    # the user's parameters refer to the model before conversion: read them (and keep them alive,
    # so their ids stay unique) before anything changes
    given = None if model_parameters is None else list(model_parameters)
    names = {id(p): n for n, p in model.named_parameters()}
    tsp_model, mesh = _convert(model, tsp_size or section.get("size"), section, config,
                               long_context)
    check_mesh(mesh)  # before the model changes
    _count_data_parallel_ranks(config, mesh)
    remove_gradient_sync(tsp_model)
    model_state(tsp_model).grad_scale = mesh.dp_size
    params = _plain_parameters(model)
    import deepspeed

    if config.get("zero_optimization", {}).get("stage", 0) == 3:
        for module in model.modules():
            if isinstance(module, ShardedModule):
                for p in module.parameters():
                    deepspeed.zero.register_external_parameter(module, p)

    def convert(p):
        return params[names[id(p)]] if id(p) in names else p

    if given is None:
        model_parameters = list(params.values())
    elif given and isinstance(given[0], dict):
        model_parameters = [{**g, "params": [convert(p) for p in g["params"]]} for g in given]
    else:
        model_parameters = [convert(p) for p in given]
    optimizer = kwargs.get("optimizer")
    if isinstance(optimizer, torch.optim.Optimizer):  # built on the parameters before conversion
        for group in optimizer.param_groups:
            group["params"] = [convert(p) for p in group["params"]]
    args = kwargs.get("args")
    if args is not None and getattr(args, "device_rank", 0) is None:
        # Lightning passes its root device's index: None for a CPU device, which DeepSpeed
        # compares with 0. DeepSpeed's own default is the local rank.
        kwargs["args"] = argparse.Namespace(**{**vars(args),
                                               "device_rank": int(os.environ.get("LOCAL_RANK", 0))})
    ds_initialize = _ORIGINAL or deepspeed.initialize  # DeepSpeed's own, also inside routed()
    return ds_initialize(model=model, model_parameters=model_parameters, config=config,
                         mpu=TSPMPU(mesh), **kwargs)


_ORIGINAL: Callable | None = None  # deepspeed.initialize while routed() has replaced it


@contextmanager
def routed(**defaults: Any) -> Iterator[None]:
    """While inside, ``deepspeed.initialize`` is :func:`initialize` (with ``defaults``, e.g.
    ``tsp_size``), for frameworks that call ``deepspeed.initialize`` themselves and pass no mpu
    (Lightning's DeepSpeedStrategy, Accelerate's DeepSpeed path)."""
    import deepspeed

    global _ORIGINAL
    if _ORIGINAL is not None:
        raise RuntimeError("tsp_deepspeed.routed() is already active")
    _ORIGINAL = deepspeed.initialize
    deepspeed.initialize = lambda **kwargs: initialize(**{**defaults, **kwargs})
    try:
        yield
    finally:
        deepspeed.initialize, _ORIGINAL = _ORIGINAL, None
