"""Lightning: Trainer(strategy="tsp") and Fabric(strategy="tsp") match one process in float64 with
gradient clipping active and plain SGD (norms, first-step gradients, losses, final weights), at
tsp 2 (processes started by Lightning), dp 2 x tsp 2 (also with fsdp=True: FSDP2 over the
data-parallel dim, each rank storing a quarter of the model) and tsp 4 with 1 and 2 key/value
heads (torchrun), with TSP's logged figures equal to comm's counters; with activation_offload
and checkpointed layers the losses and first gradients to 1e-10; bf16 trains like float32 within
bf16's precision; a PEFT PeftModel at tsp 2 and dp 2 x tsp 2 trains its adapters as on one
process (to 1e-10, the base untouched), and under bf16-mixed and bf16-true within bf16's
precision; resume is exact; TSPStrategy(compile="eager") compiles each decoder layer and
trains as uncompiled bit for bit; bad configurations (trainer.fit(torch.compile(module)) among
them) fail fast everywhere."""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys
from contextlib import nullcontext

import pytest
import torch

from tests.jobs.lightning_job import MOMENTUM, SEQ, VOCAB, Sequences, global_batches
from tests.support import hf_models, launch, metrics_check
from tests.support.precision import G, U, relative_error
from tests.support.reference import assert_close

JOB = os.path.join(launch.JOBS, "lightning_job.py")

# float64 SGD with clipping: the update is lr x clip x g/|g| (norms 1.3-2.3 here, clip 0.5, so
# clipping acts at every step): the weights check the gradient's direction and the recorded norm
# its size, the first step's gradients are compared directly
SGD = ("--precision", "64-true", "--optimizer", "sgd", "--lr", "0.5", "--clip", "0.5",
       "--record-grads")


def run_job(out: str, *args: str, expect_ok: bool = True,
            torchrun: int = 0) -> subprocess.CompletedProcess:
    """The job with Lightning starting its processes, or under ``torchrun`` processes."""
    launcher = launch.torchrun(torchrun) if torchrun else [sys.executable]
    ranks = torchrun or (int(args[args.index("--devices") + 1]) if "--devices" in args else 1)
    return launch.run([*launcher, JOB, "--out", out, *args], ranks, expect_clean=expect_ok,
                      timeout=400)


def ranks(out: str) -> list[dict]:
    """Every rank's scalar records."""
    files = sorted(glob.glob(os.path.join(out, "rank*.json")))
    assert files, f"no rank*.json in {out}"
    res = []
    for fn in files:
        with open(fn) as f:
            res.append(json.load(f))
    return res


def result(out: str) -> tuple[dict, dict]:
    """Rank 0's records and its final full weights."""
    return ranks(out)[0], torch.load(os.path.join(out, "rank0_weights.pt"))


def full_run(out: str) -> list[dict]:
    """Every rank's records with its own final full weights and (where recorded) first-step
    gradients, each gathered over its TSP group: every replica's, not only replica 0's."""
    runs = ranks(out)
    for r, run in enumerate(runs):
        run["weights"] = torch.load(os.path.join(out, f"rank{r}_weights.pt"))
        grads = os.path.join(out, f"rank{r}_grads0.pt")
        if os.path.exists(grads):
            run["grads0"] = torch.load(grads)
    return runs


def assert_same(run: tuple[dict, dict], ref: tuple[dict, dict], tol: float = 1e-5) -> None:
    (res, weights), (ref_res, ref_weights) = run, ref
    assert len(res["losses"]) == len(ref_res["losses"])
    for step, (a, b) in enumerate(zip(res["losses"], ref_res["losses"])):
        assert abs(a - b) <= tol * abs(b), f"step {step}: loss {a} vs {b}"
    assert sorted(weights) == sorted(ref_weights)
    for name, t in ref_weights.items():
        assert_close(weights[name], t, tol, name)


def reference(kv_heads: int, rows: int, dp: int, shuffle: bool, dtype=torch.float64,
              steps: int = 4, lr: float = 0.5, clip: float | None = 0.5,
              pattern: bool = False, family: str = "llama") -> dict:
    """One process on the global batches the distributed run's samplers give."""
    batches = global_batches(Sequences(rows, pattern).ids, dp, steps, shuffle)
    model = hf_models.build(family, dtype, kv_heads=kv_heads)
    ref = hf_models.sgd_reference(model, batches, lr, clip)
    ref["model"] = model
    return ref


