"""FSDP2 (``fully_shard``) in ``tsp simulate``: one rank of a ``degree x dp_shard`` world runs the
real ``fully_shard`` under the fake process group and ``FakeTensorMode``, measured by
``FSDPMemTracker`` (``torch.distributed._tools.fsdp2_mem_tracker``), which tells FSDP2's own
buffers apart from the sharded model state (docs/design.md "FSDP2 on the data-parallel axis",
docs/memory.md "FSDP2").

Every layout is wrapped the same way, so the comparison stays like for like: ``fully_shard`` on
each decoder layer, then on the root (embedding, final norm, LM head), over the "dp_shard" dim,
``reshard_after_forward=True``, no ``MixedPrecisionPolicy`` (parameters, gradients and AdamW
moments all in the run's ``--dtype``, as without FSDP2). TSP gets it from
:func:`tsp_core.parallelize` (:mod:`tsp_core.distributed.fsdp`) on ``init_mesh(D, dp_shard=N)``'s
("dp_replicate", "dp_shard", "tsp") mesh; the tensor-parallel baselines from plain
``fully_shard`` on a ("dp_shard", "cp", "tp") mesh, their DTensor shards on "tp" (FSDP2's
2-D path, as torchtitan composes TP and FSDP2). Context-parallel layouts are not wrapped:
torchtitan shards them over the flattened (dp_shard, cp) dims, which this module does not build.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch import nn

    from ..baselines.layouts import LayoutSpec, ParallelModel
    from ..distributed.mesh import TSPMesh

# the layouts the simulation wraps in FSDP2 (see the module docstring for the others)
FSDP_LAYOUTS = ("tsp", "tp", "tp-sp")
# FSDPMemTracker's reference types -> the simulation's categories. Sharded parameters, gradients
# and optimizer states keep the names of a run without FSDP2; the rest is FSDP2's working set.
FSDP_CATEGORIES = {"Sharded Param": "parameters", "Sharded Grad": "gradients",
                   "OptState": "optimizer_states", "Activation": "activations",
                   "Temp": "temporaries", "Buffer": "buffers", "Inputs": "inputs",
                   "Unsharded Param": "unsharded_parameters",
                   "Unsharded Grad": "unsharded_gradients", "All Gather": "all_gather",
                   "Reduce Scatter": "reduce_scatter"}
# the categories that exist only because of FSDP2 (the "fsdp" column of `tsp simulate`)
FSDP_WORKING_SET = ("unsharded_parameters", "unsharded_gradients", "all_gather",
                    "reduce_scatter")


def check_dp_shard(layout: str, degree: int, dp_shard: int) -> None:
    """Refuse a ``dp_shard`` the simulation cannot build, naming the numbers."""
    if not isinstance(dp_shard, int) or dp_shard < 1:
        raise ValueError(f"dp_shard ({dp_shard}) must be a positive integer (1: no FSDP2)")
    if dp_shard > 1 and layout not in FSDP_LAYOUTS:
        raise ValueError(f"dp_shard ({dp_shard}) > 1 is simulated for {', '.join(FSDP_LAYOUTS)}, "
                         f"not {layout} at degree {degree}: FSDP2 over context parallel shards "
                         f"over the flattened (dp_shard, cp) dims, which is not built here")


def build_mesh(spec: LayoutSpec, dp_shard: int) -> TSPMesh:
    """The mesh of ``spec`` with a "dp_shard" dim of ``dp_shard`` ranks, over the (fake) world of
    ``spec.degree * dp_shard`` ranks. TSP's is ``tsp_core.init_mesh``'s own."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from ..distributed.mesh import TSPMesh, init_mesh

    world = dist.get_world_size()
    if world != spec.degree * dp_shard:
        raise ValueError(f"{spec.label} at degree {spec.degree} x dp_shard {dp_shard} needs "
                         f"{spec.degree * dp_shard} ranks, the world has {world}")
    if spec.name == "tsp":
        return init_mesh(spec.tp, dp_shard, dp_shard=dp_shard)
    dm = init_device_mesh("cpu", (dp_shard, spec.cp, spec.tp),
                          mesh_dim_names=("dp_shard", "cp", "tp"))
    return TSPMesh(dm, "cp")


def shard_baseline(pm: ParallelModel) -> None:
    """``fully_shard`` a tensor-parallel baseline (built on :func:`build_mesh`'s mesh) the way
    :func:`tsp_core.distributed.fsdp.apply_fsdp` wraps TSP: each decoder layer, then the root. FSDP2
    sums the data-parallel gradients itself, so the baseline's own data-parallel hooks go. Call it
    outside ``FakeTensorMode``: FSDP2 builds its 2-D mesh from the real rank map (under the fake
    mode that raises), and the fake parameters carry their mode with them."""
    from torch.distributed.fsdp import fully_shard

    dm = pm.mesh.device_mesh
    pm.remove_gradient_sync()
    for layer in pm.layers:
        fully_shard(layer, mesh=dm["dp_shard"], reshard_after_forward=True)
    fully_shard(pm.model, mesh=dm["dp_shard"], reshard_after_forward=True)


def tracker(model: nn.Module, optimizer):
    """``FSDPMemTracker`` of ``model`` (the FSDP2 root) and ``optimizer``."""
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker

    return FSDPMemTracker(model, optimizer)


def categories(per_kind: dict) -> dict[str, int]:
    """One device's entry of ``FSDPMemTracker``'s ``{device: {reftype: bytes, "Total": bytes}}``
    -> bytes by category."""
    return {FSDP_CATEGORIES.get(str(getattr(k, "value", k)), str(k)): int(v)
            for k, v in per_kind.items() if str(k) != "Total"}
