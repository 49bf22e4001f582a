"""Which schedule moves fewer bytes: the traffic model's per-layer bytes of both
(:func:`moe_bytes`) and the choice by them (:func:`choose_schedule`)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from .spec import MoESpec


@dataclass(frozen=True)
class MoEScheduleBytes:
    """Bytes one rank sends in one MoE layer under the two TSP schedules of ``docs/moe.md``."""

    a_forward: float   # (a) expert parallel: dispatch + combine (+ the counts)
    a_backward: float  # their gradients + the router's gradient all-reduce
    b_forward: float   # (b) the ring: every rank's slice of every expert travels D-1 hops
    b_backward: float  # the slices again (D-1 hops) + the gradient accumulators (D hops) + router
    crossover: float   # tokens per rank at which (a) and (b) move the same bytes
    forward_passes: int = 1

    @property
    def a(self) -> float:
        return self.forward_passes * self.a_forward + self.a_backward

    @property
    def b(self) -> float:
        return self.forward_passes * self.b_forward + self.b_backward

    @property
    def choice(self) -> str:
        """"a" or "b": the schedule that moves fewer bytes (ties: "a", the default)."""
        return "a" if self.a <= self.b else "b"


def moe_bytes(E: int, k: int, Fe: int, h: int, tokens_per_rank: float, d: int, b: int = 2,
              forward_passes: int = 1, shared: int = 0, router_extra: int = 0
              ) -> MoEScheduleBytes:
    """:func:`tsp_core.plan.traffic.moe_schedule_bytes` of E experts of Fe channels, top k, hidden h
    (what :func:`choose_schedule` decides with). ``shared``: the shared experts' intermediate
    size; they run as the dense TSP MLP under both schedules (their channel slices travel, no
    token moves: 3 Fs h b (D-1)/D forward, (2D-1)/D of it backward), so they add the same bytes
    to both and leave the crossover where it is. ``router_extra``: the router's numbers beyond
    its [E, h] weight (Gemma 4's scale [h] and per-expert scales [E]), whose gradients are
    all-reduced with it under both schedules (the crossover stays too)."""
    f = (d - 1) / d
    per_token = f * 2 * k * h * b                   # one all-to-all pair per token, one pass
    router = f * 2 * (E * h + router_extra) * b
    dense = 3 * shared * h * b                      # the shared experts' weights
    a_fw = per_token * tokens_per_rank + f * 8 * E + f * dense
    a_bw = per_token * tokens_per_rank + router + (f + 1) * dense
    ring = 3 * E * Fe * h * b
    b_fw, b_bw = f * (ring + dense), (f + 1) * (ring + dense) + router
    if f == 0:
        crossover = float("inf")
    else:  # forward_passes * (a_fw - b_fw) + a_bw - b_bw = 0, linear in T
        crossover = (forward_passes * (f * ring - f * 8 * E) + (f + 1) * ring) / \
            ((forward_passes + 1) * per_token)   # the shared experts' bytes cancel
    return MoEScheduleBytes(a_fw, a_bw, b_fw, b_bw, crossover, forward_passes)


SCHEDULES = ("expert", "ring")


def choose_schedule(spec: MoESpec, tokens_per_rank: int | None, forward_passes: int = 1) -> str:
    """The schedule that moves fewer bytes per layer for ``tokens_per_rank`` (batch x sequence
    / D), by the traffic model's formula (:func:`moe_bytes`, docs/moe.md;
    ``forward_passes`` 2 under full recompute); "expert" when it is not known. They cross at
    about T* = 9 E F / (4 k) tokens per rank (at D = 8: Mixtral-8x7B 135168, Qwen3-30B-A3B 28965:
    "expert" at the lengths people train Mixtral at, "ring" for Qwen3-30B-A3B beyond ~232K
    tokens at D = 8)."""
    if tokens_per_rank is None:
        return "expert"
    router = sum(math.prod(shape) for shape in spec.router_shapes().values())
    bytes_ = moe_bytes(spec.num_experts, spec.top_k, spec.intermediate_size, spec.hidden_size,
                       tokens_per_rank, spec.tsp_size, forward_passes=forward_passes,
                       shared=spec.shared_intermediate_size,
                       router_extra=router - spec.num_experts * spec.hidden_size)
    return "expert" if bytes_.choice == "a" else "ring"
