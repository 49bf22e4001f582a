"""Part (f): one decoder layer of Llama-3-8B's shape, TSP at tsp 1, eager and compiled
(``tsp_core.parallelize(..., compile=)``: ``torch.compile(fullgraph=True)`` on the layer): tokens/s,
peak memory, and the same loss.

At tsp 1 every TSP code path of the layer still runs (its attention schedule over flash pieces,
the ring MLP, the traced collectives as ordered ops), in a world of one process (NCCL on CUDA,
gloo on CPU), so the two runs see real values and their losses can be compared. The part runs in
its own process, as (c) and (d) do: a compile's caches and the allocator's state stay there.
"""

from __future__ import annotations

import copy
import statistics
from dataclasses import dataclass
from typing import Any

import torch

from .common import Check, measurement, rel_err, within
from .layer_part import time_steps

GIB = 2 ** 30


@dataclass(frozen=True)
class CompileShape:
    hidden: int
    heads: int
    kv_heads: int
    intermediate: int
    tokens: int
    dtype: str
    backend: str


# CUDA: Llama-3-8B's layer (h 4096, 32 query / 8 key-value heads, F 14336) on 16384 tokens
# (a 131072-token sequence over 8 ranks), bf16, inductor. CPU: a tiny layer through aot_eager
# (AOT autograd's forward/backward split without code generation: exact), seconds on 2 cores.
SHAPES = {"cuda": CompileShape(4096, 32, 8, 14336, 16384, "bfloat16", "inductor"),
          "cpu": CompileShape(64, 4, 2, 128, 64, "float32", "aot_eager")}
ITERS = {"cuda": (2, 5), "cpu": (1, 2)}  # (warm-up, timed); the first warm-up step compiles
# |compiled loss - eager loss| / eager loss, the loss being mean(y^2) over the layer's output.
# bf16: inductor fuses the elementwise ops and rounds once where eager rounds after each op; a
# one-ulp (2^-8 = 0.4%) shift of every output would move the mean of squares by 0.8%, so 1e-2
# allows that and no more. float32 on CPU with aot_eager runs the same kernels: 1e-6.
LOSS_TOL = {"bfloat16": 1e-2, "float32": 1e-6}


def layer_and_inputs(shape: CompileShape, device: str):
    """A one-layer Llama of ``shape``, its rotary embedding, an input and its positions."""
    from transformers import LlamaConfig, LlamaForCausalLM

    dtype = getattr(torch, shape.dtype)
    config = LlamaConfig(vocab_size=512, hidden_size=shape.hidden,
                         intermediate_size=shape.intermediate, num_hidden_layers=1,
                         num_attention_heads=shape.heads, num_key_value_heads=shape.kv_heads,
                         max_position_embeddings=max(4096, shape.tokens))
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(config).to(dtype)
    gen = torch.Generator(device).manual_seed(1)
    x = torch.randn(1, shape.tokens, shape.hidden, generator=gen, device=device, dtype=dtype)
    pos = torch.arange(shape.tokens, device=device)[None]
    return model, x, pos


def run_mode(model, x: torch.Tensor, pos: torch.Tensor, compile: bool | str, device: str,
             mesh) -> dict[str, Any]:
    """``parallelize`` a copy of ``model`` (compiled or not) and time its layer's forward and
    backward; the loss, the input gradient, the step times and (CUDA) the peak memory."""
    import tsp_core

    tsp = tsp_core.parallelize(copy.deepcopy(model), mesh, compile=compile).train()
    layer, rotary = tsp.model.layers[0], tsp.model.rotary_emb
    x = x.detach().clone().requires_grad_()
    cos, sin = rotary(x, pos)
    out: dict[str, Any] = {}

    def step() -> None:
        x.grad = None
        y = layer(x, position_embeddings=(cos, sin), position_ids=pos)
        loss = y.float().pow(2).mean()
        loss.backward()
        out["loss"], out["grad"] = loss.item(), x.grad.detach().clone()

    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    warmup, timed = ITERS[device]
    first = time_steps(step, device, 0, 1)[0]  # a compiled layer compiles here
    seconds = time_steps(step, device, warmup - 1, timed)
    out.update(first=first, seconds=seconds, tokens_per_s=x.shape[1] / statistics.median(seconds))
    if device == "cuda":
        out["peak"] = torch.cuda.max_memory_allocated()
    return out


def run(device: str, log=print, backend: str | bool | None = None
        ) -> tuple[list[Check], dict[str, Any]]:
    """Part (f); returns its checks and figures. ``backend`` (default: the device's) False runs
    the comparison with both sides eager: the harness without a compile's cost."""
    import torch._dynamo as dynamo

    from .model_part import one_process_world

    shape = SHAPES[device]
    backend = shape.backend if backend is None else backend
    log(f"(f) TSP decoder layer at tsp 1, eager and compiled ({backend}) on {device}: "
        f"{shape}")
    with one_process_world(device) as mesh:
        model, x, pos = layer_and_inputs(shape, device)
        eager = run_mode(model, x, pos, False, device, mesh)
        if device == "cuda":
            torch.cuda.empty_cache()
        dynamo.reset()
        dynamo.utils.counters.clear()
        compiled = run_mode(model, x, pos, backend, device, mesh)
        graphs = int(dynamo.utils.counters["stats"]["unique_graphs"])
    checks = speed_checks(eager, compiled, shape.tokens, backend, graphs)
    loss_err = abs(compiled["loss"] - eager["loss"]) / abs(eager["loss"])
    checks.append(within("f.loss", loss_err, LOSS_TOL[shape.dtype],
                         unit="|compiled - eager| / eager",
                         note=f"mean(y^2) of the layer's output: compiled {compiled['loss']:.7g}, "
                              f"eager {eager['loss']:.7g}"))
    checks.append(measurement("f.input_grad", rel_err(compiled["grad"], eager["grad"]),
                              "max |d| / max |eager|",
                              "the layer input's gradient, compiled against eager"))
    if device == "cuda":
        for mode, res in (("eager", eager), ("compiled", compiled)):
            checks.append(measurement(f"f.{mode}.peak", res["peak"] / GIB, "GiB",
                                      "torch.cuda.max_memory_allocated over its steps (the "
                                      "weights, the input and its gradient included)"))
    return checks, {"eager_tokens_per_s": eager["tokens_per_s"],
                    "compiled_tokens_per_s": compiled["tokens_per_s"], "graphs": graphs}


def speed_checks(eager: dict[str, Any], compiled: dict[str, Any], tokens: int,
                 backend: str | bool, graphs: int) -> list[Check]:
    def times(res: dict[str, Any]) -> str:
        return ", ".join(f"{t:.4g}" for t in res["seconds"])

    compile_s = compiled["first"] - statistics.median(compiled["seconds"])
    return [
        measurement("f.eager.tokens_per_s", eager["tokens_per_s"], "tokens/s",
                    f"{tokens} tokens / median forward+backward step: {times(eager)} s"),
        measurement("f.compiled.tokens_per_s", compiled["tokens_per_s"], "tokens/s",
                    f"{backend}, {graphs} graph(s), fullgraph: {times(compiled)} s"),
        measurement("f.ratio", compiled["tokens_per_s"] / eager["tokens_per_s"], "x",
                    "compiled tokens/s over eager's"),
        measurement("f.compile_seconds", compile_s, "s",
                    f"first compiled step ({compiled['first']:.3g} s) less the median compiled "
                    f"step: dynamo, AOT autograd and (inductor) code generation, forward and "
                    f"backward"),
    ]
