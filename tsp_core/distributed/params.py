"""TSP parameters as DTensors on the mesh: ``Shard`` on the TSP dim for owned slices,
``Replicate`` everywhere else (DCP, grad clipping and save_pretrained need
DTensors). The schedules compute on ``to_local()`` views.

Every TSP module describes each of its parameters, per rank, by a :class:`ShardSpec` against the
full Hugging Face-shaped tensor. Creating, loading and gathering parameters is written once, in
:class:`ShardedModule`, from those specs.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard

from . import comm
from .mesh import TSPMesh


@dataclass(frozen=True)
class ShardSpec:
    """A rank's local tensor is ``full.narrow(dim, start, length)``, zero-padded to ``local_len``
    along ``dim`` (vocabulary padding). ``dim=None`` means replicated: the whole tensor."""

    dim: int | None
    start: int = 0
    length: int = 0
    local_len: int = 0


REPLICATED = ShardSpec(None)


def even_spec(full_len: int, rank: int, size: int, dim: int) -> ShardSpec:
    """Rank ``rank``'s equal slice of ``full_len`` along ``dim``."""
    if full_len % size:
        raise ValueError(f"tsp_size ({size}) must divide dim {dim} of size {full_len}")
    n = full_len // size
    return ShardSpec(dim, rank * n, n, n)


