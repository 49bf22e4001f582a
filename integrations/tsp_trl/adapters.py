"""TRL's ``peft_config=`` under TSP (docs/lora.md). TRL's trainers apply ``get_peft_model``
inside their own ``__init__``, after ``TSPTrainer`` has converted the model, where PEFT finds no
``nn.Linear`` to adapt. So :func:`apply_peft_config` applies it first, as TRL's SFTTrainer
would (its checks, its ``get_peft_model`` arguments), and TRL is handed the PeftModel with
``peft_config=None``: it then does with it what it does with the PeftModel it built itself
(input gradients under gradient checkpointing, the fused head on the base model).

DPOTrainer tells the two apart: a PeftModel given without ``peft_config`` (and without
``ref_model``) gets a second, frozen "ref" adapter as its reference, one built from
``peft_config`` is its own reference with the adapter disabled; a ``ref_model`` given is the
reference either way. So TSPDPOTrainer hands TRL the model inside the converted PeftModel with the
``peft_config``, and TRL's ``get_peft_model`` returns the PeftModel (:func:`built_peft_model`)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from types import ModuleType
from typing import Any

from tsp_core.models.lora import is_peft_model


def apply_peft_config(model: Any, peft_config: Any, args: Any) -> Any:
    """``get_peft_model(model, peft_config)`` as TRL 1.16's SFTTrainer calls it (its
    ``TypeError`` for another object than a ``PeftConfig``, its ``ValueError`` for a model that
    is a PeftModel already, ``autocast_adapter_dtype=False`` under DeepSpeed ZeRO-3); every rank
    alike, before any collective. The adapters' initial values come from torch's random
    generator: the trainers seed it with ``args.seed`` first, as TRL's do (TSP checks that the
    ranks' adapters agree when it converts the PeftModel)."""
    from peft import PeftConfig, get_peft_model

    if not isinstance(peft_config, PeftConfig):
        raise TypeError(f"`peft_config` must be a `peft.PeftConfig` instance (e.g. "
                        f"`peft.LoraConfig`), got {type(peft_config).__name__}.")
    if is_peft_model(model):
        raise ValueError("You passed a `PeftModel` instance together with a `peft_config` to "
                         "the trainer: pass the base model with the `peft_config`, or the "
                         "PeftModel without it.")
    kwargs = {}
    plugin = getattr(args, "deepspeed_plugin", None)
    quantized = getattr(model, "is_loaded_in_4bit", False) or \
        getattr(model, "is_loaded_in_8bit", False)
    if plugin is not None and plugin.zero_stage == 3 and not quantized:
        kwargs["autocast_adapter_dtype"] = False
    return get_peft_model(model, peft_config, **kwargs)


def refuse_peft_model(model: Any, peft_config: Any, ref_model: Any, trainer: str) -> None:
    """A PeftModel handed to TRL's DPOTrainer without ``peft_config`` or ``ref_model`` keeps its
    adapter as the starting point: TRL adds a second, frozen adapter "ref" (a copy of
    "default") as the reference, and TSP converts one adapter. Refused on every rank before any
    collective, with the fix. With ``ref_model=`` TRL adds no adapter and scores the reference
    with that model, which TSP converts on the policy's mesh; with ``peft_config`` the reference
    is the model with its adapter disabled (:func:`built_peft_model`): both run."""
    if peft_config is None and ref_model is None and is_peft_model(model):
        raise NotImplementedError(
            f"{trainer} with a PeftModel (adapters {sorted(model.peft_config)}), no "
            f"peft_config and no ref_model is not supported under TSP yet: DPOTrainer would add "
            f"a second adapter 'ref', a frozen copy of 'default', as the reference model, and "
            f"TSP converts one adapter. Pass the base model with peft_config=LoraConfig(...) "
            f"(the reference is then the base model, the adapter disabled), pass the reference "
            f"as ref_model=, or run {trainer} with tsp_size=1 (docs/lora.md)")


@contextlib.contextmanager
def built_peft_model(module: ModuleType, built: Any, peft_config: Any) -> Iterator[None]:
    """While a TRL trainer's ``__init__`` runs: its module's ``get_peft_model(model,
    peft_config)`` returns ``built``, the PeftModel :func:`apply_peft_config` made of that
    model with that config before the TSP conversion (PEFT cannot adapt TSP's weight shards),
    so TRL takes its own ``peft_config=`` path with the model it would have built. Any other
    call is PEFT's."""
    original = module.get_peft_model

    def get_peft_model(model: Any, config: Any, *args: Any, **kwargs: Any) -> Any:
        if model is built.get_base_model() and config is peft_config:
            return built
        return original(model, config, *args, **kwargs)

    module.get_peft_model = get_peft_model
    try:
        yield
    finally:
        module.get_peft_model = original