def assert_every_rank(runs: list[dict], ref: dict, what: str, tol: float = 1e-8,
                      norm_tol: float = 1e-9, loss_tol: float | None = None,
                      grads: bool = True) -> None:
    """Losses, norms, weights and (with ``grads``) first gradients on every rank: a rank
    lacking one of them fails."""
    assert min(ref["norms"]) > 0.5, f"clipping at 0.5 must act: {ref['norms']}"
    loss_tol = tol if loss_tol is None else loss_tol
    for r, run in enumerate(runs):
        losses, logged = run.pop("losses"), run.pop("logged")
        keys = ("norms", "weights", "grads0") if grads else ("norms", "weights")
        hf_models.assert_matches_reference(run, ref, tol, norm_tol, what=f"{what} rank {r}: ",
                                           keys=keys)
        # the (logged) train loss is the true (global) loss, not a rank's share
        for a, b in zip(losses + logged, ref["losses"] * 2):
            assert abs(a - b) <= loss_tol * abs(b), (what, r, losses, logged, ref["losses"])
        assert len(losses) == len(logged) == len(ref["losses"]), (what, losses, logged)


def mean_batch_loss(model, ids: torch.Tensor) -> float:
    """What validate/test log: the mean over batches of 2 rows of each batch's loss."""
    with torch.no_grad():
        losses = [hf_models.reference_loss(model, b, b).item() for b in ids.split(2)]
    return sum(losses) / len(losses)


# a PEFT PeftModel (rank-4 LoRA on the seven projections, hf_models.lora_model) under
# strategy="tsp" at tsp 2, float64, SGD with momentum (a state per trained parameter), clipped;
# at dp 2 x tsp 2 with 8 rows (LORA_DP2)
LORA_RUN = ("--tsp-size", "2", "--kv-heads", "1", "--lora", "4", "--optimizer", "sgd-momentum",
            "--lr", "0.5", "--clip", "0.5", "--record-grads")
LORA = ("--devices", "2", *LORA_RUN, "--precision", "64-true")
LORA_DP2 = ("--devices", "4", *LORA_RUN, "--precision", "64-true", "--rows", "8")
# the PeftModel under bf16 (--precision bf16-mixed / bf16-true), plain SGD as the bf16 bounds
# assume (tests/support/precision.py), one step on the learnable rows. On random rows the
# adapters' gradients are sums that cancel (one process under autocast: 31 u from float32's,
# 3.2 u on these rows); after the first step the adapters' path at lr 0.5 is chaotic (float32's
# gradient norms 0.99, 1.18, 2.58, 0.59; one process under autocast ends 47 G of the movement
# from float32's adapters after 4 steps), which no bound from bf16's precision covers
LORA_BF16 = ("--devices", "2", *LORA_RUN, "--optimizer", "sgd", "--pattern", "--steps", "1")


def peft_reference(dtype: torch.dtype, rows: int, dp: int, momentum: float = 0.0,
                   pattern: bool = False, steps: int = 4) -> dict:
    """The PeftModel of ``--lora 4`` trained by plain PEFT and torch on one process on the
    global batches Lightning's shuffled sampler gives ``dp`` replicas of ``rows`` rows (of the
    ``pattern``, :class:`Sequences`; ``steps`` clipped SGD steps at lr 0.5):
    :func:`hf_models.sgd_reference`'s record, its weights named as TSP's full state dict names
    them, with ``adapters`` (the trained names), ``init`` (the weights as built, by the same
    names)."""
    import functools

    from tests.support.hf_models import lora_model

    model = lora_model(hf_models.build("llama", dtype, kv_heads=1), 4)
    hf_name = {n: n.replace(".base_layer.", ".") for n in model.state_dict()}
    init = {hf_name[n]: t.clone() for n, t in model.state_dict().items()}
    batches = global_batches(Sequences(rows, pattern).ids, dp, steps, True)
    ref = hf_models.sgd_reference(model, batches, lr=0.5, clip=0.5, optimizer=functools.partial(
        torch.optim.SGD, momentum=momentum))
    ref["weights"] = {hf_name[n]: w for n, w in ref["weights"].items()}
    ref["adapters"] = sorted(n for n, p in model.named_parameters() if p.requires_grad)
    ref["init"] = init
    assert len(ref["adapters"]) == 2 * 7 * 2 and sorted(ref["grads0"]) == ref["adapters"]
    return ref


def assert_peft_exact(runs: list[dict], ref: dict, what: str) -> None:
    """Every rank's losses and logged losses, clipping norms, first gradients (the adapters'
    alone) and adapters after the steps equal :func:`peft_reference`'s to 1e-10; the base
    weights bit for bit as built; gradients and optimizer state for the adapters only, though
    the optimizer was given every parameter."""
    for r, run in enumerate(runs):
        where = f"{what}, rank {r}: "
        assert run["grad_names"] == run["state_names"] == ref["adapters"], \
            f"{where}trained {run['grad_names']}, optimizer state {run['state_names']}"
        hf_models.assert_matches_reference(run, ref, 1e-10, what=where)
        hf_models.assert_matches_reference({"losses": run["logged"]}, ref, 1e-10,
                                           what=f"{where}logged ", keys=("losses",))
        for name, w in run["weights"].items():
            if ".lora_" not in name:
                assert torch.equal(w, ref["init"][name]), f"{where}base weight {name} moved"


