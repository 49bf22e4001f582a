"""Part (e): what the long-context switches cost on this device (docs/long-context.md).

A few checkpointed decoder layers of a Llama at tsp 1 (a world of one process: every TSP code
path runs, the collectives have one member), the model converted by ``tsp_core.parallelize``:

- host offload (``activation_offload=True``): the step time with it on and off, the copy time
  alone (the offloaded layer inputs' bytes over this device's measured host <-> device
  bandwidth), and the device bytes kept after the forward and at the step's peak, each way.
  Whether the copies hide behind compute is the step time's difference against the copy time.
  At tsp 1 a rank of L tokens attends to L keys, where a rank of D > 1 with L local tokens
  attends to D x L: less compute per copied byte, so this is the harder case for hiding.
- tiles: the MLP's and the loss's forward+backward time and peak with the default tile
  (``tile_tokens=None``; on CPU a forced small tile, the default being larger than its few
  tokens) against one tile of all the local tokens (``tile_tokens`` = L).

Speed and memory are figures, never pass/fail. What may fail is exactness, in float32 at the
small shape on either device: the offloaded model's loss and every gradient equal the
non-offloaded one's, and the tiled MLP's and loss's outputs and gradients equal the untiled.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ...distributed.model_state import model_state
from ...distributed.params import local
from .common import Check, failure, measurement, rel_err, within
from .layer_part import GIB, time_steps
from .meters import CudaMeter, LiveBytes
from .model_part import one_process_world


@dataclass(frozen=True)
class LongShape:
    """A Llama of ``layers`` decoder layers at tsp 1 on ``local`` tokens; ``tile``: the MLP's
    and the loss's tile (None: chosen from the sizes, ``parallelize``'s default)."""

    hidden: int
    heads: int
    kv_heads: int
    intermediate: int
    layers: int
    vocab: int
    local: int
    tile: int | None


# CUDA: Llama-3.1-8B's layer and vocabulary, 4 layers, 16384 local tokens (a 128K sequence over
# D = 8), bf16. CPU (and the exactness checks on both devices, float32): a small Llama of 3
# layers whose 256 tokens make 4 tiles of 64.
SHAPES = {"cuda": LongShape(4096, 32, 8, 14336, 4, 128256, 16384, None),
          "cpu": LongShape(128, 4, 2, 384, 3, 512, 256, 64)}
DTYPE = {"cuda": torch.bfloat16, "cpu": torch.float32}
ITERS = {"cuda": (1, 3), "cpu": (0, 1)}  # (warm-up, timed); CPU figures only show the code runs
# max|err| / max|ref| over the loss and every gradient, float32. Offload moves the same bytes
# and tiles cut only the token dimension, so only the order of a weight gradient's sum over
# tiles may differ (seen on CPU: offload 0, tiles below 1e-7).
EXACT_TOL = 1e-5
# At the small shape, tiles of 64 of 256 tokens: the tiled step's added peak over the untiled
# one's. Seen on CPU: MLP 0.65, loss 0.67; an untiled module gives 1.
SMALLER_TOL = 0.9


def llama(shape: LongShape, dtype: torch.dtype, device: str, seed: int = 0):
    """The random Llama of ``shape`` (nothing downloaded), activation checkpointing on (each
    decoder layer recomputed in the backward, what offload needs)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=shape.vocab, hidden_size=shape.hidden,
                         intermediate_size=shape.intermediate, num_hidden_layers=shape.layers,
                         num_attention_heads=shape.heads, num_key_value_heads=shape.kv_heads,
                         max_position_embeddings=shape.local, rope_theta=500000.0,
                         rms_norm_eps=1e-5, bos_token_id=None, eos_token_id=None,
                         pad_token_id=None, attn_implementation="sdpa")
    torch.manual_seed(seed)
    with torch.device(device):
        model = LlamaForCausalLM(config)
    model = model.to(dtype)
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    return model.train()


