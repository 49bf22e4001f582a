""":class:`TSPMoE`, the sparse MoE block with Hugging Face's names and shapes, running either
schedule, the shared experts beside them and the decode step."""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.nn.functional as F

from ...distributed import comm, opaque
from ...distributed.mesh import TSPMesh
from ...distributed.params import (
    REPLICATED,
    ShardedModule,
    ShardSpec,
    TensorSource,
    even_spec,
    init_full,
    local,
    schedule_inputs,
)
from ..mlp import MLPSpec, TSPGatedMLPFn, activate, check_local_input
from ..sizes import valid_sizes_hint, valid_tsp_sizes
from ..tiles import TokenTiled, mlp_tile_tokens
from .choice import SCHEDULES
from .dispatch import dispatch_combine
from .experts import expert_views, glu
from .ring import RingExpertsFn
from .routing import dense_weights, recomputing, route_tokens
from .spec import MoESpec, check_moe_shape, check_router


class TSPMoE(TokenTiled, ShardedModule):
    """A sparse mixture-of-experts block with Hugging Face's names and shapes: the router
    ``<router_name>.weight`` [E, h] (and ``.bias`` [E], gpt-oss; replicated), the experts as the
    family stores them (``layout``, :data:`LAYOUTS`: ``experts.gate_up_proj`` [E, 2F, h] and
    ``experts.down_proj`` [E, h, F] for "rows"; [E, h, 2F] and [E, F, h] otherwise; with
    ``expert_bias`` ``experts.gate_up_proj_bias`` [E, 2F] and ``experts.down_proj_bias`` [E, h],
    the latter replicated: it is added per token after the experts, each chosen expert's bias
    times its weight, one [N, E] x [E, h] product). ``schedule`` "expert": split by whole experts
    over the TSP group; "ring": every expert split by intermediate channels (for "rows" and
    "columns" kept as ``experts.gate_proj`` and ``experts.up_proj``, named and loaded as the
    fused ``gate_up_proj`` in every full state dict and checkpoint; an "interleaved" slice of
    channels is one run of columns of ``gate_up_proj``). ``options``: the other
    :class:`MoESpec` fields. ``forward(x)`` takes this rank's tokens [B, S/D, h] (``returns_pair``:
    see :meth:`forward`). With ``router_apart`` (Gemma 4) the module is the experts alone,
    named as Hugging Face's experts module names them (``gate_up_proj``, ``down_proj``), and
    ``forward(x, experts, weights)`` takes the routing of a :class:`TSPRouter`."""

    def __init__(self, mesh: TSPMesh, hidden_size: int, intermediate_size: int, num_experts: int,
                 top_k: int, *, schedule: str = "expert", dtype: torch.dtype | None = None,
                 router_dtype: torch.dtype | None = None,
                 device: torch.device | str | None = None, init_seed: int | None = 0,
                 tile_tokens: int | None = None, returns_pair: bool = False,
                 **options) -> None:
        super().__init__()
        self.tile_tokens, self.returns_pair = tile_tokens, returns_pair
        if schedule not in SCHEDULES:
            raise ValueError(f"schedule {schedule!r} is not one of {SCHEDULES}")
        check_moe_shape(mesh.size, num_experts, top_k, schedule)
        if schedule == "ring" and intermediate_size % mesh.size:
            hint = valid_sizes_hint(valid_tsp_sizes(None, None, intermediate_size),
                                    f"the experts' intermediate size {intermediate_size}")
            raise ValueError(f"tsp_size ({mesh.size}) must divide the experts' intermediate size "
                             f"({intermediate_size}) under the ring schedule; {hint}")
        # one object per value: the layers of a kind then share one compiled graph (opaque)
        self.spec = s = opaque.interned(MoESpec(hidden_size, intermediate_size, num_experts,
                                                top_k, mesh.size, **options))
        check_router(s)
        fs = s.shared_intermediate_size
        if fs % mesh.size:
            hint = valid_sizes_hint(valid_tsp_sizes(None, None, fs),
                                    f"the shared experts' intermediate size {fs}")
            raise ValueError(f"tsp_size ({mesh.size}) must divide the shared experts' "
                             f"intermediate size ({fs}): they run as the dense TSP MLP; {hint}")
        if s.shared_gate is not None and not fs:
            raise ValueError(f"a shared-expert gate ({s.shared_gate}) needs shared experts: "
                             f"shared_intermediate_size is 0")
        if s.expert_bias and s.layout != "interleaved":
            raise ValueError(f"expert biases are implemented for the \"interleaved\" layout "
                             f"(gpt-oss), not {s.layout!r}")
        self.mesh, self.schedule = mesh, schedule
        h, f, e = hidden_size, intermediate_size, num_experts
        r = s.router_name
        # the router's tensors by their names here and in it (none: a TSPRouter routes)
        self.router_parts = {} if s.router_apart else {
            f"{r}.{n}": n for n in s.router_shapes()}
        self.router_names = tuple(self.router_parts)
        shapes = {f"{r}.{n}": shape for n, shape in s.router_shapes().items()}
        ex = self.experts_prefix = "" if s.router_apart else "experts."
        rows = s.layout == "rows"
        gate_up, down = ((e, 2 * f, h), (e, h, f)) if rows else ((e, h, 2 * f), (e, f, h))
        if schedule == "expert" or s.layout == "interleaved":
            self.expert_names = (f"{ex}gate_up_proj", f"{ex}down_proj",
                                 *((f"{ex}gate_up_proj_bias",) if s.expert_bias else ()))
            shapes.update({f"{ex}gate_up_proj": gate_up, f"{ex}down_proj": down,
                           f"{ex}gate_up_proj_bias": (e, 2 * f)})
        else:  # the ring's gate and up slices, fused by name below
            self.expert_names = (f"{ex}gate_proj", f"{ex}up_proj", f"{ex}down_proj")
            part = (e, f, h) if rows else (e, h, f)
            shapes.update({f"{ex}gate_proj": part, f"{ex}up_proj": part, f"{ex}down_proj": down})
        self.down_bias = (f"{ex}down_proj_bias",) if s.expert_bias else ()
        shapes[f"{ex}down_proj_bias"] = (e, h)
        # the shared experts: TSPGatedMLP's parameters and schedule, on this rank's own tokens
        self.shared = tuple(f"{s.shared_name}.{p}_proj.weight" for p in ("gate", "up", "down"))
        shapes.update({self.shared[0]: (fs, h), self.shared[1]: (fs, h), self.shared[2]: (h, fs)})
        self.names = (*self.router_names, *self.expert_names, *self.down_bias,
                      *(self.shared if fs else ()))
        # the shared experts' gate (Qwen3-Next): replicated, its gradient summed over the group
        self.shared_gate = (f"{s.shared_gate}.weight",) if s.shared_gate is not None else ()
        shapes.update({n: (1, h) for n in self.shared_gate})
        self.full_shapes = {n: shapes[n] for n in (*self.names, *self.shared_gate)}
        self.router_logits: torch.Tensor | None = None
        full = init_full(self.full_shapes, init_seed, dtype, device)
        if router_dtype is not None and self.router_names:  # GLM-4.5's router weight stays
            weight = self.router_names[0]                    # float32 in a bf16 model
            full[weight] = full[weight].to(router_dtype)
        self._create(full)
        if schedule == "ring" and s.layout != "interleaved":
            self.fuse_tensors(f"{ex}gate_up_proj", (f"{ex}gate_proj", f"{ex}up_proj"),
                              1 if rows else 2)
        if s.correction_bias:  # a buffer (not trained), float32 at least, as Hugging Face keeps it
            wide = torch.promote_types(dtype or torch.get_default_dtype(), torch.float32)
            self.router_module.register_buffer("e_score_correction_bias",
                                        torch.zeros(e, dtype=wide, device=device))

    @property
    def router_module(self) -> torch.nn.Module:
        """The router's module (Hugging Face's ``gate`` or ``router``)."""
        return getattr(self, self.spec.router_name)

    def load_full(self, full) -> None:
        """The parameters' slices, and the correction bias whole where ``full`` has it (a
        checkpoint may leave a buffer out: it keeps its value)."""
        super().load_full(full)
        name = f"{self.spec.router_name}.e_score_correction_bias"
        if self.spec.correction_bias:
            source = TensorSource(full) if isinstance(full, Mapping) else full
            if source.shape(name) is not None:
                with torch.no_grad():
                    self.router_module.e_score_correction_bias.copy_(source.read(name, None, 0, 0))

    def _route(self, x2: torch.Tensor, router: list[torch.Tensor]) -> tuple[torch.Tensor, ...]:
        """(logits, top-k weights, experts) of tokens x2 [N, h] with the router's tensors
        ``router`` (in ``router_names``' order)."""
        choice = self.router_module.e_score_correction_bias if self.spec.correction_bias else None
        named = dict(zip(self.router_parts.values(), router))
        return route_tokens(x2, named, self.spec, choice)

    def extra_repr(self) -> str:
        s = self.spec
        return (f"hidden_size={s.hidden_size}, intermediate_size={s.intermediate_size}, "
                f"experts={s.num_experts}, top_k={s.top_k}, tsp_size={s.tsp_size}, "
                f"schedule={self.schedule}, router={s.router}, layout={s.layout}"
                + (f", shared={s.shared_intermediate_size}" if s.shared_intermediate_size else ""))

    def shard_spec(self, name: str, rank: int) -> ShardSpec:
        s = self.spec
        if name in self.router_names or name in self.down_bias or name in self.shared_gate:
            return REPLICATED
        if name in self.shared:  # the dense TSP MLP's slices of intermediate channels
            return even_spec(s.shared_intermediate_size, rank, s.tsp_size,
                             1 if name == self.shared[2] else 0)
        if self.schedule == "expert":
            return even_spec(s.num_experts, rank, s.tsp_size, 0)
        # the ring: the intermediate channels' dim ([E, F or 2F, ...] or [E, ..., F or 2F])
        down = name == f"{self.experts_prefix}down_proj"
        dim = (2 if down else 1) if s.layout == "rows" else (1 if down or "bias" in name else 2)
        return even_spec(self.full_shapes[name][dim], rank, s.tsp_size, dim)

    def forward(self, x: torch.Tensor, top_k_index: torch.Tensor | None = None,
                top_k_weights: torch.Tensor | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """This rank's tokens' output; with ``returns_pair`` (gpt-oss's and Llama 4's blocks
        return a pair their layer unpacks) (output, router logits). With ``router_apart``: the
        experts' output of tokens x [N, h] routed by the caller's TSPRouter to ``top_k_index``
        with ``top_k_weights`` [N, k] (Hugging Face's experts' signature)."""
        if self.spec.router_apart:
            if top_k_index is None or top_k_weights is None:
                raise ValueError("these experts are routed by a TSPRouter apart (router_apart): "
                                 "call them as experts(x, top_k_index, top_k_weights)")
            routed = (top_k_weights, top_k_index)
            if self.tsp_decode is not None:  # generation (what tsp_decode.mlp does for a TSPMoE)
                return self.decode_step(x, routed)
            return self._forward(x, routed)[0]
        if self.tsp_decode is not None:  # generation: x identical on every rank
            y = self.tsp_decode.mlp(self, x)
            return (y, None) if self.returns_pair else y
        y, logits = self._forward(x)
        return (y, logits) if self.returns_pair else y

    def _forward(self, x: torch.Tensor, routed: tuple[torch.Tensor, torch.Tensor] | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(output, router logits) of this rank's tokens x; ``routed``: their (top-k weights,
        experts) from a router apart (the logits are then None)."""
        s = self.spec
        # routed apart, the tokens come flat, [N, h], as Hugging Face's experts take them
        check_local_input(x[None] if routed is not None and x.dim() == 2 else x, s.hidden_size)
        x, weights, context = schedule_inputs(self, list(self.names[len(self.router_names):]), x)
        experts_weights = weights[:len(self.expert_names)]
        down_bias = weights[len(self.expert_names):][:len(self.down_bias)]
        shared = weights[len(self.expert_names) + len(self.down_bias):]
        router = [local(self.get_parameter(n)) for n in self.router_names]
        if s.router != "sigmoid":  # the input's dtype (autocast's, as the other weights)
            router = [w.to(x.dtype) for w in router]  # the sigmoid router widens it itself
        with context:
            x2 = x.reshape(-1, s.hidden_size)
            router = [comm.sum_grad(w, self.mesh.group) for w in router]
            logits, weights, experts = ((None, *routed) if routed is not None
                                        else self._route(x2, router))
            if not recomputing():  # the load-balancing loss reads the forward's, not a recompute's
                self.router_logits = logits
            if self.schedule == "expert":
                # a tile's gate and up are two [tile, F] products: count 2F channels
                tile = self.tile_tokens or mlp_tile_tokens(2 * s.intermediate_size, x.dtype)
                y = dispatch_combine(x2, weights, experts, experts_weights, s, self.mesh.group,
                                     tile)
            else:
                tile = self.tile_tokens or mlp_tile_tokens(s.intermediate_size // s.tsp_size,
                                                           x.dtype)
                y = RingExpertsFn.apply(x2, weights, experts, s, self.mesh.group, tile,
                                         *experts_weights)
            if down_bias:  # each chosen expert's bias, times its weight
                bias = comm.sum_grad(down_bias[0], self.mesh.group)
                y = y + (dense_weights(weights, experts, s.num_experts).to(bias.dtype) @ bias
                         ).to(y.dtype)
            y = y.view(x.shape)
            if shared:  # Hugging Face adds them after the routed experts' sum
                spec = MLPSpec(s.hidden_size, s.shared_intermediate_size, s.tsp_size,
                               s.activation)
                tile = self.tile_tokens or mlp_tile_tokens(
                    s.shared_intermediate_size // s.tsp_size, x.dtype)
                y = y + self._shared_gate(x) * TSPGatedMLPFn.apply(x, spec, self.mesh.group,
                                                                   tile, *shared)
        return y, logits

    def _shared_gate(self, x: torch.Tensor, sync: bool = True) -> torch.Tensor | float:
        """The shared experts' scale per token of x [..., h]: ``sigmoid(x @ gate^T)`` [..., 1]
        (Qwen3-Next), or 1 without a gate; ``sync``: the gate's gradient summed over the group
        (each rank's tokens add to it)."""
        if not self.shared_gate:
            return 1.0
        gate = local(self.get_parameter(self.shared_gate[0])).to(x.dtype)
        if sync:
            gate = comm.sum_grad(gate, self.mesh.group)
        return torch.sigmoid(F.linear(x, gate))

    def decode_step(self, x: torch.Tensor,
                    routed: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """Generation: ``x`` [..., h] identical on every rank; each rank adds what it holds (its
        own experts, or its channels of every expert) for each token's experts, weighted; an
        all-reduce sums them. No token or weight moves. Replicated tensors (the down-projection
        biases) are added after the sum, once. ``routed``: (top-k weights, experts) from a
        router apart."""
        s = self.spec
        x2 = x.reshape(-1, s.hidden_size)
        if routed is None:
            router = [local(self.get_parameter(n)) for n in self.router_names]
            _, weights, experts = self._route(x2, router)
        else:
            weights, experts = routed
        tensors = [local(self.get_parameter(n)) for n in self.expert_names]
        expert = self.schedule == "expert"
        first, owned = ((self.mesh.rank * s.local_experts, range(s.local_experts)) if expert
                        else (0, range(s.num_experts)))
        split = not expert and s.layout != "interleaved"
        y = torch.zeros_like(x2)
        for e in owned:
            token, slot = torch.where(experts == first + e)
            if token.numel():
                wg, wu, wd, bg, bu = expert_views(s, tensors, e, split)
                w = weights[token, slot, None]
                xe = x2[token] * w.to(x2.dtype) if s.weight_input else x2[token]
                out = F.linear(glu(F.linear(xe, wg, bg), F.linear(xe, wu, bu), s), wd)
                y.index_add_(0, token, (out if s.weight_input else out * w).to(y.dtype))
        if s.shared_intermediate_size:  # this rank's channels of the shared experts: summed
            wg, wu, wd = (local(self.get_parameter(n)) for n in self.shared)  # apart, added
            shared = (activate(F.linear(x2, wg), s.activation) * F.linear(x2, wu)) @ wd.t()  # after
            shared = self._shared_gate(x2, sync=False) * shared  # per token: before the sum
            both = torch.stack([y, shared])
            comm.all_reduce(both, self.mesh.group)  # one all-reduce for both
            y = both[0] + both[1]
        else:
            comm.all_reduce(y, self.mesh.group)
        if self.down_bias:
            bias = local(self.get_parameter(self.down_bias[0]))
            y = y + (dense_weights(weights, experts, s.num_experts).to(bias.dtype) @ bias
                     ).to(y.dtype)
        return y.view(x.shape)
