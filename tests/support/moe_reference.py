"""A float64-faithful copy of Hugging Face's GLM-4.5 / DeepSeek-V3 router (``Glm4MoeTopkRouter``,
``DeepseekV3TopkRouter``: the same code), for the references of tests/layers/test_moe.py and
tests/models/test_deepseek_v3.py.

Hugging Face's router computes in float32 even in a float64 model (``hidden_states.type(
torch.float32)``, ``self.weight.type(torch.float32)``): its weight gradient would be a float32
sum, ~1e-7 off any other order. The copy is Hugging Face's forward with those two casts widened
to the model's dtype when that is wider, and nothing else: for float32 and below it is Hugging
Face's arithmetic, which tests/models/test_references.py checks bit for bit against the
unmodified router (the group mask and the top-k-group choice included). Nothing here imports
tsp_core."""

from __future__ import annotations

import types

import torch
import torch.nn.functional as F

ROUTERS = ("Glm4MoeTopkRouter", "DeepseekV3TopkRouter")


def router_forward(self, hidden_states: torch.Tensor):
    """``Glm4MoeTopkRouter.forward`` with its float32 casts at least float32: (router logits,
    top-k weights, top-k experts)."""
    hidden_states = hidden_states.view(-1, self.hidden_dim)
    wide = torch.promote_types(self.weight.dtype, torch.float32)
    router_logits = F.linear(hidden_states.type(wide), self.weight.type(wide))
    scores = router_logits.sigmoid()
    scores_for_choice = scores + self.e_score_correction_bias
    group_scores = (scores_for_choice.view(-1, self.num_group, self.num_experts // self.num_group)
                    .topk(2, dim=-1)[0].sum(dim=-1))
    group_idx = torch.topk(group_scores, k=self.topk_group, dim=-1, sorted=False)[1]
    group_mask = torch.zeros_like(group_scores)
    group_mask.scatter_(1, group_idx, 1)
    score_mask = (group_mask.unsqueeze(-1)
                  .expand(-1, self.num_group, self.num_experts // self.num_group)
                  .reshape(-1, self.num_experts))
    scores_for_choice = scores_for_choice.masked_fill(~score_mask.bool(), float("-inf"))
    topk_indices = torch.topk(scores_for_choice, k=self.top_k, dim=-1, sorted=False)[1]
    topk_weights = scores.gather(1, topk_indices)
    if self.norm_topk_prob:
        denominator = topk_weights.sum(dim=-1, keepdim=True) + 1e-20
        topk_weights /= denominator
    topk_weights = topk_weights * self.routed_scaling_factor
    return router_logits, topk_weights, topk_indices


def float64_glm_router(model: torch.nn.Module) -> int:
    """Give every GLM-4.5 or DeepSeek-V3 router of ``model`` (itself included) the faithful
    forward (per module: other models keep Hugging Face's). Returns how many were patched."""
    patched = 0
    for module in model.modules():
        if type(module).__name__ in ROUTERS:
            module.forward = types.MethodType(router_forward, module)
            patched += 1
    return patched
