"""Inference on a TSP model (docs/design.md "Decode"): prefill with the TSP forward, then
tensor-parallel decode over a sequence-sharded KV cache.

Prefill runs the TSP schedule on the prompt. Each attention round computes this rank's own tokens'
K/V for one head group, so after the rounds a rank holds its own tokens' K/V of *every* head: the
cache is split by tokens, 1/D of it per rank, and nothing in it came from another rank.

Decode needs no weight to move: a TSP rank already holds what tensor parallelism would give it
(a head group, a slice of the MLP's channels, a slice of the vocabulary). Per new token and layer:

1. every rank projects its heads' q, k, v; one all-gather gives every rank all heads' q, k, v;
2. the rank whose turn it is appends the new token's K/V (all heads) to its cache, so the caches
   stay balanced (the rank with the fewest slots takes the next token);
3. every rank attends all query heads to its own cache slots (split-KV, flash-decoding; a
   sliding window or Llama 4's chunks hide slots) and an all-to-all sends each head group's
   partial output and log-sum-exp to the head's owner, which merges them (adding the heads'
   attention sinks, gpt-oss, once);
4. the owner applies its rows of o_proj and an all-reduce sums the head groups; the MLP is split
   by channels (gate/up columns, down rows) with one all-reduce; norms are replicated.

The embedding (rows of the vocabulary: a masked lookup and an all-reduce) and the LM head (this
rank's vocabulary logits, all-gathered) are the model's own vocabulary shards.

LoRA adapters (a converted PeftModel) add their term with the replicated ``A`` and ``B`` and no
collective of their own: q/k/v/gate/up add their rows of ``s B A x``, o/down add each rank's
share before the all-reduce they make anyway (:func:`~tsp_core.layers.lora.decode_rows`,
:func:`~tsp_core.layers.lora.decode_share`); a QLoRA base's NF4 shards are dequantized in place
(:func:`decode_weights`).

Prefill and every decode step run the model's own Hugging Face forward (embedding scale, norms,
residuals, per-layer rotary embeddings: whatever the family does), with the TSP modules told what
to do instead (``ShardedModule.tsp_decode``), so a family needs no decode code of its own.

Prompts of different lengths arrive left-padded (Hugging Face's convention). Prefill drops the
padding, places each prompt at positions 0..n-1 and pads the batch on the *right* to a multiple of
2D: causal attention keeps those pad tokens invisible, and the cache drops them (a slot whose
position is not below its row's prompt length is marked empty), so padding never shows in results.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..distributed import comm
from ..distributed.mesh import TSPMesh
from ..distributed.model_state import ATTRIBUTE, find_model_state
from ..distributed.params import local
from ..layers import rope
from ..layers.attention import AttentionSpec, TSPAttention
from ..layers.attention.latent import TSPLatentAttention
from ..layers.attention.rounds import gated, query_scale, scale_queries, split_gate
from ..layers.linear_attention.decode import prefill as delta_net_prefill
from ..layers.linear_attention.decode import step as delta_net_step
from ..layers.lora import decode_rows, decode_share
from ..layers.mlp import TSPGatedMLP, activate
from ..layers.moe import TSPMoE
from ..layers.nf4 import NF4Weight
from ..layers.norm import NORMS
from ..layers.vocab import TSPEmbedding, TSPLMHead
from ..sequence import layout
from .latent_decode import latent_step


@dataclass
class ShardedKVCache:
    """This rank's part of the KV cache: K/V of every head for the tokens this rank holds.

    ``keys[l]``/``values[l]``: [B, num_kv_heads, capacity, head_dim] of layer l (a layer that
    reuses another's K/V, KVSharing "reuse", holds an empty [B, 0, capacity, head_dim] and reads
    its ``kv_source`` layer's entry); ``positions``
    [B, capacity]: each slot's global position in its row, -1 for an empty slot (padding, or
    capacity not used yet); ``length``: slots used; ``counts``: slots used on every rank of the
    group (every rank knows them, so all agree whose turn the next token is)."""

    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    positions: torch.Tensor
    length: int
    counts: list[int]
    rank: int
    lengths: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.long))

    def nbytes(self) -> int:
        """Bytes this rank holds for K and V (allocated, every layer)."""
        return sum(t.numel() * t.element_size() for t in self.keys + self.values)

    def next_owner(self) -> int:
        """The rank that stores the next token: the one with the fewest slots (lowest on ties)."""
        return min(range(len(self.counts)), key=lambda r: (self.counts[r], r))

    def reserve(self, steps: int) -> None:
        """Allocate room for the slots this rank will receive in the next ``steps`` tokens, once,
        instead of growing every token."""
        counts = list(self.counts)
        mine = 0
        for _ in range(steps):
            owner = min(range(len(counts)), key=lambda r: (counts[r], r))
            counts[owner] += 1
            mine += owner == self.rank
        self._grow(self.length + mine)

    def _grow(self, capacity: int) -> None:
        have = self.positions.shape[1]
        if capacity <= have:
            return
        extra = capacity - have

        def pad(t: torch.Tensor) -> torch.Tensor:
            return torch.cat([t, t.new_zeros(*t.shape[:2], extra, t.shape[3])], dim=2)

        self.keys = [pad(k) for k in self.keys]
        self.values = [pad(v) for v in self.values]
        self.positions = torch.cat([self.positions, self.positions.new_full(
            (self.positions.shape[0], extra), -1)], dim=1)


@dataclass(frozen=True)
class _Layer:
    attn: TSPAttention
    mlp: TSPGatedMLP | TSPMoE
    experts: TSPMoE | None = None  # an MoE beside the MLP (Gemma 4: policy.ffn.moe_beside_mlp)


@dataclass(frozen=True)
class _Parts:
    """The TSP modules of a parallelized model and the Hugging Face base model around them, whose
    own forward (norms, residuals, scalings, rotary embeddings: whatever the family does) runs
    prefill and every decode step."""

    mesh: TSPMesh
    base: nn.Module
    embed: TSPEmbedding
    layers: list[_Layer]
    head: TSPLMHead
    ropes: list[nn.Module]   # rotaries whose frequencies depend on the length
    vocab_size: int


def converted(model: nn.Module) -> nn.Module:
    """The converted model: ``model``, or the one a PEFT ``PeftModel`` wraps (its
    ``base_model.model``). PEFT forwards attribute reads to it, so a PeftModel finds its TSP
    state, but its own ``model`` attribute is not the policy's base model."""
    if ATTRIBUTE in vars(model):
        return model
    inner = getattr(getattr(model, "base_model", None), "model", None)
    return inner if isinstance(inner, nn.Module) and ATTRIBUTE in vars(inner) else model


