"""A DeepSpeed training job with tsp_deepspeed on a tiny Llama (run with torchrun,
DS_ACCELERATOR=cpu). Each data-parallel replica takes its rows of the global batch. Every rank
writes its losses and DeepSpeed's gradient norm per step (``get_global_grad_norm``, the norm it
clips by) and its optimizer-state bytes (measured by MemTracker) to ``rank<R>.json`` in --out,
and the final full weights it holds (``rank<R>_weights.pt``: each data-parallel replica's own,
gathered over its TSP group, so a replica that diverged shows); rank 0 also ``result.json``.
``--kv-heads 1``: MQA (at tsp 2 and 4 each rank holds a slice of the key/value rows);
``--optimizer sgd``: plain SGD (the update is lr x the clipped gradient); ``--bf16``:
DeepSpeed's ``"bf16": {"enabled": true}`` (it stores the module in bf16);
``--micro-batch N``: rows per data-parallel replica and step (the global batch is N x dp rows);
``--plain``: the same configuration without TSP, for comparison: ``deepspeed.initialize`` of the
unmodified model, every process a data-parallel replica taking its rows by ``dist.get_rank()``,
its final weights the engine's module's own state_dict (no tsp_core call).

One launch runs several cases, one after another in the same processes (a launch costs more
than a case): ``--case NAME=ARGS`` (repeated), each case's ARGS as this job's single-case options,
its files in ``--out/NAME``. Between cases the engine is dropped and DeepSpeed's clipping function
and its process-wide mpu restored (``deepspeed.utils.groups.mpu``: set by an engine given one,
the TSP engines; an engine given none, --plain, would take its groups). A case that measures
memory (MemTracker) should come first."""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys

import torch
import torch.distributed as dist
from torch.distributed._tools.mem_tracker import MemTracker

import tsp_core
import tsp_deepspeed
from tests.support.hf_models import build


def batches(steps: int, rows: int):
    gen = torch.Generator().manual_seed(7)
    return [torch.randint(0, 96, (rows, 24), generator=gen) for _ in range(steps)]


def config(stage: int, optimizer: str = "adamw", lr: float = 1e-3, clip: float = 1.0,
           micro_batch: int = 2, bf16: bool = False) -> dict:
    opt = {"type": "AdamW", "params": {"lr": lr, "weight_decay": 0.01}} if optimizer == "adamw" \
        else {"type": "SGD", "params": {"lr": lr}}
    cfg = {"train_micro_batch_size_per_gpu": micro_batch, "gradient_clipping": clip,
           "optimizer": opt, "zero_optimization": {"stage": stage},
           "zero_allow_untested_optimizer": True}
    return {**cfg, "bf16": {"enabled": True}} if bf16 else cfg


def record_zero0_norms() -> list[float]:
    """Without ZeRO (stage 0, float32) the engine clips with ``deepspeed.runtime.utils
    .clip_grad_norm_`` and keeps no norm (``get_global_grad_norm()`` is None): record what that
    function returns, the norm DeepSpeed clips by."""
    import deepspeed.runtime.engine as ds_engine

    norms: list[float] = []
    clip = ds_engine.clip_grad_norm_

    def recording(*args, **kwargs):
        norm = clip(*args, **kwargs)
        norms.append(float(norm))
        return norm

    ds_engine.clip_grad_norm_ = recording
    return norms


def refuse_dp_shard(tsp: int, kv_heads: int) -> dict:
    """tsp_deepspeed.initialize on a model parallelized with a dp_shard mesh (FSDP2 over data
    parallel): the error, the TSP collectives issued before it and whether the model's parameters
    are still the DTensors parallelize made."""
    from torch.distributed.tensor import DTensor

    mesh = tsp_core.init_mesh(tsp, dp_shard=int(os.environ["WORLD_SIZE"]) // tsp)
    model = tsp_core.parallelize(build("llama", torch.float32, kv_heads=kv_heads), mesh)
    before = {n: p for n, p in model.named_parameters() if isinstance(p, DTensor)}
    message = None
    with tsp_core.comm.track() as stats:
        try:
            tsp_deepspeed.initialize(model=model, config=config(1))
        except ValueError as e:
            message = str(e)
    return {"message": message, "collectives": dict(stats.calls),
            "unchanged": len(before) > 0 and {n: id(p) for n, p in model.named_parameters()}
            == {n: id(p) for n, p in before.items()}}


def case_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser()
    ap.add_argument("--stage", type=int, default=1)
    ap.add_argument("--tsp", type=int, default=2)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--save-at", type=int, default=0)
    ap.add_argument("--resume", default="")
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--optimizer", choices=["adamw", "sgd"], default="adamw")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--clip", type=float, default=1.0)
    ap.add_argument("--micro-batch", type=int, default=2)
    ap.add_argument("--bf16", action="store_true")
    ap.add_argument("--plain", action="store_true",
                    help="without TSP: deepspeed.initialize, data parallel over every process")
    ap.add_argument("--refuse-dp-shard", action="store_true",
                    help="first: a model parallelized with dp_shard, refused (refuse_dp_shard)")
    return ap


