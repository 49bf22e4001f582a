"""The TSP attention ``nn.Module``: the shards this rank owns, the checks on its inputs, and the
choice of schedule (one head group per round, or the phased schedule when q/k norms span every
head of a token)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import torch

from ...distributed import comm
from ...distributed.mesh import TSPMesh
from ...distributed.params import (
    REPLICATED,
    ShardedModule,
    ShardSpec,
    chunk_spec,
    even_spec,
    init_full,
    local_replicated,
    schedule_inputs,
)
from .. import rope
from ..dropout import AttentionDropout
from ..inputs import check_local_input, checked_docs
from ..lora import schedule_adapters
from .parts import AttentionParts, AttentionShape, QKNorm, Rotary, Values
from .per_group import PerGroupAttentionFn
from .phased import PhasedAttentionFn
from .rounds import AttentionSpec


def real_rotary(position_embeddings):
    """A Hugging Face rotary embedding's output as ``(cos, sin)`` [B, L, r] in the ``cat(freqs,
    freqs)`` convention: as given, or from Llama 4's one complex tensor ``freqs_cis`` [B, L, r/2]
    (``cos + i sin`` per channel pair, applied to pairs (2i, 2i+1): the policy's
    ``rope_interleaved``). None stays None."""
    if not isinstance(position_embeddings, torch.Tensor):
        return position_embeddings
    if not position_embeddings.is_complex():
        raise ValueError(f"position_embeddings: a (cos, sin) pair or a complex freqs_cis "
                         f"tensor, got a {position_embeddings.dtype} tensor of shape "
                         f"{tuple(position_embeddings.shape)}")
    re, im = position_embeddings.real, position_embeddings.imag
    return torch.cat((re, re), dim=-1), torch.cat((im, im), dim=-1)


def rotary_inputs(position_embeddings, rotary: Rotary):
    """A Hugging Face rotary embedding's output as the ``(cos, sin)`` [B, L, r] a layer with
    ``rotary`` rotates with (None stays None): real (:func:`real_rotary`), widened to the usual
    ``cat(freqs, freqs)`` for "half_width" (gpt-oss rotates halves with one copy: the same
    rotation once widened), and for "none" emptied (:func:`unrotated`)."""
    position_embeddings = real_rotary(position_embeddings)
    if position_embeddings is None:
        return None
    if rotary.kind == "half_width":
        position_embeddings = tuple(torch.cat((t, t), dim=-1) for t in position_embeddings)
    return unrotated(position_embeddings, rotary)


def unrotated(position_embeddings: tuple[torch.Tensor, torch.Tensor], rotary: Rotary
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(cos, sin)`` as is, or for a NoPE layer (``rotary.kind`` "none") emptied: rope.apply
    rotates the first cos.shape[-1] channels, none, exactly the identity."""
    if rotary.kind != "none":
        return position_embeddings
    return tuple(t[..., :0] for t in position_embeddings)


LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")  # the projections LoRA may adapt


