"""The TSP device mesh: which ranks share weights and tokens, and who their ring neighbours are.

A TSP group is the innermost dim of a named ``DeviceMesh`` so that it spans consecutive ranks (one
node). Every other dim is data parallel: it replicates the TSP group, or, for the dim named
``shard_dim`` (``dp_shard``), holds FSDP2 shards of each rank's TSP shard (docs/design.md "FSDP2 on
the data-parallel axis"), except a pipeline dim (``pp_dim``, outermost), whose ranks hold different
stages of the model (:mod:`tsp_core.pipeline`). Code always names the dim it uses instead of
assuming a 1-D mesh.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Literal

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from .torch_features import FSDP2_SPMD, require

Layout = Literal["zigzag", "contiguous"]
LAYOUTS: tuple[str, ...] = ("zigzag", "contiguous")


@dataclass(frozen=True)
class TSPMesh:
    """A device mesh plus the name of its TSP dim, the token layout used on that dim and, when
    FSDP2 shards model state over data parallel too, the name of the data-parallel dim it shards
    over (``shard_dim``; every other non-TSP dim then holds replicas: HSDP), and, with pipeline
    parallelism, the name of the dim whose ranks hold different stages (``pp_dim``: it is neither
    TSP nor data parallel; :meth:`stage_mesh` is the mesh of one stage)."""

    device_mesh: DeviceMesh
    dim: str = "tsp"
    layout: Layout = "zigzag"
    shard_dim: str | None = None
    pp_dim: str | None = None

    def __post_init__(self) -> None:
        names = self.device_mesh.mesh_dim_names or ()
        if self.dim not in names:
            raise ValueError(f"mesh has no dim named {self.dim!r} (its dims are {names}); "
                             f"pass the name of the dim that holds the TSP group")
        if self.shard_dim is not None and (self.shard_dim not in names
                                           or self.shard_dim == self.dim):
            raise ValueError(f"shard_dim {self.shard_dim!r} must name a data-parallel dim of the "
                             f"mesh (its dims are {names}; {self.dim!r} holds the TSP group)")
        if self.layout not in LAYOUTS:
            raise ValueError(f"layout {self.layout!r} is not one of {LAYOUTS}")
        if self.pp_dim is not None and (self.pp_dim not in names
                                        or self.pp_dim in (self.dim, self.shard_dim)):
            raise ValueError(f"pp_dim {self.pp_dim!r} must name a dim of the mesh other than the "
                             f"TSP and shard dims (its dims are {names})")

    @classmethod
    def from_device_mesh(cls, mesh: DeviceMesh, dim: str, layout: Layout = "zigzag",
                         shard_dim: str | None = None, pp_dim: str | None = None) -> TSPMesh:
        """Wrap a mesh a framework already built (Accelerate calls its dim "tp", Lightning
        "tensor_parallel"; Accelerate's FSDP2 dim is "dp_shard"; torchtitan's pipeline dim
        "pp")."""
        return cls(mesh, dim, layout, shard_dim, pp_dim)

    @property
    def group(self) -> dist.ProcessGroup:
        return self.device_mesh.get_group(self.dim)

    @property
    def size(self) -> int:
        return self.device_mesh.size(self._dim_index)

    @property
    def rank(self) -> int:
        """This process's rank inside its TSP group (0..size-1)."""
        return self.device_mesh.get_local_rank(self.dim)

    @property
    def device_type(self) -> str:
        return self.device_mesh.device_type

    @property
    def other_dims(self) -> tuple[str, ...]:
        """Dims that replicate the TSP group (data parallel and friends; not the pipeline dim)."""
        return tuple(n for n in self.device_mesh.mesh_dim_names if n not in (self.dim, self.pp_dim))

    @property
    def all_groups(self) -> list[dist.ProcessGroup]:
        """One group per mesh dim, TSP first: reducing over each in turn reduces over the mesh."""
        return [self.group] + [self.device_mesh.get_group(n) for n in self.other_dims]

    @property
    def dp_size(self) -> int:
        """Number of TSP-group replicas (product of every non-TSP dim but the pipeline dim)."""
        return self.device_mesh.size() // self.size // self.pp_size

    @property
    def pp_size(self) -> int:
        """Number of pipeline ranks (1 without a pipeline dim)."""
        if self.pp_dim is None:
            return 1
        return self.device_mesh.size(self.device_mesh.mesh_dim_names.index(self.pp_dim))

    @property
    def pp_rank(self) -> int:
        """This process's rank on the pipeline dim (0 without one)."""
        return 0 if self.pp_dim is None else self.device_mesh.get_local_rank(self.pp_dim)

    @property
    def pp_group(self) -> dist.ProcessGroup:
        """The ranks that hold the other stages of this rank's TSP and data-parallel position."""
        if self.pp_dim is None:
            raise ValueError("this mesh has no pipeline dim: build it with "
                             "tsp_core.init_mesh(tsp_size, pp_size=P)")
        return self.device_mesh.get_group(self.pp_dim)

    def stage_mesh(self) -> TSPMesh:
        """The mesh of this rank's pipeline stage: every dim but the pipeline dim (the TSP and
        data-parallel groups of this stage); the mesh itself without a pipeline dim."""
        if self.pp_dim is None:
            return self
        names = tuple(n for n in self.device_mesh.mesh_dim_names if n != self.pp_dim)
        sub = self.device_mesh[names[0] if len(names) == 1 else names]
        return TSPMesh(sub, self.dim, self.layout, self.shard_dim)

    @property
    def fsdp_size(self) -> int:
        """How many ranks FSDP2 shards each TSP shard over (1: no FSDP2)."""
        if self.shard_dim is None:
            return 1
        return self.device_mesh.size(self.device_mesh.mesh_dim_names.index(self.shard_dim))

    @property
    def replicate_dims(self) -> tuple[str, ...]:
        """Data-parallel dims that hold whole replicas (every non-TSP dim but ``shard_dim``)."""
        return tuple(n for n in self.other_dims if n != self.shard_dim)

    @property
    def _dim_index(self) -> int:
        return self.device_mesh.mesh_dim_names.index(self.dim)

    def next_rank(self) -> int:
        """Group rank of the ring successor."""
        return (self.rank + 1) % self.size

    def prev_rank(self) -> int:
        """Group rank of the ring predecessor."""
        return (self.rank - 1) % self.size


