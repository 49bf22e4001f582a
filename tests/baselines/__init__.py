"""Tests of tsp_core.baselines."""