def test_trainer_matches_one_process(tmp_path):
    # tsp 2 with 1 key/value head (each rank holds half of its rows), processes started by
    # Lightning; then validate / test / predict, and export_hf. TSPStrategy(timeout=...) reaches
    # every group of the mesh, not only the default one Lightning gives it to
    run_job(str(tmp_path), "--devices", "2", "--kv-heads", "1", *SGD, "--evaluate",
            "--export", str(tmp_path / "hf"), "--timeout", "123")
    runs = full_run(str(tmp_path))
    assert len(runs) == 2
    for run in runs:
        assert run["group_timeouts"] == {"world": 123, "data_parallel": 123,
                                         "tensor_parallel": 123}, run["group_timeouts"]
    ref = reference(kv_heads=1, rows=4, dp=1, shuffle=True)
    assert_every_rank(runs, ref, "tsp 2, 1 kv head")
    # validate and test see sharded batches too; predict returns the local tokens' logits
    want = mean_batch_loss(ref["model"], Sequences(4).ids)
    for run in runs:
        for key in ("val", "test"):
            assert abs(run[key] - want) <= 1e-8 * want, (key, run[key], want)
        assert run["predict_shapes"] == [[2, SEQ // 2, VOCAB]] * 2
    from transformers import AutoModelForCausalLM

    exported = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), dtype=torch.float64)
    for name, t in exported.state_dict().items():
        assert_close(t, ref["weights"][name], 1e-8, f"exported {name}")


def test_data_parallel_and_tsp4_match_one_process(tmp_path):
    # one torchrun launch of 4 processes, twelve runs: the Trainer at dp 2 x tsp 2 (8 rows, the
    # injected sampler gives each data-parallel replica its own, shuffled) and at tsp 4 with 1
    # and 2 key/value heads; Fabric at dp 2 x tsp 2 (fabric.clip_gradients); the Trainer on a
    # Gemma 3 at tsp 4; the Trainer and Fabric at dp 2 x tsp 2 with fsdp=True (FSDP2 over the
    # data-parallel dim), also under bf16-true, bf16-mixed and with FSDP2's bf16
    # MixedPrecisionPolicy; the Trainer and Fabric at dp 2 x tsp 2 with activation_offload=True
    # and checkpointed layers; a PeftModel at dp 2 x tsp 2
    common = ("--devices", "4", *SGD)
    dp2 = ("--tsp-size", "2", "--kv-heads", "1", "--rows", "8")
    fsdp = ("--devices", "4", "--optimizer", "sgd", "--lr", "0.5", "--clip", "0.5",
            "--record-grads", *dp2, "--fsdp")
    run_job(str(tmp_path), "--case",
            " ".join(["trainer_dp2", *common, *dp2, "--metrics"]),
            "--case", " ".join(["trainer_tsp4_kv1", *common, "--tsp-size", "4", "--kv-heads", "1"]),
            "--case", " ".join(["trainer_tsp4_kv2", *common, "--tsp-size", "4", "--kv-heads", "2",
                                "--metrics-off"]),
            "--case", " ".join(["fabric_dp2", "--mode", "fabric", *common, *dp2]),
            "--case", " ".join(["trainer_gemma3", *common, "--tsp-size", "4", "--family",
                               "gemma3"]),
            "--case", " ".join(["trainer_fsdp", *common, *dp2, "--fsdp"]),
            "--case", " ".join(["fabric_fsdp", "--mode", "fabric", *common, *dp2, "--fsdp"]),
            "--case", " ".join(["trainer_fsdp_bf16_true", *fsdp, "--precision", "bf16-true"]),
            "--case", " ".join(["trainer_fsdp_bf16_mixed", *fsdp, "--precision", "bf16-mixed"]),
            "--case", " ".join(["trainer_fsdp_mp_bf16", *fsdp, "--precision", "32-true",
                                "--fsdp-mp", "bf16"]),
            "--case", " ".join(["trainer_offload", *common, *dp2, "--activation-offload"]),
            "--case", " ".join(["fabric_offload", "--mode", "fabric", *common, *dp2,
                                "--activation-offload"]),
            "--case", " ".join(["trainer_lora_dp2", *LORA_DP2]), torchrun=4)
    dp2_ref = reference(1, rows=8, dp=2, shuffle=True)
    fabric_ref = reference(1, rows=8, dp=2, shuffle=False)
    cases = {"trainer_dp2": dp2_ref,
             "trainer_tsp4_kv1": reference(1, rows=4, dp=1, shuffle=True),
             "trainer_tsp4_kv2": reference(2, rows=4, dp=1, shuffle=True),
             "fabric_dp2": fabric_ref,
             # Gemma 3: sandwich and 1 + w norms, q/k norms, a scaled embedding, tied weights
             "trainer_gemma3": reference(2, rows=4, dp=1, shuffle=True, family="gemma3"),
             "trainer_fsdp": dp2_ref, "fabric_fsdp": fabric_ref,
             # activation_offload=True, checkpointed layers
             "trainer_offload": dp2_ref, "fabric_offload": fabric_ref}
    storage = {}
    for name, ref in cases.items():
        runs = full_run(str(tmp_path / name))
        assert len(runs) == 4, name
        storage[name] = [{k: r[k] for k in ("local_numel", "grad_numel", "full_numel",
                                            "fsdp_modules")} for r in runs]
        # Fabric under DoublePrecision hands the forward's output back in the default dtype
        # (float32), for any model: its losses are float32 roundings of the float64 loss
        loss_tol = 1e-7 if name.startswith("fabric") else None
        if name.endswith("_offload"):
            assert_offload_exact(runs, ref, name, loss_tol or 1e-10)
        assert_every_rank(runs, ref, name, loss_tol=loss_tol)
    # dp 2 x tsp 2 stores half of the model per rank (TSP's 1/2), with fsdp=True a quarter
    # (1/(tsp x dp)): FSDP2 wraps the 2 decoder layers and the root, parameters and gradients
    for name, share, wrapped in (("trainer_dp2", 2, 0), ("fabric_dp2", 2, 0),
                                 ("trainer_fsdp", 4, 3), ("fabric_fsdp", 4, 3)):
        assert_storage(storage[name], share, wrapped, name)
    assert_fsdp_bf16(tmp_path)
    assert_logged_metrics(str(tmp_path / "trainer_dp2"), dp=2)
    # a PeftModel at dp 2 x tsp 2: each replica its shuffled rows, the adapters' gradients
    # summed over both replicas, as one process on the global batches
    runs = full_run(str(tmp_path / "trainer_lora_dp2"))
    assert len(runs) == 4
    assert_peft_exact(runs, peft_reference(torch.float64, rows=8, dp=2, momentum=MOMENTUM),
                      "lora dp 2 x tsp 2")
    # metrics=False: the logger gets the losses and nothing of TSP's
    with open(tmp_path / "trainer_tsp4_kv2" / "csv" / "version_0" / "metrics.csv") as f:
        header = f.readline()
    assert "train_loss" in header and "tsp/" not in header, header


