"""``load_pretrained``: a ``save_pretrained`` checkpoint straight into a TSP model, each rank
reading only its own slices (the full model never exists on any rank)."""

from __future__ import annotations

import os

import torch
from torch import nn

import tsp_core
from tsp_core.distributed.mesh import TSPMesh
from tsp_core.layers.tiles import check_tile_tokens


def load_pretrained(path: str | os.PathLike, tsp_size: int | None = None, *,
                    mesh: TSPMesh | None = None, dtype: torch.dtype | None = None,
                    tile_tokens: int | None = None, activation_offload: bool = False) -> nn.Module:
    """Build the model of ``path`` with parameters on the meta device (buffers such as rotary
    frequencies materialised), convert it with :func:`tsp_core.parallelize` and fill every rank's
    shards from the safetensors files, slice by slice. Returns the model in eval mode, like
    ``from_pretrained``; ``model.save_pretrained`` writes an ordinary checkpoint back.
    ``tile_tokens`` and ``activation_offload`` are ``parallelize``'s (docs/long-context.md;
    offload needs activation checkpointing, enabled on the returned model before training)."""
    check_tile_tokens(tile_tokens)  # before the mesh's process groups
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    if mesh is None:
        mesh = tsp_core.init_mesh(tsp_size or int(os.environ.get("WORLD_SIZE", "1")))
    config = AutoConfig.from_pretrained(path)
    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype or config.dtype)
    tsp_core.parallelize(model, mesh, tile_tokens=tile_tokens,
                         activation_offload=activation_offload)
    tsp_core.load_full_state_dict(model, path)
    try:
        model.generation_config = GenerationConfig.from_pretrained(path)
    except OSError:
        pass  # no generation_config.json: keep the default
    return model.eval()
