"""Stage 2 of :func:`tsp_core.parallelize`: every check that can fail, before anything is
changed or communicated, so that every rank raises alike and the model stays as it was.

:func:`check_options` looks at the call's arguments, :func:`check_model` at the model read into
specs (:mod:`.reading`); :func:`refuse_left_out` and :func:`refuse_unconverted` at the planned
replacements (:mod:`.build`), still before the model changes."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ..distributed.mesh import TSPMesh
from ..distributed.model_state import find_model_state
from ..distributed.params import ShardedModule
from ..layers import rope
from ..layers.attention import check_attention_shape
from ..layers.mlp import ACTIVATIONS as GATED_ACTIVATIONS
from ..layers.mlp import PLAIN_ACTIVATIONS
from ..layers.moe import SCHEDULES, check_moe_shape
from ..layers.sizes import valid_sizes_hint, valid_tsp_sizes
from ..layers.tiles import check_tile_tokens
from .delta_net import check_delta_nets
from .policies import DecoderPolicy
from .reading import ACTIVATIONS, ModelSpec, activation, attention_parts, norm_eps, softcap


def check_options(mesh: TSPMesh, mp_policy: Any, tile_tokens: int | None,
                  moe_schedule: str) -> None:
    """The call's own arguments."""
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


def check_model(model: nn.Module, mesh: TSPMesh, policy: DecoderPolicy, spec: ModelSpec,
                moe_schedule: str) -> None:
    """Every check of the model itself, in the order a user meets them."""
    check_moe_policy(model, policy)
    if find_model_state(model) is not None:
        raise ValueError("this model is already parallelized with TSP")
    check_sizes(mesh, policy, spec, moe_schedule)
    check_config(model, policy, spec)
    check_parameters(model, mesh, policy)
    check_modules(model, policy)
    check_head_norms(model, policy, spec)
    check_kv_sharing(model, policy, spec)
    if policy.attn.module is None:  # a family's own attention checks its own rows
        check_attention_rows(policy, spec)
    dense = getattr(spec.config, policy.ffn.dense_intermediate_size)
    check_fused(model, policy, {"q_proj": spec.num_heads * spec.head_dim,
                                "k_proj": spec.kv_heads * spec.head_dim,
                                "v_proj": spec.kv_heads * spec.head_dim, "gate_proj": dense,
                                "up_proj": dense})
    rope.length_dependent_rotaries(model)  # raises for one TSP cannot give the global length


def check_sizes(mesh: TSPMesh, policy: DecoderPolicy, spec: ModelSpec,
                moe_schedule: str) -> None:
    """``tsp_size`` divides everything that is cut into its slices: every layer's heads, the
    dense MLPs' widths, the experts (or their width under the ring schedule), the Gated
    DeltaNets' heads; the error names the sizes that would work for the whole model."""
    c, nq = spec.config, spec.num_heads
    widths = sorted({s.mlp_width for s in spec.layers if s.mlp_kind != "moe"})
    divided = list(widths)
    if spec.moe is not None:
        divided.append(spec.moe.num_experts if moe_schedule == "expert"
                       else spec.moe.intermediate_size)
    shapes = sorted({(s.kv_heads, s.head_dim) for s in spec.layers if s.delta_net is None}
                    ) or [(spec.kv_heads, spec.head_dim)]
    delta_nets = any(s.delta_net is not None for s in spec.layers)
    divided += [c.linear_num_key_heads] if delta_nets else []  # Qwen3.5's linear attention
    valid = sorted(set.intersection(*(set(valid_tsp_sizes(nq, k, *divided)) for k, _ in shapes)))
    hint = valid_sizes_hint(valid)
    for k, d in shapes:
        check_attention_shape(mesh.size, c.hidden_size, nq, k, d, valid)
    if delta_nets:
        check_delta_nets(c, mesh.size, valid)
    if spec.moe is not None:
        check_moe_shape(mesh.size, spec.moe.num_experts, spec.moe.top_k, moe_schedule, valid)
        if moe_schedule == "ring" and spec.moe.intermediate_size % mesh.size:
            raise ValueError(f"tsp_size ({mesh.size}) must divide the experts' intermediate size "
                             f"({spec.moe.intermediate_size}) under the ring schedule; {hint}")
    for width in widths:
        if width % mesh.size:
            raise ValueError(f"tsp_size ({mesh.size}) must divide "
                             f"{policy.ffn.dense_intermediate_size} ({width}); {hint}")


