"""Sharded checkpoints (tsp_core.save_checkpoint / load_checkpoint): a run that saves and resumes at
TSP degree 4 -> 2 -> 1 -> 4 (data parallel 1, 2, 4, 1: each replica its own rows of a 4-row global
batch), optimizer state included, has every step's gradients and the final weights of one
uninterrupted single-process run on the global batch (float64, 1e-10); the same files load into a
plain Hugging Face model; an unfinished save, a checkpoint of another model and a bad save fail on
every rank and change nothing."""

from __future__ import annotations

import copy
import os
from fractions import Fraction

import pytest
import torch
import torch.distributed as dist

import tsp_core
from tests.support import dist_pool, gather, hf_models
from tests.support.reference import assert_close

ROWS = 4  # the global batch: data-parallel replicas (1, 2 or 4) split it, each its own rows


def batch(step: int, vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab, (ROWS, 16), generator=torch.Generator().manual_seed(100 + step))


def reference_run(family: str, steps: int):
    """One process on the global batch; returns the model, its optimizer and each step's grads."""
    model = hf_models.build(family, torch.float64)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    grads = []
    for step in range(steps):
        ids = batch(step, model.config.vocab_size)
        hf_models.reference_loss(model, ids, ids).backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
        opt.step()
        opt.zero_grad()
    return model, opt, grads


def tsp_steps(model, opt, mesh, steps: range, ref_grads: list[dict] | None = None) -> None:
    """Steps on this data-parallel replica's rows of the global batch; with ``ref_grads``, every
    gradient must equal the one-process gradient of the global batch (a data-parallel mean where
    a sum belongs, or a TSP-degree factor, fails here; AdamW's update alone would hide it)."""
    dp, dp_rank = mesh.dp_size, dist.get_rank() // mesh.size
    for step in steps:
        ids = batch(step, model.config.vocab_size).chunk(dp)[dp_rank]
        model(**tsp_core.shard_batch({"input_ids": ids, "labels": ids}, mesh)).loss.backward()
        if ref_grads is not None:
            got = gather.full_grads(model)
            for name, g in ref_grads[step].items():
                assert_close(got[name], g, 1e-10, f"grad of {name} at step {step} "
                                                  f"(tsp {mesh.size}, dp {dp})")
        opt.step()
        opt.zero_grad()


def reshard_run(family: str, root: str) -> dict:
    # degree 4 (dp 1), 2 (dp 2 x tsp 2), 1 (dp 4), then 4 again; one fresh model (another seed) and
    # a fresh optimizer at each stage, filled only by load_checkpoint
    stages = [(4, range(0, 2)), (2, range(2, 3)), (1, range(3, 4)), (4, range(4, 5))]
    ref, ref_opt, ref_grads = reference_run(family, 5)
    prev = None
    for tsp, steps in stages:
        mesh = dist_pool.mesh(tsp)
        seed = 0 if prev is None else 7 + tsp  # the reference's weights only through the checkpoint
        model = tsp_core.parallelize(hf_models.build(family, torch.float64, seed=seed), mesh)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        if prev is not None:
            extra = tsp_core.load_checkpoint(prev, model, opt)
            assert extra == {"step": steps.start, "note": f"after {steps.start}"}, extra
        tsp_steps(model, opt, mesh, steps, ref_grads)
        prev = os.path.join(root, f"d{tsp}_step{steps.stop}")
        tsp_core.save_checkpoint(prev, model, opt, step=steps.stop, note=f"after {steps.stop}")
    got = tsp_core.full_state_dict(model)
    for name, t in ref.state_dict().items():
        assert_close(got[name], t, 1e-10, f"{name} after 5 steps with resharding resumes")

    # the degree-4 checkpoint of step 5 into a plain model and a plain AdamW
    plain = hf_models.build(family, torch.float64, seed=3)
    plain_opt = torch.optim.AdamW(plain.parameters(), lr=1e-2)
    assert tsp_core.load_checkpoint(prev, plain, plain_opt)["step"] == 5
    for name, t in ref.state_dict().items():
        assert_close(plain.state_dict()[name], t, 1e-10, f"{name} in a plain model")
    ref_state = {n: ref_opt.state[p] for n, p in ref.named_parameters()}
    for n, p in plain.named_parameters():
        for key in ("exp_avg", "exp_avg_sq"):
            assert_close(plain_opt.state[p][key], ref_state[n][key], 1e-10, f"{n} {key}")
        assert plain_opt.state[p]["step"].item() == 5
    # and it keeps training like the reference
    ids = batch(5, plain.config.vocab_size)
    for m, o in ((plain, plain_opt), (ref, ref_opt)):
        hf_models.reference_loss(m, ids, ids).backward()
        o.step()
    for name, t in ref.state_dict().items():
        assert_close(plain.state_dict()[name], t, 1e-10, f"{name}, plain model, step 6")
    dist.barrier()
    return sorted(os.listdir(root))


