"""What the planner assumes about a machine: per-device peak, achievable efficiency, memory and
links, and the cluster a job runs on.

Peaks and memory sizes are the vendors' published figures (dense bf16, no sparsity). The
efficiencies are assumptions, not measurements of this library: the fraction of peak that large
bf16 GEMMs and flash-attention kernels typically reach on each device, and the fraction of a link's
peak that ring collectives typically reach. ``docs/planning.md`` says where each is uncertain; every
one can be overridden (``tsp plan --matmul-efficiency ...`` or a hardware file).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

GB = 1e9


@dataclass(frozen=True)
class Device:
    name: str
    peak_tflops: float          # dense bf16
    memory_gb: float            # vendor GB (1e9 bytes)
    # GB/s per GPU per direction to its node's peers (NVLink / Infinity Fabric)
    intra_gbps: float
    matmul_efficiency: float    # fraction of peak for the large GEMMs (assumed)
    attention_efficiency: float  # fraction of peak for flash attention (assumed)

    @property
    def memory_bytes(self) -> float:
        return self.memory_gb * GB


DEVICES: dict[str, Device] = {
    # MI300X: 1307 TFLOP/s bf16, 192 GB HBM3, 7 Infinity Fabric links x 64 GB/s per direction
    "mi300x": Device("mi300x", 1307.4, 192.0, 448.0, 0.45, 0.35),
    # H100 SXM5: 989 TFLOP/s bf16, 80 GB, NVLink 4 (18 links) 450 GB/s per direction
    "h100": Device("h100", 989.4, 80.0, 450.0, 0.55, 0.45),
    # H200: H100's compute, 141 GB HBM3e, same NVLink
    "h200": Device("h200", 989.4, 141.0, 450.0, 0.55, 0.45),
    # A100 SXM 80GB: 312 TFLOP/s bf16, NVLink 3 (12 links) 300 GB/s per direction
    "a100": Device("a100", 312.0, 80.0, 300.0, 0.6, 0.5),
}
# GB/s per direction between GPUs with no NVLink / XGMI (PCIe 4/5 through a switch)
PCIE_GBPS = 25.0


@dataclass(frozen=True)
class Cluster:
    """GPUs per node, node count and the two link classes a group can span."""

    device: Device
    gpus_per_node: int
    nodes: int
    # Gb/s per GPU (one NIC each), the usual InfiniBand / RoCE figure
    inter_node_gbps: float = 400.0
    link_efficiency: float = 0.75    # fraction of a link's peak a ring collective reaches (assumed)
    intra_latency_us: float = 10.0   # per ring step inside a node (assumed)
    inter_latency_us: float = 25.0   # per ring step across nodes (assumed)
    intra_gbps: float | None = None  # override the device's intra-node figure (e.g. detected PCIe)

    @property
    def gpus(self) -> int:
        return self.gpus_per_node * self.nodes

    @property
    def intra_bytes_per_s(self) -> float:
        gbps = self.intra_gbps if self.intra_gbps is not None else self.device.intra_gbps
        return gbps * GB * self.link_efficiency

    @property
    def inter_bytes_per_s(self) -> float:
        return self.inter_node_gbps / 8 * GB * self.link_efficiency

    def with_overrides(self, **kw) -> Cluster:
        return replace(self, **{k: v for k, v in kw.items() if v is not None})


def device(name: str) -> Device:
    key = name.lower().replace("-", "").replace(" ", "")
    if key not in DEVICES:
        raise ValueError(f"unknown GPU {name!r}; choose from {', '.join(DEVICES)} (or describe it "
                         f"in a hardware file: see docs/planning.md)")
    return DEVICES[key]
