"""``initialize``: ``deepspeed.initialize`` with TSP (facts from INTEGRATION_NOTES).

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
"""

from __future__ import annotations

import json
import os
from typing import Any

from torch import nn
from torch.distributed.tensor import DTensor

import tsp_core
from tsp_core.data_parallel import remove_gradient_sync
from tsp_core.mesh import TSPMesh
from tsp_core.parallelize import TSPCausalLM
from tsp_core.params import ShardedModule


class TSPMPU:
    """The model-parallel unit DeepSpeed asks for: data-parallel and TSP groups."""

    def __init__(self, mesh: TSPMesh) -> None:
        if len(mesh.other_dims) != 1:
            raise ValueError(f"DeepSpeed takes one data-parallel dim; the mesh has {mesh.other_dims}")
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


def initialize(model: nn.Module, config: dict | str | None = None, tsp_size: int | None = None,
               model_parameters: Any = None, **kwargs: Any):
    """``deepspeed.initialize(model=..., config=..., ...)`` with TSP; returns what it returns.
    ``tsp_size`` may also come from a ``"tsp": {"size": D}`` section of the config.
    ``model_parameters`` (parameters or param groups of the original model) are mapped to the
    converted model's parameters by name."""
    import deepspeed

    if isinstance(config, (str, os.PathLike)):
        with open(config) as f:
            config = json.load(f)
    config = dict(config or {})
    section = config.pop("tsp", {})
    size = tsp_size or section.get("size") or int(os.environ.get("LOCAL_WORLD_SIZE",
                                                                 os.environ.get("WORLD_SIZE", "1")))
    mesh = tsp_core.init_mesh(int(size))
    # the user's parameters refer to the model before conversion: read them (and keep them alive,
    # so their ids stay unique) before anything changes
    given = None if model_parameters is None else list(model_parameters)
    names = {id(p): n for n, p in model.named_parameters()}
    if not isinstance(model, TSPCausalLM):
        tsp_core.parallelize(model, mesh)
    remove_gradient_sync(model)
    model._tsp_grad_scale = mesh.dp_size
    params = _plain_parameters(model)
    if config.get("zero_optimization", {}).get("stage", 0) == 3:
        for module in model.modules():
            if isinstance(module, ShardedModule):
                for p in module.parameters():
                    deepspeed.zero.register_external_parameter(module, p)
    if given is None:
        model_parameters = list(params.values())
    else:
        def convert(p):
            return params[names[id(p)]] if id(p) in names else p

        if given and isinstance(given[0], dict):
            model_parameters = [{**g, "params": [convert(p) for p in g["params"]]} for g in given]
        else:
            model_parameters = [convert(p) for p in given]
    return deepspeed.initialize(model=model, model_parameters=model_parameters, config=config,
                                mpu=TSPMPU(mesh), **kwargs)