def chunk_spec(full_len: int, rank: int, size: int, dim: int = 0) -> ShardSpec:
    """Rank ``rank``'s chunk of ``full_len`` under DTensor's uneven ``Shard`` rule (ceil(n/D) per
    rank, the last ones shorter or empty), zero-padded to one local length: vocabulary rows, and
    key/value rows when there are fewer key/value heads than ranks. Every element is stored once."""
    per = -(-full_len // size)
    start = min(rank * per, full_len)
    return ShardSpec(dim, start, max(0, min(per, full_len - start)), per)


class FullSource(Protocol):
    """Where full tensors come from: a dict in memory or a safetensors checkpoint on disk."""

    def shape(self, name: str) -> tuple[int, ...] | None: ...

    def read(self, name: str, dim: int | None, start: int, length: int) -> torch.Tensor: ...


class TensorSource:
    """Full tensors held in memory."""

    def __init__(self, tensors: Mapping[str, torch.Tensor]) -> None:
        self.tensors = tensors

    def shape(self, name: str) -> tuple[int, ...] | None:
        t = self.tensors.get(name)
        return None if t is None else tuple(t.shape)

    def read(self, name: str, dim: int | None, start: int, length: int) -> torch.Tensor:
        t = self.tensors[name]
        return t if dim is None else t.narrow(dim, start, length)


def read_local(source: FullSource, name: str, spec: ShardSpec) -> torch.Tensor:
    """This rank's local tensor for ``name`` according to ``spec`` (a fresh tensor)."""
    part = source.read(name, spec.dim, spec.start, spec.length).clone()
    if spec.dim is not None and spec.length < spec.local_len:
        pad = list(part.shape)
        pad[spec.dim] = spec.local_len - spec.length
        part = torch.cat([part, part.new_zeros(pad)], dim=spec.dim)
    return part


def assemble_full(virtual: torch.Tensor, specs: list[ShardSpec], full_len: int) -> torch.Tensor:
    """The full tensor from the rank-order concatenation of every rank's local tensor (what
    ``DTensor.full_tensor()`` returns). Copies held by several ranks are taken once; padding
    is dropped."""
    dim = specs[0].dim
    if dim is None:
        return virtual
    shape = list(virtual.shape)
    shape[dim] = full_len
    full = virtual.new_empty(shape)
    for r, s in enumerate(specs):
        full.narrow(dim, s.start, s.length).copy_(virtual.narrow(dim, r * s.local_len, s.length))
    return full


def _placements(mesh: TSPMesh, shard_dim: int | None):
    names = mesh.device_mesh.mesh_dim_names
    return [Shard(shard_dim) if (n == mesh.dim and shard_dim is not None) else Replicate()
            for n in names]


def sharded_parameter(local: torch.Tensor, mesh: TSPMesh, dim: int) -> nn.Parameter:
    """A parameter whose local tensor is this rank's slice along ``dim``."""
    shape = list(local.shape)
    shape[dim] *= mesh.size
    dt = DTensor.from_local(local.detach(), mesh.device_mesh, _placements(mesh, dim),
                            run_check=False, shape=torch.Size(shape),
                            stride=torch.empty(shape, device="meta").stride())
    return nn.Parameter(dt)


def replicated_parameter(full: torch.Tensor, mesh: TSPMesh) -> nn.Parameter:
    """A parameter every rank holds whole (norm weights, biases of row-parallel outputs)."""
    dt = DTensor.from_local(full.detach(), mesh.device_mesh, _placements(mesh, None),
                            run_check=False)
    return nn.Parameter(dt)


def own_name(name: str) -> str:
    """A parameter's name in its TSP module's ``full_shapes``: without the ``base_layer.`` that
    a LoRA adapter (:class:`tsp_core.layers.lora.TSPLoRA`) puts in front of the projection's own
    weight when it takes the projection's place, as PEFT names it."""
    return name.replace("base_layer.", "")


def local(param: torch.Tensor) -> torch.Tensor:
    """The local tensor of a sharded parameter (differentiable)."""
    return param.to_local() if isinstance(param, DTensor) else param


def _over_tsp_only(t: DTensor, mesh: TSPMesh) -> list:
    """``t``'s placements with every data-parallel dim replicated (FSDP2 shards there)."""
    names = t.device_mesh.mesh_dim_names
    return [p if n == mesh.dim else Replicate() for n, p in zip(names, t.placements)]


def tsp_part(t: torch.Tensor, mesh: TSPMesh) -> torch.Tensor:
    """This rank's TSP-local tensor of a parameter, gradient or optimizer state (its ShardSpec's
    layout). Under FSDP2 (:mod:`tsp_core.distributed.fsdp`) a stored tensor holds only a
    data-parallel slice of that: the slices are all-gathered over the data-parallel dims (a new
    tensor; write back with :func:`set_tsp_part`). Otherwise the local tensor itself."""
    if not isinstance(t, DTensor):
        return t
    want = _over_tsp_only(t, mesh)
    if list(t.placements) != want:
        t = t.redistribute(t.device_mesh, want)
    return t.to_local()


def from_tsp_part(value: torch.Tensor, like: torch.Tensor, mesh: TSPMesh) -> torch.Tensor:
    """A tensor laid out like ``like`` (a parameter or optimizer state) from ``value``, laid out
    like :func:`tsp_part` of it: under FSDP2 this rank's data-parallel slice of ``value``."""
    if not isinstance(like, DTensor):
        return value
    want = _over_tsp_only(like, mesh)
    whole = DTensor.from_local(value, like.device_mesh, want, run_check=False, shape=like.shape,
                               stride=like.stride())
    if list(like.placements) == want:
        return whole
    return whole.redistribute(like.device_mesh, like.placements)


def set_tsp_part(t: torch.Tensor, value: torch.Tensor, mesh: TSPMesh) -> None:
    """Copy ``value``, laid out like :func:`tsp_part` of ``t``, into ``t``: under FSDP2 only this
    rank's data-parallel slice of it is kept."""
    with torch.no_grad():
        local(t).copy_(local(from_tsp_part(value, t, mesh)))


def local_replicated(param: torch.Tensor, mesh: TSPMesh) -> torch.Tensor:
    """The local copy of a replicated parameter, whose gradient is summed over the TSP group
    (each rank saw different tokens)."""
    return comm.sum_grad(local(param), mesh.group)


def init_full(shapes: Mapping[str, tuple[int, ...]], seed: int | None, dtype: torch.dtype | None,
              device: torch.device | str | None, ones: tuple[str, ...] = ()
              ) -> dict[str, torch.Tensor]:
    """Full tensors for a fresh module: weights N(0, 0.02) drawn from ``seed`` (the same on every
    rank, so a model is the same at every degree), biases zero, names in ``ones`` one;
    ``seed=None`` leaves them uninitialised (fake-tensor simulation)."""
    gen = None if seed is None else torch.Generator().manual_seed(seed)
    out = {}
    for name, shape in shapes.items():
        if seed is None:
            t = torch.empty(shape)
        elif name in ones:
            t = torch.ones(shape)
        elif name.endswith("bias"):
            t = torch.zeros(shape)
        else:
            t = torch.randn(shape, generator=gen) * 0.02
        out[name] = t.to(dtype=dtype or torch.get_default_dtype(), device=device)
    return out


class WeightHolder(nn.Module):
    """What holds a TSP module's nested parameters (``q_proj`` of ``q_proj.weight``): a container
    without a forward (the schedules read its tensors). PEFT asked to adapt a converted model
    fails on it with "Target module {module} is not supported", printing ``str()``: that says
    what to do instead; ``repr()``, which ``print(model)`` shows, stays short."""

    def __str__(self) -> str:
        return ("a TSP weight shard (a model already converted by tsp_core.parallelize, whose "
                "projections are no nn.Linear): load or create the adapters on the Hugging Face "
                "model first (PeftModel.from_pretrained(model, dir) or get_peft_model), then "
                "parallelize the PeftModel (docs/lora.md)")


class ShardedModule(nn.Module):
    """Base of the TSP modules. A subclass sets ``self.mesh`` and ``self.full_shapes`` (parameter
    name -> full Hugging Face shape, nested names such as ``q_proj.weight``), implements
    :meth:`shard_spec`, and calls :meth:`_create`."""

    mesh: TSPMesh
    full_shapes: dict[str, tuple[int, ...]]
    # set by tsp_core.inference.decode while it runs the model's own forward for one generation
    # step: the embedding, attention and MLP then take their tensor-parallel decode path
    # (docs/design.md "Decode")
    tsp_decode: Any = None

    def shard_spec(self, name: str, rank: int) -> ShardSpec:
        raise NotImplementedError

    def own_parameters(self) -> list[tuple[str, nn.Parameter]]:
        """(name in ``full_shapes``, parameter) of this module's own parameters: an adapter
        nested in it (:class:`tsp_core.layers.lora.TSPLoRA`) holds and gathers its own, and
        puts ``base_layer.`` in the name of the projection it wraps (:func:`own_name`)."""
        return [(own_name(n), p) for n, p in self.named_parameters()
                if own_name(n) in self.full_shapes]

    def _create(self, full: Mapping[str, torch.Tensor]) -> None:
        source = TensorSource(full)
        for name in self.full_shapes:
            spec = self.shard_spec(name, self.mesh.rank)
            part = read_local(source, name, spec)
            param = (replicated_parameter(part, self.mesh) if spec.dim is None
                     else sharded_parameter(part, self.mesh, spec.dim))
            owner = self
            *path, attr = name.split(".")
            for p in path:
                if not hasattr(owner, p):
                    owner.add_module(p, WeightHolder())
                owner = getattr(owner, p)
            owner.register_parameter(attr, param)

    def load_full(self, full: Mapping[str, torch.Tensor] | FullSource) -> None:
        """Keep this rank's slices of full Hugging Face-shaped tensors (names relative to this
        module, e.g. ``q_proj.weight``)."""
        source = TensorSource(full) if isinstance(full, Mapping) else full
        for name, expected in self.hf_shapes().items():
            got = source.shape(name)
            if got is None:
                raise ValueError(f"{type(self).__name__}: {name} (shape {tuple(expected)}) is "
                                 f"missing from the state dict or checkpoint "
                                 f"({self.extra_repr()})")
            if got != tuple(expected):
                raise ValueError(f"{type(self).__name__}: {name} has shape {got}, expected "
                                 f"{tuple(expected)} ({self.extra_repr()})")
        source = Unfused(source, self) if self.fused_names() else source
        for name, param in self.own_parameters():
            set_tsp_part(param, read_local(source, name, self.shard_spec(name, self.mesh.rank)),
                         self.mesh)

    def full_tensors(self, grads: bool = False) -> dict[str, torch.Tensor]:
        """Full Hugging Face-shaped parameters (or their gradients), gathered over the group;
        every rank of the group must call it."""
        out = {}
        for name, p in self.own_parameters():
            t = p.grad if grads else p
            if t is not None:
                out[name] = self.gather_full(name, t)
        for fused, parts in self.fused_names().items():  # Hugging Face's fused tensors
            if all(n in out for n, _ in parts):
                out[fused] = self.join_fused(fused, [out.pop(n) for n, _ in parts])
        return out

    def gather_full(self, name: str, t: torch.Tensor) -> torch.Tensor:
        """The full tensor of parameter ``name`` from every rank's local ``t`` laid out like it
        (the parameter, its gradient, an optimizer state); every rank of the group must call it."""
        specs = [self.shard_spec(name, r) for r in range(self.mesh.size)]
        part = tsp_part(t, self.mesh).detach()
        if specs[0].dim is None:
            return part.clone()
        gathered = part.new_empty((self.mesh.size, *part.shape))
        comm.all_gather(gathered, part.contiguous(), self.mesh.group)
        virtual = torch.cat(gathered.unbind(0), dim=specs[0].dim)
        return assemble_full(virtual, specs, self.full_shapes[name][specs[0].dim])

    # ---------------------------------------------- fused Hugging Face tensors (Phi-3)

    def fuse(self, groups: Mapping[str, Sequence[str]]) -> None:
        """Name parameters the way a model that fuses them does, e.g. Phi-3's
        ``{"qkv_proj": ("q_proj", "k_proj", "v_proj")}``: the Hugging Face tensor
        ``qkv_proj.weight`` (and ``.bias``) is the parts' rows concatenated in this order. The
        module keeps the parts as its parameters (each sharded as usual: a rank owns whole heads
        of q, k and v, matching gate and up channels) and computes with them; every full tensor
        in or out of it (:meth:`full_tensors`, :meth:`load_full`, hence ``full_state_dict``,
        ``load_full_state_dict``, ``save_pretrained``, ``save_checkpoint``) has the fused name
        and shape."""
        for fused, parts in groups.items():
            for part in parts:
                if f"{part}.weight" not in self.full_shapes:
                    raise ValueError(f"{type(self).__name__} has no {part}.weight to fuse into "
                                     f"{fused}; its parameters: {sorted(self.full_shapes)}")
                if self.shard_spec(f"{part}.weight", 0).dim != 0:
                    raise ValueError(f"{type(self).__name__}.{part} is not sharded by rows; only "
                                     f"row-sharded projections can form {fused}")
            has_bias = {f"{p}.bias" in self.full_shapes for p in parts}
            if len(has_bias) > 1:
                raise ValueError(f"{fused}: some of {tuple(parts)} have a bias and some not")
        self.fused = {f: tuple(parts) for f, parts in groups.items()}

    def fuse_tensors(self, fused: str, parts: Sequence[str], dim: int, groups: int = 1) -> None:
        """Name parameters ``parts`` (full names, e.g. ``experts.gate_proj``) as one Hugging Face
        tensor ``fused``, their concatenation along ``dim`` (along which each part must be
        sharded): a mixture-of-experts ring keeps every expert's gate and up channels as two
        parameters, Hugging Face stores them as ``experts.gate_up_proj`` [E, 2F, h]. With
        ``groups`` > 1 the fused tensor is ``groups`` blocks along ``dim``, block g the parts'
        g-th slices (1/groups of each) concatenated: Qwen3-Next's ``in_proj_qkvz`` holds per key
        head [q | k | v | z] (:meth:`join_fused`)."""
        for part in parts:
            if part not in self.full_shapes:
                raise ValueError(f"{type(self).__name__} has no {part} to fuse into {fused}; "
                                 f"its parameters: {sorted(self.full_shapes)}")
            if self.shard_spec(part, 0).dim != dim:
                raise ValueError(f"{type(self).__name__}.{part} is not sharded along dim {dim}, "
                                 f"the dim it is fused along into {fused}")
            if self.full_shapes[part][dim] % groups:
                raise ValueError(f"{fused}: {part}'s {self.full_shapes[part][dim]} rows do not "
                                 f"split into {groups} groups")
        self.fused_tensors = {**self.fused_tensors, fused: (tuple(parts), dim)}
        self.fused_groups = {**self.fused_groups, fused: groups}

    fused: dict[str, tuple[str, ...]] = {}
    fused_tensors: dict[str, tuple[tuple[str, ...], int]] = {}
    fused_groups: dict[str, int] = {}  # fuse_tensors' groups, where more than one

    def fused_names(self) -> dict[str, list[tuple[str, int]]]:
        """Fused Hugging Face name -> [(part parameter name, its size along the fused dim)], in
        order (:meth:`fused_dim`: rows for fused projections)."""
        out = {}
        for fused, parts in self.fused.items():
            for suffix in ("weight", "bias"):
                names = [f"{p}.{suffix}" for p in parts]
                if names[0] in self.full_shapes:
                    out[f"{fused}.{suffix}"] = [(n, self.full_shapes[n][0]) for n in names]
        for fused, (parts, dim) in self.fused_tensors.items():
            out[fused] = [(n, self.full_shapes[n][dim]) for n in parts]
        return out

    def fused_dim(self, fused: str) -> int:
        """The dim along which the parts of fused tensor ``fused`` are concatenated."""
        return self.fused_tensors[fused][1] if fused in self.fused_tensors else 0

    def join_fused(self, fused: str, parts: Sequence[torch.Tensor]) -> torch.Tensor:
        """The Hugging Face tensor ``fused`` from its parts' full tensors, in order: their
        concatenation along :meth:`fused_dim`, or, with ``groups`` (:meth:`fuse_tensors`), per
        group the parts' slices of that group concatenated, the groups one after another."""
        dim, groups = self.fused_dim(fused), self.fused_groups.get(fused, 1)
        if groups == 1:
            return torch.cat(list(parts), dim=dim)
        split = [p.unflatten(dim, (groups, p.shape[dim] // groups)) for p in parts]
        return torch.cat(split, dim=dim + 1).flatten(dim, dim + 1)

    def hf_name(self, name: str) -> str:
        """The Hugging Face name of parameter ``name``: the fused tensor it is in, or itself."""
        for fused, parts in self.fused_names().items():
            if any(n == name for n, _ in parts):
                return fused
        return name

    def hf_shapes(self) -> dict[str, tuple[int, ...]]:
        """Full Hugging Face shapes by Hugging Face name (fused tensors as one)."""
        out = {}
        for name, shape in self.full_shapes.items():
            hf = self.hf_name(name)
            if hf == name:
                out[name] = tuple(shape)
            elif hf not in out:
                full = list(shape)
                full[self.fused_dim(hf)] = sum(r for _, r in self.fused_names()[hf])
                out[hf] = tuple(full)
        return out


class Unfused:
    """A :class:`FullSource` serving a module's part names (``q_proj.weight``) from the fused
    Hugging Face tensors (``qkv_proj.weight``) of ``source``: a row slice of a part is read as
    the same rows of the fused tensor, never the whole."""

    def __init__(self, source: FullSource, module: ShardedModule) -> None:
        self.source = source
        self.where: dict[str, tuple[str, int, int, int]] = {}
        self.groups: dict[str, tuple[int, int]] = {}  # grouped parts: (groups, group's rows)
        for fused, parts in module.fused_names().items():
            offset, along = 0, module.fused_dim(fused)
            groups = module.fused_groups.get(fused, 1)
            block = sum(rows for _, rows in parts) // groups
            for name, rows in parts:
                self.where[name] = (fused, along, offset // groups, rows)
                offset += rows
                if groups > 1:
                    self.groups[name] = (groups, block)

    def shape(self, name: str) -> tuple[int, ...] | None:
        if name not in self.where:
            return self.source.shape(name)
        fused, along, _, rows = self.where[name]
        shape = self.source.shape(fused)
        if shape is None:
            return None
        shape = list(shape)
        shape[along] = rows
        return tuple(shape)

    def read(self, name: str, dim: int | None, start: int, length: int) -> torch.Tensor:
        if name not in self.where:
            return self.source.read(name, dim, start, length)
        fused, along, offset, rows = self.where[name]
        if name in self.groups:
            return self._read_grouped(name, dim, start, length)
        if dim == along:
            return self.source.read(fused, along, offset + start, length)
        whole = self.source.read(fused, along, offset, rows)
        return whole if dim is None else whole.narrow(dim, start, length)

    def _read_grouped(self, name: str, dim: int | None, start: int, length: int
                      ) -> torch.Tensor:
        """A slice of a part of a grouped fused tensor: the fused tensor's whole groups that hold
        it (only those: a rank owning whole key heads reads its own groups), the part's rows of
        each."""
        fused, along, offset, rows = self.where[name]
        groups, block = self.groups[name]
        per = rows // groups  # the part's rows in one group
        first, last = (start // per, (start + length - 1) // per + 1) if dim == along else \
            (0, groups)
        held = self.source.read(fused, along, first * block, (last - first) * block)
        held = held.unflatten(along, (last - first, block)).narrow(along + 1, offset, per)
        held = held.flatten(along, along + 1)
        if dim == along:
            return held.narrow(along, start - first * per, length)
        return held if dim is None else held.narrow(dim, start, length)


def schedule_weight(module: nn.Module, name: str) -> Any:
    """Parameter ``name`` of ``module`` as a schedule takes it: its local tensor, or what its
    holder's ``schedule_shard`` gives (an NF4 shard, tsp_core/layers/nf4.py), also behind a
    LoRA adapter in the projection's place (its ``base_layer``)."""
    path, _, attr = name.rpartition(".")
    holder = module.get_submodule(path) if path else module
    holder = getattr(holder, "base_layer", holder)
    shard = getattr(holder, "schedule_shard", None)
    return local(module.get_parameter(name)) if shard is None else shard(attr)


def schedule_inputs(module: nn.Module, names: list[str], x: torch.Tensor):
    """The input and ``module``'s local weight shards, ready for a TSP schedule, and the context
    to run it in. Under autocast (bf16-mixed) both are cast once to the autocast dtype and the
    schedule runs with autocast off, so its forward and backward compute in one dtype (the casts
    are in the autograd graph: fp32 master weights get fp32 gradients). Every shard must then
    share the input's dtype (a round packs them into one buffer). A quantized projection's
    holder (:class:`tsp_core.layers.nf4.NF4Weight`) gives its packed shard instead of a tensor."""
    weights = [schedule_weight(module, n) for n in names]
    context = contextlib.nullcontext()
    device = x.device.type
    if torch.is_autocast_enabled(device):
        dtype = torch.get_autocast_dtype(device)
        x, weights = x.to(dtype), [w.to(dtype) for w in weights]
        context = torch.autocast(device, enabled=False)
    for n, w in zip(names, weights):
        if w.dtype != x.dtype:
            raise ValueError(f"{type(module).__name__}: input dtype ({x.dtype}) differs from "
                             f"{n} ({w.dtype}); every weight shard and the input must share one "
                             f"dtype: cast with .to({x.dtype})")
    return x, weights, context
