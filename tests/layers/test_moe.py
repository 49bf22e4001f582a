"""Mixture-of-experts under TSP (tsp_core.layers.moe, docs/moe.md): tiny Mixtral (4 experts, top 2)
and Qwen3-MoE (8 experts, top 2, normalised top-k, q/k norms, one dense layer) against the
unmodified Hugging Face model on one process in float64: loss including the load-balancing loss over
the global batch, the first step's gradient of every parameter (relative 1e-10, every rank), every
weight after AdamW steps, at tsp 1, 2, 4 and dp 2 x tsp 2, under both schedules; greedy
generation; the all-to-all calls and bytes of one layer against the formula for uniform and skewed
routing."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import tsp_core
from tests.inference.test_decode import left_padded
from tests.support import dist_pool, hf_models
from tests.support.reference import assert_close, assert_grads_close
from tsp_core import comm
from tsp_core.layers.moe import TSPMoE

AUX_COEF = 0.3  # large enough that a wrong load-balancing loss moves the loss and the router


def build(family: str, seed: int = 0):
    """A tiny random MoE model in float64 with the router's logits in its output (HF's experts in
    their eager implementation: grouped_mm has no float64 kernel)."""
    torch.manual_seed(seed)
    common = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-6,
                  output_router_logits=True, router_aux_loss_coef=AUX_COEF)
    if family == "mixtral":
        from transformers import MixtralConfig, MixtralForCausalLM

        model = MixtralForCausalLM(MixtralConfig(
            vocab_size=96, intermediate_size=48, num_local_experts=4, num_experts_per_tok=2,
            sliding_window=7, **common))
    elif family == "qwen3_moe":
        from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

        model = Qwen3MoeForCausalLM(Qwen3MoeConfig(
            vocab_size=96, intermediate_size=64, moe_intermediate_size=16, num_experts=8,
            num_experts_per_tok=2, norm_topk_prob=True, head_dim=16, mlp_only_layers=[1],
            **common))
        with torch.no_grad():  # q/k norms away from their initial ones
            for name, p in model.named_parameters():
                if name.endswith("norm.weight"):
                    p.add_(0.1 * torch.randn(p.shape))
    else:
        raise ValueError(family)
    with torch.no_grad():  # a router that prefers some experts: routing far from uniform
        for name, p in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.normal_(0, 0.5)
    model.set_experts_implementation("eager")
    return model.to(torch.float64)


def aux_reference(router_logits, num_experts: int, top_k: int) -> torch.Tensor:
    """Hugging Face's load_balancing_loss_func in float64 (its own sums run in float32)."""
    counts = torch.zeros(num_experts, dtype=torch.float64)
    probs_sum = torch.zeros(num_experts, dtype=torch.float64)
    rows = 0
    for logits in router_logits:
        probs = torch.softmax(logits, -1)
        chosen = torch.topk(probs, top_k, -1).indices.reshape(-1)
        counts += torch.bincount(chosen, minlength=num_experts).to(torch.float64)
        probs_sum += probs.sum(0)
        rows += probs.shape[0]
    return (counts / rows * (probs_sum / rows)).sum() * num_experts


