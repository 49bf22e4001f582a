"""Turn a Hugging Face decoder-only causal LM into a TSP model, in place.

Attention and MLP become :class:`TSPAttention` / :class:`TSPGatedMLP` holding this rank's slice of
the model's own weights, the embedding and LM head are vocabulary-sharded, norms are replicated;
every parameter is a DTensor with its Hugging Face name and (full) shape. The model's forward then
takes the output of :func:`tsp_core.shard_batch` and returns a ``CausalLMOutputWithPast`` whose
loss is the global mean, identical on every rank.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

from ..distributed import comm
from ..distributed.data_parallel import install_gradient_sync
from ..distributed.fsdp import apply_fsdp
from ..distributed.mesh import TSPMesh, get_mesh
from ..distributed.params import ShardedModule
from ..inference.generation import hf_generate
from ..inference.logits import token_index
from ..layers import rope
from ..layers.attention import TSPAttention, check_attention_shape
from ..layers.attention.module import real_rotary
from ..layers.mlp import ACTIVATIONS as GATED_ACTIVATIONS
from ..layers.mlp import PLAIN_ACTIVATIONS, TSPGatedMLP, TSPPlainMLP
from ..layers.moe import (
    SCHEDULES,
    MoESpec,
    TSPMoE,
    TSPRouter,
    check_moe_shape,
    choose_schedule,
    load_balancing_loss,
)
from ..layers.norm import TSPRMSNorm
from ..layers.replicated import TSPReplicatedLinear
from ..layers.sizes import valid_sizes_hint, valid_tsp_sizes
from ..layers.tiles import check_tile_tokens
from ..layers.vocab import TSPEmbedding, TSPLMHead
from ..sequence.layout import IGNORE_INDEX, document_lengths, shard_batch
from ..state.checkpoint import save_pretrained
from .delta_net import check_delta_nets, tsp_delta_net
from .input_checks import check_model_inputs
from .offload import install_activation_offload
from .policies import DecoderPolicy, find_policy
from .replicas import check_replicas_agree

ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh",
               "gelu_tanh": "gelu_tanh", "xielu": "xielu"}
ATTN_IMPLEMENTATION = "tsp"


class HFTSPAttention(TSPAttention):
    """:class:`TSPAttention` with the call signature of a Hugging Face attention module."""

    rotary: bool = True  # False: a NoPE layer (DecoderPolicy.rotary)
    # KV sharing (DecoderPolicy.kv_sharing): "store" or "reuse" under kv_key; kv_source: the index
    # of the layer whose K/V a "reuse" layer attends with (its decode cache)
    kv_role: str | None = None
    kv_key: Any = None
    kv_source: int | None = None
    rope_half_width: bool = False  # the model's cos/sin hold each frequency once (gpt-oss)

    def forward(self, hidden_states: torch.Tensor, position_embeddings=None, attention_mask=None,
                cache=None, **kwargs: Any):
        position_embeddings = real_rotary(position_embeddings)  # Llama 4's complex freqs_cis
        if cache is not None:
            raise NotImplementedError("TSP attention's forward takes no KV cache; generate with "
                                      "model.generate(...) or tsp_core.generate "
                                      "(tsp_core.inference.decode keeps its own "
                                      "sequence-sharded cache)")
        if self.rope_half_width and position_embeddings is not None:
            # Hugging Face's usual cos/sin repeat the frequencies (cat(freqs, freqs)); gpt-oss's
            # rotate halves with one copy: the same rotation once widened
            position_embeddings = tuple(torch.cat((t, t), dim=-1) for t in position_embeddings)
        if not self.rotary and position_embeddings is not None:
            # rope.apply rotates the first cos.shape[-1] channels: none, exactly the identity
            position_embeddings = tuple(t[..., :0] for t in position_embeddings)
        state = self.tsp_decode  # tsp_core.inference.decode: a decode step, or prefill's K/V sink
        if state is not None and state.decoding:
            return state.attention(self, hidden_states, position_embeddings), None
        shared = self._shared_kv(kwargs.get("shared_kv_states"))
        out = super().forward(hidden_states, position_embeddings=position_embeddings,
                              docs=kwargs.get("tsp_docs"),
                              kv_sink=None if state is None else state.sink, shared_kv=shared)
        if self.kv_role == "store":
            out, kv_all = out
            kwargs["shared_kv_states"][self.kv_key] = (kv_all,)
        return out, None

    def _shared_kv(self, states: Any) -> torch.Tensor | None:
        """The K/V this "reuse" layer attends with: what the layer that stores them put in the
        model's ``shared_kv_states`` in this forward (None for other layers)."""
        if self.kv_role is None:
            return None
        if states is None:
            raise ValueError(f"a KV-shared layer ({self.kv_role!r}) needs the model's "
                             f"shared_kv_states, which its forward passes every attention")
        if self.kv_role != "reuse":
            return None
        (kv_all,) = states[self.kv_key]
        if (torch.is_grad_enabled() and not kv_all.requires_grad
                and any(p.requires_grad for p in self.parameters())):
            raise RuntimeError("a KV-shared layer got K/V without their gradient path: reentrant "
                               "activation checkpointing recomputes the storing layer after this "
                               "one; use gradient_checkpointing_enable(gradient_checkpointing_"
                               "kwargs={'use_reentrant': False})")
        return kv_all


