"""``output_router_logits=True`` on a TSP MoE model (tsp_core/layers/moe/logits.py, docs/moe.md
"Router logits"): the output's ``router_logits`` are Hugging Face's, one ``[B * L, E]`` tensor
per MoE layer for this rank's ``[B, L]`` tokens, and ``gather_router_logits`` gives every rank
the TSP group's ``[B * S, E]`` in the original order. Against the unmodified Hugging Face model
on one process in float64 (tests/layers/test_moe.py's tiny Mixtral, Qwen3-MoE with one dense
layer, gpt-oss with its router bias; at tsp 2 and dp 2 x tsp 2, one case under the ring schedule)
and Gemma 4 (the zoo's, its norms HF-faithful float64 copies: its router_logits are its router's
float32 probabilities, the tensor it routes from), on every rank:

- each layer's local logits equal Hugging Face's rows of this rank's tokens (1e-12);
- the gathered ones equal Hugging Face's whole ``router_logits`` (1e-12), from the full batch
  (padding ``shard_batch`` added left out) and from the sharded one (the padded rows);
- Hugging Face's are in the autograd graph, and so are TSP's: a balancing loss the user builds
  from the gathered logits (not a sum over tokens: the square of each expert's mean
  probability) and a router z-loss summed over the local tokens, each added to the model's
  loss, give every parameter the gradient one process gives (relative 1e-10);
- without ``output_router_logits`` there are none, and no layer keeps its logits after the
  forward."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import tsp_core
from tests.layers.test_moe import AUX_COEF, aux_reference, build
from tests.support import dist_pool, gather, hf_models, parity
from tests.support.reference import assert_grads_close

TOL = 1e-12
GRAD_TOL = 1e-10
USER_COEF = 0.7  # the user's own loss, beside the model's aux loss (AUX_COEF)
ROWS = 2  # rows per data-parallel replica


def num_experts(config) -> int:
    return getattr(config, "num_local_experts", None) or config.num_experts


def user_balance(router_logits) -> torch.Tensor:
    """A balancing loss a user might build from Hugging Face's router logits, not a sum over
    tokens: E * sum_e (mean probability of e)^2 per layer, summed over layers (1 when uniform)."""
    total = 0
    for logits in router_logits:
        mean = torch.softmax(logits, -1).mean(0)
        total = total + logits.shape[-1] * (mean * mean).sum()
    return total


def z_sum(router_logits) -> torch.Tensor:
    """The router z-loss's sum over tokens and layers: sum logsumexp(logits)^2."""
    return sum((torch.logsumexp(logits, -1) ** 2).sum() for logits in router_logits)


def build_model(family: str):
    """tests/layers/test_moe.py's tiny float64 model of ``family``; Gemma 4: the zoo's
    (tests/support/hf_models.py: the MoE block beside every dense MLP, its norms HF-faithful
    float64 copies)."""
    if family == "gemma4":
        return hf_models.build("gemma4", torch.float64)
    return build(family)


def reference(ref, ids, labels):
    """HF's float64 loss (cross-entropy from its logits plus the load-balancing loss from its
    router logits, as tests/layers/test_moe.py's reference_loss; Gemma 4 has none) and its
    router logits."""
    out = ref(input_ids=ids, output_router_logits=True)
    shifted = F.pad(labels, (0, 1), value=-100)[:, 1:]
    ce = F.cross_entropy(out.logits.flatten(0, 1), shifted.flatten(), ignore_index=-100)
    c = ref.config
    if c.model_type.startswith("gemma4"):
        return ce, out.router_logits
    aux = aux_reference(out.router_logits, num_experts(c), c.num_experts_per_tok)
    return ce + AUX_COEF * aux, out.router_logits


def replica_rows(logits: torch.Tensor, rows: slice, batch_rows: int) -> torch.Tensor:
    """Hugging Face's [B * S, E] logits of the global batch: those of ``rows``, [b * S, E]."""
    return logits.view(batch_rows, -1, logits.shape[-1])[rows].reshape(-1, logits.shape[-1])


def max_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return (got - want).abs().max().item()


