"""The TSP attention ``nn.Module``: the shards this rank owns, the checks on its inputs, and the
choice of schedule (one head group per round, or the phased schedule when q/k norms span every
head of a token)."""

from __future__ import annotations

from typing import Callable, Sequence

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
from ..inputs import check_local_input, checked_docs
from ..norm import NORMS as NORM_KINDS
from ..norm import WEIGHTLESS
from ..sizes import valid_sizes_hint, valid_tsp_sizes
from .per_group import PerGroupAttentionFn
from .phased import PhasedAttentionFn
from .rounds import AttentionSpec


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


class TSPAttention(ShardedModule):
    """Multi-head / grouped-query attention with TSP: rank p owns query heads
    [p*nq/D, (p+1)*nq/D), the key/value heads they use (with fewer key/value heads than ranks, an
    even 1/D slice of the key/value rows instead, so no weight is stored twice), and the matching
    columns of o_proj. Parameters carry Hugging Face names and shapes: ``q_proj.weight``
    [nq*d, h], ``k_proj.weight``, ``v_proj.weight`` [nkv*d, h], ``o_proj.weight`` [h, nq*d],
    optional biases, and with ``qk_norm_eps`` the per-head RMSNorm weights ``q_norm.weight``,
    ``k_norm.weight`` [d] (replicated; applied to every query/key head before RoPE, Qwen3), or
    with ``qk_norm_all_heads`` norms over all heads of a token, [nq*d] and [nkv*d] (OLMo 2; the
    phased schedule of :mod:`tsp_core.layers.attention.phased`). With ``sinks``, the per-head
    sink logits ``sinks`` [nq] (gpt-oss: one more softmax column without a value), sharded with
    the query heads (each round's shard carries its owner's sinks; their gradient goes back with
    the round's weight gradients).
    ``attention_chunk_size``: a query sees only the keys of its own chunk of that many tokens
    (Llama 4's chunked local attention; a policy passes it on the layers with RoPE).
    ``v_norm_eps``: each value head RMS-normalised without a learned scale, in
    ``qk_norm_kind``'s numerics (Gemma 4's v_norm). ``values_from_keys``: no ``v_proj``; the
    values are the key projection's output before the key norm and RoPE (Gemma 4's
    ``attention_k_eq_v``); each round then carries the key rows twice. ``kv_out``: ``forward``
    returns ``(output, kv_all)``, this rank's tokens' K/V, for later layers to reuse;
    ``kv_shared``: no key/value projection or key norm, ``forward(..., shared_kv=kv_all)``
    attends with another layer's (Gemma 4's KV-shared layers), whose gradient goes back to it.
    ``qk_norm_kind`` "l2" (Llama 4's ``qk_norm``): the per-head q/k norm has no weight, so
    there are no ``q_norm``/``k_norm`` parameters. ``query_scale(positions, dtype)``: every query
    is multiplied by a factor of its global position in the row (Llama 4's attention temperature
    tuning on its NoPE layers), after RoPE and the q/k norm, in training, prefill and decode;
    packed rows are refused on such a layer (Hugging Face counts the position across documents).
    ``output_gate`` (Qwen3.5, Qwen3-Next): ``q_proj`` has 2 * head_dim rows per head, [query |
    gate], and each head's attention output is multiplied by sigmoid(gate) before ``o_proj``;
    each round computes the gate of this rank's tokens from the broadcast query shard (and
    recomputes it in the backward), so its gradient joins the query shard's, reduced to the
    owner with the round's other gradients.

    ``forward(x, position_ids)`` takes this rank's tokens [B, S/D, hidden] and their *global*
    positions [B, S/D] and returns this rank's output tokens. A model that computes its own rotary
    cos/sin passes ``position_embeddings=(cos, sin)`` instead.
    """

    def __init__(self, mesh: TSPMesh, hidden_size: int, num_heads: int,
                 num_kv_heads: int | None = None, head_dim: int | None = None, *,
                 qkv_bias: bool = False, o_bias: bool = False, rope_theta: float = 10000.0,
                 causal: bool = True, sliding_window: int | None = None,
                 scale: float | None = None, qk_norm_eps: float | None = None,
                 qk_norm_kind: str = "llama", softcap: float | None = None,
                 qk_norm_all_heads: bool = False, rope_interleaved: bool = False,
                 qk_norm_after_rope: bool = False,
                 qk_norm_names: tuple[str, str] = ("q_norm", "k_norm"),
                 attention_chunk_size: int | None = None, sinks: bool = False,
                 v_norm_eps: float | None = None, values_from_keys: bool = False,
                 kv_shared: bool = False, kv_out: bool = False,
                 query_scale: Callable[[torch.Tensor, torch.dtype], torch.Tensor] | None = None,
                 output_gate: bool = False, dtype: torch.dtype | None = None,
                 device: torch.device | str | None = None, init_seed: int | None = 0) -> None:
        super().__init__()
        num_kv_heads = num_kv_heads or num_heads
        if head_dim is None:
            if hidden_size % num_heads:
                raise ValueError(f"num_attention_heads ({num_heads}) must divide hidden_size "
                                 f"({hidden_size}) unless head_dim is given")
            head_dim = hidden_size // num_heads
        check_attention_shape(mesh.size, hidden_size, num_heads, num_kv_heads, head_dim)
        if attention_chunk_size is not None and (not causal or attention_chunk_size < 1):
            raise ValueError(f"attention_chunk_size ({attention_chunk_size}) needs causal "
                             f"attention (causal={causal}) and a chunk of at least 1 token")
        if qk_norm_after_rope and qk_norm_all_heads:
            raise ValueError("qk_norm_after_rope is implemented for per-head q/k norms only, not "
                             "with qk_norm_all_heads")
        if qk_norm_kind not in NORM_KINDS:
            raise ValueError(f"unknown q/k norm kind {qk_norm_kind!r}; one of "
                             f"{sorted(NORM_KINDS)}")
        if qk_norm_kind in WEIGHTLESS and qk_norm_all_heads:
            raise ValueError(f"the {qk_norm_kind!r} q/k norm (no weight) is per head; "
                             f"qk_norm_all_heads is not implemented for it")
        if v_norm_eps is not None and qk_norm_all_heads:
            raise ValueError("v_norm_eps (a per-head value norm) is implemented on the default "
                             "schedule only, not with qk_norm_all_heads")
        if output_gate and qk_norm_all_heads:
            raise ValueError("output_gate (a per-head output gate) is implemented on the default "
                             "schedule only, not with qk_norm_all_heads")
        if (kv_shared or kv_out) and qk_norm_all_heads:
            raise ValueError("KV-shared layers (kv_shared, kv_out) are implemented on the default "
                             "schedule only, not with qk_norm_all_heads")
        self.values_from_keys = values_from_keys
        self.NORMS = tuple(f"{n}.weight" for n in qk_norm_names)  # the q/k norms' HF names
        self.mesh = mesh
        self.spec = AttentionSpec(hidden_size, num_heads, num_kv_heads, head_dim, mesh.size,
                                  mesh.layout, causal, sliding_window, scale, qk_norm_eps,
                                  qk_norm_kind, softcap=softcap,
                                  qk_norm_all_heads=qk_norm_all_heads,
                                  qk_norm_after_rope=qk_norm_after_rope,
                                  rope_interleaved=rope_interleaved,
                                  chunk_size=attention_chunk_size, sinks=sinks,
                                  v_norm_eps=v_norm_eps, query_scale=query_scale,
                                  kv_shared=kv_shared, kv_out=kv_out, output_gate=output_gate)
        self.register_buffer("inv_freq", rope.default_inv_freq(head_dim, rope_theta),
                             persistent=False)
        q, kv = num_heads * head_dim, num_kv_heads * head_dim
        q_rows = 2 * q if output_gate else q  # each head's [query | gate] rows
        self.full_shapes = {"q_proj.weight": (q_rows, hidden_size), "k_proj.weight": (kv, hidden_size),
                            "v_proj.weight": (kv, hidden_size), "o_proj.weight": (hidden_size, q)}
        if qkv_bias:
            self.full_shapes.update({"q_proj.bias": (q_rows,), "k_proj.bias": (kv,),
                                     "v_proj.bias": (kv,)})
        if values_from_keys:  # no value projection of its own: the key projection's output
            self.full_shapes = {n: s for n, s in self.full_shapes.items()
                                if not n.startswith("v_proj.")}
        if o_bias:
            self.full_shapes["o_proj.bias"] = (hidden_size,)
        if sinks:
            self.full_shapes["sinks"] = (num_heads,)
        if qk_norm_eps is not None and qk_norm_kind not in WEIGHTLESS:
            widths = (q, kv) if qk_norm_all_heads else (head_dim, head_dim)
            self.full_shapes.update({n: (w,) for n, w in zip(self.NORMS, widths)})
        if kv_shared:  # another layer's K/V: no key/value projection, no key norm of its own
            self.full_shapes = {n: s for n, s in self.full_shapes.items()
                                if not n.startswith(("k_proj.", "v_proj.")) and n != self.NORMS[1]}
        ones = self.NORMS if qk_norm_kind != "gemma" else ()  # gemma's: an offset from one
        full = init_full(self.full_shapes, init_seed, dtype, device, ones=ones)
        for n in self.NORMS if qk_norm_kind == "gemma" and qk_norm_eps is not None else ():
            full[n].zero_()
        self._create(full)

    def _apply(self, fn, recurse=True):
        return rope.keep_frequencies(self, lambda: super(TSPAttention, self)._apply(fn, recurse))

    def extra_repr(self) -> str:
        s = self.spec
        return (f"hidden_size={s.hidden_size}, heads={s.num_heads}/{s.num_kv_heads}, "
                f"head_dim={s.head_dim}, tsp_size={s.tsp_size}, sliding_window={s.sliding_window}"
                + (f", attention_chunk_size={s.chunk_size}" if s.chunk_size is not None else "")
                + (", sinks=True" if s.sinks else "")
                + (f", qk_norm={s.qk_norm_kind}" if s.qk_norm_eps is not None else "")
                + (f", query_scale={s.query_scale}" if s.query_scale is not None else "")
                + (f", v_norm_eps={s.v_norm_eps}" if s.v_norm_eps is not None else "")
                + (", values_from_keys=True" if self.values_from_keys else "")
                + (", output_gate=True" if s.output_gate else ""))

    NORMS = ("q_norm.weight", "k_norm.weight")

    def shard_spec(self, name: str, rank: int) -> ShardSpec:
        s = self.spec
        if name == "o_proj.bias" or name in self.NORMS:
            return REPLICATED
        if name.startswith(("k_proj", "v_proj")) and s.kv_replicas > 1:
            return chunk_spec(s.num_kv_heads * s.head_dim, rank, s.tsp_size)  # see _Shards
        dim = 1 if name == "o_proj.weight" else 0
        return even_spec(self.full_shapes[name][dim], rank, s.tsp_size, dim)

    def _weight_names(self) -> list[str]:
        """The schedule's weights in its order; with ``values_from_keys`` the key projection
        stands in the value projection's place too (the schedule computes V from it as from any
        value projection; autograd sums the two gradients of the one parameter)."""
        if self.spec.kv_shared:  # (wq, wo[, bq]): the K/V are another layer's
            names = ["q_proj.weight", "o_proj.weight"]
            names += ["q_proj.bias"] if "q_proj.bias" in self.full_shapes else []
            return names + (["sinks"] if self.spec.sinks else [])
        v = "k_proj" if self.values_from_keys else "v_proj"
        names = ["q_proj.weight", "k_proj.weight", f"{v}.weight", "o_proj.weight"]
        if "q_proj.bias" in self.full_shapes:
            names += ["q_proj.bias", "k_proj.bias", f"{v}.bias"]
        return names + (["sinks"] if self.spec.sinks else [])  # sharded with the query heads

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
        another rank. ``shared_kv``: with ``kv_shared``, the ``kv_all`` another layer returned
        (Gemma 4's KV-shared layers). With ``kv_out`` the result is ``(output, kv_all)``."""
        s = self.spec
        if s.kv_shared != (shared_kv is not None):
            raise ValueError(f"a layer {'with' if s.kv_shared else 'without'} kv_shared takes "
                             f"{'the' if s.kv_shared else 'no'} shared_kv of the layer it reuses")
        check_local_input(x, s.hidden_size)
        if x.shape[1] % (2 if s.layout == "zigzag" else 1):
            raise ValueError(f"local sequence length ({x.shape[1]}) must be even under the zigzag "
                             f"layout (2 chunks per rank); shard with tsp_core.shard_batch")
        docs = checked_docs(docs, x, s.tsp_size)
        if docs is not None:
            packed = [b for b, row in enumerate(docs) if len(row) > 1]
            if s.query_scale is not None and packed:  # same docs on every rank: all raise here
                raise ValueError(
                    f"packed rows (row {packed[0]} holds {len(docs[packed[0]])} documents: "
                    f"{docs[packed[0]]}) on a layer whose queries are scaled by their position "
                    f"({s.query_scale}): Hugging Face scales them by the position in the row "
                    f"(Llama 4's attn_temperature_tuning counts across documents), which a row "
                    f"whose documents shard_batch padded to multiples of {2 * s.tsp_size} "
                    f"cannot give; feed one document per row, or set "
                    f"attn_temperature_tuning=False")
        if position_embeddings is None:
            if position_ids is None:
                raise ValueError("pass the global position_ids of the local tokens (from "
                                 "tsp_core.shard_batch) or position_embeddings=(cos, sin)")
            if position_ids.dim() == 1:
                position_ids = position_ids.unsqueeze(0).expand(x.shape[0], -1)
            if tuple(position_ids.shape) != tuple(x.shape[:2]):
                raise ValueError(f"position_ids of shape {tuple(position_ids.shape)} do not match "
                                 f"the input's [batch, local_seq] = {tuple(x.shape[:2])}")
            position_embeddings = rope.cos_sin(position_ids, self.inv_freq, 1.0, x.dtype)
        weightless = s.qk_norm_eps is not None and s.qk_norm_kind in WEIGHTLESS
        norms = list(self.NORMS) if s.qk_norm_eps is not None and not weightless else []
        norms = norms[:1] if s.kv_shared else norms
        x, weights, context = schedule_inputs(self, self._weight_names() + norms, x)
        if norms:  # replicated: every rank normalises its own tokens, gradients summed
            weights[-len(norms):] = [comm.sum_grad(w, self.mesh.group)
                                     for w in weights[-len(norms):]]
        if weightless:  # the schedules take norm weights: empty placeholders, never read
            weights += [x.new_empty(0)] * (1 if s.kv_shared else 2)
        if s.kv_shared:
            weights = [shared_kv, *weights]
        cos, sin = rope.rotation_inputs(real_rotary(position_embeddings), x.dtype)
        fn = PhasedAttentionFn if s.qk_norm_all_heads else PerGroupAttentionFn
        with context:
            y = fn.apply(x, cos, sin, s, self.mesh.group, docs, kv_sink, *weights)
        y, kv_all = y if s.kv_out else (y, None)
        if "o_proj.bias" in self.full_shapes:
            y = y + local_replicated(self.o_proj.bias, self.mesh)
        return (y, kv_all) if s.kv_out else y