class TSPCausalLM:
    """Mixed in before the model's own class by :func:`parallelize`: the forward of a TSP
    causal LM (vocabulary-parallel loss, global mean over the whole mesh)."""

    _tsp_mesh: TSPMesh
    _tsp_policy: DecoderPolicy
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
        different batches raise."""
        from transformers.modeling_outputs import CausalLMOutputWithPast

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
        policy, mesh = self._tsp_policy, self._tsp_mesh
        if tsp_docs is not None:  # one host transfer per step, not per layer
            kwargs["tsp_docs"] = tuple(tuple(n for n in row if n) for row in tsp_docs.tolist())
        self._tsp_forward_calls = getattr(self, "_tsp_forward_calls", 0) + 1
        ropes = getattr(self, "_tsp_ropes", [])
        rope_len = (int(torch.as_tensor(tsp_rope_len).max())
                    if ropes and tsp_rope_len is not None else None)
        # bad input raises on every rank of the group, before any schedule collective
        check_model_inputs(self, input_ids, inputs_embeds, position_ids, shift_labels,
                           kwargs.get("tsp_docs"), tsp_rope_len, tsp_fingerprint)
        router = kwargs.pop("output_router_logits", None)
        fused = kwargs.pop("fused_lm_head", False)
        full_docs = kwargs.pop("tsp_full_docs", None)
        if fused and shift_labels is None:
            raise ValueError("fused_lm_head=True scores the labels: pass labels (TRL's trainers "
                             "do) so that the model shards them into shift_labels")
        with rope.global_length(ropes, rope_len):
            out = getattr(self, policy.base_model)(input_ids=input_ids, position_ids=position_ids,
                                                   inputs_embeds=inputs_embeds, use_cache=False,
                                                   **kwargs)
        aux = self._tsp_aux_loss(router, attention_mask)
        head: TSPLMHead = getattr(self, policy.lm_head)
        hidden = head.scale_input(out.last_hidden_state)
        if shift_labels is None:
            if aux is not None:
                from transformers.modeling_outputs import MoeCausalLMOutputWithPast

                return MoeCausalLMOutputWithPast(logits=head(hidden), aux_loss=aux)
            return CausalLMOutputWithPast(logits=head(hidden))
        self._tsp_loss_calls = getattr(self, "_tsp_loss_calls", 0) + 1  # TSPTrainer's guard
        if fused:
            return self._tsp_fused_output(head, hidden, shift_labels, num_items_in_batch, aux,
                                          None if full_docs is None else (tsp_docs, full_docs))
        loss_sum = head.loss_sum(hidden, shift_labels)
        if num_items_in_batch is None:
            count = (shift_labels != IGNORE_INDEX).sum().to(loss_sum.dtype)
            for group in mesh.all_groups:
                comm.all_reduce(count, group)
        else:
            count = torch.as_tensor(num_items_in_batch, dtype=loss_sum.dtype)
        loss = comm.sum_over(loss_sum, mesh.all_groups) / count
        if aux is not None:  # Hugging Face adds it when there are labels
            loss = loss + self.config.router_aux_loss_coef * aux
        scale = getattr(self, "_tsp_grad_scale", 1)
        if scale != 1:  # an engine that averages data-parallel gradients (DeepSpeed): same value,
            loss = loss * scale - loss.detach() * (scale - 1)  # gradient times the dp size
        if aux is not None:
            from transformers.modeling_outputs import MoeCausalLMOutputWithPast

            return MoeCausalLMOutputWithPast(loss=loss, aux_loss=aux)
        return CausalLMOutputWithPast(loss=loss)

    def _tsp_fused_output(self, head: TSPLMHead, hidden: torch.Tensor,
                          shift_labels: torch.Tensor,
                          num_items_in_batch: torch.Tensor | int | None,
                          aux: torch.Tensor | None, full: tuple | None = None):
        """What TRL's fused LM head (``trl.trainer.utils.add_fused_lm_head``) returns for
        ``fused_lm_head=True``, from the vocabulary-parallel head: per local token (shaped like
        ``shift_labels``) the label's log-probability, the entropy and the top-1 hit, zero where
        the label is -100. A trainer that sums them gets this rank's share: sum it over the TSP
        group (tsp_trl's trainers do). ``loss`` is already global: the sum over the whole mesh
        divided by ``num_items_in_batch`` (else the global count of labels), plus the weighted
        MoE auxiliary loss.

        With ``_tsp_fused_full`` set on the model (tsp_trl's DPO: its loss is not a sum over
        tokens), every per-token field is gathered instead into the full sequence in the original
        order, ``[batch, seq - 1]`` as TRL's own head returns it, the same on every rank of the
        group (``full``: shard_batch's ``tsp_docs`` and the rows' own document lengths); the
        log-probabilities' backward takes this rank's positions of the gradient (every rank
        computes the same loss from them)."""
        from .outputs import FusedLMOutput

        mesh = self._tsp_mesh
        log_probs, entropy, top1, mean_logits = head.token_stats(hidden, shift_labels)
        mask = shift_labels != IGNORE_INDEX
        if num_items_in_batch is None:
            count = mask.sum().to(log_probs.dtype)
            for group in mesh.all_groups:
                comm.all_reduce(count, group)
            count = count.clamp(min=1)
        else:
            count = torch.as_tensor(num_items_in_batch, dtype=log_probs.dtype)
        loss = comm.sum_over(-log_probs.sum(), mesh.all_groups) / count
        if aux is not None:
            loss = loss + self.config.router_aux_loss_coef * aux
        if full is not None:
            tsp_docs, docs = full
            index = token_index(tsp_docs, mesh.size, mesh.layout, docs)[:, :-1]
            log_probs = gather_tokens(log_probs, index, mesh.group)
            entropy, top1, mean_logits, mask = (
                gather_tokens(t, index, mesh.group) for t in (entropy, top1, mean_logits, mask))
        return FusedLMOutput(loss=loss, log_probs=log_probs, entropy=entropy,
                             mean_logits=mean_logits, is_top1=top1, label_mask=mask, aux_loss=aux)

    def _tsp_aux_loss(self, output_router_logits: bool | None,
                      attention_mask: torch.Tensor | None) -> torch.Tensor | None:
        """The MoE load-balancing loss of the forward that just ran, over the global batch
        (:func:`tsp_core.layers.moe.load_balancing_loss`), when ``output_router_logits`` (else the
        config's) asks for it, as Hugging Face computes it; None for a dense model. The layers'
        router logits are released either way."""
        layers = [m for m in self.modules() if isinstance(m, TSPMoE)]
        if not layers:
            return None
        wanted = (output_router_logits if output_router_logits is not None
                  else getattr(self.config, "output_router_logits", False))
        try:
            if not wanted or not self._tsp_policy.moe.aux_loss:  # GLM-4.5 has none
                return None
            if any(m.router_logits is None for m in layers):
                raise ValueError("an MoE layer has no router logits: it did not run forward")
            s = layers[0].spec
            return load_balancing_loss([m.router_logits for m in layers], s.num_experts,
                                       s.top_k, self._tsp_mesh.all_groups, attention_mask)
        finally:
            for m in layers:
                m.router_logits = None


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


class _GatherTokens(torch.autograd.Function):
    """Every rank's local per-token values ``[B, L]`` in ``index``'s order ``[B, S]`` (an
    all-gather), identical on every rank of the group; the backward keeps this rank's positions
    of the gradient, since every rank computes the same result from them."""

    @staticmethod
    def forward(ctx, x, index, group):
        d, (b, n) = group.size(), x.shape[:2]
        buf = x.new_empty((d, *x.shape))
        comm.all_gather(buf, x.contiguous(), group)
        ctx.index, ctx.shape, ctx.rank = index, (d, *x.shape), group.rank()
        return buf[index // n, torch.arange(b, device=x.device)[:, None], index % n]

    @staticmethod
    def backward(ctx, g):
        d, b, n = ctx.shape[:3]
        full = g.new_zeros(ctx.shape)
        full[ctx.index // n, torch.arange(b, device=g.device)[:, None], ctx.index % n] = g
        return full[ctx.rank], None, None


def gather_tokens(x: torch.Tensor, index: torch.Tensor, group) -> torch.Tensor:
    """:class:`_GatherTokens` (a bool tensor travels as uint8)."""
    if x.dtype == torch.bool:
        return _GatherTokens.apply(x.to(torch.uint8), index, group).bool()
    return _GatherTokens.apply(x, index, group)


_TSP_CLASSES: dict[type, type] = {}


def _tsp_class(cls: type) -> type:
    if cls not in _TSP_CLASSES:
        _TSP_CLASSES[cls] = type(f"TSP{cls.__name__}", (TSPCausalLM, cls),
                                 {"_tsp_base_class": cls})
    return _TSP_CLASSES[cls]


def unreplaced_attention_message(module: Any) -> str:
    """Why a Hugging Face attention module called the "tsp" implementation, and the fix. Only a
    model that ``parallelize`` did not convert does: ``parallelize`` replaces every attention
    module and sets ``config._attn_implementation = "tsp"`` on the model's config object, which
    every model built from that same object shares (transformers keeps it, it does not copy
    it), and on which a model built from ``tsp_model.config`` starts."""
    name = type(module).__name__
    return (f"{name} called the \"{ATTN_IMPLEMENTATION}\" attention implementation, which only "
            f"tsp_core.parallelize's attention modules (HFTSPAttention) run: this {name} belongs "
            f"to a model that was not parallelized, whose config says "
            f"attn_implementation=\"{ATTN_IMPLEMENTATION}\". That happens when a plain model is "
            f"built from the same config object as a model later given to tsp_core.parallelize "
            f"(parallelize sets config._attn_implementation = \"{ATTN_IMPLEMENTATION}\" on it) "
            f"or from a TSP model's config, or given attn_implementation=\""
            f"{ATTN_IMPLEMENTATION}\". Give the plain model a config of its own, e.g. "
            f"AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation="
            f"\"sdpa\"); to run this model with TSP, call tsp_core.parallelize(model, mesh)")


def _register_attention_implementation() -> None:
    """Register "tsp" with transformers so that the model builds no attention mask (the TSP
    modules compute the causal pattern themselves). A module that calls it was not replaced
    (:func:`unreplaced_attention_message`)."""
    from transformers import AttentionInterface

    def never_called(module: Any = None, *args: Any, **kwargs: Any):
        raise RuntimeError(unreplaced_attention_message(module))

    AttentionInterface.register(ATTN_IMPLEMENTATION, never_called)


def _check(model: nn.Module, mesh: TSPMesh, policy: DecoderPolicy, moe_schedule: str) -> None:
    """Every check that can fail, before anything is changed or communicated."""
    if isinstance(model, TSPCausalLM):
        raise ValueError("this model is already parallelized with TSP")
    c = model.config
    nq, nkv, head_dim = _config_shape(c)
    layers = getattr(getattr(model, policy.base_model, None), policy.layers, [])
    sparse = [policy.sparse_mlp(getattr(layer, policy.mlp)) for layer in layers]
    beside = any(policy.moe_beside_mlp(layer) for layer in layers)  # Gemma 4's MoE block
    spec = _moe_spec(c, policy, mesh) if any(sparse) or beside else None
    dense_size = getattr(c, policy.dense_intermediate_size)
    # what is cut into tsp_size slices: each dense MLP's width (Gemma 4's double-wide ones)
    widths = sorted({_mlp_width(getattr(layer, policy.mlp), c, policy)
                     for layer, s in zip(layers, sparse) if not s})
    divided = list(widths)
    if spec is not None:
        divided.append(spec.num_experts if moe_schedule == "expert" else spec.intermediate_size)
    # each layer's key/value heads and head_dim (Gemma 4's global layers: their own)
    shapes = sorted({_attention_shape(getattr(layer, policy.attention), nq, nkv, head_dim)
                     for layer in layers if _delta_net(layer, policy) is None}) or [(nkv, head_dim)]
    delta_nets = any(_delta_net(layer, policy) is not None for layer in layers)
    divided += [c.linear_num_key_heads] if delta_nets else []  # Qwen3.5's linear attention
    valid = sorted(set.intersection(*(set(valid_tsp_sizes(nq, k, *divided)) for k, _ in shapes)))
    hint = valid_sizes_hint(valid)
    for k, d in shapes:
        check_attention_shape(mesh.size, c.hidden_size, nq, k, d, valid)
    if delta_nets:
        check_delta_nets(c, mesh.size, valid)
    if spec is not None:
        check_moe_shape(mesh.size, spec.num_experts, spec.top_k, moe_schedule, valid)
        if moe_schedule == "ring" and spec.intermediate_size % mesh.size:
            raise ValueError(f"tsp_size ({mesh.size}) must divide the experts' intermediate size "
                             f"({spec.intermediate_size}) under the ring schedule; {hint}")
    for width in widths:
        if width % mesh.size:
            raise ValueError(f"tsp_size ({mesh.size}) must divide "
                             f"{policy.dense_intermediate_size} ({width}); {hint}")
    refused = [f"config.{name}={getattr(c, name)!r} ({what})" for name, what in policy.unsupported
               if getattr(c, name, None)]
    if refused:
        raise ValueError(f"{type(model).__name__}: {'; '.join(refused)} not implemented by TSP; "
                         f"set {'them' if len(refused) > 1 else 'it'} to None/False to run it "
                         f"without (a different model), or train it without TSP")
    for what, hook in (("attention", policy.attn_softcap), ("logits", policy.logits_softcap)):
        cap = _softcap(hook, c)
        if cap is not None and not cap > 0:
            raise ValueError(f"{type(model).__name__}: the {what} soft-cap ({cap}) must be "
                             f"positive, or None for no soft-capping")
    act = _activation(c)
    plain = any(_plain_mlp(getattr(layer, policy.mlp), policy) for layer in layers)
    kinds = PLAIN_ACTIVATIONS if plain else GATED_ACTIVATIONS
    if ACTIVATIONS.get(act) not in kinds:
        raise ValueError(f"hidden_act {act!r} is not supported by "
                         f"{'TSPPlainMLP' if plain else 'TSPGatedMLP'}; supported: "
                         f"{sorted(n for n, k in ACTIVATIONS.items() if k in kinds)}")
    if getattr(c, "attention_dropout", 0.0):
        raise ValueError(f"attention_dropout ({c.attention_dropout}) is not supported by TSP "
                         f"attention; set it to 0.0")
    params = list(model.parameters())
    if any(p.is_meta for p in params) and not all(p.is_meta for p in params):
        raise ValueError("some parameters are on the meta device and some are not; build the "
                         "model either fully materialised or with every parameter on meta")
    meta_buffers = [n for n, b in model.named_buffers() if b.is_meta]
    if meta_buffers:
        raise ValueError(f"buffers {meta_buffers[:3]} are on the meta device; build the model with "
                         f"parameters on meta but buffers materialised (e.g. accelerate's "
                         f"init_empty_weights(include_buffers=False)), as "
                         f"tsp_transformers.load_pretrained does")
    kept = _float32_kept(model, policy)
    dtypes = {p.dtype for n, p in model.named_parameters()  # what Hugging Face keeps float32
              if not (kept(n) and p.dtype == torch.float32)}
    if mesh.fsdp_size > 1 and len(dtypes | {p.dtype for p in params}) > 1:
        raise ValueError(f"the model keeps its routers or norms float32 (as from_pretrained "
                         f"loads them) and its other parameters {sorted(map(str, dtypes))}: "
                         f"FSDP2 (fsdp_size {mesh.fsdp_size}) needs one dtype per decoder layer; "
                         f"cast the model to one dtype first")
    if len(dtypes) > 1:
        raise ValueError(f"the model mixes parameter dtypes {sorted(map(str, dtypes))}; cast it "
                         f"to one dtype first")
    base = getattr(model, policy.base_model)
    for name in (policy.embed, policy.layers, policy.final_norm):
        if not hasattr(base, name):
            raise ValueError(f"{type(model).__name__}.{policy.base_model} has no {name!r}; the "
                             f"policy {policy.name!r} does not describe this model")
    _check_head_norms(model, policy, nq, nkv, head_dim)
    _check_kv_sharing(model, policy, nq, nkv, head_dim)
    if policy.attention_module is None:  # a family's own attention checks its own rows
        _check_attention_rows(model, policy, nq, nkv, head_dim)
    _check_fused(model, policy, {"q_proj": nq * head_dim, "k_proj": nkv * head_dim,
                                 "v_proj": nkv * head_dim, "gate_proj": dense_size,
                                 "up_proj": dense_size})
    rope.length_dependent_rotaries(model)  # raises for one TSP cannot give the global length


def _float32_kept(model: nn.Module, policy: DecoderPolicy) -> Callable[[str], bool]:
    """Whether parameter ``name`` may stay float32 in a model of another dtype, as
    ``from_pretrained`` keeps it and the TSP module that replaces it keeps it too: the router
    (``ExpertsPolicy.router_float32``, GLM-4.5) and the RMSNorms among the model's
    ``_keep_in_fp32_modules`` (gpt-oss's in a float16 model; each TSPRMSNorm takes its weight's
    dtype)."""
    moe = policy.moe
    router = f"{policy.mlp}.{moe.router}.weight" if moe is not None and moe.router_float32 else None
    listed = {*(getattr(model, "_keep_in_fp32_modules", None) or ()),
              *(getattr(model, "_keep_in_fp32_modules_strict", None) or ())}
    norms = listed & {*policy.layer_norms, policy.final_norm}

    def kept(name: str) -> bool:
        parts = name.split(".")
        return (router is not None and name.endswith(router)) or (
            len(parts) >= 2 and parts[-2] in norms and parts[-1] == "weight")
    return kept


def _config_shape(config: Any) -> tuple[int, int, int]:
    """(query heads, key/value heads, head_dim) of the config; on a heterogeneous config (Gemma
    4's: head_dim and num_key_value_heads per layer, which transformers refuses to read globally)
    the model-wide values, each layer's own being read from its attention module
    (:func:`_attention_shape`)."""
    def read(name: str) -> Any:
        try:
            return getattr(config, name, None)
        except RuntimeError:  # transformers' AmbiguousGlobalPerLayerAttributeError
            return config._getattr_without_heterogeneous_validation(name)

    nq = config.num_attention_heads
    return nq, read("num_key_value_heads") or nq, read("head_dim") or config.hidden_size // nq


def _attention_shape(attn: nn.Module, nq: int, nkv: int, head_dim: int) -> tuple[int, int]:
    """A layer's (key/value heads, head_dim): the Hugging Face attention module's own where it
    has them (``num_key_value_groups``, ``head_dim``: Gemma 4's global layers have their own),
    else the config's ``nkv`` and ``head_dim``."""
    groups = getattr(attn, "num_key_value_groups", None)
    return (nq // groups if groups else nkv), (getattr(attn, "head_dim", None) or head_dim)


def _delta_net(layer: nn.Module, policy: DecoderPolicy) -> nn.Module | None:
    """A decoder layer's Gated DeltaNet (``DecoderPolicy.linear_attention``, Qwen3.5's linear
    attention), None for a layer with softmax attention."""
    return getattr(layer, policy.linear_attention, None) if policy.linear_attention else None


def _check_attention_rows(model: nn.Module, policy: DecoderPolicy, nq: int, nkv: int,
                          head_dim: int) -> None:
    """Each layer's unfused q/k projections have the rows of the shape read for it
    (:func:`_attention_shape`), so a module whose attributes say otherwise raises here."""
    for i, layer in enumerate(getattr(getattr(model, policy.base_model), policy.layers)):
        if _delta_net(layer, policy) is not None:  # no softmax attention
            continue
        attn = getattr(layer, policy.attention)
        k, d = _attention_shape(attn, nq, nkv, head_dim)
        q_rows = nq * d * (2 if policy.output_gate else 1)  # [query | gate] per head (Qwen3.5)
        for name, rows in (("q_proj", q_rows), ("k_proj", k * d)):
            linear = getattr(attn, name, None)
            if isinstance(linear, nn.Linear) and linear.out_features != rows:
                raise ValueError(f"layer {i}: {policy.attention}.{name} has "
                                 f"{linear.out_features} rows, but the layer's {nq} query and {k} "
                                 f"key/value heads of head_dim {d} make {rows}")


def _mlp_width(mlp: nn.Module, config: Any, policy: DecoderPolicy) -> int:
    """A dense MLP's intermediate size, from its up projection's rows (its share of a fused one):
    each layer's own (Gemma 4's double-wide MLPs on its KV-shared layers), else the config's."""
    for name, parts in policy.fused_in("mlp").items():
        if "up_proj" in parts and isinstance(getattr(mlp, name, None), nn.Linear):
            return getattr(mlp, name).out_features // len(parts)
    up = getattr(mlp, "up_proj", None)
    if isinstance(up, nn.Linear):
        return up.out_features
    return getattr(config, policy.dense_intermediate_size)


def _value_norm_eps(policy: DecoderPolicy, attn: nn.Module) -> float | None:
    """The epsilon of the attention's weightless value norm (``DecoderPolicy.value_norm``), None
    when the policy names none."""
    if policy.value_norm is None:
        return None
    norm = getattr(attn, policy.value_norm, None)
    if norm is None:
        raise ValueError(f"the policy {policy.name!r} names a value norm {policy.value_norm!r} "
                         f"that the attention ({type(attn).__name__}) does not have")
    return _eps(norm)


def _replicated(mesh: TSPMesh, old: nn.Module, policy: DecoderPolicy, opts: dict) -> nn.Module:
    """The TSP module, replicated over the group, of a small per-token Linear or RMSNorm that
    the policy names (``base_replicated``, ``layer_replicated``)."""
    if isinstance(old, nn.Linear):
        return TSPReplicatedLinear(mesh, old.in_features, old.out_features, old.bias is not None,
                                   init_seed=None, **opts)
    weight = getattr(old, "weight", None)
    if isinstance(weight, nn.Parameter) and weight.dim() == 1 and (
            hasattr(old, "eps") or hasattr(old, "variance_epsilon")):
        return TSPRMSNorm(mesh, weight.shape[0], _eps(old), policy.norm, **opts)
    raise ValueError(f"the policy {policy.name!r} replicates a {type(old).__name__}: only "
                     f"nn.Linear and RMSNorms (a 1-d weight and an eps) can be")


def _refuse_unconverted(model: nn.Module, policy: DecoderPolicy, planned: list) -> None:
    """Every parameter goes to a TSP module: one left in a Hugging Face module would be trained
    on this rank's tokens only (its gradient a part of the whole) and miss from every TSP state
    dict. Raised before the model changes, naming the parameters and the fix."""
    where = {id(m): n for n, m in model.named_modules()}
    done = tuple(f"{where[id(parent)]}.{name}.".lstrip(".") for parent, name, _, _ in planned)
    left = [n for n, _ in model.named_parameters() if not n.startswith(done)]
    if left:
        raise ValueError(f"policy {policy.name!r}: parameters {left[:4]}"
                         f"{f' and {len(left) - 4} more' if len(left) > 4 else ''} belong to "
                         f"no module that TSP converts, so they would be trained on each rank's "
                         f"tokens only; describe them in the policy (base_replicated, "
                         f"layer_replicated, extra_embeds) or refuse the config field that adds "
                         f"them")


def _linear(module: nn.Module, name: str, fused: dict[str, tuple[str, ...]]) -> nn.Module:
    """The Hugging Face Linear holding projection ``name``: itself, or the fused one it is part
    of (Phi-3's ``qkv_proj`` holds q_proj's rows)."""
    for fused_name, parts in fused.items():
        if name in parts:
            return getattr(module, fused_name)
    return getattr(module, name)


def _check_fused(model: nn.Module, policy: DecoderPolicy, rows: dict[str, int]) -> None:
    """Every fused projection the policy names exists with the rows of its parts."""
    base = getattr(model, policy.base_model)
    for role, name, parts in policy.fused:
        for i, layer in enumerate(getattr(base, policy.layers)):
            module = getattr(layer, getattr(policy, role))
            linear = getattr(module, name, None)
            want = sum(rows[p] for p in parts)
            got = None if linear is None else tuple(linear.weight.shape)
            if got is None or got[0] != want:
                raise ValueError(f"layer {i}: {getattr(policy, role)}.{name} has weight shape "
                                 f"{got}; the policy {policy.name!r} fuses {parts} there "
                                 f"({want} rows)")


def _check_moe_policy(model: nn.Module, policy: DecoderPolicy) -> None:
    """A mixture-of-experts model needs a policy that describes its experts (Mixtral and
    Qwen3-MoE have one): refused by the config field that makes a model one, so that a dense
    policy matched by class or model_type never runs it as a dense model."""
    c = getattr(model, "config", None)
    for name in ("num_local_experts", "num_experts"):  # Mixtral; Qwen2/3-MoE, OLMoE, ...
        if getattr(c, name, None) and policy.moe is None:
            raise ValueError(f"{type(model).__name__} is a mixture-of-experts model "
                             f"(config.{name}={getattr(c, name)}) and the policy {policy.name!r} "
                             f"describes no experts; TSP runs the MoE of Mixtral and Qwen3-MoE "
                             f"(docs/moe.md): train it without TSP, or describe its experts with "
                             f"DecoderPolicy(moe=ExpertsPolicy(...))")


def _moe_spec(c: Any, policy: DecoderPolicy, mesh: TSPMesh) -> MoESpec:
    """The shape and routing of the family's sparse MLPs, from the config."""
    return policy.moe.spec(c, mesh.size, ACTIVATIONS.get(_activation(c), "silu"))


def _plain_mlp(mlp: nn.Module, policy: DecoderPolicy) -> bool:
    """Whether a dense MLP is ungated, ``down(act(up(x)))`` (Apertus): it has no gate, plain or
    fused; :class:`TSPPlainMLP` replaces it."""
    return not (policy.sparse_mlp(mlp) or hasattr(mlp, "gate_proj") or policy.fused_in("mlp"))


def _activation(config: Any) -> str:
    """The MLP's activation name (Gemma 2/3 call the field hidden_activation)."""
    return getattr(config, "hidden_act", None) or getattr(config, "hidden_activation", None)


def _eps(norm: nn.Module) -> float:
    """An RMSNorm's epsilon (Llama's ``variance_epsilon``, Gemma's ``eps``)."""
    eps = getattr(norm, "variance_epsilon", None)
    return norm.eps if eps is None else eps


def _softcap(hook: Any, config: Any) -> float | None:
    """A policy's soft-cap of ``config`` (None: the family has none, or it is off)."""
    cap = None if hook is None else hook(config)
    return None if cap is None else float(cap)


def _head_norm_eps(policy: DecoderPolicy, attn: nn.Module, config: Any) -> float | None:
    """The epsilon of the attention's per-head q/k norms (None: the model has none)."""
    if policy.qk_norms(config) is None:
        return None
    return _eps(getattr(attn, policy.head_norms[0]))


def _check_kv_sharing(model: nn.Module, policy: DecoderPolicy, nq: int, nkv: int,
                      head_dim: int) -> None:
    """Each layer that reuses K/V (``DecoderPolicy.kv_sharing``) comes after a layer that stores
    them under its key, with the same key/value heads and head_dim."""
    stored: dict[Any, tuple[int, tuple[int, int]]] = {}
    for i, layer in enumerate(getattr(getattr(model, policy.base_model), policy.layers)):
        if _delta_net(layer, policy) is not None:  # no softmax attention
            continue
        attn = getattr(layer, policy.attention)
        sharing = policy.kv_sharing(model.config, attn)
        if sharing is None:
            continue
        role, key = sharing
        shape = _attention_shape(attn, nq, nkv, head_dim)
        if role == "store":
            stored[key] = (i, shape)
        elif key not in stored:
            raise ValueError(f"layer {i} reuses the K/V stored under {key!r}, which no earlier "
                             f"layer stores")
        elif stored[key][1] != shape:
            raise ValueError(f"layer {i} reuses layer {stored[key][0]}'s K/V ({key!r}) with "
                             f"(key/value heads, head_dim) {shape}, but they have "
                             f"{stored[key][1]}")


def _check_head_norms(model: nn.Module, policy: DecoderPolicy, nq: int, nkv: int,
                      head_dim: int) -> None:
    """The q/k norms are what the policy says: per head (weights of the layer's head_dim) or over
    all heads of a token (``qk_norm_all_heads``: nq*head_dim, nkv*head_dim), with the same eps."""
    if policy.qk_norms(model.config) is None:
        return
    for i, layer in enumerate(getattr(getattr(model, policy.base_model), policy.layers)):
        if _delta_net(layer, policy) is not None:  # no softmax attention
            continue
        attn = getattr(layer, policy.attention)
        k, d = _attention_shape(attn, nq, nkv, head_dim)
        q_width, k_width = (nq * d, k * d) if policy.qk_norm_all_heads else (d, d)
        sharing = policy.kv_sharing(model.config, attn)
        names = policy.head_norms
        if sharing is not None and sharing[0] == "reuse":  # no K/V, no k norm of its own
            names, k_width = names[:1], None
        norms = [getattr(attn, n, None) for n in names]
        if any(n is None for n in norms):
            raise ValueError(f"layer {i}: the policy {policy.name!r} names q/k norms "
                             f"{names} that the attention does not have")
        shapes = [tuple(n.weight.shape) for n in norms]
        if shapes != [(q_width,), (k_width,)][:len(norms)]:
            what = ("over all heads of a token" if policy.qk_norm_all_heads else "per head")
            raise ValueError(f"layer {i}: q/k norm weights of shapes {shapes}, but the policy "
                             f"{policy.name!r} describes norms {what}: [({q_width},), "
                             f"({k_width},)]; set DecoderPolicy.qk_norm_all_heads to match")
        if len(norms) == 2 and _eps(norms[0]) != _eps(norms[1]):
            raise ValueError(f"layer {i}: q_norm eps ({_eps(norms[0])}) and k_norm eps "
                             f"({_eps(norms[1])}) differ")


def parallelize(model: nn.Module, mesh: TSPMesh, *, policy: DecoderPolicy | None = None,
                moe_schedule: str = "auto", moe_tokens_per_rank: int | None = None,
                mp_policy: Any = None, reshard_after_forward: bool = True,
                tile_tokens: int | None = None, activation_offload: bool = False) -> nn.Module:
    """Convert ``model`` in place to TSP on ``mesh`` and return it. A model whose parameters are
    all on the meta device gets uninitialised shards (fill them with load_full_state_dict).

    When the mesh shards data parallel too (``init_mesh(..., dp_shard=N)``, N > 1), FSDP2's
    ``fully_shard`` then splits each rank's TSP shards over "dp_shard", per decoder layer and the
    root (:mod:`tsp_core.distributed.fsdp`): ``mp_policy`` is its ``MixedPrecisionPolicy`` (e.g.
    bf16 parameters, float32 gradient reduction) and ``reshard_after_forward`` its option of that
    name. Build the optimizer after this call.

    With data parallelism every replica must hold the same weights (build the model from the
    same seed on every rank, or load it): checked with one small all-gather before the model
    changes (:mod:`tsp_core.models.replicas`), since DDP's broadcast of rank 0's weights does not
    happen here.

    Mixture-of-experts layers (:mod:`tsp_core.layers.moe`) run ``moe_schedule`` "expert" (whole
    experts per rank, routed tokens move) or "ring" (every expert's channels split, weights move);
    "auto" picks per layer the one that moves fewer bytes for ``moe_tokens_per_rank`` (batch x
    sequence / tsp_size of the run), "expert" when that is not given.

    Long context (docs/long-context.md): the MLP, the experts and the loss run over a rank's
    tokens ``tile_tokens`` at a time (None: chosen from the model's sizes so that a tile's working
    set stays under :data:`tsp_core.layers.tiles.TILE_BYTES`); ``activation_offload`` keeps each
    checkpointed decoder layer's saved input in host memory between its forward and its backward
    (:mod:`tsp_core.models.offload`; needs activation checkpointing:
    ``model.gradient_checkpointing_enable()``)."""
    if mesh.pp_dim is not None:  # pipeline parallel: one TSP model per stage
        raise ValueError(f"the mesh has a pipeline dim {mesh.pp_dim!r} of size {mesh.pp_size}; "
                         f"cut the model into stages with tsp_core.pipeline(model, mesh, "
                         f"microbatches=M) instead of parallelize")
    if mp_policy is not None and mesh.fsdp_size == 1:
        raise ValueError("mp_policy is FSDP2's and needs a mesh that shards data parallel "
                         f"(dp_shard > 1; this mesh's is {mesh.fsdp_size}); without FSDP2 train "
                         "in mixed precision with autocast (Lightning's bf16-mixed)")
    check_tile_tokens(tile_tokens)
    if moe_schedule not in ("auto", *SCHEDULES):
        raise ValueError(f"moe_schedule {moe_schedule!r} is not one of "
                         f"{('auto', *SCHEDULES)}")
    policy = policy or find_policy(model)
    _check_moe_policy(model, policy)
    if policy.moe is not None and moe_schedule == "auto" and getattr(
            model.config, policy.moe.num_experts, None):  # not a dense Gemma 4 (moe_beside_mlp)
        moe_schedule = choose_schedule(_moe_spec(model.config, policy, mesh), moe_tokens_per_rank)
    _check(model, mesh, policy, moe_schedule)
    c = model.config
    p0 = next(model.parameters())
    empty = p0.is_meta  # weights come later, from load_full_state_dict
    if not empty:
        device = p0.device
    elif mesh.device_type == "cuda":
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        device = torch.device("cpu")
    opts = dict(dtype=p0.dtype, device=device)
    nq, nkv, head_dim = _config_shape(c)

    # (parent, name, TSP module, the replaced module's state): applied once every one is checked
    planned: list[tuple[nn.Module, str, nn.Module, dict[str, torch.Tensor] | None]] = []

    def replace(parent: nn.Module, name: str, new: nn.Module, old: nn.Module | None = None) -> None:
        role = ("attention" if isinstance(new, TSPAttention) else
                "mlp" if isinstance(new, TSPGatedMLP) else None)
        if role is not None and policy.fused_in(role):  # Hugging Face's fused projections
            new.fuse(policy.fused_in(role))
        state = None
        if not empty:
            state = (old or getattr(parent, name)).state_dict()
            _refuse_left_out(policy, f"{parent.__class__.__name__}.{name}", state, new)
        planned.append((parent, name, new, state))

    base = getattr(model, policy.base_model)
    old_embed = getattr(base, policy.embed)
    old_head = getattr(model, policy.lm_head)
    tied = old_head.weight is old_embed.weight
    embed = TSPEmbedding(mesh, c.vocab_size, c.hidden_size, old_embed.padding_idx,
                         init_seed=None, **opts)
    if getattr(old_embed, "embed_scale", None) is not None:  # HF's scaled word embedding (Gemma)
        embed.scale_by(old_embed.embed_scale)
    replace(base, policy.embed, embed)
    for name in policy.extra_embeds:  # Gemma 4's per-layer inputs, where the model has them
        old = getattr(base, name, None)
        if old is not None:
            extra = TSPEmbedding(mesh, old.num_embeddings, old.embedding_dim, old.padding_idx,
                                 init_seed=None, **opts)
            if getattr(old, "embed_scale", None) is not None:
                extra.scale_by(old.embed_scale)
            replace(base, name, extra)

    def replicate(parent: nn.Module, names: tuple[str, ...]) -> None:
        for name in names:
            if getattr(parent, name, None) is not None:
                replace(parent, name, _replicated(mesh, getattr(parent, name), policy, opts))

    replicate(base, policy.base_replicated)
    stores: dict[Any, int] = {}  # KV sharing: key -> the index of the layer that stores it
    built: list[HFTSPAttention] = []
    for layer in getattr(base, policy.layers):
        linear = _delta_net(layer, policy)
        if linear is not None:  # Qwen3.5's Gated DeltaNet: no softmax attention in this layer
            replace(layer, policy.linear_attention, tsp_delta_net(mesh, c, linear, opts))
        else:
            attn = getattr(layer, policy.attention)
            l2_eps = policy.l2_qk_norm(c, attn)  # a weightless L2 q/k norm (Llama 4)
            layer_nkv, layer_head_dim = _attention_shape(attn, nq, nkv, head_dim)
            sharing = policy.kv_sharing(c, attn)
            reuse = sharing is not None and sharing[0] == "reuse"
            own = policy.attention_module  # the family's own schedule (DeepSeek-V3's latent one)
            new_attn = own(mesh, c, attn, opts) if own is not None else HFTSPAttention(
                mesh, c.hidden_size, nq, layer_nkv, layer_head_dim,
                qkv_bias=_linear(attn, "q_proj", policy.fused_in("attention")).bias is not None,
                o_bias=attn.o_proj.bias is not None, sliding_window=policy.sliding_window(c, attn),
                scale=attn.scaling,
                qk_norm_eps=_head_norm_eps(policy, attn, c) if l2_eps is None else l2_eps,
                qk_norm_kind=policy.norm if l2_eps is None else "l2",
                softcap=_softcap(policy.attn_softcap, c),
                qk_norm_all_heads=policy.qk_norm_all_heads,
                qk_norm_after_rope=policy.head_norms_after_rope,
                qk_norm_names=policy.head_norms or ("q_norm", "k_norm"),
                rope_interleaved=policy.rope_interleaved,
                attention_chunk_size=policy.attention_chunk(c, attn),
                sinks=isinstance(getattr(attn, "sinks", None), nn.Parameter),
                query_scale=policy.query_scale(c, attn),
                v_norm_eps=None if reuse else _value_norm_eps(policy, attn),
                values_from_keys=bool(policy.values_from_keys(c, attn)), kv_shared=reuse,
                kv_out=sharing is not None and sharing[0] == "store",
                output_gate=policy.output_gate, init_seed=None, **opts)
            if sharing is not None:
                new_attn.kv_role, new_attn.kv_key = sharing
                if reuse:  # the last layer before it that stores under its key
                    new_attn.kv_source = stores.get(new_attn.kv_key)
                else:
                    stores[new_attn.kv_key] = len(built)
            built.append(new_attn)
            new_attn.rotary = bool(policy.rotary(c, attn))
            new_attn.rope_half_width = policy.rope_half_width
            replace(layer, policy.attention, new_attn)
        mlp = getattr(layer, policy.mlp)
        if policy.sparse_mlp(mlp):
            spec = _moe_spec(c, policy, mesh)
            replace(layer, policy.mlp, TSPMoE(
                mesh, spec.hidden_size, spec.intermediate_size, spec.num_experts, spec.top_k,
                **spec.options(), schedule=moe_schedule, init_seed=None,
                router_dtype=getattr(mlp, policy.moe.router).weight.dtype,
                returns_pair=policy.moe.returns_pair, **opts))
        elif _plain_mlp(mlp, policy):
            replace(layer, policy.mlp, TSPPlainMLP(
                mesh, c.hidden_size, _mlp_width(mlp, c, policy),
                activation=ACTIVATIONS[_activation(c)],
                bias=mlp.up_proj.bias is not None, init_seed=None, **opts))
        else:
            replace(layer, policy.mlp, TSPGatedMLP(
                mesh, c.hidden_size, _mlp_width(mlp, c, policy),
                activation=ACTIVATIONS[_activation(c)],
                bias=_linear(mlp, "gate_proj", policy.fused_in("mlp")).bias is not None,
                init_seed=None, **opts))
        if policy.moe_beside_mlp(layer):  # Gemma 4: the layer calls its router and experts
            spec = _moe_spec(c, policy, mesh)
            replace(layer, policy.moe.router, TSPRouter(mesh, spec, init_seed=None, **opts))
            replace(layer, policy.moe.experts, TSPMoE(
                mesh, spec.hidden_size, spec.intermediate_size, spec.num_experts, spec.top_k,
                **spec.options(), schedule=moe_schedule, init_seed=None, **opts))
        for norm in policy.layer_norms:
            old = getattr(layer, norm)
            replace(layer, norm, TSPRMSNorm(mesh, c.hidden_size, _eps(old), policy.norm,
                                            **{**opts, "dtype": old.weight.dtype}))
        replicate(layer, policy.layer_replicated)
    old = getattr(base, policy.final_norm)
    replace(base, policy.final_norm,
            TSPRMSNorm(mesh, c.hidden_size, _eps(old), policy.norm,
                       **{**opts, "dtype": old.weight.dtype}))
    if tied:
        planned.append((model, policy.lm_head,
                        TSPLMHead(mesh, c.vocab_size, c.hidden_size, tied_to=embed), None))
    else:
        replace(model, policy.lm_head, TSPLMHead(mesh, c.vocab_size, c.hidden_size,
                                                 init_seed=None, **opts), old_head)
    _refuse_unconverted(model, policy, planned)
    if not empty:  # before any change: every rank raises together
        where = {id(m): n for n, m in model.named_modules()}
        check_replicas_agree(mesh, [(f"{where[id(parent)]}.{name}.{k}".lstrip("."), t)
                                    for parent, name, _, state in planned
                                    for k, t in sorted((state or {}).items())])
    for parent, name, new, state in planned:  # every replacement checked: the model changes now
        if state is not None:
            new.load_full(state)
        setattr(parent, name, new)
    if policy.logits_divisor is not None:
        getattr(model, policy.lm_head).logits_divisor = float(policy.logits_divisor(c))
    getattr(model, policy.lm_head).logits_softcap = _softcap(policy.logits_softcap, c)

    model.__class__ = _tsp_class(type(model))
    model._tsp_mesh, model._tsp_policy = mesh, policy
    # rotaries whose frequencies depend on the length take the global one (tsp_rope_len)
    model._tsp_ropes = rope.length_dependent_rotaries(model)
    rope.use_global_length(model._tsp_ropes)
    _register_attention_implementation()
    model.set_attn_implementation(ATTN_IMPLEMENTATION)
    for module in model.modules():  # the MLPs, the experts and the loss
        if hasattr(module, "tile_tokens"):
            module.tile_tokens = tile_tokens
    if activation_offload:
        install_activation_offload(model, list(getattr(base, policy.layers)))
    if mesh.fsdp_size > 1:  # FSDP2 sums data-parallel gradients itself
        apply_fsdp(model, mesh, list(getattr(base, policy.layers)), mp_policy=mp_policy,
                   reshard_after_forward=reshard_after_forward)
    else:
        install_gradient_sync(model, mesh)
    return model


def _refuse_left_out(policy: DecoderPolicy, where: str, state: dict[str, torch.Tensor],
                     new: nn.Module) -> None:
    """Raise when the TSP module that replaces a Hugging Face module would not take all of its
    tensors (a policy that leaves out, say, the q/k norms would otherwise run another model,
    silently). Raised before the model changes: every replacement is checked first."""
    takes = (set(new.hf_shapes()) | {n for n, _ in new.named_buffers()}
             if isinstance(new, ShardedModule) else set(new.state_dict()))
    left_out = sorted(set(state) - takes)
    if left_out:
        raise ValueError(f"policy {policy.name!r}: {where} holds {left_out}, which its TSP "
                         f"replacement ({type(new).__name__}) does not take, so they would be "
                         f"dropped silently; describe them in the policy (e.g. head_norms for "
                         f"per-head q/k norms, layer_norms for norms the layer applies)")


def shard_full_batches(model: nn.Module) -> nn.Module:
    """Let ``model(**batch)`` take the full-sequence batch (``input_ids`` and optionally
    ``labels``, ``attention_mask``, ``position_ids``/``cu_seqlens`` of packed rows, as keywords)
    and shard it itself; batches from ``shard_batch`` (they carry ``tsp_docs``) pass unchanged.
    For loops the user does not write (Fabric, Accelerate, the Trainer), where no hook sees the
    batch first. Idempotent."""
    if getattr(model, "_tsp_shards_inputs", False):
        return model
    mesh = get_mesh(model)

    def hook(_module: nn.Module, args: tuple, kwargs: dict[str, Any]):
        if args or "input_ids" not in kwargs or "tsp_docs" in kwargs:
            return None  # not a keyword batch, or already sharded (every sharded batch has tsp_docs)
        batch = {k: kwargs.pop(k) for k in ("input_ids", "labels", "attention_mask",
                                            "position_ids", "cu_seqlens") if k in kwargs}
        padding_free = {k: kwargs.pop(k) for k in PADDING_FREE_KEYS if k in kwargs}
        if padding_free:
            check_padding_free(padding_free, batch)
        if kwargs.get("fused_lm_head") and getattr(_module, "_tsp_fused_full", False):
            ids = batch["input_ids"]  # the rows' documents, for the full-sequence fused fields
            kwargs["tsp_full_docs"] = document_lengths(batch, ids.shape[1], ids.shape[0])
        return args, {**kwargs, **shard_batch(batch, mesh)}

    model.register_forward_pre_hook(hook, with_kwargs=True)
    model._tsp_shards_inputs = True
    return model


# what TRL's padding-free collator adds beside the restarting position_ids (the flash-attention
# varlen form of the same documents); shard_batch takes the documents from position_ids
PADDING_FREE_KEYS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "seq_idx")


def check_padding_free(keys: dict[str, Any], batch: dict[str, Any]) -> None:
    """TRL's padding-free keys describe the documents that ``position_ids`` restarting at 0
    describe; shard_batch uses those, so the keys must agree with them (raised on every rank of
    the group alike: they hold the same batch)."""
    if "position_ids" not in batch:
        raise ValueError(f"padding-free keys {sorted(keys)} without position_ids: TSP takes the "
                         f"documents of a packed row from position_ids restarting at 0 (TRL's "
                         f"padding-free collator gives them) or from cu_seqlens")
    ids = batch["position_ids"]
    if ids.shape[0] != 1:
        raise ValueError(f"padding-free keys describe one packed row; position_ids has "
                         f"{ids.shape[0]} rows")
    starts = (ids[0] == 0).nonzero().flatten().tolist() + [ids.shape[1]]
    for name in ("cu_seq_lens_q", "cu_seq_lens_k"):
        if name in keys and [int(v) for v in keys[name]] != starts:
            raise ValueError(f"{name} {[int(v) for v in keys[name]]} does not match the "
                             f"documents of position_ids (they restart at {starts[:-1]}, row "
                             f"length {starts[-1]}); build both from the same documents")
