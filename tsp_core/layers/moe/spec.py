"""What an MoE layer is (:class:`MoESpec`: its shapes, router kind, experts' layout and
activation) and the checks that refuse what cannot route or be owned, naming the numbers, before
any collective."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields

from ..mlp import ACTIVATIONS
from ..sizes import valid_sizes_hint, valid_tsp_sizes


@dataclass(frozen=True)
class MoESpec:
    hidden_size: int
    intermediate_size: int   # per expert
    num_experts: int
    top_k: int
    tsp_size: int
    activation: str = "silu"  # ACTIVATIONS, or "swiglu_clamped" (gpt-oss: swiglu_limit, _alpha)
    norm_topk: bool = True              # renormalise the top-k weights to sum to one
    weights_in_logits_dtype: bool = False  # cast them back to the logits' dtype (Qwen3-MoE)
    # the router kind (ROUTERS) and its parameters; "sigmoid": GLM-4.5's (DeepSeek-V3's) router
    router: str = "softmax"
    routed_scaling: float = 1.0         # the top-k weights times this (routed_scaling_factor)
    n_group: int = 1                    # "sigmoid": experts in n_group groups, the top-k taken
    topk_group: int = 1                 # ... among the topk_group best groups only
    correction_bias: bool = False       # "sigmoid": a buffer added to the scores for the choice
    # a dense gated MLP beside the routed experts on every token (0: none), its module's name
    shared_intermediate_size: int = 0
    shared_name: str = "shared_experts"
    # a Linear [1, h] without bias whose sigmoid scales the shared experts' output per token
    # (Qwen3-Next's ``shared_expert_gate``), its module's name; None: none
    shared_gate: str | None = None
    router_name: str = "gate"           # the router module's name (gpt-oss, Llama 4: "router")
    router_bias: bool = False           # the router's logits have a bias (gpt-oss)
    weight_input: bool = False          # the weights scale the experts' input (Llama 4)
    layout: str = "rows"                # how Hugging Face stores the experts (LAYOUTS)
    expert_bias: bool = False           # gate_up_proj_bias [E, 2F], down_proj_bias [E, h]
    swiglu_limit: float = 7.0           # "swiglu_clamped": gate <= limit, |up| <= limit
    swiglu_alpha: float = 1.702         # ... gate * sigmoid(alpha * gate) * (up + 1)
    router_eps: float = 1e-6            # "normed_softmax": the epsilon of its weightless norm
    # the router is a module of its own (TSPRouter) that the family's layer calls apart, then
    # hands the experts their routing: experts(x, top-k experts, top-k weights) (Gemma 4)
    router_apart: bool = False

    @property
    def local_experts(self) -> int:
        return self.num_experts // self.tsp_size

    def router_shapes(self) -> dict[str, tuple[int, ...]]:
        """The router's tensors, by name in its module, and their shapes: its weight [E, h] and,
        with ``router_bias``, its bias [E]; "normed_softmax" (Gemma 4): ``proj.weight`` [E, h],
        the input's ``scale`` [h] and the ``per_expert_scale`` [E]."""
        E, h = self.num_experts, self.hidden_size
        if self.router == "normed_softmax":
            return {"proj.weight": (E, h), "scale": (h,), "per_expert_scale": (E,)}
        return {"weight": (E, h), **({"bias": (E,)} if self.router_bias else {})}

    def options(self) -> dict:
        """The keyword arguments of :class:`TSPMoE` beyond the shapes: how it routes, how its
        experts compute and are stored, and what runs beside them (``parallelize`` builds the
        layers with them)."""
        shapes = ("hidden_size", "intermediate_size", "num_experts", "top_k", "tsp_size")
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name not in shapes}


