"""``TSPFabricStrategy``: ``Fabric(strategy="tsp")``. ``fabric.setup(model)`` converts the model
(the module itself if it is a Hugging Face causal LM, else its ``model`` attribute), and the
converted model shards full-sequence batches itself, so a Fabric loop calling
``model(**batch).loss`` works unchanged."""

from __future__ import annotations

from datetime import timedelta
from typing import Literal

from lightning.fabric.strategies.model_parallel import ModelParallelStrategy
from torch import nn
from torch.distributed.constants import default_pg_timeout

from tsp_core.mesh import TSPMesh
from tsp_core.parallelize import shard_full_batches

from .common import check_precision, parallelize_target, resolve_sizes


class TSPFabricStrategy(ModelParallelStrategy):
    """Same arguments as :class:`tsp_lightning.TSPStrategy`."""

    def __init__(self, tsp_size: Literal["auto"] | int = "auto",
                 data_parallel_size: Literal["auto"] | int = "auto",
                 save_distributed_checkpoint: bool = True, layout: str = "zigzag",
                 process_group_backend: str | None = None,
                 timeout: timedelta | None = default_pg_timeout) -> None:
        super().__init__(parallelize_fn=self._convert, data_parallel_size=data_parallel_size,
                         tensor_parallel_size=tsp_size,
                         save_distributed_checkpoint=save_distributed_checkpoint,
                         process_group_backend=process_group_backend, timeout=timeout)
        self._layout = layout
        self._tsp_mesh: TSPMesh | None = None

    @property
    def tsp_mesh(self) -> TSPMesh:
        if self._tsp_mesh is None:
            raise RuntimeError("the TSP mesh exists once the processes are set up")
        return self._tsp_mesh

    def setup_environment(self) -> None:
        check_precision(self.precision.precision)
        self._data_parallel_size, self._tensor_parallel_size = resolve_sizes(
            self._tensor_parallel_size, self._data_parallel_size, self.num_nodes,
            self.num_processes)
        super().setup_environment()
        self._tsp_mesh = TSPMesh.from_device_mesh(self.device_mesh, "tensor_parallel",
                                                  self._layout)

    def _convert(self, module: nn.Module, _device_mesh) -> nn.Module:
        shard_full_batches(parallelize_target(module, self.tsp_mesh))
        return module
