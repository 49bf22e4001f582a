"""``parallelize(..., compile=...)``: each decoder layer compiled whole
(``torch.compile(fullgraph=True)``), against eager TSP from the same weights and against the
unmodified model on one process, at tsp 2, on every rank.

With the ``aot_eager`` backend (dynamo's graph, forward and backward split by AOT autograd as
inductor gets them, run without code generation), in float64: no graph break; one graph per
kind of layer, none added after the first step; each step's loss and the first step's gradients
equal to eager TSP's bit for bit, with the same collectives and bytes in the same order (the
ranks' graphs differ, and a collective dropped, merged or moved on one rank only would hang
them), issued and waited for in eager's order (the next round's prefetch in flight while this
round computes); losses to 1e-10, first gradients to 1e-10 and weights after the SGD steps to
1e-8 of the one-process model's, its loss computed from its logits. After training, generation
compiles nothing (its steps run eagerly) and gives eager's greedy tokens. Selective activation
checkpointing is refused on every case's compiled layers, enabled after ``parallelize`` and
before it.

Inductor (``compile=True``) is not run here: its kernel builds take minutes on a CPU and starve
the suite's other worker. ``compiled_and_eager(name, "inductor", torch.float32, 4)`` with
``_check(..., exact=False)`` checks a case by hand (losses of 4 SGD steps within 1e-6 of eager's).

The cases: Qwen3 (q/k norms), Mixtral under each MoE schedule (the routed experts run as opaque
ops: their sizes depend on the routing), the expert schedule with token tiles, activation
checkpointing and host offload on, gpt-oss (attention sinks, sliding and full layers, expert
biases), one Gated DeltaNet layer (Qwen3.5's linear attention) and one multi-head latent
attention layer (DeepSeek-V3's, with its dense MLP); and Llama with one key/value head (each
split over both ranks) under FSDP2 (dp_shard 2 x tsp 2, its gathers' hooks eager around the
compiled forward). That Llama compiled at tsp 2 without FSDP2 is checked the same way with LoRA
adapters (tests/models/test_compiled_lora.py) and through ``TSPTrainer(torch_compile=...)``
(tests/integrations/test_transformers.py); its case here ("llama") serves the by-hand inductor
check."""

from __future__ import annotations

import contextlib
import copy
import os
from collections.abc import Iterator
from functools import partial

import pytest
import torch

from tests.layers import test_moe
from tests.models import test_deepseek_v3
from tests.support import dist_pool, gather, hf_models, parity

CHECKPOINTED = {"tile_tokens": 4, "activation_offload": True}
INDUCTOR_ENV = "_TORCHINDUCTOR_PYOBJECT_TENSOR_DATA_PTR"
DP_SHARD = {"llama-fsdp2": 2}


def _case(name: str):
    """(the model, parallelize's options, activation checkpointing on, the reference's loss,
    the compiled graphs expected: one per kind of layer, and a checkpointed MoE layer's
    recompute gets its own, which keeps no router logits)."""
    moe_loss = test_moe.reference_loss
    return {
        "llama": (partial(hf_models.build, "llama", torch.float64, kv_heads=1), {}, False,
                  hf_models.reference_loss, 1),
        "qwen3": (partial(hf_models.build, "qwen3", torch.float64), {}, False,
                  hf_models.reference_loss, 2),  # a full layer and a sliding one
        "mixtral-ring": (partial(test_moe.build, "mixtral"), {"moe_schedule": "ring"}, False,
                         moe_loss, 1),
        "mixtral-expert": (partial(test_moe.build, "mixtral"), {"moe_schedule": "expert"},
                           False, moe_loss, 1),
        "mixtral-expert-offload": (partial(test_moe.build, "mixtral"),
                                   {"moe_schedule": "expert", **CHECKPOINTED}, True, moe_loss, 2),
        "gpt_oss": (partial(test_moe.build, "gpt_oss"), {}, False, moe_loss, 2),  # sliding, full
        # FSDP2 over dp_shard 2 (DP_SHARD), every replica given the same rows
        "llama-fsdp2": (partial(hf_models.build, "llama", torch.float64, kv_heads=1), {}, False,
                        hf_models.reference_loss, 1),
        # one layer each: Qwen3.5's Gated DeltaNet, DeepSeek-V3's MLA (with its dense MLP)
        "gated_deltanet": (partial(_first_layer, hf_models.build, "qwen3_5-linear",
                                   torch.float64), {}, False, hf_models.reference_loss, 1),
        "mla": (partial(_first_layer, test_deepseek_v3.build), {}, False,
                hf_models.reference_loss, 1),
    }[name]


