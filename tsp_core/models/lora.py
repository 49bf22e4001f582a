"""PEFT models under :func:`tsp_core.parallelize` (docs/lora.md): a ``PeftModel`` with LoRA
adapters (one or several named ones) on the attention's q/k/v/o and the gated MLP's
gate/up/down projections, or on the projections Hugging Face fuses (Phi-3's ``qkv_proj``,
``gate_up_proj``).

:func:`read_peft` checks the PEFT configuration and the adapted modules (pure Python, the same on
every rank, so a refusal raises on every rank before any collective) and records the adapters;
:meth:`PeftAdapters.unwrapped` shows the Hugging Face model inside with each PEFT layer replaced
by its base ``nn.Linear``, so the usual stages convert it; :meth:`PeftAdapters.attach` then puts
a :class:`~tsp_core.layers.lora.TSPLoRA` in each adapted projection's place in the new TSP
module (a :class:`~tsp_core.layers.lora.TSPFusedLoRA` in a fused projection's: the adapter is a
part the TSP module finds among its projections, not an option of the schedules) and gives
every parameter the ``requires_grad`` PEFT gave it: the base frozen.

The converted model stays the ``PeftModel``: its adapters are PEFT tuner layers (the class of
:func:`tuner_class`), so ``print_trainable_parameters``, ``disable_adapter()`` and
``set_adapter(name)`` work; its ``save_pretrained`` (:func:`save_pretrained`) writes the full
adapters.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import cache
from types import MethodType
from typing import Any

from torch import nn

from ..distributed.mesh import TSPMesh, get_mesh
from ..layers.lora import INPUT_SIDE, AdapterSpec, FusedParts, TSPFusedLoRA, TSPLoRA
from .policies import DecoderPolicy, find_policy
from .qlora import QuantizedBase, is_linear4bit, read_quantized, refuse_without_adapters
from .replicas import check_replicas_agree

TARGETS = {"attention": ("q_proj", "k_proj", "v_proj", "o_proj"),
           "mlp": ("gate_proj", "up_proj", "down_proj")}
# LoraConfig fields that ask for something TSP's adapters do not do: refused when set
UNSUPPORTED = {"use_dora": "DoRA", "lora_bias": "a LoRA bias (lora_bias=True)",
               "modules_to_save": "modules_to_save (fully trained copies of modules)",
               "target_parameters": "target_parameters (LoRA on parameters: MoE experts, "
                                    "whose adapters need the experts' full weight gradients; "
                                    "adapt the attention with target_modules and leave the "
                                    "experts frozen)",
               "trainable_token_indices": "trainable_token_indices",
               "layer_replication": "layer_replication",
               "alora_invocation_tokens": "activated LoRA (alora_invocation_tokens)",
               "use_qalora": "QALoRA (use_qalora=True)"}
DOCS = "docs/lora.md"


def is_peft_model(model: Any) -> bool:
    """Whether ``model`` is a PEFT ``PeftModel`` (told by its class, without importing peft)."""
    return any(c.__name__ == "PeftModel" and c.__module__.startswith("peft")
               for c in type(model).__mro__)


@dataclass
class Adapted:
    """One PEFT LoRA layer: ``parent.name`` in the Hugging Face model (``parent`` the layer's
    attention or MLP module) and its projection ``name``."""

    path: str
    parent: nn.Module
    name: str
    layer: nn.Module


@dataclass
class PeftAdapters:
    """The LoRA adapters of a ``PeftModel`` about to be converted."""

    peft_model: nn.Module
    model: nn.Module  # the Hugging Face model inside (peft_model.base_model.model)
    adapters: list[str]  # every adapter's name (peft_config's keys)
    adapted: list[Adapted]
    requires_grad: dict[str, bool] = field(default_factory=dict)
    quantized: QuantizedBase | None = None  # a 4-bit NF4 base (QLoRA, .qlora)

    @contextlib.contextmanager
    def unwrapped(self) -> Iterator[nn.Module]:
        """The Hugging Face model with each PEFT layer replaced by its base ``nn.Linear``; the
        PEFT layers are put back if the block raises (a refusal leaves the model as it was)."""
        for a in self.adapted:
            setattr(a.parent, a.name, a.layer.base_layer)
        try:
            with self.quantized.stand_ins() if self.quantized else contextlib.nullcontext():
                yield self.model
        except BaseException:
            for a in self.adapted:
                setattr(a.parent, a.name, a.layer)
            raise

    def check(self, plan: Any) -> dict[int, nn.Module]:
        """The TSP module that replaces each adapted attention or MLP (by the id of the Hugging
        Face module), refusing one whose schedule does not take adapters; before any
        collective (``apply_plan`` checks the replicas after this)."""
        new = {id(getattr(r.parent, r.name)): r.new for r in plan.replacements}
        for a in self.adapted:
            module = new.get(id(a.parent))
            refuse_schedule(a, module)
        if self.quantized is not None:
            self.quantized.check(new, plan.mesh)
        return new

    def attach(self, new: dict[int, nn.Module], mesh: TSPMesh) -> None:
        """Each adapter in its projection's place in the TSP module, its weights PEFT's (checked
        to be the same on every rank: they are replicated), then PEFT's ``requires_grad``."""
        if self.quantized is not None:  # NF4 shards in the float shards' place
            self.quantized.attach(new, mesh)
        tensors = []
        for a in self.adapted:
            host = new[id(a.parent)]
            adapter = tsp_adapter(a, host, mesh)
            full = {f"{kind}.{n}.weight": getattr(a.layer, kind)[n].weight.detach()
                    for n in adapter.r for kind in ("lora_A", "lora_B")}
            adapter.load_full(full)
            adapter.train(a.layer.training)
            setattr(host, a.name, adapter)
            tensors += [(f"{a.path}.{n}", t) for n, t in full.items()]
        check_replicas_agree(mesh, tensors, with_tsp=True)
        self.restore_requires_grad()
        # the PeftModel's class stays PEFT's; its save_pretrained gathers the adapters
        self.peft_model.save_pretrained = MethodType(save_pretrained, self.peft_model)
        # PEFT's set_adapter reaches the layers of its tuner_layer_cls: ours too
        tuner = self.peft_model.base_model
        tuner.tuner_layer_cls = (type(tuner).tuner_layer_cls, tuner_class(), tuner_class(True))
        # PEFT's per-call adapter choices hook its own layers, which TSP's are not
        tuner._enable_peft_forward_hooks = MethodType(refuse_per_call_adapters, tuner)

    def restore_requires_grad(self) -> None:
        """Every parameter's ``requires_grad`` as PEFT set it (the TSP modules' parameters are
        new ones); the names are PEFT's (an adapter keeps ``base_layer.`` in the base's). A
        parameter a TSP module names its own way (Gated DeltaNet's convolution, split by part)
        is part of the base, which :func:`read_peft` found frozen."""
        for name, p in self.peft_model.named_parameters():
            p.requires_grad_(self.requires_grad.get(name, False))


