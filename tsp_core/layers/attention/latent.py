"""Multi-head latent attention (DeepSeek-V2/V3's MLA) under TSP (docs/design.md "Multi-head
latent attention (DeepSeek-V3)").

MLA projects K and V of every head from one shared latent per token: ``c_kv`` (``kv_lora_rank``
channels, RMS-normalised) and one rotary key ``k_rope`` (``qk_rope_head_dim``) shared by all
heads; head i's ``[k_nope | v]`` is ``kv_b_proj``'s rows of head i applied to ``c_kv``. So the
schedule gathers the latent, not K/V:

- the small down-projections (``kv_a_proj_with_mqa``, ``kv_a_layernorm``, ``q_a_proj``,
  ``q_a_layernorm``) are replicated and run on this rank's tokens (their gradients summed over the
  group, as a norm's); :class:`TSPLatentAttention` does this part with plain autograd, which keeps
  only this rank's tokens' tensors;
- :class:`LatentAttentionFn`: ONE all-gather of this rank's latent ``[S/D, kv_lora_rank +
  qk_rope_head_dim]`` per layer and pass serves every round; round r broadcasts rank r's head group
  ``[q_b_r | kv_b_r | o_r]``, forms that group's K/V from the gathered latent, attends with the
  flash pieces of :mod:`tsp_core.layers.flash` and adds ``A_r o_r^T`` to the local output;
- backward: the latent is gathered again (never kept: docs/design.md "Memory rules"), each round
  re-broadcast; the latent's gradient is summed over the rounds and reduce-scattered ONCE to the
  token owners; each round's weight gradients are reduced onto its owner.

The query/key head size (``qk_nope + qk_rope``) differs from the value head size: the flash
kernels take one head size for q, k and v, so q, k and v are zero-padded to the larger of the two
(the scores and the output's first ``v_head_dim`` channels are unchanged; the padding is sliced
off), as Hugging Face's flash-attention path pads V.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ...distributed import comm
from ...distributed.flat_pack import FlatPack
from ...distributed.mesh import TSPMesh
from ...distributed.params import (
    REPLICATED,
    ShardedModule,
    ShardSpec,
    even_spec,
    init_full,
    local_replicated,
    schedule_inputs,
)
from .. import flash, rope
from ..inputs import check_local_input, checked_docs
from ..norm import rms_norm
from ..sizes import valid_sizes_hint, valid_tsp_sizes
from .parts import AttentionParts
from .rounds import (
    AttentionSpec,
    OwnerReduces,
    Rounds,
    by_rows,
    join_heads,
    row_groups,
    split_heads,
)


@dataclass(frozen=True)
class LatentSpec:
    """Static shape of one TSP multi-head latent attention layer."""

    hidden_size: int
    num_heads: int
    q_lora_rank: int | None     # None: one q_proj from the hidden state (DeepSeek-V2-Lite)
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    tsp_size: int
    scale: float
    layout: str = "zigzag"
    # DeepSeek's rope_interleave: the rotary channels are pairs (2i, 2i+1), rotated and written
    # back as [evens | odds] (Hugging Face's apply_rotary_pos_emb_interleave)
    rope_interleaved: bool = True

    @property
    def local_heads(self) -> int:
        return self.num_heads // self.tsp_size

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def padded_dim(self) -> int:
        """The one head size the kernels see: q, k and v zero-padded to it."""
        return max(self.qk_head_dim, self.v_head_dim)

    @property
    def latent_dim(self) -> int:
        """Channels of the latent each token contributes: ``[c_kv | k_rope]``."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    def __post_init__(self) -> None:
        # built here, not in the compiled forward: dynamo cannot construct AttentionParts' parts
        object.__setattr__(self, "_attention", AttentionSpec(
            self.hidden_size, self.num_heads, self.num_heads, self.padded_dim, self.tsp_size,
            self.layout, AttentionParts(scale=self.scale)))

    @property
    def attention(self) -> AttentionSpec:
        """The causal pattern's spec, for the row groups' flash pieces (tsp_core.layers.flash)."""
        return self._attention


def rotate(t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool
           ) -> torch.Tensor:
    """The rotary part [B, H, L, r] rotated at cos, sin [B, L, r]: rotate-half, or DeepSeek's
    interleaved pairs (evens and odds taken apart, then rotate-half: bit for bit Hugging Face's
    ``apply_rotary_pos_emb_interleave``)."""
    if interleaved:
        t = torch.cat((t[..., 0::2], t[..., 1::2]), dim=-1)
    return rope.apply(t, cos, sin)


