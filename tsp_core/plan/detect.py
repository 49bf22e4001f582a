"""Find out what machine a job runs on: GPUs per node and their kind (torch.cuda, which also covers
ROCm), the link between a node's GPUs (``nvidia-smi topo -m`` / ``rocm-smi --showtopo`` when those
tools exist) and the node count (the launcher's environment). Anything can be overridden by
explicit values or a small JSON file (``TSP_HARDWARE=path``), because detection on a login node or
inside a container often sees less than the job will get.

The parsers take text, so they are tested on recorded outputs without a GPU.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from .hardware import DEVICES, PCIE_GBPS, Cluster, Device, device

OVERRIDE_KEYS = ("gpu", "gpus_per_node", "nodes", "inter_node_gbps", "intra_gbps", "memory_gb")


@dataclass
class Topology:
    """What a topology tool said about one node."""

    gpus: int
    link: str                  # "nvlink", "xgmi" or "pcie": the slowest link between two GPUs
    detail: str = ""           # e.g. "NV18" (bonded NVLinks), "XGMI"


def parse_nvidia_topo(text: str) -> Topology:
    """``nvidia-smi topo -m``: a GPU x GPU matrix whose cells are X (self), NV# (# bonded NVLinks)
    or a PCIe path (PIX, PXB, PHB, NODE, SYS). NIC rows and columns are ignored."""
    rows = [ln.split("\t") if "\t" in ln else ln.split() for ln in text.splitlines()]
    header = next((r for r in rows if any(c.strip() == "GPU0" for c in r)), None)
    if header is None:
        raise ValueError("no GPU0 column in the nvidia-smi topo -m output")
    cols = [c.strip() for c in header]
    gpu_cols = [i for i, c in enumerate(cols) if re.fullmatch(r"GPU\d+", c)]
    cells: list[str] = []
    gpus = 0
    for r in rows:
        if r and re.fullmatch(r"GPU\d+", r[0].strip()):
            gpus += 1
            # a tab-separated row has an empty first header cell: align by position
            offset = 0 if cols and cols[0] == "" else 1
            for i in gpu_cols:
                j = i if offset == 0 else i + 1
                if j < len(r):
                    cells.append(r[j].strip())
    links = [c for c in cells if c and c != "X"]
    if not gpus:
        raise ValueError("no GPU rows in the nvidia-smi topo -m output")
    if links and all(c.startswith("NV") for c in links):
        return Topology(gpus, "nvlink", min(links, key=lambda c: int(c[2:] or 0)))
    return Topology(gpus, "nvlink" if gpus == 1 else "pcie",
                    next((c for c in links if not c.startswith("NV")), ""))


def parse_rocm_topo(text: str) -> Topology:
    """``rocm-smi --showtopo``: the "Link Type between two GPUs" matrix (XGMI or PCIE; the diagonal
    is 0)."""
    lines = text.splitlines()
    try:
        start = next(i for i, ln in enumerate(lines) if "Link Type between two GPUs" in ln)
    except StopIteration:
        raise ValueError("no 'Link Type between two GPUs' section in the rocm-smi output") from None
    gpus, links = 0, []
    for ln in lines[start + 2:]:
        parts = ln.split()
        if not parts or not re.fullmatch(r"GPU\d+", parts[0]):
            break
        gpus += 1
        links += [p for p in parts[1:] if not p.isdigit()]
    if not gpus:
        raise ValueError("no GPU rows in the rocm-smi link-type matrix")
    if links and all(p.upper() == "XGMI" for p in links):
        return Topology(gpus, "xgmi", "XGMI")
    return Topology(gpus, "xgmi" if gpus == 1 else "pcie", next(iter(links), ""))


def nodes_from_env(env: Mapping[str, str]) -> tuple[int | None, int | None, str]:
    """(nodes, GPUs per node, source) from the launcher's variables: Slurm (``SLURM_JOB_NUM_NODES``,
    ``SLURM_GPUS_ON_NODE`` / ``SLURM_NTASKS_PER_NODE``), torchrun (``WORLD_SIZE`` /
    ``LOCAL_WORLD_SIZE``), Open MPI (``OMPI_COMM_WORLD_SIZE`` / ``..._LOCAL_SIZE``)."""
    def num(key: str) -> int | None:
        value = re.match(r"\d+", env.get(key, ""))
        return int(value.group()) if value else None

    nodes = num("SLURM_JOB_NUM_NODES") or num("SLURM_NNODES")
    if nodes:
        per = num("SLURM_GPUS_ON_NODE") or num("SLURM_NTASKS_PER_NODE")
        return nodes, per, "slurm"
    for world_key, local_key, name in (
            ("WORLD_SIZE", "LOCAL_WORLD_SIZE", "torchrun"),
            ("OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE", "mpi")):
        world, local = num(world_key), num(local_key)
        if world and local:
            if world % local:
                raise ValueError(
                    f"{world_key} ({world}) is not a multiple of {local_key} ({local})")
            return world // local, local, name
    return None, None, "none"


def device_from_name(name: str) -> Device | None:
    """The table entry for a torch device name ("NVIDIA H100 80GB HBM3", "AMD Instinct MI300X")."""
    key = name.lower().replace(" ", "").replace("-", "")
    for k in DEVICES:
        if k in key:
            return DEVICES[k]
    return None


def _run_tool(cmd: list[str]) -> str | None:
    if shutil.which(cmd[0]) is None:
        return None
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=20, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None


@dataclass
class Detected:
    cluster: Cluster
    sources: dict[str, str] = field(default_factory=dict)  # what came from where


def load_overrides(path: str | None) -> dict:
    """The hardware file: JSON with any of ``OVERRIDE_KEYS``."""
    if not path:
        return {}
    with open(path) as f:
        data = json.load(f)
    unknown = sorted(set(data) - set(OVERRIDE_KEYS))
    if unknown:
        raise ValueError(f"unknown keys {unknown} in {path}; allowed: {list(OVERRIDE_KEYS)}")
    return data


def detect(overrides: Mapping[str, object] | None = None, env: Mapping[str, str] | None = None,
           run: Callable[[list[str]], str | None] = _run_tool, torch_devices=None) -> Detected:
    """The cluster to plan for. Precedence: ``overrides`` > the hardware file (``TSP_HARDWARE``) >
    detection. ``torch_devices`` is ``[(name, total_memory_bytes), ...]`` (default: torch.cuda)."""
    env = os.environ if env is None else env
    given = {**load_overrides(env.get("TSP_HARDWARE")),
             **{k: v for k, v in (overrides or {}).items() if v is not None}}
    src: dict[str, str] = {k: "given" for k in given}
    if torch_devices is None:
        torch_devices = _torch_devices()
    dev = device(str(given["gpu"])) if "gpu" in given else None
    if dev is None and torch_devices:
        dev = device_from_name(torch_devices[0][0])
        if dev is not None:
            src["gpu"] = f"torch.cuda ({torch_devices[0][0]})"
    if dev is None:
        raise ValueError("cannot tell the GPU kind (no GPU visible, or one the table does not "
                         f"know); pass --gpu one of {', '.join(DEVICES)} or set gpu in a hardware "
                         f"file")
    if "memory_gb" in given:
        dev = Device(**{**dev.__dict__, "memory_gb": float(given["memory_gb"])})
    elif torch_devices and "gpu" not in given:
        dev = Device(**{**dev.__dict__, "memory_gb": torch_devices[0][1] / 1e9})
        src["memory_gb"] = "torch.cuda"
    nodes, per, launcher = nodes_from_env(env)
    intra = given.get("intra_gbps")
    topo = None
    if intra is None:
        text = run(["nvidia-smi", "topo", "-m"])
        parse = parse_nvidia_topo
        if text is None:
            text, parse = run(["rocm-smi", "--showtopo"]), parse_rocm_topo
        if text is not None:
            topo = parse(text)
            tool = "nvidia-smi" if parse is parse_nvidia_topo else "rocm-smi"
            src["link"] = f"{topo.detail or topo.link} ({tool})"
            if topo.link == "pcie":
                intra = PCIE_GBPS
    gpn = (given.get("gpus_per_node") or per or (topo.gpus if topo else None)
           or len(torch_devices or []))
    if "gpus_per_node" not in given:
        src["gpus_per_node"] = launcher if per else ("topology tool" if topo else "torch.cuda")
    if not gpn:
        raise ValueError("cannot tell how many GPUs a node has; pass --gpus-per-node")
    n = given.get("nodes") or nodes or 1
    if "nodes" not in given:
        src["nodes"] = launcher if nodes else "default (1)"
    cluster = Cluster(dev, int(gpn), int(n), float(given.get("inter_node_gbps", 400.0)),
                      intra_gbps=None if intra is None else float(intra))
    return Detected(cluster, src)


def _torch_devices() -> list[tuple[str, int]]:
    import torch

    if not torch.cuda.is_available():
        return []
    return [(torch.cuda.get_device_name(i), torch.cuda.get_device_properties(i).total_memory)
            for i in range(torch.cuda.device_count())]
