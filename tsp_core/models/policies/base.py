"""What a policy is and the registry of them: :class:`DecoderPolicy` (where a family keeps each
TSP role, in groups: :class:`~.modules.ModuleNames`, :class:`~.attention.AttentionPolicy`,
:class:`~.ffn.FeedForwardPolicy`, :class:`~.head.HeadPolicy`), :func:`register_policy`,
:func:`find_policy`."""


from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from .attention import AttentionPolicy
from .ffn import FeedForwardPolicy
from .head import HeadPolicy
from .modules import ModuleNames


@dataclass(frozen=True)
class DecoderPolicy:
    """One decoder-only family as TSP sees it, in small groups so that a family names only what
    differs from Llama (every default is the Llama layout shared by Mistral and Qwen2) and keeps
    its own hooks in its file: where each module is (``modules``:
    :class:`~.modules.ModuleNames`, Gemma 4's per-layer inputs and Phi-3's fused projections
    too), how its attention reads as parts (``attn``: :class:`~.attention.AttentionPolicy`, the
    sliding window, rotary, q/k norms, soft-cap of the scores, output gate and a family's own
    parts), its MLPs (``ffn``: :class:`~.ffn.FeedForwardPolicy`, the sparse blocks'
    :class:`~.ffn.ExpertsPolicy`), what is done to its logits (``head``:
    :class:`~.head.HeadPolicy`, a divisor and a soft-cap), the norms' numerics (``norm``), the
    config fields to refuse (``unsupported``) and when generation recomputes the KV cache
    (``recompute_cache_at``). Each layer's key/value heads, head_dim and MLP width are read from
    its Hugging Face modules. The rest of a family (embedding scale, sandwich norms, residual
    multipliers, per-layer rotary embeddings, the softmax scale) is the Hugging Face model's own
    code around the TSP modules, in training and in generation; the attention's ``scaling`` is
    read from the module, a scaled word embedding's ``embed_scale`` too."""

    name: str
    model_types: tuple[str, ...]
    class_names: tuple[str, ...] = ()
    modules: ModuleNames = field(default_factory=ModuleNames)  # where each module is
    ffn: FeedForwardPolicy = field(default_factory=FeedForwardPolicy)  # the MLPs, dense or sparse
    head: HeadPolicy = field(default_factory=HeadPolicy)  # what is done to the logits
    attn: AttentionPolicy = field(default_factory=AttentionPolicy)  # the attention's parts
    norm: str = "llama"                        # every RMSNorm's numerics (layers.norm.NORMS)
    # config fields TSP does not implement: (name, what it is); a truthy value is refused
    unsupported: tuple[tuple[str, str], ...] = ()
    # the config field of a dropout on each attention's and MLP's output (Seed-OSS's
    # residual_dropout): applied on this rank's own tokens by tsp_core.layers.dropout.RankDropout
    output_dropout: str | None = None
    # generation: Hugging Face's generate drops the KV cache and runs the whole sequence again
    # when it first reaches this many tokens + 1 (Phi-3: original_max_position_embeddings, where
    # longrope switches factors); tsp_core.generate does the same
    recompute_cache_at: Callable[[Any], int | None] | None = None


_POLICIES: dict[str, DecoderPolicy] = {}


def register_policy(policy: DecoderPolicy, replace: bool = False) -> DecoderPolicy:
    """Make ``policy`` available to :func:`tsp_core.parallelize` and :func:`find_policy`. A name
    is registered once: a second policy of the same name would silently change every model that
    finds it, so it is refused unless ``replace=True`` says that is meant."""
    if policy.name in _POLICIES and not replace:
        raise ValueError(
            f"a policy named {policy.name!r} is already registered; register_policy(policy, "
            f"replace=True) replaces it on purpose, or give the new policy another name")
    _POLICIES[policy.name] = policy
    return policy


def supported() -> list[str]:
    return sorted(_POLICIES)


def find_policy(model: nn.Module) -> DecoderPolicy:
    """The policy for ``model``: by class name (including base classes), then model_type."""
    names = {c.__name__ for c in type(model).__mro__}
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    for policy in _POLICIES.values():
        if names & set(policy.class_names) or model_type in policy.model_types:
            return policy
    raise ValueError(
        f"no TSP policy for {type(model).__name__} (model_type={model_type!r}); supported: "
        f"{supported()}. Describe its module names with tsp_core.models.DecoderPolicy(...) and "
        f"pass it as parallelize(model, mesh, policy=...) or register it with "
        f"tsp_core.models.register_policy(...)")
