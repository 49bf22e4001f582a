"""``tsp bench --mode generate``: real multi-process greedy generation with TSP, the tensor-parallel
baseline and one process, on the same seeded Llama-family model and prompts.

For each layout and prompt length every worker:

- ``tsp``: :func:`tsp_core.parallelize`, then :func:`tsp_core.inference.decode.prefill` and
  ``max_new_tokens - 1`` calls of :func:`tsp_core.inference.decode.decode_step` (what
  ``tsp_core.generate`` runs), timed around the prefill (with the first token picked) and around the
  decode steps;
- ``tp``: :func:`tsp_core.baselines.build` with ``LayoutSpec("tp", D, 1)`` (DTensor tensor
  parallel), attention set back to ``sdpa``, Hugging Face's own ``generate`` and ``DynamicCache``;
- ``single``: the plain model and Hugging Face's ``generate`` in each process (every rank runs it
  at once, as the training benchmark's one-process baseline does).

Hugging Face's generate cannot be split, so its prefill time is a ``max_new_tokens=1`` call (time
to the first token) and its decode time the full call minus that. EOS is disabled, so every run
makes the same number of tokens. KV bytes are the allocated K/V tensors of this rank's cache after
the run; collectives per decoded token are counted by :mod:`tsp_core.comm` (DTensor's too).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from functools import partial
from typing import Any

import torch

from .bench import run_on_processes

MIB, KIB = 1024 ** 2, 1024
LAYOUTS = ("tsp", "tp", "single")


@dataclass(frozen=True)
class GenerateBenchConfig:
    layouts: str = "tsp,tp,single"
    degree: int = 2
    prompts: tuple[int, ...] = (1024,)
    new_tokens: int = 32
    model: str = "tiny"
    batch: int = 1
    repeats: int = 2
    dtype: str = "float32"


@dataclass
class GenerateRecord:
    layout: str
    degree: int
    prompt: int
    new_tokens: int
    batch: int
    prefill_tokens_per_s: float
    decode_tokens_per_s: float
    prefill_seconds: float
    decode_seconds: float
    kv_bytes: list[int]                      # per rank, after the run
    decode_bytes_per_token: float            # counted collectives, per rank
    decode_calls_per_token: float
    same_tokens_as_single: bool | None
    device: str
    extra: dict[str, Any] = field(default_factory=dict)


def _sync(device: torch.device) -> None:
    import torch.distributed as dist

    dist.barrier()
    if device.type == "cuda":
        torch.cuda.synchronize()


def _build(cfg: GenerateBenchConfig, prompt: int, device: torch.device):
    from transformers import LlamaForCausalLM

    from ..plan.simulate import model_config

    config = model_config(cfg.model, seq=prompt + cfg.new_tokens)
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(config).to(getattr(torch, cfg.dtype))
    model.eval()
    model.generation_config.eos_token_id = None   # every run makes new_tokens tokens
    return model


def _tsp_run(model, ids: torch.Tensor, new: int, device: torch.device):
    """(prefill seconds, decode seconds, output, cache, decode CommStats)."""
    from ..distributed import comm
    from ..inference.decode import decode_step, prefill

    _sync(device)
    t0 = time.perf_counter()
    logits, cache = prefill(model, ids)
    tokens = [logits.float().argmax(-1)]
    cache.reserve(new - 1)
    if device.type == "cuda":
        torch.cuda.synchronize()
    t1 = time.perf_counter()
    with comm.track() as stats:
        for step in range(new - 1):
            logits = decode_step(model, cache, tokens[-1], cache.lengths + step)
            tokens.append(logits.float().argmax(-1))
    if device.type == "cuda":
        torch.cuda.synchronize()
    t2 = time.perf_counter()
    return t1 - t0, t2 - t1, torch.cat([ids, torch.stack(tokens, 1)], 1), cache, stats


def _hf_run(model, ids: torch.Tensor, new: int, device: torch.device):
    """Hugging Face generate: (time to the first token, decode seconds, output, cache)."""
    from transformers import DynamicCache

    def call(n: int, cache=None):
        _sync(device)
        t0 = time.perf_counter()
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                             do_sample=False, cache=cache)
        if device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - t0, out

    first, _ = call(1)
    cache = DynamicCache(config=model.config)
    total, out = call(new, cache)
    return first, max(total - first, 1e-9), out, cache


def _hf_decode_traffic(model, ids: torch.Tensor) -> tuple[float, int]:
    """Bytes and calls of one decoded token of the DTensor model (a 2-token minus a 1-token
    generate, DTensor's collectives counted)."""
    from ..distributed import comm

    counts = []
    for n in (1, 2):
        with comm.track() as s, comm.count_functional_collectives():
            model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                           do_sample=False)
        counts.append((s.total_bytes, sum(s.calls.values())))
    return counts[1][0] - counts[0][0], counts[1][1] - counts[0][1]