def rotate_backward(g: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                    interleaved: bool) -> torch.Tensor:
    """Gradient of :func:`rotate` w.r.t. its input."""
    g = rope.apply_backward(g, cos, sin)
    if not interleaved:
        return g
    half = g.shape[-1] // 2
    out = torch.empty_like(g)
    out[..., 0::2], out[..., 1::2] = g[..., :half], g[..., half:]
    return out


def _pad(t: torch.Tensor, d: int) -> torch.Tensor:
    return t if t.shape[-1] == d else F.pad(t, (0, d - t.shape[-1]))


def latent_queries(q_in: torch.Tensor, wq: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
             spec: LatentSpec) -> torch.Tensor:
    """One head group's queries [B, heads, L, qk_head_dim] of this rank's tokens, the rotary
    part rotated."""
    q = split_heads(F.linear(q_in, wq), spec.local_heads)
    nope, rot = q.split([spec.qk_nope_head_dim, spec.qk_rope_head_dim], dim=-1)
    return torch.cat((nope, rotate(rot, cos, sin, spec.rope_interleaved)), dim=-1)


def _keys_values(latent: torch.Tensor, wkv: torch.Tensor, spec: LatentSpec) -> torch.Tensor:
    """One head group's packed, padded K/V [2, B, heads, S, padded_dim] from the gathered
    latent [B, S, latent_dim]: ``[k_nope | v]`` by the group's kv_b_proj rows, the shared rotary
    key repeated over the heads."""
    B, S, _ = latent.shape
    n, nope, dv, R = spec.local_heads, spec.qk_nope_head_dim, spec.v_head_dim, spec.kv_lora_rank
    kv = F.linear(latent[..., :R], wkv).view(B, S, n, nope + dv).transpose(1, 2)
    out = latent.new_zeros(2, B, n, S, spec.padded_dim)
    out[0, ..., :nope] = kv[..., :nope]
    out[0, ..., nope:spec.qk_head_dim] = latent[:, None, :, R:]
    out[1, ..., :dv] = kv[..., nope:]
    return out


def _gather(latent: torch.Tensor, groups, spec: LatentSpec, group: dist.ProcessGroup):
    """Start the latent's all-gather, one per row group (one for unpacked rows)."""
    return [comm.start_all_gather_sequence(latent[g.rows], group, 1, spec.layout, g.docs)
            for g in groups]


