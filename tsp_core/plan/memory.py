"""Per-rank memory of one training step, by arithmetic (the planner's side of ``tsp simulate``).

Assumptions are those of ``tsp simulate``: full recompute (each decoder layer keeps only its input),
AdamW with two moments in the parameters' dtype, batch ``B`` of sequences of ``S`` tokens.

The peak is not "everything at once": MemTracker's peak is one moment. Two moments compete:

- **A**, early in the backward: every layer's checkpoint is alive, almost no gradient exists
  (the LM head's, and the last layer's MLP while its attention runs backward); or, just before
  it, the loss with its logits.
- **B**, late in the backward: one checkpoint is left, every gradient but the first layer's and the
  embedding's exists.

Long sequences peak at A (checkpoints dominate), short ones at B (gradients dominate). Each moment
adds the working set of what runs then: one layer's recomputed activations and its backward
temporaries, counted tensor by tensor below (``docs/planning.md`` lists them). The tensor counts
are read from the code paths, not fitted; where they miss, ``docs/planning.md`` says by how much.

FSDP2 over ``dp_shard`` ranks (docs/design.md "FSDP2 on the data-parallel axis";
:func:`fsdp_terms`): parameters, optimizer states and the gradients FSDP2 has reduce-scattered are
1/dp_shard of the above; FSDP2's own buffers are added at each moment as ``tsp simulate --dp-shard``
measures them under the real ``fully_shard``.

Sparse mixture-of-experts layers (Mixtral, Qwen3-MoE) under uniform routing: each rank holds
1/D (1/T) of the experts and the whole router; the MLP's working set is that of TSP's schedule (a)
(:func:`moe_working_set`) or of the baselines' tensor-parallel experts
(:func:`grouped_experts_working_set`).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..baselines.layouts import LayoutSpec
from ..layers.attention import backward_floor_bytes
from ..layers.linear_attention.delta_rule import SUB_CHUNK
from ..layers.mlp import PLAIN_TILE_TENSORS, plain_tile_tokens
from ..layers.tiles import MLP_TILE_TENSORS, loss_tile_tokens, mlp_tile_tokens
from .traffic import ModelShape


def shape_dtype(b: int):
    """The activations' dtype of ``b`` bytes per element (bf16 for 2)."""
    import torch

    return {2: torch.bfloat16, 4: torch.float32, 8: torch.float64}[b]


@dataclass
class MemoryEstimate:
    peak: float
    moment: str                     # which moment is the peak ("A: loss", "B: mlp", ...)
    parts: dict[str, float]         # parameters, gradients, optimizer_states, activations


