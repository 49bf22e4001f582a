"""Which decoder layers each pipeline stage holds, and which pipeline rank holds each stage.

Cuts count the embedding and the head (final norm, vocabulary-parallel head and loss) as one
decoder layer each, as torchtitan does: ``layers + 2`` units, a stage's cost its decoder layers
plus one for the embedding on the first stage and one for the head on the last. By default
(:func:`balanced_split`) the stages share the units as evenly as whole layers allow: where the
units divide, every stage holds ``units / stages`` of them, so the first and the last stage hold
one decoder layer fewer than a middle one (Llama-3.1-405B's 126 layers make 128 units: 16 stages
of 8); where they do not, the first ``units mod stages`` stages hold one unit more (torchtitan's
order), except that a first or last stage never goes without a decoder layer. ``layer_split``
gives a cut of one's own.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Sequence

logger = logging.getLogger("tsp_core.pipeline")


def split_layers(num_layers: int, num_stages: int,
                 layer_split: Sequence[int] | None = None) -> list[range]:
    """The global indices of the decoder layers of each stage, first to last: ``layer_split``'s,
    or by default :func:`balanced_split`'s. Every stage holds at least one decoder layer. Raises
    ``ValueError`` naming the numbers; nothing is communicated."""
    if num_stages < 1:
        raise ValueError(f"the pipeline needs at least one stage, got {num_stages}")
    if layer_split is not None:
        split = [int(n) for n in layer_split]
        if len(split) != num_stages or sum(split) != num_layers or min(split) < 1:
            raise ValueError(f"layer_split {list(layer_split)} must give {num_stages} stages of at "
                             f"least one decoder layer each, {num_layers} layers in all (it gives "
                             f"{len(split)} stages, {sum(split)} layers)")
    else:
        split = balanced_split(num_layers, num_stages)
    starts = [sum(split[:i]) for i in range(num_stages)]
    return [range(a, a + n) for a, n in zip(starts, split)]


def stage_costs(split: Sequence[int]) -> list[int]:
    """Each stage's units: its decoder layers, plus one for the embedding on the first stage and
    one for the head on the last (a single stage holds both)."""
    return [n + (i == 0) + (i == len(split) - 1) for i, n in enumerate(split)]


def balanced_split(num_layers: int, num_stages: int) -> list[int]:
    """The decoder layers of each stage in the default cut, the one both the pipeline
    (:func:`split_layers` without ``layer_split``) and ``tsp plan --pp`` use.

    Its stage costs (:func:`stage_costs`) are ``ceil(units / stages)`` or one less, the most
    balanced any cut allows: no cut has a cheaper busiest stage, nor fewer stages at that cost.
    The stages that hold one unit less are the last ones (torchtitan gives the extra units to the
    first stages), skipping a first or last stage that would be left without a decoder layer.
    Raises ``ValueError`` when a stage would hold no decoder layer whatever the cut."""
    if num_stages < 1:
        raise ValueError(f"the pipeline needs at least one stage, got {num_stages}")
    if num_layers < num_stages:
        raise ValueError(f"the model has {num_layers} decoder layers, fewer than the "
                         f"{num_stages} pipeline stages asked for (every stage holds at least "
                         f"one); use fewer stages (pp_size x stages_per_rank)")
    units = num_layers + 2  # the embedding and the head count as one layer each
    cap = -(-units // num_stages)  # the busiest stage's units: no cut has a cheaper one
    ends = stage_costs([0] * num_stages)  # each stage's units besides its decoder layers
    costs = [cap] * num_stages
    # num_stages * cap - units stages hold cap - 1: the last that keep a decoder layer so
    lighter = [s for s in reversed(range(num_stages)) if cap - 1 - ends[s] >= 1]
    for s in lighter[:num_stages * cap - units]:
        costs[s] -= 1
    return [c - e for c, e in zip(costs, ends)]


def report_split(num_layers: int, num_stages: int, rank: int) -> None:
    """Say the default cut on global rank 0 (``rank``) when the units do not divide into the
    stages (an even cut goes unsaid): one line, a warning of the ``tsp_core.pipeline`` logger
    when logging is configured, otherwise a ``[tsp]`` line on stderr (as ``tsp_size="auto"``
    says its choice)."""
    units = num_layers + 2
    if rank != 0 or units % num_stages == 0:
        return
    split = balanced_split(num_layers, num_stages)
    line = (f"pipeline: {num_layers} decoder layers + the embedding + the head = {units} units "
            f"do not divide into {num_stages} stages; the most balanced cut is layer_split="
            f"{split} (units per stage {stage_costs(split)}); pass layer_split for another")
    if logger.hasHandlers():
        logger.warning(line)
    else:
        print(f"[tsp] {line}", file=sys.stderr, flush=True)


def stage_ranks(num_stages: int, pp_size: int) -> list[int]:
    """The pipeline rank of each stage: looping (stage s on rank s mod pp_size), the placement of
    torch's 1F1B, Interleaved1F1B and InterleavedZeroBubble schedules."""
    return [s % pp_size for s in range(num_stages)]