def converted(shape: LongShape, dtype: torch.dtype, device: str, mesh, offload: bool):
    """``llama`` converted with the long-context switches (the same weights every call)."""
    import tsp_core

    return tsp_core.parallelize(llama(shape, dtype, device), mesh, tile_tokens=shape.tile,
                                activation_offload=offload).train()


def token_batch(shape: LongShape, device: str, mesh) -> dict[str, torch.Tensor]:
    import tsp_core

    gen = torch.Generator().manual_seed(5)
    ids = torch.randint(0, shape.vocab, (1, shape.local), generator=gen).to(device)
    return tsp_core.shard_batch({"input_ids": ids, "labels": ids}, mesh)


def gradients(model) -> dict[str, torch.Tensor]:
    return {n: local(p.grad).detach().clone() for n, p in model.named_parameters()
            if p.grad is not None}


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


# ------------------------------------------------------------------------------ exactness

def offload_stats(model) -> dict[str, int]:
    """The model's offload counters (``model_state(model).offload.stats``: layer inputs moved
    to the host, brought back, prefetched); an error if ``parallelize`` installed no offload."""
    offload = model_state(model).offload
    if offload is None:
        raise RuntimeError("parallelize(..., activation_offload=True) installed no offload "
                           "(model_state(model).offload is None)")
    return dict(offload.stats)


def check_offload_exact(models: dict[bool, Any], batch: dict[str, torch.Tensor]) -> Check:
    """One step of the small model without and with offload (``models[False]``,
    ``models[True]``, the same weights): the loss and every gradient. A step that moved no
    layer input to the host fails: the comparison would prove nothing."""
    shape, name = SHAPES["cpu"], "e.offload.exact"
    runs = []
    before = offload_stats(models[True])
    for offload in (False, True):
        model = models[offload]
        model.zero_grad(set_to_none=True)
        loss = model(**batch).loss
        loss.backward()
        runs.append((loss.detach(), gradients(model)))
        model.zero_grad(set_to_none=True)
    moved = {k: v - before[k] for k, v in offload_stats(models[True]).items()}
    if moved["offloaded"] < shape.layers:
        return failure(name, f"the offloaded step moved {moved['offloaded']} layer inputs to the "
                             f"host, fewer than its {shape.layers} checkpointed layers")
    (loss0, g0), (loss1, g1) = runs
    if sorted(g0) != sorted(g1) or not g0:
        return failure(name, f"gradients of {sorted(set(g0) ^ set(g1))[:5]} differ in presence "
                             f"({len(g0)} without offload, {len(g1)} with)")
    errs = {n: rel_err(g1[n], g0[n]) for n in g0}
    worst = max(errs, key=errs.get)
    loss_err = rel_err(loss1, loss0)
    return within(name, max(loss_err, errs[worst]), EXACT_TOL, unit="max|err|/max|ref|",
                  note=f"float32, {shape.layers} checkpointed layers, {shape.local} tokens, tile "
                       f"{shape.tile}: loss {loss_err:.2g}, worst gradient {worst} "
                       f"{errs[worst]:.2g} ({len(errs)} gradients); layer inputs offloaded "
                       f"{moved['offloaded']}, brought back {moved['brought_back']}, of them "
                       f"prefetched {moved['prefetched']}",
                  detail={"loss": [loss0.item(), loss1.item()], "gradients": errs,
                          "moved": moved})


def module_step(module: torch.nn.Module, kind: str, shape: LongShape, dtype: torch.dtype,
                device: str) -> tuple[Callable[[], None], dict[str, Any]]:
    """A forward+backward of the MLP (``kind`` "mlp") or the loss ("loss") on ``shape.local``
    tokens; the closure leaves the output and the gradients in the returned dict."""
    gen = torch.Generator(device).manual_seed(2)
    x = torch.randn(1, shape.local, shape.hidden, generator=gen, device=device,
                    dtype=dtype).requires_grad_()
    dy = torch.randn(x.shape, generator=gen, device=device, dtype=dtype)
    labels = torch.randint(0, shape.vocab, (1, shape.local), generator=gen, device=device)
    labels[0, :3] = -100  # ignored labels count in neither the loss nor its gradient
    out: dict[str, Any] = {}

    def step() -> None:
        x.grad = None
        module.zero_grad(set_to_none=True)
        if kind == "mlp":
            y = module(x)
            y.backward(dy)
        else:
            y = module.loss_sum(x, labels)
            y.backward()
        out.update(y=y.detach(), dx=x.grad, **{n: local(p.grad) for n, p in
                                                 module.named_parameters()})

    return step, out


