"""Tests of tsp_core.state."""
