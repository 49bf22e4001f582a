"""Train a small random-init Llama with TSP on CPU, beside the layouts people run today.

    torchrun --standalone --nproc_per_node 2 examples/train_llama.py     (what `./run main` does)

The model is built from the config below (nothing is downloaded) with a fixed seed, so every run
starts from the same weights and sees the same batches: the plain Hugging Face model on the whole
sequence in one process (every process runs it at the same time, one core each), then, on all
processes together, TSP and the baselines of ``--baselines`` (default Megatron TP, TP + sequence
parallel and context parallel, from ``tsp_core.baselines``) at the same degree. The script prints
per-step losses, tokens/s (median after warm-up), per-rank peak memory (MemTracker over one extra
step: parameters, gradients, optimizer state, activations and temporaries; the same tracker for
every run), the bytes each rank sent in that step and "wait %": rank 0's host time blocked in
collectives during another extra step, over the median step (``tsp_core.comm``'s
``wait_seconds``; DTensor's collectives timed the same way).

``--pp 2`` cuts the model into two pipeline stages (``tsp_core.pipeline``, 1F1B, ``--microbatches``
per step, by default 4; docs/pipeline.md): with 4 processes, pp 2 x TSP 2; the baselines do not
run then.

``--tsp 1 --dp-shard 2`` (or, with 4 processes, ``--tsp 2 --dp-shard 2``) adds FSDP2 over the
data-parallel ranks (docs/fsdp.md); each data-parallel rank trains on its own rows of the batch
(``--batch``, by default one row per data-parallel rank), and the baselines run only without data
parallel. ``--dtype bfloat16`` builds every column's model in bfloat16 (parameters, gradients and
AdamW state; the losses are then within bfloat16's rounding of the float32 ones, not equal).

The arguments are checked before any process group or collective: ``--steps`` above
``--warmup``, ``--tsp`` dividing the number of processes, the heads and ``--ffn``, ``--seq`` at
least 2 x ``--tsp``, ``--batch`` a multiple of the data-parallel size, ``--dp-shard`` dividing it,
and what each baseline needs; a bad combination exits with status 2 and a message naming the
numbers and the fix.

``--lora R`` trains a LoRA adapter instead of every weight (docs/lora.md): PEFT's
``get_peft_model`` puts rank-R adapters on the seven projections (q, k, v, o, gate, up, down;
lora_alpha 2R) of the same base model, TSP parallelizes the ``PeftModel`` (the base frozen and
sharded, the adapters replicated), rank 0 prints the trainable parameter count, and after training
every rank calls ``save_pretrained(--adapter-dir)`` (rank 0 writes PEFT's files, which plain PEFT
loads onto the unmodified base). The one-process column is then the same ``PeftModel``; no
baselines, pipeline, FSDP2 or elastic mode run with it:

    torchrun --standalone --nproc_per_node 2 examples/train_llama.py --lora 8

Elastic training (docs/checkpointing.md): with ``--checkpoint-dir`` the script trains the TSP model
only, on batches that depend only on the step number, saves a sharded checkpoint every
``--checkpoint-every`` steps and, with ``--resume``, starts from the latest complete one. Under
``torchrun --max-restarts N`` a job that lost a process restarts and continues exactly:

    torchrun --standalone --nproc_per_node 2 --max-restarts 2 examples/train_llama.py \
        --checkpoint-dir ckpt --checkpoint-every 2 --resume --final-weights final.pt
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import os
import signal
import statistics
import time

import torch
import torch.distributed as dist
from torch.distributed._tools.mem_tracker import MemTracker
from transformers import LlamaConfig, LlamaForCausalLM

import tsp_core
from tsp_core import comm
from tsp_core.baselines import build as build_layout
from tsp_core.baselines import layout_specs

MIB = 1024 ** 2


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--ffn", type=int, default=704)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=None,
                    help="rows per step, split over the data-parallel ranks (default: one each)")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=2,
                    help="steps left out of the tokens/s median (fewer than --steps)")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float64"])
    ap.add_argument("--tsp", type=int, default=None, help="TSP degree (default: every process)")
    ap.add_argument("--pp", type=int, default=1,
                    help="pipeline stages (tsp_core.pipeline, 1F1B; docs/pipeline.md)")
    ap.add_argument("--microbatches", type=int, default=None,
                    help="--pp > 1: micro-batches per step (default 2 x --pp)")
    ap.add_argument("--dp-shard", type=int, default=None,
                    help="FSDP2 over this many data-parallel ranks (docs/fsdp.md)")
    ap.add_argument("--baselines", default=None,
                    help="layouts run beside TSP on the same processes (empty: none; default "
                         "tp,tp-sp,cp; only without data parallel); from "
                         "tsp_core.baselines.LAYOUTS")
    ap.add_argument("--checkpoint-dir", default=None,
                    help="elastic mode: train TSP only, saving sharded checkpoints here")
    ap.add_argument("--checkpoint-every", type=int, default=2)
    ap.add_argument("--resume", action="store_true",
                    help="start from the latest complete checkpoint in --checkpoint-dir")
    ap.add_argument("--final-weights", default=None,
                    help="elastic mode: save the final full state dict (torch.save) here")
    ap.add_argument("--lora", type=int, default=None, metavar="R",
                    help="train a rank-R LoRA adapter on the seven projections (docs/lora.md)")
    ap.add_argument("--adapter-dir", default="lora-adapter",
                    help="--lora: where save_pretrained writes the adapter")
    return ap


def check_args(a: argparse.Namespace, world: int) -> argparse.Namespace:
    """``a`` with the defaults that depend on the number of processes ``world`` filled in (--tsp,
    --batch, --baselines), after checking every combination the run would otherwise trip over
    later, some ranks inside a collective (a too-short sequence) or after minutes of training (no
    step left to time). Raises ValueError naming the numbers and the fix."""
    a = argparse.Namespace(**vars(a))
    elastic_only = [f for f, v in (("--resume", a.resume), ("--final-weights", a.final_weights))
                    if v]
    if a.checkpoint_dir is None and elastic_only:
        raise ValueError(f"{' and '.join(elastic_only)}: only in elastic mode; add "
                         f"--checkpoint-dir DIR")
    check_lora(a)
    if a.checkpoint_every < 1:
        raise ValueError(f"--checkpoint-every ({a.checkpoint_every}) must be at least 1")
    if a.steps < 1 or a.warmup < 0:
        raise ValueError(f"--steps ({a.steps}) must be at least 1 and --warmup ({a.warmup}) at "
                         f"least 0")
    if a.checkpoint_dir is None and a.steps <= a.warmup:
        raise ValueError(f"--steps ({a.steps}) must be larger than --warmup ({a.warmup}): "
                         f"tokens/s is the median of the steps after the warm-up, and none would "
                         f"be left; pass --steps {a.warmup + 1} or more, or --warmup "
                         f"{a.steps - 1} or less")
    if a.pp < 1 or world % a.pp:
        raise ValueError(f"--pp ({a.pp}) must divide the number of processes ({world})")
    if a.pp > 1 and a.checkpoint_dir is not None:
        raise ValueError(f"--pp ({a.pp}): elastic mode (--checkpoint-dir) trains without "
                         f"pipeline stages here; pass --pp 1")
    if a.pp > 1:
        from tsp_core.pipeline import split_layers

        split_layers(a.layers, a.pp)  # fewer layers than stages raises here
    a.microbatches = (2 * a.pp if a.pp > 1 else 1) if a.microbatches is None else a.microbatches
    if a.microbatches < a.pp:
        raise ValueError(f"--microbatches ({a.microbatches}) must be at least --pp ({a.pp})")
    world //= a.pp  # the processes of one pipeline stage
    tsp = world if a.tsp is None else a.tsp
    if tsp < 1 or world % tsp:
        raise ValueError(f"--tsp ({tsp}) must divide the number of processes ({world}); launch a "
                         f"multiple of {max(tsp, 1)} processes or pass a divisor of {world}")
    dp = world // tsp
    if a.dp_shard is not None and (a.dp_shard < 1 or dp % a.dp_shard):
        raise ValueError(f"--dp-shard ({a.dp_shard}) must divide the data-parallel size ({dp} = "
                         f"{world} processes / --tsp {tsp}); pass a divisor of {dp}, or launch "
                         f"a multiple of {tsp * max(a.dp_shard, 1)} processes")
    if a.heads < 1 or a.hidden % a.heads:
        raise ValueError(f"--heads ({a.heads}) must divide --hidden ({a.hidden})")
    if a.kv_heads < 1 or a.heads % a.kv_heads:
        raise ValueError(f"--kv-heads ({a.kv_heads}) must divide --heads ({a.heads})")
    for what, n in (("--heads", a.heads), ("--ffn", a.ffn)):
        if n % tsp:
            raise ValueError(f"--tsp ({tsp}) must divide {what} ({n}): each rank holds 1/{tsp} "
                             f"of them; pass a divisor of {n} as --tsp or change {what}")
    if a.kv_heads % tsp and tsp % a.kv_heads:
        raise ValueError(f"--kv-heads ({a.kv_heads}) and --tsp ({tsp}): one must divide the "
                         f"other, so that each rank's query heads share whole key/value heads")
    if a.seq < 2 * tsp:
        raise ValueError(f"--seq ({a.seq}) must be at least 2 x --tsp = {2 * tsp}: the zigzag "
                         f"layout gives every rank two chunks of each sequence; pass --seq "
                         f"{2 * tsp} or more, or a smaller --tsp")
    a.batch = dp * a.microbatches if a.batch is None else a.batch
    if a.pp > 1 and (a.batch < 1 or a.batch % (dp * a.microbatches)):
        raise ValueError(f"--batch ({a.batch}) must be a multiple of the data-parallel size ({dp}) "
                         f"x --microbatches ({a.microbatches}); pass --batch "
                         f"{dp * a.microbatches}")
    if a.batch < 1 or a.batch % dp:
        raise ValueError(f"--batch ({a.batch}) must be a multiple of the data-parallel size ({dp} "
                         f"= {world} processes / --tsp {tsp}): each data-parallel rank trains on "
                         f"its own rows; pass --batch {dp} or a multiple of it")
    if a.baselines is None:
        a.baselines = ("tp,tp-sp,cp" if dp == 1 and a.checkpoint_dir is None and a.pp == 1
                       and a.lora is None else "")
    names = [n for n in a.baselines.split(",") if n]
    if names and a.pp > 1:
        raise ValueError(f"--baselines ({a.baselines}) run only without pipeline stages; pass "
                         f"--baselines '' with --pp {a.pp}")
    if names and dp > 1:
        raise ValueError(f"--baselines ({a.baselines}) run only without data parallel, and this "
                         f"run has {dp} data-parallel ranks; pass --baselines '' or --tsp {world}")
    if names and a.lora is not None:
        raise ValueError(f"--baselines ({a.baselines}) train every weight and --lora "
                         f"({a.lora}) an adapter; pass --baselines '' with --lora")
    if names and a.checkpoint_dir is not None:
        raise ValueError(f"--baselines ({a.baselines}) do not run in elastic mode "
                         f"(--checkpoint-dir); pass --baselines ''")
    for name in names:
        try:
            specs = layout_specs(name, world)
        except ValueError as e:  # an unknown name, a 2-D layout on a degree without a split
            raise ValueError(f"--baselines ({a.baselines}): {e}") from None
        for spec in specs:
            if spec.name == "tsp":
                continue
            for what, n in (("--heads", a.heads), ("--kv-heads", a.kv_heads), ("--ffn", a.ffn)):
                if n % spec.tp:
                    raise ValueError(f"baseline {spec.label} splits {what} ({n}) over {spec.tp} "
                                     f"ranks, which must divide it; leave {name} out of "
                                     f"--baselines or change {what}")
            chunks = 2 * spec.cp
            if a.seq % chunks:
                raise ValueError(f"baseline {spec.label} takes sequences whose length is a "
                                 f"multiple of {chunks} (it does not pad), and --seq is {a.seq}; "
                                 f"pass --seq {a.seq + chunks - a.seq % chunks} or leave {name} "
                                 f"out of --baselines")
    a.tsp = tsp
    return a


def check_lora(a: argparse.Namespace) -> None:
    """Refuse what a LoRA run (``--lora``) does not combine with, before any process group:
    LoRA under TSP takes no FSDP2 (docs/lora.md), and this script's pipeline and elastic modes
    train every weight."""
    if a.lora is None:
        return
    if a.lora < 1:
        raise ValueError(f"--lora ({a.lora}) is the adapters' rank: pass 1 or more")
    for flag, value, why, off in (
            ("--pp", a.pp if a.pp > 1 else None, "the pipeline run trains every weight",
             "--pp 1"),
            ("--dp-shard", a.dp_shard, "LoRA under TSP takes no FSDP2 yet (docs/lora.md)",
             "no --dp-shard"),
            ("--checkpoint-dir", a.checkpoint_dir, "elastic mode trains every weight",
             "no --checkpoint-dir")):
        if value is not None:
            raise ValueError(f"--lora ({a.lora}) with {flag} ({value}): {why}; pass {off}")


def with_lora(model: LlamaForCausalLM, r: int):
    """PEFT's ``get_peft_model`` with rank-``r`` adapters on the seven projections (A drawn
    from the global generator, B zero: PEFT's defaults), the base frozen."""
    from peft import LoraConfig, get_peft_model

    return get_peft_model(model, LoraConfig(r=r, lora_alpha=2 * r, target_modules=[
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]))


