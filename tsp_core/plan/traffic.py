"""Bytes each rank sends per decoder layer in the forward pass, by layout (docs/design.md
"Communication per layer"), in the same ring accounting as :mod:`tsp_core.comm` (so measured and
predicted numbers are comparable).

With h = hidden size, g = query heads per key/value head (h over the K/V width when head_dim is
not h / heads), F = MLP intermediate size, W_att = (2 + 2/g) h^2 (2 h (q + k/v widths) in
general) and W_mlp = 3 F h (elements; 2 F h for an ungated MLP), on a T x C mesh (T
tensor-parallel ranks inside C context-parallel ones; TSP uses D = T):

- tp, tp-sp:  4 (T-1)/T * B (S/C) h          two all-reduces, or two all-gather + reduce-scatter
- cp:         2 (C-1)/C * B S (h/T) / g      all-gather of K and V (this rank's heads)
- tsp:        (D-1)/D * (W_att + W_mlp + 2 B S h / g)   weights + K/V
              (also when nkv < D: the key/value rows are sliced 1/D per rank and
              all-gathered once, each head's K/V gathered once)

so TSP moves less than tp / tp-sp once B S (4 - 2/g) h > W_att + W_mlp (B*S > 8h for g=1, F=4h).
Backward is about twice the forward for every layout.

Sparse mixture-of-experts layers (Mixtral, Qwen3-MoE: E experts of intermediate F_e, top k, router
replicated; ``docs/moe.md``): attention's traffic is unchanged; the MLP term becomes that of the
schedule :func:`moe_schedule_bytes` picks for TSP, (a) expert parallel (tokens move, by
all-to-all) or (b) the dense ring over every expert's channels (weights move). Under tp / tp-sp
the MoE layer moves what the dense MLP moves (the all-reduce, or all-gather + reduce-scatter, of
its input/output): every rank routes the same (replicated or gathered) tokens with the
replicated router and runs its 1/T slice of every expert, so routing adds nothing. Shared experts
(GLM-4.5: a dense gated MLP beside the routed ones) are counted in the weights and add the dense
ring's bytes to both TSP schedules (``shared_intermediate_size``); the first
``first_k_dense_replace`` layers are dense.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..layers.moe import MoEScheduleBytes, moe_bytes


@dataclass(frozen=True)
class LatentShape:
    """Multi-head latent attention's sizes (docs/design.md "Multi-head latent attention
    (DeepSeek-V3)"): the down-projections are replicated, ``q_b_proj`` (or ``q_proj``),
    ``kv_b_proj`` and ``o_proj`` sharded by heads."""

    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    bias: bool = False

    @property
    def latent_dim(self) -> int:
        """Elements each token's latent ``[c_kv | k_rope]`` has: what is all-gathered."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def padded_dim(self) -> int:
        """The one head size the flash kernels see (q, k, v zero-padded to it: 192 in V3)."""
        return max(self.qk_nope_head_dim + self.qk_rope_head_dim, self.v_head_dim)

    def kv_b(self, heads: int) -> int:
        """``kv_b_proj``'s elements: applied by every rank to the gathered latent, every round."""
        return heads * (self.qk_nope_head_dim + self.v_head_dim) * self.kv_lora_rank

    def sharded(self, h: int, heads: int) -> int:
        """W_mla = nq (dqk q_width + (nope + dv) kv_lora_rank + dv h): the broadcast shards."""
        q_width = h if self.q_lora_rank is None else self.q_lora_rank
        dqk = self.qk_nope_head_dim + self.qk_rope_head_dim
        return heads * (dqk * q_width + self.v_head_dim * h) + self.kv_b(heads)

    def replicated(self, h: int) -> int:
        """W_rep: q_a_proj, q_a_layernorm, kv_a_proj_with_mqa, kv_a_layernorm (and biases)."""
        q = 0 if self.q_lora_rank is None else self.q_lora_rank * (h + 1 + self.bias)
        return q + self.latent_dim * (h + self.bias) + self.kv_lora_rank + self.bias * h


