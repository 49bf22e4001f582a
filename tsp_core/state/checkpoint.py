"""Full (Hugging Face-format) state dicts in and out of a TSP model.

``full_state_dict`` gathers every parameter to its Hugging Face name and full shape (KV-head
copies taken once, vocabulary padding dropped; parts a TSP module keeps of a fused Hugging Face
tensor, Phi-3's q/k/v of ``qkv_proj``, as that one tensor). ``load_full_state_dict`` lets each rank
read only its own slices: from a dict, or from the safetensors files ``save_pretrained`` writes,
which are read slice by slice, never whole.
"""

from __future__ import annotations

import json
import os
from contextlib import ExitStack
from typing import Mapping

import torch
from torch import nn

from ..distributed.params import FullSource, ShardedModule, TensorSource
from ..layers.vocab import TSPLMHead


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


class _HubExperts:
    """A :class:`FullSource` that serves a mixture-of-experts model's in-memory names
    (``<mlp>.experts.gate_up_proj`` [E, 2F, h], ``<mlp>.experts.down_proj`` [E, h, F],
    ``<mlp>.gate.weight``) from a checkpoint in the Hub's layout, one tensor per expert and
    projection (``<hub>.experts.<e>.<gate|up|down>.weight``; transformers converts the same way
    in ``from_pretrained``). Only the experts, and the rows or columns, a rank owns are read.
    Names the checkpoint has as they are pass through."""

    KINDS = ("experts.gate_up_proj", "experts.down_proj", "gate.weight")

    def __init__(self, source: FullSource, policy, num_experts: int) -> None:
        self.source, self.experts = source, num_experts
        self.mlp, self.hub = policy.mlp, policy.moe.hub_module or policy.mlp
        self.gate, self.up, self.down = policy.moe.hub_parts

    def _split(self, name: str) -> tuple[str, str] | None:
        """(the block's prefix in the checkpoint, kind) of an in-memory MoE name, else None."""
        for kind in self.KINDS:
            suffix = f"{self.mlp}.{kind}"
            if name.endswith(suffix) and self.source.shape(name) is None:
                return name[: -len(suffix)] + self.hub + ".", kind
        return None

    def _expert(self, base: str, e: int, part: str) -> str:
        return f"{base}experts.{e}.{part}.weight"

    def shape(self, name: str) -> tuple[int, ...] | None:
        where = self._split(name)
        if where is None:
            return self.source.shape(name)
        base, kind = where
        if kind == "gate.weight":
            return self.source.shape(base + kind)
        one = self.source.shape(self._expert(base, 0, self.down if "down" in kind else self.gate))
        if one is None:
            return None
        return (self.experts, *one) if "down" in kind else (self.experts, 2 * one[0], one[1])

    def read(self, name: str, dim: int | None, start: int, length: int) -> torch.Tensor:
        where = self._split(name)
        if where is None:
            return self.source.read(name, dim, start, length)
        base, kind = where
        if kind == "gate.weight":
            return self.source.read(base + kind, dim, start, length)
        experts = range(start, start + length) if dim == 0 else range(self.experts)
        inner = None if dim in (None, 0) else dim - 1  # the dim inside one expert's tensor
        if "down" in kind:
            return torch.stack([self.source.read(self._expert(base, e, self.down), inner, start,
                                                 length) for e in experts])
        rows = self.source.shape(self._expert(base, 0, self.gate))[0]
        return torch.stack([self._gate_up(base, e, inner, start, length, rows) for e in experts])

    def _gate_up(self, base: str, e: int, inner: int | None, start: int, length: int,
                 rows: int) -> torch.Tensor:
        """Expert e's [gate; up] rows, or the slice ``[start, start + length)`` along ``inner``."""
        gate, up = self._expert(base, e, self.gate), self._expert(base, e, self.up)
        if inner == 0 and start + length <= rows:
            return self.source.read(gate, 0, start, length)
        if inner == 0 and start >= rows:
            return self.source.read(up, 0, start - rows, length)
        whole = torch.cat([self.source.read(gate, inner if inner else None, start, length),
                           self.source.read(up, inner if inner else None, start, length)])
        return whole.narrow(0, start, length) if inner == 0 else whole


def _hub_layout(model: nn.Module, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A mixture-of-experts model's full state dict in the Hub's checkpoint layout (one tensor
    per expert and projection, the block under its checkpoint name), as transformers' own
    ``save_pretrained`` writes it; other models' unchanged."""
    policy = getattr(model, "_tsp_policy", None)
    if policy is None or policy.moe is None:
        return state
    gate, up, down = policy.moe.hub_parts
    out = {}
    for name, t in state.items():
        kind = next((k for k in _HubExperts.KINDS if name.endswith(f"{policy.mlp}.{k}")), None)
        if kind is None:
            out[name] = t
            continue
        base = name[: -len(f"{policy.mlp}.{kind}")] + (policy.moe.hub_module or policy.mlp) + "."
        if kind == "gate.weight":
            out[base + kind] = t
        elif kind == "experts.down_proj":
            out.update({f"{base}experts.{e}.{down}.weight": t[e] for e in range(t.shape[0])})
        else:
            g, u = t.chunk(2, dim=1)
            for e in range(t.shape[0]):
                out[f"{base}experts.{e}.{gate}.weight"] = g[e]
                out[f"{base}experts.{e}.{up}.weight"] = u[e]
    return out


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
        policy = getattr(model, "_tsp_policy", None)
        if policy is not None and policy.moe is not None:  # the Hub's per-expert layout too
            source = _HubExperts(source, policy, getattr(model.config, policy.moe.num_experts))
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


def base_class_name(model: nn.Module) -> str:
    """The name of the Hugging Face class a TSP model was made from (``parallelize`` records it on
    the class it builds), or the model's own class name."""
    return getattr(type(model), "_tsp_base_class", type(model)).__name__


def save_pretrained(model: nn.Module, path: str | os.PathLike) -> None:
    """A consolidated Hugging Face checkpoint of a TSP model (config, generation config and
    ``model.safetensors``), loadable with ``from_pretrained``. Every rank must call it (it
    gathers); global rank 0 writes, so synchronise before other ranks read it. The config gets
    what ``PreTrainedModel.save_pretrained`` fills in first (and, as it does, keeps): ``dtype``,
    the parameters' (``model.dtype``), and ``architectures``, the unmodified model's class, so
    ``config.json`` is the one the unmodified model writes."""
    from safetensors.torch import save_file

    model.config.dtype = str(model.dtype).split(".")[1]
    model.config.architectures = [base_class_name(model).removeprefix("FSDP")]
    state = full_state_dict(model, rank0_only=True)
    if not state:
        return
    os.makedirs(path, exist_ok=True)
    model.config.save_pretrained(path)
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.save_pretrained(path)
    if getattr(model.config, "tie_word_embeddings", False):
        state.pop(f"{model._tsp_policy.lm_head}.weight", None)  # tied: loaded from the embedding
    state = _hub_layout(model, state)
    save_file({k: v.contiguous() for k, v in state.items()},
              os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
