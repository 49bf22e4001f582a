"""Mixture-of-experts MLP with the experts folded onto the TSP axis (docs/design.md
"Mixture-of-experts MLP", docs/moe.md (a)): rank p owns experts [p*E/D, (p+1)*E/D) whole; the router
is replicated and each rank routes its own tokens. A token's k routed copies travel to their
experts' owners by one all-to-all (dropless: variable splits, exchanged first) and the expert
outputs come back by a second one; the token's owner weights and sums them. The backward runs the
two all-to-alls the other way (autograd over :func:`tsp_core.comm.all_to_all_rows`).

Routing follows the Hugging Face family exactly (``MoESpec``): softmax of the router logits in
float32, top-k, the top-k weights renormalised (Mixtral always, Qwen3-MoE with
``norm_topk_prob``) and, for Qwen3-MoE, cast back to the logits' dtype. Each call keeps its
router logits (``router_logits``, local tokens only) for the load-balancing loss, which
:func:`load_balancing_loss` computes over the global batch as one process does, and for the
model's output with ``output_router_logits`` (:mod:`.logits`: this rank's tokens, in Hugging
Face's shapes; :func:`gather_router_logits` gathers the TSP group's into the original order).

Gemma 4 calls its router and experts apart, beside the layer's dense MLP: :class:`TSPRouter`
(the "normed_softmax" router, replicated) routes, and a :class:`TSPMoE` with ``router_apart``
runs the experts on the routing it is handed, under either schedule below.

Two schedules (docs/moe.md), chosen per layer at construction (``schedule``): "expert" above
(E/D whole experts per rank, routed copies move: about 4 T k h b (D-1)/D bytes per rank per
step for T local tokens) and "ring": every expert's intermediate channels split 1/D (gate, up and
down of channels [pF/D, (p+1)F/D) of every expert), the slices of all experts circulating as in
:class:`tsp_core.layers.mlp.TSPGatedMLP` while every token stays on its rank (3 E F h b (3D-2)/D
bytes per step, whatever T). :func:`choose_schedule` picks the one that moves fewer bytes for a
given T (the traffic model's formula); they cross at about T* = 9 E F / (4 k).

What the backward keeps under "expert": this rank's expert weights, the router logits of its own
tokens and, as autograd saves them, the rows its experts received (about k times its own token
count when routing is balanced) and the combined outputs (the experts' activations are
recomputed, :class:`.dispatch.RoutedExpertsFn`); under "ring": its own
slices, its tokens and their routing (activations recomputed per slice, as the dense MLP). Under
``FakeTensorMode`` (``tsp simulate``), where routing has no values, the splits are those of uniform
routing.

At long context (docs/moe.md "At long context"): both schedules run the experts ``tile_tokens``
rows at a time (:mod:`.tiles`), recomputing a tile's activations in the backward, so no expert's
[rows, F] intermediate exists beyond a tile. Under "ring" nothing else grows with the tokens but
the input and the routing; under "expert" the routed copies do: the received rows and the
combined outputs [k T, h] are kept for backward, and the dispatch and combine hold up to two
more [k T, h] buffers while they run.
"""

from .choice import SCHEDULES, MoEScheduleBytes, choose_schedule, moe_bytes
from .dispatch import dispatch_combine
from .experts import expert_views, glu, glu_backward
from .logits import gather_router_logits, kept_router_logits, router_modules
from .module import TSPMoE
from .router import TSPRouter
from .routing import (
    dense_weights,
    load_balancing_loss,
    recomputing,
    route,
    route_tokens,
    router_logits,
)
from .spec import (
    EXPERT_ACTIVATIONS,
    LAYOUTS,
    ROUTERS,
    MoESpec,
    check_moe_shape,
    check_router,
)

__all__ = ["EXPERT_ACTIVATIONS", "LAYOUTS", "ROUTERS", "SCHEDULES", "MoEScheduleBytes", "MoESpec",
           "TSPMoE", "TSPRouter", "check_moe_shape", "check_router", "choose_schedule",
           "dense_weights", "dispatch_combine", "expert_views", "gather_router_logits", "glu",
           "glu_backward", "kept_router_logits", "load_balancing_loss", "moe_bytes",
           "recomputing", "route", "route_tokens", "router_logits", "router_modules"]
