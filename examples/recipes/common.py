"""What the five recipes share: their command line, the token file they read, the data-parallel
sampler, and the row each step prints (and appends to ``<out>/metrics.jsonl``).

Data: ``--data FILE`` holds token ids as unsigned 32-bit integers, either a ``.npy`` array (any
shape, read flat) or a raw little-endian ``.bin`` file (``np.array(ids, dtype=np.uint32).tofile(
path)``). It is cut into rows of ``--seq`` tokens (a trailing partial row is dropped); each row is
one training sequence, ``input_ids`` and ``labels`` alike (the model shifts the labels). Rows are
read in file order, so shuffle the documents when you write the file. ``--synthetic`` trains on
random tokens instead, for a first run without data: it must be asked for, never a fallback.

Long context (docs/long-context.md): ``--activation-offload`` and ``--tile-tokens N`` are
``tsp_core.parallelize``'s ``activation_offload`` and ``tile_tokens``. Each recipe gives them to
``load_pretrained``, which converts the model, and to its framework's switch, which checks that
the model it is handed was converted with them (:func:`long_context`).
"""

from __future__ import annotations

import argparse
import json
import os

import numpy as np
import torch
import torch.distributed as dist
from torch.utils.data import Dataset, DistributedSampler

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float64": torch.float64}


def parse_args(doc: str, argv: list[str] | None = None,
               extra: tuple[tuple[str, dict], ...] = ()) -> argparse.Namespace:
    """The recipes' shared flags (and a recipe's own ``extra`` ones)."""
    cuda = torch.cuda.is_available()
    ap = argparse.ArgumentParser(description=doc.splitlines()[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--model", required=True,
                    help="a save_pretrained directory (config.json + *.safetensors)")
    source = ap.add_mutually_exclusive_group(required=True)
    source.add_argument("--data", help=".npy or .bin file of uint32 token ids (common.py)")
    source.add_argument("--synthetic", action="store_true", help="random tokens, no data file")
    ap.add_argument("--seq", type=int, default=131072 if cuda else 1024,
                    help="tokens per row (default 131072 on CUDA, 1024 on CPU)")
    ap.add_argument("--batch", type=int, default=1, help="rows per data-parallel replica per step")
    ap.add_argument("--steps", type=int, default=1000, help="train until this optimizer step")
    ap.add_argument("--lr", type=float, default=1e-5)
    ap.add_argument("--dtype", choices=list(DTYPES), default="bfloat16" if cuda else "float32",
                    help="parameter dtype (default bfloat16 on CUDA, float32 on CPU)")
    ap.add_argument("--tsp", type=int, default=None,
                    help="TSP degree (default: every process of a node); data parallel takes "
                         "the rest of the processes")
    ap.add_argument("--out", default="runs/recipe", help="checkpoints and logs go here")
    ap.add_argument("--save-every", type=int, default=200, help="checkpoint every N steps")
    ap.add_argument("--resume", action="store_true", help="continue from the latest checkpoint")
    # long context (docs/long-context.md); activation checkpointing is always on
    ap.add_argument("--activation-offload", action="store_true",
                    help="keep each checkpointed decoder layer's input in host memory between "
                         "its forward and its backward (the framework's activation_offload switch)")
    ap.add_argument("--tile-tokens", type=int, default=None,
                    help="tokens per tile of the MLP and the loss (default: chosen from the "
                         "model's sizes, a tile's working set under 256 MiB)")
    for flag, options in extra:
        ap.add_argument(flag, **options)
    a = ap.parse_args(argv)
    if a.tile_tokens is not None and a.tile_tokens <= 0:  # before any process group
        ap.error(f"--tile-tokens {a.tile_tokens}: a tile is a positive number of tokens; leave "
                 f"it out to choose it from the model's sizes")
    a.torch_dtype, a.tsp_given = DTYPES[a.dtype], a.tsp is not None
    if a.tsp is None:
        a.tsp = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1")))
    return a


class TokenRows(Dataset):
    """Rows of ``seq`` token ids from a uint32 file (module docstring), or random ones, starting
    at row ``start`` (a resumed run skips the rows already trained on)."""

    def __init__(self, a: argparse.Namespace, vocab_size: int, start: int = 0) -> None:
        self.seq, self.vocab, self.start = a.seq, vocab_size, start
        self.tokens = None if a.synthetic else read_tokens(a.data)
        world = int(os.environ.get("WORLD_SIZE", "1"))  # enough rows for every replica's steps
        total = a.steps * a.batch * world if a.synthetic else len(self.tokens) // a.seq
        if total <= start:
            raise ValueError(f"{a.data} holds {total} rows of {a.seq} tokens; {start} were "
                             f"already trained on: write more data or lower --steps")
        self.rows = total - start

    def __len__(self) -> int:
        return self.rows

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        row = self.start + i
        if self.tokens is None:
            ids = torch.randint(0, self.vocab, (self.seq,),
                                generator=torch.Generator().manual_seed(row))
        else:
            part = self.tokens[row * self.seq:(row + 1) * self.seq]
            ids = torch.from_numpy(part.astype(np.int64))
        return {"input_ids": ids, "labels": ids}


def read_tokens(path: str) -> np.ndarray:
    """The file's token ids as a flat uint32 array, memory-mapped (nothing is read yet)."""
    if path.endswith(".npy"):
        tokens = np.load(path, mmap_mode="r")
        if tokens.dtype != np.uint32:
            raise ValueError(f"{path} holds {tokens.dtype} token ids; write them as uint32")
        return tokens.reshape(-1)
    if path.endswith(".bin"):
        return np.memmap(path, dtype=np.uint32, mode="r")
    raise ValueError(f"--data {path}: expected a .npy or .bin file of uint32 token ids")


def data_parallel_sampler(data: Dataset, mesh) -> DistributedSampler:
    """Every rank of a TSP group (consecutive global ranks) gets the same rows; data-parallel
    replicas get different ones. In file order: replica r takes rows r, r + dp, ..."""
    return DistributedSampler(data, num_replicas=mesh.dp_size,
                              rank=dist.get_rank() // mesh.size, shuffle=False)


def report(a: argparse.Namespace, step: int, loss: float, figures: dict[str, float],
           log_file: bool = True) -> None:
    """On global rank 0: print the step's row and (unless the framework's own logger has it)
    append it to ``<out>/metrics.jsonl``."""
    if dist.is_initialized() and dist.get_rank() != 0:
        return
    row = json.dumps({"step": step, "loss": loss, **figures})
    print(f"recipe {row}", flush=True)
    if not log_file:
        return
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "metrics.jsonl"), "a") as f:
        f.write(row + "\n")


def long_context(a: argparse.Namespace) -> dict:
    """``tsp_core.parallelize``'s long-context options from the flags (activation checkpointing,
    which offload needs, is on in every recipe)."""
    return {"tile_tokens": a.tile_tokens, "activation_offload": a.activation_offload}


def device() -> torch.device:
    """This process's device: its GPU under a launcher, else the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")