def assert_offload_exact(runs: list[dict], ref: dict, what: str, loss_tol: float) -> None:
    """With ``activation_offload=True`` every rank moved each checkpointed layer's input to the
    host and back at every step (on the CPU they stay in place, the same code path), and the
    losses (to ``loss_tol``) and the first step's gradients (to 1e-10) are the unmodified
    model's."""
    layers, steps = hf_models.COMMON["num_hidden_layers"], len(ref["losses"])
    for r, run in enumerate(runs):
        assert run["offload"] == {"offloaded": layers * steps, "brought_back": layers * steps,
                                  "prefetched": (layers - 1) * steps}, (what, r, run["offload"])
        for step, (a, b) in enumerate(zip(run["losses"], ref["losses"])):
            assert abs(a - b) <= loss_tol * abs(b), f"{what} rank {r} step {step}: {a} vs {b}"
        hf_models.assert_matches_reference(run, ref, 1e-10, what=f"{what} rank {r}: ",
                                           keys=("grads0",))


def assert_storage(runs: list[dict], share: int, wrapped: int, what: str) -> None:
    """Every rank stores 1/``share`` of the model's parameter elements, and as many gradient
    elements (within 1% of the model: the norm weights, 0.4% of it, are held by every rank of a
    TSP group), and ``wrapped`` modules are FSDP2 modules."""
    for r, run in enumerate(runs):
        full, stored = run["full_numel"], run["local_numel"]
        assert abs(stored * share - full) <= 0.01 * full, \
            f"{what} rank {r}: stores {stored} of {full} parameter elements, not 1/{share}"
        assert run["grad_numel"] == stored, (what, r, run)
        assert run["fsdp_modules"] == wrapped, (what, r, run)


def assert_fsdp_bf16(tmp_path) -> None:
    """fsdp=True under bf16-true (Lightning converts the module after FSDP2 wrapped it), under
    bf16-mixed (autocast) and with FSDP2's MixedPrecisionPolicy(param_dtype=bf16,
    reduce_dtype=float32) at 32-true, against
    float32 on one process, 4 clipped SGD steps: within bf16's precision, by the bounds of
    test_bf16_precisions_train (G = 9 u; bf16-true's weights also rounded into bf16 at the start
    and after each step: sqrt(5) u < 3 u of |w|). Measured: gradients 1.8 u (bf16-true), 1.5 u
    (bf16-mixed), 1.7 u (policy); weights 1.3e-3, 2.1e-4 and 2.3e-4 of |w|."""
    u = U
    ref = reference(1, rows=8, dp=2, shuffle=True, dtype=torch.float32)
    init = hf_models.build("llama", torch.float32, kv_heads=1).state_dict()
    names = sorted(ref["grads0"])
    moved = relative_error(ref["weights"], init, names)
    for name, dtype, extra in (("trainer_fsdp_bf16_true", torch.bfloat16, 3 * u),
                               ("trainer_fsdp_bf16_mixed", torch.float32, 0.0),
                               ("trainer_fsdp_mp_bf16", torch.float32, 0.0)):
        runs = full_run(str(tmp_path / name))
        run = runs[0]
        assert_storage(runs, 4, 3, name)
        for r, rank_run in enumerate(runs):  # every replica's own gathered weights and gradients
            # bf16-true stores bf16 weights; bf16-mixed and the policy keep float32 ones and
            # compute in bf16 (so their gradients are off float32's by about u, not 1e-7)
            assert {w.dtype for w in rank_run["weights"].values()} == {dtype}, (name, r)
            grads = relative_error(rank_run["grads0"], ref["grads0"], names)
            assert 0.1 * u <= grads <= G, \
                f"{name} rank {r}: first gradients {grads / u:.2f} u from float32's"
            weights = relative_error(rank_run["weights"], ref["weights"], names)
            assert weights <= 2 * G * moved + extra, (name, r, weights, moved)
        for key in ("norms", "losses"):
            for step, (a, b) in enumerate(zip(run[key], ref[key])):
                assert abs(a - b) <= 2 * G * b, f"{name} step {step}: {key} {a} vs float32 {b}"
        assert all(r["losses"] == run["losses"] and r["norms"] == run["norms"] for r in runs)
        print(f"{name}: gradients {grads / u:.2f} u, weights {weights:.2e} of |w|")