def finish_lora(model, ids: torch.Tensor, mesh: tsp_core.TSPMesh, a: argparse.Namespace) -> None:
    """After training: the loss of the trained TSP PeftModel on ``ids`` (what the saved adapter
    must give) and ``save_pretrained``, which every rank calls (the adapters are gathered; rank
    0 writes PEFT's adapter_config.json and adapter_model.safetensors)."""
    rows = my_rows(ids, mesh)
    with torch.no_grad():
        loss = model(**tsp_core.shard_batch({"input_ids": rows, "labels": rows}, mesh)).loss
    model.save_pretrained(a.adapter_dir)
    if dist.get_rank() == 0:
        print(f"LoRA after training: loss {loss.item():.6f} on batch 0; adapter saved to "
              f"{a.adapter_dir}", flush=True)


def my_rows(ids: torch.Tensor, mesh: tsp_core.TSPMesh) -> torch.Tensor:
    """This data-parallel rank's rows of the global batch (TSP is the mesh's innermost dim, so
    the data-parallel rank is the global rank over the TSP degree)."""
    return ids.chunk(mesh.dp_size)[dist.get_rank() // mesh.size]


def build(a: argparse.Namespace) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=a.vocab, hidden_size=a.hidden, intermediate_size=a.ffn,
                         num_hidden_layers=a.layers, num_attention_heads=a.heads,
                         num_key_value_heads=a.kv_heads, max_position_embeddings=a.seq)
    return LlamaForCausalLM(config).to(getattr(torch, a.dtype))


