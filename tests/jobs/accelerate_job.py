"""An ordinary Accelerate training script with gradient clipping, for TSPAccelerator's plain and
DeepSpeed paths.

    TSP_SIZE=2 accelerate launch --multi_gpu --num_processes 4 accelerate_job.py ...  (dp 2 x tsp 2)
    accelerate launch --use_deepspeed --zero_stage 2 --num_processes 2 accelerate_job.py ...
    python accelerate_job.py --plain ...       (plain Accelerator, one process, no DeepSpeed)

Each process takes ``--batch`` rows per step from a sequential loader that Accelerate splits over
the data-parallel ranks (replica i takes batches i, i + dp, ...; every rank of a TSP group the
same). ``accelerator.clip_grad_norm_`` clips and returns the norm it clipped by (under DeepSpeed
clipping is DeepSpeed's, at the 1.0 Accelerate fills in, and the norm DeepSpeed's).
``--kv-heads 1,2`` trains one model per entry, each prepared by the one accelerator.
``--lora R``: each model a PEFT ``PeftModel`` (rank-R LoRA on the seven projections).
``--dynamo-backend NAME``: ``TSPAccelerator(dynamo_backend=NAME)``; every rank also records which
decoder layers were compiled (:func:`layer_compiled`), the class of the prepared model (an
``OptimizedModule`` would be a whole-model compile) and dynamo's graph breaks (``compiled``),
and dynamo's ``trace_autograd_ops`` is restored and its caches reset afterwards.
``--round-trip``: save the state after step 2, train steps 3-4, load it and train them again: the
repeats must be identical (exit 1 otherwise). ``--case "NAME ARGS..."`` (repeatable): one more
run in the same processes with its own accelerator, results in --out/NAME.

FSDP2 (dp_shard x tsp): ``--fsdp-code`` builds ``TSPAccelerator(parallelism_config=
ParallelismConfig(dp_shard_size=N, tp_size=D), fsdp_plugin=FullyShardedDataParallelPlugin(
fsdp_version=2, mixed_precision_policy=MixedPrecisionPolicy(reduce_dtype=float64)))``; a launch
with an FSDP2 ``accelerate config`` file (``accelerate launch --config_file``) takes it from the
launcher's environment with the script unchanged. Under --case the launcher's FSDP and
``parallelism_config`` variables reach only the cases marked ``--launch-fsdp`` (which do not see
``TSP_SIZE``: the TSP degree is the config file's tp size); the others run as after a plain
``--multi_gpu`` launch. With FSDP2 every rank also records the bytes of parameter
storage it holds and how its FSDP2 units were configured (``fsdp`` in ``rank<R>.json``).

Every rank writes its losses and norms per model (``rank<R>.json``), the final full weights it
holds and (not under DeepSpeed, whose gradients live in its buffers) the first step's full
gradients before clipping (``rank<R>_weights_kv<N>.pt``, ``rank<R>_grads0_kv<N>.pt``: each
data-parallel replica's own, gathered over its TSP group, so a replica that diverged shows).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex

import torch
from accelerate import Accelerator, ParallelismConfig
from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin
from torch.utils.data import DataLoader

import tsp_core
from tests.support.gather import full_grads, storage_bytes
from tests.support.hf_models import build, lora_model
from tests.support.metrics_check import StepCounters
from tsp_accelerate import JSONLinesTracker, TSPAccelerator
from tsp_core.distributed.model_state import find_model_state


def layer_compiled(layer) -> bool:
    """Whether a decoder layer was compiled (its class a compiled subclass of its own)."""
    from tsp_core.models.compiled import compiled_by

    return compiled_by(layer) is not None


def offload_stats(model) -> dict | None:
    """The host offload's counts (``tsp_core.models.offload``), None without offload."""
    state = find_model_state(model)
    offload = None if state is None else state.offload
    return None if offload is None else dict(offload.stats)


