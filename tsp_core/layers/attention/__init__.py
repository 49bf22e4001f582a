"""TSP attention: the layer's parts (:mod:`.parts`: shape, q/k norm, values, rotary, mask,
KV sharing, and the one check of their combination), the round machinery both schedules share
(:mod:`.rounds`), one module per schedule (:mod:`.per_group`: one head group per round;
:mod:`.phased`: q/k norms over every head of a token), the ``nn.Module`` that owns the shards and
picks the schedule (:mod:`.module`), and what its backward may hold (:mod:`.floor`)."""

from .floor import backward_floor_bytes
from .module import TSPAttention
from .parts import (
    AttentionParts,
    AttentionShape,
    KVSharing,
    Mask,
    QKNorm,
    Rotary,
    ValueNorm,
    Values,
    check_attention_shape,
)
from .rounds import AttentionSpec

__all__ = ["AttentionParts", "AttentionShape", "AttentionSpec", "KVSharing", "Mask", "QKNorm",
           "Rotary", "TSPAttention", "ValueNorm", "Values", "backward_floor_bytes",
           "check_attention_shape"]
