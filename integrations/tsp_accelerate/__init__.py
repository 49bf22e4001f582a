"""Accelerate adapter: ``TSPAccelerator`` is a drop-in ``Accelerator`` (one changed line);
``JSONLinesTracker`` logs ``accelerator.log`` values (``tsp_metrics()`` among them) to a file."""

from .accelerator import TSPAccelerator
from .tracking import JSONLinesTracker

__all__ = ["JSONLinesTracker", "TSPAccelerator"]
