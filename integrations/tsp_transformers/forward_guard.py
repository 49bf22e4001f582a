"""Whether the forward a TSP model runs under a Trainer is still its own.

Something may set ``model.forward`` on the instance. Mixed precision does, and is harmless:
Accelerate's ``prepare`` (``bf16=True`` / ``fp16=True``) sets ``convert_outputs_to_fp32(
torch.autocast(...)(forward))``, and each layer of that calls the one inside it with the same
arguments. TRL's ``add_fused_lm_head`` and Liger's fused cross-entropy do too, and are not: their
forward runs the backbone and its own loss from ``get_output_embeddings().weight``, skipping the
vocabulary-parallel loss, the input checks, the global rotary length and the MoE auxiliary loss.
Both kinds carry ``__wrapped__`` (``functools.wraps``), TRL's pointing at the class's forward it
never calls, so ``__wrapped__`` alone cannot tell them apart. The guard follows only wrappers known
to call what they wrap, through the variable they really call, and refuses anything else."""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from types import FunctionType, MethodType
from typing import Any

import torch
from torch import nn


def _where(wrapper: Any, inner: Any) -> str:
    """The name under which ``wrapper`` keeps ``inner``: a closure variable of a function, an
    attribute of an object (``__wrapped__`` aside: only what it calls counts)."""
    if isinstance(wrapper, FunctionType):
        cells = zip(wrapper.__code__.co_freevars, wrapper.__closure__ or ())
        return next(name for name, cell in cells if cell.cell_contents is inner)
    return next(name for name, value in vars(wrapper).items()
                if value is inner and name != "__wrapped__")


def _kind(wrapper: Any) -> Any:
    """What identifies a wrapper: a function's code object, else an object's type."""
    return wrapper.__code__ if isinstance(wrapper, FunctionType) else type(wrapper)


@functools.cache
def pass_through_wrappers() -> dict[Any, str]:
    """Each wrapper known to call exactly what it wraps with its own arguments (torch's autocast
    decorator, Accelerate's ``convert_outputs_to_fp32`` closure and its ``ConvertOutputsToFp32``
    object), by :func:`_kind`, with where it keeps the function it calls. Read off wrappers made
    here around a probe, so that a variable renamed in another release is still found."""
    from accelerate.utils.operations import convert_outputs_to_fp32

    def probe(*args: Any, **kwargs: Any) -> None:
        return None

    known: dict[Any, str] = {}
    autocast = torch.autocast("cpu", enabled=False)(probe)
    converted = convert_outputs_to_fp32(probe)
    for wrapper, inner in ((autocast, probe), (converted, converted.__wrapped__),
                           (converted.__wrapped__, probe)):
        known[_kind(wrapper)] = _where(wrapper, inner)
    return known


def _called(wrapper: Any, name: str) -> Any:
    if isinstance(wrapper, FunctionType):
        cells = dict(zip(wrapper.__code__.co_freevars, wrapper.__closure__ or ()))
        return cells[name].cell_contents
    return getattr(wrapper, name)


def describe(function: Any) -> str:
    """What really runs, by its code object (``functools.wraps`` copies the wrapped function's
    names, not its code): ``name of package/module.py``, and the object a method is bound to
    when that is not the model (:func:`forward_that_runs` returns only such methods)."""
    if isinstance(function, MethodType):
        return (f"{describe(function.__func__)} bound to another object (a "
                f"{type(function.__self__).__name__})")
    code = getattr(function, "__code__", None)
    if code is None:
        return type(function).__name__
    return f"{code.co_name} of {os.sep.join(code.co_filename.split(os.sep)[-3:])}"


def forward_that_runs(model: nn.Module) -> Callable | None:
    """None when calling ``model.forward`` runs the class's own forward on ``model`` (nothing set
    on the instance, or only pass-through wrappers around it); else the function that runs in
    its place: the first that is neither a known pass-through wrapper nor the class's forward,
    or a method bound to another object."""
    current = vars(model).get("forward")
    own = getattr(type(model).forward, "__func__", type(model).forward)
    known = pass_through_wrappers()
    seen: set[int] = set()
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, MethodType):
            if current.__self__ is not model:
                return current
            current = current.__func__
        elif current is own:
            return None
        elif _kind(current) in known:
            current = _called(current, known[_kind(current)])
        else:
            return current
    return current


def bypass_message(trainer: Any, what: str) -> str:
    """The guard's refusal: the Trainer class, what it does, and the trainers that work."""
    return (f"{type(trainer).__name__}: {what}. Under TSP each rank holds a slice of the "
            f"vocabulary and of every sequence, so that would train wrongly (a loss over this "
            f"rank's tokens only, the head gathered whole on every rank). Use TSPTrainer's own "
            f"loss, or for TRL the supported trainers tsp_trl.TSPSFTTrainer / "
            f"tsp_trl.TSPDPOTrainer / tsp_trl.TSPGRPOTrainer (docs/trl.md)")


def refuse_bypassed_forward(trainer: Any, model: nn.Module) -> None:
    """Raise when the forward ``model`` runs is not the TSP model's own (:func:`forward_that_runs`),
    naming what runs instead. The same on every rank (no collective), so every rank raises
    together."""
    bypass = forward_that_runs(model)
    if bypass is not None:
        raise ValueError(bypass_message(trainer, f"the model's forward was replaced by "
                                                 f"{describe(bypass)} (e.g. TRL's "
                                                 f"add_fused_lm_head)"))
