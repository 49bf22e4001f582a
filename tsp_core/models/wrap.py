"""Stage 4 of :func:`tsp_core.parallelize`: change the model, once every replacement is built
and checked. :func:`apply_plan` checks that the data-parallel replicas agree and swaps the
modules in; :func:`wrap_model` makes it a TSP causal LM (:class:`.runtime.TSPCausalLM` and
its :class:`~tsp_core.distributed.model_state.TSPModelState`) with a config of its own
(:func:`own_config`), with the long-context options, and hands data-parallel gradients to FSDP2
or to the gradient sync."""

from __future__ import annotations

import copy
from typing import Any

from torch import nn

from ..distributed.data_parallel import install_gradient_sync
from ..distributed.fsdp import apply_fsdp
from ..distributed.model_state import TSPModelState, attach_model_state
from ..layers import rope
from .build import ModulePlan
from .checks import refuse_unconverted
from .offload import install_activation_offload
from .reading import softcap
from .replicas import check_replicas_agree
from .runtime import ATTN_IMPLEMENTATION, register_attention_implementation, tsp_class


def apply_plan(model: nn.Module, plan: ModulePlan) -> None:
    """Refuse parameters no replacement takes and replicas that differ (one small all-gather,
    on every rank alike), then load each TSP module's state and swap it in."""
    refuse_unconverted(model, plan.policy, plan.replacements)
    if not plan.empty:  # before any change: every rank raises together
        where = {id(m): n for n, m in model.named_modules()}
        check_replicas_agree(plan.mesh, [(f"{where[id(r.parent)]}.{r.name}.{k}".lstrip("."), t)
                                         for r in plan.replacements
                                         for k, t in sorted((r.state or {}).items())])
    for r in plan.replacements:  # every replacement checked: the model changes now
        if r.state is not None:
            r.new.load_full(r.state)
        r.new.train(r.parent.training)  # a model in eval() stays there (no dropout runs)
        setattr(r.parent, r.name, r.new)
    policy, c = plan.policy, plan.spec.config
    head = getattr(model, policy.modules.lm_head)
    if policy.head.logits_divisor is not None:
        head.logits_divisor = float(policy.head.logits_divisor(c))
    head.logits_softcap = softcap(policy.head.logits_softcap, c)


def own_config(model: nn.Module) -> None:
    """Give ``model`` a deep copy of its config, so that what the conversion sets on it
    (``attn_implementation="tsp"``) stays off the caller's config object, which transformers
    shares, uncopied, with every model built from it. Every module holding the config or one of
    its sub-configs (Hugging Face's attention, MLP and rotary modules keep ``self.config``) is
    given the copy's."""
    from transformers import PretrainedConfig

    memo: dict[int, Any] = {}  # id of each original object -> its copy
    copy.deepcopy(model.config, memo)
    for module in model.modules():
        for name, value in list(vars(module).items()):
            if isinstance(value, PretrainedConfig) and id(value) in memo:
                setattr(module, name, memo[id(value)])


def wrap_model(model: nn.Module, plan: ModulePlan, tile_tokens: int | None,
               activation_offload: bool, mp_policy: Any, reshard_after_forward: bool) -> None:
    """The converted model's class, state, config (a copy: :func:`own_config`) and attention
    implementation; tiles and activation offload (docs/long-context.md); FSDP2 or the
    data-parallel gradient sync."""
    mesh, policy = plan.mesh, plan.policy
    state = attach_model_state(model, TSPModelState(
        mesh, policy, type(model), tile_tokens=tile_tokens,
        activation_offload=activation_offload, fsdp=mesh.fsdp_size > 1))
    model.__class__ = tsp_class(type(model))
    # rotaries whose frequencies depend on the length take the global one (tsp_rope_len)
    state.ropes = rope.length_dependent_rotaries(model)
    rope.use_global_length(state.ropes)
    own_config(model)  # before it says "tsp": a plain model sharing the old one keeps its own
    register_attention_implementation()
    model.set_attn_implementation(ATTN_IMPLEMENTATION)
    for module in model.modules():  # the MLPs, the experts and the loss
        if hasattr(module, "tile_tokens"):
            module.tile_tokens = tile_tokens
    layers = list(getattr(getattr(model, policy.modules.base_model), policy.modules.layers))
    if activation_offload:
        state.offload = install_activation_offload(model, layers)
    if mesh.fsdp_size > 1:  # FSDP2 sums data-parallel gradients itself
        apply_fsdp(model, mesh, layers, mp_policy=mp_policy,
                   reshard_after_forward=reshard_after_forward)
    else:
        install_gradient_sync(model, mesh)
