"""Tests of tsp_core.distributed."""
