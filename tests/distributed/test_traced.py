"""TSP's collectives as torch.compile traces them (:mod:`tsp_core.distributed.traced`): every
decoder layer of a TSP Llama compiled whole by ``parallelize(..., compile=...)``
(``torch.compile(fullgraph=True)`` per layer) through AOT
autograd (the ``aot_eager`` backend: dynamo's graph, forward and backward split as inductor gets
them, run without code generation), with no graph break and no recompile on the second step,
gives eager TSP's loss and gradients bit for bit and issues the same collectives, with the same
bytes, in the same order, on every rank (the ranks' graphs differ, and a collective dropped,
merged or moved on one rank only would hang them)."""

from __future__ import annotations

import copy

import torch

from tests.support import dist_pool


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a gradient (a DTensor does not travel between processes)."""
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def _step(model, ids: torch.Tensor, mesh, steps: int = 2):
    import tsp_core
    from tsp_core import comm

    batch = tsp_core.shard_batch({"input_ids": ids, "labels": ids}, mesh)
    losses, logs = [], []
    for _ in range(steps):
        model.zero_grad(set_to_none=True)
        with comm.track() as stats:
            loss = model(**batch).loss
            loss.backward()
        losses.append(loss.item())
        logs.append(stats.log)
    grads = {n: _local(p.grad).clone() for n, p in model.named_parameters() if p.grad is not None}
    return losses, grads, logs


def compiled_against_eager(tsp: int) -> dict:
    import torch._dynamo as dynamo
    from transformers import LlamaConfig, LlamaForCausalLM

    import tsp_core

    mesh = dist_pool.mesh(tsp)
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2)  # GQA: 2 kv heads, tsp 2
    base = LlamaForCausalLM(cfg).double()
    ids = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(1))
    eager = _step(tsp_core.parallelize(copy.deepcopy(base), mesh), ids, mesh)

    dynamo.reset()
    dynamo.utils.counters.clear()
    traces_autograd = dynamo.config.trace_autograd_ops
    model = tsp_core.parallelize(copy.deepcopy(base), mesh, compile="aot_eager")
    frames = []
    model.model.layers[0].register_forward_hook(
        lambda *_: frames.append(dynamo.utils.counters["stats"]["unique_graphs"]))
    try:
        compiled = _step(model, ids, mesh)
    finally:
        dynamo.config.trace_autograd_ops = traces_autograd  # parallelize turned it on
    breaks = dict(dynamo.utils.counters["graph_break"])
    dynamo.reset()
    return {"eager": eager, "compiled": compiled, "breaks": breaks, "graphs": frames}


def test_layers_traced_whole_match_eager(pools):
    for rank, res in enumerate(pools.of(2).run(compiled_against_eager, 2)):
        (l0, g0, logs0), (l1, g1, logs1) = res["eager"], res["compiled"]
        assert res["breaks"] == {}, f"rank {rank}: graph breaks {res['breaks']}"
        first, second = res["graphs"][0], res["graphs"][-1]
        assert first >= 1 and second == first, f"rank {rank}: graphs {res['graphs']}"
        assert l1 == l0, f"rank {rank}: losses {l1} vs eager {l0}"
        assert g1.keys() == g0.keys()
        for name, g in g0.items():
            assert torch.equal(g1[name], g), f"rank {rank}: {name} differs"
        for step, (a, b) in enumerate(zip(logs0, logs1)):
            assert a == b, f"rank {rank}, step {step}: collectives {b} vs eager {a}"
        assert len(logs1[0]) > 0
