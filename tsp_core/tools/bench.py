"""Real multi-process training runs of every layout on the same model and data: tokens/s, per-rank
peak memory and bytes moved per layer beside the formula of docs/design.md "Communication per
layer".

``run(...)`` starts ``degree`` worker processes (gloo on CPU, NCCL with one GPU each when CUDA is
present). For each (layout, sequence length) every worker builds the same seeded Llama-family
model, lays it out, and runs AdamW steps on the same random tokens:

- tokens/s: batch * seq / median step time (forward, backward, optimizer step) after warm-up;
- peak memory per rank: CUDA allocator peak on GPU; on CPU ``MemTracker`` over one extra step
  (the same tracker for every layout, as in the main example);
- bytes: what :mod:`tsp_core.comm` counted in one decoder layer's forward and in a whole step.
"""

from __future__ import annotations

import os
import queue
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from functools import partial
from typing import Any

import torch

MIB = 1024 ** 2


@dataclass(frozen=True)
class BenchConfig:
    layouts: str = "tsp,tp,tp-sp,cp"
    degree: int = 2
    seqs: tuple[int, ...] = (2048,)
    model: str = "tiny"
    batch: int = 1
    steps: int = 4
    warmup: int = 1
    dtype: str = "float32"

    def __post_init__(self) -> None:
        # the first step measures traffic and memory and is never timed: at least one warm-up
        if self.warmup < 1 or self.steps < 1:
            raise ValueError(f"warmup ({self.warmup}) and steps ({self.steps}) must be at least 1: "
                             f"the first step measures traffic and memory and is not timed")


@dataclass
class BenchRecord:
    layout: str
    name: str
    tp: int
    cp: int
    degree: int
    seq: int
    batch: int
    tokens_per_s: float
    step_seconds: list[float]
    peak_bytes: list[int]                    # per rank
    layer_forward_bytes: float               # measured, one decoder layer, forward
    formula_layer_forward_bytes: float       # docs/design.md "Communication per layer"
    step_bytes: float                        # measured, one whole training step
    step_calls: int
    wait_fraction: float                     # host time blocked in collectives / median step
    loss: float
    device: str
    extra: dict[str, Any] = field(default_factory=dict)


def _device_and_backend(rank: int) -> tuple[torch.device, str]:
    if torch.cuda.is_available():
        torch.cuda.set_device(rank % torch.cuda.device_count())
        return torch.device("cuda", torch.cuda.current_device()), "nccl"
    return torch.device("cpu"), "gloo"


def _measure(cfg: BenchConfig, layout_label: str, seq: int, device: torch.device) -> BenchRecord:
    import torch.distributed as dist
    from torch.distributed._tools.mem_tracker import MemTracker
    from transformers import LlamaForCausalLM

    from ..baselines import build, parse_layouts
    from ..distributed import comm
    from ..plan.simulate import model_config
    from ..plan.traffic import ModelShape, layer_forward_elements

    (spec,) = [s for s in parse_layouts(layout_label.split("(")[0], cfg.degree)
               if s.label == layout_label]
    config = model_config(cfg.model, seq=seq)
    dtype = getattr(torch, cfg.dtype)
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(config).to(dtype)
    pm = build(model, spec)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, config.vocab_size, (cfg.batch, seq), generator=gen).to(device)
    batch = {"input_ids": ids, "labels": ids}

    def step() -> float:
        loss = pm.step(batch)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.item()

    with pm.layer_traffic(0) as layer_stats, comm.track() as step_stats:
        loss = step()  # warm-up step 1 also measures the traffic
    times = []
    for _ in range(cfg.warmup - 1 + cfg.steps):
        dist.barrier()
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        loss = step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    times = times[cfg.warmup - 1:]
    # the host time blocked in collectives, in one more step with every layout's collectives
    # timed (DTensor's through the counting mode), over the median timed step
    with pm.counting(), comm.track() as waited:
        step()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
        step()
        peak = torch.cuda.max_memory_allocated()
    else:
        tracker = MemTracker()
        tracker.track_external(model, opt)
        with tracker:
            step()
        (snap,) = tracker.get_tracker_snapshot("peak").values()
        peak = int(snap["Total"])
    peaks = [torch.zeros((), dtype=torch.int64, device=device)
             for _ in range(dist.get_world_size())]
    dist.all_gather(peaks, torch.tensor(peak, dtype=torch.int64, device=device))
    shape = ModelShape.from_config(config)
    formula = layer_forward_elements(spec.name, spec.tp, spec.cp, shape, cfg.batch, seq)
    return BenchRecord(
        spec.label, spec.name, spec.tp, spec.cp, spec.degree, seq, cfg.batch,
        cfg.batch * seq / statistics.median(times), times, [int(p) for p in peaks],
        layer_stats.total_bytes, formula * torch.finfo(dtype).bits / 8, step_stats.total_bytes,
        sum(step_stats.calls.values()), waited.wait_seconds / statistics.median(times), loss,
        device.type)


def _worker(rank: int, degree: int, cases: list, measure: Callable, init_file: str,
            results) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    import torch.distributed as dist

    device, backend = _device_and_backend(rank)
    dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank,
                            world_size=degree)
    state: dict[str, Any] = {}  # kept across a worker's cases (e.g. a reference's output)
    try:
        for case in cases:
            try:
                rec = measure(case, device, state)
            except BaseException as e:  # noqa: BLE001 - reported, then every rank stops
                results.put(("error", rank, f"{case}: {type(e).__name__}: {e}"))
                raise
            if rank == 0:
                results.put(("record", rank, rec))
        dist.barrier()
    finally:
        dist.destroy_process_group()
    results.put(("done", rank, None))


