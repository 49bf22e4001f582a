"""LoRA in ``tsp simulate`` (``SimulationRequest.lora = r``, ``--lora R``): the simulated model is
PEFT's ``get_peft_model(model, LoraConfig(r=R, target_modules=<the seven projections>))`` before
it is laid out, as ``tsp_trl.TSPSFTTrainer(peft_config=...)`` applies it (docs/lora.md).

Its base is frozen (no gradient, no optimizer state); AdamW holds the adapters' moments only.
The adapters are PEFT's: float32 beside a bf16 base (``autocast_adapter_dtype``, PEFT's default),
replicated on every rank. Only TSP takes a ``PeftModel``: the baselines' tensor-parallel styles
shard ``nn.Linear`` modules, and PEFT puts its ``LoraLayer`` in their place, so a baseline would
need adapters of its own design to be compared (refused, naming that).

With ``qlora`` (``--qlora``) the base's seven projections are 4-bit NF4, held and moved as
``tsp_core.parallelize`` holds a PeftModel loaded with ``BitsAndBytesConfig(load_in_4bit=True,
bnb_4bit_quant_type="nf4")`` (docs/lora.md "QLoRA"): :func:`quantize_base` puts in each adapted
projection's ``base_layer`` the :class:`~tsp_core.layers.nf4.NF4Weight` that
``tsp_core.models.qlora`` attaches (this rank's packed codes, elements / 2 bytes, and float32
absmax, one per 64 weights), built from the shard's shape, after the same refusals
(:meth:`~tsp_core.models.qlora.QuantizedBase.check`); the schedules then move and dequantize it
as in training. Embeddings, norms and the LM head stay in the model's dtype, as bitsandbytes
leaves them. The bitsandbytes model itself cannot be built under fake tensors: its
``Params4bit`` cannot wrap a ``FakeTensor`` ("Creating a new Tensor subclass Params4bit but the
raw Tensor object is already associated to a python object of type FakeTensor").
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..models.lora import TARGETS as ADAPTED

# the seven projections tsp_core.models.lora adapts
TARGETS = tuple(name for names in ADAPTED.values() for name in names)
# bitsandbytes' 4-bit block: Linear4bit's default, which BitsAndBytesConfig does not change
BLOCKSIZE = 64


def check_lora(lora: int | None, layout: str, dp_shard: int, qlora: bool = False) -> None:
    """Refuse what the simulation cannot lay out with adapters, naming the numbers."""
    if qlora and lora is None:
        raise ValueError("qlora (a 4-bit NF4 base) trains LoRA adapters on the frozen base: give "
                         "the adapters' rank too (--lora R, e.g. --lora 16)")
    if lora is None:
        return
    if not isinstance(lora, int) or lora < 1:
        raise ValueError(f"lora rank ({lora}) must be a positive integer")
    if layout != "tsp":
        raise ValueError(f"lora (r={lora}) is simulated for tsp only, not {layout}: the "
                         f"baselines' tensor-parallel styles shard nn.Linear modules and PEFT "
                         f"puts its LoRA layers in their place")
    if dp_shard > 1:
        raise ValueError(f"lora (r={lora}) with FSDP2 (dp_shard {dp_shard}) is refused by "
                         f"tsp_core.parallelize (docs/lora.md); use dp_shard 1")


def wrap(model: nn.Module, rank: int) -> nn.Module:
    """``model`` as PEFT's ``PeftModel`` with LoRA of rank ``rank`` on :data:`TARGETS`, its base
    frozen by PEFT, its adapters float32 as PEFT leaves them beside a bf16 base.

    Under ``FakeTensorMode`` a parameter's ``.to(...)`` fails (``nn.Module._apply`` swaps fake
    parameters, which hold weak references), and PEFT moves each new adapter to its base's
    device and dtype, then casts it back to float32 (``autocast_adapter_dtype``). The adapters
    are built in the float32 default dtype on the base's (fake) device, so both moves are
    skipped: the result is the dtype PEFT's two moves give."""
    from peft import LoraConfig, get_peft_model
    from peft.tuners.tuners_utils import BaseTunerLayer

    if torch.get_default_dtype() != torch.float32:
        raise ValueError(f"build the adapters with float32 as the default dtype, not "
                         f"{torch.get_default_dtype()} (PEFT's adapters beside a bf16 base)")
    config = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=list(TARGETS),
                        lora_dropout=0.0, bias="none", task_type="CAUSAL_LM")
    move, to = BaseTunerLayer._move_adapter_to_device_of_base_layer, nn.Module.to
    BaseTunerLayer._move_adapter_to_device_of_base_layer = lambda *args, **kwargs: None
    nn.Module.to = _to_unless_in_place(to)  # PEFT's module.to(weight.device): already there
    try:
        return get_peft_model(model, config, autocast_adapter_dtype=False)
    finally:
        BaseTunerLayer._move_adapter_to_device_of_base_layer, nn.Module.to = move, to


