"""What one TSP attention layer is made of, each part once: its shape (:class:`AttentionShape`),
its q/k norm (:class:`QKNorm`), values (:class:`Values`: as projected, or a
:class:`ValueNorm`), rotary embedding
(:class:`Rotary`), mask (:class:`Mask`), KV sharing (:class:`KVSharing`) and the rest
(:class:`AttentionParts`: the softmax scale, a per-token query scale, the output gate, values
from the keys). :meth:`AttentionParts.check` is the one place that refuses a combination no
schedule implements; the schedules (:mod:`.per_group`, :mod:`.phased`) read the parts.

A family's feature becomes a new part or a new field of one here, read by the schedules, and
set by the family's policy (``tsp_core.models.policies``); nothing between them changes."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ..norm import NORMS, WEIGHTLESS, unscaled_norm
from ..sizes import valid_sizes_hint, valid_tsp_sizes

ROTARY_KINDS = ("none", "default", "interleaved", "half_width", "complex")
QK_NORM_SCOPES = ("head", "token")
KV_ROLES = ("store", "reuse")


@dataclass(frozen=True)
class AttentionShape:
    """The layer's size: ``num_kv_heads`` None: as many as query heads (multi-head attention);
    ``head_dim`` None: ``hidden_size // num_heads``. ``qkv_bias``: biases on the q/k/v
    projections; ``o_bias``: on the output projection."""

    hidden_size: int
    num_heads: int
    num_kv_heads: int | None = None
    head_dim: int | None = None
    qkv_bias: bool = False
    o_bias: bool = False

    def resolved(self) -> AttentionShape:
        """This shape with ``num_kv_heads`` and ``head_dim`` filled in."""
        head_dim = self.head_dim
        if head_dim is None:
            if self.hidden_size % self.num_heads:
                raise ValueError(f"num_attention_heads ({self.num_heads}) must divide hidden_size "
                                 f"({self.hidden_size}) unless head_dim is given")
            head_dim = self.hidden_size // self.num_heads
        return AttentionShape(self.hidden_size, self.num_heads,
                              self.num_kv_heads or self.num_heads, head_dim, self.qkv_bias,
                              self.o_bias)


@dataclass(frozen=True)
class QKNorm:
    """An RMS norm of the queries and keys. ``kind``: its numerics
    (:data:`tsp_core.layers.norm.NORMS`; "l2": Llama 4's weightless L2 norm, no parameters);
    ``scope`` "head": each head over head_dim (Qwen3, Gemma 3), weights [head_dim]; "token": over
    all heads of a token (OLMo 2; the phased schedule), weights [heads * head_dim]; ``after_rope``:
    applied after RoPE instead of before it (Hunyuan dense); ``names``: the q and k norm modules'
    names (their weights are ``<name>.weight``)."""

    kind: str = "llama"
    eps: float = 1e-6
    scope: str = "head"
    after_rope: bool = False
    names: tuple[str, str] = ("q_norm", "k_norm")

    @property
    def weightless(self) -> bool:
        return self.kind in WEIGHTLESS

    @property
    def over_token(self) -> bool:
        """Whether the norm spans every head of a token (the phased schedule)."""
        return self.scope == "token"

    @property
    def weights(self) -> tuple[str, str]:
        """The q and k norm weights' parameter names."""
        return tuple(f"{n}.weight" for n in self.names)


@dataclass(frozen=True)
class Values:
    """The values as the attention uses them: this base part leaves each value head as projected.
    It is the slot both schedules and decode call on the projected value heads [..., head_dim]:
    :meth:`apply` in the forward, :meth:`backward` for the gradient. A family's transform of
    the values is a subclass that overrides only :meth:`apply`: its backward is autograd over
    that ``apply``, and no schedule changes. The transform must act on each (token, head) vector
    alone, as the values are split over both."""

    @property
    def needs_input(self) -> bool:
        """Whether :meth:`backward` needs the projected values: whenever :meth:`apply` is not
        this identity (a subclass whose own :meth:`backward` needs no input may say False)."""
        return type(self).apply is not Values.apply

    def apply(self, v: torch.Tensor) -> torch.Tensor:
        return v

    def backward(self, pre: torch.Tensor | None, grad: torch.Tensor) -> torch.Tensor:
        """The gradient w.r.t. the projected values ``pre`` (recomputed by the schedule, only when
        ``needs_input``; docs/design.md "Memory rules") from that of :meth:`apply`'s result."""
        if not self.needs_input:
            return grad
        with torch.enable_grad():
            pre = pre.detach().requires_grad_()
            return torch.autograd.grad(self.apply(pre), pre, grad)[0]


@dataclass(frozen=True)
class ValueNorm(Values):
    """An RMS norm without a learned scale over each value head (Gemma 4's v_norm), in ``kind``'s
    numerics (:data:`tsp_core.layers.norm.NORMS`)."""

    eps: float = 1e-6
    kind: str = "llama"

    def apply(self, v: torch.Tensor) -> torch.Tensor:
        return unscaled_norm(v, self.kind, self.eps)


@dataclass(frozen=True)
class Rotary:
    """How q and k are rotated. ``kind``: "none" (a NoPE layer: SmolLM3's no_rope_layers, Llama
    4's NoPE layers), "default" (rotate-half over cos/sin [.., head_dim] in the ``cat(freqs,
    freqs)`` convention), "interleaved" (channel pairs (2i, 2i+1): GLM-4, Ernie 4.5),
    "half_width" (the model's cos/sin hold each frequency once, [.., head_dim / 2]: gpt-oss;
    widened to the usual convention), "complex" (Llama 4's complex ``freqs_cis`` on channel
    pairs). ``theta``: the base of the frequencies the layer computes itself from
    ``position_ids``."""

    kind: str = "default"
    theta: float = 10000.0

    @property
    def interleaved(self) -> bool:
        """Whether the rotation pairs channels (2i, 2i+1) instead of halves."""
        return self.kind in ("interleaved", "complex")


@dataclass(frozen=True)
class Mask:
    """Which keys a query sees and how its scores are shaped: ``causal``; ``sliding_window``: the
    last that many positions (None: all); ``chunk_size``: only the keys of its own chunk of that
    many tokens (Llama 4's chunked local attention); ``sinks``: a learned per-head logit in the
    softmax denominator (gpt-oss's ``sinks`` [num_heads], sharded with the query heads);
    ``softcap``: scores ``tanh(s / softcap) * softcap`` (Gemma 2)."""

    causal: bool = True
    sliding_window: int | None = None
    chunk_size: int | None = None
    sinks: bool = False
    softcap: float | None = None


@dataclass(frozen=True)
class KVSharing:
    """A route of K/V between layers, keyed by ``key``: ``role`` "store": the layer gives its K/V
    with its output (``forward`` returns ``(output, kv_all)``) to later layers; "reuse": it
    projects no K/V and attends with those last stored under ``key`` (``forward(...,
    shared_kv=kv_all)``), whose gradient goes back to the storing layer. The schedules only take
    K/V as an input or give them as an output (:attr:`AttentionParts.takes_kv`, ``gives_kv``);
    the model links the layers by key. A sharing scheme (Gemma 4's ``num_kv_shared_layers``,
    cross-layer attention) is a policy that gives its layers these routes."""

    role: str
    key: Any = None

    @property
    def reuses(self) -> bool:
        return self.role == "reuse"

    @property
    def stores(self) -> bool:
        return self.role == "store"


@dataclass(frozen=True)
class AttentionParts:
    """The parts of one attention layer; every field's default is "off". ``values``: the
    values' slot (:class:`Values`; :class:`ValueNorm`: Gemma 4). ``scale``: the softmax
    scale (None: head_dim ** -0.5); ``query_scale(positions, dtype)``: each query multiplied by a
    factor of its global position in the row (Llama 4's attention temperature tuning on its NoPE
    layers), after RoPE and the q/k norm; ``output_gate``: ``q_proj`` has 2 * head_dim rows per
    head, [query | gate], and each head's output is multiplied by sigmoid(gate) before
    ``o_proj`` (Qwen3.5, Qwen3-Next); ``values_from_keys``: no ``v_proj``, the values are the key
    projection's output before the key norm and RoPE (Gemma 4's ``attention_k_eq_v``)."""

    qk_norm: QKNorm | None = None
    values: Values = field(default_factory=Values)
    rotary: Rotary = field(default_factory=Rotary)
    mask: Mask = field(default_factory=Mask)
    scale: float | None = None
    query_scale: Callable[[torch.Tensor, torch.dtype], torch.Tensor] | None = None
    output_gate: bool = False
    kv_sharing: KVSharing | None = None
    values_from_keys: bool = False

    @property
    def over_token(self) -> bool:
        """Whether the q/k norms span every head of a token: the phased schedule."""
        return self.qk_norm is not None and self.qk_norm.over_token

    @property
    def takes_kv(self) -> bool:
        """Whether the layer attends with K/V given to it (``shared_kv``) and projects none."""
        return self.kv_sharing is not None and self.kv_sharing.reuses

    @property
    def gives_kv(self) -> bool:
        """Whether the layer also returns its K/V for the layers that reuse them."""
        return self.kv_sharing is not None and self.kv_sharing.stores

    def check(self, shape: AttentionShape, tsp_size: int) -> AttentionShape:
        """``shape`` resolved (:meth:`AttentionShape.resolved`) once its heads split over
        ``tsp_size`` ranks (:func:`check_attention_shape`) and these parts are a combination a
        schedule implements; else a ValueError that names what to change. The one place that
        refuses an attention layer."""
        shape = shape.resolved()
        check_attention_shape(tsp_size, shape.hidden_size, shape.num_heads, shape.num_kv_heads,
                              shape.head_dim)
        self._check_combination()
        return shape

    def _check_combination(self) -> None:
        mask, norm = self.mask, self.qk_norm
        if mask.chunk_size is not None and (not mask.causal or mask.chunk_size < 1):
            raise ValueError(f"attention_chunk_size ({mask.chunk_size}) needs causal "
                             f"attention (causal={mask.causal}) and a chunk of at least 1 token")
        if self.rotary.kind not in ROTARY_KINDS:
            raise ValueError(f"unknown rotary kind {self.rotary.kind!r}; one of {ROTARY_KINDS}")
        if self.kv_sharing is not None and self.kv_sharing.role not in KV_ROLES:
            raise ValueError(f"unknown KV-sharing role {self.kv_sharing.role!r}; one of "
                             f"{KV_ROLES}")
        if norm is None:
            return None
        if norm.scope not in QK_NORM_SCOPES:
            raise ValueError(f"unknown q/k norm scope {norm.scope!r}; one of {QK_NORM_SCOPES}")
        if norm.after_rope and norm.over_token:
            raise ValueError("qk_norm_after_rope is implemented for per-head q/k norms only, not "
                             "with qk_norm_all_heads")
        if norm.kind not in NORMS:
            raise ValueError(f"unknown q/k norm kind {norm.kind!r}; one of {sorted(NORMS)}")
        if norm.weightless and norm.over_token:
            raise ValueError(f"the {norm.kind!r} q/k norm (no weight) is per head; "
                             f"qk_norm_all_heads is not implemented for it")
        if self.output_gate and norm.over_token:
            raise ValueError("output_gate (a per-head output gate) is implemented on the default "
                             "schedule only, not with qk_norm_all_heads")
        if self.kv_sharing is not None and norm.over_token:
            raise ValueError("KV-shared layers (KVSharing) are implemented on the default "
                             "schedule only, not with qk_norm_all_heads")


def check_attention_shape(tsp_size: int, hidden_size: int, num_heads: int, num_kv_heads: int,
                          head_dim: int, valid: Sequence[int] | None = None) -> None:
    """Raise, naming the numbers and the sizes that would work, when the heads cannot be split
    over ``tsp_size`` ranks. ``valid``: the whole model's valid sizes (``parallelize`` passes
    them), else those of these heads."""
    if num_kv_heads < 1 or num_heads % num_kv_heads:
        if num_heads % tsp_size:
            raise ValueError(f"tsp_size ({tsp_size}) must divide num_attention_heads "
                             f"({num_heads})")
        raise ValueError(f"num_key_value_heads ({num_kv_heads}) must divide "
                         f"num_attention_heads ({num_heads})")
    if valid is None:
        valid = valid_tsp_sizes(num_heads, num_kv_heads)
        what = f"{num_heads} query and {num_kv_heads} key/value heads"
    else:
        what = "this model"
    hint = valid_sizes_hint(valid, what)
    if num_heads % tsp_size:
        raise ValueError(f"tsp_size ({tsp_size}) must divide num_attention_heads ({num_heads}); "
                         f"{hint}")
    if num_kv_heads % tsp_size and tsp_size % num_kv_heads:
        raise ValueError(f"num_key_value_heads ({num_kv_heads}) and tsp_size ({tsp_size}): one "
                         f"must divide the other, so that each rank's query heads share whole "
                         f"key/value heads; {hint}")
    if hidden_size < 1 or head_dim < 1:
        raise ValueError(f"hidden_size ({hidden_size}) and head_dim ({head_dim}) must be positive")