def router_logits_case(family: str, tsp: int, seq: int, schedule: str = "expert") -> dict:
    """Run on every rank: the checks of the module docstring for ``family``'s tiny model at
    ``tsp`` (the pool's world over it is the data-parallel size), ``ROWS`` rows of ``seq``
    tokens per replica. Returns this rank's largest errors."""
    mesh = dist_pool.mesh(tsp)
    ref = build_model(family)
    model = tsp_core.parallelize(copy.deepcopy(ref), mesh, moe_schedule=schedule)
    dp, dp_rank = mesh.dp_size, mesh.device_mesh.get_coordinate()[0]
    what = f"{family} {schedule} dp {dp} x tsp {tsp} rank {dist.get_rank()}"
    ids, labels = parity.batches(ref.config.vocab_size, ROWS * dp, seq, 1)[0]
    mine = slice(dp_rank * ROWS, (dp_rank + 1) * ROWS)
    full = {"input_ids": ids[mine], "labels": labels[mine]}
    sharded = tsp_core.shard_batch(full, mesh)

    ref_loss, want = reference(ref, ids, labels)
    assert all(t.requires_grad for t in want), "HF's router logits are not in the graph"
    moe_layers = sum(1 for m in ref.modules()
                     if type(m).__name__.endswith(("TopKRouter", "TextRouter")))
    assert len(want) == moe_layers >= 1, (len(want), moe_layers)
    mine_want = [replica_rows(t, mine, ROWS * dp) for t in want]  # this replica's [b * S, E]

    out = model(**sharded, output_router_logits=True)
    got = out.router_logits
    assert got is not None, f"{what}: the output has no router_logits"
    assert isinstance(got, tuple) and len(got) == len(want), \
        f"{what}: {type(got).__name__} of {len(got)} tensors, HF returns {len(want)}"
    errors = {}

    # this rank's tokens: [B, L] flattened row by row, as HF flattens [B, S]
    pos = sharded["position_ids"]  # global positions (one document per row)
    real = sharded.get("attention_mask", torch.ones_like(pos)).bool()  # not shard_batch's padding
    local_rows = torch.arange(ROWS)[:, None].expand_as(pos)
    for layer, (g, w) in enumerate(zip(got, mine_want)):
        assert g.shape == (pos.numel(), w.shape[-1]), \
            f"{what} layer {layer}: shape {tuple(g.shape)}, want ({pos.numel()}, {w.shape[-1]})"
        assert g.dtype == w.dtype and g.requires_grad, (what, layer, g.dtype, g.requires_grad)
        w_local = w.view(ROWS, seq, -1)[local_rows[real], pos[real]]
        err = max_error(g.view(ROWS, -1, g.shape[-1])[real], w_local)
        assert err <= TOL, f"{what} layer {layer}: local router logits off by {err:.3e}"
        errors["local"] = max(errors.get("local", 0.0), err)

    from tsp_core.layers.moe import gather_router_logits

    whole = gather_router_logits(got, full, mesh)
    padded = gather_router_logits(got, sharded, mesh)
    for layer, (g, p, w) in enumerate(zip(whole, padded, mine_want)):
        assert g.shape == w.shape, f"{what} layer {layer}: gathered {tuple(g.shape)} != {w.shape}"
        err = max_error(g, w)
        assert err <= TOL, f"{what} layer {layer}: gathered router logits off by {err:.3e}"
        # the sharded batch's: the padded rows, each document padded at its end
        p = p.view(ROWS, -1, p.shape[-1])
        assert p.shape[1] == sharded["input_ids"].shape[1] * tsp, (what, tuple(p.shape))
        err_p = max_error(p[:, :seq].reshape(-1, p.shape[-1]), w)
        assert err_p <= TOL, f"{what} layer {layer}: gathered (sharded batch) off by {err_p:.3e}"
        errors["gathered"] = max(errors.get("gathered", 0.0), err, err_p)

    # a user's balancing loss from the gathered logits (every replica its own batch's)
    user_ref = sum(user_balance([replica_rows(t, slice(r * ROWS, (r + 1) * ROWS), ROWS * dp)
                                 for t in want]) for r in range(dp))
    (ref_loss + USER_COEF * user_ref).backward()
    want_grads = {n: p.grad.detach().clone() for n, p in ref.named_parameters()}
    (out.loss + USER_COEF * user_balance(whole)).backward()
    assert_grads_close(gather.full_grads(model), want_grads, GRAD_TOL,
                       f"{what}: a balancing loss from the gathered router logits,")

    # a z-loss summed over the local tokens (padding left out), over the global token count
    ref.zero_grad()
    model.zero_grad()
    tokens = ROWS * dp * seq
    ref_loss, want = reference(ref, ids, labels)
    (ref_loss + USER_COEF * z_sum(want) / tokens).backward()
    want_grads = {n: p.grad.detach().clone() for n, p in ref.named_parameters()}
    out = model(**sharded, output_router_logits=True)
    local = [g[real.reshape(-1)] for g in out.router_logits]
    (out.loss + USER_COEF * z_sum(local) / tokens).backward()
    assert_grads_close(gather.full_grads(model), want_grads, GRAD_TOL,
                       f"{what}: a z-loss summed over the local router logits,")

    # not asked for: none, and no layer keeps its logits past the forward
    from tsp_core.layers.moe import router_modules

    with torch.no_grad():
        plain = model(**sharded, output_router_logits=False)
    assert getattr(plain, "router_logits", None) is None, what
    assert all(m.router_logits is None for m in router_modules(model)), what
    dist.barrier()
    return errors


CASES = [  # (family, world, tsp, seq): seq 14 is padded to 16 by shard_batch at tsp 2
    ("mixtral", 2, 2, 16), ("mixtral", 4, 2, 16), ("mixtral", 2, 2, 14),
    ("qwen3_moe", 2, 2, 16), ("qwen3_moe", 4, 2, 16), ("gpt_oss", 2, 2, 16),
    ("gemma4", 2, 2, 16),
]


@pytest.mark.parametrize("family,world,tsp,seq", CASES,
                         ids=[f"{f}-world{w}-tsp{t}-seq{s}" for f, w, t, s in CASES])
def test_router_logits_match_hf(pools, family, world, tsp, seq):
    errors = pools.of(world).run(router_logits_case, family, tsp, seq)
    assert all(e["local"] <= TOL and e["gathered"] <= TOL for e in errors), errors


def test_router_logits_ring_schedule(pools):
    """The ring schedule keeps its logits as the expert schedule does."""
    pools.of(2).run(router_logits_case, "qwen3_moe", 2, 16, "ring")
