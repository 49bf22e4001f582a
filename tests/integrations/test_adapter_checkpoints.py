"""Adapter checkpoints that reshard: Lightning (Trainer and Fabric), Accelerate and TSPTrainer save
at TSP degree 2 (data parallel 1) and resume at degree 1 (one process; also the unmodified model)
and at degree 2 x data parallel 2; the continued run matches the uninterrupted one. TSPTrainer's
``load_best_model_at_end`` restores the best step's weights exactly.

Three launches of tests/jobs/adapter_checkpoint_job.py run every adapter in turn: 2 processes (the
uninterrupted 4-step runs, each saving after step 2 as its users do), 1 process and 4 processes
(steps 3-4 from those checkpoints). Everything is float64; compared per resumed step: the loss,
the norm of the full gradient (a gradient D or dp times too large shows here, where AdamW would
hide it in the weights) and the learning rate; then the final full weights; on every rank of every
launch (each writes its own results), against every rank of the uninterrupted run. Tolerance 1e-10
(measured: 0 to 2e-16); the Trainer's logged losses are float32, so 1e-6 there (its logged
gradient norms are float64: 1e-10).

What keeps the data the same: every global batch has the same rows at every data-parallel size,
each replica taking its share. Lightning: one global batch of 4 rows per epoch from the sampler
Lightning injects (shuffled with seed 0 + epoch; dp replicas take every dp-th row) and the
checkpoint at an epoch end; Lightning restarts a non-stateful loader's epoch on resume instead of
fast-forwarding it, so with more batches per epoch a resumed run sees other data, with or without
TSP. The plain-model resume gets the same sampler explicitly. Fabric: batches built per step.
Accelerate: ``split_batches=True``, 2 rows per step in order. Trainer: its seeded sampler, 2 rows
per step (``per_device_train_batch_size`` 2 / dp), the batches already done skipped on resume.

Broken variants (the job's ``--broken`` passes; see its ``break_on_purpose``) run in the save and
the one-process launches, each framework's after its good runs and put back before the next
framework runs, and the same comparisons must fail on them: ``drop-optimizer`` (resumes at one
process with a fresh optimizer: every directory checkpoint's run diverges, the one-file ones,
which do not use that loader, still match), ``local-layout`` (the old local-layout saves, written
by a broken save pass, do not resume at one process) and ``best-model`` (the best checkpoint not
loaded at the end; in the same broken save pass: it touches only TSPTrainer, local-layout only
the others).

In the shared 2-process pool: the Lightning strategies' one-file resume (weights, then each
optimizer's state) refuses a file whose last optimizer tensor, or last weight, has the wrong shape
without changing either; TSPTrainer's two resume steps refuse a checkpoint without its
scheduler.pt without changing weights, optimizer or scheduler (docs/checkpointing.md "Checks
before loading").
"""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch
import torch.distributed as dist

import tsp_core
from tests.support import launch
from tests.support.reference import assert_close

JOB = os.path.join(launch.JOBS, "adapter_checkpoint_job.py")
SAVE_AT, STEPS = 2, 4
# what each framework's runs record per step (Fabric's loop has no scheduler)
LIT_KEYS = ACC_KEYS = ("losses", "norms", "lrs")
FABRIC_KEYS = ("losses", "norms")


def run_job(processes: int, *args: str) -> None:
    """Launch the job (it must end cleanly on every rank)."""
    launcher = [sys.executable] if processes == 1 else launch.torchrun(processes)
    launch.run([*launcher, launch.EXIT_CLEANLY, JOB, *args], processes, timeout=600)


def results(out: str, rank: int) -> tuple[dict, dict]:
    with open(os.path.join(out, f"result-{rank}.json")) as f:
        return json.load(f), torch.load(os.path.join(out, f"weights-{rank}.pt"))


def every_rank(out: str, processes: int) -> list[tuple[dict, dict]]:
    """Every rank's (results, weights) of one pass, in rank order."""
    return [results(out, r) for r in range(processes)]