def train(model, step_fn, data: list[torch.Tensor], a: argparse.Namespace,
          counting=contextlib.nullcontext, track_memory: bool = True):
    """Per-step losses, tokens/s, the peak bytes of one more (tracked) step and the bytes this
    rank sent in it, and the host time blocked in collectives in another extra step over the
    median step. ``step_fn(ids)`` runs forward and backward and returns the loss. Without
    ``track_memory`` (a pipeline: MemTracker takes one forward per module and step, a stage runs
    one per micro-batch; LoRA: its module tracker hooks the frozen embedding's output, which
    needs no gradient, and raises) the peak is reported as 0, printed "n/a"."""
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr)

    def step(ids: torch.Tensor) -> float:
        loss = step_fn(ids)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.item()

    losses, times = [], []
    for ids in data:
        dist.barrier()
        t0 = time.perf_counter()
        losses.append(step(ids))
        times.append(time.perf_counter() - t0)
    median = statistics.median(times[a.warmup:])
    with counting(), comm.track() as waited:  # every layout's collectives timed the same way
        step(data[0])
    if not track_memory:
        with counting(), comm.track() as sent:
            step(data[0])
        return losses, a.batch * a.seq / median, 0, sent.total_bytes, waited.wait_seconds / median
    tracker = MemTracker()
    tracker.track_external(model, opt)
    with tracker, counting(), comm.track() as sent:
        step(data[0])
    (snap,) = tracker.get_tracker_snapshot("peak").values()
    return (losses, a.batch * a.seq / median, int(snap["Total"]), sent.total_bytes,
            waited.wait_seconds / median)


