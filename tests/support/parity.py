"""The training parity harness: TSP against the unmodified Hugging Face model on one process.

Every family test trains the same way: the reference (the plain model, never touched by tsp_core)
takes each global batch whole; the TSP copy, parallelized on the pool's mesh, takes its
data-parallel replica's rows sharded over the TSP group. Compared on every rank
(:func:`train_parity` runs on each one of the pool and asserts there):

- the loss of every step (relative error);
- the first step's gradient of every parameter, gathered to full shape (relative error per
  tensor, :func:`tests.support.reference.relative_error`: the weights after AdamW steps hide a
  gradient of the wrong scale, the gradients themselves do not);
- every weight and buffer after the steps (:func:`tests.support.reference.assert_close`'s
  error), from ``tsp_core.full_state_dict``.

A name present on one side only fails the test, naming it. A test describes its run with
:class:`Parity` (the model builder, sizes, optimizer, tolerances, parallelize options, feature
guards); :func:`reference_record`, :func:`tsp_record` and :func:`compare` are the parts, for a
test that trains one reference against several TSP models.

With ``autocast`` (:func:`bf16_parity`), both models are float32 and each step's forward and
backward run under ``torch.autocast("cpu", dtype=...)``, the way users train in mixed precision:
the TSP run is held to bf16's precision (tests/support/precision.py), against the reference under
the same autocast, and must differ from the plain float32 reference (it computed in bf16).
"""

from __future__ import annotations

import contextlib
import copy
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from tests.support import dist_pool, gather, hf_models, precision
from tests.support.reference import relative_error

Batch = tuple[torch.Tensor, torch.Tensor]  # (input_ids, labels), the global batch of one step


@dataclass(frozen=True)
class Tolerances:
    """``loss``: relative, every step; ``grads``: relative per tensor, the first step (None: not
    compared); ``weights``: max abs error over max(1, max abs value), after the steps."""

    loss: float = 1e-10
    grads: float | None = 1e-10
    weights: float = 1e-8


FLOAT64 = Tolerances()
# a sanity check beside the float64 exactness runs: float32 rounding, amplified by AdamW
FLOAT32 = Tolerances(loss=1e-4, grads=None, weights=1e-4)


@dataclass(frozen=True)
class Parity:
    """One parity run (pickled to every rank of the pool).

    ``build``: the unmodified model, the same weights on every rank (a module-level function or
    a ``functools.partial`` of one). ``tsp``: the TSP size; the pool's world size over it is the
    number of data-parallel replicas, ``rows`` rows each. ``steps`` batches of ``seq`` tokens
    (:func:`batches`), or ``data``: the global batches themselves. ``optimizer``: a factory of
    the optimizer over parameters, the same for both models. ``reference_loss``: the reference's
    loss of (model, ids, labels). ``options``: keyword arguments of ``tsp_core.parallelize``.
    ``guard(reference, model)``: checks the models have the features the test is about, after
    parallelize; ``check_output(output)``: checks each TSP step's output."""

    build: Callable[[], nn.Module]
    tsp: int
    steps: int = 3
    seq: int = 24
    rows: int = 2
    middle_ignored: bool = False
    data: list[Batch] | None = None
    optimizer: Callable[..., torch.optim.Optimizer] = partial(torch.optim.SGD, lr=0.5)
    tol: Tolerances = FLOAT64
    reference_loss: Callable[..., torch.Tensor] = hf_models.reference_loss
    options: dict[str, Any] = field(default_factory=dict)
    guard: Callable[[nn.Module, nn.Module], None] | None = None
    check_output: Callable[[Any], None] | None = None
    name: str = ""
    autocast: torch.dtype | None = None