@pytest.fixture(scope="module")
def launches(tmp_path_factory) -> str:
    """The three launches: 'save' (tsp 2, dp 1), 'tsp1' (one process), 'tsp2dp2' (4 processes),
    each writing its good pass in ROOT/NAME (the checkpoints in ROOT/ckpt); the save and the
    one-process launch also run the broken variants' passes after each framework's good one
    (see :func:`broken`). Returns ROOT."""
    root = tmp_path_factory.mktemp("adapter_ckpt")
    ckpt, broken_ckpt = str(root / "ckpt"), str(root / "broken" / "ckpt")
    extra = {"save": [f"local-layout,best-model --ckpt {broken_ckpt} --out {root / 'broken'}"
                      f"/save"],
             "tsp1": [f"local-layout --ckpt {broken_ckpt} --out {root / 'broken'}/local "
                      f"--only accelerate,lightning,fabric",
                      f"drop-optimizer --ckpt {ckpt} --out {root / 'broken'}/drop"]}
    for name, processes, phase in (("save", 2, "save"), ("tsp1", 1, "resume"),
                                   ("tsp2dp2", 4, "resume")):
        run_job(processes, "--phase", phase, "--ckpt", ckpt, "--out", str(root / name),
                *[arg for spec in extra.get(name, []) for arg in ("--broken", spec)])
    return str(root)


@pytest.fixture(scope="module")
def runs(launches) -> dict:
    """The good passes: 'save', 'tsp1', 'tsp2dp2', each a list of every rank's (results,
    weights); and the checkpoint directory."""
    out = {name: every_rank(os.path.join(launches, name), processes)
           for name, processes in (("save", 2), ("tsp1", 1), ("tsp2dp2", 4))}
    return {**out, "ckpt": os.path.join(launches, "ckpt")}


@pytest.fixture(scope="module")
def broken(launches) -> dict:
    """The broken variants' passes, laid out like ``runs``: 'save' (local-layout and best-model,
    2 processes, its own checkpoint directory), 'local-layout' (those checkpoints resumed at one
    process), 'drop-optimizer' (the good checkpoints resumed at one process)."""
    root = os.path.join(launches, "broken")
    return {"ckpt": os.path.join(root, "ckpt"), "save": every_rank(os.path.join(root, "save"), 2),
            "local-layout": every_rank(os.path.join(root, "local"), 1),
            "drop-optimizer": every_rank(os.path.join(root, "drop"), 1)}


def assert_continues(runs: dict, base: str, resumed: list[tuple[str, str]],
                     final: dict | None = None, keys=("losses", "norms", "lrs"),
                     tols: dict[str, float] | None = None, save: str = "save") -> None:
    """Each resumed run (launch, name), on every rank, ran steps SAVE_AT+1..STEPS like the
    uninterrupted ``base`` on every rank of the ``save`` launch: same ``keys`` per step (relative
    tolerance 1e-10 unless ``tols`` says otherwise), same final weights (``final``: the
    uninterrupted run's weights, else each rank's own)."""
    for save_rank, (ref_results, ref_all_weights) in enumerate(runs[save]):
        ref, ref_weights = ref_results[base], final or ref_all_weights[base]
        for launch_name, name in resumed:
            for rank, (res_all, weights_all) in enumerate(runs[launch_name]):
                where = f"{name} (rank {rank} of {launch_name}, against rank {save_rank})"
                assert name in res_all, f"{where}: no result; errors {res_all['errors']}"
                res, weights = res_all[name], weights_all[name]
                for key in keys:
                    tol = (tols or {}).get(key, 1e-10)
                    want = ref[key][SAVE_AT:]
                    assert len(res[key]) == len(want) == STEPS - SAVE_AT, \
                        (where, key, res[key], want)
                    for step, (a, b) in enumerate(zip(res[key], want), SAVE_AT + 1):
                        assert abs(a - b) <= tol * abs(b), f"{where}: step {step} {key} {a} vs {b}"
                assert sorted(weights) == sorted(ref_weights), where
                for k, t in ref_weights.items():
                    assert_close(weights[k], t, 1e-10, f"{where}: final {k}")


