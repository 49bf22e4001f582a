"""Parts (c) and (d): the compute of one decoder layer, timed, its FLOP rate and memory.

(c) The real TSP decoder layer (``tsp_core.parallelize`` of a one-layer Llama, bf16) run as rank
0 of a world of D = 8 on the ``fake`` process-group backend: every collective is a no-op, so the
device does exactly one rank's compute and none of its communication: its S/D zigzag queries
against all S keys for each of the D head groups, and the D MLP slices. Buffers that a
collective would fill (the other ranks' weight shards and K/V) hold whatever the allocator gives;
on CUDA the allocator is first filled with a finite value so that most of them are finite, and
the outputs' non-finite count is reported. GEMM and flash-kernel run times do not depend on the
values. Memory per module phase is compared with ``tsp simulate``'s prediction for the same layer.

(d) Hugging Face's own LlamaDecoderLayer (SDPA, causal) on the same S/D tokens: what a plain
layer of the same shape achieves on this device, the reference for (c)'s efficiency.

Each part runs in its own process (the fake world of (c) must not meet part (b)'s real one).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch

from ...distributed.chunks import row_segments
from ...layers import flash
from .common import Check, bf16_peak, measurement, within
from .meters import CudaMeter, LiveBytes, PhaseMemory

GIB = 2 ** 30
PHASES = ("attention_forward", "attention_backward", "mlp_forward", "mlp_backward")
# |measured - predicted| / predicted per phase. CPU: the simulation runs the very kernels the
# CPU run does, so only bookkeeping could differ (0 bytes seen). CUDA: chosen, not measured (no
# GPU run yet); the CUDA path runs other kernels (FlashAttention-2 for bf16: flash.kernel_for)
# than the simulation, and a miss is a finding about those or about the simulation, with both
# figures in the note.
MEMORY_TOL = {"cpu": 0.02, "cuda": 0.10}


@dataclass(frozen=True)
class LayerShape:
    """A decoder layer and the TSP group it is split over; ``model``: the ``tsp simulate``
    preset with the same layer."""

    hidden: int
    heads: int
    kv_heads: int
    intermediate: int
    seq: int
    degree: int
    model: str

    @property
    def local(self) -> int:
        return self.seq // self.degree

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


# The paper's 7B layer at 131072 tokens over D = 8 (16384 local tokens); on CPU the "small"
# preset's layer at 2048 tokens (256 local), seconds on 2 cores.
SHAPES = {"cuda": LayerShape(4096, 32, 32, 16384, 131072, 8, "7b"),
          "cpu": LayerShape(256, 8, 8, 1024, 2048, 8, "small")}
ITERS = {"cuda": (2, 5), "cpu": (1, 3)}  # (warm-up, timed)


def visible_pairs(pieces: list[flash.Piece]) -> int:
    """(query, key) pairs a piece plan computes, per batch row and head: a full piece all of its
    rectangle, a causal or anticausal n x n piece n(n+1)/2."""
    total = 0
    for p in pieces:
        n, m = p.q1 - p.q0, p.k1 - p.k0
        total += n * m if p.mask == "full" else n * (n + 1) // 2
    return total


def layer_flops(tokens: int, pairs: int, s: LayerShape) -> dict[str, float]:
    """Useful FLOPs of one decoder layer's forward and backward (norms, RoPE and elementwise ops
    not counted; a multiply-add is 2 FLOPs):

    - projections: 2 T h (2 Hq d + 2 Hkv d)   (q and o: Hq d wide; k and v: Hkv d)
    - MLP:         2 T 3 h F                  (gate, up, down)
    - attention:   4 P d Hq                   (Q K^T and P V, 2 d each per visible pair; P the
                                               visible (query, key) pairs per head)
    - backward:    2x the matmuls (input and weight gradients), 2.5x attention (dQ, dK, dV, dP
                   plus the recomputed scores: 5 products where the forward has 2).

    T is the tokens this device holds (S/D for a TSP rank, which computes every head group's
    projections for its own tokens and every MLP slice), P from the piece plan of its queries."""
    d = s.head_dim
    matmul = 2 * tokens * s.hidden * (2 * s.heads * d + 2 * s.kv_heads * d) \
        + 2 * tokens * 3 * s.hidden * s.intermediate
    attn = 4 * pairs * d * s.heads
    total = 3 * matmul + 3.5 * attn
    return {"forward": matmul + attn, "backward": 2 * matmul + 2.5 * attn, "total": total,
            "attention_share": 3.5 * attn / total}


# ---------------------------------------------------------------------------------- timing

def time_steps(step: Callable[[], None], device: str, warmup: int, iters: int) -> list[float]:
    """Seconds of each of ``iters`` calls after ``warmup`` untimed ones (CUDA events on a GPU)."""
    for _ in range(warmup):
        step()
    if device == "cuda":
        torch.cuda.synchronize()
    out = []
    for _ in range(iters):
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            step()
            end.record()
            torch.cuda.synchronize()
            out.append(start.elapsed_time(end) / 1000)
        else:
            t0 = time.perf_counter()
            step()
            out.append(time.perf_counter() - t0)
    return out


def speed_checks(part: str, seconds: list[float], flops: dict[str, float], device: str,
                 what: str) -> list[Check]:
    """Median time, TFLOP/s, and the fraction of the GPU's bf16 dense peak when it is known."""
    med = statistics.median(seconds)
    tflops = flops["total"] / med / 1e12
    checks = [measurement(f"{part}.time", med, "s", f"median of {len(seconds)} forward+backward "
                          f"steps of {what}: " + ", ".join(f"{t:.4g}" for t in seconds)),
              measurement(f"{part}.tflops", tflops, "TFLOP/s",
                          f"{flops['total'] / 1e12:.4g} TFLOP per step, attention "
                          f"{flops['attention_share']:.0%} of it (layer_flops)")]
    peak = bf16_peak(torch.cuda.get_device_name(0)) if device == "cuda" else None
    if peak is not None:
        checks.append(measurement(f"{part}.peak_fraction", tflops / peak, "of bf16 peak",
                                  f"{tflops:.1f} / {peak} TFLOP/s"))
    return checks