def backward(loss: torch.Tensor) -> torch.Tensor:
    loss.backward()
    return loss


def elastic(a: argparse.Namespace, mesh: tsp_core.TSPMesh) -> None:
    """TSP training that checkpoints every ``--checkpoint-every`` steps and resumes from the latest
    complete checkpoint. The batch of step k is drawn from seed k, so a resumed run sees exactly
    the batches an uninterrupted one would."""
    model = tsp_core.parallelize(build(a), mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr)
    start = 0
    latest = tsp_core.latest_checkpoint(a.checkpoint_dir) if a.resume else None
    if latest is not None:
        start = tsp_core.load_checkpoint(latest, model, opt)["step"]
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if dist.get_rank() == 0:
        print(f"attempt {restart}: starting at step {start}"
              + (f" from {latest}" if latest else ""), flush=True)
    # test hook: this global rank SIGKILLs itself at this step, on the first attempt only
    kill = os.environ.get("TSP_TEST_KILL")  # "rank:step"
    for step in range(start, a.steps):
        if kill and restart == 0 and [dist.get_rank(), step] == [int(v) for v in kill.split(":")]:
            print(f"rank {dist.get_rank()} SIGKILLs itself at step {step}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        ids = torch.randint(0, a.vocab, (a.batch, a.seq),
                            generator=torch.Generator().manual_seed(1000 + step))
        model.tsp_step = step
        ids = my_rows(ids, mesh)
        loss = model(**tsp_core.shard_batch({"input_ids": ids, "labels": ids}, mesh)).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if dist.get_rank() == 0:
            print(f"step {step} loss {loss.item():.6f}", flush=True)
        if (step + 1) % a.checkpoint_every == 0 or step + 1 == a.steps:
            tsp_core.save_checkpoint(os.path.join(a.checkpoint_dir, f"step_{step + 1:06d}"), model,
                                     opt, step=step + 1)
    state = tsp_core.full_state_dict(model, rank0_only=True)
    if a.final_weights and dist.get_rank() == 0:
        torch.save(state, a.final_weights)


