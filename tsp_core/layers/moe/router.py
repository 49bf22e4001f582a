""":class:`TSPRouter`, a mixture-of-experts router as a module of its own, for families whose layer
calls the router and the experts apart (Gemma 4: ``router(x)``, then ``experts(x', experts,
weights)`` on another input)."""

from __future__ import annotations

import torch

from ...distributed.mesh import TSPMesh
from ...distributed.params import REPLICATED, ShardedModule, ShardSpec, init_full, local_replicated
from .routing import recomputing, route_tokens
from .spec import MoESpec, check_router


class TSPRouter(ShardedModule):
    """The router of ``spec`` (its kind, :data:`ROUTERS`) with Hugging Face's names and shapes
    (:meth:`MoESpec.router_shapes`; "normed_softmax": ``proj.weight`` [E, h], ``scale`` [h],
    ``per_expert_scale`` [E]), replicated over the TSP group: each rank routes its own tokens
    and the tensors' gradients are summed over the group (one all-reduce each, as every small
    replicated tensor). No other collective: in generation, where every rank holds the same
    tokens, it routes them as in training."""

    def __init__(self, mesh: TSPMesh, spec: MoESpec, *, dtype: torch.dtype | None = None,
                 device: torch.device | str | None = None, init_seed: int | None = 0) -> None:
        super().__init__()
        check_router(spec)
        self.mesh, self.spec = mesh, spec
        self.full_shapes = spec.router_shapes()
        # the last forward's probabilities of this rank's tokens, Hugging Face's router_logits
        self.router_logits: torch.Tensor | None = None
        self._create(init_full(self.full_shapes, init_seed, dtype, device))

    def extra_repr(self) -> str:
        s = self.spec
        return (f"hidden_size={s.hidden_size}, experts={s.num_experts}, top_k={s.top_k}, "
                f"router={s.router}, replicated over tsp_size={s.tsp_size}")

    def shard_spec(self, name: str, rank: int) -> ShardSpec:
        return REPLICATED

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Hugging Face's router outputs for tokens x [N, h]: (the softmax of the router's
        logits [N, E] in float32, the top-k weights [N, k], the experts [N, k]). The
        probabilities are kept as ``router_logits`` (outside an activation checkpoint's
        recompute), what Hugging Face's ``output_router_logits`` records of this router."""
        router = {n: local_replicated(self.get_parameter(n), self.mesh) for n in self.full_shapes}
        probs, weights, experts = route_tokens(x, router, self.spec, probabilities=True)
        if not recomputing():  # Hugging Face's output records these (output_router_logits)
            self.router_logits = probs
        return probs, weights, experts