def _default_backend() -> str:
    return "nccl" if torch.cuda.is_available() else "gloo"


def check_timeout(timeout: timedelta | float | None) -> timedelta | None:
    """``timeout`` as a timedelta (a number is seconds), None left as is; raises unless it is a
    positive duration."""
    if timeout is None:
        return None
    if isinstance(timeout, bool) or not isinstance(timeout, (timedelta, int, float)):
        raise TypeError(f"timeout must be a datetime.timedelta or a number of seconds, got "
                        f"{type(timeout).__name__} {timeout!r}")
    seconds = timeout.total_seconds() if isinstance(timeout, timedelta) else float(timeout)
    if not (seconds > 0 and math.isfinite(seconds)):
        raise ValueError(f"timeout ({timeout!r}) must be a positive duration: how long a "
                         f"collective may wait for the other ranks before it raises, e.g. "
                         f"timeout=600 or datetime.timedelta(minutes=10)")
    return timedelta(seconds=seconds)


def set_timeout(mesh: TSPMesh | DeviceMesh, timeout: timedelta | float) -> None:
    """Give every process group of ``mesh`` (one per dim, on every rank) and the default process
    group ``timeout``: a collective on one of them that the other ranks do not join within it
    raises on gloo (NCCL's watchdog aborts the process). For a mesh a framework built, with
    groups that kept torch's default (30 minutes on gloo, 10 on NCCL)."""
    timeout = check_timeout(timeout)
    device_mesh = mesh.device_mesh if isinstance(mesh, TSPMesh) else mesh
    groups = [device_mesh.get_group(name) for name in device_mesh.mesh_dim_names]
    for group in [dist.group.WORLD, *groups]:
        dist.distributed_c10d._set_pg_timeout(timeout, group)