def quantize_base(model: nn.Module) -> None:
    """Each adapted projection's base shard of the converted PeftModel ``model`` as QLoRA holds
    it (module docstring): refused first (a ``ValueError``), on the same grounds and with the
    same words as ``tsp_core.parallelize`` refuses a 4-bit base (a schedule that takes no NF4
    shard, a shard that cuts a block of :data:`BLOCKSIZE`), then an :class:`NF4Weight` of the
    shard's packed bytes and absmax in the float shard's place (a bias kept beside it)."""
    from types import SimpleNamespace

    from ..layers.lora import TSPLoRA
    from ..layers.nf4 import NF4Weight
    from ..models.qlora import Quantized, QuantizedBase

    found = [(f"{path}.{name}", host, name, adapter) for path, host in model.named_modules()
             for name, adapter in host.named_children() if isinstance(adapter, TSPLoRA)]
    if not found:
        raise ValueError("qlora: the model has no LoRA adapters to quantize the base of")
    mesh = found[0][3].mesh

    def shape_of(host: nn.Module, name: str) -> SimpleNamespace:  # what check reads of a layer
        state = SimpleNamespace(shape=host.full_shapes.get(f"{name}.weight"), blocksize=BLOCKSIZE)
        return SimpleNamespace(weight=SimpleNamespace(quant_state=state))

    base = QuantizedBase([Quantized(path, host, name, shape_of(host, name))
                          for path, host, name, _ in found])
    try:
        base.check({id(h): h for _, h, _, _ in found}, mesh)
    except NotImplementedError as e:  # a request this model cannot take: one line from tsp
        raise ValueError(f"qlora: {e}") from e
    for _, host, name, adapter in found:
        spec = host.shard_spec(f"{name}.weight", mesh.rank)
        shape = list(host.full_shapes[f"{name}.weight"])
        shape[spec.dim] = spec.length
        old = adapter.base_layer
        elements, device = shape[0] * shape[1], old.weight.device
        holder = NF4Weight(torch.empty(elements // 2, dtype=torch.uint8, device=device),
                           torch.empty(elements // BLOCKSIZE, dtype=torch.float32, device=device),
                           tuple(shape), BLOCKSIZE, old.weight.dtype)
        for n, p in old.named_parameters(recurse=False):
            if n != "weight":
                holder.register_parameter(n, p)
        adapter.base_layer = holder


def _to_unless_in_place(to):
    """``nn.Module.to`` that returns the module untouched when every tensor of it already has
    the asked device and dtype (what ``to`` would leave unchanged, without a fake swap)."""
    def guarded(module: nn.Module, *args: Any, **kwargs: Any) -> nn.Module:
        device, dtype, _, _ = torch._C._nn._parse_to(*args, **kwargs)
        tensors = [*module.parameters(), *module.buffers()]
        if all((device is None or t.device == torch.device(device))
               and (dtype is None or t.dtype == dtype or not t.is_floating_point())
               for t in tensors):
            return module
        return to(module, *args, **kwargs)

    return guarded


def adapter_parameters(model: nn.Module) -> list[Any]:
    """The trainable parameters: the adapters under LoRA, every parameter otherwise."""
    return [p for p in model.parameters() if p.requires_grad]


def tracker_class():
    """The simulation's tracker, hooking the gradients of trainable parameters only: PyTorch's
    ``MemTracker`` registers a gradient hook on every parameter of a module it enters, which a
    frozen parameter refuses (and it never gets a gradient to count)."""
    from torch.distributed._tools.mem_tracker import _MemRefType

    from .peak_tracker import IndexedMemTracker

    class FrozenAwareTracker(IndexedMemTracker):
        def _track_module_params_and_buffers(self, module, install_grad_hooks=True):
            out = super()._track_module_params_and_buffers(module, install_grad_hooks=False)
            if install_grad_hooks:
                for p in module.parameters():
                    if p.requires_grad and p not in self._param_to_grad_hook_handles:
                        self._param_to_grad_hook_handles[p] = (
                            p.register_hook(self._grad(_MemRefType.GRAD)),
                            p.register_post_accumulate_grad_hook(
                                lambda q: self._grad(_MemRefType.GRAD)(q.grad)))
            return out

        def _grad(self, kind):
            def hook(grad: torch.Tensor) -> None:  # a hook's result would replace the gradient
                self._update_and_maybe_create_winfos(grad, kind)

            return hook

    return FrozenAwareTracker
