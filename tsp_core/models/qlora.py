"""QLoRA under :func:`tsp_core.parallelize` (docs/lora.md "QLoRA"): a PeftModel whose Hugging
Face model was loaded 4-bit NF4 by bitsandbytes (``BitsAndBytesConfig(load_in_4bit=True,
bnb_4bit_quant_type="nf4")``), so its projections are ``bitsandbytes.nn.Linear4bit``.

:func:`read_quantized` finds them and refuses what cannot be kept exact (pure Python on every
rank, before any collective); :meth:`QuantizedBase.stand_ins` puts, while the model converts, an
``nn.Linear`` of each one's shape in its place whose weight is one expanded zero (no memory), so
the usual stages build the TSP modules; :meth:`QuantizedBase.check` refuses shards that would
cut a quantization block (before any collective); :meth:`QuantizedBase.attach` then puts in
each projection's place in its TSP module an :class:`~tsp_core.layers.nf4.NF4Weight` holding
this rank's slice of bitsandbytes' packed codes and absmax, which the schedules move packed and
dequantize per round (tsp_core/layers/nf4.py)."""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..distributed.mesh import TSPMesh
from ..layers.nf4 import NF4Weight, block_range, shard_of
from .policies import DecoderPolicy
from .replicas import check_replicas_agree

DOCS = 'docs/lora.md "QLoRA"'
TARGETS = {"attention": ("q_proj", "k_proj", "v_proj", "o_proj"),
           "mlp": ("gate_proj", "up_proj", "down_proj")}


def _bnb_class(module: nn.Module) -> str | None:
    """The class name of a bitsandbytes layer (told without importing bitsandbytes)."""
    cls = type(module)
    return cls.__name__ if cls.__module__.startswith("bitsandbytes") else None


def is_linear4bit(module: nn.Module) -> bool:
    """Whether ``module`` is a bitsandbytes ``Linear4bit``."""
    return _bnb_class(module) == "Linear4bit"


@dataclass
class Quantized:
    """One ``Linear4bit``: projection ``name`` of ``parent`` (a decoder layer's attention or
    MLP) at ``path``, in the Hugging Face model (behind a PEFT adapter: its ``base_layer``)."""

    path: str
    parent: nn.Module
    name: str
    layer: nn.Module

    @property
    def state(self):
        return self.layer.weight.quant_state


def refuse_state(q: Quantized) -> None:
    """Raise unless ``q`` holds plain NF4 codes as bitsandbytes stores them for training."""
    s = q.state
    if s is None:
        raise NotImplementedError(f"{q.path}: a Linear4bit without a quantization state (not "
                                  f"quantized yet: load it with from_pretrained and a "
                                  f"BitsAndBytesConfig) ({DOCS})")
    if s.nested and (s.state2.blocksize != 256 or s.state2.dtype != torch.float32):
        raise NotImplementedError(
            f"{q.path}: double quantization with nested blocks of {s.state2.blocksize} "
            f"({s.state2.dtype}); bitsandbytes' own are 256 (float32) ({DOCS})")
    if s.quant_type != "nf4":
        raise NotImplementedError(f"{q.path}: 4-bit quant type {s.quant_type!r}; TSP keeps "
                                  f"NF4 (bnb_4bit_quant_type=\"nf4\") ({DOCS})")
    if getattr(s, "packing_format_for_cpu", False):
        raise NotImplementedError(f"{q.path}: its codes were repacked for bitsandbytes' CPU "
                                  f"inference kernel (the model ran in eval mode without "
                                  f"gradients); reload it ({DOCS})")
    if len(s.shape) != 2:
        raise NotImplementedError(f"{q.path}: a quantized weight of shape {tuple(s.shape)}, "
                                  f"not [out, in] ({DOCS})")