def fill_allocator(device: str, gib: float = 32.0) -> None:
    """Hand the CUDA caching allocator one large block holding a finite bf16 value (0.01, also
    finite read as float32), so that the 'received' buffers no-op collectives leave untouched
    are mostly finite; freed blocks stay cached and are split for later tensors."""
    if device != "cuda":
        return
    free, _ = torch.cuda.mem_get_info()
    n = int(min(gib * GIB, 0.5 * free)) // 2
    block = torch.full((n,), 0.01, dtype=torch.bfloat16, device="cuda")
    del block


# --------------------------------------------------------------------------------- part (c)

def predict(shape: LayerShape) -> dict[str, Any]:
    """``tsp simulate``'s record for one layer of ``shape.model`` (bf16, no recompute, no
    optimizer) in its own fresh process, as the CLI runs it."""
    from ...plan.simulate import MODELS, SimulationRequest, record_dict, simulate_many

    m = MODELS[shape.model]
    want = (m["hidden_size"], m["num_attention_heads"], m["num_key_value_heads"],
            m["intermediate_size"])
    if want != (shape.hidden, shape.heads, shape.kv_heads, shape.intermediate):
        raise ValueError(f"preset {shape.model!r} has (h, heads, kv heads, F) = {want}, the check "
                         f"runs {shape}")
    req = SimulationRequest("tsp", shape.degree, 1, shape.seq, shape.model, layers=1,
                            recompute="none", optimizer="none", dtype="bfloat16")
    (rec,) = simulate_many([req], jobs=1)
    return record_dict(rec)


def tsp_layer(shape: LayerShape, device: str):
    """The real TSP decoder layer of rank 0 of a fake world of ``shape.degree``, its rotary
    embedding, and the mesh. The fake process group must exist already."""
    from torch.distributed.device_mesh import init_device_mesh
    from transformers import LlamaForCausalLM

    import tsp_core

    from ...plan.simulate import model_config

    config = model_config(shape.model, layers=1, seq=shape.seq)
    config.vocab_size = 512  # the embedding and head are not part of the measured layer
    mesh = tsp_core.TSPMesh(init_device_mesh(device, (1, shape.degree),
                                             mesh_dim_names=("dp", "tsp")), "tsp")
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(config)
    model = tsp_core.parallelize(model.to(torch.bfloat16), mesh).train()
    return model.model.layers[0], model.model.rotary_emb