class TSPAttention(ShardedModule):
    """Multi-head / grouped-query attention with TSP: rank p owns query heads
    [p*nq/D, (p+1)*nq/D), the key/value heads they use (with fewer key/value heads than ranks, an
    even 1/D slice of the key/value rows instead, so no weight is stored twice), and the matching
    columns of o_proj. ``shape`` (:class:`~.parts.AttentionShape`) gives the sizes and biases,
    ``parts`` (:class:`~.parts.AttentionParts`) everything else, each feature a part; the
    parameters carry Hugging Face names and shapes: ``q_proj.weight`` [nq*d, h] ([nq*2d, h] with
    the output gate: each head's [query | gate] rows), ``k_proj.weight``, ``v_proj.weight``
    [nkv*d, h] (no ``v_proj`` with ``values_from_keys``; no key/value projection on a layer that
    reuses another's K/V), ``o_proj.weight`` [h, nq*d], optional biases, with a q/k norm
    (:class:`~.parts.QKNorm`) its weights under the norm's names, [d] each per head (replicated;
    Qwen3) or [nq*d] and [nkv*d] over all heads of a token (OLMo 2; the phased schedule of
    :mod:`tsp_core.layers.attention.phased`), none for the weightless "l2" kind (Llama 4), and
    with ``Mask.sinks`` the per-head sink logits ``sinks`` [nq] (gpt-oss: one more softmax column
    without a value), sharded with the query heads (each round's shard carries its owner's
    sinks; their gradient goes back with the round's weight gradients). The output gate's gate
    is computed in each round from the broadcast query shard for this rank's tokens (and
    recomputed in the backward), so its gradient joins the query shard's. Packed rows are
    refused on a layer with a query scale (Hugging Face counts the position across documents).
    A layer that stores its K/V (``KVSharing`` role "store") returns ``(output, kv_all)`` from
    ``forward``; one that reuses them takes ``forward(..., shared_kv=kv_all)``.

    ``forward(x, position_ids)`` takes this rank's tokens [B, S/D, hidden] and their *global*
    positions [B, S/D] and returns this rank's output tokens. A model that computes its own rotary
    cos/sin passes ``position_embeddings=(cos, sin)`` instead.

    ``attention_dropout`` (a config's, 0 by default): in training, the attention probabilities of
    this rank's queries are dropped with this probability, each rank its own masks
    (:class:`~tsp_core.layers.dropout.AttentionDropout`; the pieces then run the tiled math
    kernel: tsp_core/layers/flash.py); in eval mode and at 0 nothing changes.
    """

    attention_dropout: float = 0.0

    def __init__(self, mesh: TSPMesh, shape: AttentionShape, parts: AttentionParts | None = None,
                 *, dtype: torch.dtype | None = None, device: torch.device | str | None = None,
                 init_seed: int | None = 0) -> None:
        super().__init__()
        parts = AttentionParts() if parts is None else parts
        shape = parts.check(shape, mesh.size)
        self.shape, self.parts, self.mesh = shape, parts, mesh
        self.NORMS = (parts.qk_norm or QKNorm()).weights  # the q/k norms' HF names
        self.spec = AttentionSpec(shape.hidden_size, shape.num_heads, shape.num_kv_heads,
                                  shape.head_dim, mesh.size, mesh.layout, parts)
        self.register_buffer("inv_freq", rope.default_inv_freq(shape.head_dim, parts.rotary.theta),
                             persistent=False)
        self.full_shapes = full_shapes(shape, parts)
        norm = parts.qk_norm
        ones = self.NORMS if norm is None or norm.kind != "gemma" else ()  # gemma's: offset from 1
        full = init_full(self.full_shapes, init_seed, dtype, device, ones=ones)
        for n in self.NORMS if norm is not None and norm.kind == "gemma" else ():
            if n in full:  # a layer reusing K/V has no key norm
                full[n].zero_()
        self._create(full)

    def _apply(self, fn, recurse=True):
        return rope.keep_frequencies(self, lambda: super(TSPAttention, self)._apply(fn, recurse))

    def extra_repr(self) -> str:
        s, p, m = self.spec, self.parts, self.parts.mask
        return (f"hidden_size={s.hidden_size}, heads={s.num_heads}/{s.num_kv_heads}, "
                f"head_dim={s.head_dim}, tsp_size={s.tsp_size}, sliding_window={m.sliding_window}"
                + (f", chunk_size={m.chunk_size}" if m.chunk_size is not None else "")
                + (", sinks=True" if m.sinks else "")
                + (f", qk_norm={p.qk_norm.kind}" if p.qk_norm is not None else "")
                + (f", query_scale={p.query_scale}" if p.query_scale is not None else "")
                + (f", values={p.values}" if p.values != Values() else "")
                + (", values_from_keys=True" if p.values_from_keys else "")
                + (", output_gate=True" if p.output_gate else ""))

    NORMS = ("q_norm.weight", "k_norm.weight")

    def shard_spec(self, name: str, rank: int) -> ShardSpec:
        s = self.spec
        if name == "o_proj.bias" or name in self.NORMS:
            return REPLICATED
        if name.startswith(("k_proj", "v_proj")) and s.kv_replicas > 1:
            return chunk_spec(s.num_kv_heads * s.head_dim, rank, s.tsp_size)  # see rounds.Shards
        dim = 1 if name == "o_proj.weight" else 0
        return even_spec(self.full_shapes[name][dim], rank, s.tsp_size, dim)

    def _weight_names(self) -> list[str]:
        """The schedule's weights in its order; with ``values_from_keys`` the key projection
        stands in the value projection's place too (the schedule computes V from it as from any
        value projection; autograd sums the two gradients of the one parameter)."""
        sinks = ["sinks"] if self.parts.mask.sinks else []  # sharded with the query heads
        if self.parts.takes_kv:  # (wq, wo[, bq]): the K/V are another layer's
            names = ["q_proj.weight", "o_proj.weight"]
            names += ["q_proj.bias"] if "q_proj.bias" in self.full_shapes else []
            return names + sinks
        v = "k_proj" if self.parts.values_from_keys else "v_proj"
        names = ["q_proj.weight", "k_proj.weight", f"{v}.weight", "o_proj.weight"]
        if "q_proj.bias" in self.full_shapes:
            names += ["q_proj.bias", "k_proj.bias", f"{v}.bias"]
        return names + sinks

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor | None = None, *,
                position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
                docs: Sequence[Sequence[int]] | None = None,
                kv_sink: Callable[[torch.Tensor], None] | None = None,
                shared_kv: torch.Tensor | None = None):
        """``docs``: for packed rows, each row's document lengths (as ``shard_batch`` pads them:
        multiples of 2D); attention then stays inside each document. ``kv_sink`` (prefill for
        :mod:`tsp_core.inference.decode`) is called once with ``kv_all`` [G, 2, B, local_kv_heads,
        S/D, head_dim], G = D / kv_replicas key/value head groups in order: the K/V (RoPE applied)
        of this rank's own tokens for every key/value head, all computed here, none received from
        another rank. ``shared_kv``: on a layer that reuses K/V (``KVSharing`` role "reuse"), the
        ``kv_all`` another layer returned (Gemma 4's KV-shared layers). On a layer that stores
        them (role "store") the result is ``(output, kv_all)``. ``position_embeddings``: the
        model's rotary output, read as ``AttentionParts.rotary`` says (:func:`rotary_inputs`)."""
        s, p = self.spec, self.parts
        if p.takes_kv and shared_kv is None:
            raise ValueError("a layer that reuses K/V (KVSharing \"reuse\") takes the shared_kv "
                             "of the layer it reuses; none was given")
        if not p.takes_kv and shared_kv is not None:
            raise ValueError("shared_kv was given to a layer that projects its own K/V (no "
                             "KVSharing \"reuse\"); only a reusing layer takes it")
        check_local_input(x, s.hidden_size)
        if x.shape[1] % (2 if s.layout == "zigzag" else 1):
            raise ValueError(f"local sequence length ({x.shape[1]}) must be even under the zigzag "
                             f"layout (2 chunks per rank); shard with tsp_core.shard_batch")
        docs = checked_docs(docs, x, s.tsp_size)
        if docs is not None:
            packed = [b for b, row in enumerate(docs) if len(row) > 1]
            if p.query_scale is not None and packed:  # same docs on every rank: all raise here
                raise ValueError(
                    f"packed rows (row {packed[0]} holds {len(docs[packed[0]])} documents: "
                    f"{docs[packed[0]]}) on a layer whose queries are scaled by their position "
                    f"({p.query_scale}): Hugging Face scales them by the position in the row "
                    f"(Llama 4's attn_temperature_tuning counts across documents), which a row "
                    f"whose documents shard_batch padded to multiples of {2 * s.tsp_size} "
                    f"cannot give; feed one document per row, or set "
                    f"attn_temperature_tuning=False")
        position_embeddings = rotary_inputs(position_embeddings, p.rotary)
        if position_embeddings is None:
            if position_ids is None:
                raise ValueError("pass the global position_ids of the local tokens (from "
                                 "tsp_core.shard_batch) or position_embeddings=(cos, sin)")
            if position_ids.dim() == 1:
                position_ids = position_ids.unsqueeze(0).expand(x.shape[0], -1)
            if tuple(position_ids.shape) != tuple(x.shape[:2]):
                raise ValueError(f"position_ids of shape {tuple(position_ids.shape)} do not match "
                                 f"the input's [batch, local_seq] = {tuple(x.shape[:2])}")
            position_embeddings = unrotated(rope.cos_sin(position_ids, self.inv_freq, 1.0, x.dtype),
                                            p.rotary)
        weightless = p.qk_norm is not None and p.qk_norm.weightless
        norms = list(self.NORMS) if p.qk_norm is not None and not weightless else []
        norms = norms[:1] if p.takes_kv else norms
        x, weights, context = schedule_inputs(self, self._weight_names() + norms, x)
        if norms:  # replicated: every rank normalises its own tokens, gradients summed
            weights[-len(norms):] = [comm.sum_grad(w, self.mesh.group)
                                     for w in weights[-len(norms):]]
        if weightless:  # the schedules take norm weights: empty placeholders, never read
            weights += [x.new_empty(0)] * (1 if p.takes_kv else 2)
        if p.takes_kv:
            weights = [shared_kv, *weights]
        cos, sin = rope.rotation_inputs(position_embeddings, x.dtype)
        fn = PhasedAttentionFn if p.over_token else PerGroupAttentionFn
        dropout = (AttentionDropout.drawn(self.attention_dropout)
                   if self.training and self.attention_dropout else None)
        x, low, tensors, adapters = schedule_adapters(self, LORA_TARGETS, x)
        if low is not None:  # LoRA (tsp_core.layers.lora): the call's adapters join the rounds
            s = dataclasses.replace(s, lora=low)
        with context:
            y = fn.apply(x, cos, sin, s, self.mesh.group, docs, kv_sink, dropout, *weights,
                         *tensors)
        if "o_proj" in adapters:
            *y, z = y
            y = y[0] if len(y) == 1 else tuple(y)
        y, kv_all = y if p.gives_kv else (y, None)
        if "o_proj" in adapters:
            y = adapters["o_proj"].add_output(y, z)
        if "o_proj.bias" in self.full_shapes:
            y = y + local_replicated(self.o_proj.bias, self.mesh)
        return (y, kv_all) if p.gives_kv else y