def tiled_modules(model) -> dict[str, torch.nn.Module]:
    """The first decoder layer's MLP and the LM head (the loss); each must take tiles."""
    found = {"mlp": model.model.layers[0].mlp, "loss": model.lm_head}
    for kind, module in found.items():
        if not hasattr(module, "tile_tokens"):
            raise RuntimeError(f"{type(module).__name__} (the {kind}) has no tile_tokens: this "
                               f"build does not tile it")
    return found


def check_tiles_exact(model, device: str) -> list[Check]:
    """The small model's MLP and loss with tiles of ``shape.tile`` against one tile of all
    ``shape.local`` tokens: the output and every gradient equal, and the tiled step's added
    peak below the untiled one's (what tiling is for; at these sizes the tiles' working set is
    a third of the untiled step's or so, the rest its input, output and gradients)."""
    shape = SHAPES["cpu"]
    checks = []
    for kind, module in tiled_modules(model).items():
        results, peaks = [], []
        for tile in (shape.tile, shape.local):
            module.tile_tokens = tile
            step, out = module_step(module, kind, shape, torch.float32, device)
            step()  # a first call's one-time allocations (a GEMM workspace) are not the tile's
            peaks.append(module_memory(step, device))
            results.append({k: v.clone() for k, v in out.items()})
        module.tile_tokens = shape.tile
        module.zero_grad(set_to_none=True)
        tiled, whole = results
        errs = {k: rel_err(tiled[k], whole[k]) for k in whole}
        worst = max(errs, key=errs.get)
        checks.append(within(f"e.tiles.{kind}.exact", errs[worst], EXACT_TOL,
                             unit="max|err|/max|ref|",
                             note=f"float32, tiles of {shape.tile} against one of {shape.local} "
                                  f"tokens; worst {worst}",
                             detail={"errors": errs}))
        checks.append(within(f"e.tiles.{kind}.smaller", peaks[0] / peaks[1], SMALLER_TOL,
                             unit="tiled peak / untiled peak",
                             note=f"float32, added during the step: tiles of {shape.tile} "
                                  f"{peaks[0] / 2**20:.4g} MiB, one of {shape.local} "
                                  f"{peaks[1] / 2**20:.4g} MiB",
                             detail={"peaks": peaks}))
    return checks


# ------------------------------------------------------------------------------ figures

def meter_for(device: str):
    return CudaMeter() if device == "cuda" else LiveBytes()


def model_memory(model, batch: dict[str, torch.Tensor], device: str) -> tuple[int, int]:
    """(bytes kept between the forward and the backward, the step's peak), above what was
    allocated before the step (weights, inputs); fresh gradients, as a first step has."""
    model.zero_grad(set_to_none=True)
    sync(device)
    meter = meter_for(device)
    ctx = meter if isinstance(meter, LiveBytes) else _null()
    with ctx:
        base = meter.current()
        meter.reset_peak()
        loss = model(**batch).loss
        sync(device)
        kept = meter.current() - base
        loss.backward()
        sync(device)
        peak = meter.peak() - base
    model.zero_grad(set_to_none=True)
    return kept, peak


