"""TRL's ``peft_config=`` under TSP (docs/lora.md). TRL's trainers apply ``get_peft_model``
inside their own ``__init__``, after ``TSPTrainer`` has converted the model, where PEFT finds no
``nn.Linear`` to adapt. So :func:`apply_peft_config` applies it first, as TRL's SFTTrainer
would (its checks, its ``get_peft_model`` arguments), and TRL is handed the PeftModel with
``peft_config=None``: it then does with it what it does with the PeftModel it built itself
(input gradients under gradient checkpointing, the fused head on the base model)."""

from __future__ import annotations

from typing import Any

from tsp_core.models.lora import is_peft_model


def apply_peft_config(model: Any, peft_config: Any, args: Any) -> Any:
    """``get_peft_model(model, peft_config)`` as TRL 1.16's SFTTrainer calls it (its
    ``TypeError`` for another object than a ``PeftConfig``, its ``ValueError`` for a model that
    is a PeftModel already, ``autocast_adapter_dtype=False`` under DeepSpeed ZeRO-3); every rank
    alike, before any collective. The adapters' initial values come from torch's random
    generator, as on one process: seed it the same on every rank (TSP checks that the ranks'
    adapters agree when it converts the PeftModel)."""
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


def refuse_peft(model: Any, peft_config: Any, trainer: str) -> None:
    """A trainer whose PEFT use TSP does not run yet (DPO: TRL's reference is the policy with
    its adapter disabled, or a second adapter) refuses ``peft_config`` and a PeftModel, on
    every rank before any collective."""
    if peft_config is not None or is_peft_model(model):
        given = "peft_config=" if peft_config is not None else "a PeftModel"
        raise NotImplementedError(f"{trainer} with {given} is not supported under TSP yet (its "
                                  f"reference model would be the policy with the adapter "
                                  f"disabled, or a second adapter): train LoRA with "
                                  f"TSPSFTTrainer, or run {trainer} with tsp_size=1 "
                                  f"(docs/lora.md)")