def tsp_adapter(a: Adapted, host: nn.Module, mesh: TSPMesh) -> TSPLoRA:
    """The TSP adapter (of :func:`tuner_class`) of PEFT layer ``a`` in TSP module ``host``: every
    named adapter the layer has, its rank, scale and dropout, the layer's active adapter; a
    :class:`TSPFusedLoRA` over ``host``'s parts where ``a`` is a projection the model fuses."""
    layer = a.layer
    adapters = {n: AdapterSpec(layer.r[n], layer.scaling[n],
                               getattr(layer.lora_dropout[n], "p", 0.0)) for n in layer.lora_A}
    first = layer.lora_A[next(iter(adapters))].weight
    opts = dict(dtype=first.dtype, device=first.device)
    active = copy.copy(layer.active_adapter)
    parts = getattr(host, "fused", {}).get(a.name)
    if parts is not None:
        fused_parts = FusedParts(a.name, {p: getattr(host, p) for p in parts})
        return tuner_class(True)(
            mesh, fused_parts, adapters, active, layer.in_features,
            {p: host.full_shapes[f"{p}.weight"][0] for p in parts},
            specs={p: host.shard_spec(f"{p}.weight", mesh.rank) for p in parts}, **opts)
    return tuner_class()(mesh, getattr(host, a.name), adapters, active, layer.in_features,
                         layer.out_features, side="input" if a.name in INPUT_SIDE else "output",
                         base_spec=host.shard_spec(f"{a.name}.weight", mesh.rank), **opts)


def inner_model(model: nn.Module) -> nn.Module:
    """The Hugging Face (or TSP) model inside a PeftModel; any other ``model`` itself."""
    return model.base_model.model if is_peft_model(model) else model


def adapter_state_dict(model: nn.Module) -> dict[str, Any]:
    """The full tensors of every TSP LoRA adapter (all named adapters) of the converted
    PeftModel ``model``, by the PeftModel's own parameter names (what PEFT's
    ``get_peft_model_state_dict`` picks from its ``state_dict()`` on one process); every rank
    of the group must call it. The base weights are not gathered: PEFT saves none of them."""
    return {f"{prefix}.{name}": t
            for prefix, m in model.named_modules() if isinstance(m, TSPLoRA)
            for name, t in m.full_tensors().items()}