@dataclass(frozen=True)
class DeltaNetShape:
    """Gated DeltaNet's sizes (Qwen3.5's linear-attention layers; docs/design.md "Gated
    DeltaNet") and how many of the layers are linear attention."""

    num_key_heads: int
    num_value_heads: int
    key_head_dim: int
    value_head_dim: int
    conv_kernel: int
    layers: int

    def sharded(self, h: int) -> int:
        """W_dn: in_proj_qkv, in_proj_z, in_proj_b, in_proj_a, the convolution, A_log, dt_bias
        and out_proj, all split by heads (the gated norm's d_v weight is replicated)."""
        nk, nv, dk, dv = self.num_key_heads, self.num_value_heads, self.key_head_dim, \
            self.value_head_dim
        return ((2 * nk * dk + 2 * nv * dv + 2 * nv) * h + (2 * nk * dk + nv * dv)
                * self.conv_kernel + 2 * nv + nv * dv * h)

    def map_elements(self, d: int, batch: int) -> int:
        """M = 2 D B nv d_k (d_k + d_v): every chunk's map, gathered round by round (float32)."""
        return 2 * d * batch * self.num_value_heads * self.key_head_dim * \
            (self.key_head_dim + self.value_head_dim)

    def tail_elements(self, d: int, batch: int, seq: int, h: int) -> float:
        """T = 2 D B min(S / 2D, K - 1) h: every chunk's convolution halo."""
        return 2 * d * batch * min(seq / (2 * d), self.conv_kernel - 1) * h


