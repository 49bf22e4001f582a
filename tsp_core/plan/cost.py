"""Step time and ranking: which layout and degree to run on a cluster (``tsp plan``).

step time = compute (FLOPs / (peak x efficiency)) + communication the schedule cannot hide.
Compute per rank is the same for every layout at one degree (each splits the work evenly); the
layouts differ in bytes moved (docs/design.md "Communication per layer", :mod:`traffic`), in which
links carry them (a group inside a node rides NVLink / Infinity Fabric, one spanning nodes the NIC)
and in overlap: TSP's weight broadcasts and ring hops are prefetched a round ahead (hidden up to the
compute time), its K/V gathers are not; the baselines' collectives sit on the critical path.
Data-parallel gradient sums overlap the backward. Full recompute replays each layer's forward and
its collectives.

FSDP2 over ``dp_shard`` ranks (docs/design.md "FSDP2 on the data-parallel axis") shards each rank's
model state further (:func:`tsp_core.plan.memory.estimate`) and adds its all-gathers and
reduce-scatters on the data-parallel link (:func:`fsdp_seconds`); replicas then sum 1/dp_shard of
the gradients.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from ..baselines.layouts import LAYOUTS, LayoutSpec, layout_specs
from ..layers.sizes import valid_tsp_sizes
from .fsdp_sim import FSDP_LAYOUTS  # FSDP2 over context parallel is neither simulated nor planned
from .hardware import Cluster
from .memory import estimate, param_counts
from .traffic import ModelShape, baseline_refusal, layer_forward_elements, moe_schedule_bytes

LAYOUT_NAMES = ("tsp", "tp", "tp-sp", "cp", "tp+cp", "tp-sp+cp")
GLOBAL_BATCH_TOKENS = 1 << 24  # 16M tokens per optimizer step (Llama 3's pre-training batch)


@dataclass
class Candidate:
    layout: str
    label: str
    degree: int
    tp: int
    cp: int
    memory_gib: float
    fits: bool
    replicas: int
    active_replicas: int
    tokens_per_s: float
    step_s: float
    compute_s: float
    exposed_comm_s: float
    links: dict[str, str]
    peak_moment: str
    dp_shard: int = 1   # FSDP2 shards each rank's model state over this many ranks (1: none)

    def as_dict(self) -> dict:
        return asdict(self)


def _span(size: int, stride: int, per_node: int) -> str:
    """Link class of a group of ``size`` ranks ``stride`` apart (ranks are numbered node by
    node)."""
    if size <= 1:
        return "none"
    return "intra-node" if size * stride <= per_node else "inter-node"


def candidates(degrees: list[int]) -> list[LayoutSpec]:
    """Every layout at every degree, the 2-D ones at every split (D=1: the plain model, as TSP)."""
    out = []
    for d in degrees:
        if d == 1:
            out.append(LayoutSpec("tsp", 1))
            continue
        for name in LAYOUTS:
            if "+" not in name or any(d % t == 0 for t in range(2, d)):
                out += layout_specs(name, d)
    return out


def check_layout(shape: ModelShape, lay: LayoutSpec) -> str | None:
    """Why ``lay`` cannot run this model, or None."""
    if lay.name == "tsp":  # tsp_core.parallelize's rule (valid_tsp_sizes), schedule (a) for MoE
        d = lay.tp
        divided = [shape.intermediate_size] if shape.num_dense_layers else []
        divided += [shape.num_experts] if shape.is_moe else []  # E/D whole experts per rank
        if shape.delta_net is not None:  # whole key heads per rank (check_delta_net_shape)
            divided.append(shape.delta_net.num_key_heads)
        heads = [shape.num_heads] + ([] if shape.latent else [shape.num_kv_heads])
        if d in valid_tsp_sizes(*heads, *divided):
            return None
        if shape.delta_net is not None and shape.delta_net.num_key_heads % d:
            return (f"D ({d}) must divide linear_num_key_heads "
                    f"({shape.delta_net.num_key_heads}) of the Gated DeltaNet layers")
        if shape.num_heads % d:
            return f"D ({d}) must divide num_attention_heads ({shape.num_heads})"
        if shape.latent is None and shape.num_kv_heads % d and d % shape.num_kv_heads:
            return (f"D ({d}) and num_key_value_heads ({shape.num_kv_heads}): one must divide "
                    f"the other")
        if shape.is_moe and shape.num_experts % d:
            return f"D ({d}) must divide the number of experts ({shape.num_experts})"
        return f"D ({d}) must divide intermediate_size ({shape.intermediate_size})"
    refusal = baseline_refusal(shape)
    if refusal:
        return refusal
    sizes = [("num_attention_heads", shape.num_heads), ("num_key_value_heads", shape.num_kv_heads)]
    if shape.num_dense_layers:
        sizes.append(("intermediate_size", shape.intermediate_size))
    if shape.is_moe:
        sizes.append(("the experts' intermediate size", shape.expert_intermediate_size))
    for what, n in sizes:
        if n % lay.tp:
            return f"tensor-parallel size ({lay.tp}) must divide {what} ({n})"
    return None


def tsp_layer_bytes(shape: ModelShape, d: int, tokens_per_rank: float, passes: int = 4,
                    b: int = 2) -> tuple[float, float]:
    """(prefetchable, exposed) bytes one rank sends per decoder layer in a training step under
    TSP at degree ``d`` with full recompute, averaged over the layers. Prefetchable: weights
    (attention broadcasts, the dense MLP's ring, MoE schedule (b)'s ring), ``passes`` forward
    equivalents (forward, recompute, backward at twice). Exposed: the K/V gathers (and their
    reduce-scatter) and, for MoE schedule (a), its all-to-alls (they wait for the routing) and
    the router's gradient all-reduce, counted exactly by :func:`moe_schedule_bytes`."""
    f = (d - 1) / d
    hidden = passes * f * shape.sharded_attention_weights * b
    # the replicated tensors' (MLA's down-projections, norms) gradient all-reduce, once
    hidden += 2 * f * (shape.attention_weights - shape.sharded_attention_weights) * b
    batch_seq = tokens_per_rank * d
    exposed = passes * shape.sequence_bytes(d, 1, batch_seq, b) if d > 1 else 0.0
    dense = passes * f * shape.mlp_weights * b
    if not shape.is_moe:
        return hidden + dense, exposed
    m = moe_schedule_bytes(shape, tokens_per_rank, d, b, forward_passes=2)
    moe_hidden, moe_exposed = (0.0, m.a) if m.choice == "a" else (m.b, 0.0)
    L, n = shape.num_layers, shape.num_moe_layers
    return (hidden + (n * moe_hidden + (L - n) * dense) / L,
            exposed + n * moe_exposed / L)


