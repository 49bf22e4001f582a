"""Vocabulary-sharded embedding and LM head with a fused cross-entropy (docs/design.md "Embedding
and LM head").

Rank p owns rows [p*V'/D, (p+1)*V'/D) of the table, V' = V rounded up to a multiple of D (the
padding rows are zeros, never looked up, never predicted). The embedding sends each token id to
the rank that owns its row and the rows back (all-to-all), so a rank moves S/D x h, never the
table. The loss circulates the vocabulary shards around the ring and keeps an online
log-sum-exp per token, in tiles of tokens (``TSPLMHead.tile_tokens``), so no [S/D, V] float32
logits exist at once, only a few [tile, V/D] (:mod:`.tiles`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import is_fake

from ..distributed import comm
from ..distributed.mesh import TSPMesh
from ..distributed.params import (
    ShardedModule,
    ShardSpec,
    chunk_spec,
    init_full,
    local,
    schedule_inputs,
)
from ..sequence.layout import IGNORE_INDEX
from .tiles import TokenTiled, grad_accumulator, loss_tile_tokens, token_tiles

# logits elements per token chunk of the full logits (tsp_core.inference.logits; 64 MiB in
# float32); the loss takes its tiles from TSPLMHead.tile_tokens
LOSS_CHUNK_ELEMENTS = 1 << 24


def vocab_spec(vocab_size: int, rank: int, size: int) -> ShardSpec:
    """Rows of the (padded) vocabulary owned by ``rank``."""
    return chunk_spec(vocab_size, rank, size)


class TSPEmbedding(ShardedModule):
    """``nn.Embedding`` whose ``weight`` [V, h] is split by rows over the TSP group."""

    def __init__(self, mesh: TSPMesh, num_embeddings: int, embedding_dim: int,
                 padding_idx: int | None = None, *, dtype: torch.dtype | None = None,
                 device: torch.device | str | None = None, init_seed: int | None = 0) -> None:
        super().__init__()
        self.mesh, self.num_embeddings, self.padding_idx = mesh, num_embeddings, padding_idx
        self.full_shapes = {"weight": (num_embeddings, embedding_dim)}
        self._create(init_full(self.full_shapes, init_seed, dtype, device))
        # Gemma: every output times this (scale_by), as HF's scaled word embedding does
        self.register_buffer("embed_scale", None, persistent=False)

    def extra_repr(self) -> str:
        return f"{self.full_shapes['weight']}, tsp_size={self.mesh.size}"

    def shard_spec(self, name: str, rank: int) -> ShardSpec:
        return vocab_spec(self.num_embeddings, rank, self.mesh.size)

    def scale_by(self, embed_scale: torch.Tensor) -> None:
        """Multiply every output by ``embed_scale`` cast to the weight's dtype, as Hugging Face's
        scaled word embeddings do (Gemma's sqrt(hidden_size), kept in float32)."""
        self.embed_scale = embed_scale.detach().clone()

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tsp_decode is not None:  # generation: ids identical on every rank
            out = self.tsp_decode.embed(self, input_ids)
        else:
            out = self._sharded(input_ids)
        if self.embed_scale is not None:
            out = out * self.embed_scale.to(out.dtype)
        return out

    def _sharded(self, input_ids: torch.Tensor) -> torch.Tensor:
        group, d = self.mesh.group, self.mesh.size
        per = local(self.weight).shape[0]
        flat = input_ids.reshape(-1)
        owner = flat.clamp(0, self.num_embeddings - 1) // per
        order = torch.argsort(owner, stable=True)
        if is_fake(flat):  # a memory simulation: ids have no values, assume they spread evenly
            splits = [flat.numel() // d + (r < flat.numel() % d) for r in range(d)]
            return self._lookup(input_ids, flat[order], order, splits, splits)
        bad = ((flat < 0) | (flat >= self.num_embeddings)).any()
        counts = torch.bincount(owner, minlength=d)
        # exchange counts with a "bad input" flag, so every rank raises together, never hangs
        send = torch.stack([counts, bad.long().expand(d)], 1)
        recv = torch.empty_like(send)
        comm.all_to_all(recv, send, group)
        if recv[:, 1].any():
            culprits = recv[:, 1].nonzero().flatten().tolist()
            raise ValueError(f"token ids out of range [0, {self.num_embeddings}) on TSP rank(s) "
                             f"{culprits}" + (f": this rank has {flat.min().item()}..."
                                              f"{flat.max().item()}" if bad else ""))
        return self._lookup(input_ids, flat[order], order, counts.tolist(), recv[:, 0].tolist())

    def _lookup(self, input_ids: torch.Tensor, sorted_ids: torch.Tensor, order: torch.Tensor,
                in_splits: list[int], out_splits: list[int]) -> torch.Tensor:
        """Send the ids (sorted by owner) to their owners, look them up, send the rows back."""
        group, me = self.mesh.group, self.mesh.rank
        table = local(self.weight)
        per = table.shape[0]
        ids = sorted_ids.new_empty(sum(out_splits))
        comm.all_to_all(ids, sorted_ids.contiguous(), group, out_splits, in_splits)
        start = me * per
        pad = self.padding_idx
        local_pad = pad - start if pad is not None and start <= pad < start + per else None
        rows = F.embedding(ids - start, table, padding_idx=local_pad)
        back = comm.all_to_all_rows(rows, group, in_splits, out_splits)
        return back.index_select(0, torch.argsort(order)).view(*input_ids.shape, -1)


def softcap(logits: torch.Tensor, cap: float | None) -> torch.Tensor:
    """``tanh(logits / cap) * cap`` in Hugging Face's order (Gemma 2's final logit soft-capping);
    ``cap`` None: the logits unchanged."""
    return logits if cap is None else torch.tanh(logits / cap) * cap


def _in_shard(labels: torch.Tensor, lo: int, valid: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Which labels fall in the shard's rows [lo, lo + valid), and their column there (clamped
    for the others): masks, not indices, so no host sync and no data-dependent shapes."""
    return (labels >= lo) & (labels < lo + valid), (labels - lo).clamp(0, valid - 1)


def _tile_logits(hidden: torch.Tensor, shard: torch.Tensor, acc: torch.dtype,
                 cap: float | None) -> torch.Tensor:
    """One tile's logits against one shard's valid rows, in ``acc``, soft-capped in place (the
    operations of :func:`softcap`, without its temporaries)."""
    logits = (hidden @ shard.t()).to(acc)
    return logits if cap is None else logits.div_(cap).tanh_().mul_(cap)


class _VocabParallelCE(torch.autograd.Function):
    """Sum over tokens of cross-entropy against vocabulary shards that circulate in a ring, of
    the logits soft-capped by ``cap`` (None: not capped), ``tile`` tokens at a time: at most
    :data:`tiles.LOSS_TILE_TENSORS` [tile, V/D] float32 tensors at once, forward and backward."""

    @staticmethod
    def forward(ctx, hidden, labels, weight, vocab_size: int, group, cap: float | None = None,
                tile: int = 1):
        acc = torch.float64 if hidden.dtype == torch.float64 else torch.float32
        n, per = hidden.shape[0], weight.shape[0]
        m = hidden.new_full((n,), float("-inf"), dtype=acc)
        ssum = hidden.new_zeros(n, dtype=acc)
        target = hidden.new_zeros(n, dtype=acc)

        def compute(owner: int, shard: torch.Tensor) -> None:
            lo = owner * per
            valid = max(0, min(per, vocab_size - lo))
            if valid == 0:
                return
            for sl in token_tiles(n, tile):
                logits = _tile_logits(hidden[sl], shard[:valid], acc, cap)
                m_new = torch.maximum(m[sl], logits.max(-1).values)
                inside, col = _in_shard(labels[sl], lo, valid)
                picked = logits.gather(1, col[:, None]).squeeze(1)
                target[sl] = torch.where(inside, picked, target[sl])
                ssum[sl] = ssum[sl] * torch.exp(m[sl] - m_new) + logits.sub_(
                    m_new[:, None]).exp_().sum(-1)
                m[sl] = m_new
                del logits  # before the next tile's

        comm.ring_over_shards(weight.contiguous(), group, compute)
        lse = m + torch.log(ssum)
        keep = labels != IGNORE_INDEX
        ctx.vocab_size, ctx.group, ctx.cap, ctx.tile = vocab_size, group, cap, tile
        ctx.save_for_backward(hidden, labels, weight, lse)
        return torch.where(keep, lse - target, 0).sum()

    @staticmethod
    def backward(ctx, g):
        hidden, labels, weight, lse = ctx.saved_tensors
        scale = (labels != IGNORE_INDEX).to(lse.dtype) * g.to(lse.dtype)
        dh, dw = _ring_backward(hidden, labels, weight, lse, scale, ctx.vocab_size, ctx.group,
                                ctx.cap, ctx.tile, ctx.needs_input_grad[2])
        return dh, None, dw, None, None, None, None


def _ring_backward(hidden: torch.Tensor, labels: torch.Tensor, weight: torch.Tensor,
                   lse: torch.Tensor, scale: torch.Tensor, vocab_size: int, group,
                   cap: float | None, tile: int, weight_grads: bool = True
                   ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Gradients of sum_i scale_i x (lse_i - logit_i[label_i]) with respect to the local hidden
    states and this rank's vocabulary shard (``scale`` zero where the label is ignored): the
    shards circulate again and each one's gradient travels back to its owner. Per tile of
    ``tile`` tokens at most two [tile, V/D] float32 tensors (the softmax and, with a cap, its
    tanh) and the softmax cast to the model's dtype exist at once. A frozen head
    (``weight_grads`` False: LoRA) gets no gradient: the shards circulate for dh alone."""
    n, per = hidden.shape[0], weight.shape[0]
    tiles = token_tiles(n, tile)
    dh = torch.zeros_like(hidden)

    def contribute(owner: int, shard: torch.Tensor) -> torch.Tensor:
        lo = owner * per
        valid = max(0, min(per, vocab_size - lo))
        dw = grad_accumulator(shard.numel(), shard.dtype, shard.device,
                              len(tiles)).view(shard.shape)
        for sl in tiles if valid else []:
            raw = (hidden[sl] @ shard[:valid].t()).to(lse.dtype)
            t = None if cap is None else raw.div_(cap).tanh_()
            p = (raw if t is None else t * cap).sub_(lse[sl, None]).exp_()
            del raw
            inside, col = _in_shard(labels[sl], lo, valid)
            p.scatter_add_(1, col[:, None], -inside.to(p.dtype)[:, None])
            p.mul_(scale[sl, None])
            if t is not None:  # through the cap: d(cap tanh(x / cap))/dx = 1 - tanh^2
                p.mul_(t.mul_(t).neg_().add_(1))
                del t
            p = p.to(hidden.dtype)
            dh[sl] += p @ shard[:valid]
            if weight_grads:
                dw[:valid] += p.t() @ hidden[sl]
            del p  # before the next tile's
        return dw.to(shard.dtype)

    if not weight_grads:
        comm.ring_over_shards(weight.contiguous(), group, contribute)
        return dh, None
    dw = comm.ring_over_shards_with_grads(weight.contiguous(), group, contribute)
    return dh, dw


class _VocabParallelTokenStats(torch.autograd.Function):
    """Per local token, against vocabulary shards that circulate in a ring (soft-capped by
    ``cap``): the label's log-probability (differentiable), the entropy of the next-token
    distribution and whether the label is its most likely token (the first one on ties, as
    ``argmax``), each zero where the label is ignored. Entropy and top-1 come from two more
    running sums in the same pass as the log-sum-exp (sum of exp(l - m) x l, and the largest
    logit before the label's column), so no rank ever holds another's shard's logits beyond a
    tile of ``tile`` tokens, nor the whole head. Also the mean logit over the vocabulary (a
    fourth sum)."""

    @staticmethod
    def forward(ctx, hidden, labels, weight, vocab_size: int, group, cap: float | None = None,
                tile: int = 1):
        acc = torch.float64 if hidden.dtype == torch.float64 else torch.float32
        n, per = hidden.shape[0], weight.shape[0]
        m = hidden.new_full((n,), float("-inf"), dtype=acc)
        ssum = hidden.new_zeros(n, dtype=acc)
        xsum = hidden.new_zeros(n, dtype=acc)  # sum of exp(l - m) x l: the mean logit under p
        target = hidden.new_zeros(n, dtype=acc)
        before = hidden.new_full((n,), float("-inf"), dtype=acc)  # max logit left of the label
        zsum = hidden.new_zeros(n, dtype=acc)  # sum of the logits

        def compute(owner: int, shard: torch.Tensor) -> None:
            lo = owner * per
            valid = max(0, min(per, vocab_size - lo))
            if valid == 0:
                return
            columns = torch.arange(lo, lo + valid, device=hidden.device)
            for sl in token_tiles(n, tile):
                logits = _tile_logits(hidden[sl], shard[:valid], acc, cap)
                m_new = torch.maximum(m[sl], logits.max(-1).values)
                zsum[sl] += logits.sum(-1)
                inside, col = _in_shard(labels[sl], lo, valid)
                picked = logits.gather(1, col[:, None]).squeeze(1)
                target[sl] = torch.where(inside, picked, target[sl])
                left = columns[None, :] < labels[sl, None]
                before[sl] = torch.maximum(before[sl], torch.where(
                    left, logits, float("-inf")).max(-1).values)
                del left
                decay = torch.exp(m[sl] - m_new)
                e = (logits - m_new[:, None]).exp_()
                ssum[sl] = ssum[sl] * decay + e.sum(-1)
                xsum[sl] = xsum[sl] * decay + e.mul_(logits).sum(-1)
                m[sl] = m_new
                del logits, e  # before the next tile's

        comm.ring_over_shards(weight.contiguous(), group, compute)
        lse = m + torch.log(ssum)
        keep = labels != IGNORE_INDEX
        log_probs = torch.where(keep, target - lse, 0)
        entropy = torch.where(keep, lse - xsum / ssum, 0)
        top1 = keep & (target >= m) & (target > before)
        mean_logits = torch.where(keep, zsum / vocab_size, 0)
        ctx.vocab_size, ctx.group, ctx.cap, ctx.tile = vocab_size, group, cap, tile
        ctx.save_for_backward(hidden, labels, weight, lse)
        ctx.mark_non_differentiable(entropy, top1, mean_logits)
        return log_probs, entropy, top1, mean_logits

    @staticmethod
    def backward(ctx, g, _entropy, _top1, _mean_logits):
        hidden, labels, weight, lse = ctx.saved_tensors
        if g is None:
            return None, None, None, None, None, None, None
        # d log p(label) / d logits = onehot - p: the loss's gradient with scale -g
        scale = -(labels != IGNORE_INDEX).to(lse.dtype) * g.to(lse.dtype)
        dh, dw = _ring_backward(hidden, labels, weight, lse, scale, ctx.vocab_size, ctx.group,
                                ctx.cap, ctx.tile, ctx.needs_input_grad[2])
        return dh, None, dw, None, None, None, None


class TSPLMHead(TokenTiled, ShardedModule):
    """LM head whose ``weight`` [V, h] is split by rows like :class:`TSPEmbedding` (and may be
    the embedding's very parameter, for tied embeddings). ``tile_tokens``: the losses take the
    local tokens that many at a time (None: :func:`tiles.loss_tile_tokens` of the sizes)."""

    def __init__(self, mesh: TSPMesh, vocab_size: int, hidden_size: int, *,
                 tied_to: TSPEmbedding | None = None, dtype: torch.dtype | None = None,
                 device: torch.device | str | None = None, init_seed: int | None = 0,
                 tile_tokens: int | None = None) -> None:
        super().__init__()
        self.tile_tokens = tile_tokens
        self.mesh, self.vocab_size = mesh, vocab_size
        self.full_shapes = {"weight": (vocab_size, hidden_size)}
        self.tied = tied_to is not None
        if tied_to is not None:
            if tied_to.full_shapes["weight"] != self.full_shapes["weight"]:
                raise ValueError(f"tied embedding has shape {tied_to.full_shapes['weight']}, "
                                 f"the LM head {self.full_shapes['weight']}")
            self.weight = tied_to.weight
        else:
            self._create(init_full(self.full_shapes, init_seed, dtype, device))

    # Granite: logits divided by this (config.logits_scaling), applied to the head's input
    logits_divisor: float = 1.0
    # Gemma 2: logits (after the divisor) soft-capped, tanh(logits / cap) * cap; None: not capped
    logits_softcap: float | None = None

    def extra_repr(self) -> str:
        return f"{self.full_shapes['weight']}, tsp_size={self.mesh.size}"

    def shard_spec(self, name: str, rank: int) -> ShardSpec:
        return vocab_spec(self.vocab_size, rank, self.mesh.size)

    def scale_input(self, hidden: torch.Tensor) -> torch.Tensor:
        """What the head multiplies: ``hidden / logits_divisor`` gives the logits divided by it."""
        return hidden if self.logits_divisor == 1.0 else hidden / self.logits_divisor

    def cap(self, logits: torch.Tensor) -> torch.Tensor:
        """What the head does to its logits after the product: ``logits_softcap``'s soft-cap."""
        return softcap(logits, self.logits_softcap)

    def _loss_inputs(self, hidden: torch.Tensor, shift_labels: torch.Tensor):
        """The hidden states, this rank's weight shard and the schedule's context that both
        losses start from, after checking that the labels are the local tokens'."""
        if tuple(shift_labels.shape) != tuple(hidden.shape[:-1]):
            raise ValueError(f"shift_labels of shape {tuple(shift_labels.shape)} do not match the "
                             f"local tokens {tuple(hidden.shape[:-1])}; shard with "
                             f"tsp_core.shard_batch")
        hidden, (weight,), context = schedule_inputs(self, ["weight"], hidden)
        return hidden, weight, context

    def loss_tile(self, hidden: torch.Tensor, weight: torch.Tensor) -> int:
        """The losses' tile: ``tile_tokens``, or chosen from the local vocabulary rows."""
        return self.tile_tokens or loss_tile_tokens(weight.shape[0], hidden.dtype)

    def loss_sum(self, hidden: torch.Tensor, shift_labels: torch.Tensor) -> torch.Tensor:
        """Sum of the local tokens' cross-entropy (ignore index -100), float32 (float64 for a
        float64 model); never materialises the local [tokens, V] logits at once."""
        hidden, weight, context = self._loss_inputs(hidden, shift_labels)
        with context:
            return _VocabParallelCE.apply(hidden.reshape(-1, hidden.shape[-1]),
                                          shift_labels.reshape(-1), weight, self.vocab_size,
                                          self.mesh.group, self.logits_softcap,
                                          self.loss_tile(hidden, weight))

    def token_stats(self, hidden: torch.Tensor, shift_labels: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Per local token: the label's log-probability (differentiable), the entropy of the
        next-token distribution, whether the label is its top-1 token and the mean logit over
        the vocabulary, each zero where the
        label is -100, shaped like ``shift_labels`` (what TRL's fused LM head returns; float32,
        float64 for a float64 model); never materialises the local [tokens, V] logits at once."""
        hidden, weight, context = self._loss_inputs(hidden, shift_labels)
        with context:
            out = _VocabParallelTokenStats.apply(
                hidden.reshape(-1, hidden.shape[-1]), shift_labels.reshape(-1), weight,
                self.vocab_size, self.mesh.group, self.logits_softcap,
                self.loss_tile(hidden, weight))
        return tuple(t.view(shift_labels.shape) for t in out)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits of the local tokens over the whole vocabulary [..., V] (each rank's shard is
        broadcast in turn; the backward reduces each shard's gradient to its owner)."""
        parts = []
        shard = local(self.weight)
        for r in range(self.mesh.size):
            valid = vocab_spec(self.vocab_size, r, self.mesh.size).length
            w = comm.owner_broadcast(shard, r, self.mesh.group)
            parts.append(F.linear(hidden, w[:valid]))
        return self.cap(torch.cat(parts, -1))