def rows(n: int) -> torch.Tensor:
    return torch.randint(0, 96, (n, 24), generator=torch.Generator().manual_seed(1))


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser()
    ap.add_argument("--plain", action="store_true")
    ap.add_argument("--tsp-size", type=int, default=None, help="else TSP_SIZE or every process")
    ap.add_argument("--dtype", default="float32", choices=["float32", "float64"])
    ap.add_argument("--mixed-precision", default="no", choices=["no", "bf16"],
                    help="the Accelerator's mixed_precision (autocast around the forward)")
    ap.add_argument("--kv-heads", default="2", help="comma-separated: one model each")
    ap.add_argument("--family", default="llama", help="a tests/hf_models family")
    ap.add_argument("--optimizer", choices=["adamw", "sgd"], default="sgd")
    ap.add_argument("--lr", type=float, default=0.5)
    ap.add_argument("--clip", type=float, default=1.0)
    ap.add_argument("--batch", type=int, default=2, help="rows per process and step")
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--round-trip", action="store_true")
    ap.add_argument("--metrics", action="store_true",
                    help="log tsp_metrics() every 2 steps to a JSONLinesTracker "
                         "(out/tracker.jsonl)")
    ap.add_argument("--fsdp-code", type=int, default=0, metavar="DP_SHARD",
                    help="FSDP2 over DP_SHARD data-parallel ranks, configured in code")
    ap.add_argument("--launch-fsdp", action="store_true",
                    help="(--case) this case sees the launcher's FSDP configuration")
    ap.add_argument("--timeout", type=int, default=0,
                    help="InitProcessGroupKwargs(timeout=timedelta(seconds=N))")
    ap.add_argument("--activation-offload", action="store_true",
                    help="TSPAccelerator(activation_offload=True), the models' layers checkpointed")
    ap.add_argument("--lora", type=int, default=0, metavar="R",
                    help="each model a PEFT PeftModel (lora_model): rank-R LoRA on the seven "
                         "projections, A and B random")
    ap.add_argument("--dynamo-backend", default=None,
                    help="TSPAccelerator(dynamo_backend=...): each decoder layer compiled")
    ap.add_argument("--out", required=True)
    ap.add_argument("--case", action="append", default=[])
    return ap


def fsdp_units(model) -> dict:
    """How FSDP2 was applied: each decoder layer's reshard_after_forward and reduce dtype."""
    from torch.distributed.fsdp import FSDPModule

    layers = [m for n, m in model.named_modules() if isinstance(m, FSDPModule) and n]
    states = [m._get_fsdp_state() for m in layers]
    return {"units": len(layers) + isinstance(model, FSDPModule),
            "reshard": [s._fsdp_param_group.post_forward_mesh_info is not None for s in states],
            "reduce_dtype": sorted({str(s._mp_policy.reduce_dtype) for s in states})}


def group_timeouts(mesh) -> dict[str, float]:
    """The seconds each process group of ``mesh`` (and the default group) waits for the other
    ranks in a collective."""
    dm = mesh.device_mesh
    groups = {"world": torch.distributed.group.WORLD,
              **{name: dm.get_group(name) for name in dm.mesh_dim_names}}
    return {name: g._get_backend(torch.device("cpu")).options._timeout.total_seconds()
            for name, g in groups.items()}


def train(a) -> Accelerator:
    """One run; with ``--dynamo-backend``, dynamo's settings as they were afterwards (compiling
    turns ``trace_autograd_ops`` on for the process)."""
    if not a.dynamo_backend:
        return run(a)
    traces_autograd = torch._dynamo.config.trace_autograd_ops
    torch._dynamo.utils.counters.clear()
    try:
        return run(a)
    finally:
        torch._dynamo.config.trace_autograd_ops = traces_autograd
        torch._dynamo.reset()


