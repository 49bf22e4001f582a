"""Shared fixtures."""

from __future__ import annotations

import pytest

from tests.support import dist_pool


class Pools:
    """Worker pools by world size, started on first use (a pool of 4 costs seconds to start)."""

    def __init__(self) -> None:
        self._pools: dict[int, dist_pool.DistPool] = {}

    def of(self, size: int) -> dist_pool.DistPool:
        if size not in self._pools:
            self._pools[size] = dist_pool.DistPool(size)
        return self._pools[size]

    def close(self) -> None:
        for p in self._pools.values():
            p.close()
        self._pools.clear()


@pytest.fixture(scope="module")
def pools():
    """One set of pools per test module, closed when the module is done."""
    p = Pools()
    yield p
    p.close()
