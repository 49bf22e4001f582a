"""Megatron tensor-parallel mixture of experts (no expert parallelism) for the ``tp`` / ``tp-sp``
baselines (and their ``+cp`` meshes): the router is replicated and every expert's intermediate
channels are split 1/T over the tensor-parallel ranks, like the dense MLP's.

Rank r of T holds, of every expert, the gate rows [rF/T, (r+1)F/T) and the up rows
[F + rF/T, F + (r+1)F/T) of Hugging Face's ``gate_up_proj`` [E, 2F, h] (``_StridedShard(1,
split_factor=2)``: the gate half and the up half each split 1/T, so ``full_tensor()`` and every
full state dict give Hugging Face's tensor back; a plain ``Shard(1)`` would give rank 0 only gate
rows) and the columns [rF/T, (r+1)F/T) of ``down_proj`` [E, h, F] (``Shard(2)``). The router
``gate.weight`` [E, h] is a ``Replicate`` DTensor.

Forward of one block (``x`` replicated for ``tp``, sequence-sharded for ``tp-sp``):
the input becomes replicated (``tp-sp``: one all-gather along the sequence, as for the dense MLP);
every rank computes Hugging Face's routing on all of those tokens (identical on every rank: the
same tokens, the same router), runs each expert on the tokens routed to it with its channel slice
(the model's experts implementation, ``config._experts_implementation``: Hugging Face's
``grouped_mm`` etc. on this rank's slices, or the eager expert loop, so every layout runs the same
expert kernels), and the partial outputs are summed by one all-reduce (``tp``) or
reduce-scattered along the sequence (``tp-sp``), exactly as the dense MLP's row-parallel output.
The backward is Megatron's: the experts' part of the input's gradient is partial on every rank
and is summed by the all-reduce (``tp``) / reduce-scatter (``tp-sp``) of the input's DTensor.
The routing weights' gradient is partial too (each rank's channels' share of every expert's
output), and Hugging Face computes the top-k weights in float32 even in a float64 model: rounding
each rank's share to float32 before summing would be ~1e-8 off one process. So the routing
weights' gradient is all-reduced first, in the dtype of their product with the experts' output
(one all-reduce of N x k elements in the backward, through :func:`tsp_core.comm.sum_grad`;
Hugging Face's ``moe_tp_experts`` does the same); from there the router's backward is
replicated: the router weight's gradient is complete and identical on every rank (a
``Replicate`` DTensor), and its part of the input's gradient is kept by tensor-parallel rank 0
only (zero elsewhere), so the input's reduction counts it once.

Collectives per MoE block, forward: ``tp`` one all-reduce of its output [N, h]; ``tp-sp`` one
all-gather of its input and one reduce-scatter of its output (DTensor's, counted by
:func:`tsp_core.comm.count_functional_collectives`: exactly the dense MLP's; routing adds none).
Backward: the same as the dense MLP's plus the all-reduce of the routing weights' gradient.

The load-balancing loss is not Hugging Face's (which never sees these router logits): each block
keeps ``router_logits`` (every token its rank routed, identical on the tensor-parallel ranks) and
:func:`tsp_core.layers.moe.load_balancing_loss` computes it over the global batch as one process
does.

Under ``FakeTensorMode`` (``tsp simulate``), where routing has no values, the eager expert loop
runs on the token counts of uniform routing (every expert gets N k / E of the N k routed copies);
Hugging Face's ``grouped_mm`` needs no values (fixed shapes) and runs as it is.
"""

from __future__ import annotations

import types

import torch
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import is_fake
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.placement_types import _StridedShard

from ..distributed import comm
from ..layers.moe import MoESpec, recomputing, route
from ..models.policies import DecoderPolicy, ExpertsPolicy

GATE_UP = _StridedShard(1, split_factor=2)  # gate rows and up rows, each split 1/T


def check_moe(config, policy: DecoderPolicy, tp: int) -> None:
    """Raise, naming the numbers, when a family's experts cannot be split over ``tp`` ranks."""
    experts = policy.ffn.moe
    if experts is None:
        return
    f = getattr(config, experts.intermediate_size)
    if f % tp:
        raise ValueError(f"tensor-parallel size ({tp}) must divide {experts.intermediate_size} "
                         f"({f}): each rank holds 1/{tp} of every expert's channels")
    jitter = getattr(config, "router_jitter_noise", 0) or 0
    if jitter:
        raise NotImplementedError(f"router_jitter_noise ({jitter}) is random noise on the "
                                  f"router's input; the tensor-parallel experts do not apply it")