def full_shapes(shape: AttentionShape, parts: AttentionParts) -> dict[str, tuple[int, ...]]:
    """The full (unsharded) shape of each parameter of a layer of ``shape`` (resolved) and
    ``parts``, by its Hugging Face name."""
    h, d = shape.hidden_size, shape.head_dim
    q, kv = shape.num_heads * d, shape.num_kv_heads * d
    q_rows = 2 * q if parts.output_gate else q  # each head's [query | gate] rows
    shapes = {"q_proj.weight": (q_rows, h), "k_proj.weight": (kv, h), "v_proj.weight": (kv, h),
              "o_proj.weight": (h, q)}
    if shape.qkv_bias:
        shapes.update({"q_proj.bias": (q_rows,), "k_proj.bias": (kv,), "v_proj.bias": (kv,)})
    if parts.values_from_keys:  # no value projection of its own: the key projection's output
        shapes = {n: s for n, s in shapes.items() if not n.startswith("v_proj.")}
    if shape.o_bias:
        shapes["o_proj.bias"] = (h,)
    if parts.mask.sinks:
        shapes["sinks"] = (shape.num_heads,)
    norm = parts.qk_norm
    if norm is not None and not norm.weightless:
        widths = (q, kv) if norm.over_token else (d, d)
        shapes.update({n: (w,) for n, w in zip(norm.weights, widths)})
    if parts.takes_kv:  # another layer's K/V: no key/value projection, no key norm of its own
        k_norm = norm.weights[1] if norm is not None else None
        shapes = {n: s for n, s in shapes.items()
                  if not n.startswith(("k_proj.", "v_proj.")) and n != k_norm}
    return shapes
