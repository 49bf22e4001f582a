"""The tsp command: measure and plan folded tensor-and-sequence parallelism (TSP) next to
tensor, sequence and context parallelism on the same model.

  tsp simulate  per-rank memory of every layout under fake tensors (no GPU, no download)
  tsp bench     real multi-process training or generation runs of every layout: time, memory
                and bytes sent
  tsp plan      the cost model's ranking of layouts and degrees for a cluster, and its choice

`tsp COMMAND --help` lists a command's options with their defaults."""

from __future__ import annotations

import argparse
import json
import sys
import textwrap
import time
from typing import Any

GIB = 1024 ** 3
# what the commands import that the base install (torch) lacks -> the extra that installs it
EXTRAS = {"transformers": "transformers", "safetensors": "transformers", "matplotlib": "bench"}


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Keeps a description's line breaks and ends every option's help with its default. A default
    of None means "not given": such an option's help says in words what happens then."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if (not action.option_strings or action.default in (None, argparse.SUPPRESS)
                or "default" in text):
            return text
        default = action.default
        shown = ",".join(map(str, default)) if isinstance(default, tuple) else str(default)
        return f"{text} (default: {shown.replace('%', '%%')})"


def _ints(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers, got {text!r}") from None


def _write_json(path: str, data) -> None:
    with open(path, "w") as f:
        json.dump(data, f, indent=1)


def in_flight_bytes(record, hidden: int, pp: int, microbatches: int) -> int:
    """What 1F1B's first stage holds beyond one simulated micro-batch: the checkpointed layer
    inputs of ``min(M, P) - 1`` more micro-batches, one residual-stream tensor per layer each
    (this layout's tokens per rank x h, in the record's dtype)."""
    from ..baselines.layouts import LayoutSpec
    from ..plan.memory import tokens

    n_r, _ = tokens(LayoutSpec(record.name, record.tp, record.cp), record.seq, record.batch)
    size = torch_dtype_size(record.dtype)
    return int((min(microbatches, pp) - 1) * record.layers * n_r * hidden * size)


def torch_dtype_size(name: str) -> int:
    import torch

    return getattr(torch, name).itemsize


def simulation_requests(args: argparse.Namespace) -> tuple[Any, list]:
    """The model config and the simulation requests that ``tsp simulate ARGS`` runs, each
    checked before any process starts (``SystemExit`` or ``ValueError`` naming the numbers).
    Fills in what the options leave to it: ``args.layers`` with ``--pp``, ``args.microbatches``
    and ``args.layouts``."""
    from ..baselines import parse_layouts
    from ..plan.fsdp_sim import FSDP_LAYOUTS, check_dp_shard
    from ..plan.simulate import SimulationRequest, check_request, model_config

    pp = args.pp
    args.microbatches = micro = args.microbatches or 4 * pp
    if pp > 1:  # before any process starts
        from ..pipeline.split import balanced_split, split_layers

        if args.layers is not None or args.activation_offload or micro < pp:
            raise SystemExit(f"--pp ({pp}) simulates the busiest stage of the whole model: pass "
                             f"no --layers ({args.layers}) and no --activation-offload, and "
                             f"--microbatches ({micro}) at least --pp")
        try:
            total = model_config(args.model, None).num_hidden_layers
            split_layers(total, pp, balanced_split(total, pp))
        except (ValueError, OSError) as e:
            raise SystemExit(str(e)) from e
        args.layers = max(balanced_split(total, pp))
    try:
        config = model_config(args.model, args.layers)
    except (ValueError, OSError) as e:
        raise SystemExit(str(e)) from e
    if args.layouts is None:  # with FSDP2, the layouts it is simulated for
        fsdp = any(dp > 1 for dp in args.dp_shard)
        args.layouts = ",".join(FSDP_LAYOUTS) if fsdp else "tsp,tp,tp-sp,cp,tp+cp,tp-sp+cp"
        if args.lora is not None:  # only TSP takes a PeftModel (tsp_core.plan.lora_sim)
            args.layouts = "tsp"
    offload = args.activation_offload
    # tiles are TSP's (the baselines' MLP and loss are Hugging Face's, untiled)
    requests = [SimulationRequest(s.name, s.tp, s.cp, seq, args.model, args.layers, args.batch,
                                  args.recompute, args.optimizer, args.dtype, dp,
                                  args.tile_tokens if s.name == "tsp" else None, offload,
                                  args.step, args.lora, args.qlora)
                for degree in args.degree for seq in args.seq
                for s in parse_layouts(args.layouts, degree) for dp in args.dp_shard]
    for r in requests:  # before any process starts
        check_dp_shard(r.layout, r.tp * r.cp, r.dp_shard)
        check_request(r)
    return config, requests


def simulate_main(args: argparse.Namespace) -> int:
    from ..models.reading import config_shape  # Gemma 4's heads differ per layer
    from ..plan.fsdp_sim import FSDP_WORKING_SET
    from ..plan.simulate import record_dict, simulate_many

    config, requests = simulation_requests(args)
    pp, micro, fsdp = args.pp, args.microbatches, any(dp > 1 for dp in args.dp_shard)
    offload, grpo = args.activation_offload, args.step == "grpo"

    print(f"model {args.model}: {config.num_hidden_layers} layers, hidden {config.hidden_size}, "
          f"heads {config.num_attention_heads}/{config_shape(config)[1]}, intermediate "
          f"{config.intermediate_size}, vocab {config.vocab_size}, {args.dtype}; batch "
          f"{args.batch}; recompute {args.recompute}; optimizer {args.optimizer}; "
          + (f"FSDP2 dp_shard {','.join(map(str, args.dp_shard))}; " if fsdp else "")
          + ("activation offload (every layout; host bytes apart); " if offload else "")
          + (f"LoRA r={args.lora} on the seven projections, base frozen"
             + (" and 4-bit NF4 (QLoRA)" if args.qlora else "") + "; " if args.lora else "")
          + ("one GRPO step (policy + reference resident, reference's no-grad forward; rollout "
             "computed: resident state + KV cache); " if grpo else "")
          + f"tsp tiles {args.tile_tokens or 'from the sizes'} (the baselines' MLP and loss are "
          f"untiled); "
          + f"rank 0 of each world under FakeTensorMode ({len(requests)} runs, {args.jobs} at a "
          f"time)",
          file=sys.stderr, flush=True)
    kinds = ["parameters", "gradients", "optimizer_states", "activations", "temporaries"]
    # with FSDP2: the dp_shard size, the GPUs of one sharded group (D x dp_shard) and FSDP2's
    # working set (unsharded parameters and gradients, all-gather / reduce-scatter buffers)
    extra = " ".join(f"{k:>{w}}" for k, w in (("dp", 3), ("GPUs", 5))) + " " if fsdp else ""
    host = f"{'host GiB':>9} " if offload else ""  # per rank, apart from the GPU's peak
    # GRPO: the reference's parameters (inside "parameters") and the rollout's peak (computed)
    rl = f" {'reference':>11} {'rollout*':>9}" if grpo else ""
    head = (f"{'layout':<15} {'seq':>7} {'D':>3} {extra}{'peak GiB':>9} {host}"
            + " ".join(f"{k[:11]:>11}" for k in kinds) + (f" {'fsdp':>11}" if fsdp else "")
            + (f" {'in flight':>9} {'pp peak':>9}" if pp > 1 else "") + rl)
    start = time.perf_counter()

    def row(r) -> str:
        more = f"{r.dp_shard:>3} {r.gpus:>5} " if fsdp else ""
        fsdp_bytes = sum(r.breakdown.get(k, 0) for k in FSDP_WORKING_SET)
        on_host = f"{r.host_gib:>9.2f} " if offload else ""
        flight = in_flight_bytes(r, config.hidden_size, pp, micro) if pp > 1 else 0
        return (f"{r.layout:<15} {r.seq:>7} {r.degree:>3} {more}{r.peak_gib:>9.2f} {on_host}"
                + " ".join(f"{r.breakdown.get(k, 0) / GIB:>11.2f}" for k in kinds)
                + (f" {fsdp_bytes / GIB:>11.2f}" if fsdp else "")
                + (f" {flight / GIB:>9.2f} {(r.peak_bytes + flight) / GIB:>9.2f}" if pp > 1
                   else "")
                + (f" {r.reference_bytes / GIB:>11.2f} {r.rollout_bytes / GIB:>9.2f}" if grpo
                   else ""))

    done = [0]

    def progress(r) -> None:
        done[0] += 1
        print(f"[{done[0]}/{len(requests)} {time.perf_counter() - start:.0f}s] {row(r)} "
              f"({r.seconds:.0f}s)", file=sys.stderr, flush=True)

    records = simulate_many(requests, args.jobs, progress)
    print(head)
    for r in records:
        print(row(r))
    if grpo:
        print("rollout*: computed, not simulated: the step's resident parameters (policy and "
              "reference), buffers and optimizer states plus the KV cache of every row at full "
              "length")
    if args.json:
        _write_json(args.json, [record_dict(r) for r in records])
    return 0


def bench_main(args: argparse.Namespace) -> int:
    if args.compile and args.mode != "train":
        raise ValueError("--compile measures training steps: leave --mode at train")
    if args.compile:
        return bench_compile_main(args)
    args.steps = 4 if args.steps is None else args.steps
    args.warmup = 1 if args.warmup is None else args.warmup
    if args.mode == "generate":
        return bench_generate_main(args)
    from . import bench

    layouts = args.layouts or "tsp,tp,tp-sp,cp,tp+cp"
    cfg = bench.BenchConfig(layouts, args.degree, args.seq, args.model, args.batch,
                            args.steps, args.warmup, args.dtype)
    print(f"bench: {cfg}", file=sys.stderr, flush=True)
    print(bench.HEADER, file=sys.stderr, flush=True)
    records = bench.run(cfg, progress=lambda line: print(line, file=sys.stderr, flush=True))
    print(bench.table(records))
    if args.json:
        _write_json(args.json, bench.to_json(records, cfg))
    if args.plot:
        bench.plot(records, args.plot)
    return 0


def bench_compile_main(args: argparse.Namespace) -> int:
    from . import bench_compile as bc

    if len(args.seq) != 1 or args.plot:
        raise ValueError(f"--compile runs one sequence length (got --seq "
                         f"{','.join(map(str, args.seq))}) and writes no plot")
    cfg = bc.CompileBenchConfig(args.layouts or bc.DEFAULT_LAYOUTS, args.degree, args.seq[0],
                                args.model, args.batch, 5 if args.steps is None else args.steps,
                                2 if args.warmup is None else args.warmup, args.dtype,
                                args.compile_backend)
    print(f"bench --compile: {cfg}", file=sys.stderr, flush=True)
    print(bc.HEADER, file=sys.stderr, flush=True)
    records = bc.run(cfg, progress=lambda line: print(line, file=sys.stderr, flush=True))
    print(bc.table(records))
    if args.json:
        _write_json(args.json, bc.to_json(records, cfg))
    return 0


def bench_generate_main(args: argparse.Namespace) -> int:
    from . import bench_generate as bg

    if args.plot:
        raise ValueError("--plot is for --mode train")
    cfg = bg.GenerateBenchConfig(args.layouts or "tsp,tp,single", args.degree, args.seq,
                                 args.new_tokens, args.model, args.batch, args.steps, args.dtype)
    print(f"bench generate: {cfg}", file=sys.stderr, flush=True)
    print(bg.HEADER, file=sys.stderr, flush=True)
    records = bg.run(cfg, progress=lambda line: print(line, file=sys.stderr, flush=True))
    print(bg.table(records))
    if args.json:
        _write_json(args.json, bg.to_json(records, cfg))
    return 0


def parser() -> argparse.ArgumentParser:
    from .. import __version__
    from ..baselines import LAYOUTS

    ap = argparse.ArgumentParser(prog="tsp", description=__doc__, formatter_class=HelpFormatter)
    ap.add_argument("--version", action="version", version=f"tsp {__version__}")
    sub = ap.add_subparsers(dest="command", required=True)
    layouts_help = f"comma-separated, from {', '.join(LAYOUTS)}"

    def command(name: str, summary: str) -> argparse.ArgumentParser:
        return sub.add_parser(name, help=summary, description=textwrap.fill(summary, 79),
                              formatter_class=HelpFormatter)

    sim = command("simulate", "per-rank memory of each layout under fake tensors: parameters, "
                  "gradients, optimizer states, activations and temporaries of rank 0 of each "
                  "world (no GPU needed)")
    sim.add_argument("--model", default="7b", help="a preset (7b, qwen3-8b, gemma-2-9b, "
                     "gemma-3-12b, olmo-2-7b, llama-70b, llama-3.1-8b, llama-3.1-70b, "
                     "llama-3.1-405b, mixtral-8x7b, qwen3-30b-a3b, glm-4.5-air, gpt-oss-20b, "
                     "llama-4-scout, qwen3.5, small, tiny) or the path of a "
                     "config.json (any supported family)")
    sim.add_argument("--layers", type=int, default=None,
                     help="override the model's layer count (default: the model's)")
    sim.add_argument("--seq", type=_ints, default=(131072,),
                     help="sequence lengths (comma-separated)")
    sim.add_argument("--degree", type=_ints, default=(8,),
                     help="ranks per model replica (comma-separated)")
    sim.add_argument("--layouts", default=None,
                     help=f"{layouts_help} (default all; with --dp-shard > 1: tsp, tp, tp-sp)")
    sim.add_argument("--dp-shard", type=_ints, default=(1,),
                     help="FSDP2 shard sizes: the model state of each rank is sharded over N "
                          "data-parallel ranks, world = degree x N (1: no FSDP2; > 1 for tsp, tp, "
                          "tp-sp)")
    sim.add_argument("--activation-offload", action="store_true",
                     help="keep each checkpointed layer's input in host memory (every layout; "
                          "needs --recompute full or selective); the host's bytes per rank are "
                          "reported apart from the GPU's peak")
    sim.add_argument("--step", default="train", choices=["train", "grpo"],
                     help="train: one training step; grpo: one GRPO step: the policy's step "
                          "through GRPO's per-token loss with a reference model of the same shape "
                          "resident (laid out like the policy) and its no-grad forward; the "
                          "rollout's peak is computed beside it (not with --dp-shard > 1)")
    sim.add_argument("--lora", type=int, default=None, metavar="R",
                     help="PEFT's LoRA of rank R on the seven projections (q, k, v, o, gate, up, "
                          "down), the base frozen: gradients and AdamW moments of the adapters "
                          "alone (tsp only: the baselines' tensor-parallel styles cannot take a "
                          "PeftModel; default: full fine-tuning)")
    sim.add_argument("--qlora", action="store_true",
                     help="with --lora: the frozen base's seven projections 4-bit NF4 (QLoRA: "
                          "BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=\"nf4\")), "
                          "each rank's shard kept and moved packed, dequantized per round; "
                          "embeddings, norms and the LM head stay in --dtype")
    sim.add_argument("--tile-tokens", type=int, default=None,
                     help="tokens per tile of TSP's MLP, experts and loss (default: chosen from "
                          "the model's sizes; the baselines' are not tiled)")
    sim.add_argument("--pp", type=int, default=1,
                     help="pipeline stages (tsp_core.pipeline, 1F1B): simulate the busiest stage "
                          "(its decoder layers, with the embedding and the head) and add the "
                          "layer inputs of the micro-batches in flight on the first stage")
    sim.add_argument("--microbatches", type=int, default=None,
                     help="--pp: micro-batches per step (default 4 x --pp)")
    sim.add_argument("--batch", type=int, default=1, help="sequences per replica")
    sim.add_argument("--recompute", default="full", choices=["none", "selective", "full"],
                     help="activation recomputation")
    sim.add_argument("--optimizer", default="adamw", choices=["adamw", "none"],
                     help="optimizer states counted")
    sim.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"],
                     help="parameter and activation dtype")
    sim.add_argument("--jobs", type=int, default=2, help="simulations run in parallel")
    sim.add_argument("--json", default=None,
                     help="write the records to this file (default: none written)")
    sim.set_defaults(func=simulate_main)

    b = command("bench", "real multi-process runs of each layout on this machine's devices: "
                "seconds per step, tokens/s, peak memory and bytes sent per layer")
    b.add_argument("--mode", default="train", choices=["train", "generate"],
                   help="train: training steps; generate: prefill + greedy decode (--seq is the "
                        "prompt length, --steps the timed repeats)")
    b.add_argument("--layouts", default=None,
                   help=f"{layouts_help} (default tsp,tp,tp-sp,cp,tp+cp); with --mode generate "
                        f"from tsp, tp, single (default all three)")
    b.add_argument("--new-tokens", type=int, default=32, help="--mode generate: tokens per prompt")
    b.add_argument("--degree", type=int, default=2, help="processes (ranks per replica)")
    b.add_argument("--seq", type=_ints, default=(2048,), help="sequence lengths")
    b.add_argument("--model", default="tiny", help="tiny | small (Llama family)")
    b.add_argument("--batch", type=int, default=1, help="sequences per replica")
    b.add_argument("--steps", type=int, default=None,
                   help="timed steps after warm-up (default 4; 5 with --compile)")
    b.add_argument("--warmup", type=int, default=None,
                   help="untimed steps first (default 1; 2 with --compile, the first compiles)")
    b.add_argument("--compile", action="store_true",
                   help="each layout eager and with every decoder layer compiled "
                        "(torch.compile fullgraph, the same unit for every layout): tokens/s, "
                        "compile seconds, the losses side by side (layouts tsp,tp-sp unless "
                        "--layouts; one --seq)")
    b.add_argument("--compile-backend", default="inductor",
                   help="torch.compile backend for --compile (aot_eager traces and splits the "
                        "same graphs without code generation)")
    b.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float64"],
                   help="parameter and activation dtype")
    b.add_argument("--json", default=None,
                   help="write the records to this file (default: none written)")
    b.add_argument("--plot", default=None,
                   help="write a PNG of memory and tokens/s vs seq (default: none written)")
    b.set_defaults(func=bench_main)

    from ..plan.command import add_arguments as plan_arguments

    plan_arguments(command("plan", "rank layouts and degrees for a cluster with the cost model "
                           "(detected here, or described by the options) and print the choice"))
    return ap


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        return args.func(args)
    except ValueError as e:  # bad requests: one line, no traceback
        print(f"tsp {args.command}: error: {e}", file=sys.stderr)
        return 2
    except ModuleNotFoundError as e:  # an extra that is not installed
        missing = (e.name or "").split(".")[0]
        if missing not in EXTRAS:
            raise
        print(f"tsp {args.command}: error: it needs {missing}, which is not installed: "
              f"pip install 'tsp-parallel[{EXTRAS[missing]}]'", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
