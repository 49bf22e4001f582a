"""The session's shared worker pools (tests/support/dist_pool.py) keep test modules apart: a
function that leaves state behind in a worker fails its test, naming what it left, and the next
function finds that state put back; a module that takes a used pool over finds what a new pool
gives (a random seed of each rank's own)."""

from __future__ import annotations

import os

import pytest
import torch

from tests.conftest import Pools
from tests.support import dist_pool

PROBE = "TSP_POOL_PROBE"


def leave_state_behind() -> None:
    from tsp_core.models.policies import DecoderPolicy, register_policy

    os.environ[PROBE] = "1"
    torch.set_default_dtype(torch.float64)
    torch.set_grad_enabled(False)
    register_policy(DecoderPolicy(name="pool-probe", model_types=()))


def state_now() -> dict:
    from tsp_core.models.policies import supported

    return dict(env=os.environ.get(PROBE), dtype=torch.get_default_dtype(),
                grad=torch.is_grad_enabled(), probe_policy="pool-probe" in supported())


CLEAN = dict(env=None, dtype=torch.float32, grad=True, probe_policy=False)


def leak_then_look() -> tuple[bool, str, dict]:
    # the worker's own check, run inside a task: what it reports, then what the worker holds
    state_now()  # tsp_core imported first: the check is of the function, not of first imports
    ok, message = dist_pool._call(leave_state_behind, (), {})
    return ok, message, state_now()


def test_state_left_behind_fails_and_is_put_back(pools):
    pool = pools.of(2)
    for ok, message, after in pool.run(leak_then_look):
        assert not ok
        assert message.startswith("leave_state_behind left state behind in the shared pool"), \
            message
        for left in (f"environment variable {PROBE}: None -> '1'",
                     "default dtype: torch.float32 -> torch.float64", "grad mode: True -> False",
                     "registered policies: added ['pool-probe']"):
            assert left in message, (left, message)
        assert after == CLEAN, after
    # through the pool: the test fails, and the next function finds the state clean
    with pytest.raises(AssertionError, match="(?s)leave_state_behind failed on rank.*left state"):
        pool.run(leave_state_behind)
    assert pool.run(state_now) == [CLEAN, CLEAN]


def draw(seed: int | None) -> list[float]:
    if seed is not None:
        torch.manual_seed(seed)
    return torch.rand(4).tolist()


def test_a_module_taking_a_used_pool_over_gets_fresh_seeds(pools, _shared_pools):
    seeded = pools.of(2).run(draw, 0)
    assert seeded[0] == seeded[1]
    again = Pools(_shared_pools).of(2).run(draw, None)  # the next module's first use
    assert again[0] != again[1] and seeded[0] not in again, (seeded, again)