def assert_logged_metrics(out: str, dp: int) -> None:
    """TSPMonitor's rows (every 2 steps, with validation after step 2 and a checkpoint after step
    3 in the windows) against each step's own counters, on every rank; rank 0's are the rows the
    CSVLogger wrote."""
    import csv

    runs = ranks(out)
    for r, run in enumerate(runs):
        assert len(run["metric_rows"]) == 2, (r, run["metric_rows"])
        metrics_check.assert_windows(run["metric_rows"], run["step_counts"], dp, f"rank {r}")
    with open(os.path.join(out, "csv", "version_0", "metrics.csv")) as f:
        written = [{k: float(v) for k, v in row.items() if k.startswith("tsp/") and v}
                   for row in csv.DictReader(f)]
    written = [row for row in written if row]
    assert written == runs[0]["metric_rows"], (written, runs[0]["metric_rows"])


# bad configurations: each a case of the 2-process launch below that must raise on every rank
BAD = {"tsp3": (["--tsp-size", "3"], r"tsp_size \(3\) must divide the world size \(2\)"),
       "gpt2": (["--bad-model"],
                r"no TSP policy for GPT2LMHeadModel \(model_type='gpt2'\); supported"),
       "fp16": (["--precision", "16-true"],
                r"precision='16-true' is not supported by the TSP strategy"),
       # Lightning's way to compile (trainer.fit(torch.compile(module))) compiles the whole
       # module; the strategy's compile= compiles each decoder layer
       "compile_module": (["--compile-module"],
                          r"RuntimeError: torch.compile\(lightning_module\) compiles the whole "
                          r"LightningModule.*TSPStrategy\(compile=True\)")}


# TSPStrategy(compile="eager") against the same run uncompiled: tsp 2, float64, clipped SGD
COMPILED = ("--devices", "2", "--tsp-size", "2", "--kv-heads", "1", *SGD)


@pytest.fixture(scope="module")
def two_processes(tmp_path_factory) -> str:
    """One torchrun launch of 2 processes: bf16-mixed and bf16-true at tsp 2, 8 SGD steps clipped
    at 0.5 (lr 0.5: each step moves the weights by 0.25; unclipped SGD on this model is erratic,
    gradient norms jump to 15) on rows of a repeated pattern, which a model can learn; the
    uninterrupted and the resumed run of :func:`test_resume_is_exact`; the packed batches of
    :func:`test_packed_batches`; the PeftModel of :func:`test_peft_model_matches_one_process`
    and, under bf16-mixed and bf16-true, of :func:`test_peft_model_bf16_precisions_train`;
    the eager and compiled runs (Trainer and Fabric) of
    :func:`test_compile_compiles_each_decoder_layer`;
    then every bad configuration of :data:`BAD`, each raising in the
    same processes (the launch still ends cleanly on both ranks). Returns the output folder (a
    subfolder per case)."""
    out = tmp_path_factory.mktemp("lightning_2")
    common = ("--devices", "2", "--tsp-size", "2", "--optimizer", "sgd", "--lr", "0.5",
              "--clip", "0.5", "--steps", "8", "--pattern", "--record-grads")
    bad = [arg for name, (args, _) in BAD.items()
           for arg in ("--case", " ".join([name, "--devices", "2", "--fails", *args]))]
    resume = ("--devices", "2", "--clip", "0.5", "--rows", "2")
    ckpts = str(out / "ckpts")
    run_job(str(out), "--case", " ".join(["mixed", *common, "--precision", "bf16-mixed"]),
            "--case", " ".join(["true", *common, "--precision", "bf16-true"]),
            "--case", " ".join(["uninterrupted", *resume, "--ckpt-dir", ckpts]),
            "--case", " ".join(["resumed", *resume, "--resume",
                                os.path.join(ckpts, "epoch=1.ckpt")]),
            "--case", "packed --devices 2 --packed --rows 2 --steps 1",
            "--case", " ".join(["lora", *LORA]),
            "--case", " ".join(["lora_mixed", *LORA_BF16, "--precision", "bf16-mixed"]),
            "--case", " ".join(["lora_true", *LORA_BF16, "--precision", "bf16-true"]),
            "--case", " ".join(["eager", *COMPILED]),
            "--case", " ".join(["compiled", *COMPILED, "--compile", "eager"]),
            "--case", " ".join(["fabric_compiled", "--mode", "fabric", *COMPILED, "--compile",
                                "eager"]), *bad,
            torchrun=2)
    return str(out)