def latent_redundant_weights(shape: ModelShape) -> float:
    """Per layer, the weights every TSP rank applies to the whole gathered sequence rather than
    its own tokens: MLA's ``kv_b_proj`` forms each round's K/V from the gathered latent on every
    rank, so it costs D times its per-token count over the group (0 without MLA)."""
    if shape.latent is None:
        return 0.0
    return shape.num_layers * shape.latent.kv_b(shape.num_heads)


def attention_flops(shape: ModelShape, batch: int, seq: int, d: int) -> float:
    """Forward flops of the sequence mixing over all layers, the whole group together:
    softmax attention 2 B S^2 h (causal QK^T and PV); MLA's nq heads at the padded head size P
    (192 in V3) on both sides, 2 B S^2 nq P; Gated DeltaNet's chunked rule, per token and value
    head 4 d_k d_v (d_k + d_v) / d_v for the state and its maps (docs/design.md: the maps cost
    (d_k + d_v) / d_v times the state updates) plus 2 C (d_k + d_v) inside each chunk of C = 64
    tokens, and the scan: every rank composes 2 D maps per round, 4 D nv d_k^2 d_v per layer
    (D times that over the group)."""
    softmax = shape.num_full_layers * 2 * batch * seq * seq * shape.hidden_size
    if shape.latent is not None:
        return shape.num_layers * 2 * batch * seq * seq * shape.num_heads * \
            shape.latent.padded_dim
    n = shape.delta_net
    if n is None:
        return softmax
    dk, dv, nv = n.key_head_dim, n.value_head_dim, n.num_value_heads
    rule = batch * seq * nv * (4 * dk * (dk + dv) + 2 * 64 * (dk + dv))
    scan = d * 4 * d * nv * dk * dk * dv * batch
    return softmax + n.layers * (rule + scan)


