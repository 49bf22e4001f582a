"""``tsp plan --pp P``: the ranking for one pipeline stage, then the pipeline's cost.

A stage is ranked like a whole model on ``gpus / P`` GPUs with the busiest stage's decoder layers
in the pipeline's own default cut (:func:`tsp_core.pipeline.balanced_split`, the one
``tsp_core.pipeline`` takes without ``layer_split``: the embedding and the head count as one
layer each; the embedding, head and loss stay in the stage's estimate, an upper bound for every
stage). The pipeline then adds, per layout, what a stage alone does not see:

- memory: under 1F1B the first stage holds the checkpointed layer inputs of ``min(M, P)``
  micro-batches (the stage estimate counts one), each ``tokens per rank x h x 2`` bytes a layer;
- time: ``M`` micro-batches over ``P`` stages take ``M + P - 1`` stage steps, so the bubble is
  ``(P - 1) / (M + P - 1)`` of the step; a step trains ``M`` micro-batches per replica.
"""

from __future__ import annotations

import dataclasses

from ..baselines.layouts import LayoutSpec
from ..pipeline.split import balanced_split
from .cost import Candidate
from .hardware import Cluster
from .memory import tokens
from .traffic import ModelShape


def stage_view(shape: ModelShape, cluster: Cluster, pp: int) -> tuple[ModelShape, Cluster, int]:
    """(the busiest stage's shape, the cluster of one stage, its decoder layers); raises naming
    the numbers when the GPUs do not divide into ``pp`` stages or the layers are fewer."""
    if pp < 1:
        raise ValueError(f"--pp ({pp}) must be at least 1")
    if cluster.nodes % pp:
        raise ValueError(f"--pp ({pp}) must divide the nodes ({cluster.nodes}): each stage takes "
                         f"whole nodes; pass --gpus a multiple of {pp} x --gpus-per-node")
    if shape.num_layers < pp:
        raise ValueError(f"the model has {shape.num_layers} decoder layers, fewer than --pp "
                         f"({pp}) stages")
    layers = max(balanced_split(shape.num_layers, pp))
    stage = dataclasses.replace(shape, num_layers=layers)
    return stage, dataclasses.replace(cluster, nodes=cluster.nodes // pp), layers


def with_pipeline(c: Candidate, stage: ModelShape, seq: int, batch: int, pp: int,
                  microbatches: int, usable_bytes: float, global_batch_tokens: int) -> Candidate:
    """``c`` (one stage, one micro-batch) as a ``pp``-stage pipeline of ``microbatches``."""
    lay = LayoutSpec(c.layout, c.tp, c.cp)
    n_r, _ = tokens(lay, seq, batch)
    in_flight = min(microbatches, pp)
    extra = (in_flight - 1) * stage.num_layers * n_r * stage.hidden_size * 2
    memory = c.memory_gib + extra / 2 ** 30
    step = (microbatches + pp - 1) * c.step_s
    sequences = max(1, global_batch_tokens // (batch * seq * microbatches))
    active = min(c.replicas, sequences)
    return dataclasses.replace(
        c, memory_gib=memory, fits=memory * 2 ** 30 <= usable_bytes, active_replicas=active,
        step_s=step, compute_s=(microbatches + pp - 1) * c.compute_s,
        exposed_comm_s=(microbatches + pp - 1) * c.exposed_comm_s,
        tokens_per_s=active * microbatches * batch * seq / step)


def bubble(pp: int, microbatches: int) -> float:
    """The idle fraction of a 1F1B step."""
    return (pp - 1) / (microbatches + pp - 1)