def tsp_engine(model, cfg: dict, tsp: int):
    """tsp_deepspeed's engine (the config's "tsp" section works like tsp_size), this rank's
    data-parallel size and rank, how a batch enters it (sharded over the TSP group) and its final
    full weights (the engine's module gathered over the TSP group: a collective every rank calls,
    each keeping the result)."""
    engine, *_ = tsp_deepspeed.initialize(model=model, config={**cfg, "tsp": {"size": tsp}},
                                          model_parameters=model.parameters())
    mesh = tsp_core.get_mesh(engine.module)
    return (engine, (mesh.dp_size, mesh.device_mesh.get_coordinate()[0]),
            lambda batch: tsp_core.shard_batch(batch, mesh),
            lambda: tsp_core.full_state_dict(engine.module))


def plain_engine(model, cfg: dict):
    """DeepSpeed's own engine on the unmodified model, data parallel over every process: the
    batch enters whole, the final weights are its module's (ZeRO 0-2 keep them whole on every
    rank; ZeRO-3 partitions them, refused here)."""
    import deepspeed

    if cfg["zero_optimization"]["stage"] == 3:
        raise ValueError("--plain reads the module's weights whole: ZeRO-3 partitions them")
    engine, *_ = deepspeed.initialize(model=model, config=cfg,
                                      model_parameters=model.parameters())
    return (engine, (dist.get_world_size(), dist.get_rank()), lambda batch: batch,
            lambda: {k: v.detach().clone() for k, v in engine.module.state_dict().items()})


def run_case(a: argparse.Namespace, out: str) -> None:
    """One training run (the options of :func:`case_parser`), its files written to ``out``."""
    import deepspeed.runtime.engine as ds_engine
    from deepspeed.utils import groups

    refusal = refuse_dp_shard(a.tsp, a.kv_heads) if a.refuse_dp_shard else None
    clip_grad_norm, mpu = ds_engine.clip_grad_norm_, groups.mpu
    zero0_norms = record_zero0_norms()
    model = build("llama", torch.float32, kv_heads=a.kv_heads)
    cfg = config(a.stage, a.optimizer, a.lr, a.clip, a.micro_batch, a.bf16)
    # this rank's optimizer state, measured by MemTracker, not by the optimizer's own tensors:
    # what is alive in its category after the first step (ZeRO builds it in initialize)
    tracker = MemTracker()
    tracker.__enter__()
    engine, (dp, dp_rank), inputs, full_weights = plain_engine(model, cfg) if a.plain else \
        tsp_engine(model, cfg, a.tsp)
    rows = a.micro_batch
    data = batches(a.steps, rows * dp)
    first = 0
    if a.resume:
        engine.load_checkpoint(a.resume)
        first = a.save_at
    losses, norms = [], []
    for step in range(first, a.steps):
        ids = data[step][rows * dp_rank: rows * (dp_rank + 1)]
        loss = engine(**inputs({"input_ids": ids, "labels": ids})).loss
        engine.backward(loss)
        engine.step()
        if tracker is not None:
            opt_bytes = sum(v for snap in tracker.get_tracker_snapshot().values()
                            for k, v in snap.items() if getattr(k, "value", k) == "Optstate")
            tracker.__exit__(None, None, None)
            tracker = None
        losses.append(loss.item())
        norm = engine.get_global_grad_norm()
        norms.append(float(zero0_norms[-1] if norm is None else norm))
        if a.save_at and step + 1 == a.save_at and not a.resume:
            engine.save_checkpoint(os.path.join(out, "ckpt"))
    weights = full_weights()
    ds_engine.clip_grad_norm_, groups.mpu = clip_grad_norm, mpu
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, f"rank{dist.get_rank()}.json"), "w") as f:
        json.dump({"losses": losses, "norms": norms, "optimizer_bytes": opt_bytes,
                   "dp_shard_refusal": refusal}, f)
    torch.save(weights, os.path.join(out, f"rank{dist.get_rank()}_weights.pt"))
    if dist.get_rank() == 0:
        with open(os.path.join(out, "result.json"), "w") as f:
            json.dump({"losses": losses, "norms": norms, "optimizer_bytes": opt_bytes}, f)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--case", action="append", required=True, metavar="NAME=ARGS",
                    help="a run: its name (its folder in --out) and its options, space-separated")
    a = ap.parse_args()
    for case in a.case:
        name, _, args = case.partition("=")
        print(f"deepspeed_job: case {name}: {args}", file=sys.stderr, flush=True)
        run_case(case_parser().parse_args(args.split()), os.path.join(a.out, name))
        gc.collect()  # the case's engine and its optimizer state


if __name__ == "__main__":
    main()
