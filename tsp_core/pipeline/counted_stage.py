"""torch's ``PipelineStage`` with its point-to-point traffic counted.

A module of its own because ``torch.distributed.pipelining`` imports torch's compiler stack
(about a third of a second per process): :mod:`.pipeline` imports this module only when a
pipeline builds its schedule, so ``import tsp_core`` does not pay for it."""

from __future__ import annotations

from torch.distributed.pipelining import PipelineStage

from ..distributed import comm


class CountedStage(PipelineStage):
    """torch's ``PipelineStage`` whose point-to-point sends and receives go through
    :func:`tsp_core.comm.count_point_to_point` (kinds "send" and "recv"), like every collective."""

    def get_fwd_recv_ops(self, fwd_chunk_id: int):
        return comm.count_point_to_point(super().get_fwd_recv_ops(fwd_chunk_id))

    def get_bwd_recv_ops(self, bwd_chunk_id: int):
        return comm.count_point_to_point(super().get_bwd_recv_ops(bwd_chunk_id))

    def get_fwd_send_ops(self, fwd_chunk_id: int):
        return comm.count_point_to_point(super().get_fwd_send_ops(fwd_chunk_id))

    def get_bwd_send_ops(self, bwd_chunk_id: int):
        return comm.count_point_to_point(super().get_bwd_send_ops(bwd_chunk_id))
