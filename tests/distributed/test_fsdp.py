"""TSP x FSDP2 (tsp_core.distributed.fsdp): FSDP2 shards each rank's TSP shard over "dp_shard" (HSDP
with replicas), and training, clipping, checkpoints and generation give the one-process numbers.

References are the unmodified Hugging Face model on one process, in float64. The model has a
vocabulary that TSP pads (101 rows over 2 ranks) and FSDP2 then splits unevenly (51 rows over 2),
and one key/value head split over the TSP ranks."""

from __future__ import annotations

import copy
import os
import tempfile

import pytest
import torch
import torch.distributed as dist

import tsp_core
from tests.support import dist_pool, gather, hf_models
from tests.support.reference import assert_close
from tsp_core.distributed.mesh import check_dp_shard
from tsp_core.distributed.params import local

STEPS, ROWS, SEQ, LR, CLIP = 3, 4, 22, 1e-2, 0.05
FAMILY, KV = "llama-tied", 1


def _batches(vocab: int, steps: int = STEPS) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(7)
    return [torch.randint(0, vocab, (ROWS, SEQ), generator=gen) for _ in range(steps)]


def _step(model, mesh, ids: torch.Tensor, opt) -> tuple[float, float, dict | None]:
    """One training step on this data-parallel rank's rows: loss, norm before clipping."""
    dp_rank = dist.get_rank() // mesh.size
    mine = ids.chunk(mesh.dp_size)[dp_rank]
    loss = model(**tsp_core.shard_batch({"input_ids": mine, "labels": mine}, mesh)).loss
    loss.backward()
    grads = gather.full_grads(model)
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
    opt.step()
    opt.zero_grad()
    return loss.item(), norm.full_tensor().item(), grads


def storage_floor(ref, tsp: int, shard: int) -> float:
    """The parameter bytes a rank must hold at least, from the parameter counts: 1/(D x dp_shard)
    of the model (FSDP2 pads uneven splits, so a rank may hold a little more)."""
    return sum(p.numel() * p.element_size() for p in ref.parameters()) / (tsp * shard)


def assert_sharded(model, floor: float, when: str) -> float:
    """This rank's parameter storage (every parameter's local untyped storage, measured) is within
    3% above ``floor``: no FSDP2 unit, the root (embedding, final norm, LM head) included, is left
    whole. Returns held / floor."""
    held = gather.storage_bytes(model)
    assert floor <= held <= 1.03 * floor, \
        f"rank {dist.get_rank()} {when}: {held} parameter bytes held, floor {floor:.0f} " \
        f"(ratio {held / floor:.3f}, at most 1.03)"
    return held / floor


def adamw_matches_one_process(replicas: int, shard: int, tsp: int, recompute: str) -> float:
    mesh = dist_pool.mesh(tsp, dp_shard=shard)
    assert (mesh.dp_size, mesh.fsdp_size) == (replicas * shard, shard)
    ref = hf_models.build(FAMILY, torch.float64, kv_heads=KV)
    batches = _batches(ref.config.vocab_size)
    model = copy.deepcopy(ref)
    if recompute != "none":
        from tsp_core.plan.simulate import recompute_kwargs

        model.activation_checkpointing_enable(
            activation_checkpointing_kwargs=recompute_kwargs(recompute))
    model = tsp_core.parallelize(model, mesh)
    want = hf_models.sgd_reference(ref, batches, LR, CLIP, optimizer=torch.optim.AdamW)
    assert min(want["norms"]) > 2 * CLIP, want["norms"]  # clipping is active at every step

    # FSDP2 holds 1/(D * dp_shard) of the model per rank, up to the padding of uneven splits,
    # after parallelize and after every training step (FSDP2 reshards after backward)
    floor = storage_floor(ref, tsp, shard)
    ratios = [assert_sharded(model, floor, "after parallelize")]

    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    run: dict = {"losses": [], "norms": []}
    for step, ids in enumerate(batches):
        loss, norm, grads = _step(model, mesh, ids, opt)
        run["losses"].append(loss)
        run["norms"].append(norm)
        ratios.append(assert_sharded(model, floor, f"after training step {step}"))
        if step == 0:
            run["grads0"] = grads
            # gradients are stored sharded too
            assert all(local(p.grad if p.grad is not None else p).numel() == local(p).numel()
                       for p in model.parameters())
    run["weights"] = tsp_core.full_state_dict(model)
    hf_models.assert_matches_reference(run, want, 1e-8, norm_tol=1e-9, loss_tol=1e-10,
                                       what=f"dp_replicate {replicas} x dp_shard {shard} x tsp "
                                            f"{tsp} ({recompute} recompute): ")
    dist.barrier()
    return max(ratios)


