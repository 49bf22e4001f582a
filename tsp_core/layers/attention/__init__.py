"""TSP attention: the round machinery both schedules share (:mod:`.rounds`), one module per
schedule (:mod:`.per_group`: one head group per round; :mod:`.phased`: q/k norms over every head
of a token), and the ``nn.Module`` that owns the shards and picks the schedule (:mod:`.module`)."""

from .module import TSPAttention, check_attention_shape
from .rounds import AttentionSpec

__all__ = ["AttentionSpec", "TSPAttention", "check_attention_shape"]
