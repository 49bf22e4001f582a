"""Compiled decoder layers (docs/design.md "Compiled layers"): ``torch.compile(fullgraph=True)``
on each decoder layer of a converted model, as torchtitan compiles each transformer block, so one
graph serves every layer of a kind and a change outside the layers (the loss, the data) never
recompiles them. The layers' collectives are traced as ordered ops
(:mod:`tsp_core.distributed.traced`)."""

from __future__ import annotations

from functools import cache
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import noop_context_fn

from ..distributed import opaque, traced
from ..distributed.model_state import find_model_state
from ..inference.decode import generating

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


# Dynamo's options while a compiled layer runs (traced on its first call), for that call only:
# - the backwards recompute small pieces with torch.autograd.grad (norm tiles, activations),
#   which dynamo traces only with trace_autograd_ops;
# - an opaque op's size fixed by the routing (tsp_core.distributed.opaque) would get a runtime
#   assert in the graph, and inductor's re-inplacing pass fails on those asserts (it compares the
#   old and new symbolic booleans by subtracting them); the size comes from the op's eager code,
#   which builds its outputs from the routing's counts.
DYNAMO_OPTIONS = {"trace_autograd_ops": True, "do_not_emit_runtime_asserts": True}


def compile_layers(model: nn.Module, compile: bool | str) -> None:
    """Compile every decoder layer of the converted ``model`` (a no-op for ``compile=False``):
    each layer becomes an instance of :func:`compiled_class` of its class."""
    if compile is False:
        return
    modules = find_model_state(model).policy.modules
    backend = "inductor" if compile is True else compile
    layers = list(getattr(getattr(model, modules.base_model), modules.layers))
    for layer in layers:
        refuse_selective_checkpointing(layer, getattr(layer, CHECKPOINT_FUNC, None))
    for layer in layers:
        layer.__class__ = compiled_class(type(layer), backend)


@cache
def compiled_class(cls: type[nn.Module], backend: str) -> type[nn.Module]:
    """A subclass of the decoder layer class ``cls`` whose ``forward`` is ``cls.forward``
    compiled (one function per class, so the layers of a kind share its graphs). What runs
    around the forward stays eager, outside the graph: the module's hooks (FSDP2's gathers) and
    Hugging Face's activation checkpointing, which wraps the subclass's forward (a layer class's
    subclass is checkpointed by its outermost forward), so the recompute runs the compiled
    forward again; selective checkpointing is refused (:func:`refuse_selective_checkpointing`),
    enabled before compiling or after. Before each call it tells the graph what only the eager
    code can see (:class:`traced.Outside`). Shapes are static (``dynamic=False``: a round's
    shard sizes are Python numbers): each new sequence length compiles one graph per kind of
    layer. A generation's prefill and decode steps run the layer eagerly."""
    if getattr(cls, "compiled_by", None) is not None:
        raise ValueError(f"{cls.__name__} is compiled already (by {cls.compiled_by!r})")
    options = INDUCTOR_OPTIONS if backend == "inductor" else None
    opaque.prepare_tracing()
    compiled = torch.compile(cls.forward, backend=backend, fullgraph=True, dynamic=False,
                             options=options)

    def forward(self, *args, **kwargs):
        if generating():  # eager: a decode step's cache and positions change at every token
            return cls.forward(self, *args, **kwargs)
        traced.Outside.in_backward = torch._C._current_graph_task_id() != -1
        try:
            with torch._dynamo.config.patch(DYNAMO_OPTIONS):
                return compiled(self, *args, **kwargs)
        except torch._dynamo.exc.FailOnRecompileLimitHit as err:
            limit = torch._dynamo.config.recompile_limit
            raise RuntimeError(
                f"{cls.__name__} is compiled for {limit} input shapes already "
                f"(torch._dynamo.config.recompile_limit = {limit}) and this call needs another: "
                f"each new sequence length compiles the layer once more. Pad batches to a few "
                f"lengths (a collator's pad_to_multiple_of, packed rows of one length) or raise "
                f"that limit") from err

    return type(f"Compiled{cls.__name__}", (cls,), {
        "forward": forward, "compiled_by": backend, "__module__": cls.__module__,
        CHECKPOINT_FUNC: property(_checkpoint_func, _set_checkpoint_func)})


# where Hugging Face's activation_checkpointing_enable puts each layer's checkpoint function
# (functools.partial of torch.utils.checkpoint.checkpoint with its keyword arguments)
CHECKPOINT_FUNC = "_gradient_checkpointing_func"


def _checkpoint_func(layer: nn.Module) -> Any:
    """The checkpoint function Hugging Face set on ``layer`` (an instance attribute before
    the layer was compiled, or through :func:`_set_checkpoint_func` after)."""
    try:
        return layer.__dict__[CHECKPOINT_FUNC]
    except KeyError:
        raise AttributeError(CHECKPOINT_FUNC) from None


def _set_checkpoint_func(layer: nn.Module, func: Any) -> None:
    """A compiled layer's checkpoint function is set when activation checkpointing is enabled
    (on every rank, before any collective): a selective one is refused there."""
    refuse_selective_checkpointing(layer, func)
    layer.__dict__[CHECKPOINT_FUNC] = func


def refuse_selective_checkpointing(layer: nn.Module, func: Any) -> None:
    """Raise for selective activation checkpointing (a ``context_fn``) on a compiled layer,
    which neither order can run (docs/design.md "Compiled layers"). Around the compiled forward
    (Hugging Face's order, as for full checkpointing) the policy is a dispatch mode that must run
    each op of the graph: the traced collectives are ordered-effect ops it has no rule for, and
    an inductor kernel would hide the matmuls it saves. Inside the graph (torchtitan's order)
    AOT autograd's partitioner recomputes the rounds' broadcasts and K/V all-gathers in the
    backward on the forward's effect token, which is no tensor at run time; saving their results
    instead would keep other ranks' weight shards and keys/values, which the memory rules
    forbid."""
    keywords = getattr(func, "keywords", None) or {}
    if keywords.get("context_fn", noop_context_fn) is noop_context_fn:
        return
    raise ValueError(
        f"{type(layer).__name__}: selective activation checkpointing "
        f"(activation_checkpointing_kwargs with a context_fn) cannot run on a layer compiled "
        f"by parallelize(..., compile=...): its policy cannot see the compiled graph's ops, "
        f"and inside the graph the backward would recompute the layer's collectives. Enable "
        f"full checkpointing (activation_checkpointing_kwargs={{'use_reentrant': False}}) "
        f"with compile, or parallelize with compile=False to keep the selective policy")


def compiled_by(layer: nn.Module) -> str | None:
    """The backend that compiled ``layer`` (:func:`compile_layers`), or None."""
    return getattr(type(layer), "compiled_by", None)
