"""Which decoder layers each pipeline stage holds, and which pipeline rank holds each stage.

Cuts count the embedding and the head (final norm, vocabulary-parallel head and loss) as one
decoder layer each, as torchtitan does: ``layers + 2`` units shared evenly by the stages, so the
first stage holds one layer fewer than a middle one and so does the last (Llama-3.1-405B's 126
layers make 128 units: 16 stages of 8). A count that does not divide is refused, naming an explicit
``layer_split`` that would do.
"""

from __future__ import annotations

from collections.abc import Sequence


def split_layers(num_layers: int, num_stages: int,
                 layer_split: Sequence[int] | None = None) -> list[range]:
    """The global indices of the decoder layers of each stage, first to last. Every stage holds at
    least one decoder layer. Raises ``ValueError`` naming the numbers; nothing is communicated."""
    if num_stages < 1:
        raise ValueError(f"the pipeline needs at least one stage, got {num_stages}")
    if layer_split is not None:
        split = [int(n) for n in layer_split]
        if len(split) != num_stages or sum(split) != num_layers or min(split) < 1:
            raise ValueError(f"layer_split {list(layer_split)} must give {num_stages} stages of at "
                             f"least one decoder layer each, {num_layers} layers in all (it gives "
                             f"{len(split)} stages, {sum(split)} layers)")
    else:
        if num_layers < num_stages:
            raise ValueError(f"the model has {num_layers} decoder layers, fewer than the "
                             f"{num_stages} pipeline stages asked for (every stage holds at least "
                             f"one); use fewer stages (pp_size x stages_per_rank)")
        units = num_layers + 2  # the embedding and the head count as one layer each
        if units % num_stages:
            raise ValueError(
                f"{num_layers} decoder layers + the embedding + the head = {units} units do not "
                f"divide into {num_stages} equal stages; pass layer_split, e.g. "
                f"{suggest_split(num_layers, num_stages)}, or pick a stage count that divides "
                f"{units}")
        per = units // num_stages
        split = [per] * num_stages
        split[0] -= 1
        split[-1] -= 1
        if min(split) < 1:
            raise ValueError(f"{num_layers} decoder layers over {num_stages} stages leave the "
                             f"first or last stage without a decoder layer; pass layer_split, "
                             f"e.g. {suggest_split(num_layers, num_stages)}")
    starts = [sum(split[:i]) for i in range(num_stages)]
    return [range(a, a + n) for a, n in zip(starts, split)]


def suggest_split(num_layers: int, num_stages: int) -> list[int]:
    """A split of ``num_layers`` over ``num_stages`` that is as even as the units allow (one
    layer fewer on the first and last stage where it can)."""
    if num_layers < num_stages:
        return []
    units = num_layers + 2
    split = [units // num_stages + (i < units % num_stages) for i in range(num_stages)]
    split[0] -= 1
    split[-1] -= 1
    while min(split) < 1:  # give the ends a layer back from the largest middle stage
        i = split.index(min(split))
        split[split.index(max(split))] -= 1
        split[i] += 1
    return split


def stage_ranks(num_stages: int, pp_size: int) -> list[int]:
    """The pipeline rank of each stage: looping (stage s on rank s mod pp_size), the placement of
    torch's 1F1B, Interleaved1F1B and InterleavedZeroBubble schedules."""
    return [s % pp_size for s in range(num_stages)]