def param_counts(shape: ModelShape, lay: LayoutSpec) -> dict[str, float]:
    """Elements per rank: one layer (the first and last: a sparse one when the model has any),
    its attention part, all layers together, the embedding, the head (+ final norm). A sparse
    layer's experts are cut 1/D by whole experts (TSP) or 1/T by channels (tp): the same count;
    its router (E x h) is replicated."""
    h, v = shape.hidden_size, shape.vocab_size
    shard = lay.tp  # cp: tp = 1, every matrix whole
    vocab = -(-v // shard) * h  # padded to a multiple of the shard count
    # every layer kind's attention (latent, softmax, Gated DeltaNet: replicated parts whole),
    # each layer's input norm; "attention" is the average layer's
    attn_all = sum(n * w for n, w in shape.attention_layer_weights(shard)) + shape.num_layers * h
    attn = attn_all / shape.num_layers
    mlp = shape.mlp_weights / shard + h
    moe = (shape.expert_weights + shape.shared_weights) / shard + shape.router_weights + h
    edge = attn + (moe if shape.is_moe else mlp)
    return {"layer": edge, "attention": attn, "embed": vocab, "head": vocab + h,
            "layers": attn_all + shape.num_moe_layers * moe + shape.num_dense_layers * mlp}


def latent_saved_bytes(shape: ModelShape, tokens: float, b: int = 2) -> float:
    """What one multi-head latent attention layer keeps for backward on ``tokens`` own tokens
    (docs/design.md "Multi-head latent attention (DeepSeek-V3)"): the query input and latent,
    the queries and output of every head, the float32 LSE per head, and the down-projections'
    RMSNorms (float32 input, normalised output, two rsqrt): 98,952 bytes per token for
    DeepSeek-V3, the figure tests/models/test_deepseek_v3.py measures under fake tensors."""
    m, nq = shape.latent, shape.num_heads
    qw = shape.hidden_size if m.q_lora_rank is None else m.q_lora_rank
    dqk = m.qk_nope_head_dim + m.qk_rope_head_dim
    norms = (0 if m.q_lora_rank is None else qw) + m.kv_lora_rank
    return tokens * ((qw + m.latent_dim + nq * (dqk + m.v_head_dim)) * b + 4 * nq
                     + norms * (4 + b) + 4 * (2 if m.q_lora_rank is not None else 1))


def latent_backward_bytes(shape: ModelShape, seq_tokens: float, d: int, b: int = 2) -> float:
    """What one latent attention layer's backward adds at its peak on one rank, besides what it
    kept (:func:`latent_saved_bytes`) and its weight buffers: the gathered latent of the whole
    sequence (B S) and its float32 gradient sum, one round's head group K/V padded to the
    kernels' head size and its float32 dK/dV, and ``[dk_nope | dv]`` as kv_b_proj's output."""
    m, nl = shape.latent, shape.num_heads // d
    P = m.padded_dim
    return seq_tokens * (m.latent_dim * (b + 4) + 2 * nl * P * (b + 4)
                         + nl * (m.qk_nope_head_dim + m.v_head_dim) * b)


def moe_working_set(shape: ModelShape, rows: float, channels: float, experts: float,
                    b: int = 2, tokens: float | None = None) -> dict[str, float]:
    """Bytes one sparse MLP adds at each candidate peak of its (recomputed) forward and backward
    on one rank that runs ``experts`` (n) experts of ``channels`` (F) intermediate channels each
    on ``rows`` (R) routed copies of ``tokens`` (T, default R / k) tokens (uniform routing: TSP's
    (a) receives k T rows for its E/D whole experts). Read from
    :func:`tsp_core.layers.moe.dispatch_combine` (each [R, h] buffer dropped once the next
    exists) and its experts' function, which runs each expert's rows ``t`` at a time
    (:func:`tiles.mlp_tile_tokens` of 2F: a tile's gate and up) and keeps only the rows for
    backward. What the forward keeps for backward, common to the first two moments: the rows
    grouped by expert and the rows come back (the routing-weight product keeps them), and with
    ``weight_input`` (Llama 4) the weighted copies: ``saved`` = R h b (2, or 3). w: the routing
    weights' dtype (float32 under Mixtral and GLM-4.5, the model's under the others).

    - ``forward``: the end of the recomputed forward (it stops at ``index_add``, the last op
      that saves a tensor): ``saved``, the weighted rows in w and, under float32 routing, their
      bf16 copy (``index_add``'s source), and the [T, h] zeros it adds into;
    - ``weights_backward``: the routing-weight product's backward: ``saved`` and three [R, h]
      in w (the incoming gradient, the rows' and the weights' gradients before the sum);
    - ``expert_backward``: the experts' backward: the kept rows, the gradient of their output and
      the rows' gradient (3 [R, h]), every local expert's weight-gradient accumulator (3 n F h,
      float32 for a bf16 model with more than one tile) and the larger of one tile's tensors
      (at most :data:`tiles.MLP_TILE_TENSORS` [t, F]) and, at the end, float32 ones cast to
      the weights' dtype (3 n F h b)."""
    h, F, R = shape.hidden_size, channels, rows
    n = max(1, round(experts))
    T = R / shape.top_k if tokens is None else tokens
    w = 4 if shape.routing_fp32 else b      # the routing weights' dtype
    cast = b if shape.routing_fp32 else 0   # the weighted rows cast back to the model's dtype
    saved = R * h * b * (3 if shape.weight_input else 2)
    tile = min(mlp_tile_tokens(2 * int(F), shape_dtype(b)), max(1.0, R / n))
    acc = 4 if b == 2 and R / n > tile else b
    cast_grads = 3 * n * F * h * b if acc != b else 0  # .to(the weights' dtype): a copy
    return {"forward": saved + R * h * (w + cast) + T * h * b,
            "weights_backward": saved + 3 * R * h * w,
            "expert_backward": 3 * R * h * b + 3 * n * F * h * acc
            + max(MLP_TILE_TENSORS * tile * F * b, cast_grads)}


def grouped_experts_working_set(shape: ModelShape, rows: float, channels: float,
                                b: int = 2) -> float:
    """Bytes the tensor-parallel baselines' MoE block adds at its backward's peak (Hugging Face's
    default ``grouped_mm`` experts on this rank's ``channels`` of every expert, ``rows`` routed
    copies): the saved sorted rows and the experts' [rows, h] output, the gate/up output (2 F),
    activation and product (F each), and three [rows, h] tensors in the routing weights' dtype
    (float32 for Mixtral) in the backward of the weighted sum: rows (2 h + 4 F) b + 3 rows h w."""
    h = shape.hidden_size
    w = 4 if shape.routing_fp32 else b
    return rows * (2 * h + 4 * channels) * b + 3 * rows * h * w


def mlp_tile(shape: ModelShape, local_channels: int, b: int = 2) -> tuple[int, int]:
    """(tokens of TSP's MLP tile when ``tile_tokens`` is None, [tile, F/D] tensors the planner
    counts per tile). Gated (``mlp_matrices`` 3): :func:`tiles.mlp_tile_tokens`, its gate, up,
    activation and product (4). Ungated (2: Apertus): :func:`~tsp_core.layers.mlp.plain_tile_tokens`
    of xIELU, the ungated family's activation, and the tensors its backward holds
    (:data:`~tsp_core.layers.mlp.PLAIN_TILE_TENSORS`: autograd keeps both branches of xIELU,
    so more than the gated MLP's, on a tile half as long)."""
    if shape.mlp_matrices == 3:
        return mlp_tile_tokens(local_channels, shape_dtype(b)), 4
    return (plain_tile_tokens(local_channels, shape_dtype(b), "xielu"),
            PLAIN_TILE_TENSORS["xielu"])


def _tsp_attention_kinds(shape: ModelShape, d: int, n_r: float, r: float, batch: int, seq: int,
                        b: int) -> list[tuple[float, float, float]]:
    """Per attention kind of the model under TSP: (bytes it keeps for backward as the MLP's
    working set counts them, bytes alive at its backward's peak, its kept tensors as the MoE
    working set counts them). ``r``: one residual tensor of the rank's ``n_r`` tokens."""
    h, g = shape.hidden_size, shape.group
    out = []
    if shape.latent is not None:  # the layer input, x, kept tensors, dy, dq_in, round buffers
        m = shape.latent
        kept = latent_saved_bytes(shape, n_r, b)
        qw = h if m.q_lora_rank is None else m.q_lora_rank
        w = m.sharded(h, shape.num_heads) / d * b
        attn = 3 * r + kept + latent_backward_bytes(shape, batch * seq, d, b) + \
            n_r * qw * b + 6 * w
        return [(kept, attn, kept)]
    if shape.num_full_layers:
        # attention's backward: the norm's input (r), the attention's input x, local Q and
        # output (2r), K/V of all heads (2r/g), the incoming gradient (r), the backward's floor
        # (one head group's whole-sequence K/V, one more K/V-sized buffer and its float32
        # dK/dV; dX, dQ, dO and a kernel call's pieces:
        # tsp_core.layers.attention.backward_floor_bytes), four broadcast shards and two
        # gradient buffers
        head_dim = shape.q_width // shape.num_heads
        floor = backward_floor_bytes(batch * seq, d, head_dim, max(1, shape.num_kv_heads // d),
                                     shape.num_heads // d, h, dtype_bytes=b)
        w = shape.softmax_attention_weights / d * b
        out.append((4 * r + 2 * r / g, 5 * r + 2 * r / g + floor + 6 * w,
                    2 * n_r * shape.q_width * b + 2 * r / g))
    if shape.delta_net is not None:  # the layer input, x, the round rerun's graph, dy, dx
        w = shape.delta_net.sharded(h) / d * b
        out.append((r, 4 * r + delta_net_round_bytes(shape, n_r, d, b) + 6 * w, r))
    return out


def delta_net_round_bytes(shape: ModelShape, tokens: float, d: int, b: int = 2) -> float:
    """What one Gated DeltaNet round's backward holds on ``tokens`` own tokens (the round's
    forward rerun under autograd, tsp_core.layers.linear_attention.schedule): the projections'
    inputs and outputs, the convolution's input and output, q/k/v/z per local value head in
    the compute dtype, both chunked rules' (the map's, values d_k + d_v wide, and the
    outputs') sub-chunk matrices, solves and states, the gated norm's tensors and the output
    projection's output times dy; and, while autograd runs the map's rule backward, one
    gradient per per-token tensor of it (its three [C] sub-chunk matrices, the widened values'
    solve and three d_k-wide key tensors). The last term is the least certain one
    (docs/planning.md, "Where the model is uncertain")."""
    n = shape.delta_net
    H, Kh, dk, dv = n.num_value_heads / d, n.num_key_heads / d, n.key_head_dim, n.value_head_dim
    h, cd, C = shape.hidden_size, max(4, b), SUB_CHUNK
    cw = 2 * Kh * dk + H * dv
    prep = 2 * h * b + 2 * cw * b + H * (4 * dk * cd + dv * cd + dv * b)

    def rule(wv: float, outputs: bool) -> float:
        per = dk + 3 * C + 2 * wv + 2 * dk + 2 * dk * wv / C
        return H * cd * (per + (2 * C + dk + wv if outputs else 0))

    maps = rule(dk + dv, False) + H * (dk + dv) * cd
    norm = H * dv * (3 * cd + 2 * b) + 2 * h * b
    grads = H * cd * (3 * C + (dk + dv) + 3 * dk)
    return tokens * (prep + maps + rule(dv, True) + norm + grads)


def tokens(lay: LayoutSpec, seq: int, batch: int) -> tuple[float, float]:
    """(residual-stream tokens, tokens entering the projections) per rank."""
    s = batch * seq
    if lay.name == "tsp":
        return s / lay.tp, s / lay.tp
    n_a = s / lay.cp
    return (n_a / lay.tp if lay.name.startswith("tp-sp") else n_a), n_a


def working_sets(shape: ModelShape, lay: LayoutSpec, seq: int, batch: int,
                 b: int = 2) -> dict[str, float]:
    """Bytes alive, besides checkpoints and gradients, at the peak of each phase."""
    h, F, V, g = shape.hidden_size, shape.intermediate_size, shape.vocab_size, shape.group
    n_r, n_a = tokens(lay, seq, batch)
    r = n_r * h * b                   # one residual-stream tensor
    if lay.name == "tsp":
        d = lay.tp
        w_mlp = shape.mlp_weights / d * b
        per = -(-V // d)
        chunk = min(n_r, loss_tile_tokens(per, shape_dtype(b)))
        tile, tile_tensors = mlp_tile(shape, F // d, b)
        tile = min(n_r, tile)
        # per attention kind present: (what it keeps for backward, its backward's working set);
        # the planner takes the larger of each (the edge layers may be of either kind)
        kinds = _tsp_attention_kinds(shape, d, n_r, r, batch, seq, b)
        saved = max(k[0] for k in kinds)
        attn = max(k[1] for k in kinds)
        # MLP: both norms' inputs (2r: a norm keeps only its input), attention's saved tensors,
        # the MLP input, per tile of the ring's shard its [tile, F/D] tensors (mlp_tile), dx,
        # dy; the ring's current and next shard, their gradient accumulators and the owner's
        # gradient (5)
        mlp = (2 * r + saved + r + tile_tensors * tile * F / d * b + 2 * r + 5 * w_mlp)
        if shape.is_moe:  # schedule (a): k T routed rows through this rank's E/D whole experts
            moe = moe_working_set(shape, shape.top_k * n_r, shape.expert_intermediate_size,
                                  shape.num_experts / d, b, tokens=n_r)
            moe["forward"] += r  # the recompute's residual (x + attention), freed at its stop
            # both norms (fp32 input, normalised bf16, output: 4r each, the MLP input among
            # them), attention's saved tensors (softmax: q_all and out_all, every query head of
            # this rank's tokens, n q_width each, and kv_all, 2r/g), the layer's output
            # gradient (r: the residual's and the MoE's, one tensor)
            common = 8 * r + max(k[2] for k in kinds) + r
            mlp = max(common + max(moe.values()), mlp if shape.num_dense_layers else 0)
        # loss: final norm (its input and output: 2r), two float32 [tile, V/D] (the backward's
        # probabilities and their scaled copy), two vocabulary shards in the ring and the
        # float32 gradient of the shard over the tiles
        loss = 2 * r + chunk * per * 2 * 4 + 2 * per * h * b + per * h * 4
        return {"attention": attn, "mlp": mlp, "loss": loss}
    t = n_a * h / lay.tp * b          # one head-sharded [tokens, h/T] tensor
    kv = 2 * (seq * batch if lay.cp > 1 else n_a) * h / lay.tp / g * b  # K and V the kernel sees
    f = n_a * F / lay.tp * b          # one MLP intermediate
    a = n_a * h * b                   # one gathered (tp-sp) or replicated projection input
    sp = lay.name.startswith("tp-sp")
    saved_attn = (2 + 2 / g) * t + t  # q, k, v, output; o_proj's input
    # context parallel: the gathered K/V, its gradient summed in float32 (2) and the kernel's
    # pieces; tensor parallel (kv local): the kernel's K/V, their gradients and pieces
    attn = 3 * r + (a if sp else 0) + saved_attn + (4 if lay.cp > 1 else 3) * kv + 2 * t + a + r
    mlp = 7 * r + (2 * a if sp else 0) + saved_attn + 4 * f + 3 * f + a
    if shape.is_moe:  # every expert's F/T channels on the k N routed copies of the N tokens
        common = 7 * r + (2 * a if sp else 0) + saved_attn + a
        moe = grouped_experts_working_set(shape, shape.top_k * n_a,
                                          shape.expert_intermediate_size / lay.tp, b)
        mlp = max(common + moe, mlp if shape.num_dense_layers else 0)
    # the post-attention RMSNorm's backward (HF's, over this rank's residual tokens, after the
    # MLP's): both norms' saved tensors (6r), attention's (not yet run backward; under tp-sp its
    # gathered input), and autograd's float32 formulas for to/mul/pow/mean: five float32 copies
    # of the norm's input (10r) and the incoming bf16 gradient (r). Under tp the norm sees every
    # token of the rank, so this is tp's largest working set at the last and first layer.
    norm = 6 * r + (a if sp else 0) + saved_attn + 11 * r
    # loss (loss_parallel's log-softmax over the [tokens, V/T] float32 logits): the final norm
    # (3r), the LM head's input (the all-gathered one under tp-sp; the replicated norm output
    # under tp), the saved float32 log-softmax and, in its backward, three float32 [tokens, V/T]
    # (the loss gradient, exp of the log-softmax, the result); the bf16 logits are freed by then
    logits = n_a * V / lay.tp
    loss = 3 * r + a + logits * (4 + 3 * 4)
    return {"attention": attn, "mlp": mlp, "loss": loss, "norm": norm}


def fsdp_terms(c: dict[str, float], lay: LayoutSpec, b: int = 2) -> dict[str, float]:
    """FSDP2's working set at the planner's moments, in bytes, for the wrapping
    ``tsp_core.distributed.fsdp`` uses (each decoder layer, then the root: embedding, final norm, LM
    head, all with ``reshard_after_forward=True``), read from torch's ``_fully_shard`` and checked
    against ``tsp simulate --dp-shard`` (docs/memory.md, "FSDP2"). ``u``: one decoder layer's shard
    unsharded over dp_shard; ``root``: the root's (this rank's TSP / TP shard of the embedding,
    final norm and LM head).

    In the backward the root is gathered again at its pre-backward and stays whole until its
    post-backward at the end (its gradients too: the LM head's is reduce-scattered last). The
    layer running holds its unsharded parameters, the next layer's all-gather output (prefetched
    one layer ahead) and the reduce-scatter input of the layer after it (kept until the next
    reduce-scatter): ``edge`` = root + 2u at the last layer (nothing reduce-scattered yet) and at
    the first (nothing left to prefetch), ``middle`` = root + 3u at the one before the last.
    ``loss``: TSP computes its loss inside the root's forward, where the root is whole and the
    last layer's all-gather output is still held (FSDP2 frees it at the root's post-forward):
    root + u; the baselines' loss runs after the root's forward has resharded it: nothing.

    A layer's unsharded gradient is the same whole-layer gradient counted without FSDP2. (An
    unset ``reshard_after_forward`` would keep the root whole from forward to backward instead:
    torch 2.13 reshards the root only when the argument is given.)"""
    u = c["layer"] * b
    root = (c["embed"] + c["head"]) * b
    return {"loss": root + u if lay.name == "tsp" else 0.0, "edge": root + 2 * u,
            "middle": root + 3 * u}


def estimate(shape: ModelShape, lay: LayoutSpec, seq: int, batch: int = 1, b: int = 2,
             optimizer_moments: int = 2, dp_shard: int = 1) -> MemoryEstimate:
    """Peak bytes of one rank for one training step (full recompute, AdamW), with FSDP2 over
    ``dp_shard`` ranks when it is above 1 (:func:`fsdp_terms`)."""
    if dp_shard < 1:
        raise ValueError(f"dp_shard ({dp_shard}) must be at least 1")
    c = param_counts(shape, lay)
    L = shape.num_layers
    params = (c["layers"] + c["embed"] + c["head"]) * b
    opt = optimizer_moments * params
    n_r, _ = tokens(lay, seq, batch)
    ckpt = n_r * shape.hidden_size * b
    ws = working_sets(shape, lay, seq, batch, b)
    g_head, g_layer = c["head"] * b, c["layer"] * b
    g_mlp = (c["layer"] - c["attention"]) * b
    moments = {
        "A: loss": (L * ckpt + ws["loss"], 0.0),
        "A: last layer mlp": (L * ckpt + ws["mlp"], g_head),
        "A: last layer attention": (L * ckpt + ws["attention"], g_head + g_mlp),
        "B: first layer mlp": (ckpt + ws["mlp"], params - c["embed"] * b - g_layer),
        "B: first layer attention": (ckpt + ws["attention"],
                                     params - c["embed"] * b - c["attention"] * b),
    }
    if "norm" in ws:
        moments["A: last layer norm backward"] = (L * ckpt + ws["norm"], g_head + g_mlp)
        moments["B: first layer norm backward"] = (ckpt + ws["norm"],
                                                   params - c["embed"] * b - c["attention"] * b)
    parts = {"parameters": params, "optimizer_states": opt}
    extra = {k: 0.0 for k in moments}     # FSDP2's working set at each moment
    if dp_shard > 1:
        f = fsdp_terms(c, lay, b)
        parts = {k: v / dp_shard for k, v in parts.items()}
        rest = params - c["embed"] * b - g_layer - g_head  # layers 2..L: reduce-scattered by B
        for k, (act, grads) in list(moments.items()):
            if k.startswith("B"):
                moments[k] = (act, grads - rest + rest / dp_shard)
            extra[k] = f["loss" if k == "A: loss" else "edge"]
            if k.startswith("A: last layer") and L > 1:  # the layer before: one checkpoint
                k2 = k.replace("last layer", "layer L-1")  # less, the last one reduce-scattered
                moments[k2] = (act - ckpt, grads + g_layer / dp_shard)
                extra[k2] = f["middle"]
    name, (act, grads) = max(moments.items(), key=lambda kv: sum(kv[1]) + extra[kv[0]])
    return MemoryEstimate(sum(parts.values()) + act + grads + extra[name], name,
                          parts | {"gradients": grads, "activations": act, "fsdp": extra[name]})