@contextlib.contextmanager
def refuse_per_call_adapters(tuner: nn.Module, *args: Any, **kwargs: Any) -> Iterator[None]:
    """The converted tuner's ``_enable_peft_forward_hooks``, which PEFT enters around each
    forward and ``generate``. PEFT's ``adapter_names=`` (an adapter per row) and
    ``alora_offsets=`` work by hooks on its own LoRA layers; TSP's adapters are not those, so the
    choice would be ignored and the active adapter applied to every row. Refused instead, on
    every rank before the forward's first collective."""
    given = [k for k in ("adapter_names", "alora_offsets") if kwargs.get(k) is not None]
    if given:
        raise NotImplementedError(
            f"{' and '.join(given)}= (PEFT's per-row adapter choice) is not supported under TSP: "
            f"every row runs the active adapter. Choose it with set_adapter(name), or "
            f"disable_adapter() for the base (docs/lora.md)")
    yield


def save_pretrained(model: nn.Module, save_directory: str, *args: Any, **kwargs: Any) -> None:
    """PEFT's ``save_pretrained`` of the converted PeftModel ``model`` (its own, set by
    :meth:`PeftAdapters.attach`), with the full adapters: every rank must call it. Without
    ``state_dict=`` every rank gathers its group's adapters (:func:`adapter_state_dict`) and
    global rank 0 alone writes (PEFT's ``is_main_process`` still applies there); a given
    ``state_dict`` is PEFT's own call, on the ranks that make it."""
    if kwargs.get("state_dict") is None:
        kwargs["state_dict"] = adapter_state_dict(model)
        if get_mesh(model).device_mesh.get_rank() != 0:
            return None
    return type(model).save_pretrained(model, save_directory, *args, **kwargs)


def refuse_schedule(a: Adapted, module: nn.Module | None) -> None:
    """Raise unless ``module`` (the TSP module replacing ``a.parent``) runs a schedule that takes
    LoRA adapters: the per-head-group attention without KV sharing or sinks (Llama, Qwen3,
    Phi-3, ...), or the gated MLP."""
    from ..layers.attention import TSPAttention
    from ..layers.mlp import TSPGatedMLP

    if isinstance(module, TSPAttention):
        p = module.parts
        why = ("its q/k norms span every head of a token (the phased schedule)" if p.over_token
               else "it shares K/V between layers" if p.kv_sharing is not None
               else "it has attention sinks" if p.mask.sinks
               else "its values come from the keys" if p.values_from_keys
               else None)
    elif isinstance(module, TSPGatedMLP):
        why = None
    else:
        why = f"it becomes a {type(module).__name__}, whose schedule takes no adapter"
    if why is not None:
        raise NotImplementedError(f"LoRA on {a.path} is not supported under TSP: {why}; "
                                  f"adapt the layers of a Llama-like attention and gated MLP "
                                  f"({DOCS})")


def read_peft(model: nn.Module, mesh: TSPMesh, policy: DecoderPolicy | None
              ) -> PeftAdapters | None:
    """The adapters of ``model`` if it is a PeftModel (None otherwise), every refusal raised
    here, on every rank alike, before anything changes or any collective runs."""
    if not is_peft_model(model):
        refuse_without_adapters(model)
        return None
    configs = dict(model.peft_config)
    for name, config in configs.items():
        refuse_config(name, config)
    if mesh.fsdp_size > 1:
        raise NotImplementedError(f"LoRA with FSDP2 (dp_shard={mesh.fsdp_size}) is not "
                                  f"supported yet: use plain data parallelism (init_mesh "
                                  f"without dp_shard) ({DOCS})")
    inner = model.base_model.model
    if next(inner.parameters()).is_meta:
        raise NotImplementedError("a PeftModel on the meta device: load the base weights and "
                                  "create the adapters before parallelize")
    policy = policy or find_policy(inner)
    quantized = read_quantized(inner, policy)
    adapted = find_adapted(inner, policy)
    requires_grad = {n: p.requires_grad for n, p in model.named_parameters()}
    trained = sorted(n for n, on in requires_grad.items() if on and ".lora_" not in n)
    if trained:
        raise NotImplementedError(f"{len(trained)} parameters of the PeftModel besides its LoRA "
                                  f"adapters require grad, {trained[:3]} first: TSP converts a "
                                  f"PeftModel whose base is frozen, as get_peft_model leaves it; "
                                  f"set their requires_grad to False before parallelize "
                                  f"({DOCS})")
    return PeftAdapters(model, inner, list(configs), adapted, requires_grad, quantized)


