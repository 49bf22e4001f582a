"""The command line: run the parts, write the JSON and the markdown report, exit 1 on a failure.

Parts (a), (b) and (e) run in this process, one after the other ((b) and (e) each create and
destroy their own one-process world); (c), (d) and (f) each run in a fresh
``python -m tsp_core.tools.gpu_check --worker`` process, because (c) needs the ``fake``
backend's 8-rank world, which cannot share a process with (b)'s or (e)'s real one, a part's
timing and memory should not inherit another's allocator state, and (f)'s compiled graphs and
dynamo settings should stay in its own process.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from typing import Any

import torch

from .common import (
    Check,
    device_info,
    failure,
    from_json,
    markdown,
    measurement,
    to_json,
    write_json,
)

PARTS = ("a", "b", "c", "d", "e", "f")
WORKER_PARTS = ("c", "d", "f")
# the whole CUDA run must fit in 8 minutes of a lent GPU: (a), (b) and (e) take well under one
# each (an estimate for (e): 10 steps of 4 layers at 16384 tokens, 24 of an MLP or the loss),
# then each worker at most 3 (their own estimate: under a minute each, docs/gpu.md "Status";
# (f) one to two: an inductor compile of one layer's forward and backward, then 14 steps)
WORKER_TIMEOUT = {"cuda": 180, "cpu": 240}


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m tsp_core.tools.gpu_check", description=(
        "Prove tsp_core's CUDA path on a GPU and measure it; --device cpu runs the same checks "
        "at small shapes (docs/gpu.md)."))
    ap.add_argument("--device", choices=["cuda", "cpu"], default=None,
                    help="default: cuda (an error if there is none)")
    ap.add_argument("--out", default=None, help=(
        "folder for gpu-check.json and gpu-check.md (created if missing; --json and --report "
        "still name other files)"))
    ap.add_argument("--json", default=None,
                    help="results (default gpu-check.json, in --out if given)")
    ap.add_argument("--report", default=None,
                    help="markdown report (default: the JSON's name with .md)")
    ap.add_argument("--parts", default=",".join(PARTS),
                    help=f"comma-separated subset of {','.join(PARTS)}")
    ap.add_argument("--worker", choices=WORKER_PARTS, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.json is None:
        args.json = os.path.join(args.out or "", "gpu-check.json")
    if args.device is None:
        if not torch.cuda.is_available():
            ap.error("no CUDA device is visible; pass --device cpu to run the same checks on CPU "
                     "at small shapes")
        args.device = "cuda"
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error(f"--device cuda, but torch {torch.__version__} sees no CUDA device")
    args.parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    unknown = sorted(set(args.parts) - set(PARTS))
    if unknown:
        ap.error(f"unknown parts {unknown}; choose from {','.join(PARTS)}")
    return args


def worker(part: str, device: str, out: str) -> int:
    """Run (c), (d) or (f) here and write its checks and figures to ``out``."""
    from . import compile_part, layer_part

    fn = {"c": layer_part.run_tsp, "d": layer_part.run_hf, "f": compile_part.run}[part]
    try:
        checks, figures = fn(device)
    except Exception as e:  # noqa: BLE001 - reported as a failed check
        import traceback

        traceback.print_exc()
        checks, figures = [failure(f"{part}.error", e)], {}
    write_json(out, {"checks": to_json(checks), "figures": figures})
    return 0


def guarded(part: str, fn, device: str) -> list[Check]:
    """An in-process part's checks; if the part itself raises, one failed check naming it."""
    try:
        return fn(device)
    except Exception as e:  # noqa: BLE001 - reported, the other parts still run
        import traceback

        traceback.print_exc()
        return [failure(f"{part}.error", e)]


