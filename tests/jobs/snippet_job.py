"""Run the Python snippets of the docs as written (``python tests/jobs/snippet_job.py SPEC``, under
torchrun for the 2-process ones): SPEC is a JSON list of blocks ``{"path", "line", "code"}`` from
tests/project/test_snippets.py, run one after the other in these processes.

Each block runs as its own ``__main__`` module (a fresh namespace, installed in ``sys.modules`` for
its run as ``runpy`` does, so its classes pickle), compiled under its doc's path with its own line
numbers: a traceback names the doc's lines. Its working directory is a fresh folder (the same
one on every rank). Between blocks every rank starts over as a fresh launch would: the process
groups are destroyed, Accelerate's process state is reset, the environment is restored, and the
next block rendezvouses on a fresh port (re-initialising on the launch's own store would read the
previous group's addresses). No code is added to a block. torch's random state is left as it is
(torch 2.13 seeds each process differently anyway: the snippets seed before building a model).

Each rank appends ``ok PATH:LINE`` to ``WORKDIR/rank<R>.txt`` after a block (a file per rank: the
ranks' stderr interleave), or ``failed PATH:LINE``, prints ``snippet failed: PATH:LINE on rank R``
with the traceback to stderr and exits 1 at once (a peer may be waiting in a collective; the
launcher ends it)."""

from __future__ import annotations

import json
import os
import socket
import sys
import traceback
import types

FRESH_PORT_KEY = "tsp_snippets/port/{}"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def launch_store():
    """A client of the launcher's store (torchrun's agent store), to agree on each block's port."""
    import torch.distributed as dist

    return dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                         int(os.environ["WORLD_SIZE"]), is_master=False)


def start_over(index: int, environ: dict[str, str], store) -> None:
    """Leave these processes as a fresh launch would find them (see the module docstring)."""
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
    if "accelerate" in sys.modules:
        from accelerate.state import AcceleratorState, GradientState, PartialState

        AcceleratorState._reset_state(True)
        PartialState._reset_state()
        GradientState._reset_state()
    os.environ.clear()
    os.environ.update(environ)
    if store is not None:   # rank 0 serves the block's rendezvous on a port the others read
        key = FRESH_PORT_KEY.format(index)
        if int(environ["RANK"]) == 0:
            store.set(key, str(free_port()))
        os.environ["MASTER_PORT"] = store.get(key).decode()
        os.environ["TORCHELASTIC_USE_AGENT_STORE"] = "False"


def run_block(block: dict, workdir: str) -> None:
    """Execute one block as ``__main__`` in ``workdir``."""
    code = compile("\n" * block["line"] + block["code"], block["path"], "exec")
    module = types.ModuleType("__main__")
    module.__file__ = block["path"]
    saved_main, saved_cwd, saved_argv = sys.modules["__main__"], os.getcwd(), sys.argv
    os.makedirs(workdir, exist_ok=True)
    os.chdir(workdir)
    sys.modules["__main__"], sys.argv = module, [block["path"]]
    try:
        exec(code, module.__dict__)
    finally:
        sys.modules["__main__"], sys.argv = saved_main, saved_argv
        os.chdir(saved_cwd)


def main(spec: str, workdir: str) -> None:
    with open(spec) as f:
        blocks = json.load(f)
    rank = os.environ.get("RANK", "0")
    os.makedirs(workdir, exist_ok=True)
    results = open(os.path.join(workdir, f"rank{rank}.txt"), "a", buffering=1)
    environ = dict(os.environ)
    store = launch_store() if "WORLD_SIZE" in os.environ else None
    for index, block in enumerate(blocks):
        where = f"{block['path']}:{block['line']}"
        start_over(index, environ, store)
        try:
            run_block(block, os.path.join(workdir, f"block{index}"))
        except BaseException:  # noqa: BLE001 - reported, then this launch ends
            results.write(f"failed {where}\n")
            print(f"snippet failed: {where} on rank {rank}\n{traceback.format_exc()}",
                  file=sys.stderr, flush=True)
            os._exit(1)
        results.write(f"ok {where}\n")
    start_over(len(blocks), environ, None)
    from tsp_core.distributed.shutdown import shutdown

    shutdown(0)


if __name__ == "__main__":
    main(*sys.argv[1:])