class Router(nn.Module):
    """The replicated router: ``weight`` [E, h] (Hugging Face's ``gate.weight``)."""

    def __init__(self, weight: torch.Tensor, mesh: DeviceMesh) -> None:
        super().__init__()
        self.weight = nn.Parameter(distribute_tensor(weight.detach(), mesh, [Replicate()]),
                                   requires_grad=weight.requires_grad)


class TensorParallelExperts(nn.Module):
    """Hugging Face's experts with every expert's channels split 1/T: ``gate_up_proj`` [E, 2F, h]
    (``_StridedShard(1, 2)``) and ``down_proj`` [E, h, F] (``Shard(2)``). ``forward(x, experts,
    weights)`` (x [N, h] replicated, top-k ``experts``/``weights`` [N, k]) returns this rank's
    partial sum [N, h] of every token's weighted expert outputs on this rank's channels, with
    the model's experts implementation (read from the config at each call, as Hugging Face's
    experts do): a registered one (``grouped_mm``, ...) on the local slices, or Hugging Face's
    eager loop (under fake tensors, on uniform routing)."""

    def __init__(self, experts: nn.Module, mesh: DeviceMesh, num_experts: int) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.act_fn = experts.act_fn
        # the experts implementation's switches (transformers.integrations.moe); the config is
        # the model's, so model.set_experts_implementation(...) reaches this module too
        self._hf = {k: getattr(experts, k) for k in (
            "config", "has_gate", "has_bias", "has_post_expert_norm", "is_transposed",
            "is_concatenated") if hasattr(experts, k)}
        self._custom_gate = getattr(type(experts), "_apply_gate", None)
        for name, placement in (("gate_up_proj", GATE_UP), ("down_proj", Shard(2))):
            full = getattr(experts, name)
            setattr(self, name, nn.Parameter(distribute_tensor(full.detach(), mesh, [placement]),
                                             requires_grad=full.requires_grad))

    def _assignments(self, experts: torch.Tensor) -> list[tuple[int, torch.Tensor, torch.Tensor]]:
        """(expert, tokens, slots) of every expert that received tokens, in expert order."""
        n, k = experts.shape
        if is_fake(experts):  # no values: uniform routing, copies token-major
            total, out, start = n * k, [], 0
            for e in range(self.num_experts):
                count = total // self.num_experts + (e < total % self.num_experts)
                flat = torch.arange(start, start + count, device=experts.device)
                out.append((e, flat // k, flat % k))
                start += count
            return out
        # Hugging Face's eager loop (MixtralExperts.forward)
        with torch.no_grad():
            mask = F.one_hot(experts, num_classes=self.num_experts).permute(2, 1, 0)  # [E, k, N]
            hit = torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero().flatten().tolist()
        out = []
        for e in hit:
            slot, token = torch.where(mask[e])
            out.append((e, token, slot))
        return out

    def _gate(self, gate_up: torch.Tensor) -> torch.Tensor:
        """Hugging Face's default gating on this rank's [gate_r; up_r] channels."""
        gate, up = gate_up.chunk(2, dim=-1)
        return self.act_fn(gate) * up

    def _implementation(self):
        """The registered experts function the model's config names, or None for eager."""
        name = getattr(self._hf.get("config"), "_experts_implementation", None)
        if name in (None, "eager"):
            return None
        from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS, _default_apply_gate

        h = {k: v for k, v in self._hf.items() if k != "config"}
        if h.get("has_bias") or h.get("has_post_expert_norm") or h.get("is_transposed") or \
                not h.get("has_gate", True) or not h.get("is_concatenated", True) or \
                self._custom_gate not in (None, _default_apply_gate):
            raise NotImplementedError(f"experts implementation {name!r} with {h}: the tensor-"
                                      f"parallel experts hold concatenated gate/up weights, no "
                                      f"biases, and gate the default way only")

        return ALL_EXPERTS_FUNCTIONS.get_interface(name, None)

    def forward(self, x: torch.Tensor, experts: torch.Tensor,
                weights: torch.Tensor) -> torch.Tensor:
        gate_up, down = self.gate_up_proj.to_local(), self.down_proj.to_local()
        implementation = self._implementation()
        if implementation is not None:  # Hugging Face's function on this rank's slices
            view = types.SimpleNamespace(
                gate_up_proj=gate_up, down_proj=down, num_experts=self.num_experts,
                act_fn=self.act_fn, has_gate=True, has_bias=False, has_post_expert_norm=False,
                is_transposed=False, is_concatenated=True, _is_expert_parallel=False,
                config=self._hf.get("config"), _apply_gate=self._gate)
            return implementation(view, x, experts, weights)
        y = torch.zeros_like(x)
        gate_ups, downs = gate_up.unbind(0), down.unbind(0)  # one gradient buffer, not E
        for e, token, slot in self._assignments(experts):
            gate, up = F.linear(x[token], gate_ups[e]).chunk(2, dim=-1)
            part = F.linear(self.act_fn(gate) * up, downs[e]) * weights[token, slot, None]
            y.index_add_(0, token, part.to(y.dtype))
        return y


class _FirstRankGrad(torch.autograd.Function):
    """Identity whose backward keeps the gradient on one rank and zeroes it on the others: a
    replicated computation's gradient entering a tensor whose gradient is summed over them."""

    @staticmethod
    def forward(ctx, x, keep: bool):
        ctx.keep = keep
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return (g if ctx.keep else None), None  # None: a zero gradient, nothing allocated


class TensorParallelMoE(nn.Module):
    """A Hugging Face sparse MoE block (Mixtral's, Qwen3-MoE's) with Megatron's tensor-parallel
    experts; same parameter names and full shapes (``gate.weight``, ``experts.gate_up_proj``,
    ``experts.down_proj``). ``forward(hidden_states)`` takes what the dense MLP takes (a local
    replicated tensor, or the sequence-sharded DTensor of ``tp-sp``) and returns a local tensor
    of the same layout. ``router_logits`` [N, E]: the last forward's, of every token routed."""

    def __init__(self, block: nn.Module, mesh: DeviceMesh, spec: MoESpec, experts: ExpertsPolicy,
                 sequence_parallel: bool) -> None:
        super().__init__()
        self.mesh, self.spec = mesh, spec
        self.seq = Shard(1) if sequence_parallel else Replicate()
        self.gate = Router(getattr(block, experts.router).weight, mesh)
        self.experts = TensorParallelExperts(getattr(block, experts.experts), mesh,
                                             spec.num_experts)
        self.router_logits: torch.Tensor | None = None

    def extra_repr(self) -> str:
        s = self.spec
        return (f"experts={s.num_experts}, top_k={s.top_k}, channels per rank="
                f"{s.intermediate_size // self.mesh.size()} of {s.intermediate_size}, "
                f"layout={self.seq}")

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        x = hidden_states
        if not isinstance(x, DTensor):
            x = DTensor.from_local(x, self.mesh, [self.seq], run_check=False)
        # x's gradient is partial on every rank: summed by x's DTensor backward (all-reduce, or
        # reduce-scatter along the sequence), once for the experts and the router together
        x = x.redistribute(self.mesh, [Replicate()]).to_local(grad_placements=[Partial()])
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        # the router's backward is replicated (complete on every rank): rank 0 alone passes its
        # part of x's gradient on
        first = self.mesh.get_local_rank() == 0
        logits = F.linear(_FirstRankGrad.apply(x2, first), self.gate.weight.to_local())
        if not recomputing():  # the load-balancing loss reads the forward's, not a recompute's
            self.router_logits = logits
        weights, experts = route(logits, self.spec)
        # each rank's share of the weights' gradient, summed before it reaches the router's
        # float32 (in the product's dtype, as Hugging Face's weights * expert output promotes)
        weights = weights.to(torch.promote_types(weights.dtype, x2.dtype))
        weights = comm.sum_grad(weights, self.mesh.get_group())
        y = self.experts(x2, experts, weights).view(shape)
        return DTensor.from_local(y, self.mesh, [Partial()], run_check=False).redistribute(
            self.mesh, [self.seq]).to_local()


def apply_moe(layer: nn.Module, policy: DecoderPolicy, config, mesh: DeviceMesh,
              sequence_parallel: bool) -> None:
    """Replace ``layer``'s sparse MoE block by a :class:`TensorParallelMoE`."""
    experts, mlp = policy.ffn.moe, policy.modules.mlp
    spec = experts.spec(config, mesh.size())
    block = getattr(layer, mlp)
    setattr(layer, mlp, TensorParallelMoE(block, mesh, spec, experts, sequence_parallel))