def test_lightning_trainer_resumes_at_other_degrees(runs):
    # ModelCheckpoint's directory (save_distributed_checkpoint=True) into tsp 1 and tsp 2 x dp 2;
    # the one-file checkpoint (save_distributed_checkpoint=False) into the unmodified model under
    # Lightning's own single-device strategy, and into tsp 2 x dp 2
    step2 = os.path.join(runs["ckpt"], "lightning", "epoch=1.ckpt")
    assert os.path.isfile(os.path.join(step2, "tsp_checkpoint.json")), os.listdir(step2)
    assert os.path.isfile(os.path.join(runs["ckpt"], "lightning-onefile.ckpt"))
    assert_continues(runs, "lightning", [("tsp1", "lightning_tsp1"),
                                         ("tsp1", "lightning_plain_onefile"),
                                         ("tsp2dp2", "lightning_tsp2"),
                                         ("tsp2dp2", "lightning_tsp2_onefile")], keys=LIT_KEYS)


def test_fabric_resumes_at_other_degrees(runs):
    # fabric.save's directory into tsp 1 and tsp 2 x dp 2; the one-file checkpoint into the
    # unmodified model under Fabric's single-device strategy, and into tsp 2 x dp 2
    assert os.path.isfile(os.path.join(runs["ckpt"], "fabric", "tsp_checkpoint.json"))
    assert_continues(runs, "fabric", [("tsp1", "fabric_tsp1"), ("tsp1", "fabric_plain_onefile"),
                                      ("tsp2dp2", "fabric_tsp2"),
                                      ("tsp2dp2", "fabric_tsp2_onefile")], keys=FABRIC_KEYS)


def test_accelerate_resumes_at_other_degrees(runs):
    # save_state's directory: tsp_core's checkpoint of model and optimizer (SGD with momentum)
    # beside Accelerate's own files; also into the unmodified model with a plain SGD and StepLR
    state = os.path.join(runs["ckpt"], "accelerate")
    for name in ("tsp_model/tsp_checkpoint.json", "scheduler.bin", "random_states_0.pkl",
                 "random_states_1.pkl"):
        assert os.path.isfile(os.path.join(state, name)), (name, os.listdir(state))
    assert_continues(runs, "accelerate", [("tsp1", "accelerate_tsp1"),
                                          ("tsp1", "accelerate_plain"),
                                          ("tsp2dp2", "accelerate_tsp2")], keys=ACC_KEYS)


def checkpoint_weights(runs: dict, step: int) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(os.path.join(runs["ckpt"], "trainer", f"checkpoint-{step}",
                                  "model.safetensors"))


def assert_trainer_continues(runs: dict, resumed: list[tuple[str, str]]) -> None:
    """The Trainer's resumed runs against the uninterrupted one, whose final weights are its
    checkpoint-4 (it then loaded its best model): logged losses (float32), gradient norms
    (float64) and learning rates per step, final weights."""
    final = checkpoint_weights(runs, STEPS)
    for launch_name, name in resumed:
        for _, weights in runs[launch_name]:
            if name in weights:  # the tied lm_head is not saved
                weights[name] = {k: weights[name][k] for k in final}
    assert_continues(runs, "trainer", resumed, final=final, tols={"losses": 1e-6})


def test_tsp_trainer_resumes_at_other_degrees(runs):
    # checkpoint-2 of the save run (model.safetensors + the optimizer as a tsp_core checkpoint)
    # into the plain Trainer (tsp_size 1, one process) and into tsp 2 x dp 2
    assert_trainer_continues(runs, [("tsp1", "trainer_tsp1"), ("tsp2dp2", "trainer_tsp2")])


def assert_best_model(runs: dict) -> None:
    """A metric that is best at step 2 of 4: the final model is checkpoint-2's, bit for bit, on
    every rank."""
    best, last = checkpoint_weights(runs, 2), checkpoint_weights(runs, STEPS)
    assert max((best[k] - last[k]).abs().max().item() for k in best) > 1e-3  # a real difference
    for rank, (res, weights) in enumerate(runs["save"]):
        assert res["trainer_best"]["best"].endswith("checkpoint-2"), (rank, res["trainer_best"])
        for k, t in best.items():
            assert torch.equal(weights["trainer_best"][k], t), \
                f"rank {rank}: {k} is not the best checkpoint's"


def test_tsp_trainer_load_best_model_at_end(runs):
    assert_best_model(runs)


def fails(check, *args, **kwargs) -> str:
    """The assertion ``check`` fails with (it must fail: if it passes, the test fails naming the
    check and the case)."""
    try:
        check(*args, **kwargs)
    except AssertionError as err:
        return str(err).splitlines()[0]
    pytest.fail(f"{check.__name__} passed on a broken variant: {args[1:]}")


