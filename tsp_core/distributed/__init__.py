"""The bottom layer: the mesh, every collective (counted by :mod:`.comm`), the flat buffer a
round's weight shards travel in, DTensor shard helpers, data-parallel gradient sync, FSDP2
composition, the collective guard, clean shutdown, step metrics, and the chunk arithmetic of the
token layouts that the collectives need.

Imports nothing else of tsp_core (docs/design.md "Code map")."""

from . import chunks, comm, data_parallel, flat_pack, fsdp, guard, metrics, params, shutdown
from .mesh import TSPMesh, get_mesh, init_mesh
from .metrics import StepMetrics
from .params import ShardedModule, ShardSpec
from .shutdown import run_cleanly

__all__ = ["ShardSpec", "ShardedModule", "StepMetrics", "TSPMesh", "chunks", "comm",
           "data_parallel", "flat_pack", "fsdp", "get_mesh", "guard", "init_mesh", "metrics",
           "params", "run_cleanly", "shutdown"]
