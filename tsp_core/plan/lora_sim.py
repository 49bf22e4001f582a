"""LoRA in ``tsp simulate`` (``SimulationRequest.lora = r``, ``--lora R``): the simulated model is
PEFT's ``get_peft_model(model, LoraConfig(r=R, target_modules=<the seven projections>))`` before
it is laid out, as ``tsp_trl.TSPSFTTrainer(peft_config=...)`` applies it (docs/lora.md).

Its base is frozen (no gradient, no optimizer state); AdamW holds the adapters' moments only.
The adapters are PEFT's: float32 beside a bf16 base (``autocast_adapter_dtype``, PEFT's default),
replicated on every rank. Only TSP takes a ``PeftModel``: the baselines' tensor-parallel styles
shard ``nn.Linear`` modules, and PEFT puts its ``LoraLayer`` in their place, so a baseline would
need adapters of its own design to be compared (refused, naming that).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..models.lora import TARGETS as ADAPTED

# the seven projections tsp_core.models.lora adapts
TARGETS = tuple(name for names in ADAPTED.values() for name in names)


def check_lora(lora: int | None, layout: str, dp_shard: int) -> None:
    """Refuse what the simulation cannot lay out with adapters, naming the numbers."""
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
