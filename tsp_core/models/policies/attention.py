"""The attention side of a policy (:class:`AttentionPolicy`): how a family's Hugging Face
attention module reads as :class:`~tsp_core.layers.attention.AttentionParts`, the parts a
:class:`~tsp_core.layers.attention.TSPAttention` is built from.

The hooks every family may set are fields here; a feature of one family alone (Llama 4's
chunks, NoPE layers and temperature, Gemma 4's value norm and KV sharing) is a builder function
in that family's own file (``AttentionPolicy.family_parts``), which sets the parts it needs. A
new such feature touches the family's file, :mod:`tsp_core.layers.attention.parts`, a test and
the docs, never ``parallelize`` or the schedules."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from torch import nn

from ...layers.attention.parts import AttentionParts, Mask, QKNorm, Rotary, ValueNorm


def no_window(config: Any, attention: nn.Module) -> int | None:
    """No sliding window on any layer."""
    return None


def window_from_config(config: Any, attention: nn.Module) -> int | None:
    """Every layer's window is the config's ``sliding_window`` (None: off): Mistral, Phi-3."""
    return getattr(config, "sliding_window", None)


def window_from_module(config: Any, attention: nn.Module) -> int | None:
    """Each layer's window is its attention module's own ``sliding_window``, which Hugging Face
    sets from ``config.layer_types`` (None on full layers): Qwen2, Gemma, OLMo 3, gpt-oss."""
    return getattr(attention, "sliding_window", None)


def norm_eps(norm: nn.Module) -> float:
    """An RMSNorm module's epsilon (Llama's ``variance_epsilon``, Gemma's ``eps``)."""
    eps = getattr(norm, "variance_epsilon", None)
    return norm.eps if eps is None else eps


def value_norm_from_module(attention: nn.Module, name: str, kind: str,
                           policy: str) -> ValueNorm:
    """The weightless value norm module ``name`` of ``attention`` as a part, in ``kind``'s
    numerics; refused, naming ``policy``, when the module lacks it."""
    norm = getattr(attention, name, None)
    if norm is None:
        raise ValueError(f"the policy {policy!r} names a value norm {name!r} "
                         f"that the attention ({type(attention).__name__}) does not have")
    return ValueNorm(float(norm_eps(norm)), kind)


def no_rotary(parts: AttentionParts) -> AttentionParts:
    """``parts`` of a NoPE layer: no rotation of q and k (SmolLM3's no_rope_layers, EXAONE 4's
    global layers, Llama 4's NoPE layers)."""
    return replace(parts, rotary=replace(parts.rotary, kind="none"))


def _always(config: Any) -> bool:
    return True


# the usual q/k norms: modules q_norm and k_norm, each an RMSNorm over head_dim (Qwen3)
PER_HEAD = QKNorm()


@dataclass(frozen=True)
class AttentionPolicy:
    """How one family's attention reads as parts (defaults: Llama's).

    ``sliding_window(config, attention)``: a layer's window (:func:`window_from_config`,
    :func:`window_from_module`), None: off. ``rotary``: the rotation of the layers with RoPE
    (:class:`~tsp_core.layers.attention.Rotary`: "interleaved" for GLM-4 and Ernie 4.5,
    "half_width" for gpt-oss, "complex" for Llama 4). ``qk_norm``: the attention's q/k norms,
    their module names, ``scope`` ("token": over all heads of a token, OLMo 2) and ``after_rope``
    (Hunyuan dense); its kind is the policy's ``norm`` and its eps each layer's module's; None:
    none. ``qk_norm_on(config)``: whether the config turns them on (GLM-4.5's use_qk_norm).
    ``softcap(config)``: the attention scores' soft-cap (Gemma 2), None: off. ``output_gate``:
    [query | gate] rows per head (Qwen3.5). ``family_parts(config, attention, parts)``: the
    family's own parts on top of these (Llama 4, Gemma 4, NoPE layers). ``module``: a layer's
    attention built by the family instead of TSPAttention, with its own schedule (DeepSeek-V3's
    latent attention): (mesh, config, the Hugging Face attention, dtype/device options) -> the
    TSP module; None: TSPAttention."""

    sliding_window: Callable[[Any, nn.Module], int | None] = field(default=no_window)
    rotary: Rotary = field(default_factory=Rotary)
    qk_norm: QKNorm | None = None
    qk_norm_on: Callable[[Any], bool] = field(default=_always)
    softcap: Callable[[Any], float | None] | None = None
    output_gate: bool = False
    family_parts: Callable[[Any, nn.Module, AttentionParts], AttentionParts] | None = None
    module: Callable[..., nn.Module] | None = None

    def qk_norm_in(self, config: Any) -> QKNorm | None:
        """The q/k norms where ``config`` has them (their kind and eps not yet read), else
        None."""
        return self.qk_norm if self.qk_norm is not None and self.qk_norm_on(config) else None

    def softcap_of(self, config: Any) -> float | None:
        """The attention scores' soft-cap of ``config`` (None: the family has none, or off)."""
        cap = None if self.softcap is None else self.softcap(config)
        return None if cap is None else float(cap)

    def parts(self, config: Any, attention: nn.Module, norm: str = "llama") -> AttentionParts:
        """The parts of the Hugging Face ``attention`` module of one layer (``norm``: the
        policy's RMSNorm numerics, the q/k norm's kind). An attention ``sinks`` parameter
        (gpt-oss's) is found by name; the softmax scale is the module's ``scaling``. A q/k norm
        module the attention lacks keeps the template's eps: ``parallelize``'s checks refuse
        it, naming it."""
        qk = self.qk_norm_in(config)
        if qk is not None:
            module = getattr(attention, qk.names[0], None)
            qk = replace(qk, kind=norm, eps=qk.eps if module is None else norm_eps(module))
        sinks = isinstance(getattr(attention, "sinks", None), nn.Parameter)
        mask = Mask(sliding_window=self.sliding_window(config, attention), sinks=sinks,
                    softcap=self.softcap_of(config))
        parts = AttentionParts(qk_norm=qk, rotary=self.rotary, mask=mask,
                               scale=attention.scaling,
                               output_gate=self.output_gate)
        return parts if self.family_parts is None else self.family_parts(config, attention, parts)