def check_config(model: nn.Module, policy: DecoderPolicy, spec: ModelSpec) -> None:
    """Config fields TSP does not implement, soft-caps, the activation, dropout."""
    c = model.config
    refused = [f"config.{name}={getattr(c, name)!r} ({what})" for name, what in policy.unsupported
               if getattr(c, name, None)]
    if refused:
        raise ValueError(f"{type(model).__name__}: {'; '.join(refused)} not implemented by TSP; "
                         f"set {'them' if len(refused) > 1 else 'it'} to None/False to run it "
                         f"without (a different model), or train it without TSP")
    caps = (("attention", policy.attn.softcap_of(c)),
            ("logits", softcap(policy.head.logits_softcap, c)))
    for what, cap in caps:
        if cap is not None and not cap > 0:
            raise ValueError(f"{type(model).__name__}: the {what} soft-cap ({cap}) must be "
                             f"positive, or None for no soft-capping")
    act = activation(c)
    plain = any(s.mlp_kind == "plain" for s in spec.layers)
    kinds = PLAIN_ACTIVATIONS if plain else GATED_ACTIVATIONS
    if ACTIVATIONS.get(act) not in kinds:
        raise ValueError(f"hidden_act {act!r} is not supported by "
                         f"{'TSPPlainMLP' if plain else 'TSPGatedMLP'}; supported: "
                         f"{sorted(n for n, k in ACTIVATIONS.items() if k in kinds)}")
    p = getattr(c, "attention_dropout", 0.0) or 0.0
    if not 0.0 <= p < 1.0:
        raise ValueError(f"attention_dropout ({p}) must be in [0, 1)")
    if p and policy.attn.module is not None:  # HFTSPAttention refuses it in training only
        raise ValueError(f"attention_dropout ({p}) is not supported by {policy.name}'s TSP "
                         f"attention; set it to 0.0")


def check_parameters(model: nn.Module, mesh: TSPMesh, policy: DecoderPolicy) -> None:
    """All parameters on meta or none, buffers materialised, one dtype (besides what Hugging Face
    keeps float32)."""
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
    kept = float32_kept(model, policy)
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


def check_modules(model: nn.Module, policy: DecoderPolicy) -> None:
    """The base model holds the modules the policy names."""
    names = policy.modules
    base = getattr(model, names.base_model)
    for name in (names.embed, names.layers, names.final_norm):
        if not hasattr(base, name):
            raise ValueError(f"{type(model).__name__}.{names.base_model} has no {name!r}; the "
                             f"policy {policy.name!r} does not describe this model")


def float32_kept(model: nn.Module, policy: DecoderPolicy) -> Callable[[str], bool]:
    """Whether parameter ``name`` may stay float32 in a model of another dtype, as
    ``from_pretrained`` keeps it and the TSP module that replaces it keeps it too: the router
    (``ExpertsPolicy.router_float32``, GLM-4.5) and the RMSNorms among the model's
    ``_keep_in_fp32_modules`` (gpt-oss's in a float16 model; each TSPRMSNorm takes its weight's
    dtype)."""
    moe, names = policy.ffn.moe, policy.modules
    router = f"{names.mlp}.{moe.router}.weight" if moe is not None and moe.router_float32 else None
    listed = {*(getattr(model, "_keep_in_fp32_modules", None) or ()),
              *(getattr(model, "_keep_in_fp32_modules_strict", None) or ())}
    norms = listed & {*names.layer_norms, names.final_norm}

    def kept(name: str) -> bool:
        parts = name.split(".")
        return (router is not None and name.endswith(router)) or (
            len(parts) >= 2 and parts[-2] in norms and parts[-1] == "weight")
    return kept


def check_attention_rows(policy: DecoderPolicy, spec: ModelSpec) -> None:
    """Each layer's unfused q/k projections have the rows of the shape read for it
    (:func:`.reading.attention_shape`), so a module whose attributes say otherwise raises
    here."""
    nq = spec.num_heads
    for s in spec.layers:
        if s.attention is None:  # no softmax attention
            continue
        k, d = s.kv_heads, s.head_dim
        q_rows = nq * d * (2 if policy.attn.output_gate else 1)  # [query | gate] per head
        for name, rows in (("q_proj", q_rows), ("k_proj", k * d)):
            linear = getattr(s.attention, name, None)
            if isinstance(linear, nn.Linear) and linear.out_features != rows:
                raise ValueError(f"layer {s.index}: {policy.modules.attention}.{name} has "
                                 f"{linear.out_features} rows, but the layer's {nq} query and {k} "
                                 f"key/value heads of head_dim {d} make {rows}")


def check_fused(model: nn.Module, policy: DecoderPolicy, rows: dict[str, int]) -> None:
    """Every fused projection the policy names exists with the rows of its parts."""
    names = policy.modules
    base = getattr(model, names.base_model)
    for role, name, parts in names.fused:
        for i, layer in enumerate(getattr(base, names.layers)):
            module = getattr(layer, getattr(names, role))
            linear = getattr(module, name, None)
            want = sum(rows[p] for p in parts)
            got = None if linear is None else tuple(linear.weight.shape)
            if got is None or got[0] != want:
                raise ValueError(f"layer {i}: {getattr(names, role)}.{name} has weight shape "
                                 f"{got}; the policy {policy.name!r} fuses {parts} there "
                                 f"({want} rows)")