def decode_parts(model: nn.Module) -> _Parts:
    model = converted(model)
    state = find_model_state(model)
    if state is None:
        raise ValueError(f"{type(model).__name__} was not parallelized with tsp_core.parallelize; "
                         f"generation needs a TSP model")
    policy, mesh = state.policy, state.mesh
    names, ffn = policy.modules, policy.ffn
    base = getattr(model, names.base_model)
    layers = [_Layer(_token_mixer(b, policy), getattr(b, names.mlp),
                     getattr(b, ffn.moe.experts) if ffn.moe_beside_mlp(b) else None)
              for b in getattr(base, names.layers)]
    return _Parts(mesh, base, getattr(base, names.embed), layers, getattr(model, names.lm_head),
                  state.ropes, model.config.vocab_size)


def _token_mixer(layer: nn.Module, policy: Any) -> nn.Module:
    """A decoder layer's attention, or its Gated DeltaNet (``policy.modules.linear_attention``)."""
    names = policy.modules
    if names.linear_attention and hasattr(layer, names.linear_attention):
        return getattr(layer, names.linear_attention)
    return getattr(layer, names.attention)


def _takes_kv(module: nn.Module) -> bool:
    """Whether a token mixer attends with K/V another layer stores (``AttentionParts.takes_kv``)
    and so keeps no decode cache of its own."""
    return isinstance(module, TSPAttention) and module.parts.takes_kv


_open_modes = 0  # _mode contexts open on this process


def generating() -> bool:
    """Whether a generation's prefill or decode forward is running (compiled decoder layers run
    eagerly then: :mod:`tsp_core.models.compiled`)."""
    return _open_modes > 0


@contextlib.contextmanager
def _mode(modules: list[nn.Module], state: Any):
    """Run the model's forward with ``state`` telling these TSP modules what to do instead."""
    global _open_modes
    for m in modules:
        m.tsp_decode = state
    _open_modes += 1
    try:
        yield
    finally:
        _open_modes -= 1
        for m in modules:
            m.tsp_decode = None