def test_broken_variants_fail(runs, broken):
    # drop-optimizer: the good checkpoints resumed at one process with a fresh optimizer
    drop = {"save": runs["save"], "ckpt": runs["ckpt"], "tsp1": broken["drop-optimizer"]}
    for base, name, keys in (("lightning", "lightning_tsp1", LIT_KEYS),
                             ("fabric", "fabric_tsp1", FABRIC_KEYS),
                             ("accelerate", "accelerate_tsp1", ACC_KEYS),
                             ("accelerate", "accelerate_plain", ACC_KEYS)):
        fails(assert_continues, drop, base, [("tsp1", name)], keys=keys)
    fails(assert_trainer_continues, drop, [("tsp1", "trainer_tsp1")])
    # the one-file checkpoints do not go through the broken loader: they still continue
    assert_continues(drop, "lightning", [("tsp1", "lightning_plain_onefile")], keys=LIT_KEYS)
    assert_continues(drop, "fabric", [("tsp1", "fabric_plain_onefile")], keys=FABRIC_KEYS)
    # local-layout: the broken save's checkpoints do not resume at one process
    local = {"save": broken["save"], "tsp1": broken["local-layout"]}
    for base, name, keys in (("lightning", "lightning_tsp1", LIT_KEYS),
                             ("lightning", "lightning_plain_onefile", LIT_KEYS),
                             ("fabric", "fabric_tsp1", FABRIC_KEYS),
                             ("fabric", "fabric_plain_onefile", FABRIC_KEYS),
                             ("accelerate", "accelerate_tsp1", ACC_KEYS),
                             ("accelerate", "accelerate_plain", ACC_KEYS)):
        fails(assert_continues, local, base, [("tsp1", name)], keys=keys)
    # best-model: the last weights stay
    fails(assert_best_model, broken)


