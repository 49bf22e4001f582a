"""Tests of tsp_core.models."""