def module_memory(step: Callable[[], None], device: str) -> int:
    """The peak one module step adds above what was allocated before it."""
    sync(device)
    meter = meter_for(device)
    with meter if isinstance(meter, LiveBytes) else _null():
        base = meter.current()
        meter.reset_peak()
        step()
        sync(device)
        return meter.peak() - base


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def bandwidth(nbytes: int, device: str, reps: int = 3) -> tuple[float, float]:
    """Bytes per second of device -> pinned host and pinned host -> device copies of
    ``nbytes`` (on CPU: a host memory copy, both ways the same)."""
    n = nbytes // 2
    if device != "cuda":
        a, b = torch.ones(n, dtype=torch.bfloat16), torch.empty(n, dtype=torch.bfloat16)
        times = []
        for _ in range(reps + 1):
            t0 = time.perf_counter()
            b.copy_(a)
            times.append(time.perf_counter() - t0)
        bw = nbytes / statistics.median(times[1:])
        return bw, bw
    dev = torch.ones(n, dtype=torch.bfloat16, device="cuda")
    host = torch.empty(n, dtype=torch.bfloat16, pin_memory=True)
    out = []
    for dst, src in ((host, dev), (dev, host)):
        times = []
        for _ in range(reps + 1):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            dst.copy_(src, non_blocking=True)
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) / 1000)
        out.append(nbytes / statistics.median(times[1:]))
    return out[0], out[1]


def default_tile(kind: str, shape: LongShape, dtype: torch.dtype) -> int:
    """The tile ``tile_tokens=None`` chooses for the MLP or the loss at tsp 1."""
    from ...layers.tiles import loss_tile_tokens, mlp_tile_tokens

    if kind == "mlp":
        return mlp_tile_tokens(shape.intermediate, dtype)
    return loss_tile_tokens(shape.vocab, dtype)


def tile_figures(model, shape: LongShape, dtype: torch.dtype, device: str) -> list[Check]:
    """Each tiled module's forward+backward time and added peak, the default tile against one
    tile of every local token."""
    checks = []
    for kind, module in tiled_modules(model).items():
        shown = str(shape.tile) if shape.tile else f"{default_tile(kind, shape, dtype)} (default)"
        got = {}
        for label, tile in (("tiled", shape.tile), ("untiled", shape.local)):
            module.tile_tokens = tile
            step, _ = module_step(module, kind, shape, dtype, device)
            seconds = time_steps(step, device, *ITERS[device])
            got[label] = (statistics.median(seconds), module_memory(step, device))
        module.tile_tokens = shape.tile
        (t_tiled, m_tiled), (t_whole, m_whole) = got["tiled"], got["untiled"]
        checks += [
            measurement(f"e.tiles.{kind}.time", t_tiled, "s",
                        f"median forward+backward, tile {shown}, {shape.local} tokens"),
            measurement(f"e.tiles.{kind}.time_untiled", t_whole, "s",
                        f"one tile of {shape.local} tokens"),
            measurement(f"e.tiles.{kind}.cost", t_tiled / t_whole, "x",
                        "tiled time over untiled (1: tiling is free)"),
            measurement(f"e.tiles.{kind}.peak", m_tiled / GIB, "GiB",
                        f"added during the step, tile {shown}; untiled {m_whole / GIB:.4g} GiB"),
            measurement(f"e.tiles.{kind}.peak_untiled", m_whole / GIB, "GiB",
                        "added during the step, one tile of every local token")]
    return checks


def offload_figures(model, batch, shape: LongShape, device: str) -> dict[str, float]:
    """Median step time, kept bytes and peak of one converted model."""
    def step() -> None:
        model.zero_grad(set_to_none=True)
        model(**batch).loss.backward()

    seconds = time_steps(step, device, *ITERS[device])
    kept, peak = model_memory(model, batch, device)
    return {"time": statistics.median(seconds), "kept": kept, "peak": peak}


