"""``tsp bench --compile``: compiled against eager, for TSP and for the baselines, with one harness.

For each layout, every worker builds the same seeded model twice, once eager and once with each
decoder layer compiled (``tsp_core.parallelize(..., compile=)`` for TSP,
:func:`tsp_core.baselines.build` with the same ``compile=`` for the others: the same unit, the same
backend and options), and runs the same AdamW steps on the same random tokens:

- compile seconds: the first compiled step's wall time less the median compiled step (dynamo's
  trace, AOT autograd and code generation of every layer's forward and backward happen in that
  first step). Inductor's FX-graph and AOT-autograd caches are off in the workers (its on-disk
  cache of compiled kernels is not);
- tokens/s: batch * seq / median of the timed steps (after ``warmup`` untimed ones);
- losses: every step's loss, compiled beside eager (the same data and weights, so they agree up
  to the backend's rounding: bit for bit with ``aot_eager``);
- graphs and graph breaks: dynamo's counters for the compiled run (fullgraph refuses a break).
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from functools import partial

import torch

DEFAULT_LAYOUTS = "tsp,tp-sp"


@dataclass(frozen=True)
class CompileBenchConfig:
    layouts: str = DEFAULT_LAYOUTS
    degree: int = 2
    seq: int = 512
    model: str = "tiny"
    batch: int = 1
    steps: int = 5
    warmup: int = 2
    dtype: str = "float32"
    backend: str = "inductor"

    def __post_init__(self) -> None:
        # the first step compiles and is never timed; a second settles the allocator
        if self.warmup < 1 or self.steps < 1:
            raise ValueError(f"warmup ({self.warmup}) and steps ({self.steps}) must be at least "
                             f"1: the first step compiles and is not timed")


@dataclass
class CompileRecord:
    layout: str
    mode: str                     # "eager" or "compiled"
    backend: str | None
    seq: int
    batch: int
    degree: int
    tokens_per_s: float
    step_seconds: list[float]     # the timed steps
    first_step_seconds: float
    losses: list[float]           # every step's, warm-up included
    graphs: int                   # dynamo's unique graphs (0 eager)
    graph_breaks: int
    device: str
    extra: dict = field(default_factory=dict)

    @property
    def compile_seconds(self) -> float:
        return self.first_step_seconds - statistics.median(self.step_seconds)


@contextlib.contextmanager
def cold_compiles() -> Iterator[None]:
    """Inductor's FX-graph and AOT autograd caches off, dynamo's caches and counters empty, and
    ``trace_autograd_ops`` (which ``parallelize(compile=)`` turns on) put back on exit: a compile
    measured inside is a cold one, and leaves the process as it found it."""
    import torch._dynamo as dynamo
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config

    saved = (inductor_config.fx_graph_cache, functorch_config.enable_autograd_cache,
             dynamo.config.trace_autograd_ops)
    inductor_config.fx_graph_cache = functorch_config.enable_autograd_cache = False
    dynamo.reset()
    dynamo.utils.counters.clear()
    try:
        yield
    finally:
        (inductor_config.fx_graph_cache, functorch_config.enable_autograd_cache,
         dynamo.config.trace_autograd_ops) = saved
        dynamo.reset()


def measure(cfg: CompileBenchConfig, layout: str, mode: str,
            device: torch.device) -> CompileRecord:
    """One case on every rank of the default group (``cfg.degree`` processes)."""
    with cold_compiles():
        return _steps(cfg, layout, mode, device)


def _measure(cfg: CompileBenchConfig, case: tuple[str, str], device: torch.device,
             _state: dict) -> CompileRecord:
    return measure(cfg, case[0], case[1], device)


def _steps(cfg: CompileBenchConfig, layout: str, mode: str,
           device: torch.device) -> CompileRecord:
    import torch._dynamo as dynamo
    import torch.distributed as dist
    from transformers import LlamaForCausalLM

    from ..baselines import build, parse_layouts
    from ..plan.simulate import model_config

    (spec,) = parse_layouts(layout, cfg.degree)
    config = model_config(cfg.model, seq=cfg.seq)
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(config).to(getattr(torch, cfg.dtype))
    pm = build(model, spec, compile=cfg.backend if mode == "compiled" else False)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, config.vocab_size, (cfg.batch, cfg.seq), generator=gen).to(device)
    batch = {"input_ids": ids, "labels": ids}
    times, losses = [], []
    for _ in range(cfg.warmup + cfg.steps):
        dist.barrier()
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        loss = pm.step(batch)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
        times.append(time.perf_counter() - t0)
    timed = times[cfg.warmup:]
    stats = dynamo.utils.counters
    return CompileRecord(
        spec.label, mode, cfg.backend if mode == "compiled" else None, cfg.seq, cfg.batch,
        cfg.degree, cfg.batch * cfg.seq / statistics.median(timed), timed, times[0], losses,
        int(stats["stats"]["unique_graphs"]), sum(stats["graph_break"].values()), device.type)


def cases_of(cfg: CompileBenchConfig) -> list[tuple[str, str]]:
    """(layout label, mode) for every case: each layout eager, then compiled."""
    from ..baselines import parse_layouts

    return [(s.label, mode) for s in parse_layouts(cfg.layouts, cfg.degree)
            for mode in ("eager", "compiled")]


def run(cfg: CompileBenchConfig, progress=print) -> list[CompileRecord]:
    """Every case, in order, on ``cfg.degree`` fresh processes
    (:func:`tsp_core.tools.bench.run_on_processes`)."""
    from .bench import run_on_processes

    return run_on_processes(cfg.degree, cases_of(cfg), partial(_measure, cfg), format_row,
                            progress)


HEADER = (f"{'layout':<10} {'mode':<9} {'seq':>6} {'tokens/s':>9} {'first step s':>12} "
          f"{'graphs':>6} {'breaks':>6}  losses")


def format_row(r: CompileRecord) -> str:
    return (f"{r.layout:<10} {r.mode:<9} {r.seq:>6} {r.tokens_per_s:>9.0f} "
            f"{r.first_step_seconds:>12.2f} {r.graphs:>6} {r.graph_breaks:>6}  "
            + " ".join(f"{x:.6f}" for x in r.losses))


def loss_gap(eager: CompileRecord, compiled: CompileRecord) -> float:
    """max over steps of |compiled - eager| / |eager|."""
    return max(abs(c - e) / abs(e) for e, c in zip(eager.losses, compiled.losses))


def summary(records: list[CompileRecord]) -> list[dict]:
    """Per layout: compiled / eager tokens/s, compile seconds and the losses' largest gap."""
    rows = []
    for label in dict.fromkeys(r.layout for r in records):
        by_mode = {r.mode: r for r in records if r.layout == label}
        eager, comp = by_mode["eager"], by_mode["compiled"]
        rows.append({"layout": label, "eager_tokens_per_s": eager.tokens_per_s,
                     "compiled_tokens_per_s": comp.tokens_per_s,
                     "ratio": comp.tokens_per_s / eager.tokens_per_s,
                     "compile_seconds": comp.compile_seconds,
                     "loss_gap": loss_gap(eager, comp)})
    return rows


def table(records: list[CompileRecord]) -> str:
    lines = [HEADER] + [format_row(r) for r in records] + [
        "", f"{'layout':<10} {'eager tok/s':>11} {'compiled tok/s':>14} {'compiled/eager':>14} "
            f"{'compile s':>9} {'max loss gap':>12}"]
    lines += [f"{s['layout']:<10} {s['eager_tokens_per_s']:>11.0f} "
              f"{s['compiled_tokens_per_s']:>14.0f} {s['ratio']:>14.2f} "
              f"{s['compile_seconds']:>9.1f} {s['loss_gap']:>12.2e}" for s in summary(records)]
    return "\n".join(lines)


def to_json(records: list[CompileRecord], cfg: CompileBenchConfig) -> dict:
    return {"config": asdict(cfg),
            "records": [dict(asdict(r), compile_seconds=r.compile_seconds) for r in records],
            "summary": summary(records)}
