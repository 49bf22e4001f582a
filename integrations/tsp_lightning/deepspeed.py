"""``TSPDeepSpeedStrategy``: ``Trainer(strategy="tsp_deepspeed")``, Lightning's DeepSpeedStrategy
with a TSP group: ZeRO partitions over the data-parallel axis only.

Lightning builds the engine itself and passes DeepSpeed no mpu, so the strategy converts the
LightningModule's model first (as ``TSPStrategy`` does) and sends Lightning's
``deepspeed.initialize`` calls through ``tsp_deepspeed.initialize`` (``tsp_deepspeed.routed``):
the mpu, plain shards marked ``tensor_model_parallel``, the optimizer pointed at them. Batches are
sharded before the step sees them; the sampler splits data over data-parallel ranks only.

CPU (``DS_ACCELERATOR=cpu``, gloo): Lightning 2.6 refuses any accelerator but CUDA in
``DeepSpeedStrategy.setup_environment`` and expects device indices 0..n-1 in
``setup_distributed`` (CPU devices have none). Both checks are skipped only when Lightning's
accelerator is the CPU and DeepSpeed's accelerator is ``cpu``; on GPUs the base class runs as is.
"""

from __future__ import annotations

from typing import Any, Literal

from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch.accelerators import CPUAccelerator
from lightning.pytorch.strategies import DDPStrategy, DeepSpeedStrategy
from torch.distributed.device_mesh import init_device_mesh

import tsp_core
import tsp_deepspeed

from .common import TSPMeshMixin, parallelize_target, shard
from .monitor import add_monitor

DEEPSPEED_PRECISIONS = ("32-true",)


class TSPDeepSpeedStrategy(TSPMeshMixin, DeepSpeedStrategy):
    """``TSPDeepSpeedStrategy(tsp_size=None | "auto" | int, layout="zigzag", tsp_seq_len=None,
    tsp_memory_gb=None, tsp_model_config=None, metrics=True, tile_tokens=None,
    activation_offload=False, **DeepSpeedStrategy arguments)``
    (``stage=2`` by default, or ``config=`` a DeepSpeed config). No TSP size means every process
    of a node; "auto" and ``metrics`` as in :class:`tsp_lightning.TSPStrategy` (DeepSpeed's own
    ZeRO collectives are not TSP's and not counted), ``tile_tokens`` and ``activation_offload``
    as there too; data parallel (and ZeRO) takes the rest."""

    strategy_name = "tsp_deepspeed"

    def __init__(self, tsp_size: Literal["auto"] | int | None = None, layout: str = "zigzag",
                 tsp_seq_len: int | None = None, tsp_memory_gb: float | None = None,
                 tsp_model_config: Any = None, metrics: bool = True,
                 tile_tokens: int | None = None, activation_offload: bool = False,
                 **kwargs: Any) -> None:
        self._set_long_context(tile_tokens, activation_offload)  # before anything starts
        super().__init__(**kwargs)
        self._tensor_parallel_size, self._data_parallel_size = tsp_size, "auto"
        self._layout, self._metrics = layout, metrics
        self._set_auto_inputs(tsp_seq_len, tsp_memory_gb, tsp_model_config)
        self.device_mesh = None

    def _deepspeed_on_cpu(self) -> bool:
        from deepspeed.accelerator import get_accelerator

        return isinstance(self.accelerator, CPUAccelerator) and \
            get_accelerator().device_name() == "cpu"

    def setup_environment(self) -> None:
        precision = self.precision_plugin.precision
        if precision not in DEEPSPEED_PRECISIONS:  # before any process group work, on every rank
            raise ValueError(f"precision={precision!r} is not supported by the TSP DeepSpeed "
                             f"strategy; use one of {list(DEEPSPEED_PRECISIONS)}")
        self._setup_tsp_environment(precision, self._setup_environment_and_mesh)

    def _setup_environment_and_mesh(self) -> None:
        if self._deepspeed_on_cpu():
            DDPStrategy.setup_environment(self)  # the base refuses any accelerator but CUDA
        else:
            super().setup_environment()
        self.device_mesh = init_device_mesh(
            self.root_device.type, (self._data_parallel_size, self._tensor_parallel_size),
            mesh_dim_names=("data_parallel", "tensor_parallel"))

    def setup_distributed(self) -> None:
        if not self._deepspeed_on_cpu():
            return super().setup_distributed()
        # the base also checks that device indices are 0..n-1; CPU devices carry no index
        reset_seed()
        self.set_world_ranks()
        self._init_deepspeed_distributed()

    def setup(self, trainer) -> None:
        if self._metrics:
            add_monitor(trainer)
        parallelize_target(self.lightning_module, self.tsp_mesh, **self._long_context)
        super().setup(trainer)

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath,
                        storage_options: Any = None) -> None:
        with tsp_core.metrics.paused():  # not a training step's work
            super().save_checkpoint(checkpoint, filepath, storage_options)

    def init_deepspeed(self) -> None:
        with tsp_deepspeed.routed():
            super().init_deepspeed()

    @property
    def distributed_sampler_kwargs(self) -> dict[str, int]:
        dp = self.world_size // self.tsp_mesh.size
        return {"num_replicas": dp, "rank": self.global_rank // self.tsp_mesh.size}

    def batch_to_device(self, batch: Any, device=None, dataloader_idx: int = 0) -> Any:
        return shard(super().batch_to_device(batch, device, dataloader_idx), self.tsp_mesh)