@pytest.mark.parametrize("family", ["llama", "llama-tied", "phi3"])
def test_resume_at_other_degrees_matches_one_process(pool, tmp_path, family):
    # llama: 2 KV heads, their rows sliced over 4 ranks at degree 4; llama-tied: vocabulary 101,
    # padded; phi3: fused qkv_proj / gate_up_proj, each saved as one tensor under its own name
    for listing in pool.run(reshard_run, family, str(tmp_path)):  # what every rank sees
        assert listing == ["d1_step4", "d2_step3", "d4_step2", "d4_step5"], listing


def failures(root: str) -> list[str]:
    mesh = dist_pool.mesh(2)
    model = tsp_core.parallelize(hf_models.build("llama", torch.float64), mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    tsp_steps(model, opt, mesh, range(1))
    good = os.path.join(root, "good")
    tsp_core.save_checkpoint(good, model, opt, step=1)
    before = {k: v.to_local().clone() for k, v in model.state_dict().items()}
    before_opt = copy.deepcopy(opt.state_dict())
    msgs = []

    def expect(exc, pattern, fn):
        with pytest.raises(exc, match=pattern) as info:
            fn()
        msgs.append(str(info.value))

    # a save that fails (an extra value torch.load cannot read back) raises on every rank before
    # anything is written; the existing checkpoint is untouched
    expect(ValueError, r"extra values \['step'\] must be tensors, numbers",
           lambda: tsp_core.save_checkpoint(good, model, opt, step=object()))
    # a save that died before its rename, and a directory without the completeness marker
    if dist.get_rank() == 0:
        os.makedirs(good + ".partial")
        os.makedirs(os.path.join(root, "empty"))
    dist.barrier()
    expect(FileNotFoundError, r"good.partial is a save that did not finish",
           lambda: tsp_core.load_checkpoint(good + ".partial", model))
    expect(FileNotFoundError, r"empty is not a tsp_core checkpoint",
           lambda: tsp_core.load_checkpoint(os.path.join(root, "empty"), model))
    assert tsp_core.latest_checkpoint(root) == good
    # checkpoints of other models: q/k/v biases (qwen2), another hidden size
    other = tsp_core.parallelize(hf_models.build("qwen2", torch.float64), mesh)
    tsp_core.save_checkpoint(os.path.join(root, "qwen2"), other)
    expect(ValueError, r"holds a Qwen2ForCausalLM that does not match this LlamaForCausalLM: "
                       r"6 parameters not in this model "
                       r"\(e.g. \['model.layers.0.self_attn.k_proj.bias'",
           lambda: tsp_core.load_checkpoint(os.path.join(root, "qwen2"), model))
    from transformers import LlamaConfig, LlamaForCausalLM
    wide = LlamaForCausalLM(LlamaConfig(**{**hf_models.COMMON, "hidden_size": 32}, vocab_size=96))
    wide = tsp_core.parallelize(wide.to(torch.float64), mesh)
    tsp_core.save_checkpoint(os.path.join(root, "wide"), wide)
    expect(ValueError, r"model.embed_tokens.weight has shape \(96, 32\) in the checkpoint, "
                       r"\(96, 64\) here",
           lambda: tsp_core.load_checkpoint(os.path.join(root, "wide"), model))
    expect(ValueError, r"was saved without optimizer state; pass optimizer=None",
           lambda: tsp_core.load_checkpoint(os.path.join(root, "wide"), model, opt))
    # a checkpoint whose last tensor alone is wrong (lm_head: one vocabulary row short), with
    # optimizer state: refused before anything is read, also when checked only; a fresh
    # optimizer is left without state (torch.distributed.checkpoint's state dict creates it)
    short = hf_models.build("llama", torch.float64)
    short.lm_head = torch.nn.Linear(64, 95, bias=False, dtype=torch.float64)
    short_opt = torch.optim.AdamW(short.parameters(), lr=1e-2)
    tsp_core.save_checkpoint(os.path.join(root, "short"), short, short_opt)
    fresh = torch.optim.AdamW(model.parameters(), lr=1e-2)
    from tsp_core.state.resharding import check_checkpoint
    for load in (tsp_core.load_checkpoint, check_checkpoint):
        for optimizer in (opt, fresh):
            expect(ValueError, r"lm_head.weight has shape \(95, 64\) in the checkpoint, "
                               r"\(96, 64\) here",
                   lambda load=load, optimizer=optimizer:
                   load(os.path.join(root, "short"), model, optimizer))
            assert not fresh.state, f"{load.__name__} left state in a fresh optimizer"
    check_checkpoint(good, model, fresh)
    assert not fresh.state, "check_checkpoint left state in a fresh optimizer"
    # the adapters' hooks: an optimizer-only checkpoint (TSPTrainer's) does not load as weights;
    # framework metadata torch.load(weights_only=True) refuses (Lightning's) is read only on request
    opt_only, pickled = os.path.join(root, "opt_only"), os.path.join(root, "pickled")
    tsp_core.save_checkpoint(opt_only, model, [opt], model_state=False)
    expect(ValueError, r"holds optimizer state only \(saved with model_state=False\)",
           lambda: tsp_core.load_checkpoint(opt_only, model, opt))
    tsp_core.save_checkpoint(pickled, model, extra_weights_only=False, meta=Fraction(1, 3))
    expect(ValueError, r"saved with extra_weights_only=False and do not load with "
                       r"weights_only=True",
           lambda: tsp_core.load_checkpoint(pickled, model))
    after = {k: v.to_local() for k, v in model.state_dict().items()}
    assert all(torch.equal(before[k], after[k]) for k in before), "a failed load changed the model"
    after_opt = opt.state_dict()
    for i, s in before_opt["state"].items():
        assert all(torch.equal(s[k].to_local() if hasattr(s[k], "to_local") else s[k],
                               after_opt["state"][i][k].to_local()
                               if hasattr(after_opt["state"][i][k], "to_local")
                               else after_opt["state"][i][k]) for k in s)
    assert tsp_core.load_checkpoint(pickled, model, weights_only=False) == {"meta": Fraction(1, 3)}
    assert tsp_core.load_checkpoint(opt_only, model, opt, model_state=False) == {}
    assert tsp_core.load_checkpoint(good, model, opt) == {"step": 1}
    dist.barrier()
    return msgs


def test_failures_change_nothing_and_agree_on_every_rank(pool, tmp_path):
    per_rank = pool.run(failures, str(tmp_path))
    assert all(m == per_rank[0] for m in per_rank), per_rank


LORA_RANK = 4


def lora_reference(steps: int) -> tuple[list[float], list[dict], dict, dict]:
    """The same PeftModel trained by plain PEFT and torch on one process on the global batch:
    each step's loss and adapter gradients, then the adapters and the base after ``steps``."""
    model = hf_models.lora_model(hf_models.build("llama", torch.float64), LORA_RANK)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    losses, grads = [], []
    for step in range(steps):
        ids = batch(step, model.config.vocab_size)
        loss = hf_models.reference_loss(model, ids, ids)
        loss.backward()
        losses.append(loss.item())
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad})
        opt.step()
        opt.zero_grad()
    sd = model.state_dict()
    adapters = {k: v.clone() for k, v in sd.items() if ".lora_" in k}
    return losses, grads, adapters, {k: v.clone() for k, v in sd.items() if ".lora_" not in k}