def init_process_group_from_env(timeout: timedelta | None = None) -> None:
    """Initialise the default process group from the launcher's environment (torchrun sets RANK,
    WORLD_SIZE, MASTER_ADDR, MASTER_PORT). Without a launcher this is a one-process world.
    ``timeout``: the group's (None: torch's default)."""
    if dist.is_initialized():
        return
    backend = _default_backend()
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True" and restart != "0":
        # A restarted torchrun job reuses the agent's store, which still holds the previous
        # attempt's addresses: gloo read them and failed with "Connection refused" about half the
        # time. Keys of this attempt get their own prefix.
        store = dist.PrefixStore(f"/tsp/attempt_{restart}", dist.TCPStore(
            os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
            int(os.environ["WORLD_SIZE"]), is_master=False))
        dist.init_process_group(backend, store=store, rank=int(os.environ["RANK"]),
                                world_size=int(os.environ["WORLD_SIZE"]), timeout=timeout)
    elif "WORLD_SIZE" in os.environ:
        dist.init_process_group(backend, timeout=timeout)
    else:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1,
                                timeout=timeout)


def check_mesh_shape(world_size: int, tsp_size: int, dp_size: int | None) -> int:
    """Return dp_size after checking ``dp_size * tsp_size == world_size``; raises with the
    numbers."""
    if tsp_size < 1:
        raise ValueError(f"tsp_size ({tsp_size}) must be at least 1")
    if world_size % tsp_size:
        raise ValueError(f"tsp_size ({tsp_size}) must divide the world size ({world_size}); "
                         f"launch a multiple of {tsp_size} processes or pick another tsp_size")
    if dp_size is None:
        return world_size // tsp_size
    if dp_size * tsp_size != world_size:
        raise ValueError(f"dp_size ({dp_size}) * tsp_size ({tsp_size}) = {dp_size * tsp_size} "
                         f"does not match the world size ({world_size}); leave dp_size unset to "
                         f"use {world_size // tsp_size}")
    return dp_size


def check_pp_size(world_size: int, pp_size: int) -> int:
    """Return the processes of one pipeline stage, ``world_size / pp_size``, after checking that
    ``pp_size`` divides the world; raises with the numbers."""
    if isinstance(pp_size, bool) or not isinstance(pp_size, int) or pp_size < 1:
        raise ValueError(f"pp_size ({pp_size!r}) must be a whole number of pipeline ranks, at "
                         f"least 1")
    if world_size % pp_size:
        raise ValueError(f"pp_size ({pp_size}) must divide the world size ({world_size}); launch "
                         f"a multiple of {pp_size} processes or pick another pp_size")
    return world_size // pp_size


def warn_if_spanning_nodes(tsp_size: int, local_world_size: int | None = None) -> bool:
    """Ranks are numbered node by node and TSP is the innermost dim, so a TSP group stays inside a
    node exactly when its size divides the node's process count (``LOCAL_WORLD_SIZE``). Otherwise
    the group's weight and K/V traffic rides the network: allowed, but warned. True if it spans."""
    if local_world_size is None:
        local = os.environ.get("LOCAL_WORLD_SIZE")
        local_world_size = int(local) if local and local.isdigit() else None
    if not local_world_size or local_world_size % tsp_size == 0:
        return False
    import warnings

    warnings.warn(f"tsp_size ({tsp_size}) does not divide the {local_world_size} processes of a "
                  f"node (LOCAL_WORLD_SIZE): TSP groups span nodes and their weight and K/V "
                  f"traffic rides the network; a divisor of {local_world_size} keeps each group "
                  f"inside a node",
                  stacklevel=3)
    return True