def test_bf16_precisions_train(two_processes):
    # bf16-mixed and bf16-true at tsp 2, against float32 on one process (see two_processes)
    ref = reference(kv_heads=2, rows=4, dp=1, shuffle=True, dtype=torch.float32, steps=8,
                    pattern=True)
    init = hf_models.build("llama", torch.float32).state_dict()
    names = sorted(ref["grads0"])
    # Tolerances from bf16's unit roundoff u = 2^-8: G = 9 u = 3.5% for the first gradients
    # (derived in tests/support/precision.py). Measured: 1.0 u (mixed), 1.3 u (true: weights and
    # gradients also stored in bf16).
    u = U
    # The training is real: the loss falls from ln V (4.56) by more than a third.
    assert ref["losses"][-1] < ref["losses"][0] * 2 / 3, ref["losses"]
    moved = relative_error(ref["weights"], init, names)  # float32's movement, relative to |w|
    for precision in ("mixed", "true"):
        runs = full_run(os.path.join(two_processes, precision))
        run = runs[0]
        assert run["losses"][-1] < run["losses"][0] * 2 / 3, (precision, run["losses"])
        for r, rank_run in enumerate(runs):  # every rank's own gathered gradients and weights
            grads = relative_error(rank_run["grads0"], ref["grads0"], names)
            assert grads <= G, \
                f"{precision} rank {r}: first gradients {grads:.2e} from float32's (> {G:.2e})"
            # Each update is lr x clip x g/|g|: its error is at most the gradient's twice
            # (direction and norm), 2 G of float32's movement in all; bf16-true also rounds the
            # weights into bf16 at the start and after each of the 8 steps, up to u |w| each,
            # independent: sqrt(9) u = 3 u of |w|. Measured: 0.2 G of the movement (mixed),
            # 0.8 u of |w| (true).
            weights = relative_error(rank_run["weights"], ref["weights"], names)
            bound = 2 * G * moved + (3 * u if precision == "true" else 0.0)
            assert weights <= bound, (f"{precision} rank {r}: weights {weights:.2e} from "
                                      f"float32's (> {bound:.2e}; float32 moved them by "
                                      f"{moved:.2e})")
        # norms (clipping acts on them) and losses within 2 G of float32's at every step
        for key in ("norms", "losses"):
            for step, (a, b) in enumerate(zip(run[key], ref[key])):
                assert abs(a - b) <= 2 * G * b, f"{precision} step {step}: {key} {a} vs float32 {b}"
        assert all(r["losses"] == run["losses"] and r["norms"] == run["norms"] for r in runs)
        print(f"{precision}: gradients {grads / u:.2f} u, weights {weights:.2e} of |w| "
              f"({weights / moved / G:.2f} G of the movement {moved:.2e})")


def test_resume_is_exact(two_processes):
    # One batch per epoch (2 sequences), so Lightning's own data-loader resume semantics (it
    # does not replay a shuffled, non-stateful sampler mid-run) cannot change what steps 3-4 see;
    # what is tested is the sharded weights and optimizer state through the DCP checkpoint. The
    # resumed run is a later case of the same 2 processes (see two_processes), with a new
    # Trainer, model and optimizer
    from pathlib import Path

    ckpts = Path(two_processes) / "ckpts"
    uninterrupted = result(os.path.join(two_processes, "uninterrupted"))
    step2 = ckpts / "epoch=1.ckpt"
    assert step2.is_dir(), \
        f"a sharded (torch.distributed.checkpoint) folder: {sorted(ckpts.iterdir())}"
    res, weights = result(os.path.join(two_processes, "resumed"))
    assert len(res["losses"]) == 2, res
    assert_same(({"losses": res["losses"]}, weights),
                ({"losses": uninterrupted[0]["losses"][2:]}, uninterrupted[1]), tol=1e-6)


def doc_by_doc_loss(docs: list[list[int]], model) -> float:
    """The unmodified model on each document alone: the mean next-token loss over all of them
    (the HF model on the packed row is no reference: its attention crosses documents)."""
    import torch.nn.functional as F

    total, count = 0.0, 0
    with torch.no_grad():
        for d in docs:
            t = torch.tensor(d)[None]
            total += F.cross_entropy(model(input_ids=t).logits[0, :-1], t[0, 1:],
                                     reduction="sum").item()
            count += len(d) - 1
    return total / count