def run(a) -> Accelerator:
    if a.plain:
        accelerator = Accelerator(cpu=True, mixed_precision=a.mixed_precision)
    else:
        trackers = [JSONLinesTracker(os.path.join(a.out, "tracker.jsonl"))] if a.metrics else None
        fsdp = {}
        if a.fsdp_code:
            from torch.distributed.fsdp import MixedPrecisionPolicy

            fsdp = dict(parallelism_config=ParallelismConfig(dp_shard_size=a.fsdp_code,
                                                             tp_size=a.tsp_size),
                        fsdp_plugin=FullyShardedDataParallelPlugin(
                            fsdp_version=2, mixed_precision_policy=MixedPrecisionPolicy(
                                reduce_dtype=getattr(torch, a.dtype))))
            a.tsp_size = None  # the ParallelismConfig's tp_size
        if a.timeout:
            from datetime import timedelta

            from accelerate.utils import InitProcessGroupKwargs

            fsdp["kwargs_handlers"] = [InitProcessGroupKwargs(timeout=timedelta(seconds=a.timeout))]
        if a.activation_offload:
            fsdp["activation_offload"] = True
        if a.dynamo_backend:
            fsdp["dynamo_backend"] = a.dynamo_backend
        accelerator = TSPAccelerator(tsp_size=a.tsp_size, log_with=trackers,
                                     mixed_precision=a.mixed_precision, **fsdp)
        if a.metrics:
            accelerator.init_trackers("job")
    deepspeed = accelerator.distributed_type == DistributedType.DEEPSPEED
    kv_heads = [int(k) for k in a.kv_heads.split(",")]
    models = [build(a.family, getattr(torch, a.dtype), kv_heads=k) for k in kv_heads]
    if a.lora:
        models = [lora_model(m, a.lora) for m in models]
    for m in models if a.activation_offload else ():
        m.activation_checkpointing_enable()
    opt_cls = torch.optim.SGD if a.optimizer == "sgd" else torch.optim.AdamW
    optimizers = [opt_cls(m.parameters(), lr=a.lr) for m in models]
    loader = DataLoader([{"input_ids": r, "labels": r} for r in rows(a.rows)], batch_size=a.batch)
    # one prepare call per model: Accelerate's tp path maps optimizer parameters by parameter
    # name over everything in one call, so two models of the same names there would collide;
    # DeepSpeed wants the loader in the model's call (it reads the micro-batch size from it)
    full_bytes = sum(p.numel() * p.element_size() for p in models[0].parameters())
    first = accelerator.prepare(models[0], optimizers[0], loader)
    pairs = [first[:2]] + [accelerator.prepare(m, o) for m, o in zip(models[1:], optimizers[1:])]
    models, optimizers, loader = [m for m, _ in pairs], [o for _, o in pairs], first[2]
    fsdp_info = {}
    if accelerator.is_fsdp2:
        unwrapped = accelerator.unwrap_model(models[0])
        fsdp_info = {"storage": storage_bytes(unwrapped), "full": full_bytes,
                     **fsdp_units(unwrapped)}
    batches = list(loader)
    losses = {k: [] for k in kv_heads}
    norms = {k: [] for k in kv_heads}
    grads0: dict = {}
    counters, metric_rows = StepCounters(), []

    def step(batch) -> None:
        counters.begin()
        for k, model, optimizer in zip(kv_heads, models, optimizers):
            loss = model(**batch).loss
            accelerator.backward(loss)
            if k not in grads0 and not deepspeed:
                grads0[k] = full_grads(accelerator.unwrap_model(model))
            norms[k].append(float(accelerator.clip_grad_norm_(model.parameters(), a.clip)))
            optimizer.step()
            optimizer.zero_grad()
            losses[k].append(loss.item())
        counters.end()
        if a.metrics and len(counters.steps) % 2 == 0:
            metric_rows.append(accelerator.tsp_metrics())
            accelerator.log(metric_rows[-1], step=len(counters.steps))

    if a.round_trip:
        for b in batches[:2]:
            step(b)
        state = os.path.join(a.out, "state")
        accelerator.save_state(state)
        for b in batches[2:4]:
            step(b)
        first = {k: v[2:] for k, v in losses.items()}
        accelerator.load_state(state)
        for b in batches[2:4]:
            step(b)
        again = {k: v[4:] for k, v in losses.items()}
        if again != first:
            raise SystemExit(f"save_state/load_state did not round-trip: {first} vs {again}")
        losses = {k: v[:4] for k, v in losses.items()}
        norms = {k: v[:4] for k, v in norms.items()}
    else:
        for b in batches[:a.steps]:
            step(b)

    compiled = {}
    if a.dynamo_backend:
        layers = accelerator.unwrap_model(models[0]).model.layers
        compiled = {"layers": [layer_compiled(layer) for layer in layers],
                    "classes": sorted({type(m).__name__ for m in models}),
                    "breaks": dict(torch._dynamo.utils.counters["graph_break"])}
    rank = accelerator.process_index
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, f"rank{rank}.json"), "w") as f:
        json.dump({"losses": losses, "norms": norms, "metric_rows": metric_rows,
                   "step_counts": counters.steps, "fsdp": fsdp_info,
                   "tsp_reason": getattr(getattr(accelerator, "tsp_choice", None), "reason", ""),
                   "group_timeouts": None if a.plain else group_timeouts(accelerator.tsp_mesh),
                   "offload": [offload_stats(accelerator.unwrap_model(m)) for m in models],
                   "compiled": compiled}, f)
    for k, model in zip(kv_heads, models):
        unwrapped = accelerator.unwrap_model(model)
        if a.plain:
            weights = {n: v.detach() for n, v in unwrapped.state_dict().items()}
        else:  # a collective: every rank gathers, and keeps, its TSP group's full weights
            weights = tsp_core.full_state_dict(unwrapped)
        torch.save(weights, os.path.join(a.out, f"rank{rank}_weights_kv{k}.pt"))
        if k in grads0:
            torch.save(grads0[k], os.path.join(a.out, f"rank{rank}_grads0_kv{k}.pt"))
    if accelerator.is_main_process:
        print(f"processes {accelerator.num_processes}, distributed {accelerator.distributed_type}, "
              f"TSP degree {getattr(getattr(accelerator, 'tsp_mesh', None), 'size', 1)}")
    return accelerator