class LatentAttentionFn(torch.autograd.Function):
    """The rounds of one MLA layer. Inputs: ``q_in`` [B, L, q width] (the normalised
    ``q_a_proj`` output, or the hidden state without ``q_lora_rank``), ``latent`` [B, L,
    latent_dim] (this rank's tokens' normalised ``c_kv`` and rotated ``k_rope``), cos/sin, and
    this rank's shards of ``q_b_proj`` (or ``q_proj``), ``kv_b_proj`` and ``o_proj``. Kept for
    backward: those inputs and shards, this rank's queries of every head, the attention output
    and LSE: nothing from another rank (the gathered latent is gathered again)."""

    @staticmethod
    def forward(ctx, q_in, latent, cos, sin, spec: LatentSpec, group, docs, kv_sink, wq, wkv, wo):
        B, L, _ = q_in.shape
        D, n, d = spec.tsp_size, spec.local_heads, spec.padded_dim
        groups = row_groups(docs, L * D, dist.get_rank(group), spec.attention)
        pending = _gather(latent, groups, spec, group)
        pack = FlatPack([wq.shape, wkv.shape, wo.shape])
        q_all = q_in.new_empty(D, B, n, L, spec.qk_head_dim)
        out_all = q_in.new_empty(D, B, n, L, spec.v_head_dim)
        lse_all = q_in.new_empty(D, B, n, L, dtype=torch.float64 if q_in.dtype == torch.float64
                                 else torch.float32)
        y = q_in.new_zeros(B, L, spec.hidden_size)
        full = None
        for r, buf in Rounds(pack.pack([wq, wkv, wo]), group):
            wq_r, wkv_r, wo_r = pack.unpack(buf)
            q_all[r] = latent_queries(q_in, wq_r, cos, sin, spec)
            if full is None:  # the latent of the whole sequence, once for every round
                full = [p.wait() for p in pending]
            for g, lat in zip(groups, full):
                kv = _keys_values(lat, wkv_r, spec)
                o, lse = flash.attention_forward(_pad(q_all[r][g.rows], d), kv[0], kv[1],
                                                 g.pieces, spec.scale)
                out_all[r][g.rows], lse_all[r][g.rows] = o[..., :spec.v_head_dim], lse
                del kv
            y.view(B * L, -1).addmm_(join_heads(out_all[r]).reshape(B * L, -1), wo_r.t())
        del full  # never kept for backward: gathered again there
        if kv_sink is not None:  # prefill: this rank's tokens' latent (tsp_core.inference)
            kv_sink(latent)
        ctx.spec, ctx.group, ctx.groups = spec, group, groups
        ctx.save_for_backward(q_in, latent, cos, sin, q_all, out_all, lse_all, wq, wkv, wo)
        return y

    @staticmethod
    def backward(ctx, dy):
        spec, group, groups = ctx.spec, ctx.group, ctx.groups
        q_in, latent, cos, sin, q_all, out_all, lse_all, wq, wkv, wo = ctx.saved_tensors
        pending = _gather(latent, groups, spec, group)
        B, L, _ = q_in.shape
        n, d, R = spec.local_heads, spec.padded_dim, spec.kv_lora_rank
        nope, dqk, dv = spec.qk_nope_head_dim, spec.qk_head_dim, spec.v_head_dim
        acc = torch.float64 if q_in.dtype == torch.float64 else torch.float32
        pack = FlatPack([wq.shape, wkv.shape, wo.shape])
        dy = dy.contiguous()
        dy2, q2 = dy.reshape(B * L, -1), q_in.reshape(B * L, -1)
        dq_in = torch.zeros_like(q_in)
        reduces = OwnerReduces(group)
        full, dlat = None, None
        for r, buf in Rounds(pack.pack([wq, wkv, wo]), group):
            wq_r, wkv_r, wo_r = pack.unpack(buf)
            do = split_heads(F.linear(dy, wo_r.t()), n)
            if full is None:
                full = [p.wait() for p in pending]
                dlat = [lat.new_zeros(lat.shape, dtype=acc) for lat in full]
            gwkv = torch.zeros_like(wkv_r)
            dq_parts = []
            for i, (g, lat) in enumerate(zip(groups, full)):
                kv = _keys_values(lat, wkv_r, spec)
                dq_g, dkv = flash.attention_backward(
                    _pad(do[g.rows], d), _pad(q_all[r][g.rows], d), kv,
                    _pad(out_all[r][g.rows], d), lse_all[r][g.rows], g.pieces, spec.scale)
                del kv
                b, S = lat.shape[0], lat.shape[1]
                # [dk_nope | dv] of each head (the float32 sums cast once, without the padding),
                # as kv_b_proj's output [b*S, heads*(nope + dv)]
                dproj = torch.cat((dkv[0, ..., :nope], dkv[1, ..., :dv]), dim=-1).to(q_in.dtype)
                dproj = dproj.transpose(1, 2).reshape(b * S, -1)
                gwkv += dproj.t() @ lat[..., :R].reshape(b * S, R)
                dlat[i][..., :R] += (dproj @ wkv_r).view(b, S, R)
                dlat[i][..., R:] += dkv[0, ..., nope:dqk].sum(1)  # the shared rotary key
                del dkv, dproj
                dq_parts.append((g.rows, dq_g[..., :dqk]))
            dq = by_rows(dq_parts, q_all[r])
            rot = rotate_backward(dq[..., nope:], cos, sin, spec.rope_interleaved)
            dq = join_heads(torch.cat((dq[..., :nope], rot), dim=-1)).reshape(B * L, -1)
            dq_in.view(B * L, -1).addmm_(dq, wq_r)
            grads = [dq.t() @ q2, gwkv, dy2.t() @ join_heads(out_all[r]).reshape(B * L, -1)]
            reduces.send(r, pack.pack(grads))
        del full
        parts = [(g.rows, comm.reduce_scatter_sequence(t.to(latent.dtype), group, 1, spec.layout,
                                                       g.docs))
                 for g, t in zip(groups, dlat)]
        del dlat
        dlatent = by_rows(parts, latent)
        gwq, gwkv, gwo = pack.unpack(reduces.finish())
        return dq_in, dlatent, None, None, None, None, None, None, gwq, gwkv, gwo


def check_latent_shape(tsp_size: int, num_heads: int, valid: Sequence[int] | None = None) -> None:
    """Raise, naming the numbers, when the heads cannot be split over ``tsp_size`` ranks."""
    if num_heads % tsp_size:
        valid = valid_tsp_sizes(num_heads) if valid is None else valid
        raise ValueError(f"tsp_size ({tsp_size}) must divide num_attention_heads ({num_heads}) "
                         f"of the latent attention; {valid_sizes_hint(valid)}")


