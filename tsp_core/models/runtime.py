"""The runtime of a converted model: :class:`TSPCausalLM`, mixed in before the model's own
class by :func:`tsp_core.parallelize` (stage 4, :mod:`.wrap`). Its forward runs the Hugging Face
base model on this rank's tokens and computes the loss with the vocabulary-parallel head: the
global mean over the whole mesh (:func:`loss_output`), TRL's fused-head fields
(:func:`fused_output`) and the MoE load-balancing loss over the global batch with the router
logits of this rank's tokens (:func:`moe_outputs`).
What the runtime knows about the model is its
:class:`~tsp_core.distributed.model_state.TSPModelState`."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..distributed import comm
from ..distributed.model_state import model_state
from ..inference.generation import hf_generate
from ..layers import rope
from ..layers.moe import kept_router_logits, load_balancing_loss, router_modules
from ..layers.vocab import TSPLMHead
from ..sequence.gather import gather_tokens, token_index
from ..sequence.layout import IGNORE_INDEX
from ..state.checkpoint import save_pretrained
from .input_checks import check_model_inputs

ATTN_IMPLEMENTATION = "tsp"


class TSPCausalLM:
    """Mixed in before the model's own class by :func:`tsp_core.parallelize`: the forward of a TSP
    causal LM (vocabulary-parallel loss, global mean over the whole mesh)."""

    tsp_step: int | None = None  # set by a training loop: input errors then name the step

    def _apply(self, fn, recurse=True):
        # the rotary frequencies stay float32 under .to(bfloat16) (tsp_core.layers.rope)
        return rope.keep_frequencies(self, lambda: super(TSPCausalLM, self)._apply(fn, recurse))

    def forward(self, input_ids: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None,
                shift_labels: torch.Tensor | None = None,
                attention_mask: torch.Tensor | None = None,
                labels: torch.Tensor | None = None, inputs_embeds: torch.Tensor | None = None,
                use_cache: bool | None = None, cache: Any = None,
                num_items_in_batch: torch.Tensor | int | None = None,
                tsp_docs: torch.Tensor | None = None,
                tsp_rope_len: torch.Tensor | int | None = None,
                tsp_fingerprint: torch.Tensor | None = None, **kwargs: Any):
        """Takes this rank's part of a batch from :func:`tsp_core.shard_batch`. With
        ``shift_labels`` the loss is the mean over every non-ignored token of the global batch
        (or the global sum divided by ``num_items_in_batch``); without, ``logits`` holds the
        local tokens' logits. ``attention_mask`` may only mark right padding, which causal
        attention already keeps away from real tokens (``shard_batch`` checks it). ``tsp_docs``
        (from ``shard_batch``) gives each row's document lengths, so that attention of packed
        rows stays inside each document; ``tsp_rope_len`` each row's longest document, whose
        maximum is the length the unmodified model's rotary embedding sees on the whole batch
        (required when its frequencies depend on the length: dynamic NTK, longrope);
        ``tsp_fingerprint`` a hash of each full row, compared over the group so that ranks fed
        different batches raise. ``output_router_logits`` (else the config's): the MoE aux loss
        and ``router_logits``, one ``[B * L, E]`` tensor per MoE layer of this rank's ``[B, L]``
        tokens (:func:`moe_outputs`; ``tsp_core.layers.moe.gather_router_logits`` gathers the
        whole sequence's)."""
        refuse_unsharded(labels, use_cache, cache, position_ids, kwargs)
        state = model_state(self)
        if tsp_docs is not None:  # one host transfer per step, not per layer
            kwargs["tsp_docs"] = tuple(tuple(n for n in row if n) for row in tsp_docs.tolist())
        state.forward_calls += 1
        rope_len = (int(torch.as_tensor(tsp_rope_len).max())
                    if state.ropes and tsp_rope_len is not None else None)
        # bad input raises on every rank of the group, before any schedule collective
        check_model_inputs(self, input_ids, inputs_embeds, position_ids, shift_labels,
                           kwargs.get("tsp_docs"), tsp_rope_len, tsp_fingerprint)
        router = kwargs.pop("output_router_logits", None)
        fused = kwargs.pop("fused_lm_head", False)
        full_docs = kwargs.pop("tsp_full_docs", None)
        if fused and shift_labels is None:
            raise ValueError("fused_lm_head=True scores the labels: pass labels (TRL's trainers "
                             "do) so that the model shards them into shift_labels")
        with rope.global_length(state.ropes, rope_len):
            out = getattr(self, state.policy.modules.base_model)(
                input_ids=input_ids, position_ids=position_ids, inputs_embeds=inputs_embeds,
                use_cache=False, **kwargs)
        aux, router_logits = moe_outputs(self, router, attention_mask)
        head: TSPLMHead = getattr(self, state.policy.modules.lm_head)
        hidden = head.scale_input(out.last_hidden_state)
        if shift_labels is None:
            return causal_lm_output(logits=head(hidden), aux_loss=aux,
                                    router_logits=router_logits)
        state.loss_calls += 1  # TSPTrainer's guard
        if fused:
            return fused_output(self, head, hidden, shift_labels, num_items_in_batch, aux,
                                None if full_docs is None else (tsp_docs, full_docs))
        return causal_lm_output(loss=loss_output(self, head, hidden, shift_labels,
                                                 num_items_in_batch, aux), aux_loss=aux,
                                router_logits=router_logits)

    def generate(self, inputs: torch.Tensor | None = None, generation_config: Any = None,
                 **kwargs: Any):
        """Hugging Face's ``generate`` on the TSP model: greedy or sampled decoding over the
        sequence-sharded KV cache (:func:`tsp_core.generate`), the same tokens on every rank.
        Arguments TSP does not implement (beams, logits processors, streamers, ...) raise a
        ``ValueError`` naming them."""
        return hf_generate(self, inputs, generation_config, **kwargs)

    def save_pretrained(self, save_directory: str, *args: Any, **kwargs: Any) -> None:
        """An ordinary Hugging Face checkpoint (full shapes); every rank must call it."""
        save_pretrained(self, save_directory)


def refuse_unsharded(labels: Any, use_cache: Any, cache: Any, position_ids: Any,
                     kwargs: dict[str, Any]) -> None:
    """A forward call that did not come through ``shard_batch`` (labels, no positions) or that
    asks for a KV cache, refused before any collective."""
    if labels is not None:
        raise ValueError("a TSP model takes shift_labels, shifted on the full sequence before "
                         "sharding: pass the batch through tsp_core.shard_batch")
    if use_cache or cache is not None or kwargs.get("past_key_values") is not None:
        raise NotImplementedError("a TSP model's forward takes no KV cache (use_cache, "
                                  "past_key_values); generate with model.generate(...) or "
                                  "tsp_core.generate, which keep a sequence-sharded cache")
    if position_ids is None:
        raise ValueError("a TSP model needs the global position_ids of the local tokens: "
                         "pass the batch through tsp_core.shard_batch")


def causal_lm_output(aux_loss: torch.Tensor | None = None,
                     router_logits: tuple[torch.Tensor, ...] | None = None, **fields: Any):
    """Hugging Face's output of a causal LM (its MoE variant when there is an aux loss or router
    logits)."""
    if aux_loss is not None or router_logits is not None:
        from transformers.modeling_outputs import MoeCausalLMOutputWithPast

        return MoeCausalLMOutputWithPast(aux_loss=aux_loss, router_logits=router_logits,
                                         **fields)
    from transformers.modeling_outputs import CausalLMOutputWithPast

    return CausalLMOutputWithPast(**fields)


def global_count(mask: torch.Tensor, dtype: torch.dtype, mesh: Any) -> torch.Tensor:
    """The number of scored tokens over the whole mesh (summed over every group)."""
    count = mask.sum().to(dtype)
    for group in mesh.all_groups:
        comm.all_reduce(count, group)
    return count


def loss_output(model: nn.Module, head: TSPLMHead, hidden: torch.Tensor,
                shift_labels: torch.Tensor, num_items_in_batch: torch.Tensor | int | None,
                aux: torch.Tensor | None) -> torch.Tensor:
    """The loss, identical on every rank: the global sum of token losses over the global count
    of labels (or ``num_items_in_batch``), plus the weighted MoE auxiliary loss. An engine that
    averages data-parallel gradients sets the state's ``grad_scale``: the value stays, the
    gradient is multiplied by it."""
    state = model_state(model)
    loss_sum = head.loss_sum(hidden, shift_labels)
    if num_items_in_batch is None:
        count = global_count(shift_labels != IGNORE_INDEX, loss_sum.dtype, state.mesh)
    else:
        count = torch.as_tensor(num_items_in_batch, dtype=loss_sum.dtype)
    loss = comm.sum_over(loss_sum, state.mesh.all_groups) / count
    if aux is not None:  # Hugging Face adds it when there are labels
        loss = loss + model.config.router_aux_loss_coef * aux
    scale = state.grad_scale
    if scale != 1:  # an engine that averages data-parallel gradients (DeepSpeed): same value,
        loss = loss * scale - loss.detach() * (scale - 1)  # gradient times the dp size
    return loss


def fused_output(model: nn.Module, head: TSPLMHead, hidden: torch.Tensor,
                 shift_labels: torch.Tensor, num_items_in_batch: torch.Tensor | int | None,
                 aux: torch.Tensor | None, full: tuple | None = None) -> Any:
    """What TRL's fused LM head (``trl.trainer.utils.add_fused_lm_head``) returns for
    ``fused_lm_head=True``, from the vocabulary-parallel head: per local token (shaped like
    ``shift_labels``) the label's log-probability, the entropy and the top-1 hit, zero where
    the label is -100. A trainer that sums them gets this rank's share: sum it over the TSP
    group (tsp_trl's trainers do). ``loss`` is already global: the sum over the whole mesh
    divided by ``num_items_in_batch`` (else the global count of labels), plus the weighted
    MoE auxiliary loss.

    With the state's ``fused_full`` set (tsp_trl's DPO: its loss is not a sum over tokens),
    every per-token field is gathered instead into the full sequence in the original order,
    ``[batch, seq - 1]`` as TRL's own head returns it, the same on every rank of the group
    (``full``: shard_batch's ``tsp_docs`` and the rows' own document lengths); the
    log-probabilities' backward takes this rank's positions of the gradient (every rank
    computes the same loss from them)."""
    from .outputs import FusedLMOutput  # transformers: the base install is torch alone

    mesh = model_state(model).mesh
    log_probs, entropy, top1, mean_logits = head.token_stats(hidden, shift_labels)
    mask = shift_labels != IGNORE_INDEX
    if num_items_in_batch is None:
        count = global_count(mask, log_probs.dtype, mesh).clamp(min=1)
    else:
        count = torch.as_tensor(num_items_in_batch, dtype=log_probs.dtype)
    loss = comm.sum_over(-log_probs.sum(), mesh.all_groups) / count
    if aux is not None:
        loss = loss + model.config.router_aux_loss_coef * aux
    if full is not None:
        tsp_docs, docs = full
        index = token_index(tsp_docs, mesh.size, mesh.layout, docs)[:, :-1]
        log_probs = gather_tokens(log_probs, index, mesh.group)
        entropy, top1, mean_logits, mask = (
            gather_tokens(t, index, mesh.group) for t in (entropy, top1, mean_logits, mask))
    return FusedLMOutput(loss=loss, log_probs=log_probs, entropy=entropy,
                         mean_logits=mean_logits, is_top1=top1, label_mask=mask, aux_loss=aux)


def moe_outputs(model: nn.Module, output_router_logits: bool | None,
                attention_mask: torch.Tensor | None
                ) -> tuple[torch.Tensor | None, tuple[torch.Tensor, ...] | None]:
    """(aux loss, router logits) of the forward that just ran, when ``output_router_logits``
    (else the config's) asks for them, as Hugging Face returns them; (None, None) otherwise and
    for a dense model. The aux loss is the MoE load-balancing loss over the global batch
    (:func:`tsp_core.layers.moe.load_balancing_loss`; None for a family without one, GLM-4.5,
    Llama 4, Gemma 4). The router logits are Hugging Face's ``router_logits`` of this rank's
    tokens, one ``[B * L, E]`` tensor per MoE layer (:mod:`tsp_core.layers.moe.logits`;
    ``gather_router_logits`` gathers the TSP group's). The layers' references to them are
    released either way (the output holds them when asked)."""
    layers = router_modules(model)
    if not layers:
        return None, None
    wanted = (output_router_logits if output_router_logits is not None
              else getattr(model.config, "output_router_logits", False))
    state = model_state(model)
    try:
        if not wanted:
            return None, None
        logits = kept_router_logits(layers)
        if not state.policy.ffn.moe.aux_loss:  # GLM-4.5 has none
            return None, logits
        s = layers[0].spec
        return load_balancing_loss(logits, s.num_experts, s.top_k, state.mesh.all_groups,
                                   attention_mask), logits
    finally:
        for m in layers:
            m.router_logits = None


_TSP_CLASSES: dict[type, type] = {}


def tsp_class(cls: type) -> type:
    """The class of a converted ``cls`` model: :class:`TSPCausalLM` before ``cls`` (one per
    class, so that converted models of one class share it)."""
    if cls not in _TSP_CLASSES:
        _TSP_CLASSES[cls] = type(f"TSP{cls.__name__}", (TSPCausalLM, cls), {})
    return _TSP_CLASSES[cls]


def unreplaced_attention_message(module: Any) -> str:
    """Why a Hugging Face attention module called the "tsp" implementation, and the fix. Only a
    model that ``parallelize`` did not convert does: ``parallelize`` replaces every attention
    module and sets ``attn_implementation="tsp"`` on the converted model's own copy of its config
    (:func:`.wrap.own_config`; the config object the model was built from is left as it was), so
    a plain model says "tsp" when built from ``tsp_model.config`` (transformers keeps the config
    object it is given, it does not copy it) or given ``attn_implementation="tsp"``."""
    name = type(module).__name__
    return (f"{name} called the \"{ATTN_IMPLEMENTATION}\" attention implementation, which only "
            f"tsp_core.parallelize's attention modules (HFTSPAttention) run: this {name} belongs "
            f"to a model that was not parallelized, whose config says "
            f"attn_implementation=\"{ATTN_IMPLEMENTATION}\". That happens when a plain model is "
            f"built from a TSP model's config (tsp_model.config says \"{ATTN_IMPLEMENTATION}\"; "
            f"the config a model had before tsp_core.parallelize is left as it was) or given "
            f"attn_implementation=\"{ATTN_IMPLEMENTATION}\". Give the plain model a config of its "
            f"own, e.g. AutoModelForCausalLM.from_config(copy.deepcopy(tsp_model.config), "
            f"attn_implementation=\"sdpa\"); to run this model with TSP, call "
            f"tsp_core.parallelize(model, mesh)")


def register_attention_implementation() -> None:
    """Register "tsp" with transformers so that the model builds no attention mask (the TSP
    modules compute the causal pattern themselves). A module that calls it was not replaced
    (:func:`unreplaced_attention_message`)."""
    from transformers import AttentionInterface

    def never_called(module: Any = None, *args: Any, **kwargs: Any):
        raise RuntimeError(unreplaced_attention_message(module))

    AttentionInterface.register(ATTN_IMPLEMENTATION, never_called)