def _first_layer(build, *args):
    """The model ``build(*args)`` gives, cut to its first decoder layer: one compiled graph."""
    model = build(*args)
    model.model.layers = model.model.layers[:1]
    model.config.num_hidden_layers = 1
    if getattr(model.config, "layer_types", None):
        model.config.layer_types = model.config.layer_types[:1]
    return model


def _selective_refused(model, ref, mesh, backend: str, options: dict) -> list[str]:
    """The errors of selective activation checkpointing enabled on the compiled ``model``, and
    on a copy of ``ref`` then given to ``parallelize(compile=backend)`` ("not refused" for none):
    tsp_core.models.compiled.refuse_selective_checkpointing."""
    import tsp_core
    from tsp_core.plan.simulate import recompute_kwargs

    def error(call) -> str:
        try:
            call()
        except ValueError as err:
            return str(err)
        return "not refused"

    kwargs = {"activation_checkpointing_kwargs": recompute_kwargs("selective")}
    before = copy.deepcopy(ref)
    before.activation_checkpointing_enable(**kwargs)
    return [error(partial(model.activation_checkpointing_enable, **kwargs)),
            error(partial(tsp_core.parallelize, before, mesh, compile=backend, **options))]


@contextlib.contextmanager
def _schedule() -> Iterator[list[str]]:
    """The host's order of collectives issued and waited for: "issue <kind>" when one starts,
    "wait" when the host waits for one (at once for a synchronous call). A compiled layer whose
    collectives ran synchronously would wait before issuing the next round's prefetch, where
    eager issues it first and computes meanwhile."""
    from tsp_core.distributed import comm as raw

    events: list[str] = []
    record, run, wait = raw._record, raw._run, raw.Handle.wait

    def issued(kind: str, nbytes: float) -> None:
        events.append(f"issue {kind}")
        record(kind, nbytes)

    def ran(kind, nbytes, call, async_op, group=None):
        handle = run(kind, nbytes, call, async_op, group)
        if not async_op:
            events.append("wait")
        return handle

    def waited(self) -> None:
        if self._works:
            events.append("wait")
        wait(self)

    raw._record, raw._run, raw.Handle.wait = issued, ran, waited
    try:
        yield events
    finally:
        raw._record, raw._run, raw.Handle.wait = record, run, wait


def _record(model, mesh, data, checkpointed: bool) -> dict:
    """Each step's loss, collectives and compiled-graph count; the first step's gradients
    (full shape); the weights after the SGD steps."""
    import torch._dynamo as dynamo

    import tsp_core
    from tsp_core import comm

    if checkpointed:
        model.activation_checkpointing_enable(
            activation_checkpointing_kwargs={"use_reentrant": False})
        model.train()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    losses, logs, schedules, graphs, grads0 = [], [], [], [], None
    for ids, labels in data:
        batch = tsp_core.shard_batch({"input_ids": ids, "labels": labels}, mesh)
        with comm.track() as stats, _schedule() as events:
            loss = model(**batch).loss
            loss.backward()
        logs.append(stats.log)
        schedules.append(events)
        graphs.append(dynamo.utils.counters["stats"]["unique_graphs"])
        if grads0 is None:
            grads0 = gather.full_grads(model)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return dict(losses=losses, logs=logs, schedules=schedules, graphs=graphs, grads0=grads0,
                weights=tsp_core.full_state_dict(model))


def _generated(model) -> torch.Tensor:
    """Greedy tokens after a prompt (generation runs a compiled model's layers eagerly)."""
    import tsp_core

    model.eval()
    prompt = torch.randint(0, model.config.vocab_size, (2, 6),
                           generator=torch.Generator().manual_seed(3))
    return tsp_core.generate(model, prompt, 4, eos_token_id=[])


