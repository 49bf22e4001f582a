"""Tests of tsp_core.inference."""