def offload_checks(off: dict[str, float], on: dict[str, float], shape: LongShape,
                   dtype: torch.dtype, device: str) -> list[Check]:
    """The figures of both runs and the copy time they are judged against."""
    input_bytes = shape.local * shape.hidden * dtype.itemsize  # one layer's saved input
    moved = shape.layers * input_bytes  # each way, per step
    d2h, h2d = bandwidth(input_bytes, device)
    copy_s = moved / d2h + moved / h2d
    where = "device -> pinned host" if device == "cuda" else "host memory copy"
    extra = on["time"] - off["time"]
    return [
        measurement("e.offload.time_off", off["time"], "s",
                    f"median step (forward+backward, {shape.layers} checkpointed layers, "
                    f"{shape.local} tokens, {dtype}) without offload"),
        measurement("e.offload.time_on", on["time"], "s", "the same with activation_offload"),
        measurement("e.offload.exposed", extra, "s",
                    f"time_on - time_off, {extra / copy_s:.2g} x the copies' own time (<= 0: "
                    f"hidden)" + ("" if device == "cuda" else "; on CPU nothing is copied")),
        measurement("e.offload.copy_time", copy_s, "s",
                    f"{shape.layers} layer inputs of {input_bytes / 2**20:.4g} MiB out and back "
                    f"at the bandwidths measured here"),
        measurement("e.offload.d2h_gbps", d2h / 1e9, "GB/s", where),
        measurement("e.offload.h2d_gbps", h2d / 1e9, "GB/s",
                    "pinned host -> device" if device == "cuda" else where),
        measurement("e.offload.kept_off", off["kept"] / GIB, "GiB",
                    f"allocated between the forward and the backward, without offload; "
                    f"{shape.layers} layer inputs are {moved / GIB:.4g} GiB"),
        measurement("e.offload.kept_on", on["kept"] / GIB, "GiB",
                    "the same with offload" + ("" if device == "cuda" else
                                               " (on CPU host and device are one memory)")),
        measurement("e.offload.peak_off", off["peak"] / GIB, "GiB",
                    "the step's peak above the weights and inputs, without offload"),
        measurement("e.offload.peak_on", on["peak"] / GIB, "GiB", "the same with offload")]


def guarded(name: str, fn: Callable[[], Any]) -> list[Check]:
    """``fn``'s checks, or one failed check naming what it raised (the other pieces still run)."""
    try:
        got = fn()
    except Exception as e:  # noqa: BLE001 - reported as a failed check
        return [failure(name, e)]
    return got if isinstance(got, list) else [got]


def build(shape: LongShape, dtype: torch.dtype, device: str, mesh, offload: bool,
          checks: list[Check]):
    """``converted``, or None and a failed check naming what it raised."""
    try:
        return converted(shape, dtype, device, mesh, offload)
    except Exception as e:  # noqa: BLE001 - reported as a failed check
        checks.append(failure(f"e.build.offload_{'on' if offload else 'off'}", e))
        return None


def run(device: str, log=print) -> list[Check]:
    """Exactness at the small shape in float32; then the figures at ``SHAPES[device]`` (on CPU
    from the same two models; on CUDA one long-shape model at a time)."""
    shape, dtype, small = SHAPES[device], DTYPE[device], SHAPES["cpu"]
    log(f"(e) long context at tsp 1 on {device}: {shape}, {dtype}")
    checks: list[Check] = []
    with one_process_world(device) as mesh:
        models = {on: build(small, torch.float32, device, mesh, on, checks) for on in (False, True)}
        batch = token_batch(small, device, mesh)
        if models[False] is not None and models[True] is not None:
            checks += guarded("e.offload.exact", lambda: check_offload_exact(models, batch))
        if models[False] is not None:
            checks += guarded("e.tiles.exact", lambda: check_tiles_exact(models[False], device))
        if device == "cuda":
            models.clear()
            torch.cuda.empty_cache()
            batch = token_batch(shape, device, mesh)
        figures: dict[bool, dict[str, float]] = {}
        for offload in (False, True):
            model = (models.pop(offload) if device == "cpu"
                     else build(shape, dtype, device, mesh, offload, checks))
            if model is None:
                continue
            if not offload:
                checks += guarded("e.tiles.figures",
                                  lambda model=model: tile_figures(model, shape, dtype, device))
            try:
                figures[offload] = offload_figures(model, batch, shape, device)
            except Exception as e:  # noqa: BLE001 - reported as a failed check
                checks.append(failure(f"e.offload.figures_{'on' if offload else 'off'}", e))
            model = None  # freed before the next one is built
            if device == "cuda":
                torch.cuda.empty_cache()
        if len(figures) == 2:
            checks += offload_checks(figures[False], figures[True], shape, dtype, device)
    return checks
