"""The baselines' decoder layers compiled the way TSP's are (docs/design.md "Compiled layers"):
``torch.compile(fullgraph=True)`` on each decoder layer, the same backend and the same inductor
options, so that ``tsp bench --compile`` compares one compiled unit under every layout.

The tensor-parallel styles' collectives are DTensor's functional collectives, which dynamo
traces natively (no :mod:`tsp_core.comm` call sits inside a ``tp``/``tp-sp`` layer).
"""

from __future__ import annotations

import torch
from torch import nn

from ..models.compiled import check_compile, compiled_class


def _own_storage(_module: nn.Module, _args, output: torch.Tensor) -> torch.Tensor:
    return output.clone()


def compile_baseline_layers(model: nn.Module, layers: list[nn.Module], embed: nn.Module,
                            compile: bool | str, tensor_parallel: bool) -> None:
    """Compile every layer of ``layers`` (a no-op for ``compile=False``).

    Under tensor parallelism the first layer's input is the view of the vocabulary-parallel
    embedding's DTensor that ``to_local()`` returns. AOT autograd (torch 2.13) returns no
    gradient for a compiled graph's input of that kind, and DTensor's redistribute in the
    embedding's backward then fails (``'Tensor' object has no attribute '_local_tensor'``; the
    ``eager`` backend, which has no AOT autograd, is unaffected). A copy of the embedding's
    output, made outside the compiled layers, gives the layers an input of their own: one
    [batch, tokens, hidden] copy per step."""
    check_compile(compile)
    if compile is False:
        return
    backend = "inductor" if compile is True else compile
    if tensor_parallel:
        embed.register_forward_hook(_own_storage)
    for layer in layers:
        layer.__class__ = compiled_class(type(layer), backend)
