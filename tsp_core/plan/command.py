"""``tsp plan``: detect (or take) the cluster, rank every layout and degree, print the choice."""

from __future__ import annotations

import argparse
import json
import sys

from .cost import GLOBAL_BATCH_TOKENS, plan
from .detect import detect
from .max_seq import HOST_GB, max_seq_main
from .stages import bubble, stage_view, with_pipeline
from .traffic import ModelShape

PAPER = {"tsp_vs_matched_tp_sp": "2.0-2.6x (173M vs 66.3M-86M tokens/s, forward, 1,024 MI300X)"}


def model_shape(name: str, layers: int | None) -> ModelShape:
    """A preset's shape or a ``config.json``'s (``tsp_core.plan.simulate.model_config``)."""
    from .simulate import model_config

    return ModelShape.from_config(model_config(name, layers))


def _shards(text: str) -> tuple[int, ...]:
    try:
        out = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers, got {text!r}") from None
    if not out or min(out) < 1:
        raise argparse.ArgumentTypeError(
            f"dp_shard sizes must be at least 1 (1: no FSDP2), got {text!r}")
    return out


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="7b", help="a preset (7b, qwen3-8b, gemma-2-9b, "
                   "gemma-3-12b, olmo-2-7b, llama-70b, llama-3.1-8b, llama-3.1-70b, "
                   "llama-3.1-405b, mixtral-8x7b, qwen3-30b-a3b, glm-4.5-air, gpt-oss-20b, "
                   "llama-4-scout, qwen3.5, small, tiny) or the path of a config.json")
    p.add_argument("--layers", type=int, default=None,
                   help="override the model's layer count (default: the model's)")
    p.add_argument("--seq", type=int, default=131072, help="tokens per sequence")
    p.add_argument("--batch", type=int, default=1, help="sequences per replica per micro-step")
    p.add_argument("--gpus", type=int, default=None, help="total GPUs (default: detected)")
    p.add_argument("--gpus-per-node", type=int, default=None,
                   help="GPUs per node (default: detected)")
    p.add_argument("--gpu", default=None, help="mi300x | h100 | h200 | a100 (default: detected)")
    p.add_argument("--inter-node-gbps", type=float, default=None, help="Gb/s per GPU between nodes "
                   "(default: the hardware file's, else 400)")
    p.add_argument("--intra-gbps", type=float, default=None,
                   help="GB/s per GPU inside a node (default: the detected link's, else the GPU's)")
    p.add_argument("--memory-gb", type=float, default=None,
                   help="override the GPU's memory (default: detected, else the GPU's)")
    p.add_argument("--hardware", default=None,
                   help="JSON file of overrides (default: $TSP_HARDWARE if set)")
    p.add_argument("--headroom", type=float, default=0.1, help="memory fraction kept free")
    p.add_argument("--global-batch-tokens", type=int, default=GLOBAL_BATCH_TOKENS,
                   help="tokens per optimizer step; replicas beyond it idle")
    p.add_argument("--dp-shard", type=_shards, default=(1,),
                   help="FSDP2 shard sizes to rank too (comma-separated; 1: no FSDP2): each "
                        "rank's model state is sharded over N data-parallel ranks (tsp, tp, tp-sp)")
    p.add_argument("--pp", type=int, default=1,
                   help="pipeline stages (tsp_core.pipeline, 1F1B): each layout ranked for the "
                        "busiest stage on gpus / pp GPUs, with the micro-batches in flight and "
                        "the bubble (docs/pipeline.md)")
    p.add_argument("--microbatches", type=int, default=None,
                   help="--pp: micro-batches per step (default 4 x --pp)")
    p.add_argument("--max-seq", action="store_true",
                   help="instead of ranking at --seq: per layout on every GPU, the longest "
                        "sequence whose step fits the GPU (with --headroom) and --host-gb, found "
                        "with tsp simulate of the whole model (probes at --seq and twice it, then "
                        "the answer checked), and the planner's step time there")
    p.add_argument("--activation-offload", action="store_true",
                   help="--max-seq: each checkpointed layer's input kept in host memory (every "
                        "layout); the host's bytes count against --host-gb")
    p.add_argument("--lora", type=int, default=None, metavar="R",
                   help="--max-seq: PEFT's LoRA of rank R on the seven projections, the base "
                        "frozen (tsp only; default: full fine-tuning)")
    p.add_argument("--qlora", action="store_true",
                   help="--max-seq with --lora: the frozen base's seven projections 4-bit NF4 "
                        "(QLoRA), kept and moved packed")
    p.add_argument("--host-gb", type=float, default=None,
                   help="--max-seq: host memory per node for the offloaded layer inputs, GB "
                        f"(1e9 bytes; default: 1.5 TiB, {HOST_GB:.0f} GB)")
    p.add_argument("--layouts", default=None,
                   help="--max-seq: comma-separated, from tsp, tp, tp-sp, cp, tp+cp, tp-sp+cp "
                        "(default: all)")
    p.add_argument("--jobs", type=int, default=2, help="--max-seq: simulations run in parallel")
    p.add_argument("--top", type=int, default=20, help="rows printed")
    p.add_argument("--json", default=None,
                   help="write the ranking to this file (default: none written)")
    p.set_defaults(func=main)