def run_on_processes(degree: int, cases: list, measure: Callable, describe: Callable[[Any], str],
                     progress: Callable[[str], None] = print) -> list:
    """Run ``measure(case, device, state)`` for every case, in order, on ``degree`` fresh
    processes (gloo on CPU, NCCL with one GPU each when CUDA is present); rank 0's records come
    back and ``progress`` gets ``describe(record)`` as each finishes. ``measure`` must be
    picklable (a module-level function, or a partial of one)."""
    import torch.multiprocessing as mp

    if torch.cuda.is_available() and torch.cuda.device_count() < degree:
        progress(f"note: {degree} processes share {torch.cuda.device_count()} GPU(s)")
    ctx = mp.get_context("spawn")
    fd, init_file = tempfile.mkstemp(prefix="tsp_bench_")
    os.close(fd)
    os.unlink(init_file)
    results = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(r, degree, cases, measure, init_file, results))
             for r in range(degree)]
    for p in procs:
        p.start()
    records: list = []
    done, errors = 0, []
    start = time.perf_counter()  # the progress lines say the time since, as tsp simulate's do
    try:
        while done < degree and not errors:
            try:
                kind, rank, payload = results.get(timeout=5)
            except queue.Empty:
                if any(p.exitcode not in (None, 0) for p in procs):
                    errors.append("a worker died: " + ", ".join(
                        f"rank {r} exit {p.exitcode}" for r, p in enumerate(procs)))
                continue
            if kind == "record":
                records.append(payload)
                progress(f"[{len(records)}/{len(cases)} {time.perf_counter() - start:.0f}s] "
                         f"{describe(payload)}")
            elif kind == "error":
                errors.append(f"rank {rank}: {payload}")
            else:
                done += 1
    finally:
        for p in procs:
            p.join(timeout=None if not errors else 10)
            if p.is_alive():
                p.kill()
        if os.path.exists(init_file):
            os.unlink(init_file)
    if errors:
        raise RuntimeError("benchmark failed: " + "; ".join(errors))
    return records


def _measure_case(cfg: BenchConfig, case: tuple[str, int], device: torch.device,
                  _state: dict) -> BenchRecord:
    return _measure(cfg, case[0], case[1], device)


def cases_of(cfg: BenchConfig) -> tuple[list[tuple[str, int]], list[str]]:
    """(layout label, seq) for every case, and a note for each layout that has no shape at this
    degree (a 2-D layout at a prime degree)."""
    from ..baselines import layout_specs

    labels, notes = [], []
    for name in (n.strip() for n in cfg.layouts.split(",") if n.strip()):
        try:
            labels += [s.label for s in layout_specs(name, cfg.degree)]
        except ValueError as e:
            if "has none" not in str(e):
                raise
            notes.append(f"skipped {name}: {e}")
    return [(label, seq) for seq in cfg.seqs for label in labels], notes


def run(cfg: BenchConfig, progress: Callable[[str], None] = print) -> list[BenchRecord]:
    """Run every case on ``cfg.degree`` fresh processes; ``progress`` gets a line per case."""
    cases, notes = cases_of(cfg)
    for note in notes:
        progress(note)
    if not cases:
        raise ValueError(f"nothing to run: no layout of {cfg.layouts!r} fits degree {cfg.degree}")
    return run_on_processes(cfg.degree, cases, partial(_measure_case, cfg), format_row, progress)


HEADER = (f"{'layout':<15} {'seq':>6} {'tokens/s':>9} {'wait %':>6} {'peak MiB/rank':>14} "
          f"{'layer fwd MiB':>13} {'formula':>8} {'step MiB':>9}")


def format_row(r: BenchRecord) -> str:
    return (f"{r.layout:<15} {r.seq:>6} {r.tokens_per_s:>9.0f} {100 * r.wait_fraction:>6.1f} "
            f"{max(r.peak_bytes) / MIB:>14.1f} "
            f"{r.layer_forward_bytes / MIB:>13.3f} {r.formula_layer_forward_bytes / MIB:>8.3f} "
            f"{r.step_bytes / MIB:>9.1f}")


def table(records: list[BenchRecord]) -> str:
    return "\n".join([HEADER] + [format_row(r) for r in sorted(records, key=lambda r: r.seq)])


def to_json(records: list[BenchRecord], cfg: BenchConfig) -> dict:
    return {"config": asdict(cfg), "records": [asdict(r) for r in records]}


def plot(records: list[BenchRecord], path: str) -> None:
    """Peak memory per rank, tokens/s and the fraction of a step spent waiting on collectives
    against sequence length, one line per layout."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_mem, ax_tps, ax_wait) = plt.subplots(1, 3, figsize=(16, 4))
    for label in dict.fromkeys(r.layout for r in records):
        rs = sorted((r for r in records if r.layout == label), key=lambda r: r.seq)
        seqs = [r.seq for r in rs]
        ax_mem.plot(seqs, [max(r.peak_bytes) / MIB for r in rs], marker="o", label=label)
        ax_tps.plot(seqs, [r.tokens_per_s for r in rs], marker="o", label=label)
        ax_wait.plot(seqs, [100 * r.wait_fraction for r in rs], marker="o", label=label)
    for ax, title in ((ax_mem, "peak memory per rank (MiB)"), (ax_tps, "tokens/s"),
                      (ax_wait, "waiting on collectives (% of a step)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("sequence length (tokens)")
        ax.set_title(title)
        ax.grid(True, alpha=0.3)
    ax_mem.legend()
    r0 = records[0]
    fig.suptitle(f"degree {r0.degree}, batch {r0.batch}, {r0.device}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
