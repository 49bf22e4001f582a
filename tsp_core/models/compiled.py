"""Compiled decoder layers (docs/design.md "Compiled layers"): ``torch.compile(fullgraph=True)``
on each decoder layer of a converted model, as torchtitan compiles each transformer block, so one
graph serves every layer of a kind and a change outside the layers (the loss, the data) never
recompiles them. The layers' collectives are traced as ordered ops
(:mod:`tsp_core.distributed.traced`)."""

from __future__ import annotations

import torch
from torch import nn

from ..distributed.model_state import find_model_state

# Inductor's scheduler moves nodes for locality and peak memory; in a backward graph that moved
# the ranks' collectives apart (each rank's graph differs, so each moved them differently, and
# the ranks hung: seen with the rounds' broadcasts). Without those passes the collectives keep
# the order of the traced program on every rank.
INDUCTOR_OPTIONS = {"reorder_for_locality": False, "reorder_for_peak_memory": False}


def check_compile(compile: bool | str) -> None:
    """The option of ``parallelize``: False, True (torch.compile's default backend, inductor) or
    a backend's name."""
    if compile is not True and compile is not False and not isinstance(compile, str):
        raise TypeError(f"compile must be True, False or a torch.compile backend's name, got "
                        f"{compile!r}")


def compile_layers(model: nn.Module, compile: bool | str) -> None:
    """Compile every decoder layer of the converted ``model`` (a no-op for ``compile=False``).
    The layers' hand-written backwards recompute small pieces with ``torch.autograd.grad``, which
    dynamo traces only with ``torch._dynamo.config.trace_autograd_ops`` on: it is turned on for
    the process."""
    if compile is False:
        return
    state = find_model_state(model)
    modules = state.policy.modules
    torch._dynamo.config.trace_autograd_ops = True
    backend = "inductor" if compile is True else compile
    options = INDUCTOR_OPTIONS if backend == "inductor" else None
    for layer in getattr(getattr(model, modules.base_model), modules.layers):
        layer.compile(backend=backend, fullgraph=True, options=options)