def read_quantized(model: nn.Module, policy: DecoderPolicy) -> QuantizedBase | None:
    """The ``Linear4bit`` projections of the Hugging Face ``model`` (None if it has none),
    each checked: NF4 (double quantization in bitsandbytes' nested blocks of 256 included), a
    projection of a decoder layer's attention
    or MLP; an 8-bit layer is refused."""
    names = policy.modules
    prefix = f"{names.base_model}.{names.layers}."
    found = []
    for path, module in model.named_modules():
        kind = _bnb_class(module)
        if kind is None or kind in ("Params4bit",):
            continue
        if kind != "Linear4bit":
            raise NotImplementedError(f"{path} is a bitsandbytes {kind} (8-bit: load_in_8bit?):"
                                      f" TSP takes a 4-bit NF4 base (BitsAndBytesConfig("
                                      f"load_in_4bit=True, bnb_4bit_quant_type=\"nf4\")) "
                                      f"({DOCS})")
        place = path.removesuffix(".base_layer")
        parent_path, _, name = place.rpartition(".")
        layer, _, role_name = parent_path.removeprefix(prefix).partition(".")
        role = {names.attention: "attention", names.mlp: "mlp"}.get(role_name)
        if (not parent_path.startswith(prefix) or not layer.isdigit() or role is None
                or name not in TARGETS[role]):
            raise NotImplementedError(f"{path} is quantized: TSP takes 4-bit weights in the "
                                      f"decoder layers' attention and MLP projections only "
                                      f"({DOCS})")
        q = Quantized(place, model.get_submodule(parent_path), name, module)
        refuse_state(q)
        found.append(q)
    warn_compute_dtype(found)
    return QuantizedBase(found) if found else None


def warn_compute_dtype(found: list[Quantized]) -> None:
    """Warn when ``bnb_4bit_compute_dtype`` differs from the dtype the base was loaded in:
    bitsandbytes then computes each 4-bit projection in the compute dtype, between casts, while
    TSP computes in the model's dtype (a round's shards and input share one dtype), so the two
    differ by that dtype's rounding (bf16 compute on a float32 model: adapter gradients 1.2 u of
    bf16 apart at tsp 2)."""
    pairs = sorted({(str(q.layer.compute_dtype), str(q.state.dtype)) for q in found
                    if q.layer.compute_dtype not in (None, q.state.dtype)})
    for compute, stored in pairs:
        warnings.warn(f"bnb_4bit_compute_dtype={compute} differs from the dtype the base was "
                      f"loaded in ({stored}): bitsandbytes computes each 4-bit projection in "
                      f"{compute}, TSP computes it in {stored}, the model's dtype; load the base "
                      f"with dtype={compute} to compute in {compute} ({DOCS})", stacklevel=3)


def absmax_of(state: Any) -> torch.Tensor:
    """The float32 absmax per block of a quantization state: as stored, or, with double
    quantization (``bnb_4bit_use_double_quant``: the absmax quantized again, 8 bits in blocks of
    256, plus an offset), dequantized by bitsandbytes' own kernel and offset, exactly as its
    ``Linear4bit`` forward and backward compute them before every use. A shard keeps its slice
    of these (a nested block of 256 absmax would span 16,384 weights, more than a shard may
    hold)."""
    if not state.nested:
        return state.absmax
    import bitsandbytes  # noqa: F401  (registers torch.ops.bitsandbytes)

    inner = state.state2
    return (torch.ops.bitsandbytes.dequantize_blockwise.default(
        state.absmax, inner.absmax, inner.code, inner.blocksize, torch.float32) + state.offset)


def stand_in(layer: nn.Module) -> nn.Linear:
    """An ``nn.Linear`` of ``layer``'s shape and float bias whose weight is a zero expanded to
    the shape (no memory): what the conversion reads in the quantized weight's place."""
    s = layer.weight.quant_state
    out_features, in_features = s.shape
    new = nn.Linear(in_features, out_features, bias=False, device="meta")
    new.weight = nn.Parameter(torch.zeros((), dtype=s.dtype, device=layer.weight.device)
                              .expand(out_features, in_features), requires_grad=False)
    new.bias = layer.bias
    return new