# "softmax": softmax of every logit, top-k (Mixtral, Qwen3-MoE); "sigmoid": GLM-4.5's;
# "topk_softmax": top-k logits, softmax over them (gpt-oss); "topk_sigmoid": top-k logits,
# sigmoid of each (Llama 4); "normed_softmax": "softmax" of the logits of the input RMS-normed
# without a weight, times a learned scale [h] and h**-0.5, the top-k weights times a learned
# per-expert scale (Gemma 4)
ROUTERS = ("softmax", "sigmoid", "topk_softmax", "topk_sigmoid", "normed_softmax")
# the experts' tensors as Hugging Face stores them: "rows" gate_up_proj [E, 2F, h] (gate rows,
# then up) and down_proj [E, h, F] (Mixtral, Qwen3-MoE, GLM-4.5); "columns" [E, h, 2F] (gate
# columns, then up) and [E, F, h] (Llama 4); "interleaved" [E, h, 2F] with gate and up in
# alternate columns (gpt-oss)
LAYOUTS = ("rows", "columns", "interleaved")
EXPERT_ACTIVATIONS = (*ACTIVATIONS, "swiglu_clamped")


def check_router(spec: MoESpec) -> None:
    """Raise, naming the numbers, when the router's options cannot route (before any
    collective): an unknown kind, groups that do not divide the experts, too few experts in the
    chosen groups for the top-k; an unknown layout or activation."""
    E, k, g, tg = spec.num_experts, spec.top_k, spec.n_group, spec.topk_group
    if spec.router not in ROUTERS:
        raise ValueError(f"router {spec.router!r} is not one of {ROUTERS}")
    if spec.layout not in LAYOUTS:
        raise ValueError(f"experts layout {spec.layout!r} is not one of {LAYOUTS}")
    if spec.activation not in EXPERT_ACTIVATIONS:
        raise ValueError(f"activation {spec.activation!r} is not one of {EXPERT_ACTIVATIONS}")
    if spec.router == "normed_softmax" and spec.router_bias:
        raise ValueError("the \"normed_softmax\" router (Gemma 4's) has no bias: "
                         "router_bias=False")
    if spec.weight_input and spec.expert_bias:
        raise ValueError("weight_input (the weights scale the experts' input) with expert biases "
                         "is not implemented: no family has both")
    if spec.router != "sigmoid" and (g != 1 or tg != 1 or spec.correction_bias):
        raise ValueError(f"n_group ({g}), topk_group ({tg}) and the correction bias "
                         f"({spec.correction_bias}) belong to the \"sigmoid\" router; the "
                         f"{spec.router!r} router takes n_group=1, topk_group=1, "
                         f"correction_bias=False")
    if g < 1 or E % g:
        raise ValueError(f"n_group ({g}) must divide the number of experts ({E})")
    if g > 1 and E // g < 2:
        raise ValueError(f"n_group ({g}) leaves {E // g} expert per group; a group's score is "
                         f"the sum of its best two: use n_group <= {E // 2}")
    if not 1 <= tg <= g or k > tg * (E // g):
        raise ValueError(f"topk_group ({tg}) must be between 1 and n_group ({g}) and its groups "
                         f"must hold the top {k} ({tg} x {E // g} experts)")


def check_moe_shape(tsp_size: int, num_experts: int, top_k: int,
                    schedule: str = "expert", valid: Sequence[int] | None = None) -> None:
    """Raise, naming the numbers and the sizes that would work, when the routing is impossible
    or (schedule "expert") the experts cannot be owned whole, 1/D each. ``valid``: the whole
    model's valid sizes (``parallelize`` passes them), else those of the experts."""
    if num_experts < 1 or not 1 <= top_k <= num_experts:
        raise ValueError(f"num_experts_per_tok ({top_k}) must be between 1 and the number of "
                         f"experts ({num_experts})")
    if schedule == "expert" and num_experts % tsp_size:
        hint = (valid_sizes_hint(valid) if valid is not None else
                valid_sizes_hint(valid_tsp_sizes(None, None, num_experts),
                                 f"{num_experts} experts"))
        raise ValueError(f"tsp_size ({tsp_size}) must divide the number of experts "
                         f"({num_experts}): each rank owns E/D whole experts (uneven ownership "
                         f"would break the 1/D memory rule); {hint}; or moe_schedule=\"ring\" "
                         f"(every expert's channels split instead)")
