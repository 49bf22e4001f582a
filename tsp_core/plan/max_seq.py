"""``tsp plan --max-seq``: per layout, the longest sequence whose training step fits the GPU with
the planner's reserve (``--headroom``, 10%) and, with activation offload, a host budget per node,
measured by ``tsp simulate`` of the whole model (:mod:`tsp_core.plan.simulate`).

For a fixed model and layout every byte of the step is affine in the sequence length S: the model
state does not change with S; the layer inputs, one head group's gathered K/V and the baselines'
untiled working sets grow linearly; TSP's tiles stay constant once a rank holds a tile of tokens.
So two simulations (at ``--seq`` and twice it) give a line per memory (the GPU's peak, the host's
bytes), and the answer is where a line meets its limit, rounded down to a multiple of 2D (the
zigzag layout's chunks). A third simulation at the answer checks the line, and a fourth, one
step (2D tokens) longer, that it is the longest. When a measurement is off the line (a peak that
moves to another moment of the step, or probes shorter than a tile), the line through the nearest
measured lengths on either side of the limit is solved again, kept inside them, with a
bisection when that bracket does not halve (a safeguarded secant method), at most :data:`ROUNDS`
times. The answer is always a length that was simulated
and fits; ``certain`` says that the next one was simulated and does not.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

from ..baselines.layouts import LayoutSpec
from .simulate import MemoryRecord

HOST_GB = 1.5 * 2 ** 40 / 1e9  # the default host budget of a node: 1.5 TiB
ROUNDS = 6  # simulations after the two probes, at most, per layout


@dataclass(frozen=True)
class Line:
    """``bytes = base + per_token x seq``."""

    base: float
    per_token: float

    @classmethod
    def through(cls, a: tuple[int, float], b: tuple[int, float]) -> Line:
        (s0, y0), (s1, y1) = a, b
        slope = (y1 - y0) / (s1 - s0)
        return cls(y0 - slope * s0, slope)

    def at(self, seq: float) -> float:
        return self.base + self.per_token * seq

    def longest(self, limit: float) -> float:
        """The largest (real) length at which the line is within ``limit``."""
        if self.per_token <= 0:
            return math.inf if self.base <= limit else -math.inf
        return (limit - self.base) / self.per_token


@dataclass
class Search:
    """The search of one layout: the lengths simulated so far and what they measured."""

    spec: LayoutSpec
    gpu_limit: float                 # bytes of GPU memory a rank may peak at
    host_limit: float | None         # bytes of host memory per rank (None: not limited)
    points: dict[int, MemoryRecord] = field(default_factory=dict)
    probes: tuple[int, int] = (0, 0)  # the two first lengths (:func:`probes`)
    width: float = math.inf  # the bracket's width at the last proposal
    done: bool = False

    @property
    def step(self) -> int:
        """The answer is a multiple of this: 2D, the zigzag layout's chunks."""
        return 2 * self.spec.degree

    def fits(self, rec: MemoryRecord) -> bool:
        return rec.peak_bytes <= self.gpu_limit and (
            self.host_limit is None or rec.host_bytes <= self.host_limit)

    def lines(self, pair: tuple[int, int]) -> dict[str, Line]:
        a, b = (self.points[s] for s in pair)
        out = {"GPU": Line.through((a.seq, a.peak_bytes), (b.seq, b.peak_bytes))}
        if self.host_limit is not None:
            out["host"] = Line.through((a.seq, a.host_bytes), (b.seq, b.host_bytes))
        return out

    def pair(self) -> tuple[int, int]:
        """The two measured lengths to draw the lines through: the bracket when there is one,
        else the two longest (all fit) or the two shortest (none fits)."""
        f, o = self.bracket()
        if f is not None and o is not None:
            return f, o
        seqs = sorted(self.points)
        return (seqs[-2], seqs[-1]) if o is None else (seqs[0], seqs[1])

    def bracket(self) -> tuple[int | None, int | None]:
        """(the longest measured length that fits, the shortest longer one that does not)."""
        fitting = [q for q in sorted(self.points) if self.fits(self.points[q])]
        f = fitting[-1] if fitting else None
        over = [q for q in sorted(self.points) if f is None or q > f]
        return f, (over[0] if over else None)

    def propose(self) -> int | None:
        """The next length to simulate: where the lines meet their limits, rounded down to a
        multiple of :attr:`step` and kept strictly inside the bracket; None when the answer is
        certain (it fits and one step more does not) or nothing fits."""
        f, o = self.bracket()
        if f is not None and o is not None:
            if o - f <= self.step:
                return None
            width, self.width = self.width, o - f
            if 2 * (o - f) > width:  # the bracket did not halve (a convex stretch): bisect
                return (f + o) // 2 // self.step * self.step
        limits = {"GPU": self.gpu_limit, "host": self.host_limit}
        best = min(line.longest(limits[k]) for k, line in self.lines(self.pair()).items())
        if best == math.inf:
            raise ValueError(f"{self.spec.label}: memory does not grow with the sequence "
                             f"between {sorted(self.points)} tokens; nothing bounds it")
        q = math.floor(best / self.step) * self.step if best > 0 else 0
        if f is not None:
            q = max(q, f + self.step)
        if o is not None:
            q = min(q, o - self.step)
        return q if q >= self.step else None

    def bound(self, seq: int) -> str:
        """Which limit the answer meets first: "GPU" or "host"."""
        rec = self.points[seq]
        if self.host_limit is None or self.host_limit <= 0:
            return "GPU"
        return "GPU" if rec.peak_bytes / self.gpu_limit >= rec.host_bytes / self.host_limit \
            else "host"