def check_moe_policy(model: nn.Module, policy: DecoderPolicy) -> None:
    """A mixture-of-experts model needs a policy that describes its experts (Mixtral and
    Qwen3-MoE have one): refused by the config field that makes a model one, so that a dense
    policy matched by class or model_type never runs it as a dense model."""
    c = getattr(model, "config", None)
    for name in ("num_local_experts", "num_experts"):  # Mixtral; Qwen2/3-MoE, OLMoE, ...
        if getattr(c, name, None) and policy.ffn.moe is None:
            raise ValueError(f"{type(model).__name__} is a mixture-of-experts model "
                             f"(config.{name}={getattr(c, name)}) and the policy {policy.name!r} "
                             f"describes no experts; TSP runs the MoE of Mixtral and Qwen3-MoE "
                             f"(docs/moe.md): train it without TSP, or describe its experts with "
                             f"DecoderPolicy(ffn=FeedForwardPolicy(moe=ExpertsPolicy(...)))")


def check_kv_sharing(model: nn.Module, policy: DecoderPolicy, spec: ModelSpec) -> None:
    """Each layer that reuses K/V (its parts' ``KVSharing``) comes after a layer that stores
    them under its key, with the same key/value heads and head_dim."""
    stored: dict[Any, tuple[int, tuple[int, int]]] = {}
    for s in spec.layers:
        if s.attention is None:  # no softmax attention
            continue
        parts = attention_parts(s, model.config, policy)
        sharing = None if parts is None else parts.kv_sharing
        if sharing is None:
            continue
        role, key = sharing.role, sharing.key
        shape = (s.kv_heads, s.head_dim)
        if role == "store":
            stored[key] = (s.index, shape)
        elif key not in stored:
            raise ValueError(f"layer {s.index} reuses the K/V stored under {key!r}, which no "
                             f"earlier layer stores")
        elif stored[key][1] != shape:
            raise ValueError(f"layer {s.index} reuses layer {stored[key][0]}'s K/V ({key!r}) with "
                             f"(key/value heads, head_dim) {shape}, but they have "
                             f"{stored[key][1]}")


def check_head_norms(model: nn.Module, policy: DecoderPolicy, spec: ModelSpec) -> None:
    """The q/k norms are what the policy says: per head (weights of the layer's head_dim) or over
    all heads of a token (``QKNorm.scope`` "token": nq*head_dim, nkv*head_dim), with the same
    eps."""
    qk = policy.attn.qk_norm_in(model.config)
    if qk is None:
        return
    for s in spec.layers:
        if s.attention is None:  # no softmax attention
            continue
        i, attn, k, d = s.index, s.attention, s.kv_heads, s.head_dim
        q_width, k_width = ((spec.num_heads * d, k * d) if qk.over_token else (d, d))
        names = qk.names
        parts = attention_parts(s, model.config, policy)
        if parts is not None and parts.takes_kv:  # no K/V, no k norm of its own
            names, k_width = names[:1], None
        norms = [getattr(attn, n, None) for n in names]
        if any(n is None for n in norms):
            raise ValueError(f"layer {i}: the policy {policy.name!r} names q/k norms "
                             f"{names} that the attention does not have")
        shapes = [tuple(n.weight.shape) for n in norms]
        if shapes != [(q_width,), (k_width,)][:len(norms)]:
            what = ("over all heads of a token" if qk.over_token else "per head")
            raise ValueError(f"layer {i}: q/k norm weights of shapes {shapes}, but the policy "
                             f"{policy.name!r} describes norms {what}: [({q_width},), "
                             f"({k_width},)]; set DecoderPolicy.attn.qk_norm.scope to match")
        if len(norms) == 2 and norm_eps(norms[0]) != norm_eps(norms[1]):
            raise ValueError(f"layer {i}: q_norm eps ({norm_eps(norms[0])}) and k_norm eps "
                             f"({norm_eps(norms[1])}) differ")


def refuse_left_out(policy: DecoderPolicy, where: str, state: dict[str, torch.Tensor],
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


def refuse_unconverted(model: nn.Module, policy: DecoderPolicy, planned: list) -> None:
    """Every parameter goes to a TSP module: one left in a Hugging Face module would be trained
    on this rank's tokens only (its gradient a part of the whole) and miss from every TSP state
    dict. Raised before the model changes, naming the parameters and the fix."""
    where = {id(m): n for n, m in model.named_modules()}
    done = tuple(f"{where[id(r.parent)]}.{r.name}.".lstrip(".") for r in planned)
    left = [n for n, _ in model.named_parameters() if not n.startswith(done)]
    if left:
        raise ValueError(f"policy {policy.name!r}: parameters {left[:4]}"
                         f"{f' and {len(left) - 4} more' if len(left) > 4 else ''} belong to "
                         f"no module that TSP converts, so they would be trained on each rank's "
                         f"tokens only; describe them in the policy (base_replicated, "
                         f"layer_replicated, extra_embeds) or refuse the config field that adds "
                         f"them")