def batches(vocab: int, rows: int, seq: int, steps: int, middle_ignored: bool = False,
            seed: int = 7) -> list[Batch]:
    """``steps`` random global batches of ``rows`` x ``seq`` tokens, labels the ids with the first
    3 of row 0 ignored (-100) and, with ``middle_ignored``, the last row's middle one too."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        ids = torch.randint(0, vocab, (rows, seq), generator=gen)
        labels = ids.clone()
        labels[0, :3] = -100
        if middle_ignored:
            labels[-1, seq // 2] = -100
        out.append((ids, labels))
    return out


def autocast(dtype: torch.dtype | None):
    """``torch.autocast("cpu", dtype)`` around a step's forward and backward; none for None."""
    return contextlib.nullcontext() if dtype is None else torch.autocast("cpu", dtype=dtype)


def reference_record(ref: nn.Module, data: list[Batch], optimizer: Callable,
                     reference_loss: Callable = hf_models.reference_loss,
                     autocast_dtype: torch.dtype | None = None) -> dict:
    """The plain model trained on one process, one global batch per step: each step's loss, the
    first step's gradients and the final state dict (each forward and backward under
    ``autocast_dtype``'s autocast, if given)."""
    opt = optimizer(ref.parameters())
    losses, grads0 = [], None
    for ids, labels in data:
        with autocast(autocast_dtype):
            loss = reference_loss(ref, ids, labels)
            loss.backward()
        if grads0 is None:
            missing = [n for n, p in ref.named_parameters() if p.grad is None]
            assert not missing, f"the reference's parameters {missing} got no gradient"
            grads0 = {n: p.grad.detach().clone() for n, p in ref.named_parameters()}
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    weights = {k: v.detach().clone() for k, v in ref.state_dict().items()}
    return dict(losses=losses, grads0=grads0, weights=weights)


def tsp_record(model: nn.Module, mesh, data: list[Batch], optimizer: Callable, rows: int,
               check_output: Callable[[Any], None] | None = None,
               autocast_dtype: torch.dtype | None = None) -> dict:
    """The parallelized model trained on this rank's share of the same batches (its replica's
    ``rows`` rows, sharded by ``tsp_core.shard_batch``): the record of :func:`reference_record`,
    the gradients gathered to full shape (every rank of the mesh must call it)."""
    import tsp_core

    dp_rank = mesh.device_mesh.get_coordinate()[0]
    mine = slice(dp_rank * rows, (dp_rank + 1) * rows)
    opt = optimizer(model.parameters())
    losses, grads0 = [], None
    for ids, labels in data:
        with autocast(autocast_dtype):
            out = model(**tsp_core.shard_batch({"input_ids": ids[mine], "labels": labels[mine]},
                                               mesh))
            if check_output is not None:
                check_output(out)
            out.loss.backward()
        if grads0 is None:
            grads0 = gather.full_grads(model)
        opt.step()
        opt.zero_grad()
        losses.append(out.loss.item())
    return dict(losses=losses, grads0=grads0, weights=tsp_core.full_state_dict(model))


def weight_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """max|actual - expected| / max(1, max|expected|): tests.support.reference.assert_close's."""
    err = (actual - expected).abs().max().item() if actual.numel() else 0.0
    scale = max(1.0, expected.abs().max().item() if expected.numel() else 0.0)
    return err / scale


def compare_tensors(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], tol: float,
                    error: Callable[[torch.Tensor, torch.Tensor], float], what: str) -> float:
    """Every tensor of ``want`` within ``tol`` (by ``error``) of ``got``'s of the same name and
    shape; a name on one side only fails. Names every tensor off, worst first; returns the
    largest error."""
    only_got, only_want = sorted(set(got) - set(want)), sorted(set(want) - set(got))
    assert not only_got and not only_want, \
        f"{what}: only in TSP's: {only_got}; only in the reference's: {only_want}"
    errors = []
    for name, t in want.items():
        assert got[name].shape == t.shape, \
            f"{what} {name}: shape {tuple(got[name].shape)} != {tuple(t.shape)}"
        errors.append((error(got[name], t), name))
    off = sorted(((e, n) for e, n in errors if not e <= tol),  # NaN is off too
                 key=lambda e: -e[0] if e[0] == e[0] else float("-inf"))
    assert not off, f"{what}: " + "; ".join(f"{n}: error {e:.3e} > {tol:.0e}" for e, n in off)
    return max((e for e, _ in errors), default=0.0)


