"""``TSPFabricStrategy``: ``Fabric(strategy="tsp")``. ``fabric.setup(model)`` converts the model
(the module itself if it is a Hugging Face causal LM, else its ``model`` attribute), and the
converted model shards full-sequence batches itself, so a Fabric loop calling
``model(**batch).loss`` works unchanged."""

from __future__ import annotations

from datetime import timedelta
from typing import Any, Literal

from lightning.fabric.strategies.model_parallel import ModelParallelStrategy
from torch import nn
from torch.distributed.constants import default_pg_timeout

from tsp_core.parallelize import shard_full_batches

from .common import TSPMeshMixin, parallelize_target


class TSPFabricStrategy(TSPMeshMixin, ModelParallelStrategy):
    """Same arguments as :class:`tsp_lightning.TSPStrategy`. Fabric builds the mesh at
    ``fabric.launch()``, before it sees the model: ``tsp_size="auto"`` needs ``tsp_model_config``
    (a config, a dict or a path) or ``TSP_MODEL_CONFIG``."""

    def __init__(self, tsp_size: Literal["auto"] | int | None = None,
                 data_parallel_size: Literal["auto"] | int = "auto",
                 save_distributed_checkpoint: bool = True, layout: str = "zigzag",
                 process_group_backend: str | None = None,
                 timeout: timedelta | None = default_pg_timeout, tsp_seq_len: int | None = None,
                 tsp_memory_gb: float | None = None, tsp_model_config: Any = None) -> None:
        super().__init__(parallelize_fn=self._convert, data_parallel_size=data_parallel_size,
                         tensor_parallel_size=tsp_size,
                         save_distributed_checkpoint=save_distributed_checkpoint,
                         process_group_backend=process_group_backend, timeout=timeout)
        self._layout = layout
        self._set_auto_inputs(tsp_seq_len, tsp_memory_gb, tsp_model_config)

    def setup_environment(self) -> None:
        self._setup_tsp_environment(self.precision.precision, super().setup_environment)

    def _convert(self, module: nn.Module, _device_mesh) -> nn.Module:
        shard_full_batches(parallelize_target(module, self.tsp_mesh))
        return module