def lora_steps(model, opt, mesh, steps: range, ref_losses: list[float], ref_grads: list[dict]
               ) -> None:
    """:func:`tsp_steps` for a PeftModel, checking each step's loss too: the mean of the
    data-parallel replicas' losses (each replica's rows hold as many tokens) against the one
    process's loss of the global batch."""
    dp, dp_rank = mesh.dp_size, dist.get_rank() // mesh.size
    for step in steps:
        ids = batch(step, model.config.vocab_size).chunk(dp)[dp_rank]
        loss = model(**tsp_core.shard_batch({"input_ids": ids, "labels": ids}, mesh)).loss
        loss.backward()
        mean = loss.detach().clone()
        dist.all_reduce(mean)  # every rank of a replica holds its replica's loss
        mean = mean.item() / dist.get_world_size()
        assert abs(mean - ref_losses[step]) <= 1e-10 * abs(ref_losses[step]), (
            f"loss at step {step} (tsp {mesh.size}, dp {dp}): {mean} vs {ref_losses[step]}")
        got = gather.full_grads(model)
        assert sorted(got) == sorted(ref_grads[step]), sorted(set(got) ^ set(ref_grads[step]))
        for name, g in ref_grads[step].items():
            assert_close(got[name], g, 1e-10, f"grad of {name} at step {step} "
                                              f"(tsp {mesh.size}, dp {dp})")
        opt.step()
        opt.zero_grad()