def test_compile_compiles_each_decoder_layer(two_processes):
    # TSPStrategy(compile="eager") at tsp 2, float64, 4 clipped SGD steps: on every rank
    # each decoder layer was compiled (compile_layers' mark) with no graph break, the module was
    # not compiled whole (no Lightning compiler mark, the strategy's model the LightningModule
    # itself), and the losses, logged losses, clipping norms, first gradients and final weights
    # are the same run's uncompiled bit for bit, and the unmodified model's on one process to
    # 1e-8
    eager = full_run(os.path.join(two_processes, "eager"))
    runs = full_run(os.path.join(two_processes, "compiled"))
    assert len(runs) == len(eager) == 2
    for r, (run, want) in enumerate(zip(runs, eager)):
        compiled = run.pop("compiled")
        assert compiled == {"layers": [True, True], "whole": False, "breaks": {},
                            "classes": ["LitLlama", "TSPLlamaForCausalLM"]}, (r, compiled)
        for key in ("losses", "logged", "norms"):
            assert run[key] == want[key], (r, key, run[key], want[key])
        for key in ("grads0", "weights"):
            for name, t in want[key].items():
                assert torch.equal(run[key][name], t), f"rank {r}: {key} {name} differs"
    assert_every_rank(runs, reference(1, rows=4, dp=1, shuffle=True), "compile, tsp 2")
    # TSPFabricStrategy(compile="eager"): the layers compiled, Fabric's module not compiled
    # whole, one process's numbers (Fabric hands the loss back in float32: 1e-7)
    runs = full_run(os.path.join(two_processes, "fabric_compiled"))
    assert len(runs) == 2
    for r, run in enumerate(runs):
        compiled = run.pop("compiled")
        assert compiled == {"layers": [True, True], "classes": ["TSPLlamaForCausalLM"],
                            "breaks": {}}, (r, compiled)
    assert_every_rank(runs, reference(1, rows=4, dp=1, shuffle=False), "Fabric compile, tsp 2",
                      loss_tol=1e-7)


def test_packed_batches(two_processes):
    # one step on one DataCollatorWithFlattening row of 2 documents (order does not matter), a
    # case of the 2-process launch (see two_processes)
    from tests.jobs.lightning_job import Documents, build_llama

    res, _ = result(os.path.join(two_processes, "packed"))
    want = doc_by_doc_loss(Documents(2).docs, build_llama())
    assert abs(res["losses"][0] - want) <= 1e-5 * want, (res["losses"], want)


def test_peft_model_matches_one_process(two_processes):
    # the LightningModule's model is a PeftModel; the strategy converts it with its adapters.
    # Against the same PeftModel (same seeds, same batches: Lightning's shuffled sampler, 2 rows
    # a step) trained by plain PEFT and torch on one process (assert_peft_exact)
    runs = full_run(os.path.join(two_processes, "lora"))
    assert len(runs) == 2
    assert_peft_exact(runs, peft_reference(torch.float64, rows=4, dp=1, momentum=MOMENTUM),
                      "lora")


def test_peft_model_bf16_precisions_train(two_processes):
    # the PeftModel at tsp 2 under bf16-mixed and bf16-true, one clipped SGD step on the
    # learnable rows (see LORA_BF16), against the float32 PeftModel on one process, by
    # test_bf16_precisions_train's bounds over the adapters: first gradients within G = 9 u and
    # at least 0.1 u off (computed in bf16), adapters within 2 G of float32's movement
    # (bf16-true: + sqrt(2) u of |w|, stored in bf16), the norm and loss within 2 G; the base as
    # built (bf16-true: rounded into bf16 once); gradients for the adapters only
    ref = peft_reference(torch.float32, rows=4, dp=1, pattern=True, steps=1)
    names = ref["adapters"]
    moved = relative_error(ref["weights"], ref["init"], names)
    stored = 2 ** 0.5 * U  # bf16-true: the adapters rounded into bf16 at the start and after
    for precision, dtype, extra in (("mixed", torch.float32, 0.0),  # the step, independent
                                    ("true", torch.bfloat16, stored)):
        runs = full_run(os.path.join(two_processes, f"lora_{precision}"))
        assert len(runs) == 2
        for r, run in enumerate(runs):
            what = f"lora bf16-{precision}, rank {r}"
            assert run["grad_names"] == names, (what, run["grad_names"])  # SGD: no state
            grads = relative_error(run["grads0"], ref["grads0"], names)
            assert 0.1 * U <= grads <= G, f"{what}: first gradients {grads / U:.2f} u off"
            weights = relative_error(run["weights"], ref["weights"], names)
            assert weights <= 2 * G * moved + extra, \
                f"{what}: adapters {weights:.2e} off (> 2 G of the movement {moved:.2e})"
            for name, w in run["weights"].items():
                want = ref["init"][name]
                assert w.dtype == (dtype if ".lora_" in name else want.to(dtype).dtype), name
                if ".lora_" not in name:
                    assert torch.equal(w, want.to(dtype)), f"{what}: base weight {name} moved"
            for key in ("norms", "losses"):
                for step, (a, b) in enumerate(zip(run[key], ref[key], strict=True)):
                    assert abs(a - b) <= 2 * G * b, f"{what} step {step}: {key} {a} vs {b}"
        print(f"lora bf16-{precision}: gradients {grads / U:.2f} u, adapters "
              f"{weights / moved / G:.2f} G of the movement {moved:.2e}")


