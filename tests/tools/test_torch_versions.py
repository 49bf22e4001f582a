"""tsp_core on torch 2.11's API (the GPU image's torch; docs/gpu.md "Torch versions"), in a
process where :mod:`tests.tools.older_torch` hid what torch 2.12 added: ``import tsp_core`` works,
FSDP2 on the TSP mesh refuses by name, with the torch it needs, before any process group exists,
and comm's one-buffer all-gather and reduce-scatter fall back to torch 2.11's names.
(``./run gpu-check --device cpu`` on that torch: tests/tools/test_gpu_check.py.)"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.support.launch import ROOT
from tests.tools import older_torch

PROBE = r"""
import json, sys
import torch
import torch.distributed as dist
import tsp_core
from tsp_core.distributed import comm, torch_features
result = {"torch": torch.__version__,
          "available": torch_features.available(torch_features.FSDP2_SPMD)}
try:
    tsp_core.init_mesh(1, dp_shard=2)
    result["refused"] = None
except Exception as e:
    result["refused"] = [type(e).__name__, str(e)]
result["process_group_after_refusal"] = dist.is_initialized()
if dist.is_initialized():
    dist.destroy_process_group()
# comm's one-buffer collectives in a world of 2 (the fake backend moves nothing: what is checked
# is that the call reaches a function this torch has)
from torch.testing._internal.distributed.fake_pg import FakeStore
dist.init_process_group("fake", rank=0, world_size=2, store=FakeStore())
group = dist.new_group([0, 1])
try:
    with comm.track() as stats:
        comm.all_gather(torch.empty(4), torch.ones(2), group)
        comm.reduce_scatter(torch.empty(2), torch.ones(4), group)
    result["calls"] = dict(stats.calls)
except Exception as e:
    result["calls"] = f"{type(e).__name__}: {e}"
# a framework's own mesh with a data-parallel shard dim (the adapters' FSDP2 switch) reaches
# apply_fsdp, which refuses too
from torch.distributed.device_mesh import init_device_mesh
from tsp_core.distributed.fsdp import apply_fsdp
mesh = tsp_core.TSPMesh(init_device_mesh("cpu", (2, 1), mesh_dim_names=("dp_shard", "tsp")),
                        "tsp", shard_dim="dp_shard")
try:
    apply_fsdp(torch.nn.Linear(2, 2), mesh, [])
    result["apply_fsdp"] = None
except Exception as e:
    result["apply_fsdp"] = [type(e).__name__, str(e)]
dist.destroy_process_group()
print("RESULT " + json.dumps(result))
"""


@pytest.fixture(scope="module")
def probe(tmp_path_factory):
    folder = tmp_path_factory.mktemp("older_torch")
    run = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True,
                         timeout=300, cwd=ROOT, env=older_torch.env(folder, OMP_NUM_THREADS="1"))
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    (line,) = [ln for ln in run.stdout.splitlines() if ln.startswith("RESULT ")]
    return dict(json.loads(line[len("RESULT "):]), absent=older_torch.log(folder))


def test_tsp_core_imports_without_the_newer_symbols(probe):
    assert probe["absent"] == [sorted(older_torch.every_name())], probe
    assert probe["available"] is False, probe


@pytest.mark.parametrize("where", ["refused", "apply_fsdp"])
def test_fsdp2_refuses_naming_the_feature_and_torch(probe, where):
    """``init_mesh(1, dp_shard=2)`` and ``apply_fsdp`` on a mesh with a shard dim."""
    kind, message = probe[where] or (None, f"{where}: no refusal")
    assert kind == "TorchTooOld", message
    assert "FSDP2 on the TSP mesh" in message and "needs torch >= 2.12" in message, message
    assert f"this is torch {probe['torch']}" in message, message
    assert "init_mesh(tsp_size, dp_size)" in message, message  # the way out


def test_init_mesh_refuses_before_any_process_group(probe):
    assert probe["process_group_after_refusal"] is False, "refused after starting a process group"


def test_comm_falls_back_to_the_older_names(probe):
    assert probe["calls"] == {"all_gather": 1, "reduce_scatter": 1}, probe
