"""Shared test helpers, in one place: the process launchers (launch, dist_pool, exit_cleanly), the
reference models (hf_models) and comparisons (reference, metrics_check)."""