def one_file_never_half_applies() -> list[str]:
    """The Lightning strategies' one-file resume (``tsp_lightning.checkpoint.load_one_file``: the
    full weights, then each optimizer's full state) checks all of it before changing any: an
    optimizer state whose last tensor has the wrong shape, or weights whose last tensor has,
    raise on every rank and leave the weights and the optimizer state bit for bit as they were."""
    from pathlib import Path

    from tests.support import dist_pool, hf_models
    from tsp_core.distributed.params import local
    from tsp_core.state.resharding import full_optimizer_state_dict
    from tsp_lightning import checkpoint as ckpt

    mesh = dist_pool.mesh(2)
    model = tsp_core.parallelize(hf_models.build("llama", torch.float64), mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ids = torch.randint(0, 96, (1, 16), generator=torch.Generator().manual_seed(1))
    model(**tsp_core.shard_batch({"input_ids": ids, "labels": ids}, mesh)).loss.backward()
    opt.step()
    opt.zero_grad()
    weights = hf_models.build("llama", torch.float64, seed=5).state_dict()  # other weights
    osd = full_optimizer_state_dict(model, opt)
    last = max(osd["state"])  # lm_head.weight's: the last tensor a load reaches
    bad_osd = {"param_groups": osd["param_groups"], "state": {**osd["state"], last: {
        **osd["state"][last], "exp_avg_sq": osd["state"][last]["exp_avg_sq"][:-1]}}}
    bad_weights = {**weights, "lm_head.weight": weights["lm_head.weight"][:-1]}

    def snapshot() -> dict[str, torch.Tensor]:
        out = {f"weight {k}": local(v).clone() for k, v in model.state_dict().items()}
        for i, s in opt.state_dict()["state"].items():
            out.update({f"state {i} {k}": local(v).clone() for k, v in s.items()})
        return out

    before, msgs = snapshot(), []
    for sd, o, pattern in (
            (weights, bad_osd, r"optimizer state 'exp_avg_sq' of weight \(parameter \d+\) has "
                               r"shape \(95, 64\) in the checkpoint, \(96, 64\) in the model"),
            (bad_weights, osd, r"lm_head\.weight has shape \(95, 64\) in the state dict, "
                               r"\(96, 64\) in the model")):
        with pytest.raises(ValueError, match=pattern) as info:
            ckpt.load_one_file(model, sd, [opt], [o], Path("one.ckpt"))
        msgs.append(str(info.value))
        after = snapshot()
        for k, t in before.items():
            assert torch.equal(after[k], t), f"load_one_file raised ({pattern}) after changing {k}"
    ckpt.load_one_file(model, weights, [opt], [osd], Path("one.ckpt"))  # the good one loads
    assert torch.equal(tsp_core.full_state_dict(model)["lm_head.weight"], weights["lm_head.weight"])
    return msgs


def test_lightning_one_file_resume_never_half_applies(pools):
    per_rank = pools.of(2).run(one_file_never_half_applies)
    assert all(m == per_rank[0] for m in per_rank), per_rank


def trainer_resume_never_half_applies(root: str) -> None:
    """TSPTrainer's resume loads the weights (``_load_from_checkpoint``) before the optimizer
    exists, then the optimizer and the scheduler (``_load_optimizer_and_scheduler``). A checkpoint
    without its ``scheduler.pt`` cannot resume: each of the two raises on every rank before
    changing the weights, the optimizer state or the scheduler. Neither does a checkpoint whose
    weights fit but whose optimizer state does not (its last tensors of another vocabulary):
    the weights wait for the optimizer state's check."""
    from types import SimpleNamespace

    from tests.support import dist_pool, hf_models
    from tsp_core.distributed.params import local
    from tsp_transformers import TSPTrainer
    from tsp_transformers.trainer import OPTIMIZER_DIR, SCHEDULER_NAME

    mesh = dist_pool.mesh(2)
    ids = torch.randint(0, 96, (1, 16), generator=torch.Generator().manual_seed(1))

    def trained(seed: int, vocab: int = 96):
        hf = hf_models.build("llama", torch.float64, seed=seed)
        hf.resize_token_embeddings(vocab)
        model = tsp_core.parallelize(hf, mesh)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        model(**tsp_core.shard_batch({"input_ids": ids, "labels": ids}, mesh)).loss.backward()
        opt.step()
        opt.zero_grad()
        return model, opt

    saved, saved_opt = trained(5)  # a checkpoint of other weights and optimizer state
    ckpt = os.path.join(root, "checkpoint-1")
    saved.save_pretrained(ckpt)
    tsp_core.save_checkpoint(os.path.join(ckpt, OPTIMIZER_DIR), saved, saved_opt,
                             model_state=False)
    model, opt = trained(0)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    trainer = SimpleNamespace(_tsp=True, model=model, optimizer=opt, lr_scheduler=sched,
                              _pending_weights=None)

    def snapshot() -> dict:
        out = {f"weight {k}": local(v).clone() for k, v in model.state_dict().items()}
        for i, s in opt.state_dict()["state"].items():
            out.update({f"state {i} {k}": local(v).clone() for k, v in s.items()})
        return {**out, "scheduler": sched.state_dict()}

    before = snapshot()
    for load in (TSPTrainer._load_from_checkpoint, TSPTrainer._load_optimizer_and_scheduler):
        with pytest.raises(FileNotFoundError, match="scheduler.pt"):
            load(trainer, ckpt)
        after = snapshot()
        for k, t in before.items():
            same = t == after[k] if k == "scheduler" else torch.equal(t, after[k])
            assert same, f"{load.__name__} raised after changing {k}"

    other, other_opt = trained(7, vocab=95)
    bad = os.path.join(root, "checkpoint-2")
    saved.save_pretrained(bad)
    tsp_core.save_checkpoint(os.path.join(bad, OPTIMIZER_DIR), other, other_opt,
                             model_state=False)
    if dist.get_rank() == 0:
        torch.save(sched.state_dict(), os.path.join(bad, SCHEDULER_NAME))
    dist.barrier()
    TSPTrainer._load_from_checkpoint(trainer, bad)
    with pytest.raises(ValueError, match=r"\(95, 64\)"):
        TSPTrainer._load_optimizer_and_scheduler(trainer, bad)
    after = snapshot()
    for k, t in before.items():
        same = t == after[k] if k == "scheduler" else torch.equal(t, after[k])
        assert same, f"a resume whose optimizer state does not fit changed {k}"
    dist.barrier()


def test_tsp_trainer_resume_never_half_applies(pools, tmp_path):
    pools.of(2).run(trainer_resume_never_half_applies, str(tmp_path))