class TSPLatentAttention(ShardedModule):
    """Multi-head latent attention (DeepSeek-V3's ``DeepseekV3Attention``) sharded by heads over
    the TSP group, under Hugging Face's parameter names: ``q_a_proj``, ``q_a_layernorm``,
    ``kv_a_proj_with_mqa`` and ``kv_a_layernorm`` replicated (gradients summed over the group),
    ``q_b_proj`` (or ``q_proj`` without ``q_lora_rank``) and ``kv_b_proj`` by head rows,
    ``o_proj`` by head columns. ``scale``: the softmax scale (Hugging Face's ``scaling``, yarn's
    mscale included); ``q_norm_eps``/``kv_norm_eps``: the two RMSNorms' epsilons;
    ``attention_bias``: biases on q_a_proj, kv_a_proj_with_mqa and o_proj.

    ``forward(x, position_embeddings=(cos, sin))`` takes this rank's tokens [B, S/D, hidden] and
    the rotary cos/sin [B, S/D, qk_rope_head_dim] of their global positions."""

    def __init__(self, mesh: TSPMesh, hidden_size: int, num_heads: int, *,
                 q_lora_rank: int | None, kv_lora_rank: int, qk_nope_head_dim: int,
                 qk_rope_head_dim: int, v_head_dim: int, scale: float | None = None,
                 rope_interleaved: bool = True, attention_bias: bool = False,
                 q_norm_eps: float = 1e-6, kv_norm_eps: float = 1e-6,
                 dtype: torch.dtype | None = None, device: torch.device | str | None = None,
                 init_seed: int | None = 0) -> None:
        super().__init__()
        check_latent_shape(mesh.size, num_heads)
        if qk_rope_head_dim % 2:
            raise ValueError(f"qk_rope_head_dim ({qk_rope_head_dim}) must be even (rotary pairs)")
        self.mesh, self.q_norm_eps, self.kv_norm_eps = mesh, q_norm_eps, kv_norm_eps
        qk = qk_nope_head_dim + qk_rope_head_dim
        scale = qk ** -0.5 if scale is None else scale
        self.spec = LatentSpec(hidden_size, num_heads, q_lora_rank, kv_lora_rank,
                               qk_nope_head_dim, qk_rope_head_dim, v_head_dim, mesh.size, scale,
                               mesh.layout, rope_interleaved)
        h, s = hidden_size, self.spec
        shapes: dict[str, tuple[int, ...]] = {}
        if q_lora_rank is None:
            shapes["q_proj.weight"] = (num_heads * qk, h)
        else:
            shapes["q_a_proj.weight"] = (q_lora_rank, h)
            if attention_bias:
                shapes["q_a_proj.bias"] = (q_lora_rank,)
            shapes["q_a_layernorm.weight"] = (q_lora_rank,)
            shapes["q_b_proj.weight"] = (num_heads * qk, q_lora_rank)
        shapes["kv_a_proj_with_mqa.weight"] = (s.latent_dim, h)
        if attention_bias:
            shapes["kv_a_proj_with_mqa.bias"] = (s.latent_dim,)
        shapes["kv_a_layernorm.weight"] = (kv_lora_rank,)
        shapes["kv_b_proj.weight"] = (num_heads * (qk_nope_head_dim + v_head_dim), kv_lora_rank)
        shapes["o_proj.weight"] = (h, num_heads * v_head_dim)
        if attention_bias:
            shapes["o_proj.bias"] = (h,)
        self.full_shapes = shapes
        ones = ("q_a_layernorm.weight", "kv_a_layernorm.weight")
        self._create(init_full(shapes, init_seed, dtype, device, ones=ones))

    SHARDED = {"q_proj.weight": 0, "q_b_proj.weight": 0, "kv_b_proj.weight": 0,
               "o_proj.weight": 1}

    def shard_spec(self, name: str, rank: int) -> ShardSpec:
        dim = self.SHARDED.get(name)
        if dim is None:
            return REPLICATED
        return even_spec(self.full_shapes[name][dim], rank, self.mesh.size, dim)

    def extra_repr(self) -> str:
        s = self.spec
        return (f"hidden_size={s.hidden_size}, heads={s.num_heads}, q_lora_rank={s.q_lora_rank}, "
                f"kv_lora_rank={s.kv_lora_rank}, qk_nope/rope/v={s.qk_nope_head_dim}/"
                f"{s.qk_rope_head_dim}/{s.v_head_dim}, tsp_size={s.tsp_size}")

    def _replicated(self, name: str) -> torch.Tensor | None:
        if name not in self.full_shapes:
            return None
        return local_replicated(self.get_parameter(name), self.mesh)

    def local_latent(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's tokens' query input (``q_a_layernorm(q_a_proj(x))``, or x) and latent
        ``[kv_a_layernorm(c_kv) | rotated k_rope]``, by plain autograd: only own tokens."""
        s = self.spec
        rep = self._replicated
        q_in = x
        if s.q_lora_rank is not None:
            q_in = rms_norm(F.linear(x, rep("q_a_proj.weight"), rep("q_a_proj.bias")),
                            rep("q_a_layernorm.weight"), self.q_norm_eps)
        ckv = F.linear(x, rep("kv_a_proj_with_mqa.weight"), rep("kv_a_proj_with_mqa.bias"))
        c, k_rot = ckv.split([s.kv_lora_rank, s.qk_rope_head_dim], dim=-1)
        c = rms_norm(c, rep("kv_a_layernorm.weight"), self.kv_norm_eps)
        k_rot = rotate(k_rot[:, None], cos, sin, s.rope_interleaved)[:, 0]
        return q_in, torch.cat((c, k_rot), dim=-1)

    def forward(self, x: torch.Tensor, position_embeddings: tuple[torch.Tensor, torch.Tensor],
                *, docs: Sequence[Sequence[int]] | None = None,
                kv_sink: Callable[[torch.Tensor], None] | None = None) -> torch.Tensor:
        """``docs``: packed rows' document lengths (as TSPAttention takes them); ``kv_sink``
        (prefill) is called with this rank's tokens' latent [B, S/D, latent_dim]."""
        s = self.spec
        check_local_input(x, s.hidden_size)
        if position_embeddings is None or position_embeddings[0].shape[-1] != s.qk_rope_head_dim:
            width = None if position_embeddings is None else position_embeddings[0].shape[-1]
            raise ValueError(f"position_embeddings: cos/sin of qk_rope_head_dim "
                             f"({s.qk_rope_head_dim}) channels are needed, got {width}")
        docs = checked_docs(docs, x, s.tsp_size)
        cos, sin = rope.rotation_inputs(position_embeddings, x.dtype)
        q_in, latent = self.local_latent(x, cos, sin)
        names = ["q_proj.weight" if s.q_lora_rank is None else "q_b_proj.weight",
                 "kv_b_proj.weight", "o_proj.weight"]
        q_in, weights, context = schedule_inputs(self, names, q_in)
        with context:
            y = LatentAttentionFn.apply(q_in, latent.to(q_in.dtype), cos, sin, s,
                                        self.mesh.group, docs, kv_sink, *weights)
        if "o_proj.bias" in self.full_shapes:
            y = y + self._replicated("o_proj.bias")
        return y


def latent_collectives(spec: LatentSpec, batch: int, seq: int, element_bytes: int,
                       replicated: Sequence[int]) -> dict[str, dict[str, tuple[int, float]]]:
    """The collectives of one MLA layer per rank by pass: kind -> (calls, bytes by the ring rule
    of :mod:`tsp_core.distributed.comm`), for ``batch`` rows of ``seq`` tokens over D =
    ``spec.tsp_size`` > 1 ranks; ``replicated``: the element counts of the replicated parameters
    (q_a_proj, q_a_layernorm, kv_a_proj_with_mqa, kv_a_layernorm and their biases), each summed
    by one all-reduce in the backward (docs/design.md "Multi-head latent attention (DeepSeek-V3)"):

    - forward: D broadcasts of one head group's ``[q_b | kv_b | o]`` (together ``(D-1)/D W``,
      ``W = nq (dqk q_width + (nope + dv) kv_lora_rank + dv h)``) and ONE all-gather of the
      latent, ``(D-1)/D B S (kv_lora_rank + qk_rope_head_dim)``;
    - backward: the same again, D reduces of the weight gradients (``(D-1)/D W``), ONE
      reduce-scatter of the latent's gradient (as the gather), and the replicated gradients'
      all-reduces (``2 (D-1)/D`` each)."""
    D, e = spec.tsp_size, element_bytes
    q_width = spec.hidden_size if spec.q_lora_rank is None else spec.q_lora_rank
    w = spec.num_heads * (spec.qk_head_dim * q_width
                          + (spec.qk_nope_head_dim + spec.v_head_dim) * spec.kv_lora_rank
                          + spec.v_head_dim * spec.hidden_size)
    share = (D - 1) / D
    weights = (D, share * w * e)
    latent = (1, share * batch * seq * spec.latent_dim * e)
    forward = {"broadcast": weights, "all_gather": latent}
    backward = {**forward, "reduce": weights, "reduce_scatter": latent}
    if replicated:
        backward["all_reduce"] = (len(replicated), 2 * share * sum(replicated) * e)
    return {"forward": forward, "backward": backward}