def _measure(cfg: GenerateBenchConfig, layout: str, prompt: int, device: torch.device,
             single: dict[int, torch.Tensor]) -> GenerateRecord:
    import torch.distributed as dist

    from ..baselines import LayoutSpec, build
    from ..inference.decode import cache_bytes_of

    model = _build(cfg, prompt, device)
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, model.config.vocab_size, (cfg.batch, prompt), generator=gen).to(device)
    new = cfg.new_tokens
    runs, traffic = [], (0.0, 0)
    if layout == "tsp":
        pm = build(model, LayoutSpec("tsp", cfg.degree, 1))
        for _ in range(cfg.repeats + 1):           # the first run warms up
            runs.append(_tsp_run(pm.model, ids, new, device))
        stats = runs[-1][4]
        traffic = (stats.total_bytes / max(1, new - 1), sum(stats.calls.values()) / max(1, new - 1))
    else:
        if layout == "tp":
            pm = build(model, LayoutSpec("tp", cfg.degree, 1))
            model = pm.model
            # the baseline's CP attention assumes q = k length
            model.set_attn_implementation("sdpa")
            # generate picks tokens from whole-vocabulary logits: gather the vocabulary-sharded
            # DTensor (HF keeps only the last position's logits, so this is [B, 1, V])
            model.lm_head.register_forward_hook(
                lambda _m, _i, out: out.full_tensor() if hasattr(out, "full_tensor") else out)
        for _ in range(cfg.repeats + 1):
            runs.append(_hf_run(model, ids, new, device))
        if layout == "tp":
            traffic = _hf_decode_traffic(model, ids)
    runs = runs[1:]
    prefill_s = statistics.median(r[0] for r in runs)
    decode_s = statistics.median(r[1] for r in runs)
    out, cache = runs[-1][2], runs[-1][3]
    if layout == "single":
        single[prompt] = out
    same = None if layout == "single" or prompt not in single else bool(
        torch.equal(out.cpu(), single[prompt].cpu()))
    kv = torch.tensor(cache_bytes_of(cache), dtype=torch.int64, device=device)
    every = [torch.zeros_like(kv) for _ in range(dist.get_world_size())]
    dist.all_gather(every, kv)
    return GenerateRecord(layout, cfg.degree, prompt, new, cfg.batch,
                          cfg.batch * prompt / prefill_s, cfg.batch * (new - 1) / decode_s,
                          prefill_s, decode_s, [int(k) for k in every], traffic[0], traffic[1],
                          same, device.type)


def cases_of(cfg: GenerateBenchConfig) -> list[tuple[str, int]]:
    names = [n.strip() for n in cfg.layouts.split(",") if n.strip()]
    unknown = [n for n in names if n not in LAYOUTS]
    if unknown:
        raise ValueError(f"unknown generate layout(s) {unknown}; choose from {', '.join(LAYOUTS)}")
    if cfg.new_tokens < 2:
        raise ValueError(f"new_tokens ({cfg.new_tokens}) must be at least 2 (one prefill token, "
                         f"then decode)")
    names.sort(key=lambda n: n != "single")       # the reference runs first
    return [(n, p) for p in cfg.prompts for n in names]


def _measure_case(cfg: GenerateBenchConfig, case: tuple[str, int], device: torch.device,
                  state: dict) -> GenerateRecord:
    with torch.no_grad():
        return _measure(cfg, case[0], case[1], device, state.setdefault("single", {}))


def run(cfg: GenerateBenchConfig, progress: Callable[[str], None] = print) -> list[GenerateRecord]:
    """Run every case on ``cfg.degree`` fresh processes; ``progress`` gets a line per case."""
    return run_on_processes(cfg.degree, cases_of(cfg), partial(_measure_case, cfg), format_row,
                            progress)


HEADER = (f"{'layout':<8} {'prompt':>6} {'new':>4} {'prefill tok/s':>13} {'decode tok/s':>12} "
          f"{'KV MiB/rank':>11} {'decode KiB/tok':>14} {'calls/tok':>9} {'same tokens':>11}")


def format_row(r: GenerateRecord) -> str:
    same = "-" if r.same_tokens_as_single is None else ("yes" if r.same_tokens_as_single else "no")
    return (f"{r.layout:<8} {r.prompt:>6} {r.new_tokens:>4} {r.prefill_tokens_per_s:>13.0f} "
            f"{r.decode_tokens_per_s:>12.1f} {max(r.kv_bytes) / MIB:>11.3f} "
            f"{r.decode_bytes_per_token / KIB:>14.1f} {r.decode_calls_per_token:>9.0f} "
            f"{same:>11}")


def table(records: list[GenerateRecord]) -> str:
    return "\n".join([HEADER] + [format_row(r) for r in records])


def to_json(records: list[GenerateRecord], cfg: GenerateBenchConfig) -> dict:
    return {"config": asdict(cfg), "records": [asdict(r) for r in records]}