def compiled_and_eager(name: str, backend: str, dtype: torch.dtype, steps: int) -> dict:
    """Run on every rank: the case's eager TSP record, its compiled record and (float64) the
    one-process model's, with the compiled run's graph breaks."""
    import torch._dynamo as dynamo

    import tsp_core
    from tsp_core.models.compiled import compiled_by

    build, options, checkpointed, reference_loss, _ = _case(name)
    mesh = dist_pool.mesh(2, dp_shard=DP_SHARD.get(name))
    ref = build().to(dtype)
    data = parity.batches(ref.config.vocab_size, 2, 16, steps)
    eager_model = tsp_core.parallelize(copy.deepcopy(ref), mesh, **options)
    eager = _record(eager_model, mesh, data, checkpointed)
    eager["generated"] = _generated(eager_model)
    dynamo.reset()
    dynamo.utils.counters.clear()
    inductor_env = os.environ.get(INDUCTOR_ENV)
    try:
        model = tsp_core.parallelize(copy.deepcopy(ref), mesh, compile=backend, **options)
        layers = list(model.model.layers)
        assert all(compiled_by(layer) == backend for layer in layers), \
            [type(layer).__name__ for layer in layers]
        compiled = _record(model, mesh, data, checkpointed)
        compiled["generated"] = _generated(model)
        compiled["graphs_after_generation"] = dynamo.utils.counters["stats"]["unique_graphs"]
        compiled["selective"] = _selective_refused(model, ref, mesh, backend, options)
        compiled["layer_classes"] = [type(layer).__name__ for layer in layers]
    finally:  # inductor leaves this behind in the pool's process
        if inductor_env is None:
            os.environ.pop(INDUCTOR_ENV, None)
        else:
            os.environ[INDUCTOR_ENV] = inductor_env
    breaks = dict(dynamo.utils.counters["graph_break"])
    dynamo.reset()
    want = None
    if dtype == torch.float64:
        want = parity.reference_record(ref, data, partial(torch.optim.SGD, lr=0.5),
                                       reference_loss)
    return dict(eager=eager, compiled=compiled, want=want, breaks=breaks)


def _check(rank: int, name: str, res: dict, exact: bool) -> None:
    eager, compiled = res["eager"], res["compiled"]
    what = f"{name} rank {rank}"
    assert res["breaks"] == {}, f"{what}: graph breaks {res['breaks']}"
    kinds = _case(name)[4]
    assert compiled["graphs"] == [kinds] * len(compiled["graphs"]), \
        f"{what}: compiled graphs after each step {compiled['graphs']}, want {kinds} throughout"
    for step, (a, b) in enumerate(zip(eager["logs"], compiled["logs"])):
        assert a == b, f"{what} step {step}: collectives {b} vs eager {a}"
    if exact:  # inductor's scheduler places the wait ops itself (seen sooner and later)
        for step, (a, b) in enumerate(zip(eager["schedules"], compiled["schedules"])):
            assert a == b, f"{what} step {step}: issues and waits {b} vs eager {a}"
    assert len(compiled["logs"][0]) > 0
    assert compiled["graphs_after_generation"] == kinds, f"{what}: generation compiled graphs"
    after, before = compiled["selective"]  # enabled after parallelize(compile=), and before
    for msg, layer in ((after, compiled["layer_classes"][0]),
                       (before, compiled["layer_classes"][0].removeprefix("Compiled"))):
        assert msg.startswith(f"{layer}: selective activation checkpointing") and \
            "cannot run on a layer compiled by parallelize(..., compile=...)" in msg, \
            f"{what}: {msg}"
    if exact:
        assert compiled["losses"] == eager["losses"], (what, compiled["losses"], eager["losses"])
        assert torch.equal(compiled["generated"], eager["generated"]), what
        for n, g in eager["grads0"].items():
            assert torch.equal(compiled["grads0"][n], g), f"{what}: gradient of {n} differs"
    else:
        for step, (a, b) in enumerate(zip(compiled["losses"], eager["losses"])):
            assert abs(a - b) <= 1e-6 * abs(b), f"{what} step {step}: loss {a!r} vs eager {b!r}"
    if res["want"] is not None:
        parity.compare(compiled, res["want"], parity.FLOAT64, f"{what} compiled")


@pytest.mark.parametrize("name", ["qwen3", "mixtral-ring", "mixtral-expert-offload", "gpt_oss",
                                  "gated_deltanet", "mla"])
def test_compiled_layers_match_eager_and_one_process(pools, name):
    for rank, res in enumerate(pools.of(2).run(compiled_and_eager, name, "aot_eager",
                                               torch.float64, 3)):
        _check(rank, name, res, exact=True)


def test_compiled_layers_under_fsdp2(pools):
    for rank, res in enumerate(pools.of(4).run(compiled_and_eager, "llama-fsdp2", "aot_eager",
                                               torch.float64, 3)):
        _check(rank, "llama-fsdp2", res, exact=True)
