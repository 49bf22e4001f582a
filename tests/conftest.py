"""Shared fixtures."""

from __future__ import annotations

import warnings

import pytest

from tests.support import dist_pool
from tests.support import simulations as simulations_support

# The files that take longest on the 2-core machine (seconds of one whole run with
# ``--durations=0``, longest first). ``./run test`` hands whole files to its two workers in
# collection order, so these go first: a long file started last would leave one worker running
# alone at the end (longest-first scheduling). Any other file keeps its place after them.
LONGEST_FIRST = (
    "integrations/test_deepspeed_frameworks.py",    # 426 s
    "integrations/test_adapter_checkpoints.py",     # 320 s
    "models/test_parallelize.py",                   # 240 s
    "plan/test_plan.py",                            # 219 s
    "integrations/test_lightning.py",               # 198 s
    "project/test_recipes.py",                      # 191 s
    "integrations/test_trl.py",                     # 156 s
    "plan/test_memory.py",                          # 136 s
    "integrations/test_transformers.py",            # 128 s
    "project/test_examples.py",                     # 127 s
    "integrations/test_accelerate.py",              # 94 s
    "layers/test_moe.py",                           # 90 s
    "inference/test_decode.py",                     # 84 s
    "tools/test_cli.py",                            # 79 s
    "integrations/test_deepspeed.py",               # 72 s
)


def pytest_collection_modifyitems(config, items) -> None:
    """Put :data:`LONGEST_FIRST`'s files first, in its order (a stable sort)."""
    first = {f"tests/{name}": i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: first.get(item.nodeid.split("::")[0], len(first)))


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
