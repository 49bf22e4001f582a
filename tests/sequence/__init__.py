"""Tests of tsp_core.sequence."""
