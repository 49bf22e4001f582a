"""``TSPMonitor``: TSP's per-step figures (``tsp_core.metrics``) in the Trainer's loggers.

The TSP strategies add one when the Trainer has a logger and none was given (``metrics=False``
on the strategy turns that off). It logs at Lightning's own cadence (``log_every_n_steps``, the
rows ``self.log`` writes to), each value averaged over the optimizer steps since its previous
row; validation and checkpointing in between are left out (``tsp_core.metrics.paused``).
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch.callbacks import Callback

from tsp_core.distributed.metrics import StepMetrics


class TSPMonitor(Callback):
    """Log ``tsp/...`` figures to every logger of the Trainer. ``group_max=True`` adds
    ``tsp/max/...`` (the largest over all ranks: one small all-reduce per logged row).
    :attr:`last` holds the latest figures on every rank (loggers write rank 0's)."""

    def __init__(self, group_max: bool = False) -> None:
        self.group_max = group_max
        self.last: dict[str, float] = {}
        self._meter: StepMetrics | None = None

    def on_train_start(self, trainer, pl_module) -> None:
        # before the first batch is fetched and sharded (Lightning moves a batch to the device
        # before on_train_batch_start)
        self._meter = StepMetrics(getattr(trainer.strategy, "tsp_mesh", None),
                                  trainer.strategy.root_device.type)
        self._meter.start(trainer.global_step)

    def on_train_batch_end(self, trainer, pl_module, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        # Lightning's rule for self.log rows (checked before its step counter moves on)
        if self._meter is None or not trainer._logger_connector.should_update_logs:
            return
        figures = self._meter.read(trainer.global_step, self.group_max)
        if not figures:
            return
        self.last = figures
        step = trainer.fit_loop.epoch_loop._batches_that_stepped  # the step self.log rows use
        for logger in trainer.loggers:
            logger.log_metrics(figures, step=step)

    def on_train_end(self, trainer, pl_module) -> None:
        self._meter = None  # a later fit opens a new window

    def on_validation_start(self, trainer, pl_module) -> None:
        if self._meter is not None and self._meter.started:
            self._meter.pause()

    def on_validation_end(self, trainer, pl_module) -> None:
        if self._meter is not None and self._meter.started:
            self._meter.resume()


def add_monitor(trainer) -> None:
    """Give a Trainer with a logger a :class:`TSPMonitor`, unless it has one."""
    if trainer.loggers and not any(isinstance(c, TSPMonitor) for c in trainer.callbacks):
        trainer.callbacks.append(TSPMonitor())
