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
import re
from collections.abc import Mapping
from contextlib import ExitStack

import torch
from torch import nn

from ..distributed.model_state import find_model_state, model_state
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

    def names(self) -> list[str]:
        return list(self._files)

    def kind(self, name: str) -> str:
        """The kind of dtype (:func:`dtype_kind`) of tensor ``name``, from the file's header."""
        code = self._handle(self._files[name]).get_slice(name).get_dtype()
        return {"B": "bool", "C": "complex", "F": "floating"}.get(code[0], "integer")

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
        self.mlp, self.hub = policy.modules.mlp, policy.ffn.moe.hub_module or policy.modules.mlp
        self.gate, self.up, self.down = policy.ffn.moe.hub_parts

    def _split(self, name: str) -> tuple[str, str] | None:
        """(the block's prefix in the checkpoint, kind) of an in-memory MoE name, else None."""
        for kind in self.KINDS:
            suffix = f"{self.mlp}.{kind}"
            if name.endswith(suffix) and self.source.shape(name) is None:
                return name[: -len(suffix)] + self.hub + ".", kind
        return None

    def _expert(self, base: str, e: int, part: str) -> str:
        return f"{base}experts.{e}.{part}.weight"

    def parts(self, name: str, full: tuple[int, ...]) -> dict[str, tuple[int, ...]] | None:
        """The checkpoint tensors (name -> the shape each must have) that in-memory tensor
        ``name`` of full shape ``full`` is read from, when it is read from the Hub's layout;
        None when the checkpoint has ``name`` as it is (or it is no expert tensor)."""
        where = self._split(name)
        if where is None:
            return None
        base, kind = where
        if kind == "gate.weight":
            return {base + kind: full}
        if "down" in kind:  # [E, h, F]: one [h, F] per expert
            return {self._expert(base, e, self.down): full[1:] for e in range(self.experts)}
        one = (full[1] // 2, *full[2:])  # [E, 2F, h]: gate [F, h] and up [F, h] per expert
        return {self._expert(base, e, p): one for e in range(self.experts)
                for p in (self.gate, self.up)}

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
    policy = _policy(model)
    if policy is None or policy.ffn.moe is None or policy.ffn.moe.hub_parts is None:
        return state
    experts, mlp = policy.ffn.moe, policy.modules.mlp
    gate, up, down = experts.hub_parts
    out = {}
    for name, t in state.items():
        kind = next((k for k in _HubExperts.KINDS if name.endswith(f"{mlp}.{k}")), None)
        if kind is None:
            out[name] = t
            continue
        base = name[: -len(f"{mlp}.{kind}")] + (experts.hub_module or mlp) + "."
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


def _policy(model: nn.Module):
    """The policy a converted model (or a pipeline) was described by; None for any other."""
    state = find_model_state(model)
    return None if state is None else state.policy


def sharded_modules(model: nn.Module):
    """(prefix, module) for every TSP module, the tied LM head included, in a fixed order."""
    return [(f"{n}." if n else "", m) for n, m in model.named_modules(remove_duplicate=False)
            if isinstance(m, ShardedModule)]


def full_state_dict(model: nn.Module, *, rank0_only: bool = False) -> dict[str, torch.Tensor]:
    """Hugging Face names and full shapes. Every rank must call it (it gathers); with
    ``rank0_only`` the other ranks get an empty dict. A pipeline (``tsp_core.pipeline``) completes
    this rank's stages with the other pipeline ranks' through its state's ``gather_stages``."""
    sharded = sharded_modules(model)
    owners = {prefix + name for prefix, m in sharded for name, _ in m.named_parameters()}
    out: dict[str, torch.Tensor] = {}
    for prefix, m in sharded:
        for name, t in m.full_tensors().items():
            out[prefix + name] = t
    for name, t in model.state_dict().items():
        if name not in owners:
            out[name] = t.detach()
    state = find_model_state(model)
    if state is not None and state.gather_stages is not None:  # a pipeline: the whole model
        return state.gather_stages(out, rank0_only)
    mesh = None if state is None else state.mesh
    if rank0_only and mesh is not None and mesh.device_mesh.get_rank() != 0:
        return {}
    return out


def dtype_kind(dtype: torch.dtype) -> str:
    """"floating", "complex", "bool" or "integer": a load casts within a kind (a bfloat16
    checkpoint into a float32 model, as ``from_pretrained`` does) and refuses across kinds."""
    if dtype.is_floating_point:
        return "floating"
    if dtype.is_complex:
        return "complex"
    return "bool" if dtype == torch.bool else "integer"


def _open(state_dict_or_path: Mapping[str, torch.Tensor] | str | os.PathLike,
          stack: ExitStack) -> TensorSource | SafetensorsSource:
    if isinstance(state_dict_or_path, Mapping):
        return TensorSource(state_dict_or_path)
    return SafetensorsSource(state_dict_or_path, stack)


def _hub_experts(model: nn.Module, source: FullSource) -> _HubExperts | None:
    """A mixture-of-experts model reads the Hub's per-expert layout too."""
    policy = _policy(model)
    if policy is None or policy.ffn.moe is None or policy.ffn.moe.hub_parts is None:
        return None
    return _HubExperts(source, policy, getattr(model.config, policy.ffn.moe.num_experts))


def _ignored_extra(model: nn.Module, name: str) -> bool:
    """Whether Hugging Face's ``from_pretrained`` ignores ``name`` when the model has no such
    tensor: the class's ``_keys_to_ignore_on_load_unexpected`` patterns, and the rotary
    ``inv_freq`` and ``position_ids`` buffers older checkpoints saved (when the model has such
    buffers now). Any other tensor the model lacks is refused: nothing is dropped silently."""
    patterns = set(getattr(model, "_keys_to_ignore_on_load_unexpected", None) or ())
    buffers = [n for n, _ in model.named_buffers()]
    if any(b.endswith("rotary_emb.inv_freq") for b in buffers):
        patterns.add(r"rotary_emb\.inv_freq")
    if any(b.endswith("position_ids") for b in buffers):
        patterns.add(r"(^|\.)position_ids$")
    return any(re.search(p, name) for p in patterns)


def _check_source(model: nn.Module, source: TensorSource | SafetensorsSource, what: str) -> None:
    """Every tensor a load of ``source`` into ``model`` reads exists with the shape and the kind
    of dtype the model's tensor has, and ``source`` holds nothing else. Raises, naming the
    tensors and both shapes, before anything is read or changed; every rank sees the same
    source, so every rank raises alike, before any collective."""
    if isinstance(source, TensorSource):
        names = list(source.tensors)

        def kind(n: str) -> str:
            return dtype_kind(source.tensors[n].dtype)
    else:
        names, kind = source.names(), source.kind
    hub = _hub_experts(model, source)
    expected: set[str] = set()
    wrong: list[str] = []
    missing: list[str] = []

    def expect(name: str, shape: tuple[int, ...], dtype: torch.dtype, optional: bool) -> None:
        parts = {name: shape}
        if source.shape(name) is None and hub is not None:
            parts = hub.parts(name, shape) or parts
        for n, want in parts.items():
            expected.add(n)
            got = source.shape(n)
            if got is None:
                if not optional:
                    missing.append(f"{n} {want}")
            elif got != tuple(want):
                wrong.append(f"{n} has shape {got} in the {what}, {tuple(want)} in the model")
            elif kind(n) != dtype_kind(dtype):
                wrong.append(f"{n} holds {kind(n)} values in the {what}, the model's {n} is "
                             f"{dtype}")

    owners = set()
    for prefix, m in sharded_modules(model):
        owners |= {prefix + n for n, _ in m.named_parameters()}
        tied = isinstance(m, TSPLMHead) and m.tied  # loaded through the embedding: optional
        for name, shape in m.hf_shapes().items():
            part = next((n for n, _ in m.fused_names().get(name, [])), name)
            expect(prefix + name, shape, m.get_parameter(part).dtype, tied)
    for name, t in model.state_dict(keep_vars=True).items():
        if name not in owners:  # a buffer a checkpoint may leave out keeps its value
            expect(name, tuple(t.shape), t.dtype, not isinstance(t, nn.Parameter))
    unexpected = sorted(n for n in set(names) - expected if not _ignored_extra(model, n))
    if wrong or missing or unexpected:
        found = wrong[:3] + ([f"{len(wrong) - 3} more"] if len(wrong) > 3 else [])
        if missing:
            found.append(f"{len(missing)} tensors missing from the {what} (e.g. {missing[:3]})")
        if unexpected:
            found.append(f"{len(unexpected)} tensors this model does not have (e.g. "
                         f"{unexpected[:3]})")
        raise ValueError(f"the {what} does not match this {base_class_name(model)}: "
                         + "; ".join(found) + ". Nothing was changed; load the state of the model "
                         "it was saved from (same config)")


def check_full_state_dict(model: nn.Module, state_dict_or_path: Mapping[str, torch.Tensor]
                          | str | os.PathLike) -> None:
    """Raise, changing nothing, unless :func:`load_full_state_dict` of the same arguments would
    succeed: every tensor present with the model's shape and kind of dtype, none missing, none
    the model does not have (a tied LM head may be left out). For adapters that load weights
    and optimizer state together and must check both before changing either."""
    with ExitStack() as stack:
        source = _open(state_dict_or_path, stack)
        _check_source(model, source, "state dict" if isinstance(source, TensorSource)
                      else f"checkpoint {os.fspath(state_dict_or_path)}")


def load_full_state_dict(model: nn.Module,
                         state_dict_or_path: Mapping[str, torch.Tensor] | str | os.PathLike) -> int:
    """Keep this rank's slices of a full Hugging Face state dict, or of a ``save_pretrained``
    checkpoint on disk (read slice by slice). A tied LM head is loaded through the embedding.
    Every tensor is checked first (:func:`check_full_state_dict`): a load that does not fit
    raises on every rank and changes nothing. Returns the number of elements read from disk (0
    for a dict)."""
    with ExitStack() as stack:
        raw = _open(state_dict_or_path, stack)
        _check_source(model, raw, "state dict" if isinstance(raw, TensorSource)
                      else f"checkpoint {os.fspath(state_dict_or_path)}")
        source: FullSource = _hub_experts(model, raw) or raw
        owners = set()
        for prefix, m in sharded_modules(model):
            owners |= {prefix + n for n, _ in m.named_parameters()}
            if isinstance(m, TSPLMHead) and m.tied:
                continue  # the embedding's load fills the shared weight
            m.load_full(_Prefixed(source, prefix))
        with torch.no_grad():
            for name, t in model.state_dict(keep_vars=True).items():
                if name not in owners and source.shape(name) is not None:
                    t.copy_(source.read(name, None, 0, 0))
        return getattr(raw, "elements_read", 0)


def base_class_name(model: nn.Module) -> str:
    """The name of the Hugging Face class a TSP model was made from (its state's ``base_class``:
    ``parallelize`` and :func:`tsp_core.pipeline` record it), or the model's own class name."""
    state = find_model_state(model)
    return (type(model) if state is None else state.base_class).__name__


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
        # tied: loaded from the embedding
        state.pop(f"{model_state(model).policy.modules.lm_head}.weight", None)
    state = _hub_layout(model, state)
    save_file({k: v.contiguous() for k, v in state.items()},
              os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