def main() -> None:
    ap = parser()
    try:  # before any process group or collective, the same on every rank
        a = check_args(ap.parse_args(), int(os.environ.get("WORLD_SIZE", "1")))
    except ValueError as e:
        ap.error(str(e))

    mesh = tsp_core.init_mesh(a.tsp, pp_size=a.pp, dp_shard=a.dp_shard)
    if a.checkpoint_dir is not None:
        elastic(a, mesh)
        return
    gen = torch.Generator().manual_seed(1)
    data = [torch.randint(0, a.vocab, (a.batch, a.seq), generator=gen) for _ in range(a.steps)]
    plain = build(a) if a.lora is None else with_lora(build(a), a.lora)
    initial = copy.deepcopy(plain)  # every layout starts from these weights
    runs = [("HF model, 1 process", train(
        plain, lambda ids: backward(plain(input_ids=ids, labels=ids).loss), data, a,
        track_memory=a.lora is None))]
    fsdp = f" + FSDP2 x {mesh.fsdp_size}" if mesh.fsdp_size > 1 else ""
    if a.pp > 1:  # every rank takes the global batch; the pipeline keeps its replica's rows
        pipe = tsp_core.pipeline(copy.deepcopy(initial), mesh, microbatches=a.microbatches)
        runs.append((f"TSP x PP {a.pp}{fsdp}, {dist.get_world_size()} processes", train(
            pipe, lambda ids: pipe.step({"input_ids": ids, "labels": ids}), data, a,
            track_memory=False)))
    else:
        tsp_model = tsp_core.parallelize(copy.deepcopy(initial), mesh)
        if a.lora is not None and dist.get_rank() == 0:
            tsp_model.print_trainable_parameters()  # the adapters: what the optimizer updates
        runs.append((f"TSP{fsdp}, {dist.get_world_size()} processes", train(
            tsp_model, lambda ids: backward(tsp_model(**tsp_core.shard_batch(
                {"input_ids": my_rows(ids, mesh), "labels": my_rows(ids, mesh)}, mesh)).loss),
            data, a, track_memory=a.lora is None)))
        if a.lora is not None:
            finish_lora(tsp_model, data[0], mesh, a)
    world = dist.get_world_size()
    names = [n for n in a.baselines.split(",") if n]  # none with data parallel (check_args)
    for spec in (s for n in names for s in layout_specs(n, world)):
        pm = build_layout(copy.deepcopy(initial), spec)
        runs.append((f"{spec.label}, {world} processes", train(
            pm.model, lambda ids, pm=pm: pm.step({"input_ids": ids, "labels": ids}), data, a,
            pm.counting)))
        del pm
    peaks = [torch.zeros(len(runs), dtype=torch.int64) for _ in range(world)]
    dist.all_gather(peaks, torch.tensor([r[2] for _, r in runs]))

    if dist.get_rank() == 0:
        print(f"Llama: {a.layers} layers, hidden {a.hidden}, heads {a.heads}/{a.kv_heads}, ffn "
              f"{a.ffn}, vocab {a.vocab}, {a.dtype}; batch {a.batch} x {a.seq} tokens; "
              f"TSP degree {mesh.size}, data parallel {mesh.dp_size} (FSDP2 over "
              f"{mesh.fsdp_size}), pipeline stages {mesh.pp_size}")
        base = runs[0][1][0]
        print(f"{'step':>4} {'HF 1 process':>13} " + " ".join(f"{n.split(',')[0]:>13}"
                                                             for n, _ in runs[1:]))
        for i in range(a.steps):
            print(f"{i:>4} {base[i]:>13.6f} " + " ".join(f"{r[0][i]:>13.6f}" for _, r in runs[1:]))
        for name, r in runs[1:]:
            diff = max(abs(x - y) / abs(y) for x, y in zip(r[0], base))
            print(f"max relative loss difference, {name.split(',')[0]}: {diff:.1e}")
        print(f"{'layout':<28} {'tokens/s':>9} {'MiB sent/step':>14} {'wait %':>7}   "
              f"peak MiB per rank")
        for j, (name, r) in enumerate(runs):
            ranks = ", ".join(f"{int(p[j]) / MIB:.1f}" if p[j] else "n/a"
                              for p in (peaks[:1] if j == 0 else peaks))
            print(f"{name:<28} {r[1]:>9.0f} {r[3] / MIB:>14.1f} {100 * r[4]:>7.1f}   {ranks}")


if __name__ == "__main__":
    with tsp_core.run_cleanly():  # barrier, destroy the groups, exit 0 (docs/cluster.md)
        main()