def reference_loss(model, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Cross-entropy from HF's logits in float64 plus the aux loss from its router logits in
    float64 (HF's own loss and aux sums run in float32)."""
    out = model(input_ids=ids, output_router_logits=True)
    shifted = F.pad(labels, (0, 1), value=-100)[:, 1:]
    ce = F.cross_entropy(out.logits.flatten(0, 1), shifted.flatten(), ignore_index=-100)
    c = model.config
    experts = getattr(c, "num_local_experts", None) or c.num_experts
    return ce + AUX_COEF * aux_reference(out.router_logits, experts, c.num_experts_per_tok)


def batches(vocab: int, rows: int, seq: int, steps: int):
    gen = torch.Generator().manual_seed(7)
    for _ in range(steps):
        ids = torch.randint(0, vocab, (rows, seq), generator=gen)
        labels = ids.clone()
        labels[0, :3] = -100
        yield ids, labels


def train_parity(family: str, tsp: int, schedule: str = "expert", seq: int = 16,
                 steps: int = 3) -> list[float]:
    mesh = dist_pool.mesh(tsp)
    dp, dp_rank = mesh.dp_size, mesh.device_mesh.get_coordinate()[0]
    ref = build(family)
    model = tsp_core.parallelize(copy.deepcopy(ref), mesh, moe_schedule=schedule)
    assert {m.schedule for m in model.modules() if isinstance(m, TSPMoE)} == {schedule}
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    rows, losses = 2, []
    for step, (ids, labels) in enumerate(batches(ref.config.vocab_size, rows * dp, seq, steps)):
        expected = reference_loss(ref, ids, labels)
        mine = slice(dp_rank * rows, (dp_rank + 1) * rows)
        out = model(**tsp_core.shard_batch({"input_ids": ids[mine], "labels": labels[mine]},
                                           mesh))
        assert out.aux_loss is not None
        rel = abs(out.loss.item() - expected.item()) / abs(expected.item())
        assert rel <= 1e-10, f"step {step}: loss {out.loss.item()!r} vs {expected.item()!r}"
        losses.append(out.loss.item())
        expected.backward()
        out.loss.backward()
        if step == 0:
            want_grads = {n: p.grad for n, p in ref.named_parameters()}
            what = f"{family} {schedule} dp {dp} x tsp {tsp} rank {dist.get_rank()} step 0"
            assert_grads_close(hf_models.full_grads(model), want_grads, 1e-10, what)
        for o in (opt_ref, opt):
            o.step()
            o.zero_grad()
    full, want = tsp_core.full_state_dict(model), ref.state_dict()
    assert sorted(full) == sorted(want)
    for name, t in want.items():
        assert_close(full[name], t, 1e-8, name)
    dist.barrier()
    return losses


CONFIGS = [(1, 1), (2, 2), (4, 4), (4, 2)]   # (world size, tsp size); (4, 2) is dp 2 x tsp 2


@pytest.mark.parametrize("world,tsp", CONFIGS, ids=lambda v: str(v))
@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_training_parity_float64(pools, family, world, tsp):
    losses = pools.of(world).run(train_parity, family, tsp)
    assert all(r == losses[0] for r in losses), "the loss must be identical on every rank"


def test_load_balancing_loss_skips_tsp_padding(pools):
    """14 tokens at tsp 2 are padded to 16 by shard_batch, which marks the two it added in the
    attention_mask it returns: the aux loss counts only the real tokens, like one process."""
    pools.of(2).run(train_parity, "mixtral", 2, seq=14, steps=1)


@pytest.mark.parametrize("world,tsp", [(2, 2), (4, 4), (4, 2)], ids=lambda v: str(v))
@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_ring_schedule_training_parity_float64(pools, family, world, tsp):
    """The other schedule: every expert's channels split 1/D, the slices circulating."""
    losses = pools.of(world).run(train_parity, family, tsp, "ring")
    assert all(r == losses[0] for r in losses), "the loss must be identical on every rank"


def test_schedule_chosen_by_the_bytes_formula():
    """"auto" picks the schedule that moves fewer bytes per layer by the traffic model's formula:
    below the crossover T* the expert schedule, above it the ring (Qwen3-30B-A3B's shape at
    D = 8: 4 T k h b (D-1)/D plus the counts against 3 E F h b (3D-2)/D plus the same router
    all-reduce, T* = 28964.6 tokens per rank)."""
    from tsp_core.layers.moe import MoESpec, choose_schedule, moe_bytes

    spec = MoESpec(2048, 768, 128, 8, 8)
    E, k, F_, h, D, b = 128, 8, 768, 2048, 8, 2
    for t in (1024, 28964, 28965, 65536):
        got = moe_bytes(E, k, F_, h, t, D)
        router = 2 * E * h * b * (D - 1) / D
        assert got.a == pytest.approx(4 * t * k * h * b * (D - 1) / D + 8 * E * (D - 1) / D
                                      + router)
        assert got.b == pytest.approx(3 * E * F_ * h * b * (3 * D - 2) / D + router)
        assert choose_schedule(spec, t) == ("expert" if got.a <= got.b else "ring"), t
    assert choose_schedule(spec, 28964) == "expert" and choose_schedule(spec, 28965) == "ring"
    assert choose_schedule(spec, None) == "expert"


# ------------------------------------------------------------------------- greedy generation

def greedy_generation(family: str, tsp: int, lengths: list[int], new: int,
                      schedule: str = "expert") -> list[list[int]]:
    """tsp_core.generate and the parallelized model's own generate give HF's greedy tokens, and
    every step's logits are HF's float64 logits (teacher-forced on the generated sequences) to
    1e-8: the prefill runs the all-to-all dispatch, each decode step TSPMoE.decode_step."""
    mesh = dist_pool.mesh(tsp)
    ref = build(family)
    model = tsp_core.parallelize(copy.deepcopy(ref), mesh, moe_schedule=schedule)
    # Hugging Face's generate fails with it (transformers 5.24: its load_balancing_loss_func
    # gets a [B, S] attention mask for the one-token decode steps' router logits)
    ref.config.output_router_logits = False
    ids, mask = left_padded(ref.config.vocab_size, lengths)
    want = ref.generate(ids, attention_mask=mask, max_new_tokens=new, do_sample=False)
    assert want.shape[1] == ids.shape[1] + new, "the reference stopped early: pick other prompts"
    got, steps = tsp_core.generate(model, ids, new, attention_mask=mask, return_logits=True)
    assert torch.equal(got, want), f"{family} D={tsp}: tokens differ\n{got}\n{want}"
    full_mask = torch.cat([mask, mask.new_ones(mask.shape[0], new)], dim=1)
    pos = (full_mask.cumsum(1) - 1).clamp(min=0)
    with torch.no_grad():
        ref_logits = ref(input_ids=want, attention_mask=full_mask, position_ids=pos).logits
    ref_logits = ref_logits[:, ids.shape[1] - 1:-1].transpose(0, 1)
    assert len(steps) == new
    for t, step in enumerate(steps):
        assert_close(step, ref_logits[t], 1e-8, f"{family} D={tsp} step {t} logits")
    hf_api = model.generate(ids, attention_mask=mask, max_new_tokens=new, do_sample=False)
    assert torch.equal(hf_api, want), f"{family} D={tsp}: model.generate differs\n{hf_api}"
    return got.tolist()


@pytest.mark.parametrize("tsp", [2, 4])
@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_greedy_generation_matches_hf(pools, family, tsp):
    # prompts of 6 and 13 tokens (13 is padded to 16 at D = 4), left-padded; 13 + 8 tokens run
    # past Mixtral's sliding window of 7
    outs = pools.of(tsp).run(greedy_generation, family, tsp, [6, 13], 8)
    assert all(o == outs[0] for o in outs), "ranks generated different tokens"


def test_greedy_generation_ring_schedule(pools):
    outs = pools.of(2).run(greedy_generation, "qwen3_moe", 2, [6, 13], 8, "ring")
    assert all(o == outs[0] for o in outs), "ranks generated different tokens"


# ------------------------------------------------------------------------------- checkpoints

CKPT_STEPS = 2


def reference_steps(family: str):
    """One process: the loss of each of CKPT_STEPS AdamW steps on 2 rows of 16 tokens, and the
    full state dict after each step."""
    ref = build(family)
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    losses, states = [], []
    for ids, labels in batches(ref.config.vocab_size, 2, 16, CKPT_STEPS):
        loss = reference_loss(ref, ids, labels)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        states.append({k: v.clone() for k, v in ref.state_dict().items()})
    return losses, states


def tsp_step(model, opt, mesh, ids, labels) -> float:
    out = model(**tsp_core.shard_batch({"input_ids": ids, "labels": labels}, mesh))
    out.loss.backward()
    opt.step()
    opt.zero_grad()
    return out.loss.item()


def assert_loss(got: float, want: float, what: str) -> None:
    assert abs(got - want) <= 1e-10 * abs(want), f"{what}: loss {got!r} vs {want!r}"


def assert_state(got: dict, want: dict, what: str, tol: float = 1e-8) -> None:
    assert sorted(got) == sorted(want), f"{what}: {sorted(set(got) ^ set(want))}"
    for name, t in want.items():
        assert_close(got[name], t, tol, f"{what}: {name}")


def save_at_tsp2(family: str, root: str, schedule: str = "expert") -> float:
    """Step 1 at tsp 2, then save_checkpoint (model + AdamW state) and save_pretrained; a plain
    model from_pretrained has the saved weights bit for bit; step 2 continues like one process."""
    import os

    mesh = dist_pool.mesh(2)
    losses, states = reference_steps(family)
    model = tsp_core.parallelize(build(family), mesh, moe_schedule=schedule)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    data = list(batches(model.config.vocab_size, 2, 16, CKPT_STEPS))
    assert_loss(tsp_step(model, opt, mesh, *data[0]), losses[0], "step 1 at tsp 2")
    tsp_core.save_checkpoint(os.path.join(root, "dcp_d2"), model, opt, step=1)
    saved = tsp_core.full_state_dict(model)
    assert_state(saved, states[0], "after step 1 at tsp 2")
    model.save_pretrained(os.path.join(root, "hf_d2"))
    dist.barrier()
    plain = type(build(family)).from_pretrained(os.path.join(root, "hf_d2"),
                                                dtype=torch.float64)
    got = plain.state_dict()
    assert sorted(got) == sorted(saved)
    for name, t in saved.items():
        assert got[name].dtype == t.dtype and torch.equal(got[name], t), \
            f"from_pretrained of save_pretrained at tsp 2: {name}"
    loss = tsp_step(model, opt, mesh, *data[1])
    assert_loss(loss, losses[1], "step 2 at tsp 2")
    assert_state(tsp_core.full_state_dict(model), states[1], "after step 2 at tsp 2")
    dist.barrier()
    return loss


def resume(family: str, tsp: int, root: str, saver_loss: float,
           schedule: str = "expert") -> None:
    """Load the tsp-2 checkpoint into a fresh model (other weights) and a fresh AdamW at ``tsp``
    (and, at tsp 1, into the plain Hugging Face model and a plain AdamW): step 2 gives the
    saving model's loss, and the weights after it are one process's (AdamW's moments and step
    count must have been loaded for that)."""
    import os

    mesh = dist_pool.mesh(tsp)
    losses, states = reference_steps(family)
    path = os.path.join(root, "dcp_d2")
    ids, labels = list(batches(build(family).config.vocab_size, 2, 16, CKPT_STEPS))[1]
    model = tsp_core.parallelize(build(family, seed=11), mesh, moe_schedule=schedule)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    assert tsp_core.load_checkpoint(path, model, opt) == {"step": 1}
    assert_state(tsp_core.full_state_dict(model), states[0], f"loaded at tsp {tsp}", 1e-12)
    loss = tsp_step(model, opt, mesh, ids, labels)
    assert_loss(loss, saver_loss, f"step 2 resumed at tsp {tsp} vs the saving model")
    assert_loss(loss, losses[1], f"step 2 resumed at tsp {tsp} vs one process")
    assert_state(tsp_core.full_state_dict(model), states[1], f"after step 2 resumed at tsp {tsp}")
    if tsp == 1:
        plain = build(family, seed=12)
        plain_opt = torch.optim.AdamW(plain.parameters(), lr=1e-2)
        assert tsp_core.load_checkpoint(path, plain, plain_opt) == {"step": 1}
        assert_state(plain.state_dict(), states[0], "loaded into the plain model", 1e-12)
        loss = reference_loss(plain, ids, labels)
        loss.backward()
        plain_opt.step()
        assert_loss(loss.item(), saver_loss, "step 2 of the plain model vs the saving model")
        assert_state(plain.state_dict(), states[1], "after step 2 of the plain model")
    dist.barrier()


@pytest.mark.parametrize("family,saved,loaded", [
    ("mixtral", "expert", "expert"), ("mixtral", "ring", "expert"),
    ("qwen3_moe", "expert", "ring")])
def test_checkpoint_saved_at_tsp2_resumes_at_4_1_and_plain(pools, tmp_path, family, saved,
                                                           loaded):
    # across schedules too: a checkpoint holds Hugging Face's tensors, whatever the layout
    saver = pools.of(2).run(save_at_tsp2, family, str(tmp_path), saved)
    assert all(v == saver[0] for v in saver)
    pools.of(4).run(resume, family, 4, str(tmp_path), saver[0], loaded)
    pools.of(1).run(resume, family, 1, str(tmp_path), saver[0], loaded)


def load_hf_saved(family: str, root: str, schedule: str = "expert") -> None:
    """A checkpoint written by Hugging Face's own save_pretrained (transformers 5 writes the
    per-expert layout of the Hub checkpoints: Mixtral's block_sparse_moe.experts.<e>.w1/w2/w3,
    Qwen3-MoE's mlp.experts.<e>.gate_proj/up_proj/down_proj) loads into a TSP model with
    load_full_state_dict and tsp_transformers.load_pretrained, giving the model's weights."""
    import os

    from tsp_transformers import load_pretrained

    mesh = dist_pool.mesh(2)
    ref = build(family)
    want = ref.state_dict()
    path = os.path.join(root, f"hf_own_{family}")
    if dist.get_rank() == 0:
        ref.save_pretrained(path)
    dist.barrier()
    model = tsp_core.parallelize(build(family, seed=5), mesh, moe_schedule=schedule)
    tsp_core.load_full_state_dict(model, path)
    assert_state(tsp_core.full_state_dict(model), want, "load_full_state_dict", 0.0)
    loaded = load_pretrained(path, mesh=mesh, dtype=torch.float64)
    assert_state(tsp_core.full_state_dict(loaded), want, "tsp_transformers.load_pretrained", 0.0)
    dist.barrier()


@pytest.mark.parametrize("family,schedule", [("mixtral", "expert"), ("qwen3_moe", "expert"),
                                             ("mixtral", "ring")])
def test_hf_saved_checkpoint_loads_into_tsp(pools, tmp_path, family, schedule):
    pools.of(2).run(load_hf_saved, family, str(tmp_path), schedule)


# ------------------------------------------------------------ collectives of one MoE layer

TRAFFIC = dict(hidden=16, intermediate=8, experts=8, top_k=2, rows=2, seq=16)


def routed_layer(tsp: int, case: str, schedule: str = "expert"):
    """A TSPMoE whose routing is set by construction, on this rank's tokens x [rows, seq/D, h],
    and the experts [N, k] every token must pick. The router reads expert e's logit from
    feature e (uniform) or experts 0..k-1 from feature 0, positive on every token (skewed)."""
    from tsp_core.layers.moe import TSPMoE

    c = TRAFFIC
    mesh = dist_pool.mesh(tsp)
    p, h, E, k = mesh.rank, c["hidden"], c["experts"], c["top_k"]
    N = c["rows"] * c["seq"] // tsp
    gen = torch.Generator().manual_seed(21)  # the same weights on every rank
    router = torch.zeros(E, h, dtype=torch.float64)
    x = 0.1 * torch.randn(N, h, generator=torch.Generator().manual_seed(30 + p),
                          dtype=torch.float64)
    if case == "uniform":  # token t of rank p: experts (t k + p + j) mod E, j < k: balanced
        router[:, :E] = 4 * torch.eye(E, dtype=torch.float64)
        x[:, :E] = 0
        chosen = torch.tensor([[(t * k + p + j) % E for j in range(k)] for t in range(N)])
        for j in range(k):
            x[torch.arange(N), chosen[:, j]] = 2.0 - 0.5 * j
    elif case == "skewed":  # every token: experts 0..k-1 (owned by rank 0)
        router[:k, 0] = torch.arange(k, 0, -1, dtype=torch.float64) + 2
        x[:, 0] = 1 + x[:, 0].abs()
        chosen = torch.arange(k).repeat(N, 1)
    else:
        raise ValueError(case)
    moe = TSPMoE(mesh, h, c["intermediate"], E, k, dtype=torch.float64, schedule=schedule)
    F_ = c["intermediate"]
    moe.load_full({"gate.weight": router,
                   "experts.gate_up_proj": 0.3 * torch.randn(E, 2 * F_, h, generator=gen,
                                                             dtype=torch.float64),
                   "experts.down_proj": 0.3 * torch.randn(E, h, F_, generator=gen,
                                                          dtype=torch.float64)})
    return mesh, moe, x.view(c["rows"], -1, h), chosen


def expected_log(tsp: int, counts: list[list[int]], rank: int):
    """(forward log, backward log) of one rank by comm's rule, from every rank's per-expert
    counts, and the bytes of the rows that really leave / reach the rank (dispatch)."""
    c = TRAFFIC
    D, E, h = tsp, c["experts"], c["hidden"]
    per, frac, row = E // D, (D - 1) / D, h * 8
    send = [[sum(counts[q][r * per:(r + 1) * per]) for r in range(D)] for q in range(D)]
    sent, received = sum(send[rank]), sum(send[q][rank] for q in range(D))
    leave = (sent - send[rank][rank]) * row
    arrive = (received - send[rank][rank]) * row
    rows = max(leave, arrive)  # comm.all_to_all: the larger of what leaves and what arrives
    forward = [("all_to_all", E * 8 * frac), ("all_to_all", rows), ("all_to_all", rows)]
    backward = [("all_to_all", rows), ("all_to_all", rows), ("all_reduce", 2 * E * h * 8 * frac)]
    return forward, backward, (leave, arrive)


def layer_traffic(tsp: int, case: str) -> dict:
    from tsp_core.layers.moe import route

    mesh, moe, x, chosen = routed_layer(tsp, case)
    x.requires_grad_(True)
    E = TRAFFIC["experts"]
    with comm.track() as fwd:
        y = moe(x)
    experts = route(moe.router_logits, moe.spec)[1]
    assert torch.equal(experts.sort(-1).values, chosen.sort(-1).values), "routing not as built"
    mine = torch.bincount(chosen.reshape(-1), minlength=E)
    every = [torch.zeros_like(mine) for _ in range(tsp)]
    dist.all_gather(every, mine, group=mesh.group)  # raw: not counted
    counts = [t.tolist() for t in every]
    want_fwd, want_bwd, (leave, arrive) = expected_log(tsp, counts, mesh.rank)
    g = torch.randn(y.shape, generator=torch.Generator().manual_seed(4), dtype=y.dtype)
    with comm.track() as bwd:
        (y * g).sum().backward()
    assert x.grad is not None and moe.gate.weight.grad is not None
    for what, stats, want in (("forward", fwd, want_fwd), ("backward", bwd, want_bwd)):
        calls, nbytes = {}, {}
        for kind, b in want:
            calls[kind] = calls.get(kind, 0) + 1
            nbytes[kind] = nbytes.get(kind, 0) + b
        assert dict(stats.calls) == calls, f"{case} D={tsp} {what}: {dict(stats.calls)}"
        assert dict(stats.bytes) == nbytes, f"{case} D={tsp} {what}: {dict(stats.bytes)}"
        assert sorted(stats.log) == sorted(want), f"{case} D={tsp} {what}: {stats.log}"
    dispatch = want_fwd[1][1]
    return dict(counted=dispatch, leave=leave, arrive=arrive)


@pytest.mark.parametrize("case", ["uniform", "skewed"])
@pytest.mark.parametrize("tsp", [2, 4])
def test_layer_collectives_exact(pools, tsp, case):
    """Forward: one all-to-all of the E per-expert counts, the dispatch and the combine
    all-to-all of the routed rows; backward: their two gradients and the router gradient's
    all-reduce; bytes by comm's rule (the larger of what leaves the rank and what reaches it)."""
    per_rank = pools.of(tsp).run(layer_traffic, tsp, case)
    c = TRAFFIC
    T_k_h_b = c["rows"] * c["seq"] // tsp * c["top_k"] * c["hidden"] * 8
    frac = (tsp - 1) / tsp
    if case == "uniform":  # docs/moe.md: T k h b (D-1)/D per all-to-all, counted and moved
        assert all(r == dict(counted=T_k_h_b * frac, leave=T_k_h_b * frac,
                             arrive=T_k_h_b * frac) for r in per_rank), per_rank
    else:  # rank 0 receives (D-1) T k h b; every other rank sends all its T k h b
        assert per_rank[0] == dict(counted=(tsp - 1) * T_k_h_b, leave=0,
                                   arrive=(tsp - 1) * T_k_h_b), per_rank
        assert all(r == dict(counted=T_k_h_b, leave=T_k_h_b, arrive=0)
                   for r in per_rank[1:]), per_rank


def ring_traffic(tsp: int, case: str) -> None:
    """Schedule "ring": the forward moves every expert's channel slices D-1 hops, the backward
    D-1 hops again and the gradient accumulators D hops (3 E F/D h b each), plus the router
    gradient's all-reduce; routing changes none of it (no token moves)."""
    c = TRAFFIC
    mesh, moe, x, _ = routed_layer(tsp, case, "ring")
    x.requires_grad_(True)
    D, E, h, F_ = tsp, c["experts"], c["hidden"], c["intermediate"]
    shard = 3 * E * F_ // D * h * 8
    with comm.track() as fwd:
        y = moe(x)
    with comm.track() as bwd:
        y.sum().backward()
    assert dict(fwd.calls) == {"ring_pass": D - 1} and dict(fwd.bytes) == {
        "ring_pass": (D - 1) * shard}, dict(fwd.bytes)
    assert dict(bwd.calls) == {"ring_pass": 2 * D - 1, "all_reduce": 1}, dict(bwd.calls)
    assert dict(bwd.bytes) == {"ring_pass": (2 * D - 1) * shard,
                               "all_reduce": 2 * E * h * 8 * (D - 1) / D}, dict(bwd.bytes)


@pytest.mark.parametrize("case", ["uniform", "skewed"])
def test_ring_layer_collectives_exact(pools, case):
    pools.of(4).run(ring_traffic, 4, case)


# ------------------------------------------------------------------------------ refusals

def refusals() -> list[str]:
    from transformers import MixtralConfig, MixtralForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    from tsp_core.distributed.params import ShardedModule
    from tsp_core.layers.moe import TSPMoE

    mesh = dist_pool.mesh(4)
    common = dict(vocab_size=96, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=64)
    msgs = []

    def expect(pattern: str, make) -> None:
        with comm.track() as stats, pytest.raises(ValueError, match=pattern) as info:
            make()
        assert dict(stats.calls) == {}, (pattern, dict(stats.calls))
        msgs.append(str(info.value))

    def refused(model, pattern: str) -> None:
        cls = type(model)
        before = {k: v.clone() for k, v in model.state_dict().items()}
        expect(pattern, lambda: tsp_core.parallelize(model, mesh))
        assert type(model) is cls and not any(isinstance(m, ShardedModule) for m in model.modules())
        after = model.state_dict()
        assert sorted(after) == sorted(before) and all(torch.equal(after[k], v)
                                                       for k, v in before.items())

    six = r"tsp_size \(4\) must divide the number of experts \(6\)"
    refused(MixtralForCausalLM(MixtralConfig(intermediate_size=48, num_local_experts=6,
                                             num_experts_per_tok=2, **common)), six)
    refused(Qwen3MoeForCausalLM(Qwen3MoeConfig(intermediate_size=64, moe_intermediate_size=16,
                                               num_experts=6, num_experts_per_tok=2, **common)),
            six)
    expect(six, lambda: TSPMoE(mesh, 32, 16, 6, 2, dtype=torch.float64))
    refused(MixtralForCausalLM(MixtralConfig(intermediate_size=48, num_local_experts=4,
                                             num_experts_per_tok=2, router_jitter_noise=0.1,
                                             **common)), r"router_jitter_noise=0\.1")
    refused(MixtralForCausalLM(MixtralConfig(intermediate_size=48, num_local_experts=4,
                                             num_experts_per_tok=5, **common)),
            r"num_experts_per_tok \(5\) must be between 1 and the number of experts \(4\)")
    return msgs


def test_refusals_on_every_rank(pools):
    msgs = pools.of(4).run(refusals)
    assert all(m == msgs[0] for m in msgs), "every rank must raise the same errors"
