"""Sharded training checkpoints that load at any TSP degree (torch.distributed.checkpoint).

A TSP parameter's DTensor describes this rank's *local* layout: vocabulary rows (and key/value
rows, when there are fewer KV heads than ranks) padded to a multiple of D. Saved as they are, such
DTensors would only load back at the same degree. Here every parameter and every optimizer tensor
of its shape is written under its Hugging Face name with its Hugging Face shape, as the chunks this
rank really owns (padding dropped). DCP then
reads whatever slices the loading model needs, at another degree or into a plain Hugging Face
model. Format and guarantees: docs/checkpointing.md.

Under FSDP2 (:mod:`tsp_core.distributed.fsdp`) a rank stores a data-parallel slice of its TSP shard.
A tensor without padding is then written as it is stored (its DTensor already has the Hugging Face
shape), so a save never holds more than the rank's own state; a padded one (vocabulary rows,
key/value rows when there are fewer heads than ranks: small) is gathered over data parallel first.

A save is written to ``<path>.partial`` and renamed to ``<path>`` only after every rank's data, the
DCP metadata and the ``tsp_checkpoint.json`` marker exist, so a process killed mid-save never
leaves a directory that looks complete; loading refuses a directory without the marker.
"""

from __future__ import annotations

import io
import json
import os
import pickle
import shutil
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import (
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor, Replicate, Shard

from ..distributed import comm
from ..distributed.model_state import find_model_state
from ..distributed.params import (
    ShardSpec,
    TensorSource,
    Unfused,
    assemble_full,
    chunk_spec,
    from_tsp_part,
    local,
    own_name,
    read_local,
    tsp_part,
)
from .checkpoint import base_class_name, dtype_kind, sharded_modules

MARKER = "tsp_checkpoint.json"
EXTRA = "extra.pt"
FORMAT = "tsp_core.dcp"
VERSION = 1
ADAPTER_KEY = ".lora_"  # in the name of every LoRA adapter tensor (PEFT's lora_A / lora_B)


# ----------------------------------------------------------- layouts: local <-> checkpoint

class _Layout:
    """How one sharded parameter's local tensor maps onto its Hugging Face-shaped tensor."""

    def __init__(self, module, name: str, param: DTensor) -> None:
        mesh = module.mesh
        d = mesh.size
        specs = [module.shard_spec(name, r) for r in range(d)]
        self.dim = specs[0].dim
        self.full_shape = tuple(module.full_shapes[name])
        self.spec = specs[mesh.rank]
        full_len = self.full_shape[self.dim]
        if any((s.start, s.length) != (c.start, c.length) for s, c in
               zip(specs, (chunk_spec(full_len, r, d, self.dim) for r in range(d)))):
            # a new layout must be described here before it can be checkpointed
            raise NotImplementedError(f"{type(module).__name__}.{name}: shard layout "
                                      f"{[(s.start, s.length) for s in specs]} is not one DCP can "
                                      f"describe (DTensor's chunks of dim {self.dim}, in rank "
                                      f"order)")
        self.tsp_mesh, self.mesh = mesh, mesh.device_mesh
        self.placements = [Shard(self.dim) if n == mesh.dim else Replicate()
                           for n in self.mesh.mesh_dim_names]
        # no rank pads: the parameter's DTensor is the checkpoint tensor, however it is stored
        self.padded = tuple(param.shape) != self.full_shape

    def export(self, t: torch.Tensor) -> DTensor:
        """Checkpoint view of a TSP-local tensor in this parameter's layout (shares its
        storage)."""
        own = t.narrow(self.dim, 0, self.spec.length)
        return DTensor.from_local(own, self.mesh, self.placements, run_check=False,
                                  shape=torch.Size(self.full_shape),
                                  stride=torch.empty(self.full_shape, device="meta").stride())


class _Fused:
    """A fused Hugging Face tensor (Phi-3's ``qkv_proj.weight``, ``gate_up_proj.weight``) whose
    parts a TSP module keeps as separate parameters, each sharded its own way (a rank owns its
    heads' rows of q, of k and of v). In a checkpoint it is one tensor under its Hugging Face name
    and shape, each rank writing DTensor's chunk of its rows (the layout every DCP loader, a
    plain model included, reads): built from the parts gathered whole, and split back after a
    load the same way, one fused tensor at a time (transiently whole on every rank)."""

    def __init__(self, module, prefix: str, fused: str, parts: list[tuple[str, int]]) -> None:
        mesh = module.mesh
        self.module, self.name = module, fused
        self.fqn = prefix + fused
        self.parts = [n for n, _ in parts]
        self.part_fqns = [prefix + n for n in self.parts]
        self.along = module.fused_dim(fused)  # the parts' concatenation dim (rows, or channels)
        full_shape = list(module.full_shapes[self.parts[0]])
        full_shape[self.along] = sum(r for _, r in parts)
        self.full_shape = tuple(full_shape)
        rows = self.full_shape[0]
        self.specs = [chunk_spec(rows, r, mesh.size) for r in range(mesh.size)]
        self.spec = self.specs[mesh.rank]
        self.mesh = mesh.device_mesh
        self.placements = [Shard(0) if n == mesh.dim else Replicate()
                           for n in self.mesh.mesh_dim_names]

    def _dtensor(self, own: torch.Tensor) -> DTensor:
        return DTensor.from_local(own, self.mesh, self.placements, run_check=False,
                                  shape=torch.Size(self.full_shape),
                                  stride=torch.empty(self.full_shape, device="meta").stride())

    def export(self, parts: list[torch.Tensor]) -> DTensor:
        """The checkpoint tensor from the parts (parameters or optimizer state)."""
        full = self.module.join_fused(
            self.name, [self.module.gather_full(n, t) for n, t in zip(self.parts, parts)])
        return self._dtensor(full.narrow(0, self.spec.start, self.spec.length).clone())

    def target(self, like: torch.Tensor) -> tuple[DTensor, Callable[[], list[torch.Tensor]]]:
        """(load target, function returning the parts' local tensors from what was loaded)."""
        buf = like.new_zeros((self.spec.length, *self.full_shape[1:]))

        def back() -> list[torch.Tensor]:
            own = ShardSpec(0, 0, self.spec.length, self.spec.local_len)  # padded for the gather
            padded = read_local(TensorSource({"": buf}), "", own)
            gathered = padded.new_empty((len(self.specs), *padded.shape))
            comm.all_gather(gathered, padded.contiguous(), self.module.mesh.group)
            full = assemble_full(torch.cat(gathered.unbind(0)), self.specs, self.full_shape[0])
            source = Unfused(TensorSource({self.name: full}), self.module)
            rank = self.module.mesh.rank
            return [read_local(source, n, self.module.shard_spec(n, rank)) for n in self.parts]
        return self._dtensor(buf), back


def _fusions(model: nn.Module) -> list[_Fused]:
    """Every fused Hugging Face tensor of the TSP modules in ``model`` (none for most families)."""
    return [_Fused(m, prefix, fused, parts) for prefix, m in sharded_modules(model)
            for fused, parts in m.fused_names().items()]


def _fuse_entries(fusions: list[_Fused], entries: dict[str, Any], make) -> dict[str, Any]:
    """``entries`` (by parameter name) with each fused tensor's parts replaced by one entry
    ``make(fusion, [the parts' values])`` under the fused name."""
    out = dict(entries)
    for f in fusions:
        if all(n in out for n in f.part_fqns):
            out[f.fqn] = make(f, [out.pop(n) for n in f.part_fqns])
    return out


def _fuse_param_groups(fusions: list[_Fused], groups: list[dict],
                       split: bool = False) -> list[dict]:
    """Optimizer param groups naming the fused tensors instead of their parts (``split``: the
    other way round)."""
    to_fused = {n: f.fqn for f in fusions for n in f.part_fqns}
    to_parts = {f.fqn: f.part_fqns for f in fusions}
    out = []
    for g in groups:
        names: list[str] = []
        for n in g["params"]:
            for m in (to_parts.get(n, [n]) if split else [to_fused.get(n, n)]):
                if m not in names:
                    names.append(m)
        out.append({**g, "params": names})
    return out


def _fused_state(f: _Fused, states: list[dict]) -> dict:
    """One optimizer state for a fused tensor from its parts' states: tensors of the parameter's
    layout fused, scalars (``step``) taken once (they must agree)."""
    out = {}
    for k, v in states[0].items():
        if isinstance(v, DTensor) and v.dim() > 0:
            out[k] = f.export([s[k] for s in states])
        else:
            if any(not _equal(s[k], v) for s in states[1:]):
                raise ValueError(f"optimizer state {k!r} differs between the parts {f.part_fqns} "
                                 f"of {f.fqn}; it cannot be saved as one tensor's state")
            out[k] = v
    return out


def _parts_back(f: _Fused, back: Callable[[], list[torch.Tensor]],
                likes: list[torch.Tensor]) -> dict[str, Callable[[], torch.Tensor]]:
    """Part name -> function returning that part's loaded tensor, laid out like ``likes``' (a
    DTensor like the parameter); ``back`` runs once, on the first call (it gathers)."""
    done: list[list[torch.Tensor]] = []

    def part(i: int) -> torch.Tensor:
        if not done:
            done.append(back())
        return from_tsp_part(done[0][i], likes[i], f.module.mesh)
    return {n: (lambda i=i: part(i)) for i, n in enumerate(f.part_fqns)}


def _equal(a: Any, b: Any) -> bool:
    return torch.equal(a, b) if torch.is_tensor(a) and torch.is_tensor(b) else a == b


def is_peft_model(model: nn.Module) -> bool:
    """Whether ``model`` is a PEFT ``PeftModel`` (told by its class, without importing peft)."""
    return any(c.__name__ == "PeftModel" and c.__module__.startswith("peft")
               for c in type(model).__mro__)


def saved_model_state(model: nn.Module, sd: dict[str, Any]) -> dict[str, Any]:
    """What a checkpoint holds of ``model``'s state dict ``sd``: of a PeftModel its LoRA
    adapters alone (every ``lora_A`` / ``lora_B`` tensor), as PEFT's ``save_pretrained`` and the
    Trainer's checkpoints keep a PeftModel: its base is frozen and comes from its pretrained
    weights on resume (docs/lora.md "Checkpoints"); of any other model, everything."""
    if not is_peft_model(model):
        return sd
    return {k: v for k, v in sd.items() if ADAPTER_KEY in k}


def _tsp_mesh(model: nn.Module):
    """The TSP mesh of the first TSP module inside ``model`` (a TSP model, or a container such as a
    LightningModule holding one); None for a plain model."""
    sharded = sharded_modules(model)
    return sharded[0][1].mesh if sharded else None


def _layouts(model: nn.Module) -> dict[str, _Layout]:
    """Sharded parameters by state-dict name (tied names included)."""
    out = {}
    for prefix, m in sharded_modules(model):
        for name, p in m.named_parameters():
            own = own_name(name)  # a LoRA adapter's base_layer: the wrapped projection's
            if own not in m.full_shapes:
                continue  # an adapter's own parameter: its module lists it
            spec = m.shard_spec(own, m.mesh.rank)
            if spec.dim is not None:
                out[prefix + name] = _Layout(m, own, p)
    return out


def _export(layouts: dict[str, _Layout], fqn: str, t: torch.Tensor):
    layout = layouts.get(fqn)
    if layout is not None and layout.padded and isinstance(t, DTensor):
        return layout.export(tsp_part(t, layout.tsp_mesh))
    return t


def _fresh(layouts: dict[str, _Layout], fqn: str, t: torch.Tensor):
    """(checkpoint-shaped load target, function returning the loaded tensor in ``t``'s layout)."""
    layout = layouts.get(fqn)
    if not isinstance(t, DTensor) or layout is None or not layout.padded:
        buf = torch.zeros_like(t)  # a DTensor laid out like t: DCP reads t's own chunk
        return buf, lambda: buf
    part = torch.zeros_like(tsp_part(t, layout.tsp_mesh))
    return layout.export(part), lambda: from_tsp_part(part, t, layout.tsp_mesh)


def _map_optimizer(osd: dict, fn: Callable[[str, torch.Tensor], Any]) -> dict:
    """``osd`` with every tensor of ``state[fqn]`` replaced by ``fn(fqn, tensor)``; tensors with
    the parameter's shape are laid out like it, scalars (``step``) pass through ``fn`` as well."""
    state = {fqn: {k: fn(fqn, v) if torch.is_tensor(v) else v for k, v in s.items()}
             for fqn, s in osd["state"].items()}
    return {"state": state, "param_groups": osd["param_groups"]}


def _aliases(model: nn.Module) -> dict[str, str]:
    """Parameter name -> the name a checkpoint keeps its optimizer state under, where the two
    differ: a pipeline's last-stage copy of a tied embedding is kept under the embedding's name,
    once, as one process's optimizer names the one tied weight (the model's tensors keep their
    own names)."""
    state = find_model_state(model)
    return {} if state is None else dict(state.optimizer_names)


def _rename_groups(groups: list[dict], names: dict[str, str]) -> list[dict]:
    return [{**g, "params": [names.get(n, n) for n in g["params"]]} for g in groups]


def _renamed(osd: dict, names: dict[str, str]) -> dict:
    """``osd`` with its parameter names (state keys and param groups) mapped through ``names``."""
    if not names:
        return osd
    return {"state": {names.get(k, k): v for k, v in osd["state"].items()},
            "param_groups": _rename_groups(osd["param_groups"], names)}


def _optimizer_fn(layouts: dict[str, _Layout], model_sd: dict[str, torch.Tensor], make):
    def fn(fqn: str, v: torch.Tensor):
        p = model_sd.get(fqn)
        same_layout = p is not None and isinstance(v, DTensor) and v.shape == p.shape
        return make(layouts if same_layout else {}, fqn, v)
    return fn


# ------------------------------------------------------------------------ save and load

def _rank0() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


Optimizers = torch.optim.Optimizer | Iterable[torch.optim.Optimizer] | None


def _optimizers(optimizer: Optimizers):
    """One optimizer, or a list of them (torch.distributed.checkpoint.state_dict keys their state
    by parameter name, so several optimizers over one model share one ``optimizer`` entry)."""
    if optimizer is None or isinstance(optimizer, torch.optim.Optimizer):
        return optimizer
    optimizers = list(optimizer)
    return optimizers or None


def save_checkpoint(path: str | os.PathLike, model: nn.Module, optimizer: Optimizers = None, *,
                    model_state: bool = True, extra_weights_only: bool = True, **extra: Any) -> str:
    """Write model (and optimizer) state to the directory ``path`` with
    torch.distributed.checkpoint, every tensor under its Hugging Face name and shape, so it loads at
    any TSP degree or into a plain model. ``extra`` (a step, scheduler state, RNG state...: anything
    ``torch.save`` takes, taken from global rank 0) comes back from :func:`load_checkpoint`. Every
    rank must call it. The directory appears atomically, complete; an existing one is replaced only
    then. Needs a filesystem every rank sees.

    ``model`` may also be a module holding a TSP model (a LightningModule): names are then
    ``model.state_dict()``'s. ``optimizer``: one optimizer or a list. Adapter hooks:
    ``model_state=False`` writes only the optimizer (the weights are saved elsewhere, e.g. the
    Trainer's ``model.safetensors``); ``extra_weights_only=False`` accepts any picklable ``extra``
    (a framework's own metadata), which then loads only with ``weights_only=False``."""
    optimizer = _optimizers(optimizer)
    if not model_state and optimizer is None:
        raise ValueError("save_checkpoint with model_state=False needs an optimizer to save")
    path = os.path.abspath(os.fspath(path))
    tmp = path + ".partial"
    buf = io.BytesIO()
    try:  # fails here, on every rank alike, before anything is written
        torch.save(extra, buf)
        if extra_weights_only:
            torch.load(io.BytesIO(buf.getvalue()), weights_only=True)
    except Exception as e:
        kinds = ("tensors, numbers, strings, lists, tuples or dicts of those (torch.load "
                 "weights_only)") if extra_weights_only else "picklable"
        raise ValueError(f"save_checkpoint extra values {sorted(extra)} must be {kinds}; "
                         f"{type(e).__name__}: {e}") from e
    mesh = _tsp_mesh(model)
    model_sd = model.state_dict()
    layouts = _layouts(model)
    fusions = _fusions(model)  # fused Hugging Face tensors (Phi-3): saved under their own names
    state: dict[str, Any] = {}
    if model_state:
        sd = _fuse_entries(fusions, saved_model_state(model, model_sd),
                           lambda f, vs: f.export(vs))
        state["model"] = {k: _export(layouts, k, v) for k, v in sd.items()}
    if optimizer is not None:
        osd = get_optimizer_state_dict(model, optimizer)
        if fusions:
            osd = {"state": _fuse_entries(fusions, osd["state"], _fused_state),
                   "param_groups": _fuse_param_groups(fusions, osd["param_groups"])}
        state["optimizer"] = _renamed(_map_optimizer(osd, _optimizer_fn(layouts, model_sd,
                                                                        _export)), _aliases(model))
    if _rank0() and os.path.exists(tmp):
        shutil.rmtree(tmp)  # a save that died earlier
    _barrier()
    dcp.save(state, checkpoint_id=tmp)
    if _rank0():
        with open(os.path.join(tmp, EXTRA), "wb") as f:
            f.write(buf.getvalue())
        marker = {"format": FORMAT, "version": VERSION, "model_class": base_class_name(model),
                  "tsp_size": mesh.size if mesh else None,
                  "dp_size": mesh.dp_size if mesh else None,
                  "world_size": dist.get_world_size() if dist.is_initialized() else 1,
                  "model": model_state, "optimizer": optimizer is not None,
                  "adapters_only": model_state and is_peft_model(model),
                  "extra": sorted(extra), "extra_weights_only": extra_weights_only,
                  "step": extra["step"] if isinstance(extra.get("step"), int) else None}
        with open(os.path.join(tmp, MARKER), "w") as f:
            json.dump(marker, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        old = path + ".old"
        if os.path.exists(path):
            if os.path.exists(old):
                shutil.rmtree(old)
            os.rename(path, old)
        os.rename(tmp, path)
        if os.path.exists(old):
            shutil.rmtree(old)
    _barrier()
    return path


def read_marker(path: str | os.PathLike) -> dict:
    """The ``tsp_checkpoint.json`` of a complete checkpoint; raises if the directory is not one."""
    path = os.fspath(path)
    marker = os.path.join(path, MARKER)
    if not os.path.isfile(marker):
        partial = path.endswith(".partial") or not os.path.isdir(path)
        unfinished = partial or os.path.exists(os.path.join(path, ".metadata"))
        why = "does not exist" if not os.path.exists(path) else (
            "is a save that did not finish" if unfinished else "is not a tsp_core checkpoint")
        raise FileNotFoundError(f"{path} {why} (no {MARKER}); load a complete checkpoint, e.g. "
                                f"tsp_core.latest_checkpoint(<checkpoint dir>)")
    with open(marker) as f:
        return json.load(f)


def latest_checkpoint(directory: str | os.PathLike) -> str | None:
    """The complete checkpoint in ``directory`` with the highest ``step`` (then the newest);
    directories of saves that did not finish are ignored. None when there is none."""
    directory = os.fspath(directory)
    if not os.path.isdir(directory):
        return None
    found = []
    for name in os.listdir(directory):
        p = os.path.join(directory, name)
        if name.endswith((".partial", ".old")) or not os.path.isfile(os.path.join(p, MARKER)):
            continue
        step = read_marker(p).get("step")
        found.append((step if step is not None else -1, os.path.getmtime(p), p))
    return max(found)[2] if found else None


def _check_against(path: str, target: dict[str, Any], marker: dict, model: nn.Module,
                   model_state: bool = True) -> None:
    """Every tensor the load needs exists in the checkpoint with the same shape and kind of
    dtype (checked from the metadata on every rank alike, before anything is read or
    changed)."""
    md = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    saved = {k: v for k, v in md.items() if isinstance(v, TensorStorageMetadata)}
    problems, missing = [], []
    for key, t in target.items():
        if key not in saved:
            missing.append(key)
        elif tuple(saved[key].size) != tuple(t.shape):
            problems.append(f"{key} has shape {tuple(saved[key].size)} in the checkpoint, "
                            f"{tuple(t.shape)} here")
        elif dtype_kind(saved[key].properties.dtype) != dtype_kind(t.dtype):
            problems.append(f"{key} is {saved[key].properties.dtype} in the checkpoint, {t.dtype} "
                            f"here")
    state = find_model_state(model)
    partial = state is not None and state.partial  # a pipeline rank holds some stages only
    base_too = is_peft_model(model)  # a PeftModel loads its adapters from a checkpoint with a base
    unexpected = sorted(k[len("model."):] for k in saved if model_state and k.startswith("model.")
                        and k not in target and not partial
                        and not (base_too and ADAPTER_KEY not in k))
    if problems or missing or unexpected:
        parts = problems[:3] + ([f"{len(problems) - 3} more shape differences"] if len(problems) > 3
                                else [])
        if missing:
            parts.append(f"{len(missing)} tensors missing from the checkpoint (e.g. {missing[:3]})")
        if unexpected:
            parts.append(f"{len(unexpected)} parameters not in this model (e.g. {unexpected[:3]})")
        raise ValueError(f"{path} holds a {marker.get('model_class')} that does not match this "
                         f"{base_class_name(model)}: " + "; ".join(parts) + ". Load it into the "
                         "model it was saved from (same config); nothing was changed")


def _read_extra(path: str, weights_only: bool) -> dict[str, Any]:
    try:
        return torch.load(os.path.join(path, EXTRA), weights_only=weights_only)
    except pickle.UnpicklingError as e:
        raise ValueError(f"{path}: its extra values were saved with extra_weights_only=False and "
                         f"do not load with weights_only=True; pass weights_only=False if you "
                         f"trust the file. Nothing was changed. ({e})") from e


def load_checkpoint(path: str | os.PathLike, model: nn.Module, optimizer: Optimizers = None, *,
                    model_state: bool = True, weights_only: bool = True) -> dict[str, Any]:
    """Load a :func:`save_checkpoint` directory into ``model`` (a TSP model at any degree, or a
    plain model) and ``optimizer``; returns the ``extra`` values. Every rank must call it. Names,
    shapes and kinds of dtype are checked on every rank before anything is read, so a checkpoint
    of another model raises everywhere and leaves model and optimizer untouched (an optimizer
    without state yet is left without); the model's tensors change only once the optimizer's
    state has loaded. ``model_state=False`` loads
    only the optimizer (``model`` still names its parameters); ``weights_only`` is how the extra
    values are read (``torch.load``)."""
    return _load_checkpoint(path, model, optimizer, model_state, weights_only, check_only=False)


def check_checkpoint(path: str | os.PathLike, model: nn.Module, optimizer: Optimizers = None, *,
                     model_state: bool = True, weights_only: bool = True) -> None:
    """Raise, changing nothing, unless :func:`load_checkpoint` of the same arguments passes its
    checks (marker, format, extra values, every tensor's name, shape and kind of dtype). For
    adapters that load several models and must check all before changing any."""
    _load_checkpoint(path, model, optimizer, model_state, weights_only, check_only=True)


def _load_checkpoint(path: str | os.PathLike, model: nn.Module, optimizer: Optimizers,
                     model_state: bool, weights_only: bool, check_only: bool) -> dict[str, Any]:
    optimizer = _optimizers(optimizer)
    optimizers = [optimizer] if isinstance(optimizer, torch.optim.Optimizer) else optimizer or []
    fresh = [o for o in optimizers if not o.state]
    try:
        out = _load(path, model, optimizer, model_state, weights_only, check_only)
    except Exception:
        check_only = True
        raise
    finally:
        if check_only:  # torch.distributed.checkpoint's state dicts created their state
            for o in fresh:
                o.state.clear()
    return out


def _load(path: str | os.PathLike, model: nn.Module, optimizer: Optimizers, model_state: bool,
          weights_only: bool, check_only: bool) -> dict[str, Any]:
    path = os.path.abspath(os.fspath(path))
    marker = read_marker(path)
    if marker.get("format") != FORMAT:
        raise ValueError(f"{path}: format {marker.get('format')!r}, expected {FORMAT!r}")
    if optimizer is not None and not marker.get("optimizer"):
        raise ValueError(f"{path} was saved without optimizer state; pass optimizer=None (and "
                         f"start the optimizer fresh) or load a checkpoint saved with one")
    if model_state and not marker.get("model", True):
        raise ValueError(f"{path} holds optimizer state only (saved with model_state=False); load "
                         f"the weights from where they were saved and pass model_state=False")
    extra = _read_extra(path, weights_only)
    layouts = _layouts(model)
    model_sd = model.state_dict()
    state: dict[str, Any] = {}
    finish: dict[str, Callable[[], torch.Tensor]] = {}
    fusions = _fusions(model)  # fused Hugging Face tensors (Phi-3): loaded by their own names
    if marker.get("adapters_only") and model_state and not is_peft_model(model):
        raise ValueError(f"{path} holds the LoRA adapters of a PeftModel, not its base: load it "
                         f"into the PeftModel (the base from its pretrained weights, then "
                         f"get_peft_model, as when it was saved), not a "
                         f"{base_class_name(model)}; nothing was changed")
    wanted = saved_model_state(model, model_sd)
    if model_state:
        state["model"] = {}
        for k, v in wanted.items():
            state["model"][k], finish[k] = _fresh(layouts, k, v)
        for f in fusions:
            if not all(n in wanted for n in f.part_fqns):
                continue
            for n in f.part_fqns:
                del state["model"][n]
            state["model"][f.fqn], back = f.target(local(model_sd[f.part_fqns[0]]))
            finish.update(_parts_back(f, back, [model_sd[n] for n in f.part_fqns]))
    flat = {f"model.{k}": v for k, v in state.get("model", {}).items()}
    opt_finish: dict[tuple[str, str], Callable[[], torch.Tensor]] = {}
    if optimizer is not None:
        osd = get_optimizer_state_dict(model, optimizer)
        make = _optimizer_fn(layouts, model_sd, _fresh)
        aliases = _aliases(model)
        own_names = {saved: own for own, saved in aliases.items()}
        state["optimizer"] = {"param_groups": _rename_groups(
                                  _fuse_param_groups(fusions, osd["param_groups"]), aliases),
                              "state": {}}
        for f in fusions:
            if not all(n in osd["state"] for n in f.part_fqns):
                continue
            parts = [osd["state"].pop(n) for n in f.part_fqns]
            fused = state["optimizer"]["state"][f.fqn] = {}
            for k, v in parts[0].items():
                if isinstance(v, DTensor) and v.dim() > 0:
                    fused[k], back = f.target(local(v))
                    for n, fn in _parts_back(f, back, [s[k] for s in parts]).items():
                        opt_finish[(n, k)] = fn
                elif torch.is_tensor(v):  # step: one value, a copy for each part
                    fused[k] = buf = torch.zeros_like(v)
                    for n in f.part_fqns:
                        opt_finish[(n, k)] = buf.clone
                else:
                    fused[k] = v
                    for n in f.part_fqns:
                        opt_finish[(n, k)] = lambda v=v: v
                if torch.is_tensor(v):
                    flat[f"optimizer.state.{f.fqn}.{k}"] = fused[k]
        for fqn, s in osd["state"].items():
            saved = aliases.get(fqn, fqn)
            state["optimizer"]["state"][saved] = {}
            for k, v in s.items():
                if torch.is_tensor(v):
                    target, opt_finish[(fqn, k)] = make(fqn, v)
                    state["optimizer"]["state"][saved][k] = target
                    flat[f"optimizer.state.{saved}.{k}"] = target
                else:
                    state["optimizer"]["state"][saved][k] = v
    _check_against(path, flat, marker, model, model_state)
    if check_only:
        return extra
    dcp.load(state, checkpoint_id=path)
    # the model's tensors change last: the optimizer's load (which checks its param groups) may
    # still refuse, and then nothing has changed
    loaded_model = {k: finish[k]() for k in wanted} if model_state else {}
    if optimizer is not None:
        loaded = {own_names.get(n, n): s for fqn, s in state["optimizer"]["state"].items()
                  for n in next((f.part_fqns for f in fusions if f.fqn == fqn), [fqn])}
        groups = _rename_groups(state["optimizer"]["param_groups"], own_names)
        osd = {"param_groups": _fuse_param_groups(fusions, groups, split=True),
               "state": {fqn: {k: opt_finish[(fqn, k)]() if (fqn, k) in opt_finish else v
                               for k, v in s.items()}
                         for fqn, s in loaded.items()}}
        set_optimizer_state_dict(model, optimizer, osd)
    with torch.no_grad():
        for k, loaded in loaded_model.items():
            local(model_sd[k]).copy_(local(loaded))
    return extra


# ------------------------------------------- one-file (consolidated) optimizer state, for adapters

def _owners(model: nn.Module) -> dict[int, tuple[nn.Module, str]]:
    """id(parameter) -> (its TSP module, its name there), for every sharded or replicated TSP
    parameter."""
    return {id(p): (m, name) for _, m in sharded_modules(model) for name, p in m.own_parameters()}


def _refuse_fused(model: nn.Module, what: str) -> None:
    fused = sorted({f.name for f in _fusions(model)})
    if fused:
        raise NotImplementedError(
            f"{what} keys optimizer state by parameter index, and this model keeps each fused "
            f"Hugging Face tensor ({', '.join(fused)}) as several parameters, so its indices are "
            f"not the unmodified model's; save and load the optimizer with "
            f"tsp_core.save_checkpoint / load_checkpoint, which name them by the fused tensors")


def _opt_params(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The parameters in ``optimizer.state_dict()``'s index order."""
    return [p for g in optimizer.param_groups for p in g["params"]]


def full_optimizer_state_dict(model: nn.Module, optimizer: torch.optim.Optimizer, *,
                              rank0_only: bool = False) -> dict[str, Any]:
    """``optimizer.state_dict()`` (keyed by parameter index, as a plain optimizer writes it) with
    every per-parameter tensor gathered to the Hugging Face shape of its parameter, so the same
    optimizer built over the unmodified model loads it. The counterpart of
    :func:`tsp_core.full_state_dict` for a one-file checkpoint; every rank must call it (it
    gathers); with ``rank0_only`` the other ranks get an empty dict. Not for models with fused
    Hugging Face tensors (Phi-3): use :func:`save_checkpoint`."""
    _refuse_fused(model, "full_optimizer_state_dict")
    owners = _owners(model)
    sd = optimizer.state_dict()
    keep = not rank0_only or not dist.is_initialized() or dist.get_rank() == 0
    state: dict[int, dict[str, Any]] = {}
    for i, p in enumerate(_opt_params(optimizer)):  # the same order on every rank
        if i not in sd["state"]:
            continue
        owner = owners.get(id(p))
        state[i] = {}
        for k, v in sd["state"][i].items():
            if isinstance(v, DTensor) and owner is not None and v.shape == p.shape:
                m, name = owner
                specs = [m.shard_spec(name, r) for r in range(m.mesh.size)]
                part = tsp_part(v, m.mesh).detach()
                if specs[0].dim is None:
                    v = part.clone()
                else:
                    gathered = part.new_empty((m.mesh.size, *part.shape))
                    comm.all_gather(gathered, part.contiguous(), m.mesh.group)
                    v = assemble_full(torch.cat(gathered.unbind(0), dim=specs[0].dim), specs,
                                      m.full_shapes[name][specs[0].dim])
            elif isinstance(v, DTensor):
                raise NotImplementedError(f"optimizer state {k!r} of parameter {i} is a DTensor of "
                                          f"shape {tuple(v.shape)}, not its parameter's "
                                          f"{tuple(p.shape)}: no layout to gather it with")
            if keep:  # other ranks only take part in the gathers: one tensor at a time
                state[i][k] = v
    if not keep:
        return {}
    return {"state": state, "param_groups": sd["param_groups"]}


def check_full_optimizer_state_dict(model: nn.Module, optimizer: torch.optim.Optimizer,
                                    state_dict: dict[str, Any]) -> None:
    """Raise, changing nothing, unless :func:`load_full_optimizer_state_dict` of the same
    arguments would succeed: the param groups' sizes are the optimizer's, and every tensor of
    a parameter's shape has the parameter's full shape and kind of dtype. Every rank sees the
    same state dict, so every rank raises alike, before any collective."""
    _refuse_fused(model, "load_full_optimizer_state_dict")
    groups, mine = state_dict["param_groups"], optimizer.param_groups
    sizes, my_sizes = [len(g["params"]) for g in groups], [len(g["params"]) for g in mine]
    if sizes != my_sizes:
        raise ValueError(f"the optimizer state has param groups of {sizes} parameters, this "
                         f"optimizer {my_sizes}: the checkpoint is of another model or optimizer; "
                         f"nothing was changed")
    owners = _owners(model)
    params = _opt_params(optimizer)
    for i, s in state_dict["state"].items():
        if not 0 <= int(i) < len(params):
            raise ValueError(f"optimizer state for parameter {i}, but the optimizer has "
                             f"{len(params)} parameters: the checkpoint is of another model; "
                             f"nothing was changed")
        p = params[int(i)]
        owner = owners.get(id(p))
        name = owner[1] if owner is not None else f"parameter {i}"
        full = tuple(owner[0].full_shapes[owner[1]]) if owner is not None else tuple(p.shape)
        for k, v in s.items():
            if not torch.is_tensor(v) or v.dim() == 0:
                continue
            if tuple(v.shape) != full:
                raise ValueError(f"optimizer state {k!r} of {name} (parameter {i}) has shape "
                                 f"{tuple(v.shape)} in the checkpoint, {full} in the model: "
                                 f"the checkpoint is of another model; nothing was changed")
            if dtype_kind(v.dtype) != dtype_kind(p.dtype):
                raise ValueError(f"optimizer state {k!r} of {name} (parameter {i}) is {v.dtype} "
                                 f"in the checkpoint, the parameter {p.dtype}; nothing was changed")


def load_full_optimizer_state_dict(model: nn.Module, optimizer: torch.optim.Optimizer,
                                   state_dict: dict[str, Any]) -> None:
    """Load a :func:`full_optimizer_state_dict` (or a plain optimizer's ``state_dict()`` of the
    unmodified model) into the optimizer of a TSP model at any degree: each rank keeps its slices.
    Everything is checked first (:func:`check_full_optimizer_state_dict`). Not for models with
    fused Hugging Face tensors (Phi-3): use :func:`load_checkpoint`."""
    check_full_optimizer_state_dict(model, optimizer, state_dict)
    owners = _owners(model)
    params = _opt_params(optimizer)
    state: dict[int, dict[str, Any]] = {}
    for i, s in state_dict["state"].items():
        p = params[int(i)]
        owner = owners.get(id(p))
        state[i] = {}
        for k, v in s.items():
            if owner is not None and torch.is_tensor(v) and v.dim() > 0:
                m, name = owner
                part = read_local(TensorSource({name: v}), name, m.shard_spec(name, m.mesh.rank))
                v = from_tsp_part(part.to(local(p).device, p.dtype), p, m.mesh)
            state[i][k] = v
    optimizer.load_state_dict({"state": state, "param_groups": state_dict["param_groups"]})