def compare(run: dict, ref: dict, tol: Tolerances, what: str) -> dict:
    """A :func:`tsp_record` against a :func:`reference_record`: losses, first gradients (unless
    ``tol.grads`` is None) and final weights. Returns the figures: the losses and the largest
    error of each kind."""
    assert len(run["losses"]) == len(ref["losses"]), (what, run["losses"], ref["losses"])
    loss_error = 0.0
    for step, (a, b) in enumerate(zip(run["losses"], ref["losses"])):
        rel = abs(a - b) / abs(b)
        assert rel <= tol.loss, f"{what} step {step}: loss {a!r} vs {b!r} (rel {rel:.2e})"
        loss_error = max(loss_error, rel)
    grad_error = None
    if tol.grads is not None:
        grad_error = compare_tensors(run["grads0"], ref["grads0"], tol.grads, relative_error,
                                     f"{what} gradients of step 0")
    weights = compare_tensors(run["weights"], ref["weights"], tol.weights, weight_error,
                              f"{what} weights after {len(ref['losses'])} steps")
    return dict(losses=run["losses"], loss_error=loss_error, grad_error=grad_error,
                weight_error=weights)


def bf16_bound(layers: int) -> float:
    """tests/support/precision.py's G for a model of ``layers`` decoder layers: G = 2 sqrt(k) u
    for the k = 20 bf16 roundings a gradient passes through 2 layers (about 10 a layer, forward
    and back); ``layers`` layers pass about 10 each, so G sqrt(layers / 2), and G for 2 or
    fewer."""
    return precision.G * math.sqrt(max(layers, 2) / 2)


def compare_bf16(run: dict, ref: dict, exact: dict, init: dict, what: str, layers: int) -> dict:
    """A :func:`tsp_record` under bf16 autocast against the reference's under the same autocast
    (``ref``) and without it (``exact``, float32), within tests/support/precision.py's bounds
    (u = 2^-8, bf16's unit roundoff; G = 9 u for 2 layers, :func:`bf16_bound` for ``layers``):
    the first gradients within G of ``ref``'s, norm-wise over all of them (two bf16 runs that
    round in different places differ by about 6.3 u), and at least 0.1 u from ``exact``'s (the
    run computed in bf16: one that stayed in float32 is ~1e-5 u from it); the loss of every step
    within 2 G of ``ref``'s; the weights, float32 (the master weights autocast leaves alone),
    within 2 G of the reference's movement from ``init`` (plain SGD: each step is lr x g, off by
    the gradient's error). A name on one side only fails. Returns the figures, the gradients'
    in units of u."""
    bound = bf16_bound(layers)
    for key in ("grads0", "weights"):
        only_run, only_ref = sorted(set(run[key]) - set(ref[key])), sorted(set(ref[key]) -
                                                                          set(run[key]))
        assert not only_run and not only_ref, \
            f"{what} {key}: only in TSP's: {only_run}; only in the reference's: {only_ref}"
    grads = precision.relative_error(run["grads0"], ref["grads0"])
    assert grads <= bound, (f"{what}: first gradients {grads / precision.U:.2f} u from the "
                            f"reference's (> {bound / precision.U:.1f} u)")
    off = precision.relative_error(run["grads0"], exact["grads0"])
    assert off >= 0.1 * precision.U, \
        f"{what}: first gradients {off / precision.U:.2e} u from float32's: not bf16"
    assert len(run["losses"]) == len(ref["losses"]), (what, run["losses"], ref["losses"])
    for step, (a, b) in enumerate(zip(run["losses"], ref["losses"])):
        assert abs(a - b) <= 2 * bound * abs(b), f"{what} step {step}: loss {a} vs {b}"
    wide = sorted(n for n, w in run["weights"].items()
                  if w.is_floating_point() and w.dtype != torch.float32)
    assert not wide, f"{what}: weights not float32 after the steps: {wide}"
    names = sorted(n for n, w in ref["weights"].items() if w.is_floating_point())
    moved = precision.relative_error(ref["weights"], init, names)
    weights = precision.relative_error(run["weights"], ref["weights"], names)
    assert weights <= 2 * bound * moved, \
        f"{what}: weights {weights:.2e} from the reference's (> 2 G of its movement {moved:.2e})"
    return dict(losses=run["losses"], grads_u=grads / precision.U,
                from_float32_u=off / precision.U, weights_g=weights / (bound * moved))