def unsupported_host(host: nn.Module | None, mesh: TSPMesh) -> str | None:
    """Why the TSP module ``host`` cannot hold NF4 shards (None: it can): only the per-head-group
    attention without fused projections, sinks, K/V sharing or values from the keys, with at
    least as many key/value heads as ranks, and the unfused gated MLP take them."""
    from ..layers.attention import TSPAttention
    from ..layers.mlp import TSPGatedMLP

    if isinstance(host, TSPGatedMLP):
        return "its projections are fused" if host.fused else None
    if not isinstance(host, TSPAttention):
        return f"it becomes a {type(host).__name__}, whose schedule takes no NF4 shard"
    p = host.parts
    return ("its projections are fused" if host.fused
            else "its q/k norms span every head of a token (the phased schedule)"
            if p.over_token
            else "it has attention sinks" if p.mask.sinks
            else "it shares K/V between layers" if p.kv_sharing is not None
            else "its values come from the keys" if p.values_from_keys
            else (f"fewer key/value heads ({host.spec.num_kv_heads}) than ranks ({mesh.size}): "
                  f"the key/value rows are sliced") if host.spec.kv_replicas > 1
            else None)


@dataclass
class QuantizedBase:
    """The ``Linear4bit`` projections of a model about to be converted."""

    layers: list[Quantized]

    @contextlib.contextmanager
    def stand_ins(self) -> Iterator[None]:
        """Each quantized projection's :func:`stand_in` in its place while the block runs (the
        ``Linear4bit`` back if it raises)."""
        for q in self.layers:
            setattr(q.parent, q.name, stand_in(q.layer))
        try:
            yield
        except BaseException:
            for q in self.layers:
                setattr(q.parent, q.name, q.layer)
            raise

    def check(self, new: dict[int, nn.Module], mesh: TSPMesh) -> None:
        """Refuse, on every rank alike, a TSP module whose schedule does not take NF4 shards, and
        a shard of any rank that would cut a quantization block (the numbers named)."""

        for q in self.layers:
            host = new.get(id(q.parent))
            why = unsupported_host(host, mesh)
            if why is not None:
                raise NotImplementedError(f"{q.path} is quantized, which TSP supports in a "
                                          f"Llama-like attention and gated MLP only, not here: "
                                          f"{why} ({DOCS})")
            s = q.state
            for rank in range(mesh.size):
                block_range(host.shard_spec(f"{q.name}.weight", rank), tuple(s.shape),
                            s.blocksize, f"{q.path} at tsp_size {mesh.size}, rank {rank}")

    def attach(self, new: dict[int, nn.Module], mesh: TSPMesh) -> None:
        """Each projection's :class:`NF4Weight` (this rank's packed slice) in its TSP module, in
        place of the float shard the stand-in gave (its bias kept); the full codes checked to be
        the same on every rank first."""
        absmax = {q.path: absmax_of(q.state) for q in self.layers}
        check_replicas_agree(mesh, [(f"{q.path}.{n}", t.float()) for q in self.layers
                                    for n, t in (("weight", q.layer.weight.data),
                                                 ("absmax", absmax[q.path]))], with_tsp=True)
        for q in self.layers:
            host, s = new[id(q.parent)], q.state
            spec = host.shard_spec(f"{q.name}.weight", mesh.rank)
            packed, own = shard_of(q.layer.weight.data, absmax[q.path], tuple(s.shape),
                                   s.blocksize, spec)
            shape = list(s.shape)
            shape[spec.dim] = spec.length
            holder = NF4Weight(packed, own, tuple(shape), s.blocksize, s.dtype)
            old = getattr(host, q.name)
            for name, p in old.named_parameters(recurse=False):
                if name != "weight":
                    holder.register_parameter(name, p)
            setattr(host, q.name, holder)


def refuse_without_adapters(model: nn.Module) -> None:
    """A 4-bit model that is no PeftModel has nothing to train: refused by name."""
    for path, module in model.named_modules():
        if _bnb_class(module) in ("Linear4bit", "Linear8bitLt"):
            raise NotImplementedError(f"{path} is quantized by bitsandbytes and the model has no "
                                      f"LoRA adapters: TSP takes a quantized base inside a "
                                      f"PeftModel (QLoRA: get_peft_model first) ({DOCS})")
