"""Full (Hugging Face-format) state dicts in and out of a TSP model.

``full_state_dict`` gathers every parameter to its Hugging Face name and full shape (KV-head
copies taken once, vocabulary padding dropped; parts a TSP module keeps of a fused Hugging Face
tensor, Phi-3's q/k/v of ``qkv_proj``, as that one tensor). ``load_full_state_dict`` lets each rank read only
its own slices: from a dict, or from the safetensors files ``save_pretrained`` writes, which are
read slice by slice, never whole.
"""

from __future__ import annotations

import json
import os
from contextlib import ExitStack
from typing import Mapping

import torch
from torch import nn

from .params import FullSource, ShardedModule, TensorSource
from .vocab import TSPLMHead


class SafetensorsSource:
    """Full tensors in a safetensors file, a ``save_pretrained`` directory (single file or an
    index of shards); reads only the requested slice of each tensor."""

    def __init__(self, path: str | os.PathLike, stack: ExitStack) -> None:
        from safetensors import safe_open

        path = os.fspath(path)
        if os.path.isdir(path):
            index = os.path.join(path, "model.safetensors.index.json")
            if os.path.exists(index):
                with open(index) as f:
                    weight_map = json.load(f)["weight_map"]
                files = {n: os.path.join(path, fn) for n, fn in weight_map.items()}
            else:
                single = os.path.join(path, "model.safetensors")
                if not os.path.exists(single):
                    raise FileNotFoundError(f"no model.safetensors or model.safetensors.index.json "
                                            f"in {path}")
                files = None
                path = single
        else:
            files = None
        handles = {}

        def handle(fn: str):
            if fn not in handles:
                handles[fn] = stack.enter_context(safe_open(fn, framework="pt"))
            return handles[fn]

        if files is None:
            h = handle(path)
            files = {n: path for n in h.keys()}
        self._files, self._handle = files, handle
        self.elements_read = 0  # what this rank actually read (tests check it is ~1/D)

    def shape(self, name: str) -> tuple[int, ...] | None:
        fn = self._files.get(name)
        return None if fn is None else tuple(self._handle(fn).get_slice(name).get_shape())

    def read(self, name: str, dim: int | None, start: int, length: int) -> torch.Tensor:
        h = self._handle(self._files[name])
        if dim is None:
            t = h.get_tensor(name)
        else:
            t = h.get_slice(name)[tuple([slice(None)] * dim + [slice(start, start + length)])]
        self.elements_read += t.numel()
        return t


class _Prefixed:
    def __init__(self, source: FullSource, prefix: str) -> None:
        self.source, self.prefix = source, prefix

    def shape(self, name: str):
        return self.source.shape(self.prefix + name)

    def read(self, name: str, dim, start, length):
        return self.source.read(self.prefix + name, dim, start, length)


def _sharded_modules(model: nn.Module):
    """(prefix, module) for every TSP module, the tied LM head included, in a fixed order."""
    return [(f"{n}." if n else "", m) for n, m in model.named_modules(remove_duplicate=False)
            if isinstance(m, ShardedModule)]


def full_state_dict(model: nn.Module, *, rank0_only: bool = False) -> dict[str, torch.Tensor]:
    """Hugging Face names and full shapes. Every rank must call it (it gathers); with
    ``rank0_only`` the other ranks get an empty dict."""
    sharded = _sharded_modules(model)
    owners = {prefix + name for prefix, m in sharded for name, _ in m.named_parameters()}
    out: dict[str, torch.Tensor] = {}
    for prefix, m in sharded:
        for name, t in m.full_tensors().items():
            out[prefix + name] = t
    for name, t in model.state_dict().items():
        if name not in owners:
            out[name] = t.detach()
    mesh = getattr(model, "_tsp_mesh", None)
    if rank0_only and mesh is not None and mesh.device_mesh.get_rank() != 0:
        return {}
    return out


def load_full_state_dict(model: nn.Module,
                         state_dict_or_path: Mapping[str, torch.Tensor] | str | os.PathLike) -> int:
    """Keep this rank's slices of a full Hugging Face state dict, or of a ``save_pretrained``
    checkpoint on disk (read slice by slice). A tied LM head is loaded through the embedding.
    Returns the number of elements read from disk (0 for a dict)."""
    with ExitStack() as stack:
        if isinstance(state_dict_or_path, Mapping):
            source: FullSource = TensorSource(state_dict_or_path)
        else:
            source = SafetensorsSource(state_dict_or_path, stack)
        sharded = _sharded_modules(model)
        owners = set()
        for prefix, m in sharded:
            owners |= {prefix + n for n, _ in m.named_parameters()}
            if isinstance(m, TSPLMHead) and m.tied:
                continue  # the embedding's load fills the shared weight
            m.load_full(_Prefixed(source, prefix))
        with torch.no_grad():
            for name, t in model.state_dict(keep_vars=True).items():
                if name in owners:
                    continue
                shape = source.shape(name)
                if shape is None:
                    continue  # non-persistent or absent entries keep their values
                if shape != tuple(t.shape):
                    raise ValueError(f"{name} has shape {shape} in the checkpoint, {tuple(t.shape)} "
                                     f"in the model")
                t.copy_(source.read(name, None, 0, 0))
        return getattr(source, "elements_read", 0)


def save_pretrained(model: nn.Module, path: str | os.PathLike) -> None:
    """A consolidated Hugging Face checkpoint of a TSP model (config, generation config and
    ``model.safetensors``), loadable with ``from_pretrained``. Every rank must call it (it
    gathers); global rank 0 writes, so synchronise before other ranks read it."""
    from safetensors.torch import save_file

    state = full_state_dict(model, rank0_only=True)
    if not state:
        return
    os.makedirs(path, exist_ok=True)
    model.config.save_pretrained(path)
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.save_pretrained(path)
    if getattr(model.config, "tie_word_embeddings", False):
        state.pop(f"{model._tsp_policy.lm_head}.weight", None)  # tied: loaded from the embedding
    save_file({k: v.contiguous() for k, v in state.items()},
              os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