def check_dp_shard(lay: LayoutSpec, dp_shard: int, gpus: int) -> str | None:
    """Why ``lay`` cannot run with FSDP2 over ``dp_shard`` ranks on ``gpus`` GPUs, or None: the
    rule of ``tsp_core.init_mesh`` (dp_shard divides the data-parallel size gpus / degree)."""
    from ..distributed.mesh import check_dp_shard as mesh_rule

    if dp_shard > 1 and lay.name not in FSDP_LAYOUTS:
        return (f"dp_shard ({dp_shard}) > 1 is modelled for {', '.join(FSDP_LAYOUTS)} "
                f"(FSDP2 over context parallel is not)")
    if gpus % lay.degree:
        return f"degree ({lay.degree}) must divide the GPUs ({gpus})"
    try:
        mesh_rule(gpus // lay.degree, dp_shard)
    except ValueError as err:
        return f"{err} (= {gpus} GPUs / degree {lay.degree})"
    return None


def fsdp_seconds(shape: ModelShape, lay: LayoutSpec, dp_shard: int, bw: float, lat: float,
                 b: int = 2) -> tuple[float, float]:
    """(forward, backward) seconds of one rank's FSDP2 traffic per step over ``dp_shard`` (S)
    ranks on a link of ``bw`` bytes/s and ``lat`` s per ring step, ring accounting: every unit
    (each layer, the root) is all-gathered in the forward and again in the backward (resharded
    after forward; the recompute reuses the backward's), and every gradient is reduce-scattered
    once: (S-1)/S of this rank's TSP / TP shards once in the forward, twice in the backward."""
    if dp_shard <= 1:
        return 0.0, 0.0
    c = param_counts(shape, lay)
    total = (c["layers"] + c["embed"] + c["head"]) * b
    S, L = dp_shard, shape.num_layers
    f = (S - 1) / S
    forward = f * total / bw + (L + 1) * (S - 1) * lat
    backward = 2 * f * total / bw + 2 * (L + 1) * (S - 1) * lat
    return forward, backward


def evaluate(shape: ModelShape, lay: LayoutSpec, seq: int, cluster: Cluster, batch: int = 1,
             headroom: float = 0.1, global_batch_tokens: int = GLOBAL_BATCH_TOKENS,
             dp_shard: int = 1) -> Candidate:
    dev, n = cluster.device, cluster.gpus_per_node
    mem = estimate(shape, lay, seq, batch, dp_shard=dp_shard)
    fits = mem.peak <= dev.memory_bytes * (1 - headroom)
    d = lay.degree
    h, L, V = shape.hidden_size, shape.num_layers, shape.vocab_size
    tok = batch * seq
    mm = 2 * tok * (L * (shape.attention_weights + shape.active_mlp_weights) + h * V)
    mm += 2 * tok * (d - 1) * latent_redundant_weights(shape)
    att = attention_flops(shape, batch, seq, d)     # causal QK^T and PV, DeltaNet's rule
    # forward + recompute + backward (2x) = 4 forward passes (the LM head is not recomputed: 3)
    compute = (4 * (mm - 2 * tok * h * V) + 3 * 2 * tok * h * V) / d / (dev.peak_tflops * 1e12 *
                                                                       dev.matmul_efficiency)
    compute += 4 * att / d / (dev.peak_tflops * 1e12 * dev.attention_efficiency)
    t, c = (lay.tp, lay.cp)
    links = {"tensor" if lay.name != "tsp" else "tsp": _span(t, 1, n)}
    if lay.name == "cp":
        links = {"context": _span(c, 1, n)}
    elif c > 1:
        links["context"] = _span(c, t, n)
    bw = {"intra-node": cluster.intra_bytes_per_s, "inter-node": cluster.inter_bytes_per_s}
    lat = {"intra-node": cluster.intra_latency_us * 1e-6,
           "inter-node": cluster.inter_latency_us * 1e-6}
    per_layer = 4  # forward, recompute, backward (2x)
    exposed = 0.0
    layer_compute = compute / L
    if lay.name == "tsp":
        link = links["tsp"]
        if link != "none":
            weights, critical = tsp_layer_bytes(shape, t, tok / t, per_layer)
            w_time = weights / bw[link] + per_layer * 3 * t * lat[link]
            exposed = L * (max(0.0, w_time - layer_compute) + critical / bw[link])
    else:
        if t > 1:
            vol = layer_forward_elements("tp", t, c, shape, batch, seq) * 2
            steps = (4 if lay.name.startswith("tp-sp") else 2) * 2 * (t - 1)
            exposed += L * per_layer * (vol / bw[links["tensor"]] + steps * lat[links["tensor"]])
        if c > 1:
            key = "context"
            vol = layer_forward_elements("cp", t, c, shape, batch, seq) * 2
            exposed += L * per_layer * (vol / bw[links[key]] + (c - 1) * lat[links[key]])
    replicas = cluster.gpus // d
    links["data-parallel"] = "inter-node" if cluster.gpus > max(n, d) else \
        ("intra-node" if replicas > 1 else "none")
    if dp_shard > 1:  # FSDP2's gathers hide behind the forward (1/4), the rest behind half the step
        links["fsdp"] = _span(dp_shard, d, n)
        fw, bw_s = fsdp_seconds(shape, lay, dp_shard, bw[links["fsdp"]], lat[links["fsdp"]])
    else:
        fw = bw_s = 0.0
    hsdp = replicas // dp_shard  # groups of dp_shard ranks that replicate each other
    if hsdp > 1:  # ring all-reduce of this rank's (reduce-scattered) gradients
        grads = mem.parts["parameters"]
        bw_s += 2 * (hsdp - 1) / hsdp * grads / bw[_span(hsdp, d * dp_shard, n)]
    exposed += max(0.0, fw - compute / 4) + max(0.0, bw_s - compute / 2)
    step = compute + exposed
    sequences = max(1, global_batch_tokens // tok)
    active = min(replicas, sequences)
    return Candidate(lay.name, lay.label, d, t, c, mem.peak / 2 ** 30, fits, replicas, active,
                     active * tok / step, step, compute, exposed, links, mem.moment, dp_shard)


def plan(shape: ModelShape, seq: int, cluster: Cluster, batch: int = 1,
         degrees: list[int] | None = None, headroom: float = 0.1,
         global_batch_tokens: int = GLOBAL_BATCH_TOKENS,
         dp_shards: tuple[int, ...] = (1,)) -> tuple[list[Candidate], list[str]]:
    """Every layout at every degree (divisors of the node size, and two nodes) and every FSDP2
    size of ``dp_shards``, best first: those that fit before those that do not, then by
    predicted tokens/s. Returns the ranking and the layouts that cannot run this model at all,
    with why. A dp_shard that no degree can use is refused with the numbers."""
    n = cluster.gpus_per_node
    bad = [s for s in dp_shards if not isinstance(s, int) or s < 1]
    if bad or not dp_shards:
        raise ValueError(f"dp_shard must be positive integers (1: no FSDP2), got "
                         f"{list(dp_shards)}")
    if degrees is None:
        degrees = ([d for d in range(1, n + 1) if n % d == 0]
                   + ([2 * n] if cluster.gpus >= 2 * n else []))
    ranked, refused = [], []
    for lay in candidates(degrees):
        if cluster.gpus % lay.degree:
            continue
        why = check_layout(shape, lay)
        if why:
            refused.append(f"{lay.label} at {lay.degree}: {why}")
            continue
        for s in dp_shards:
            if s > 1 and (lay.name not in FSDP_LAYOUTS or check_dp_shard(lay, s, cluster.gpus)):
                continue  # reported once per dp_shard below
            ranked.append(evaluate(shape, lay, seq, cluster, batch, headroom,
                                   global_batch_tokens, s))
    for s in (s for s in dict.fromkeys(dp_shards) if s > 1):
        why = [f"D={d}: {check_dp_shard(LayoutSpec('tsp', d), s, cluster.gpus)}"
               for d in degrees if cluster.gpus % d == 0
               and check_dp_shard(LayoutSpec("tsp", d), s, cluster.gpus)]
        if why:
            refused.append(f"dp_shard {s}: " + "; ".join(why))
        if not any(c.dp_shard == s for c in ranked):
            raise ValueError(f"dp_shard ({s}) fits no degree on {cluster.gpus} GPUs: "
                             + "; ".join(why or ["every layout is refused"]))
    ranked.sort(key=lambda c: (not c.fits, -c.tokens_per_s))
    return ranked, refused


def auto_tsp_size(shape: ModelShape, seq: int, gpus_per_node: int, memory_bytes: float,
                  batch: int = 1, headroom: float = 0.1) -> int:
    """The smallest TSP degree inside one node whose per-rank peak fits ``memory_bytes`` with
    ``headroom`` to spare (what ``tsp_size="auto"`` asks). Raises naming the binding constraint."""
    tried = []
    for d in range(1, gpus_per_node + 1):
        if gpus_per_node % d:
            continue
        why = check_layout(shape, LayoutSpec("tsp", d))
        if why:
            tried.append(f"D={d}: {why}")
            continue
        peak = estimate(shape, LayoutSpec("tsp", d), seq, batch).peak
        if peak <= memory_bytes * (1 - headroom):
            return d
        tried.append(f"D={d}: {peak / 2**30:.1f} GiB > "
                     f"{memory_bytes * (1 - headroom) / 2**30:.1f} GiB")
    raise ValueError(f"no TSP degree inside a node of {gpus_per_node} GPUs fits {seq} tokens x "
                     f"batch {batch} in {memory_bytes / 2**30:.1f} GiB with {headroom:.0%} "
                     f"headroom ("
                     + "; ".join(tried) + "); shorten the sequence, use more GPUs per node, or set "
                     "tsp_size yourself")
