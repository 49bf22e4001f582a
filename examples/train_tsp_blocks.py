"""Train a small Llama-style decoder with TSP on CPU, beside the same model unsharded.

    torchrun --standalone --nproc_per_node 2 examples/train_tsp_blocks.py   (what `./run main` does)

Attention, MLP and norms are the TSP modules of ``tsp_core``. The token embedding and LM head are
replicated on every rank here (vocabulary sharding comes with ``tsp_core.parallelize``). The
baseline is the same code with a TSP group of one rank: the whole model and sequence on one
device. Both start from the same weights and see the same data; the script prints per-step losses,
tokens/s (median after warm-up) and per-rank peak memory (MemTracker, one extra step, every layout
measured the same way).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed._tools.mem_tracker import MemTracker
from torch.distributed.device_mesh import init_device_mesh

import tsp_core
from tsp_core import TSPAttention, TSPGatedMLP, TSPMesh, comm
from tsp_core.norm import TSPRMSNorm
from tsp_core.params import local_replicated, replicated_parameter


class Block(nn.Module):
    def __init__(self, mesh: TSPMesh, a: argparse.Namespace, seed: int) -> None:
        super().__init__()
        self.attn_norm = TSPRMSNorm(mesh, a.hidden)
        self.attn = TSPAttention(mesh, a.hidden, a.heads, a.kv_heads, init_seed=seed)
        self.mlp_norm = TSPRMSNorm(mesh, a.hidden)
        self.mlp = TSPGatedMLP(mesh, a.hidden, a.ffn, init_seed=seed + 1)

    def forward(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), pos)
        return x + self.mlp(self.mlp_norm(x))


class TinyLlama(nn.Module):
    def __init__(self, mesh: TSPMesh, a: argparse.Namespace) -> None:
        super().__init__()
        self.mesh = mesh
        gen = torch.Generator().manual_seed(0)
        self.embed = replicated_parameter(torch.randn(a.vocab, a.hidden, generator=gen) * 0.02, mesh)
        self.lm_head = replicated_parameter(torch.randn(a.vocab, a.hidden, generator=gen) * 0.02, mesh)
        self.layers = nn.ModuleList(Block(mesh, a, 10 * i + 1) for i in range(a.layers))
        self.norm = TSPRMSNorm(mesh, a.hidden)

    def forward(self, input_ids, position_ids, shift_labels) -> torch.Tensor:
        """Global mean loss over non-ignored tokens, identical on every rank."""
        x = F.embedding(input_ids, local_replicated(self.embed, self.mesh))
        for layer in self.layers:
            x = layer(x, position_ids)
        logits = F.linear(self.norm(x), local_replicated(self.lm_head, self.mesh))
        loss_sum = F.cross_entropy(logits.flatten(0, 1).float(), shift_labels.flatten(),
                                   reduction="sum")
        count = (shift_labels != -100).sum().to(loss_sum.dtype)
        comm.all_reduce(count, self.mesh.group)
        return loss_sum / count


def run(mesh: TSPMesh, a: argparse.Namespace, data: list[torch.Tensor]):
    model = TinyLlama(mesh, a)
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr)
    losses, times = [], []

    def step(ids: torch.Tensor) -> float:
        batch = tsp_core.shard_batch({"input_ids": ids, "labels": ids}, mesh)
        loss = model(**batch)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        value = loss.detach().clone()
        comm.all_reduce(value, mesh.group)  # sum of per-rank partial losses = the global loss
        return value.item()

    for ids in data:
        dist.barrier()
        t0 = time.perf_counter()
        losses.append(step(ids))
        times.append(time.perf_counter() - t0)
    tracker = MemTracker()
    tracker.track_external(model, opt)
    with tracker:
        step(data[0])
    peak = tracker.get_tracker_snapshot("peak")
    (snap,) = peak.values()
    tokens = a.batch * a.seq
    median = statistics.median(times[a.warmup:])
    return losses, tokens / median, int(snap["Total"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--ffn", type=int, default=704)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=2048)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--tsp", type=int, default=None, help="TSP degree (default: all processes)")
    a = ap.parse_args()

    torch.manual_seed(1234)
    mesh = tsp_core.init_mesh(a.tsp or int(__import__("os").environ.get("WORLD_SIZE", "1")))
    rank = dist.get_rank()
    data = [torch.randint(0, a.vocab, (a.batch, a.seq), generator=torch.Generator().manual_seed(s))
            for s in range(a.steps)]
    # baseline: the same model with a TSP group of one (each process trains the whole model)
    single = TSPMesh(init_device_mesh("cpu", (dist.get_world_size(), 1),
                                      mesh_dim_names=("dp", "tsp")), "tsp")
    base_losses, base_tps, base_peak = run(single, a, data)
    with comm.track() as stats:
        tsp_losses, tsp_tps, tsp_peak = run(mesh, a, data)
    peaks = [torch.zeros(2, dtype=torch.int64) for _ in range(dist.get_world_size())]
    dist.all_gather(peaks, torch.tensor([tsp_peak, base_peak]))

    if rank == 0:
        mib = 1024 ** 2
        print(f"model: {a.layers} layers, hidden {a.hidden}, heads {a.heads}/{a.kv_heads}, "
              f"ffn {a.ffn}, vocab {a.vocab}; batch {a.batch} x seq {a.seq}; TSP degree {mesh.size}")
        print(f"{'step':>4} {'loss (tsp)':>12} {'loss (1 device)':>16}")
        for i, (l1, l2) in enumerate(zip(tsp_losses, base_losses)):
            print(f"{i:>4} {l1:>12.6f} {l2:>16.6f}")
        print(f"max |loss difference| = {max(abs(x - y) for x, y in zip(tsp_losses, base_losses)):.2e}")
        print(f"{'layout':<22} {'tokens/s':>10} {'peak MiB per rank':>20}")
        print(f"{'1 device (no TSP)':<22} {base_tps:>10.0f} {base_peak / mib:>20.1f}")
        per_rank = ", ".join(f"{int(p[0]) / mib:.1f}" for p in peaks)
        print(f"{f'tsp (D={mesh.size})':<22} {tsp_tps:>10.0f} {per_rank:>20}")
        print(f"collectives per rank over {a.steps + 1} TSP steps: "
              + ", ".join(f"{k} {v}" for k, v in sorted(stats.calls.items()))
              + f"; {stats.total_bytes / mib:.1f} MiB")
    dist.barrier()  # no rank tears its connections down while a peer still uses them
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
