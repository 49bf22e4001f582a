"""TSP attention: the round machinery both schedules share (:mod:`.rounds`), one module per
schedule (:mod:`.per_group`: one head group per round; :mod:`.phased`: q/k norms over every head
of a token), the ``nn.Module`` that owns the shards and picks the schedule (:mod:`.module`), and
what its backward may hold (:mod:`.floor`)."""

from .floor import backward_floor_bytes
from .module import TSPAttention, check_attention_shape
from .rounds import AttentionSpec

__all__ = ["AttentionSpec", "TSPAttention", "backward_floor_bytes", "check_attention_shape"]