def run_worker(part: str, device: str) -> tuple[list[Check], dict[str, Any]]:
    """Part ``part`` in a fresh process; a crash or a timeout is one failed check."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, f"{part}.json")
        cmd = [sys.executable, "-m", "tsp_core.tools.gpu_check", "--worker", part, "--device",
               device, "--json", out]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True,
                                  timeout=WORKER_TIMEOUT[device])
        except subprocess.TimeoutExpired:
            return [failure(f"{part}.worker", f"no result within {WORKER_TIMEOUT[device]} s")], {}
        sys.stdout.write(proc.stdout)
        if proc.returncode != 0 or not os.path.exists(out):
            sys.stdout.write(proc.stderr[-4000:])
            tail = " | ".join(proc.stderr.strip().splitlines()[-3:])
            return [failure(f"{part}.worker", f"exit {proc.returncode}: {tail}")], {}
        with open(out) as f:
            data = json.load(f)
    return from_json(data["checks"]), data["figures"]


def run_parts(args: argparse.Namespace) -> tuple[list[Check], dict[str, Any]]:
    from . import compile_part, flash_part, layer_part, long_context_part, model_part

    checks: list[Check] = []
    config: dict[str, Any] = {}
    if "a" in args.parts:
        config["a"] = dict(flash_part.shapes(args.device),
                           dtypes=flash_part.supported_dtypes(args.device))
        checks += guarded("a", flash_part.run, args.device)
    if "b" in args.parts:
        config["b"] = ("Llama h=128, 4/2 heads, F=256, 2 layers, vocab 128; "
                       f"{model_part.STEPS} SGD steps lr {model_part.LR} on 2 x 64 tokens; "
                       f"{model_part.NEW_TOKENS} greedy tokens; dtypes {model_part.DTYPES}; "
                       f"training also {model_part.MIXED_FP16} (float32 weights, fp16 autocast, "
                       f"GradScaler)")
        checks += guarded("b", model_part.run, args.device)
        if args.device == "cuda":
            torch.cuda.empty_cache()
    if "e" in args.parts:
        config["e"] = dict(asdict(long_context_part.SHAPES[args.device]),
                           dtype=str(long_context_part.DTYPE[args.device]).split(".")[-1],
                           exactness="float32 at the cpu shape",
                           warmup_timed=long_context_part.ITERS[args.device])
        checks += guarded("e", long_context_part.run, args.device)
        if args.device == "cuda":
            torch.cuda.empty_cache()
    figures = {}
    for part in ("c", "d"):
        if part in args.parts:
            shape = layer_part.SHAPES[args.device]
            config[part] = dict(asdict(shape), local_tokens=shape.local,
                                warmup_timed=layer_part.ITERS[args.device])
            part_checks, figures[part] = run_worker(part, args.device)
            checks += part_checks
    tc, td = (figures.get(p, {}).get("tflops") for p in ("c", "d"))
    if tc and td:
        checks.append(measurement("summary.c_vs_d", tc / td, "x",
                                  f"(c)'s TFLOP/s over (d)'s: {tc:.4g} / {td:.4g}"))
    if "f" in args.parts:
        config["f"] = dict(asdict(compile_part.SHAPES[args.device]),
                           warmup_timed=compile_part.ITERS[args.device],
                           loss_tolerance=compile_part.LOSS_TOL[
                               compile_part.SHAPES[args.device].dtype])
        part_checks, figures["f"] = run_worker("f", args.device)
        checks += part_checks
    if figures.get("c", {}).get("simulation"):
        config["simulation"] = {k: v for k, v in figures["c"]["simulation"].items()
                                if k in ("peak_bytes", "phases", "seconds")}
    return checks, config


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.worker:
        return worker(args.worker, args.device, args.json)
    start = time.perf_counter()
    info = device_info(args.device)
    print(f"gpu-check on {info['name']} ({args.device}), torch {info['torch']}, parts "
          f"{','.join(args.parts)}", flush=True)
    checks, config = run_parts(args)
    failed = [c for c in checks if not c.ok]
    data = {"device": info, "parts": args.parts, "config": config, "checks": to_json(checks),
            "summary": {"checks": len(checks), "failed": len(failed),
                        "seconds": time.perf_counter() - start}}
    report = args.report or os.path.splitext(args.json)[0] + ".md"
    for path in (args.json, report):
        if os.path.dirname(path):
            os.makedirs(os.path.dirname(path), exist_ok=True)
    write_json(args.json, data)
    with open(report, "w") as f:
        f.write(markdown(data))
    print()
    for c in checks:
        print(c.line())
    print(f"\n{len(checks) - len(failed)} of {len(checks)} checks passed in "
          f"{data['summary']['seconds']:.1f} s; wrote {args.json} and {report}")
    return 1 if failed else 0