@dataclass(frozen=True)
class ModelShape:
    """The numbers of a decoder layer that decide its traffic and memory."""

    hidden_size: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    num_layers: int = 1
    vocab_size: int = 32000
    head_dim: int | None = None   # None: hidden_size / num_heads
    # sparse mixture of experts (0 experts: a dense model): E experts of F_e intermediate
    # channels each, top_k of them per token, in ``moe_layers`` of the layers (None: all); the
    # other layers keep the dense MLP of ``intermediate_size``
    num_experts: int = 0
    top_k: int = 0
    expert_intermediate_size: int = 0
    moe_layers: int | None = None
    # shared experts (GLM-4.5): one dense gated MLP of this many channels beside the routed
    # experts in every MoE layer, on every token (0: none)
    shared_intermediate_size: int = 0
    routing_fp32: bool = False     # the top-k weights stay float32 (Mixtral; Qwen3-MoE casts back)
    weight_input: bool = False     # the weights scale the experts' input (Llama 4), not output
    # weight matrices of a dense MLP: 3 gated (gate, up, down), 2 ungated (Apertus's up, down)
    mlp_matrices: int = 3
    # an output gate (Qwen3.5): q_proj gives a gate beside every query, q_width more rows
    output_gate: bool = False
    # multi-head latent attention in every layer (DeepSeek-V3), None: softmax attention of
    # q/k/v/o projections
    latent: LatentShape | None = None
    # Gated DeltaNet in ``delta_net.layers`` of the layers (Qwen3.5), the others full attention
    delta_net: DeltaNetShape | None = None
    # per-head RMSNorms on q and k (head_dim each, replicated: Qwen3.5's full attention)
    qk_norm: bool = False

    @classmethod
    def from_config(cls, config) -> ModelShape:
        """The shape of a Hugging Face config, read through the family's TSP policy where there
        is one: its experts (:func:`_moe_fields`) and the config field of its dense MLPs'
        intermediate size (``FeedForwardPolicy.dense_intermediate_size``: Llama 4's
        ``intermediate_size_mlp``)."""
        nq = config.num_attention_heads
        _check_one_layer_shape(config)
        policy = _policy(config)
        experts = _moe_fields(config, policy)
        dense = getattr(config,
                        policy.ffn.dense_intermediate_size if policy else "intermediate_size")
        return cls(config.hidden_size, nq, getattr(config, "num_key_value_heads", None) or nq,
                   dense, config.num_hidden_layers, config.vocab_size,
                   getattr(config, "head_dim", None), **experts,
                   mlp_matrices=3 if experts or _gated_mlp(config) else 2,
                   output_gate=bool(policy and policy.attn.output_gate),
                   latent=_latent_fields(config, policy), delta_net=_delta_net_fields(config),
                   qk_norm=bool(policy and policy.attn.qk_norm_in(config)))

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def num_moe_layers(self) -> int:
        if not self.is_moe:
            return 0
        return self.num_layers if self.moe_layers is None else self.moe_layers

    @property
    def num_dense_layers(self) -> int:
        return self.num_layers - self.num_moe_layers

    @property
    def expert_weights(self) -> float:
        """Every expert's gate, up and down: 3 E F_e h (the router, E h, apart)."""
        return 3 * self.num_experts * self.expert_intermediate_size * self.hidden_size

    @property
    def router_weights(self) -> float:
        return self.num_experts * self.hidden_size

    @property
    def shared_weights(self) -> float:
        """The shared experts' gate, up and down in an MoE layer: 3 F_s h."""
        return 3 * self.shared_intermediate_size * self.hidden_size

    @property
    def layer_mlp_weights(self) -> float:
        """MLP weights of an average layer (experts and router in the MoE layers)."""
        if not self.is_moe:
            return self.mlp_weights
        return self._average(self.expert_weights + self.router_weights + self.shared_weights)

    @property
    def active_mlp_weights(self) -> float:
        """MLP weights one token multiplies by in an average layer (the FLOPs are 2 x this per
        token): its k experts and the router in the MoE layers."""
        if not self.is_moe:
            return self.mlp_weights
        k, f, h = self.top_k, self.expert_intermediate_size, self.hidden_size
        return self._average(3 * k * f * h + self.router_weights + self.shared_weights)

    def _average(self, moe: float) -> float:
        """Per layer, ``moe`` in the sparse layers and the dense MLP's weights in the others."""
        dense = self.num_dense_layers * self.mlp_weights
        return (self.num_moe_layers * moe + dense) / self.num_layers

    @property
    def q_width(self) -> int:
        return self.num_heads * (self.head_dim or self.hidden_size // self.num_heads)

    @property
    def kv_width(self) -> int:
        """One of K, V per token: num_kv_heads * head_dim."""
        return self.num_kv_heads * (self.head_dim or self.hidden_size // self.num_heads)

    @property
    def group(self) -> float:
        """g = h / kv_width, so that h / g is one of K, V per token: query heads per key/value
        head when num_heads * head_dim = h (Llama, Qwen2); Gemma's head_dim is its own."""
        return self.hidden_size / self.kv_width

    @property
    def softmax_attention_weights(self) -> int:
        """q, k, v, o projections: 2 h (q_width + kv_width); (2 + 2/g) h^2 when q_width = h; with
        an output gate q_proj's gate rows, h q_width more (the gate's activations, q_width per
        token like the queries', are not in the closed forms)."""
        gate = self.hidden_size * self.q_width if self.output_gate else 0
        return 2 * self.hidden_size * (self.q_width + self.kv_width) + gate

    @property
    def num_linear_layers(self) -> int:
        """Layers of Gated DeltaNet (the others are softmax or latent attention)."""
        return self.delta_net.layers if self.delta_net else 0

    @property
    def num_full_layers(self) -> int:
        return self.num_layers - self.num_linear_layers

    def attention_layer_weights(self, shard: int = 1) -> tuple[int | float, ...]:
        """Per layer kind present, (layers of the kind, sharded weights / ``shard`` + replicated
        tensors): latent attention (W_mla, and its down-projections replicated), softmax
        attention (its q/k norms replicated), Gated DeltaNet (W_dn, its norm's d_v replicated)."""
        h = self.hidden_size
        if self.latent is not None:
            return ((self.num_layers, self.latent.sharded(h, self.num_heads) / shard
                     + self.latent.replicated(h)),)
        norms = 2 * (self.q_width // self.num_heads) if self.qk_norm else 0
        kinds = [(self.num_full_layers, self.softmax_attention_weights / shard + norms)]
        if self.delta_net is not None:
            kinds.append((self.num_linear_layers, self.delta_net.sharded(h) / shard
                          + self.delta_net.value_head_dim))
        return tuple(k for k in kinds if k[0])

    @property
    def attention_weights(self) -> float:
        """Attention weights of an average layer, whole (every kind's, the replicated
        down-projections and norms with them); softmax attention's is
        :attr:`softmax_attention_weights` (norms apart)."""
        if self.latent is None and self.delta_net is None:
            return self.softmax_attention_weights
        return sum(n * w for n, w in self.attention_layer_weights()) / self.num_layers

    @property
    def sharded_attention_weights(self) -> float:
        """What TSP broadcasts of an average layer's attention: the head-sharded tensors (W_mla,
        W_dn, q/k/v/o), not the replicated ones (whose gradients are all-reduced)."""
        h = self.hidden_size
        if self.latent is not None:
            return self.latent.sharded(h, self.num_heads)
        dn = self.delta_net.sharded(h) * self.num_linear_layers if self.delta_net else 0
        return (dn + self.softmax_attention_weights * self.num_full_layers) / self.num_layers

    def sequence_bytes(self, d: int, batch: int, seq: int, b: int = 2) -> float:
        """Bytes one rank sends per forward of an average layer's attention for the sequence
        (not the weights) under TSP at degree ``d``: the K/V of every head (2 B S h / g
        elements), MLA's ONE latent gather (B S (kv_lora_rank + qk_rope)), Gated DeltaNet's
        halo tails (T, the model's dtype) and chunk maps (M, float32 at least), each (D-1)/D."""
        f, h = (d - 1) / d, self.hidden_size
        if self.latent is not None:
            return f * batch * seq * self.latent.latent_dim * b
        kv = f * 2 * batch * seq * self.kv_width * b * self.num_full_layers
        dn = 0.0
        if self.delta_net is not None:
            n = self.delta_net
            dn = f * (n.tail_elements(d, batch, seq, h) * b + n.map_elements(d, batch)
                      * max(4, b)) * n.layers
        return (kv + dn) / self.num_layers

    @property
    def mlp_weights(self) -> float:
        return self.mlp_matrices * self.intermediate_size * self.hidden_size


def _gated_mlp(config) -> bool:
    """Whether the family's dense MLP has a gate, read from Hugging Face's own module: its
    first decoder layer built on the meta device (no memory, no weights). An ungated MLP (no
    ``gate_proj``, no fused ``gate_up_proj``: Apertus) has two weight matrices, not three."""
    import copy

    import torch
    from transformers import AutoModelForCausalLM, PretrainedConfig

    if not isinstance(config, PretrainedConfig):  # a plain namespace of sizes: no module to read,
        return True                                # and ModelShape's own default is gated
    one = copy.deepcopy(config)
    one.num_hidden_layers = 1
    for name in ("layer_types", "no_rope_layers"):  # per-layer lists follow the layer count
        if isinstance(getattr(one, name, None), list):
            setattr(one, name, getattr(one, name)[:1])
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(one)
    mlps = [m for n, m in model.named_modules() if n.endswith(".mlp")]
    return not mlps or any(hasattr(m, a) for m in mlps[:1] for a in ("gate_proj", "gate_up_proj"))


def _latent_fields(config, policy) -> LatentShape | None:
    """The latent attention's sizes where the family runs its own attention schedule
    (``AttentionPolicy.module``: DeepSeek-V3's MLA), else None."""
    if policy is None or policy.attn.module is None:
        return None
    return LatentShape(config.q_lora_rank, config.kv_lora_rank, config.qk_nope_head_dim,
                       config.qk_rope_head_dim, config.v_head_dim,
                       bool(getattr(config, "attention_bias", False)))


def _delta_net_fields(config) -> DeltaNetShape | None:
    """Gated DeltaNet's sizes and its layer count (``layer_types`` "linear_attention":
    Qwen3.5), None when no layer is linear attention."""
    types = list(getattr(config, "layer_types", None) or [])
    linear = types.count("linear_attention")
    if not linear:
        return None
    return DeltaNetShape(config.linear_num_key_heads, config.linear_num_value_heads,
                         config.linear_key_head_dim, config.linear_value_head_dim,
                         config.linear_conv_kernel_dim, linear)


def _check_one_layer_shape(config) -> None:
    """The closed forms assume one attention shape for every layer; a config whose layers differ
    (Gemma 4: ``head_dim`` on sliding layers, ``global_head_dim`` and its own key/value heads on
    full ones; transformers then refuses the global fields) is refused with the fields, not a
    traceback. ``tsp simulate`` builds each layer as it is and takes it. Linear-attention layers
    (Qwen3.5's Gated DeltaNet) are planned: :class:`DeltaNetShape` gives their weights and bytes,
    ``memory.delta_net_round_bytes`` their backward."""
    for field in ("num_key_value_heads", "head_dim"):
        try:
            getattr(config, field, None)
        except RuntimeError as err:  # transformers' AmbiguousGlobalPerLayerAttributeError
            raise ValueError(
                f"{type(config).__name__}: config.{field} differs from layer to layer "
                f"({type(err).__name__}); tsp plan's closed forms assume one attention shape for "
                f"every layer: estimate this model with tsp simulate, which builds each layer as "
                f"it is") from None


def _policy(config):
    """The family's TSP policy of ``config``, None if there is none (a namespace of sizes)."""
    from types import SimpleNamespace

    from ..models.policies import find_policy

    try:
        return find_policy(SimpleNamespace(config=config))
    except ValueError:
        return None


def _moe_fields(config, policy) -> dict:
    """The MoE fields of :class:`ModelShape` from a config, by the family's TSP policy
    (:class:`tsp_core.models.policies.ExpertsPolicy`: which config fields hold the expert count,
    top-k and per-expert size); {} for dense families, and for a cut with no sparse layer. Which
    layers are sparse follows Hugging Face's Qwen3-MoE rule (``mlp_only_layers``,
    ``decoder_sparse_step``), GLM-4.5's (``first_k_dense_replace``) and Llama 4's list
    (``moe_layers``); Mixtral's and gpt-oss's are all sparse."""
    m = policy.ffn.moe if policy is not None else None
    if m is None or not getattr(config, m.num_experts, None):
        return {}
    L = config.num_hidden_layers
    dense = set(getattr(config, "mlp_only_layers", None) or ())
    dense |= set(range(getattr(config, "first_k_dense_replace", None) or 0))  # GLM-4.5
    step = getattr(config, "decoder_sparse_step", None) or 1
    listed = getattr(config, "moe_layers", None)  # Llama 4: the sparse layers' indices
    sparse = sum(1 for i in range(L) if i not in dense and (i + 1) % step == 0
                 and (not isinstance(listed, list) or i in listed))
    if not sparse:
        return {}
    spec = m.spec(config, 1)
    # the routing weights stay float32: Mixtral's softmax router (Qwen3-MoE's casts them back),
    # GLM-4.5's float32 router; the top-k routers (gpt-oss, Llama 4) weigh in the logits' dtype
    fp32 = m.router_float32 or (spec.router == "softmax" and not spec.weights_in_logits_dtype)
    return dict(num_experts=spec.num_experts, top_k=spec.top_k,
                expert_intermediate_size=spec.intermediate_size,
                moe_layers=None if sparse == L else sparse, routing_fp32=fp32,
                weight_input=spec.weight_input,
                shared_intermediate_size=spec.shared_intermediate_size)


def moe_schedule_bytes(shape: ModelShape, tokens_per_rank: float, d: int, b: int = 2,
                       forward_passes: int = 1) -> MoEScheduleBytes:
    """Bytes one rank sends per MoE layer at degree ``d`` with ``tokens_per_rank`` tokens
    (T = B S / D), ``b`` bytes per element, routing uniform (a fraction (D-1)/D of each
    all-to-all leaves the rank), in :mod:`tsp_core.comm`'s accounting; ``forward_passes`` = 2
    under full recompute (the forward runs again before the backward). With E experts of F_e
    channels, top k, hidden h, and f = (D-1)/D:

    - (a) forward  f (2 T k h b + 8 E)          dispatch + combine all-to-all, the int64 counts
          backward f (2 T k h b + 2 E h b)      their gradients, the router's gradient all-reduce
    - (b) forward  f 3 E F_e h b                every expert's gate/up/down slice, D-1 hops
          backward (f + 1) 3 E F_e h b + f 2 E h b   slices again (D-1 hops), gradient
                                                accumulators (D hops: the last to the owner), router

    The crossover (one forward pass) is T* = (3 E F_e (2 + 1/f) - 8 E / (h b)) / (4 k), which is
    9 E F_e / (4 k) as D grows (f -> 1): the figure ``docs/moe.md`` quotes.
    """
    if not shape.is_moe:
        raise ValueError("moe_schedule_bytes: the model has no experts (num_experts = 0)")
    return moe_bytes(shape.num_experts, shape.top_k, shape.expert_intermediate_size,
                     shape.hidden_size, tokens_per_rank, d, b, forward_passes,
                     shape.shared_intermediate_size)


def moe_crossover_tokens(shape: ModelShape, d: int, forward_passes: int = 1) -> float:
    """Tokens per rank above which schedule (b) (the ring) moves fewer bytes than (a) per MoE
    layer, forward plus backward (:func:`moe_schedule_bytes`); about 9 E F_e / (4 k)."""
    return moe_schedule_bytes(shape, 0, d, forward_passes=forward_passes).crossover


def _mlp_forward_elements(shape: ModelShape, d: int, tokens_per_rank: float) -> float:
    """TSP: elements one rank sends in an average layer's MLP forward (the dense ring, or the MoE
    schedule :func:`moe_schedule_bytes` chooses, in bf16 elements)."""
    dense = (d - 1) / d * shape.mlp_weights
    if not shape.is_moe:
        return dense
    m = moe_schedule_bytes(shape, tokens_per_rank, d)
    moe = (m.a_forward if m.choice == "a" else m.b_forward) / 2
    return (shape.num_moe_layers * moe + shape.num_dense_layers * dense) / shape.num_layers


def layer_forward_elements(name: str, tp: int, cp: int, shape: ModelShape, batch: int,
                           seq: int) -> float:
    """Elements one rank sends in one decoder layer's forward (``name`` as in
    :data:`tsp_core.baselines.LAYOUTS`; TSP's degree is ``tp``); for a model with dense and
    sparse layers, the average layer."""
    h, g = shape.hidden_size, shape.group
    if name == "tsp":
        d = tp
        return ((d - 1) / d * shape.sharded_attention_weights
                + shape.sequence_bytes(d, batch, seq) / 2
                + _mlp_forward_elements(shape, d, batch * seq / d))
    if shape.latent is not None or shape.delta_net is not None:
        raise ValueError(f"{name}: {baseline_refusal(shape)}")
    tensor = 4 * (tp - 1) / tp * batch * (seq / cp) * h
    context = 2 * (cp - 1) / cp * batch * seq * (h / tp) / g
    return tensor + context


def baseline_refusal(shape: ModelShape) -> str | None:
    """Why the tensor- and context-parallel baselines cannot run this model, or None: they
    shard Hugging Face's q/k/v/o projections, which multi-head latent attention and Gated
    DeltaNet layers do not have (not built for these layers)."""
    if shape.latent is not None:
        return (f"the baselines have no schedule for multi-head latent attention "
                f"(kv_lora_rank={shape.latent.kv_lora_rank}, q_lora_rank="
                f"{shape.latent.q_lora_rank}): only tsp runs it")
    if shape.delta_net is not None:
        return (f"the baselines have no schedule for Gated DeltaNet ({shape.num_linear_layers} "
                f"of {shape.num_layers} layers are linear_attention): only tsp runs it")
    return None


def crossover_tokens(shape: ModelShape) -> float:
    """B*S above which TSP's forward moves fewer bytes than tp / tp-sp at the same degree (both
    carry the same (D-1)/D factor). Dense models: a sparse layer's TSP traffic depends on the
    schedule (:func:`moe_schedule_bytes`, :func:`moe_crossover_tokens`)."""
    if shape.is_moe:
        raise ValueError("crossover_tokens is for dense models; for MoE layers compare "
                         "layer_forward_elements per layout or use moe_crossover_tokens")
    if shape.latent is not None or shape.delta_net is not None:
        raise ValueError(f"crossover_tokens: {baseline_refusal(shape)}")
    h, g = shape.hidden_size, shape.group
    return (shape.attention_weights + shape.mlp_weights) / ((4 - 2 / g) * h)