def run_tsp(device: str, log=print) -> tuple[list[Check], dict[str, Any]]:
    """Part (c); returns its checks and the figures the report's summary needs."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    import tsp_core

    shape = SHAPES[device]
    log(f"(c) TSP decoder layer, rank 0 of D = {shape.degree} (fake process group), on {device}: "
        f"{asdict(shape)}, {shape.local} local tokens, bf16")
    record = predict(shape)  # before the fake world exists: simulate makes its own
    if device == "cuda":
        torch.cuda.set_device(0)  # DeviceMesh picks no device under the fake backend
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=shape.degree)
    try:
        layer, rotary = tsp_layer(shape, device)
        pos = tsp_core.position_ids(shape.seq, 0, shape.degree, device=device)[None]
        gen = torch.Generator(device).manual_seed(1)
        x = torch.randn(1, shape.local, shape.hidden, generator=gen, device=device,
                        dtype=torch.bfloat16).requires_grad_()
        dy = torch.randn(x.shape, generator=gen, device=device, dtype=x.dtype)
        cos, sin = rotary(x, pos)
        out: list[torch.Tensor] = []

        def step() -> None:
            x.grad = None
            y = layer(x, position_embeddings=(cos, sin), position_ids=pos)
            y.backward(dy)
            out[:] = [y.detach()]

        segs = row_segments((shape.seq,), 0, shape.degree, "zigzag")
        pairs = visible_pairs(flash.plan_pieces(segs, shape.seq, True, None))
        flops = layer_flops(shape.local, pairs, shape)
        fill_allocator(device)
        seconds = time_steps(step, device, *ITERS[device])
        checks = speed_checks("c", seconds, flops, device,
                              f"one TSP layer, {shape.local} of {shape.seq} tokens")
        bad = int((~torch.isfinite(out[0])).sum()) + int((~torch.isfinite(x.grad)).sum())
        checks.append(measurement("c.nonfinite", bad, "elements",
                                  "non-finite output and input-gradient elements: buffers the "
                                  "no-op collectives leave uninitialised; timing does not "
                                  "depend on values"))
        checks += memory_checks(layer, step, record, device)
    finally:
        dist.destroy_process_group()
    return checks, {"tflops": checks[1].measured, "shape": asdict(shape), "pairs": pairs,
                    "flops": flops, "simulation": record}


def memory_checks(layer, step: Callable[[], None], record: dict[str, Any],
                  device: str) -> list[Check]:
    """One more step with fresh gradients (as in the simulation's single step), its module
    phases measured and compared with the record's; on CUDA also the absolute peak."""
    phases = PhaseMemory({"attention": layer.self_attn, "mlp": layer.mlp})
    layer.zero_grad(set_to_none=True)
    if device == "cuda":
        torch.cuda.synchronize()
        meter: Any = CudaMeter()
        phases.start(meter)
        base = meter.current()
        step()
        torch.cuda.synchronize()
        phases.stop()
    else:
        meter = LiveBytes()
        with meter:
            phases.start(meter)
            base = 0
            step()
            phases.stop()
    tol = MEMORY_TOL[device]
    checks = []
    for key in PHASES:
        predicted = sum(record["phases"][key].values())
        got = phases.added.get(key)
        if got is None:
            checks.append(Check(f"c.memory.{key}", False, tol, None, "relative error",
                                "the phase's hooks never fired"))
            continue
        checks.append(within(f"c.memory.{key}", abs(got - predicted) / predicted, tol,
                             unit="|measured - predicted| / predicted",
                             note=f"measured {_size(got)}, tsp simulate {_size(predicted)} "
                                  f"(added from the module's start to its peak)",
                             detail={"measured_bytes": got, "predicted_bytes": predicted}))
    checks.append(measurement("c.memory.step_peak", (phases.overall - base) / GIB, "GiB",
                              "peak during one forward+backward above what was allocated before "
                              "it (weights, input, output gradient); "
                              + ("torch.cuda.max_memory_allocated" if device == "cuda" else
                                 "live storages created by ops (LiveBytes)")))
    if device == "cuda":
        checks.append(measurement("c.memory.max_allocated", phases.overall / GIB, "GiB",
                                  "torch.cuda.max_memory_allocated during that step, absolute"))
    return checks


def _size(n: int) -> str:
    return f"{n / GIB:.4g} GiB" if n >= GIB else f"{n / 2**20:.4g} MiB"


# --------------------------------------------------------------------------------- part (d)

def run_hf(device: str, log=print) -> tuple[list[Check], dict[str, Any]]:
    """Part (d): transformers' LlamaDecoderLayer (SDPA, causal, bf16) on the local tokens."""
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

    from ...plan.simulate import model_config

    shape = SHAPES[device]
    T = shape.local
    log(f"(d) Hugging Face LlamaDecoderLayer (sdpa, causal) on {device}: h {shape.hidden}, heads "
        f"{shape.heads}/{shape.kv_heads}, F {shape.intermediate}, {T} tokens, bf16")
    config = model_config(shape.model, layers=1, seq=shape.seq)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    with torch.device(device):
        layer = LlamaDecoderLayer(config, layer_idx=0).to(torch.bfloat16).train()
        rotary = LlamaRotaryEmbedding(config)
    gen = torch.Generator(device).manual_seed(1)
    x = torch.randn(1, T, shape.hidden, generator=gen, device=device,
                    dtype=torch.bfloat16).requires_grad_()
    dy = torch.randn(x.shape, generator=gen, device=device, dtype=x.dtype)
    cos, sin = rotary(x, torch.arange(T, device=device)[None])

    def step() -> None:
        x.grad = None
        layer(x, attention_mask=None, position_embeddings=(cos, sin)).backward(dy)

    flops = layer_flops(T, T * (T + 1) // 2, shape)
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    seconds = time_steps(step, device, *ITERS[device])
    checks = speed_checks("d", seconds, flops, device, f"one HF layer, {T} tokens causal")
    if device == "cuda":
        checks.append(measurement("d.memory.max_allocated", torch.cuda.max_memory_allocated() / GIB,
                                  "GiB", "torch.cuda.max_memory_allocated over the timed steps"))
    return checks, {"tflops": checks[1].measured, "tokens": T, "flops": flops}
