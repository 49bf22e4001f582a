"""``TSPStrategy``: Lightning's ModelParallelStrategy with a TSP group on its tensor-parallel dim.

The strategy builds the mesh, converts the LightningModule's model (the ``model`` attribute, as
set in ``__init__`` or ``configure_model``) unless the user already did, and shards every batch
before the step sees it, so ``return self.model(**batch).loss`` works with or without TSP. The
model's loss is the global mean (identical on every rank), so logged losses are true ones.
Checkpoints are torch.distributed.checkpoint folders (the base class); :meth:`export_hf` writes a
consolidated Hugging Face checkpoint.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any, Literal

from lightning.fabric.strategies.model_parallel import _materialize_distributed_module
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from torch.distributed.constants import default_pg_timeout

import tsp_core

from .common import SUPPORTED_PRECISIONS, TSPMeshMixin, parallelize_target, shard

__all__ = ["SUPPORTED_PRECISIONS", "TSPStrategy"]


class TSPStrategy(TSPMeshMixin, ModelParallelStrategy):
    """``TSPStrategy(tsp_size=None | "auto" | int, data_parallel_size="auto" | int,
    save_distributed_checkpoint=True, layout="zigzag", tsp_seq_len=None, tsp_memory_gb=None,
    tsp_model_config=None)``. No TSP size means every process of a node; "auto" asks the planner
    for the smallest degree inside a node that fits in memory (``tsp_core.plan.auto``: the
    sequence length from ``tsp_seq_len``, ``TSP_SEQ_LEN`` or the model's max_position_embeddings;
    the model's config from the LightningModule's ``model`` set in ``__init__``). Data parallel
    takes the rest."""

    strategy_name = "tsp"

    def __init__(self, tsp_size: Literal["auto"] | int | None = None,
                 data_parallel_size: Literal["auto"] | int = "auto",
                 save_distributed_checkpoint: bool = True, layout: str = "zigzag",
                 process_group_backend: str | None = None,
                 timeout: timedelta | None = default_pg_timeout, tsp_seq_len: int | None = None,
                 tsp_memory_gb: float | None = None, tsp_model_config: Any = None) -> None:
        super().__init__(data_parallel_size=data_parallel_size, tensor_parallel_size=tsp_size,
                         save_distributed_checkpoint=save_distributed_checkpoint,
                         process_group_backend=process_group_backend, timeout=timeout)
        self._layout = layout
        self._set_auto_inputs(tsp_seq_len, tsp_memory_gb, tsp_model_config)

    @property
    def is_distributed(self) -> bool:
        return True

    def setup_environment(self) -> None:
        self._setup_tsp_environment(self.precision_plugin.precision, super().setup_environment)

    def setup(self, trainer) -> None:
        """ModelParallelStrategy.setup, converting the model instead of requiring
        ``configure_model`` to do it."""
        assert self.model is not None and self.accelerator is not None
        self.accelerator.setup(trainer)
        parallelize_target(self.lightning_module, self.tsp_mesh)
        _materialize_distributed_module(self.model, self.root_device)
        self.model = self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        self.barrier()
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        if trainer.state.fn == TrainerFn.FITTING:
            _optimizers_to_device(self.optimizers, self.root_device)

    def batch_to_device(self, batch: Any, device=None, dataloader_idx: int = 0) -> Any:
        return shard(super().batch_to_device(batch, device, dataloader_idx), self.tsp_mesh)

    def export_hf(self, path: str) -> None:
        """Write a consolidated Hugging Face checkpoint (config + safetensors) of the converted
        model to ``path``; every rank must call it, rank 0 writes."""
        tsp_core.save_pretrained(parallelize_target(self.lightning_module, self.tsp_mesh), path)
        self.barrier()
