"""``tsp simulate`` turns recompute on with the name transformers asks for: no FutureWarning that
``gradient_checkpointing_enable`` is deprecated (transformers 5.24: "Use
`activation_checkpointing_enable` instead") while a simulation with recompute runs."""

from __future__ import annotations

import pytest

RECOMPUTES = ("full", "selective")


def checkpointing_warnings(recompute: str) -> tuple[list[bool], list[str]]:
    """The checkpointing switches (enable flags) that a tiny TSP simulation with ``recompute``
    set, and the deprecation warnings about checkpointing it raised (run in a simulation worker;
    the spy is taken off before returning)."""
    import os
    import warnings

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch
    from transformers import PreTrainedModel

    from tsp_core.plan.simulate import SimulationRequest, simulate

    torch.set_num_threads(1)
    switched: list[bool] = []
    original = PreTrainedModel._set_gradient_checkpointing

    def spy(self, *args, **kwargs):  # what both the new and the deprecated names reach
        switched.append(kwargs.get("enable", args[0] if args else True))
        return original(self, *args, **kwargs)

    PreTrainedModel._set_gradient_checkpointing = spy
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            simulate(SimulationRequest("tsp", 2, 1, 64, "tiny", recompute=recompute))
    finally:
        PreTrainedModel._set_gradient_checkpointing = original
    return switched, [f"{w.category.__name__}: {w.message}" for w in caught
                      if issubclass(w.category, (FutureWarning, DeprecationWarning))
                      and "checkpointing" in str(w.message)]


@pytest.mark.parametrize("recompute", RECOMPUTES)
def test_simulate_recompute_raises_no_deprecation_warning(simulations, recompute):
    switched, warned = simulations.submit(checkpointing_warnings, recompute).result()
    assert switched == [True]  # checkpointing was turned on, once
    assert not warned, warned