def bf16_parity(build: Callable[[], nn.Module], tsp: int, name: str, **fields: Any) -> Parity:
    """One plain SGD step (lr 0.5) of the float32 model ``build`` makes, forward and backward
    under bf16 autocast (:func:`compare_bf16`'s bounds); ``fields``: other :class:`Parity`
    fields (``seq``, ``options``, ``guard``)."""
    return Parity(build, tsp, steps=1, autocast=torch.bfloat16, name=f"{name} bf16 autocast",
                  **fields)


def check_moe_schedule(model: nn.Module, schedule: str) -> None:
    """Every expert layer of ``model`` runs ``schedule`` (and there is one)."""
    from tsp_core.layers.moe import TSPMoE

    got = {m.schedule for m in model.modules() if isinstance(m, TSPMoE)}
    assert got == {schedule}, f"the expert layers run {sorted(got)}, not {schedule!r}"


def parallelize_refusal(model: nn.Module, tsp: int) -> str:
    """Run on every rank of a pool: ``tsp_core.parallelize`` of ``model`` at TSP degree ``tsp``
    must raise ``ValueError`` on this rank before any collective. Its message, once every rank
    got there."""
    import tsp_core

    with tsp_core.comm.track() as stats, pytest.raises(ValueError) as err:
        tsp_core.parallelize(model, dist_pool.mesh(tsp))
    assert not dict(stats.calls), dict(stats.calls)  # before any collective
    dist.barrier()
    return str(err.value)


def train_parity(case: Parity) -> dict:
    """Run on every rank of a pool: ``case``'s reference trained on the global batches, then its
    TSP copy on this rank's share of them, compared on this rank (:func:`compare`). Returns this
    rank's figures."""
    import tsp_core

    mesh = dist_pool.mesh(case.tsp)
    ref = case.build()
    model = tsp_core.parallelize(copy.deepcopy(ref), mesh, **case.options)
    assert tsp_core.get_mesh(model) is mesh
    if "moe_schedule" in case.options:
        check_moe_schedule(model, case.options["moe_schedule"])
    if case.guard is not None:
        case.guard(ref, model)
    dp = mesh.dp_size
    data = case.data
    if data is None:
        data = batches(ref.config.vocab_size, case.rows * dp, case.seq, case.steps,
                       case.middle_ignored)
    what = f"{case.name} dp {dp} x tsp {case.tsp} rank {dist.get_rank()}".strip()
    if case.autocast is None:
        want = reference_record(ref, data, case.optimizer, case.reference_loss)
        run = tsp_record(model, mesh, data, case.optimizer, case.rows, case.check_output)
        figures = compare(run, want, case.tol, what)
    else:
        init = {k: v.detach().clone() for k, v in ref.state_dict().items()}
        exact = reference_record(copy.deepcopy(ref), data, case.optimizer, case.reference_loss)
        want = reference_record(ref, data, case.optimizer, case.reference_loss, case.autocast)
        run = tsp_record(model, mesh, data, case.optimizer, case.rows, case.check_output,
                         case.autocast)
        figures = compare_bf16(run, want, exact, init, what, ref.config.num_hidden_layers)
    dist.barrier()
    return figures


def assert_same_losses(figures: list[dict]) -> None:
    """The loss of every step is the same on every rank (the per-rank figures of a pool)."""
    losses = [f["losses"] for f in figures]
    assert all(r == losses[0] for r in losses), f"the loss differs between ranks: {losses}"