def detect_cluster(args: argparse.Namespace):
    """The cluster the options describe, the rest detected (:func:`tsp_core.plan.detect.detect`)."""
    from .detect import load_overrides

    per = args.gpus_per_node
    nodes = None
    if args.gpus is not None:
        if per is None:
            raise ValueError("--gpus needs --gpus-per-node")
        if args.gpus % per:
            raise ValueError(f"--gpus ({args.gpus}) must be a multiple of --gpus-per-node ({per})")
        nodes = args.gpus // per
    over = {**load_overrides(args.hardware), **{k: v for k, v in dict(
        gpu=args.gpu, gpus_per_node=per, nodes=nodes, inter_node_gbps=args.inter_node_gbps,
        intra_gbps=args.intra_gbps, memory_gb=args.memory_gb).items() if v is not None}}
    return detect(over)


def main(args: argparse.Namespace) -> int:
    shape = model_shape(args.model, args.layers)
    found = detect_cluster(args)
    cl = found.cluster
    pp, micro = args.pp, args.microbatches or 4 * args.pp
    if pp != 1 and args.max_seq:
        raise ValueError(f"--max-seq ranks whole models; it does not take --pp ({pp})")
    if args.max_seq:
        return max_seq_main(args, shape, found)
    if micro < pp:
        raise ValueError(f"--microbatches ({micro}) must be at least --pp ({pp})")
    stage, stage_cl, stage_layers = stage_view(shape, cl, pp) if pp > 1 else (shape, cl, 0)
    ranked, refused = plan(stage, args.seq, stage_cl, args.batch, headroom=args.headroom,
                           global_batch_tokens=args.global_batch_tokens, dp_shards=args.dp_shard)
    if pp > 1:
        usable = cl.device.memory_bytes * (1 - args.headroom)
        ranked = [with_pipeline(c, stage, args.seq, args.batch, pp, micro, usable,
                                args.global_batch_tokens) for c in ranked]
        ranked.sort(key=lambda c: (not c.fits, -c.tokens_per_s))
    fsdp = any(s > 1 for s in args.dp_shard)
    print(f"cluster: {cl.nodes} x {cl.gpus_per_node} {cl.device.name} "
          f"({cl.device.memory_gb:.0f} GB, intra {cl.intra_gbps or cl.device.intra_gbps:.0f} GB/s, "
          f"inter {cl.inter_node_gbps:.0f} Gb/s per GPU); sources: {found.sources}")
    print(f"model {args.model}: {shape.num_layers} layers, h {shape.hidden_size}; "
          f"{args.seq} tokens x {args.batch}; full recompute, bf16 AdamW; "
          f"global batch {args.global_batch_tokens} tokens"
          + (f"; FSDP2 dp_shard {','.join(map(str, args.dp_shard))}" if fsdp else "")
          + (f"; pipeline {pp} stages on {stage_cl.gpus} GPUs each, the busiest of "
             f"{stage_layers} layers, {micro} micro-batches (1F1B bubble "
             f"{bubble(pp, micro):.1%})" if pp > 1 else ""))
    dp_col = f" {'dp':>3}" if fsdp else ""
    print(f"{'#':>3} {'layout':<15} {'D':>3}{dp_col} {'GiB/GPU':>8} {'fits':>4} {'replicas':>8} "
          f"{'tokens/s':>10} {'step s':>7} {'comm s':>7}  links")
    for i, c in enumerate(ranked[:args.top], 1):
        links = ", ".join(f"{k} {v}" for k, v in c.links.items() if v != "none")
        rep = (f"{c.active_replicas}/{c.replicas}" if c.active_replicas < c.replicas
               else str(c.replicas))
        dp = f" {c.dp_shard:>3}" if fsdp else ""
        fits = "yes" if c.fits else "NO"
        print(f"{i:>3} {c.label:<15} {c.degree:>3}{dp} {c.memory_gib:>8.1f} {fits:>4} "
              f"{rep:>8} {c.tokens_per_s:>10.3g} {c.step_s:>7.2f} {c.exposed_comm_s:>7.2f}  "
              f"{links}")
    for line in refused:
        print(f"cannot run: {line}")
    fitting = [c for c in ranked if c.fits]
    if not fitting:
        smallest = min(ranked, key=lambda c: c.memory_gib) if ranked else None
        raise ValueError("no layout fits: " + (
            f"the smallest per-GPU peak is {smallest.label} at D={smallest.degree}, "
            f"{smallest.memory_gib:.1f} GiB, above "
            f"{cl.device.memory_bytes * (1 - args.headroom) / 2**30:.1f} GiB usable; "
            "shorten the sequence or use larger GPUs" if smallest else
            "no layout can split this model: " + "; ".join(refused)))
    best = fitting[0]
    over = f" (FSDP2 over {best.dp_shard})" if best.dp_shard > 1 else ""
    print(f"choice: {best.label} at D={best.degree} x {best.replicas} replicas{over}: fits "
          f"({best.memory_gib:.1f} GiB), highest predicted tokens/s ({best.tokens_per_s:.3g}); "
          f"{best.exposed_comm_s:.2f} s of {best.step_s:.2f} s per step is exposed communication")
    ratios = {}
    tsp8 = next((c for c in ranked if c.layout == "tsp" and c.degree == cl.gpus_per_node), None)
    dp = tsp8.dp_shard if tsp8 else 1  # compare at the same FSDP2 size
    for _key, match in (("tp+cp(T x S = 2 nodes, best split)", lambda c: c.layout == "tp+cp"
                        and c.degree == 2 * cl.gpus_per_node and c.dp_shard == dp),
                       (f"tp-sp on {cl.gpus_per_node}", lambda c: c.layout == "tp-sp"
                        and c.degree == cl.gpus_per_node and c.dp_shard == dp)):
        other = max((c for c in ranked if match(c)), key=lambda c: c.tokens_per_s, default=None)
        if tsp8 and other:
            fs = f" (both dp_shard {dp})" if dp > 1 else ""
            ratios[f"tsp D={tsp8.degree} vs {other.label} on {other.degree}{fs}"] = \
                tsp8.tokens_per_s / other.tokens_per_s
    for k, v in ratios.items():
        print(f"predicted {k}: {v:.2f}x (paper, matched TP+SP: {PAPER['tsp_vs_matched_tp_sp']})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"cluster": {"gpu": cl.device.name, "gpus_per_node": cl.gpus_per_node,
                                   "nodes": cl.nodes, "inter_node_gbps": cl.inter_node_gbps},
                       "sources": found.sources, "choice": best.as_dict(),
                       "ranking": [c.as_dict() for c in ranked], "cannot_run": refused,
                       "ratios": ratios, "paper": PAPER}, f, indent=1)
    sys.stdout.flush()
    return 0
