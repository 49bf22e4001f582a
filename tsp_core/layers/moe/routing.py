"""Routing as each Hugging Face family routes (router kinds of :class:`.spec.MoESpec`), and the
load-balancing loss over the global batch."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ...distributed import comm, traced
from ..norm import unscaled_norm
from .spec import MoESpec


def recomputing() -> bool:
    """Whether autograd's engine is running a backward on this thread: a forward called now is an
    activation checkpoint's recompute, whose router logits must not be kept (they would hold
    the recomputed graph, saved rows and expert activations included, past the step)."""
    return traced.in_backward()


def uniform_counts(n: int, num_experts: int) -> list[int]:
    """Routed copies per expert of ``n`` under uniform routing: ``tsp simulate``'s, where
    routing has no values."""
    return [n // num_experts + (e < n % num_experts) for e in range(num_experts)]


def router_logits(x: torch.Tensor, weight: torch.Tensor, spec: MoESpec,
                  bias: torch.Tensor | None = None, scale: torch.Tensor | None = None
                  ) -> torch.Tensor:
    """Router logits [N, E] of tokens x [N, h] (plus ``bias``, gpt-oss): in the input's dtype,
    except for the sigmoid router, float32 at least (GLM-4.5 casts the input and the weight to
    float32; a float64 model stays float64). "normed_softmax" (Gemma 4): of the input's RMSNorm
    without a weight (Gemma 4's numerics) times ``scale`` [h] and h**-0.5, in Hugging Face's
    order."""
    if spec.router == "sigmoid":
        wide = torch.promote_types(x.dtype, torch.float32)
        return F.linear(x.to(wide), weight.to(wide))
    if spec.router == "normed_softmax":
        x = unscaled_norm(x, "gemma4", spec.router_eps) * scale * spec.hidden_size ** -0.5
    return F.linear(x, weight, bias)


def route_tokens(x: torch.Tensor, router: Mapping[str, torch.Tensor], spec: MoESpec,
                 choice_bias: torch.Tensor | None = None, probabilities: bool = False
                 ) -> tuple[torch.Tensor, ...]:
    """(logits, top-k weights, experts) of tokens x [N, h] by the router's tensors ``router``,
    named as :meth:`MoESpec.router_shapes` names them (``choice_bias``: GLM-4.5's correction
    bias). With ``probabilities`` the first is instead the logits' softmax in float32, the very
    tensor the softmax routers choose from (Gemma 4's router returns it: a loss built from it
    and the routing then sum their gradients in it, in float32, as Hugging Face's do)."""
    weight = router["proj.weight" if spec.router == "normed_softmax" else "weight"]
    logits = router_logits(x, weight, spec, router.get("bias"), router.get("scale"))
    scale = router.get("per_expert_scale")
    if not probabilities:
        return (logits, *route(logits, spec, choice_bias, scale))
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    return (probs, *route(logits, spec, choice_bias, scale, probs))


def route(logits: torch.Tensor, spec: MoESpec, bias: torch.Tensor | None = None,
          expert_scale: torch.Tensor | None = None, probs: torch.Tensor | None = None
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """(top-k weights, expert indices) [N, k] of router logits [N, E], Hugging Face's numerics.
    "softmax" (Mixtral, Qwen3-MoE): softmax in float32, top-k, renormalised, and cast back for
    Qwen3-MoE. "sigmoid" (GLM-4.5): scores sigmoid(logits); the choice ranks scores + ``bias``
    (the correction bias: it moves which experts are chosen, never their weights), first the
    ``topk_group`` groups whose best two sum highest, then the top-k inside them; the weights
    are the chosen experts' scores, renormalised (``norm_topk``). "topk_softmax" (gpt-oss): the
    top-k logits, softmax over them in the logits' dtype. "topk_sigmoid" (Llama 4): the top-k
    logits, the sigmoid of each in float32 at least, cast back. "normed_softmax" (Gemma 4):
    "softmax"'s, then each weight times its expert's ``expert_scale`` [E] (its per_expert_scale).
    All: times ``routed_scaling``. ``probs``: the softmax routers' float32 softmax of the logits,
    if the caller has it."""
    if spec.router in ("softmax", "normed_softmax"):
        if probs is None:
            probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        weights, experts = torch.topk(probs, spec.top_k, dim=-1)
        if spec.norm_topk:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        if spec.router == "normed_softmax":
            weights = weights * expert_scale[experts]
    elif spec.router == "sigmoid":
        scores = logits.sigmoid()
        choice = scores if bias is None else scores + bias
        if spec.n_group > 1:
            groups = choice.view(-1, spec.n_group, spec.num_experts // spec.n_group)
            best = torch.topk(groups.topk(2, dim=-1)[0].sum(-1), spec.topk_group, dim=-1)[1]
            kept = torch.zeros_like(groups[..., 0], dtype=torch.bool).scatter_(1, best, True)
            choice = groups.masked_fill(~kept[..., None], float("-inf")).flatten(1)
        experts = torch.topk(choice, spec.top_k, dim=-1)[1]
        weights = scores.gather(1, experts)
        if spec.norm_topk:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    else:
        top, experts = torch.topk(logits, spec.top_k, dim=-1)
        if spec.router == "topk_softmax":
            weights = torch.softmax(top, dim=-1, dtype=top.dtype)
        else:
            weights = top.to(torch.promote_types(top.dtype, torch.float32)).sigmoid().to(top.dtype)
    if spec.routed_scaling != 1.0:
        weights = weights * spec.routed_scaling
    if spec.weights_in_logits_dtype:
        weights = weights.to(logits.dtype)
    return weights, experts


def dense_weights(weights: torch.Tensor, experts: torch.Tensor, num_experts: int) -> torch.Tensor:
    """The top-k ``weights`` [N, k] scattered into [N, E] (zero where not chosen): the experts'
    down-projection biases of every token are then one product with [E, h] (gpt-oss's
    ``down_proj_bias``, each chosen expert's bias times its weight)."""
    return weights.new_zeros(weights.shape[0], num_experts).scatter(1, experts, weights)


def load_balancing_loss(router_logits: Sequence[torch.Tensor], num_experts: int, top_k: int,
                        groups: Sequence[dist.ProcessGroup],
                        attention_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Hugging Face's ``load_balancing_loss_func`` over the global batch: E * sum_e f_e P_e, f_e
    the fraction of routed copies (top-k of the softmax) that went to expert e and P_e the mean
    router probability of e, both over every non-padding token of every layer of every rank.

    ``router_logits``: every MoE layer's logits of the tokens this rank routed (its own tokens
    under TSP); ``attention_mask``: those tokens' mask (padding counts nowhere); ``groups``: the
    mesh dims over which ranks routed different tokens. The counts are summed there without
    gradient, the probability sums with :func:`comm.sum_over`, so each rank's backward reaches
    its own tokens' router logits (ranks that routed the same tokens, tensor parallel, compute
    the same loss). Computed in float32, or float64 for float64 logits (one process in float64
    is the reference; Hugging Face's own sums run in float32)."""
    first = router_logits[0]
    dtype = torch.float64 if first.dtype == torch.float64 else torch.float32
    w = (torch.ones(first.shape[0], dtype=dtype, device=first.device) if attention_mask is None
         else attention_mask.reshape(-1).to(dtype))
    counts = torch.zeros(num_experts, dtype=dtype, device=first.device)
    prob_sums = torch.zeros(num_experts, dtype=dtype, device=first.device)
    for logits in router_logits:
        probs = torch.softmax(logits.to(dtype), dim=-1)
        chosen = torch.topk(probs, top_k, dim=-1).indices
        counts = counts.index_add(0, chosen.reshape(-1), w.repeat_interleave(top_k))
        prob_sums = prob_sums + (probs * w[:, None]).sum(0)
    totals = torch.cat([counts, (w.sum() * len(router_logits)).reshape(1)]).detach()
    for group in groups:
        comm.all_reduce(totals, group)
    counts, rows = totals[:-1], totals[-1]
    prob_sums = comm.sum_over(prob_sums, groups)
    return (counts / rows * (prob_sums / rows)).sum() * num_experts
