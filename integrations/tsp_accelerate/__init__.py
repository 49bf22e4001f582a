"""Accelerate adapter: ``TSPAccelerator`` is a drop-in ``Accelerator`` (one changed line)."""

from .accelerator import TSPAccelerator

__all__ = ["TSPAccelerator"]
