"""Tests of tsp_core.tools (the tsp command, benchmarks, gpu-check)."""