@pytest.mark.parametrize("replicas,shard,tsp,recompute",
                         [(1, 2, 2, "none"), (2, 1, 2, "none"), (1, 2, 2, "full"),
                          (2, 2, 1, "none")],
                         ids=["shard2-tsp2", "replicate2-tsp2", "shard2-tsp2-recompute",
                              "hsdp-replicate2-shard2"])
def test_adamw_with_clipping_matches_one_process(pools, replicas, shard, tsp, recompute):
    ratios = pools.of(4).run(adamw_matches_one_process, replicas, shard, tsp, recompute)
    assert all(1.0 <= r <= 1.03 for r in ratios), ratios


def mixed_precision_step() -> None:
    """bf16 parameters in the schedules, float32 gradients reduced and stored (FSDP2's
    MixedPrecisionPolicy); the loss near the float32 one-process loss; reshard_after_forward
    passed through."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    mesh = dist_pool.mesh(2, dp_shard=2)
    ref = hf_models.build(FAMILY, torch.float32, kv_heads=KV)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    model = tsp_core.parallelize(copy.deepcopy(ref), mesh, mp_policy=policy,
                                 reshard_after_forward=False)
    seen = []
    layer = model.model.layers[0]
    layer.self_attn.register_forward_pre_hook(
        lambda m, _a: seen.append(local(m.q_proj.weight).dtype))
    ids = _batches(ref.config.vocab_size, 1)[0]
    want = hf_models.reference_loss(ref, ids, ids).item()
    dp_rank = dist.get_rank() // mesh.size
    mine = ids.chunk(mesh.dp_size)[dp_rank]
    stored = local(layer.self_attn.q_proj.weight).shape
    loss = model(**tsp_core.shard_batch({"input_ids": mine, "labels": mine}, mesh)).loss
    # reshard_after_forward=False: the layer keeps its whole (bf16) TSP shard until backward
    held = local(layer.self_attn.q_proj.weight)
    assert held.dtype == torch.bfloat16 and held.shape[0] == 2 * stored[0], (held.shape, stored)
    loss.backward()
    assert seen == [torch.bfloat16], seen
    assert all(p.dtype == torch.float32 and p.grad.dtype == torch.float32
               for p in model.parameters()), "sharded parameters and gradients stay float32"
    assert abs(loss.item() - want) <= 2e-2 * abs(want), (loss.item(), want)
    with pytest.raises(ValueError, match=r"mp_policy is FSDP2's.*dp_shard > 1"):
        tsp_core.parallelize(copy.deepcopy(ref), dist_pool.mesh(2), mp_policy=policy)
    dist.barrier()


def test_mixed_precision_and_reshard_after_forward(pools):
    pools.of(4).run(mixed_precision_step)


def generate_and_full_logits_match_hf() -> None:
    """The paths that call the model's parts outside its forward (generation's steps, the LM head
    of full_logits) see whole TSP shards, and leave every rank holding only its FSDP2 share
    again (fsdp.root_unsharded reshards the root)."""
    mesh = dist_pool.mesh(2, dp_shard=2)
    ref = hf_models.build(FAMILY, torch.float64, kv_heads=KV)
    model = tsp_core.parallelize(copy.deepcopy(ref), mesh)
    floor = storage_floor(ref, 2, 2)
    assert_sharded(model, floor, "after parallelize")
    ids = _batches(ref.config.vocab_size, 1)[0][:2, :9]
    want = ref.generate(ids, max_new_tokens=5, do_sample=False)
    assert torch.equal(tsp_core.generate(model, ids, 5), want)
    assert_sharded(model, floor, "after generate")
    with torch.no_grad():
        out = tsp_core.full_logits(model, {"input_ids": ids, "labels": ids})
        assert_close(out.logits, ref(input_ids=ids).logits, 1e-10, "full_logits")
        assert abs(out.loss.item() - hf_models.reference_loss(ref, ids, ids).item()) < 1e-10
    assert_sharded(model, floor, "after full_logits")


def test_generation_and_full_logits(pools):
    pools.of(4).run(generate_and_full_logits_match_hf)


def moe_gradients_match_one_process(schedule: str) -> None:
    """Mixtral's experts folded onto the TSP axis, then FSDP2 over them: loss (with the
    load-balancing term) and every gradient as one process."""
    from tests.layers import test_moe

    mesh = dist_pool.mesh(2, dp_shard=2)
    ref = test_moe.build("mixtral")
    model = tsp_core.parallelize(copy.deepcopy(ref), mesh, moe_schedule=schedule)
    ids = _batches(ref.config.vocab_size, 1)[0][:, :14]
    want = test_moe.reference_loss(ref, ids, ids)
    want.backward()
    mine = ids.chunk(mesh.dp_size)[dist.get_rank() // mesh.size]
    loss = model(**tsp_core.shard_batch({"input_ids": mine, "labels": mine}, mesh)).loss
    loss.backward()
    assert abs(loss.item() - want.item()) <= 1e-10 * abs(want.item()), (loss.item(), want.item())
    grads = gather.full_grads(model)
    assert sorted(grads) == sorted(n for n, _ in ref.named_parameters())
    for name, p in ref.named_parameters():
        assert_close(grads[name], p.grad, 1e-8, f"{schedule}: {name}")


@pytest.mark.parametrize("schedule", ["expert", "ring"])
def test_moe(pools, schedule):
    pools.of(4).run(moe_gradients_match_one_process, schedule)


# ---------------------------------------------------------------- checkpoints across shapes

def _training(tsp: int, shard: int | None, path: str, mode: str) -> tuple[float, dict]:
    """Step 1 then save (``mode`` "save": save_checkpoint to ``path``, and the one-file full state
    dicts to ``path``.pt), or load ("dcp" or "one-file") then step 2: step 2's loss and the final
    weights."""
    from tsp_core.state.resharding import full_optimizer_state_dict, load_full_optimizer_state_dict

    mesh = dist_pool.mesh(tsp, dp_shard=shard)
    ref = hf_models.build(FAMILY, torch.float64, kv_heads=KV)
    model = tsp_core.parallelize(copy.deepcopy(ref), mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    first, second = _batches(ref.config.vocab_size, 2)
    if mode == "save":
        _step(model, mesh, first, opt)
        tsp_core.save_checkpoint(path, model, opt, step=1)
        weights = tsp_core.full_state_dict(model, rank0_only=True)
        state = full_optimizer_state_dict(model, opt, rank0_only=True)
        if dist.get_rank() == 0:
            torch.save((weights, state), path + ".pt")
        dist.barrier()
    elif mode == "dcp":
        assert tsp_core.load_checkpoint(path, model, opt) == {"step": 1}
    else:
        weights, state = torch.load(path + ".pt", weights_only=True)
        tsp_core.load_full_state_dict(model, weights)
        load_full_optimizer_state_dict(model, opt, state)
    loss = _step(model, mesh, second, opt)[0]
    return loss, tsp_core.full_state_dict(model)


def _same(got: tuple[float, dict], want: tuple[float, dict], what: str) -> None:
    assert abs(got[0] - want[0]) <= 1e-10 * abs(want[0]), f"{what}: loss {got[0]} vs {want[0]}"
    assert sorted(got[1]) == sorted(want[1]), what
    for k, v in want[1].items():
        assert_close(got[1][k], v, 1e-8, f"{what}: {k}")


def test_checkpoint_resumes_at_other_shapes(pools):
    """Saved at dp_shard 2 x tsp 2; resumed at tsp 4, tsp 2 alone, dp_shard 4 x tsp 1 (another
    FSDP2 split, 101 vocabulary rows over 4) and on one process through save_checkpoint, and at
    dp_shard 2 x tsp 2 from the one-file state dicts: step 2 as if never interrupted."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "ckpt")
        want = pools.of(4).run(_training, 2, 2, path, "save")[0]
        for what, size, tsp, shard, mode in (("tsp 4", 4, 4, None, "dcp"),
                                             ("tsp 2 alone", 2, 2, None, "dcp"),
                                             ("dp_shard 4 x tsp 1", 4, 1, 4, "dcp"),
                                             ("dp_shard 2 x tsp 2, one file", 4, 2, 2, "one-file")):
            for got in pools.of(size).run(_training, tsp, shard, path, mode):
                _same(got, want, f"saved at dp_shard 2 x tsp 2, resumed at {what}")
        # one process: the unmodified model and its optimizer
        ref = hf_models.build(FAMILY, torch.float64, kv_heads=KV)
        opt = torch.optim.AdamW(ref.parameters(), lr=LR)
        assert tsp_core.load_checkpoint(path, ref, opt) == {"step": 1}
        ids = _batches(ref.config.vocab_size, 2)[1]
        loss = hf_models.reference_loss(ref, ids, ids)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), CLIP)
        opt.step()
        _same((loss.item(), ref.state_dict()), want, "resumed on one process")


def test_dp_shard_must_divide_data_parallel():
    assert check_dp_shard(8, 4) == 2
    with pytest.raises(ValueError, match=r"dp_shard \(3\) must be a divisor of the "
                                         r"data-parallel size \(4\)"):
        check_dp_shard(4, 3)