FSDP_ENV = ("ACCELERATE_USE_FSDP", "FSDP_", "ACCELERATE_USE_PARALLELISM_CONFIG",
            "PARALLELISM_CONFIG_")


def main() -> None:
    ap = parser()
    a = ap.parse_args()
    if not a.case:
        return train(a).end_training()
    from accelerate.state import AcceleratorState

    launched = {k: v for k, v in os.environ.items() if k.startswith(FSDP_ENV)}
    tsp_env = os.environ.get("TSP_SIZE")
    accelerator = None
    for spec in a.case:
        name, *extra = shlex.split(spec)
        args = ap.parse_args([*extra, "--out", os.path.join(a.out, name)])
        for key in [k for k in os.environ if k.startswith(FSDP_ENV)]:
            del os.environ[key]  # also what an earlier case's plugin set
        if args.launch_fsdp:  # everything from the config file, the TSP degree too
            os.environ.update(launched)
            os.environ.pop("TSP_SIZE", None)
        elif tsp_env is not None:
            os.environ["TSP_SIZE"] = tsp_env
        plain = not (args.launch_fsdp or args.fsdp_code or accelerator is None
                     or accelerator.is_fsdp2)
        if plain and args.tsp_size != accelerator.tsp_mesh.size:
            try:  # the process-wide state would keep the first TSP size: refused, not ignored
                TSPAccelerator(tsp_size=args.tsp_size)
                raise AssertionError(f"a second TSPAccelerator(tsp_size={args.tsp_size}) was "
                                     f"accepted beside one of size {accelerator.tsp_mesh.size}")
            except ValueError as e:
                assert "cannot change it" in str(e), e
        # an Accelerator keeps its parallelism config in a process-wide state: a new TSP size
        # needs a new one (the process group stays; end_training would destroy it). After FSDP2
        # the partial state too: it keeps the FSDP distributed type, without the plugin
        AcceleratorState._reset_state(accelerator is not None and accelerator.is_fsdp2)
        accelerator = train(args)
    accelerator.end_training()


if __name__ == "__main__":
    main()
