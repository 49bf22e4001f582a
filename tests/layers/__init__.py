"""Tests of tsp_core.layers."""
