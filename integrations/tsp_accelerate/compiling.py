"""``torch.compile`` the TSP way for Accelerate (docs/accelerate.md "torch.compile"): what the
user asks of Accelerate's ``TorchDynamoPlugin`` (``dynamo_backend=``, ``dynamo_plugin=``,
``accelerate launch --dynamo_backend``, the Trainer's ``torch_compile*`` arguments) becomes
``tsp_core.parallelize(..., compile=backend)``: each decoder layer compiled with
``torch.compile(fullgraph=True)`` (docs/design.md "Compiled layers"). Accelerate itself is given a
plugin of backend "no", so it never compiles the whole model: one graph of the whole TSP model
would hold every layer's collectives and recompile whenever anything outside the layers
changes. What ``parallelize`` cannot take (a mode, backend options, dynamic shapes) is refused
with the fix, never dropped."""

from __future__ import annotations

import torch
from accelerate.utils import DynamoBackend, TorchDynamoPlugin
from torch import nn

from tsp_core.distributed.model_state import find_model_state
from tsp_core.models.compiled import compile_layers, compiled_by
from tsp_core.models.lora import inner_model


def not_compiled() -> TorchDynamoPlugin:
    """What Accelerate itself is given: compile nothing."""
    return TorchDynamoPlugin(backend="no")


def requested_plugin(dynamo_backend: str | DynamoBackend | None,
                     dynamo_plugin: TorchDynamoPlugin | None) -> TorchDynamoPlugin:
    """The plugin ``Accelerator.__init__`` would build from these arguments (unset: from the
    launcher's ``ACCELERATE_DYNAMO_*`` environment)."""
    if dynamo_plugin is not None and dynamo_backend is not None:
        raise ValueError("You cannot pass in both `dynamo_plugin` and `dynamo_backend`, please "
                         "only pass in one.")
    return dynamo_plugin if dynamo_plugin is not None else TorchDynamoPlugin(backend=dynamo_backend)


def layer_compile(plugin: TorchDynamoPlugin, who: str = "TSPAccelerator") -> bool | str:
    """``parallelize``'s ``compile`` for ``plugin``: False (backend "no", or ``disable``), else
    the backend's name. Raises, before any collective, for what per-layer compilation cannot
    honour; ``fullgraph`` and ``use_regional_compilation`` need nothing (each layer is compiled
    whole, regionally), and ``dynamic=False``, which ``accelerate launch`` always sets, is taken
    as unset (torch.compile's default: static shapes until a shape changes)."""
    backend = DynamoBackend(str.upper(plugin.backend))  # a member, or a name set afterwards
    if backend == DynamoBackend.NO or plugin.disable:
        return False
    refused = []
    if plugin.mode not in (None, "default"):
        refused.append(f"mode={plugin.mode!r} (the Trainer's torch_compile_mode, accelerate's "
                       f"--dynamo_mode): leave it unset or 'default'")
    if plugin.options is not None:
        refused.append(f"options={plugin.options!r}: leave them unset (inductor gets TSP's own: "
                       f"no reordering of the collectives)")
    if plugin.dynamic:  # False is accelerate launch's default: taken as unset
        refused.append("dynamic=True (--dynamo_use_dynamic): leave it unset")
    if refused:
        raise ValueError(f"{who} compiles each decoder layer with tsp_core.parallelize(..., "
                         f"compile={backend.value.lower()!r}), which cannot honour "
                         + "; ".join(refused))
    return backend.value.lower()


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The decoder layers of a converted model (a PeftModel's TSP model inside)."""
    hf_model = inner_model(model)
    modules = find_model_state(hf_model).policy.modules
    return list(getattr(getattr(hf_model, modules.base_model), modules.layers))


def compile_converted(model: nn.Module, compile: bool | str) -> None:
    """Compile the decoder layers of ``model``, converted already (by the user, or by
    ``TSPTrainer``), unless ``compile`` is False or they are compiled already."""
    if compile is False or any(compiled_by(layer) for layer in decoder_layers(model)):
        return
    compile_layers(inner_model(model), compile)


def refuse_compiled_model(model: nn.Module, who: str = "TSPAccelerator") -> None:
    """A model ``torch.compile`` wrapped whole: refused, naming the per-layer way."""
    if isinstance(model, torch._dynamo.eval_frame.OptimizedModule):
        raise ValueError(f"{who} was given a model torch.compile wrapped whole (an "
                         f"OptimizedModule); TSP compiles each decoder layer instead: pass the "
                         f"model itself and dynamo_backend='inductor' (or another backend) to "
                         f"the accelerator")
