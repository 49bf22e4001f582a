"""The long-context tools measured: ``tsp simulate --activation-offload`` reports the host's bytes
apart from the GPU's peak, and ``tsp plan --max-seq``'s answer is the longest sequence that fits
(it fits, and one step of 2D tokens more does not), each checked by simulations run here, apart
from the code under test, in the session's two spawned simulation workers (tests/conftest.py)."""

from __future__ import annotations

import json
import re
import sys

import pytest

from tests.support.simulations import simulate_one
from tsp_core.plan.simulate import MODELS, SimulationRequest, record_dict
from tsp_core.tools import cli

LAYERS = 4  # the tiny preset with more layers: offload keeps a constant number on the device
H = MODELS["tiny"]["hidden_size"]


@pytest.fixture(scope="module")
def pool(simulations):
    """The session's two simulation workers (tests/conftest.py)."""
    return simulations


def tsp_request(seq: int, offload: bool, layout: str = "tsp") -> SimulationRequest:
    tp, cp = (2, 1) if layout == "tsp" else (1, 2)
    return SimulationRequest(layout, tp, cp, seq, "tiny", LAYERS, recompute="full",
                             activation_offload=offload)


def test_offload_moves_the_layer_inputs_to_the_host(pool):
    """TSP at D=2, 4096 tokens: with offload every layer's input (S/D x h bf16) is on the host,
    and the GPU's peak, weight gradients aside, is lower by at least the layer inputs that
    offload keeps off it (all but the two it brings back). (A baseline gets the same offload:
    the next test's cp.)"""
    seq = 4096
    plain, off = pool.map(simulate_one, [tsp_request(seq, False), tsp_request(seq, True)])
    layer_input = seq // 2 * H * 2
    print(f"peak {plain.peak_bytes} -> {off.peak_bytes}, host {off.host_bytes}; one layer "
          f"input {layer_input}")
    assert plain.host_bytes == 0
    assert off.host_bytes >= LAYERS * layer_input, (off.host_bytes, LAYERS * layer_input)
    # with offload the peak falls in a later layer's backward, when more weight gradients exist
    # (on this tiny model they weigh half a layer input): compare what is not gradients
    grads = off.breakdown["gradients"], plain.breakdown["gradients"]
    assert off.peak_bytes - grads[0] <= plain.peak_bytes - grads[1] - (LAYERS - 2) * layer_input, (
        off.peak_bytes, plain.peak_bytes, grads)
    assert off.peak_bytes < plain.peak_bytes, (off.peak_bytes, plain.peak_bytes)
    assert record_dict(off)["host_bytes"] == off.host_bytes  # what --json writes


def test_max_seq_is_the_longest_that_fits(pool, tmp_path, capsys):
    """``tsp plan --max-seq`` on the tiny model (4 layers) over 2 GPUs of 0.01 GB with offload:
    per layout, the answer fits (GPU peak within 90%, host within --host-gb per node) and the
    answer + 2D tokens does not, both simulated here."""
    out = tmp_path / "max.json"
    host_gb = 0.0016  # per node of 2 GPUs: binds before the GPU for tsp (at 3124 tokens), not cp
    assert cli.main(["plan", "--max-seq", "--model", "tiny", "--layers", str(LAYERS), "--seq",
                     "1024", "--gpus", "2", "--gpus-per-node", "2", "--gpu", "h100",
                     "--memory-gb", "0.01", "--layouts", "tsp,cp", "--activation-offload",
                     "--host-gb", str(host_gb), "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    plan = json.loads(out.read_text())
    gpu_limit, host_limit = 0.01e9 * 0.9, host_gb * 1e9 / 2
    fits = {f["layout"]: f for f in plan["max_seq"]}
    assert set(fits) == {"tsp", "cp"}
    asks = [tsp_request(f["seq"] + extra, True, name)
            for name, f in fits.items() for extra in (0, 4)]
    recs = list(pool.map(simulate_one, asks))
    for (name, f), at, beyond in zip(fits.items(), recs[0::2], recs[1::2]):
        print(name, f["seq"], f["bound"], at.peak_bytes, at.host_bytes, beyond.peak_bytes,
              beyond.host_bytes, gpu_limit, host_limit)
        assert at.host_bytes >= LAYERS * f["seq"] // 2 * H * 2, (name, at.host_bytes)  # offload
        assert at.peak_bytes <= gpu_limit and at.host_bytes <= host_limit, (name, f)
        assert beyond.peak_bytes > gpu_limit or beyond.host_bytes > host_limit, (name, f)
        assert f["certain"] and f["seq"] % 4 == 0, f
        assert (at.peak_bytes, at.host_bytes) == (f["peak_bytes"], f["host_bytes"])
        assert f"{name:<15} {2:>3} {f['seq']:>10}" in printed, printed
    assert {f["bound"] for f in fits.values()} == {"GPU", "host"}, fits


def test_max_seq_prints_a_line_as_each_simulation_finishes(monkeypatch, capsys):
    """A round of the search runs several simulations at once, each taking minutes at full size:
    a progress line, ``[done/asked so far, seconds]``, follows each as it finishes, not the whole
    round. The simulations are stood in for (a peak affine in the length: 1 MB + 1 kB a token)."""
    from tsp_core.plan import simulate

    def fake(requests, jobs=2, progress=None):
        out = []
        for q in requests:
            rec = simulate.MemoryRecord(q.layout, q.layout, q.tp, q.cp, q.tp * q.cp, q.seq, 1,
                                        q.model, LAYERS, "full", "adamw", "bfloat16",
                                        10**6 + 1000 * q.seq, {}, 0.0)
            print(f"finished {q.seq}", file=sys.stderr)
            if progress is not None:
                progress(rec)
            out.append(rec)
        return out

    monkeypatch.setattr(simulate, "simulate_many", fake)
    assert cli.main(["plan", "--max-seq", "--model", "tiny", "--layers", str(LAYERS), "--seq",
                     "1024", "--gpus", "2", "--gpus-per-node", "2", "--gpu", "h100",
                     "--memory-gb", "0.01", "--layouts", "tsp"]) == 0
    printed = capsys.readouterr()
    err = printed.err.splitlines()
    done = [i for i, line in enumerate(err) if line.startswith("finished ")]
    assert len(done) >= 3, err  # the two probes, then at least one more round
    asked = 2
    for n, i in enumerate(done, 1):
        asked = max(asked, n)  # the rounds after the probes ask one length at a time
        assert re.fullmatch(rf"\[{n}/{asked} \d+s\] simulated tsp at {err[i][9:]} tokens: "
                            r"GPU \d+\.\d\d GiB, host 0\.00 GiB per rank \(0s\)",
                            err[i + 1] if i + 1 < len(err) else ""), err
    # 0.009 GB usable: (9e6 - 1e6) / 1000 tokens, a multiple of 2D = 4
    assert f"{'tsp':<15} {2:>3} {8000:>10}" in printed.out, printed.out
