"""Shared fixtures."""

from __future__ import annotations

import warnings

import pytest

from tests.support import dist_pool
from tests.support import simulations as simulations_support


class Pools:
    """Worker pools by world size for one test module, taken from the session's (a pool of 4
    costs about 10 s to start and import into): the first use in a module gives each pool the
    state a new one would have (:func:`tests.support.dist_pool.fresh_state`)."""

    def __init__(self, shared: dict[int, dist_pool.DistPool]) -> None:
        self._shared = shared
        self._taken: set[int] = set()

    def of(self, size: int, timeout: float | None = None):
        """The pool of ``size`` ranks; with ``timeout``, one whose functions must answer within
        that many seconds (the default is the pool's 300)."""
        if size not in self._shared:
            self._shared[size] = dist_pool.DistPool(size)
        elif size not in self._taken:
            try:
                self._shared[size].run(dist_pool.fresh_state)
            except AssertionError as err:  # the pool is a new one now: this module's tests run
                warnings.warn(f"the pool of {size} that an earlier module left did not answer, "
                              f"so it was replaced: {err}", stacklevel=2)
        self._taken.add(size)
        pool = self._shared[size]
        return pool if timeout is None else dist_pool.Bounded(pool, timeout)


@pytest.fixture(scope="session")
def _shared_pools():
    """The session's pools, by world size, closed when the session ends."""
    shared: dict[int, dist_pool.DistPool] = {}
    yield shared
    dist_pool.close_all(shared.values())


@pytest.fixture(scope="module")
def pools(_shared_pools):
    """The session's pools, handed to one module at a time."""
    return Pools(_shared_pools)


@pytest.fixture(scope="module")
def pool(pools):
    """The pool of 4 ranks, for modules that use one size only."""
    return pools.of(4)


@pytest.fixture(scope="session")
def simulations():
    """The session's two simulation workers (tests/support/simulations.py), started on first
    use: every planner test's records run there instead of in a pool of its own."""
    with simulations_support.start() as workers:
        yield workers
