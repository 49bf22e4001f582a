"""One GRPO step in ``tsp simulate`` (``SimulationRequest.step = "grpo"``, ``--step grpo``).

What a GRPO training step keeps on a rank beyond a plain training step, built from the same
model code for every layout so that the comparison stays like for like:

- the reference model: a second model of the same shape, laid out like the policy (a TSP model
  on the same mesh, as ``tsp_trl.TSPGRPOTrainer`` converts TRL's reference; the baselines' own
  layout for them), its parameters only: no gradients, no optimizer states;
- its forward under ``torch.no_grad()``, which leaves the per-token log-probabilities of the
  rows (one float32 per token, this rank's tokens) and nothing for backward;
- the policy's forward and backward through GRPO's per-token loss (TRL's ``grpo`` loss with its
  KL term to the reference, ``beta`` > 0): the per-token log-probabilities come from the same
  head each layout's training step uses (TSP's vocabulary-parallel head, tiled, as
  ``tsp_trl`` asks it with ``fused_lm_head=True``; the baselines' Hugging Face head with its
  full logits, as their training step computes them).

Every token of a row is scored: which of them are the completion (TRL's ``logits_to_keep``)
changes the mask's values, not what is allocated, since every layout's head computes all of a
row's positions here.

The rollout (generation of the completions) is not simulated: :func:`rollout_bytes` computes
its peak from the step's measured resident state (both models' parameters, the policy's AdamW
states; gradients are freed by ``zero_grad`` before the next generation) plus the KV cache of
every row at full length, split as each layout's decode splits it.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from torch import nn

    from ..baselines.layouts import LayoutSpec, ParallelModel
    from ..distributed.mesh import TSPMesh

STEPS = ("train", "grpo")
BETA = 0.04  # TRL's GRPOConfig default before 0.19; any beta > 0 keeps the reference


def check_step(step: str, dp_shard: int) -> None:
    """Refuse a step this module cannot simulate, naming the numbers."""
    if step not in STEPS:
        raise ValueError(f"step {step!r} is not one of {STEPS}")
    if step == "grpo" and dp_shard > 1:
        raise ValueError(f"step 'grpo' is simulated without FSDP2: dp_shard ({dp_shard}) must be "
                         f"1 (the reference model would need its own fully_shard wrapping)")


def build_reference(model: nn.Module, spec: LayoutSpec, mesh: TSPMesh,
                    tile_tokens: int | None) -> ParallelModel:
    """``model`` (a fresh model of the policy's shape) laid out like the policy on its mesh, in
    eval mode. GRPO's reference only runs forwards under ``no_grad``, so it never gets a
    gradient and no optimizer sees it; its parameters keep ``requires_grad`` (MemTracker hooks
    every tracked parameter's gradient), as a reference TRL loads keeps it."""
    from ..baselines import build

    model.eval()
    return build(model, spec, mesh, tile_tokens=tile_tokens)


def parameter_bytes(params: nn.Module | Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind ``params`` (a module's parameters) on this rank (a
    DTensor's local shard), as MemTracker counts them: views of one storage count once."""
    from torch import nn
    from torch.distributed.tensor import DTensor

    seen: dict[int, int] = {}
    for p in params.parameters() if isinstance(params, nn.Module) else params:
        t = p.to_local() if isinstance(p, DTensor) else p
        storage = t.untyped_storage()
        seen[storage._cdata] = storage.nbytes()  # the StorageImpl: one per storage
    return sum(seen.values())


def token_log_probs(pm: ParallelModel, local: dict[str, torch.Tensor]) -> torch.Tensor:
    """Each local token's log-probability of its label, shaped like ``shift_labels`` (float32),
    from the head the layout's training step uses."""
    from torch.distributed.tensor import DTensor

    from ..sequence.layout import IGNORE_INDEX

    if pm.spec.name == "tsp":
        return pm.model(**local, fused_lm_head=True).log_probs
    labels = local["shift_labels"]
    out = pm.model(input_ids=local["input_ids"], position_ids=local["position_ids"],
                   use_cache=False)
    logits = out.logits.to(torch.promote_types(out.logits.dtype, torch.float32))
    lp = -F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX,
                          reduction="none")
    if isinstance(lp, DTensor):  # loss_parallel: every tensor-parallel rank holds all tokens
        lp = lp.full_tensor()
    return lp.view(labels.shape)


def grpo_loss(pm: ParallelModel, logps: torch.Tensor, ref_logps: torch.Tensor,
              labels: torch.Tensor) -> torch.Tensor:
    """TRL's ``grpo`` loss on the rows: ``-exp(logp - logp.detach()) * advantage`` plus
    ``beta`` times the k3 estimate of the KL to the reference, averaged over the scored tokens
    of the whole group (the advantages' values change no allocation: ones)."""
    from ..distributed import comm
    from ..sequence.layout import IGNORE_INDEX

    mask = (labels != IGNORE_INDEX).to(logps.dtype)
    advantages = torch.ones(labels.shape[0], 1, dtype=logps.dtype)
    diff = ref_logps - logps
    kl = torch.exp(diff) - diff - 1
    per_token = -torch.exp(logps - logps.detach()) * advantages + BETA * kl
    count = mask.sum()
    comm.all_reduce(count, pm.mesh.group)
    return comm.sum_over((per_token * mask).sum(), [pm.mesh.group]) / count.clamp(min=1)


def step_local(pm: ParallelModel, ref: ParallelModel, local: dict[str, torch.Tensor]) -> None:
    """One GRPO step on this rank's tokens: the reference's no-grad log-probabilities, then the
    policy's forward and backward through :func:`grpo_loss`."""
    with pm._context():  # loss_parallel for the tensor-parallel baselines
        with torch.no_grad():
            ref_logps = token_log_probs(ref, local)
        logps = token_log_probs(pm, local)
        grpo_loss(pm, logps, ref_logps, local["shift_labels"]).backward()


def kv_cache_bytes(config, spec: LayoutSpec, batch: int, seq: int, itemsize: int) -> int:
    """One rank's KV cache of ``batch`` rows at ``seq`` tokens (computed): TSP's decode keeps
    each rank's 1/D of the tokens with every key/value head (docs/design.md "Decode"); tensor
    parallel keeps every token with this rank's heads (a head shared when the ranks outnumber
    them); context parallel splits the tokens."""
    from ..models.reading import config_shape

    _, kv_heads, head_dim = config_shape(config)
    full = 2 * config.num_hidden_layers * kv_heads * head_dim * batch * seq * itemsize
    if spec.name == "tsp":
        return math.ceil(full / spec.tp)
    heads_here = math.ceil(kv_heads / spec.tp)
    return math.ceil(full * heads_here / kv_heads / spec.cp)


def rollout_bytes(breakdown: dict[str, int], kv_bytes: int) -> int:
    """The rollout's peak on a rank (computed): the resident state the step measured (both
    models' parameters and buffers, the policy's optimizer states) plus the full KV cache."""
    resident = sum(breakdown.get(k, 0) for k in ("parameters", "buffers", "optimizer_states"))
    return resident + kv_bytes