@dataclass
class LongestFit:
    """One layout's answer. ``seq`` is None when not even 2D tokens fit (``why`` says so)."""

    layout: str              # the label, e.g. "tp+cp(4x2)"
    name: str
    tp: int
    cp: int
    seq: int | None
    peak_bytes: int          # measured at seq
    host_bytes: int          # per rank, measured at seq
    bound: str               # "GPU" or "host": the limit it meets first
    probe_line: dict[str, float]  # the GPU peak's line through the two probes
    predicted_peak: float    # that line at seq: the check that memory is affine in seq
    simulations: int
    certain: bool            # seq + 2D was simulated too and does not fit
    step_s: float | None = None       # the planner's (tsp_core.plan.cost.evaluate) at seq
    tokens_per_s: float | None = None
    why: str = ""

    @property
    def degree(self) -> int:
        return self.tp * self.cp

    def as_dict(self) -> dict:
        return asdict(self) | {"degree": self.degree}


def probes(seq: int, spec: LayoutSpec) -> tuple[int, int]:
    """The two first lengths: ``seq`` rounded up to a multiple of 2D, and twice that."""
    step = 2 * spec.degree
    first = max(step, -(-seq // step) * step)
    return first, 2 * first


def search(specs: list[LayoutSpec], seq: int, gpu_limit: float, host_limit: float | None,
           measure: Callable[[list[tuple[LayoutSpec, int]]], list[MemoryRecord]],
           rounds: int = ROUNDS) -> list[LongestFit]:
    """The longest fitting length of every layout of ``specs``. ``measure`` simulates a list of
    (layout, length) at once (in parallel) and returns the records in order; the probes start at
    ``seq`` (:func:`probes`)."""
    searches = [Search(s, gpu_limit, host_limit) for s in specs]
    for s in searches:
        s.probes = probes(seq, s.spec)
    asks = [(s, q) for s in searches for q in s.probes]
    for _ in range(rounds + 1):
        for (s, q), rec in zip(asks, measure([(s.spec, q) for s, q in asks])):
            s.points[q] = rec
        asks = []
        for s in searches:
            if s.done:
                continue
            q = s.propose()
            if q is None:
                s.done = True
            else:
                asks.append((s, q))
        if not asks:
            break
    return [_answer(s) for s in searches]


def _answer(s: Search) -> LongestFit:
    first = Line.through(*((r.seq, r.peak_bytes) for r in (s.points[q] for q in s.probes)))
    line = {"base_bytes": first.base, "bytes_per_token": first.per_token}
    q, _ = s.bracket()
    common = dict(layout=s.spec.label, name=s.spec.name, tp=s.spec.tp, cp=s.spec.cp,
                  probe_line=line, simulations=len(s.points), certain=s.done)
    if q is None:
        return LongestFit(seq=None, peak_bytes=0, host_bytes=0, bound="GPU", predicted_peak=0.0,
                          why=f"{s.step} tokens do not fit: the model state and the fixed "
                              f"buffers alone take {first.base / 2**30:.2f} GiB of the "
                              f"{s.gpu_limit / 2**30:.2f} GiB usable", **common)
    rec = s.points[q]
    return LongestFit(seq=q, peak_bytes=rec.peak_bytes, host_bytes=rec.host_bytes,
                      bound=s.bound(q), predicted_peak=first.at(q), **common)


def max_seq_main(args, shape, found) -> int:
    """``tsp plan --max-seq`` (:mod:`tsp_core.plan.command` parses the options and finds the
    cluster): simulate, print the table, write ``--json``."""
    import json
    import sys
    import time

    from ..baselines.layouts import LAYOUTS
    from .cost import candidates, check_layout, evaluate
    from .simulate import SimulationRequest, check_request, record_dict, simulate_many

    cl = found.cluster
    d = cl.gpus  # the whole cluster holds one sequence
    host_gb = HOST_GB if args.host_gb is None else args.host_gb
    if host_gb <= 0:
        raise ValueError(f"--host-gb ({host_gb}) must be positive: the host memory of a node in "
                         f"GB")
    ranks = min(cl.gpus_per_node, d)  # ranks sharing one node's host memory
    gpu_limit = cl.device.memory_bytes * (1 - args.headroom)
    host_limit = host_gb * 1e9 / ranks if args.activation_offload else None
    names = [n.strip() for n in (args.layouts or ",".join(LAYOUTS)).split(",") if n.strip()]
    unknown = [n for n in names if n not in LAYOUTS]
    if unknown:
        raise ValueError(f"unknown layout {unknown[0]!r}; choose from {', '.join(LAYOUTS)}")
    specs, refused = [], []
    for spec in candidates([d]):  # D = 1: the plain model, as tsp
        if spec.name in names:
            why = check_layout(shape, spec)
            (refused if why else specs).append(f"{spec.label} at {d}: {why}" if why else spec)
    if not specs:
        raise ValueError(f"no layout can split this model over {d} GPUs: " + "; ".join(refused))

    def request(spec: LayoutSpec, seq: int) -> SimulationRequest:
        return SimulationRequest(spec.name, spec.tp, spec.cp, seq, args.model, args.layers,
                                 args.batch, "full", "adamw", "bfloat16",
                                 activation_offload=args.activation_offload,
                                 lora=getattr(args, "lora", None),
                                 qlora=getattr(args, "qlora", False))

    for spec in specs:  # refuse before any process starts
        check_request(request(spec, 2 * spec.degree))
    every: list = []
    start = time.perf_counter()
    asked = [0]  # simulations asked for so far, over every round of the search

    def progress(r: MemoryRecord) -> None:
        """One line as each simulation finishes (a round's can take many minutes), counted over
        what has been asked so far, as ``tsp simulate`` counts its runs."""
        print(f"[{len(every) + 1}/{asked[0]} {time.perf_counter() - start:.0f}s] simulated "
              f"{r.layout} at {r.seq} tokens: GPU {r.peak_gib:.2f} GiB, host {r.host_gib:.2f} "
              f"GiB per rank ({r.seconds:.0f}s)", file=sys.stderr, flush=True)
        every.append(r)

    def measure(asks: list[tuple[LayoutSpec, int]]) -> list[MemoryRecord]:
        asked[0] += len(asks)
        return simulate_many([request(s, q) for s, q in asks], args.jobs, progress)

    print(f"cluster: {cl.nodes} x {cl.gpus_per_node} {cl.device.name} "
          f"({cl.device.memory_gb:.0f} GB); sources: {found.sources}")
    print(f"model {args.model}: {shape.num_layers} layers, h {shape.hidden_size}; the longest "
          f"sequence x {args.batch} on all {d} GPUs (D = {d}); tsp simulate: full recompute, bf16 "
          f"AdamW" + ("; activation offload (every layout)" if args.activation_offload else "")
          + (f"; LoRA r={args.lora}, base frozen" if getattr(args, "lora", None) else "")
          + ("; the base 4-bit NF4 (QLoRA)" if getattr(args, "qlora", False) else "")
          + "; tiles: tsp's MLP and loss (the baselines' are untiled)")
    print(f"fits: GPU peak <= {1 - args.headroom:.0%} of {cl.device.memory_gb:.0f} GB "
          f"({gpu_limit / 2**30:.2f} GiB)" + (
              f", host <= {host_gb:.0f} GB per node of {ranks} GPUs "
              f"({host_limit / 2**30:.2f} GiB per rank)" if host_limit else ""))
    fits = search(specs, args.seq, gpu_limit, host_limit, measure)
    for f in fits:
        if f.seq is not None:
            c = evaluate(shape, LayoutSpec(f.name, f.tp, f.cp), f.seq, cl, args.batch,
                         args.headroom, args.global_batch_tokens)
            f.step_s, f.tokens_per_s = c.step_s, c.tokens_per_s
    print(f"{'layout':<15} {'D':>3} {'max seq':>10} {'GPU GiB':>8} {'host GiB/node':>13} "
          f"{'bound':>5} {'step s':>8} {'tokens/s':>10} {'sims':>4}  affine (probes' line)")
    for f in sorted(fits, key=lambda f: -(f.seq or 0)):
        if f.seq is None:
            print(f"{f.layout:<15} {f.degree:>3} {'-':>10}  {f.why}")
            continue
        off = f.peak_bytes / f.predicted_peak - 1 if f.predicted_peak else 0.0
        note = "" if f.certain else f"; not certain after {f.simulations} simulations"
        print(f"{f.layout:<15} {f.degree:>3} {f.seq:>10} {f.peak_bytes / 2**30:>8.2f} "
              f"{f.host_bytes * ranks / 2**30:>13.1f} {f.bound:>5} {f.step_s:>8.1f} "
              f"{f.tokens_per_s:>10.4g} {f.simulations:>4}  measured {off:+.2%}{note}")
    for line in refused:
        print(f"cannot run: {line}")
    print("step s: the planner's (tsp plan), which does not count the offload copies")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"cluster": {"gpu": cl.device.name, "gpus_per_node": cl.gpus_per_node,
                                   "nodes": cl.nodes, "memory_gb": cl.device.memory_gb},
                       "gpu_limit_bytes": gpu_limit, "host_gb_per_node": host_gb,
                       "host_limit_bytes": host_limit, "ranks_per_node": ranks,
                       "activation_offload": args.activation_offload,
                       "max_seq": [f.as_dict() for f in fits], "cannot_run": refused,
                       "simulations": [record_dict(r) for r in every]}, fh, indent=1)
    sys.stdout.flush()
    return 0