def check_dp_shard(dp_size: int, dp_shard: int) -> int:
    """Return ``dp_replicate = dp_size / dp_shard`` after checking that it divides."""
    if dp_shard < 1 or dp_size % dp_shard:
        raise ValueError(f"dp_shard ({dp_shard}) must be a divisor of the data-parallel size "
                         f"({dp_size}): dp_replicate = dp_size / dp_shard replicas of dp_shard "
                         f"FSDP2 shards each")
    return dp_size // dp_shard


def init_mesh(tsp_size: int, dp_size: int | None = None, *, pp_size: int = 1,
              dp_shard: int | None = None, layout: Layout = "zigzag",
              timeout: timedelta | float | None = None) -> TSPMesh:
    """Build the mesh over all processes, TSP innermost, initialising the default process group
    first when needed (gloo on CPU, NCCL on CUDA). Without ``dp_shard`` it is ("dp", "tsp"), data
    parallel replicating each TSP group. With ``dp_shard`` it is ("dp_replicate", "dp_shard",
    "tsp"): the ``dp_size`` data-parallel ranks split into ``dp_size / dp_shard`` replicas of
    ``dp_shard`` ranks each, and :func:`tsp_core.parallelize` applies FSDP2 over "dp_shard" when
    it is larger than 1 (HSDP when there are replicas too).

    ``pp_size`` > 1 adds a pipeline dim "pp", outermost: ("pp", "dp", "tsp") or ("pp",
    "dp_replicate", "dp_shard", "tsp"); ``dp_size`` then counts the data-parallel ranks of one
    stage (world = pp_size * dp_size * tsp_size). Build the model with :func:`tsp_core.pipeline`.

    ``timeout`` (a ``datetime.timedelta`` or seconds; None: torch's default, 30 minutes on gloo
    and 10 on NCCL) bounds how long a collective waits for the other ranks: it is passed to the
    default process group when ``init_mesh`` creates it and set on every group of the mesh, so a
    rank that died or took another code path makes the others fail after ``timeout`` instead of
    the default. On gloo the collective raises (``tsp_core.guard.CollectiveError``, naming it);
    on NCCL the watchdog aborts the process. If the default process group already exists (your
    launcher or framework made it), it is kept and its timeout is set to ``timeout`` too (a mesh
    dim that spans every process is that group). A bad ``timeout`` (zero, negative) raises
    ``ValueError`` before any process group is made."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout {layout!r} is not one of {LAYOUTS}")
    timeout = check_timeout(timeout)
    if dp_shard is not None and dp_shard > 1:
        require(FSDP2_SPMD)  # before the process group and any collective
    init_process_group_from_env(timeout)
    world = check_pp_size(dist.get_world_size(), pp_size)
    dp_size = check_mesh_shape(world, tsp_size, dp_size)
    replicas = None if dp_shard is None else check_dp_shard(dp_size, dp_shard)
    warn_if_spanning_nodes(tsp_size)
    device_type = "cuda" if dist.get_backend() == "nccl" else "cpu"
    pp = ((pp_size,), ("pp",)) if pp_size > 1 else ((), ())
    if replicas is None:
        mesh = TSPMesh(init_device_mesh(device_type, (*pp[0], dp_size, tsp_size),
                                        mesh_dim_names=(*pp[1], "dp", "tsp")), "tsp", layout,
                       pp_dim="pp" if pp_size > 1 else None)
    else:
        mesh = TSPMesh(init_device_mesh(device_type, (*pp[0], replicas, dp_shard, tsp_size),
                                        mesh_dim_names=(*pp[1], "dp_replicate", "dp_shard",
                                                        "tsp")),
                       "tsp", layout, "dp_shard", pp_dim="pp" if pp_size > 1 else None)
    if timeout is not None:
        set_timeout(mesh, timeout)
    return mesh


def get_mesh(model: torch.nn.Module) -> TSPMesh:
    """The mesh ``model`` was parallelized with (shard batches with it)."""
    mesh = getattr(getattr(model, "_tsp_state", None), "mesh", None)  # model_state.py
    if mesh is None:
        raise ValueError(f"{type(model).__name__} was not parallelized with tsp_core.parallelize")
    return mesh