def lora_model(tsp: int, adapter_seed: int):
    """The PeftModel of the reference (its base from seed 0, as a pretrained base is loaded again
    on resume), adapters from ``adapter_seed``, parallelized at ``tsp``; AdamW over the
    adapters, as a LoRA user builds it."""
    mesh = dist_pool.mesh(tsp)
    base = hf_models.build("llama", torch.float64)
    model = tsp_core.parallelize(hf_models.lora_model(base, LORA_RANK, seed=adapter_seed), mesh)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    return model, opt, mesh


def lora_reshard_run(root: str) -> list[str]:
    """A LoRA run saved at tsp 2 (dp 2) after 2 steps resumes at tsp 1 (dp 4), tsp 4 (dp 1) and
    tsp 2 (dp 2), each with adapters of another seed and a fresh optimizer filled only by
    load_checkpoint: steps 3-4 have the uninterrupted run's losses and adapter gradients, and the
    adapters after step 4 are its adapters, the base untouched (float64, 1e-10). The checkpoint
    holds the adapters alone. Returns what failed to load, for the messages."""
    ref_losses, ref_grads, ref_adapters, ref_base = lora_reference(4)
    model, opt, mesh = lora_model(2, adapter_seed=1)  # the reference's adapters
    lora_steps(model, opt, mesh, range(0, 2), ref_losses, ref_grads)
    ckpt = os.path.join(root, "lora_d2_step2")
    tsp_core.save_checkpoint(ckpt, model, opt, step=2)
    from torch.distributed.checkpoint import FileSystemReader
    saved = [k[len("model."):] for k in FileSystemReader(ckpt).read_metadata().state_dict_metadata
             if k.startswith("model.")]
    assert sorted(saved) == sorted(ref_adapters), sorted(set(saved) ^ set(ref_adapters))
    for tsp in (1, 4, 2):
        model, opt, mesh = lora_model(tsp, adapter_seed=7 + tsp)
        assert tsp_core.load_checkpoint(ckpt, model, opt) == {"step": 2}
        lora_steps(model, opt, mesh, range(2, 4), ref_losses, ref_grads)
        got = tsp_core.full_state_dict(model)
        for name, t in ref_adapters.items():
            assert_close(got[name], t, 1e-10, f"{name} after 4 steps, resumed at tsp {tsp}")
        for name, t in ref_base.items():  # full_state_dict names a base weight without PEFT's
            mine = got[name.replace("base_layer.", "")]  # base_layer., as saved for Transformers
            assert torch.equal(mine, t), f"{name} (base) changed, resumed at tsp {tsp}"
    plain = tsp_core.parallelize(hf_models.build("llama", torch.float64), dist_pool.mesh(2))
    msgs = []
    with pytest.raises(ValueError, match=r"holds the LoRA adapters of a PeftModel, not its "
                                         r"base: load it into the PeftModel") as info:
        tsp_core.load_checkpoint(ckpt, plain)
    msgs.append(str(info.value))
    dist.barrier()
    return msgs


def test_lora_checkpoint_resumes_at_other_degrees(pool, tmp_path):
    per_rank = pool.run(lora_reshard_run, str(tmp_path))
    assert all(m == per_rank[0] for m in per_rank), per_rank