def refuse_config(name: str, config: Any) -> None:
    """Raise naming what adapter ``name``'s configuration asks for that TSP does not do: another
    PEFT type than LoRA, or a LoRA feature of :data:`UNSUPPORTED`, a bias."""
    kind = str(getattr(config, "peft_type", type(config).__name__)).rpartition(".")[-1]
    if kind != "LORA":
        raise NotImplementedError(f"PEFT type {kind} ({type(config).__name__}, adapter "
                                  f"{name!r}) is not supported under TSP: only LoRA "
                                  f"(LoraConfig) is ({DOCS})")
    for field_name, what in UNSUPPORTED.items():
        if value := getattr(config, field_name, None):
            value = sorted(value) if isinstance(value, (set, frozenset)) else value  # one order
            raise NotImplementedError(f"{what} ({field_name}={value!r}, "
                                      f"adapter {name!r}) is not supported under TSP; plain "
                                      f"LoRA is ({DOCS})")
    if getattr(config, "bias", "none") != "none":
        raise NotImplementedError(f"LoraConfig(bias={config.bias!r}) trains the base model's "
                                  f"biases, which TSP keeps frozen; use bias=\"none\" ({DOCS})")


def find_adapted(model: nn.Module, policy: DecoderPolicy) -> list[Adapted]:
    """Every PEFT LoRA layer of the Hugging Face ``model``, each checked to be one of the
    attention's or MLP's projections of a decoder layer (:data:`TARGETS`, or a projection the
    policy names fused), a plain Linear, unmerged."""
    names = policy.modules
    prefix = f"{names.base_model}.{names.layers}."
    found = []
    for path, module in model.named_modules():
        if not hasattr(module, "lora_A"):
            continue
        parent_path, _, name = path.rpartition(".")
        layer, _, role_name = parent_path.removeprefix(prefix).partition(".")
        role = {names.attention: "attention", names.mlp: "mlp"}.get(role_name)
        targets = () if role is None else (*TARGETS[role], *names.fused_in(role))
        if not parent_path.startswith(prefix) or not layer.isdigit() or name not in targets:
            raise NotImplementedError(
                f"LoRA on {path} is not supported under TSP: adapt the decoder layers' "
                f"{names.attention}.{{{','.join(TARGETS['attention'])}}} and "
                f"{names.mlp}.{{{','.join(TARGETS['mlp'])}}} (or the projections the model "
                f"fuses: Phi-3's qkv_proj, gate_up_proj) ({DOCS})")
        if type(module.base_layer) is not nn.Linear and not is_linear4bit(module.base_layer):
            raise NotImplementedError(f"LoRA on {path}: its base layer is a "
                                      f"{type(module.base_layer).__name__}, TSP adapts "
                                      f"nn.Linear projections ({DOCS})")
        if getattr(module, "merged_adapters", None):
            raise NotImplementedError(f"LoRA on {path} is merged into the base weight "
                                      f"({module.merged_adapters}): unmerge() it first, or "
                                      f"merge_and_unload() and parallelize the plain model")
        found.append(Adapted(path, model.get_submodule(parent_path), name, module))
    return found


@cache
def tuner_class(fused: bool = False) -> type:
    """:class:`TSPLoRA` (:class:`TSPFusedLoRA` if ``fused``) as a PEFT tuner layer
    (``BaseTunerLayer`` mixed in), so that PEFT's model-wide switches reach it:
    ``disable_adapter()``, ``enable_adapter_layers()``, ``set_adapter``, the layer status,
    ``print_trainable_parameters``. Imports peft, which only a PeftModel brings."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    class TSPLoraLayer(TSPFusedLoRA if fused else TSPLoRA, BaseTunerLayer):
        """A TSP LoRA adapter that PEFT sees as one of its tuner layers: PEFT's
        ``merge_and_unload()`` and ``unload()`` put back the projection, merged or not."""

        def unload_and_optionally_merge_module(self, merge: bool, safe_merge: bool,
                                               adapter_names: Any) -> nn.Module:
            if merge:
                self.merge(safe_merge, adapter_names)
            return self.base_layer

        def unmerge(self) -> None:
            raise NotImplementedError(f"unmerging LoRA from TSP's sharded weights is not "
                                      f"supported ({DOCS})")

    return TSPLoraLayer

