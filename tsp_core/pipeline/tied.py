"""Tied embeddings across pipeline stages, as Megatron keeps them: the first stage holds the
embedding, the last stage a copy of the same weight as its LM head, and after each step's backward
the two copies' gradients are summed between the ranks that hold them, so both take the gradient
one process computes for the one tied weight and the optimizer keeps them equal.

The copies shard alike: the last stage's head is made by :func:`tsp_core.parallelize` tied to its
stage's embedding (so it is the embedding's parameter, rows split over the vocabulary as
``TSPEmbedding``'s), and the embedding is then dropped from that stage. Stage ``s`` sits on
pipeline rank ``s mod P`` (:func:`.split.stage_ranks`) with ``P >= 2`` stages' ranks, so stage 0
is always on pipeline rank 0 and the last stage on rank ``P - 1``: two ranks of the same TSP (and
data-parallel) position, which exchange their local shard of the gradient.

Checkpoints keep the weight under both names, as the model's ``state_dict()`` has them, and its
optimizer state once, under the embedding's name (the last stage's copy is renamed there through
the model state's ``optimizer_names``), as one process's optimizer names the one tied weight: a
pipeline's checkpoint loads at pp 1 and into a plain model, and theirs into a pipeline.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from ..distributed import comm
from ..distributed.mesh import TSPMesh
from ..distributed.params import local


def ties_embedding(model: nn.Module, policy) -> bool:
    """Whether ``model``'s LM head is its input embedding's very weight."""
    base = getattr(model, policy.modules.base_model)
    head = getattr(model, policy.modules.lm_head)
    return head.weight is getattr(base, policy.modules.embed).weight


def pair_group(mesh: TSPMesh) -> dist.ProcessGroup | None:
    """The group of this rank and its counterpart on the other end of the pipeline (pipeline ranks
    0 and P - 1 at this rank's stage-mesh position), None on the ranks between. Every rank must
    call it: with P > 2 it creates one group per position, in the same order everywhere."""
    if mesh.pp_size == 2:
        return mesh.pp_group
    ranks = mesh.device_mesh.mesh.movedim(mesh.device_mesh.mesh_dim_names.index(mesh.pp_dim), 0)
    mine = None
    for a, b in zip(ranks[0].flatten().tolist(), ranks[-1].flatten().tolist()):
        group = dist.new_group([a, b])
        if dist.get_rank() in (a, b):
            mine = group
    return mine


class TiedCopies:
    """The tied weight's copy on this rank (the first stage's embedding or the last stage's head;
    none on the ranks between), the group that sums the two copies' gradients and the name the
    last stage's copy's optimizer state is checkpointed under."""

    def __init__(self, copy: nn.Parameter | None, duplicate: bool,
                 group: dist.ProcessGroup | None, aliases: dict[str, str]) -> None:
        self.copy, self.group = copy, group
        # the last stage's copy's name -> the embedding's: checkpoints keep its optimizer state
        # there, once (the model's tensors keep their own names, as a plain state dict has both)
        self.aliases = aliases
        # the last stage's copy: left out of the gradient norm (one process counts the weight once)
        self.duplicate = copy if duplicate else None

    def sync_grads(self) -> None:
        """Sum the two copies' gradients (this rank's vocabulary rows, and data-parallel slice
        under FSDP2) over the pair: one all-reduce through ``tsp_core.comm``. A copy that got no
        gradient takes part with zeros."""
        if self.copy is None:
            return
        p = self.copy
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        with torch.no_grad():
            comm.all_reduce(local(p.grad), self.group)
