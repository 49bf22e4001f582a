"""Checking ``tsp/...`` figures a logger received against ``tsp_core.comm``'s own counters.

A job brackets each optimizer step with :class:`StepCounters` (``begin()`` before its first
micro-batch, ``end()`` after the optimizer step) and writes ``steps``; the test reads back what
the logger wrote and calls :func:`assert_windows`: every logged row must be the mean of the steps
it covers, MiB and collectives exactly (nothing outside the steps, such as validation or
checkpoint saving, may be in it), tokens from the batches' shapes."""

from __future__ import annotations

from collections import Counter

MIB = 2.0 ** 20


def snapshot() -> dict:
    from tsp_core import comm, metrics

    stats = comm.global_stats()
    return {"calls": dict(stats.calls), "bytes": dict(stats.bytes),
            "tokens": metrics._TOKENS["group"], "local_tokens": metrics._TOKENS["local"]}


def _minus(a: dict, b: dict) -> dict:
    return {k: a.get(k, 0) - b.get(k, 0) for k in set(a) | set(b) if a.get(k, 0) != b.get(k, 0)}


class StepCounters:
    """What each optimizer step moved, from the process's counters."""

    def __init__(self) -> None:
        self.steps: list[dict] = []
        self._start: dict | None = None

    def begin(self) -> None:
        self._start = snapshot()

    def end(self) -> None:
        now, start = snapshot(), self._start
        self.steps.append({"calls": _minus(now["calls"], start["calls"]),
                           "bytes": _minus(now["bytes"], start["bytes"]),
                           "tokens": now["tokens"] - start["tokens"],
                           "local_tokens": now["local_tokens"] - start["local_tokens"]})


def _close(a: float, b: float, rel: float, what: str) -> None:
    assert abs(a - b) <= rel * max(abs(b), 1e-300), f"{what}: logged {a} vs counted {b}"


def assert_windows(rows: list[dict], steps: list[dict], dp: int, where: str = "") -> None:
    """``rows``: the logged figures in order (each covering ``tsp/steps`` steps); ``steps``: the
    job's :class:`StepCounters` steps. The rows must cover every step once, in order."""
    assert rows, f"{where}: nothing logged"
    i = 0
    for r, row in enumerate(rows):
        n = int(row["tsp/steps"])
        assert n >= 1 and i + n <= len(steps), (where, r, n, len(steps))
        window = steps[i:i + n]
        i += n
        what = f"{where} row {r} (steps {i - n + 1}-{i})"
        calls, nbytes = Counter(), Counter()
        for s in window:
            calls.update(s["calls"])
            nbytes.update(s["bytes"])
        assert sum(calls.values()) > 0, f"{what}: the steps sent nothing"
        _close(row["tsp/comm_mib"], sum(nbytes.values()) / MIB / n, 1e-12, f"{what} comm_mib")
        _close(row["tsp/collectives"], sum(calls.values()) / n, 1e-12, f"{what} collectives")
        kinds = {k.split("/")[-1] for k in row if k.startswith("tsp/collectives/")}
        assert kinds == {k for k, v in calls.items() if v}, (what, kinds, dict(calls))
        for kind in kinds:
            _close(row[f"tsp/comm_mib/{kind}"], nbytes[kind] / MIB / n, 1e-12, f"{what} {kind}")
            _close(row[f"tsp/collectives/{kind}"], calls[kind] / n, 1e-12, f"{what} {kind}")
        tokens = sum(s["tokens"] for s in window)
        local = sum(s["local_tokens"] for s in window)
        assert tokens > 0 and local > 0, (what, tokens, local)
        _close(row["tsp/tokens"], tokens * dp / n, 1e-12, f"{what} tokens")
        step_s = row["tsp/step_s"]
        assert step_s > 0, (what, step_s)
        _close(row["tsp/tokens_per_s"], tokens * dp / n / step_s, 1e-9, f"{what} tokens/s")
        _close(row["tsp/tokens_per_s_local"], local / n / step_s, 1e-9, f"{what} local tokens/s")
        assert 0 <= row["tsp/wait_s"] <= step_s, (what, row["tsp/wait_s"], step_s)
        _close(row["tsp/wait_frac"], row["tsp/wait_s"] / step_s, 1e-9, f"{what} wait_frac")
        peak = [k for k in row if k.startswith("tsp/peak_")]
        assert len(peak) == 1 and row[peak[0]] > 0, (what, peak)
    assert i == len(steps), f"{where}: rows cover {i} of {len(steps)} steps"