class _Prefill:
    """Prefill: the attention runs its TSP schedule and hands its own tokens' K/V to ``sink``."""

    decoding = False

    def __init__(self, sink, lengths: torch.Tensor | None = None) -> None:
        self.sink, self.lengths = sink, lengths

    def delta_net(self, module: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """A Gated DeltaNet layer: its TSP forward, its state left on the layer
        (tsp_core.layers.linear_attention.decode); an empty cache entry keeps the layers'
        indices."""
        B, L = x.shape[:2]
        self.sink(x.new_zeros(1, 2, B, 0, L, 0))
        return delta_net_prefill(module, x, self.lengths)


class _Decode:
    """One decode step: the embedding, attention and MLP take their tensor-parallel paths."""

    decoding = True
    sink = None

    def __init__(self, parts: _Parts, cache: ShardedKVCache, slot: int | None,
                 positions: torch.Tensor) -> None:
        self.parts, self.cache, self.slot, self.positions = parts, cache, slot, positions
        self.index = {id(layer.attn): i for i, layer in enumerate(parts.layers)}
        self.used = cache.positions[:, :cache.length]
        self.valid = self.used >= 0

    def embed(self, module: TSPEmbedding, ids: torch.Tensor) -> torch.Tensor:
        return _embed_rows(self.parts, ids)

    def delta_net(self, module: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """A Gated DeltaNet layer's step: its state, not a cache."""
        return delta_net_step(module, x)

    def mlp(self, module: TSPGatedMLP | TSPMoE, x: torch.Tensor) -> torch.Tensor:
        if isinstance(module, TSPMoE):
            return module.decode_step(x)
        return _mlp_step(self.parts, module, x)

    def attention(self, module: TSPAttention, x: torch.Tensor,
                  position_embeddings: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """x [B, 1, h] -> [B, 1, h]"""
        cos, sin = position_embeddings
        if isinstance(module, TSPLatentAttention):  # MLA: a latent cache (latent_decode.py)
            i = self.index[id(module)]
            return latent_step(self.parts.mesh, module, x[:, 0], cos, sin, self.cache.keys[i],
                               self.cache.length, self.slot, self.valid, _attend_local,
                               merge_heads).unsqueeze(1)
        visible = visible_slots(module.spec, self.valid, self.used, self.positions)
        y = _attention_step(self.parts, self.index[id(module)], module, x[:, 0], cos, sin,
                            self.cache, self.slot, visible, self.positions)
        return y.unsqueeze(1)


# ------------------------------------------------------------- vocabulary shards, replicated rows

def _embed_rows(parts: _Parts, ids: torch.Tensor) -> torch.Tensor:
    """Embedding of token ids identical on every rank: a masked lookup in this rank's rows and one
    all-reduce (Megatron's vocabulary-parallel embedding)."""
    table = local(parts.embed.weight)
    per, start = table.shape[0], parts.mesh.rank * table.shape[0]
    inside = (ids >= start) & (ids < start + per)
    rows = F.embedding((ids - start).clamp(0, per - 1), table)
    rows = rows * inside.unsqueeze(-1).to(table.dtype)
    comm.all_reduce(rows, parts.mesh.group)
    return rows


def _logits(parts: _Parts, hidden: torch.Tensor) -> torch.Tensor:
    """[B, h] -> [B, V] on every rank: this rank's vocabulary rows, all-gathered."""
    hidden = parts.head.scale_input(hidden)
    w = local(parts.head.weight)
    mine = parts.head.cap(hidden @ w.t())                            # [B, per]
    d = parts.mesh.size
    out = mine.new_empty(d, *mine.shape)
    comm.all_gather(out, mine.contiguous(), parts.mesh.group)
    return out.permute(1, 0, 2).reshape(mine.shape[0], -1)[:, :parts.vocab_size]


# ------------------------------------------------------------------------------- weights

def decode_weights(module: nn.Module) -> dict[str, torch.Tensor]:
    """A TSP module's local tensors by their Hugging Face names, as a decode step computes with
    them: a projection behind a LoRA adapter under its own name (PEFT's ``base_layer.`` left out;
    the adapters' own tensors are not here, :func:`~tsp_core.layers.lora.decode_rows` and
    :func:`~tsp_core.layers.lora.decode_share` add their terms), and a 4-bit NF4 shard (QLoRA,
    :class:`~tsp_core.layers.nf4.NF4Weight`) dequantized by bitsandbytes' kernel, as the
    schedules dequantize it per round: this rank's shard only, nothing moves."""
    out = {n.replace(".base_layer.", "."): local(p) for n, p in module.named_parameters()
           if ".lora_" not in n}
    for path, holder in module.named_modules():
        if isinstance(holder, NF4Weight):
            out[f"{path.removesuffix('.base_layer')}.weight"] = holder.dequantized()
    return out


# ------------------------------------------------------------------------------- prefill

def check_prompts(input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
                  vocab_size: int) -> torch.Tensor:
    """Each row's prompt length; raises, naming rows and the fix, for inputs prefill can't take.
    Runs before any collective."""
    if input_ids.dim() != 2 or input_ids.dtype not in (torch.long, torch.int):
        raise ValueError(f"input_ids must be a [batch, seq] integer tensor, got "
                         f"{tuple(input_ids.shape)} {input_ids.dtype}")
    if input_ids.shape[1] == 0:
        raise ValueError("input_ids has no tokens: give every row at least one prompt token")
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    if tuple(attention_mask.shape) != tuple(input_ids.shape):
        raise ValueError(f"attention_mask has shape {tuple(attention_mask.shape)}, input_ids "
                         f"{tuple(input_ids.shape)}")
    mask = attention_mask.bool()
    holes = (mask[:, :-1] & ~mask[:, 1:]).any(dim=1).nonzero().flatten().tolist()
    if holes:
        raise ValueError(f"attention_mask rows {holes} have a 0 after a 1 (right padding or "
                         f"holes); generation takes left-padded prompts "
                         f"(tokenizer.padding_side = 'left')")
    lengths = mask.sum(1)
    empty = (lengths == 0).nonzero().flatten().tolist()
    if empty:
        raise ValueError(f"rows {empty} of attention_mask are all 0: every prompt needs a token")
    real = input_ids[mask]
    if real.numel() and (int(real.min()) < 0 or int(real.max()) >= vocab_size):
        raise ValueError(f"prompt token ids from {int(real.min())} to {int(real.max())} are "
                         f"outside the vocabulary [0, {vocab_size})")
    return lengths


def _packed_right(input_ids: torch.Tensor, lengths: torch.Tensor, total: int) -> torch.Tensor:
    """Left-padded rows -> each prompt at 0..n-1, right-padded with token 0 to ``total``."""
    B, S = input_ids.shape
    out = input_ids.new_zeros(B, total)
    for b, n in enumerate(lengths.tolist()):
        out[b, :n] = input_ids[b, S - n:]
    return out


@torch.no_grad()
def prefill(model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None
            ) -> tuple[torch.Tensor, ShardedKVCache]:
    """Run the TSP forward on left-padded prompts [B, S] (identical on every rank of the group);
    return the next-token logits [B, V] (identical on every rank) and this rank's KV cache."""
    parts = decode_parts(model)
    mesh = parts.mesh
    D, me = mesh.size, mesh.rank
    lengths = check_prompts(input_ids, attention_mask, parts.vocab_size)
    longest = int(lengths.max())
    total = layout.padded_length(longest, D, mesh.layout)
    full = _packed_right(input_ids, lengths, total)
    ids = layout.shard_sequence(full, me, D, 1, mesh.layout)          # [B, T/D]
    pos1 = layout.position_ids(total, me, D, mesh.layout, device=ids.device)
    pos = pos1.unsqueeze(0).expand(ids.shape[0], -1)
    keep = pos1 < longest                          # slots that hold a token of some row
    cache_pos = torch.where(pos[:, keep] < lengths.to(ids.device)[:, None], pos[:, keep], -1)
    counts = [int((layout.position_ids(total, r, D, mesh.layout) < longest).sum())
              for r in range(D)]
    keys: list[torch.Tensor] = []
    values: list[torch.Tensor] = []
    # a layer that reuses another's K/V (KVSharing "reuse": Gemma 4's KV-shared layers) is handed
    # the storing layer's kv_all; decode reads the storing layer's entry (``kv_source``), so the
    # reusing layer keeps an empty entry, not a copy of the prompt's K/V
    reusing = {i for i, layer in enumerate(parts.layers) if _takes_kv(layer.attn)}

    def sink(kv_all: torch.Tensor) -> None:
        if len(keys) in reusing:  # [B, 0 heads, slots, head_dim]: nothing of its own
            empty = kv_all.new_zeros(kv_all.shape[2], 0, int(keep.sum()), kv_all.shape[-1])
            keys.append(empty)
            values.append(empty.clone())
            return
        if kv_all.dim() == 3:  # a latent attention's own tokens' latent [B, L, C] (MLA): the
            keys.append(kv_all[:, None][:, :, keep].clone())          # keys; no value channel
            values.append(kv_all.new_zeros(kv_all.shape[0], 1, int(keep.sum()), 0))
            return
        g, _, B, n, L, d = kv_all.shape          # every key/value head once, in order
        kv = kv_all.permute(1, 2, 0, 3, 4, 5).reshape(2, B, g * n, L, d)[:, :, :, keep]
        keys.append(kv[0].clone())
        values.append(kv[1].clone())

    # the model's own forward (the TSP schedules inside); a length-dependent rope sees what HF's
    # generate gives it: positions cumsum(mask) - 1, so max + 1 = the longest prompt
    with _mode([layer.attn for layer in parts.layers], _Prefill(sink, lengths)), \
            rope.global_length(parts.ropes, longest):
        x = parts.base(input_ids=ids, position_ids=pos, use_cache=False).last_hidden_state
    # the final hidden state of each row's last prompt token, from whichever rank holds it
    last = (pos == (lengths.to(pos.device) - 1)[:, None]).to(x.dtype)      # [B, T/D]
    hidden = torch.einsum("bl,blh->bh", last, x).contiguous()
    comm.all_reduce(hidden, mesh.group)
    logits = _logits(parts, hidden)
    cache = ShardedKVCache(keys, values, cache_pos.contiguous(), int(keep.sum()), counts, me,
                           lengths.to(ids.device))
    return logits, cache


# -------------------------------------------------------------------------------- decode

def visible_slots(spec: AttentionSpec, valid: torch.Tensor, used: torch.Tensor,
                  positions: torch.Tensor) -> torch.Tensor:
    """Which of this rank's cache slots (``used`` [B, L]: their positions, ``valid``: holding a
    token) the new token at ``positions`` [B] sees: all of them, or with a sliding window the
    last ``window`` positions, with chunked attention (Llama 4) those of its own chunk."""
    visible, mask = valid, spec.parts.mask
    if mask.sliding_window is not None:
        visible = visible & (used > positions[:, None] - mask.sliding_window)
    if mask.chunk_size is not None:
        visible = visible & (used >= (positions - positions % mask.chunk_size)[:, None])
    return visible


def merge_heads(parts_lse: torch.Tensor, parts_out: torch.Tensor,
                sinks: torch.Tensor | None = None) -> torch.Tensor:
    """The owner's merge of its heads' partial results from every rank's slots (``parts_lse``
    [D, B, nq], ``parts_out`` [D, B, nq, d]) by log-sum-exp; with ``sinks`` [nq] (gpt-oss) each
    head's sink logit joins the denominator once, after the parts are merged."""
    total = torch.logsumexp(parts_lse, dim=0)
    if sinks is not None:
        total = torch.logaddexp(total, sinks.to(total.dtype))
    return (torch.exp(parts_lse - total).unsqueeze(-1) * parts_out).sum(0)


def _attend_local(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor,
                  scale: float, softcap: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Split-KV attention of every query head [B, nq, d] to this rank's slots k, v
    [B, nkv, L, d] where ``visible`` [B, L]; returns the partial output [B, nq, d] and its
    log-sum-exp [B, nq] (-inf and 0 where nothing here is visible), in float32 or float64.
    ``softcap``: scores ``tanh(s / softcap) * softcap`` before the mask (Gemma 2)."""
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    B, nq, d = q.shape
    nkv = k.shape[1]
    qg = q.view(B, nkv, nq // nkv, d).to(acc)
    s = torch.einsum("bhgd,bhld->bhgl", qg, k.to(acc)) * scale
    if softcap is not None:
        s = torch.tanh(s / softcap) * softcap
    s = s.masked_fill(~visible[:, None, None, :], float("-inf"))
    lse = torch.logsumexp(s, dim=-1)                                  # [B, nkv, g]
    p = torch.exp(s - lse.unsqueeze(-1)).nan_to_num_(0.0)
    out = torch.einsum("bhgl,bhld->bhgd", p, v.to(acc))
    return out.reshape(B, nq, d), lse.reshape(B, nq)


def _attention_step(parts: _Parts, i: int, attn: TSPAttention, x: torch.Tensor, cos: torch.Tensor,
                    sin: torch.Tensor, cache: ShardedKVCache, slot: int | None,
                    visible: torch.Tensor, positions: torch.Tensor | None = None
                    ) -> torch.Tensor:
    """One decode step of attention ``i``; ``positions`` [B] (the new tokens' global positions)
    feed a query scale (``AttentionParts.query_scale``: Llama 4's attention temperature)."""
    group, D = parts.mesh.group, parts.mesh.size
    spec, p = attn.spec, attn.parts
    nq, d = spec.local_heads, spec.head_dim
    B = x.shape[0]
    w = decode_weights(attn)

    def proj(name: str) -> torch.Tensor:                              # [B, this rank's rows]
        y = F.linear(x, w[f"{name}_proj.weight"], w.get(f"{name}_proj.bias"))
        lora = decode_rows(attn, f"{name}_proj", x)                   # its rows of s B A x
        return y if lora is None else y + lora

    # values_from_keys (Gemma 4's attention_k_eq_v): the key projection's output is the values;
    # a KV-shared layer (KVSharing role "reuse") projects queries only and reads its source
    # layer's cache
    shared = p.takes_kv
    names = ["q"] if shared else ["q", "k", "k" if p.values_from_keys else "v"]
    projected = {n: proj(n) for n in names}
    # an output gate (Qwen3.5) stays here: rank r applies its own heads' gate after the merge
    projected["q"], gate = split_gate(projected["q"], spec, nq)
    mine = torch.cat([projected[n] for n in names], dim=1)
    # this rank's key/value heads, or its slice of them
    kv_rows = 0 if shared else w["k_proj.weight"].shape[0]
    every = mine.new_empty(D, *mine.shape)
    comm.all_gather(every, mine.contiguous(), group)                  # every rank's q, k, v rows
    q_all, k_all, v_all = every.split([nq * d, kv_rows, kv_rows], dim=2)

    def heads(t: torch.Tensor, n: int) -> torch.Tensor:              # rank order -> [B, n, 1, d]
        return t.permute(1, 0, 2).reshape(B, -1)[:, :n * d].reshape(B, n, 1, d)

    q_all = heads(q_all, D * nq)
    k_all = heads(k_all, 0 if shared else spec.num_kv_heads)          # shared: [B, 0, 1, d]
    qk, pairs = p.qk_norm, p.rotary.interleaved
    after_rope = qk is not None and qk.after_rope
    if after_rope:                           # Hunyuan dense: the per-head norms after RoPE
        q_all = rope.apply(q_all, cos, sin, pairs)
        k_all = rope.apply(k_all, cos, sin, pairs)
    if qk is not None:                       # per head (Qwen3, Gemma 3) or over all (OLMo 2)
        norm = NORMS[qk.kind]

        def normed(t: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
            if not qk.over_token:
                return norm(t, weight, qk.eps)
            return norm(t.reshape(B, -1), weight, qk.eps).view(t.shape)

        # a weightless norm (Llama 4's L2) has no parameters
        q_all = normed(q_all, w.get(attn.NORMS[0]))
        k_all = k_all if shared else normed(k_all, w.get(attn.NORMS[1]))
    if not after_rope:
        q_all = rope.apply(q_all, cos, sin, pairs)
        k_all = rope.apply(k_all, cos, sin, pairs)
    q_all, k_all = q_all[:, :, 0], k_all[:, :, 0]                     # [B, nq_total, d]
    if p.query_scale is not None:                     # Llama 4's temperature, per row
        q_all = scale_queries(q_all.transpose(0, 1), query_scale(spec, positions, q_all)
                              ).transpose(0, 1)
    v_all = heads(v_all, 0 if shared else spec.num_kv_heads)[:, :, 0]
    v_all = p.values.apply(v_all)            # as the schedules (Gemma 4: a weightless norm)
    if shared:                               # the K/V the source layer wrote this step
        i = attn.kv_source
    elif slot is not None:                                            # this rank's turn
        cache.keys[i][:, :, slot] = k_all
        cache.values[i][:, :, slot] = v_all
    L = cache.length
    out, lse = _attend_local(q_all, cache.keys[i][:, :, :L], cache.values[i][:, :, :L],
                             visible, spec.softmax_scale, p.mask.softcap)
    # head group r's partial results go to rank r, which merges them by log-sum-exp
    send = torch.cat([out, lse.unsqueeze(-1)], dim=-1).view(B, D, nq, d + 1).transpose(0, 1)
    send = send.contiguous()
    recv = torch.empty_like(send)
    comm.all_to_all(recv, send, group)
    parts_lse, parts_out = recv[..., d], recv[..., :d]               # [D, B, nq], [D, B, nq, d]
    merged = merge_heads(parts_lse, parts_out, w.get("sinks"))      # its heads' sinks, if any
    heads_out = gated(merged.to(x.dtype).reshape(B, nq * d), gate)
    y = heads_out @ w["o_proj.weight"].t()
    lora = decode_share(attn, "o_proj", heads_out)  # summed over the head groups with y
    if lora is not None:
        y = y + lora
    comm.all_reduce(y, group)
    if "o_proj.bias" in w:
        y = y + w["o_proj.bias"]
    return y


def _mlp_step(parts: _Parts, mlp: TSPGatedMLP, x: torch.Tensor) -> torch.Tensor:
    w = decode_weights(mlp)

    def proj(name: str) -> torch.Tensor:                         # [B, this rank's channels]
        y = F.linear(x, w[f"{name}.weight"], w.get(f"{name}.bias"))
        lora = decode_rows(mlp, name, x)
        return y if lora is None else y + lora

    h = activate(proj("gate_proj"), mlp.spec.activation) * proj("up_proj")
    y = h @ w["down_proj.weight"].t()
    lora = decode_share(mlp, "down_proj", h)        # summed over the channel slices with y
    if lora is not None:
        y = y + lora
    comm.all_reduce(y, parts.mesh.group)
    if "down_proj.bias" in w:
        y = y + w["down_proj.bias"]
    return y


@torch.no_grad()
def decode_step(model: nn.Module, cache: ShardedKVCache, tokens: torch.Tensor,
                positions: torch.Tensor) -> torch.Tensor:
    """Feed one token per row (``tokens`` [B] at global ``positions`` [B], identical on every
    rank); return the next-token logits [B, V] (identical on every rank). No weight moves."""
    parts = decode_parts(model)
    owner = cache.next_owner()
    cache.counts[owner] += 1
    slot = None
    if owner == cache.rank:
        slot = cache.length
        if slot >= cache.positions.shape[1]:  # not reserved: grow by a quarter, not per token
            cache._grow(slot + max(16, slot // 4))
        cache.positions[:, slot] = positions
        cache.length += 1
    modules = [parts.embed] + [m for layer in parts.layers for m in (layer.attn, layer.mlp)]
    modules += [layer.experts for layer in parts.layers if layer.experts is not None]  # beside
    # the model's own forward on one token per row; a length-dependent rope gets max(pos) + 1,
    # as in HF's generate (every rank shares the positions)
    with _mode(modules, _Decode(parts, cache, slot, positions)), \
            rope.global_length(parts.ropes, int(positions.max()) + 1):
        x = parts.base(input_ids=tokens[:, None], position_ids=positions[:, None],
                       use_cache=False).last_hidden_state
    return _logits(parts, x[:, 0])


def cache_bytes_of(cache: Any) -> int:
    """K/V bytes a cache holds on this rank: a :class:`ShardedKVCache`, or a Hugging Face
    ``DynamicCache`` (local shards of DTensors)."""
    if isinstance(cache, ShardedKVCache):
        return cache.nbytes()
    total = 0
    for layer in cache.layers:
        for t in (layer.keys, layer.values):
            if t is None:
                continue
            t = t.to_local() if hasattr(t, "to_local") else t
            total += t.numel() * t.element_size()
    return total


__all__ = ["ShardedKVCache", "cache_bytes_of", "check_prompts", "decode_step", "merge_heads",
           "prefill", "visible_slots"]
