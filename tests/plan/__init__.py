"""Tests of tsp_core.plan."""