def test_reading_the_mesh_too_early_says_when_it_exists():
    # the mesh is built in setup_environment; read before (in __init__, before trainer.fit or
    # fabric.launch) the error says from which hook on it exists and what to do
    import tsp_lightning

    for cls in (tsp_lightning.TSPStrategy, tsp_lightning.TSPFabricStrategy):
        with pytest.raises(RuntimeError) as info:
            _ = cls(tsp_size=2).tsp_mesh  # the property raises
        message = str(info.value)
        for words in (f"{cls.__name__}.tsp_mesh was read before the strategy built it",
                      "builds the TSP mesh in setup_environment",
                      "when trainer.fit (or validate, test, predict) starts",
                      "from the LightningModule's prepare_data(), setup() and configure_model() "
                      "hooks on", "once fabric.launch() has run",
                      "probably read in the LightningModule's __init__ or before trainer.fit",
                      "Read it in configure_model (e.g. tsp_core.parallelize(self.model, "
                      "self.trainer.strategy.tsp_mesh)) or later"):
            assert words in message, (words, message)


def test_fsdp_options_fail_before_processes():
    # FSDP2's options without fsdp=True fail at construction; a policy with nothing to shard
    # (tsp_size = the process count: data parallel 1) fails in setup_environment before any
    # process group exists, naming the numbers; fsdp=True alone there only warns
    from torch.distributed.fsdp import MixedPrecisionPolicy

    import tsp_lightning

    class NoProcessGroup(Exception):
        pass

    def setup_environment():
        raise NoProcessGroup

    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    for cls in (tsp_lightning.TSPStrategy, tsp_lightning.TSPFabricStrategy):
        with pytest.raises(ValueError, match=r"are FSDP2's options: pass fsdp=True"):
            cls(tsp_size=2, fsdp_mp_policy=policy)
        with pytest.raises(ValueError, match=r"are FSDP2's options: pass fsdp=True"):
            cls(tsp_size=2, reshard_after_forward=False)
        strategy = cls(tsp_size=2, fsdp=True, fsdp_mp_policy=policy)
        strategy.parallel_devices = [torch.device("cpu")] * 2
        with pytest.raises(ValueError, match=r"fsdp_mp_policy needs FSDP2 to shard over data "
                                             r"parallel, but the data-parallel size is 1 \(2 "
                                             r"processes / tsp_size 2\): launch more"):
            strategy._setup_tsp_environment("32-true", setup_environment)
        strategy = cls(tsp_size=2, fsdp=True)
        strategy.parallel_devices = [torch.device("cpu")] * 2
        with pytest.warns(UserWarning, match=r"fsdp=True has nothing to shard: the "
                                             r"data-parallel size is 1"), \
                pytest.raises(NoProcessGroup):
            strategy._setup_tsp_environment("32-true", setup_environment)


def test_peft_model_with_fsdp_fails_before_processes():
    # a PeftModel with fsdp=True at data parallel 2 (LoRA with FSDP2 is refused by the
    # conversion) fails in setup_environment, before any process group exists, saying what to
    # pass instead; at data parallel 1 (nothing for FSDP2 to shard) it goes on
    import tsp_lightning
    from tests.jobs.lightning_job import build_llama
    from tests.support.hf_models import lora_model

    class NoProcessGroup(Exception):
        pass

    def setup_environment():
        raise NoProcessGroup

    holder = torch.nn.Module()
    holder.model = lora_model(build_llama(), 4)
    for devices, error, words in ((4, NotImplementedError, r"a PEFT PeftModel \(LoRA\) with "
                                   r"fsdp=True is not supported yet: FSDP2 would shard it over "
                                   r"the 2 data-parallel replicas. Pass fsdp=False"),
                                  (2, NoProcessGroup, "")):
        strategy = tsp_lightning.TSPStrategy(tsp_size=2, fsdp=True)
        strategy.parallel_devices = [torch.device("cpu")] * devices
        strategy._lightning_module = holder
        with pytest.raises(error, match=words), pytest.warns() if devices == 2 else nullcontext():
            strategy._setup_tsp_environment("32-true", setup_environment)


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_configuration_fails_fast(two_processes, case):
    # each rank raised the error that names the problem (and none ran the case: no results)
    import re

    runs = ranks(os.path.join(two_processes, case))
    assert len(runs) == 2, runs
    for r, run in enumerate(runs):
        assert run["rank"] == r, run
        assert re.search(BAD[case][1], run.get("error", "")), f"rank {r}: {run}"
