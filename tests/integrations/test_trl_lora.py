"""LoRA through TRL (docs/lora.md): ``TSPSFTTrainer(peft_config=LoraConfig(r=8, all seven
projections))`` at tsp 2 matches TRL's own ``SFTTrainer(peft_config=...)`` on one process in
float32 (SGD at a constant lr with clipping acting at every step, as tests/integrations/
test_trl.py): the loss, grad_norm and entropy per step to 1e-5 relative, mean_token_accuracy and
num_tokens exactly, on every rank; so does ``TSPSFTTrainer`` handed the PeftModel itself
(TSPTrainer converts it) and one with gradient checkpointing (TRL's input gradients on the TSP
model). ``trainer.save_model()`` writes PEFT's adapter files (the converted PeftModel's own
``save_pretrained``: the processes gather, rank 0 writes), equal to one process's: the same keys,
every tensor within 1e-6, the same r, lora_alpha and target modules. Only the adapters require
gradients (the same names as on one process), and the base weights are bit for bit those
loaded. ``TSPDPOTrainer(peft_config=...)`` at tsp 2 matches TRL's ``DPOTrainer(peft_config=...)``
on one process the same way (its reference: the policy with the adapter disabled): the loss,
grad_norm, rewards and log-probs per step to 1e-5 relative on every rank, the saved adapter,
the trainable names and the base weights; so do ``TSPDPOTrainer(peft_config=..., ref_model=...)``
and ``TSPDPOTrainer(PeftModel, ref_model=...)`` against DPOTrainer given the same (TRL scores
the reference with that model; TSP converts it), and ``TSPDPOTrainer(peft_config=...)`` with
gradient checkpointing (TRL's default). Handed a PeftModel without peft_config or ref_model (TRL
would add a second, "ref" adapter) it refuses on every rank before any collective, naming the
fix. The one-process references are TRL alone: their process never imports tsp_core."""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch

pytest.importorskip("trl")
pytest.importorskip("peft")

from tests.integrations.test_trl import COMMON, STEPS, runs, saved  # noqa: E402, F401
from tests.support import launch  # noqa: E402

JOB = os.path.join(launch.JOBS, "trl_lora_job.py")
PROJECTIONS = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
TSP_CASES = ("sft", "peft_model", "checkpointed", "dpo", "dpo_ref", "dpo_peft_ref",
             "dpo_checkpointed")
# each TSP case's one-process reference (gradient checkpointing changes no value on one process)
REFERENCE = {"sft": "sft", "peft_model": "sft", "checkpointed": "sft", "dpo": "dpo",
             "dpo_ref": "dpo_ref", "dpo_peft_ref": "dpo_peft_ref", "dpo_checkpointed": "dpo"}
DPO_CASES = ("dpo", "dpo_ref", "dpo_peft_ref", "dpo_checkpointed")
# the adapters' gradient norms are 0.37 to 0.6 (B starts at zero): clipping at 0.25 acts at every
# step, so each update is lr x clip x g/|g| (the adapters check the direction, grad_norm the size)
CLIP = ["--max_grad_norm", "0.25"]
# DPO: the same 4 preference pairs at each of the 3 steps, at lr 2 (x clip 0.25: it acts at
# every step, the norms 0.26 to 0.33), so that the logged rewards (0.1 x the log-probs' move off
# the reference's: 0.1 to 0.4 after step 0) are large against float32's rounding of those sums of
# about 50 (a reward is off by ~3e-7): on 12 pairs at lr 0.5 each step's rewards are those of
# pairs not yet trained on, 0.004 to 0.03 after step 0, 1e-5 off relative
DPO_CASE = "--rows 4 --learning_rate 2"
# DPO with ref_model= (given with peft_config, and with a PeftModel): the saved model moved by
# 0.2 x N(0, 1) (tests/jobs/trl_lora_job.py), so the rewards are 0.3 to 1.6 from step 0 on, where
# the adapter disabled as the reference would give 0 at step 0
DPO_REF = f"{DPO_CASE} --ref_model true"
# DPO's figures, each to 1e-5 relative (a reward is 0 at step 0 on both sides: B = 0 makes the
# policy its reference, bit for bit)
DPO_FIGURES = ("loss", "grad_norm", "rewards/chosen", "rewards/rejected", "rewards/margins",
               "rewards/accuracies", "logps/chosen", "logps/rejected")


@pytest.fixture(scope="module")
def results(tmp_path_factory, saved) -> str:  # noqa: F811
    """One process (TRL's SFTTrainer, then DPOTrainer: a plain python process, no tsp_core,
    so no exit line to check) and one 2-process launch (every TSP case), run side by side."""
    out = tmp_path_factory.mktemp("trl_lora")
    one = [sys.executable, JOB, "--model_path", saved, *COMMON, *CLIP,
           "--output_dir", str(out / "o1"), "--out", str(out / "one"), "--case", "sft",
           f"dpo --mode dpo_plain {DPO_CASE}", f"dpo_ref --mode dpo_plain {DPO_REF}",
           f"dpo_peft_ref --mode dpo_plain_peft_model {DPO_REF}"]
    two = launch.torchrun(2, launch.EXIT_CLEANLY, JOB, "--model_path", saved, *COMMON, *CLIP,
                          "--output_dir", str(out / "o2"), "--out", str(out / "tsp"),
                          "--tsp_size", "2", "--case", "dpo_peft_model --mode dpo_peft_model",
                          "sft --mode tsp", "peft_model --mode peft_model",
                          "checkpointed --mode tsp --gradient_checkpointing true",
                          f"dpo --mode dpo {DPO_CASE}", f"dpo_ref --mode dpo {DPO_REF}",
                          f"dpo_peft_ref --mode dpo_peft_model {DPO_REF}",
                          f"dpo_checkpointed --mode dpo {DPO_CASE} --gradient_checkpointing "
                          "true")
    launch.run_together((one, 0), (two, 2), timeout=180)
    return str(out)


def adapter(path: str) -> tuple[dict, dict]:
    from safetensors.torch import load_file

    with open(os.path.join(path, "adapter_config.json")) as f:
        config = json.load(f)
    return config, load_file(os.path.join(path, "adapter_model.safetensors"))


def test_references_are_trl_alone(results):
    for case in ("sft", "dpo", "dpo_ref", "dpo_peft_ref"):
        (ref,) = runs(os.path.join(results, "one", case), 1)
        assert ref["tsp_core_imported"] is False, case
        want = "LlamaForCausalLM" if case.endswith("_ref") else None
        assert ref["class"] == "PeftModelForCausalLM" and ref["ref_model"] == want, (case, ref)


@pytest.mark.parametrize("case", ("sft", "peft_model", "checkpointed"))
def test_lora_sft_tsp2_matches_one_process(results, case):
    (ref,) = runs(os.path.join(results, "one", "sft"), 1)
    assert len(ref["rows"]) == STEPS, ref
    assert min(row["grad_norm"] for row in ref["rows"]) > float(CLIP[1]), ("clipping must act",
                                                                         ref)
    for r, run in enumerate(runs(os.path.join(results, "tsp", case), 2)):
        assert run["class"] == ref["class"], (case, r, run["class"])
        assert run["trainable"] == ref["trainable"], \
            (case, r, sorted(set(run["trainable"]) ^ set(ref["trainable"]))[:4])
        assert len(run["rows"]) == STEPS, (case, r, run)
        for step, (got, want) in enumerate(zip(run["rows"], ref["rows"])):
            assert set(got) == set(want), (case, r, step, got, want)
            for key in ("loss", "grad_norm", "entropy"):
                assert abs(got[key] - want[key]) <= 1e-5 * abs(want[key]), \
                    f"{case} rank {r}, step {step}: {key} {got[key]} vs {want[key]}"
            for key in ("mean_token_accuracy", "num_tokens"):
                assert got[key] == want[key], \
                    f"{case} rank {r}, step {step}: {key} {got[key]} vs {want[key]}"


@pytest.mark.parametrize("case", DPO_CASES)
def test_lora_dpo_tsp2_matches_one_process(results, case):
    """TSPDPOTrainer against DPOTrainer, each given the same arguments, as TRL decides the
    reference: with peft_config alone the policy with the adapter disabled on both sides (TRL
    keeps no reference model), so the rewards after step 0 (the adapter trained) check that
    disabling reaches TSP's adapters; with ref_model= (beside peft_config, or beside a PeftModel)
    that model, converted by TSP, its rewards far from 0 from step 0 on; with gradient
    checkpointing (TRL's default) the policy checkpointed and the reference computed with it
    off, as TRL does, against the run without (the same values on one process)."""
    (ref,) = runs(os.path.join(results, "one", REFERENCE[case]), 1)
    assert len(ref["rows"]) == STEPS, ref
    assert min(row["grad_norm"] for row in ref["rows"]) > float(CLIP[1]), ("clipping must act",
                                                                         ref)
    moved = ref["rows"] if ref["ref_model"] else ref["rows"][1:]
    assert all(min(abs(row[f"rewards/{k}"]) for k in ("chosen", "rejected", "margins")) > 0.05
               for row in moved), ("the policy is off its reference", case, ref["rows"])
    want_ref = f"TSP{ref['ref_model']}" if ref["ref_model"] else None
    for r, run in enumerate(runs(os.path.join(results, "tsp", case), 2)):
        assert (run["class"], run["ref_model"]) == (ref["class"], want_ref), \
            (case, r, run["class"], run["ref_model"])
        assert run["checkpointing"] is (case == "dpo_checkpointed"), (case, r)
        assert run["trainable"] == ref["trainable"], \
            (case, r, sorted(set(run["trainable"]) ^ set(ref["trainable"]))[:4])
        assert len(run["rows"]) == STEPS, (case, r, run)
        for step, (got, want) in enumerate(zip(run["rows"], ref["rows"])):
            assert set(got) == set(want) >= set(DPO_FIGURES), (case, r, step, got, want)
            for key in DPO_FIGURES:
                assert abs(got[key] - want[key]) <= 1e-5 * abs(want[key]), \
                    f"{case} rank {r}, step {step}: {key} {got[key]} vs {want[key]}"
            for key in ("mean_token_accuracy", "num_tokens"):
                assert got[key] == want[key], \
                    f"{case} rank {r}, step {step}: {key} {got[key]} vs {want[key]}"


def test_only_the_adapters_train(results):
    """Every parameter that requires gradients is a LoRA A or B of one of the seven
    projections, one pair per projection per layer; the base weights after training are the
    loaded ones, bit for bit, on every rank (and on one process)."""
    (ref,) = runs(os.path.join(results, "one", "sft"), 1)
    layers = {n.split(".layers.")[1].split(".")[0] for n in ref["trainable"]}
    assert len(ref["trainable"]) == 2 * len(PROJECTIONS) * len(layers) > 0, ref["trainable"]
    for name in ref["trainable"]:
        assert (".lora_A.default." in name or ".lora_B.default." in name) and \
            name.split(".lora_")[0].rsplit(".", 1)[1] in PROJECTIONS, name
    base0 = torch.load(os.path.join(results, "one", "sft", "rank0_base0.pt"))
    finals = [(f"one process {case}", os.path.join(results, "one", case, "rank0_base.pt"))
              for case in ("sft", "dpo", "dpo_ref", "dpo_peft_ref")]
    finals += [(f"{case} rank {r}", os.path.join(results, "tsp", case, f"rank{r}_base.pt"))
               for case in TSP_CASES for r in range(2)]
    for what, path in finals:
        base = torch.load(path)
        assert sorted(base) == sorted(base0), (what, sorted(set(base) ^ set(base0))[:4])
        changed = [k for k, v in base0.items() if not torch.equal(base[k], v)]
        assert not changed, f"{what}: base weights changed: {changed[:4]}"


@pytest.mark.parametrize("case", TSP_CASES)
def test_saved_adapter_equals_one_process(results, case):
    want_config, want = adapter(os.path.join(results, "one", REFERENCE[case], "adapter"))
    got_config, got = adapter(os.path.join(results, "tsp", case, "adapter"))
    for key in ("r", "lora_alpha", "peft_type"):
        assert got_config[key] == want_config[key], (case, key, got_config[key])
    assert set(got_config["target_modules"]) == set(want_config["target_modules"]) == \
        PROJECTIONS, (case, got_config["target_modules"])
    assert sorted(got) == sorted(want), (case, sorted(set(got) ^ set(want))[:4])
    layers = {k.split(".layers.")[1].split(".")[0] for k in want}
    assert len(want) == 2 * len(PROJECTIONS) * len(layers) > 0, sorted(want)  # A and B each
    # trained: every B moved away from PEFT's zeros (by 2e-4 to 3e-2), so equal files say the
    # same training
    assert all(want[k].abs().max() > 1e-5 for k in want if ".lora_B." in k), case
    for k, w in want.items():
        assert got[k].shape == w.shape and got[k].dtype == w.dtype, (case, k, got[k].shape)
        # within 1e-6, and 1e-5 of the tensor's largest entry (a small B too): measured 1e-8,
        # 4e-7 of the largest
        off, tol = (got[k] - w).abs().max().item(), min(1e-6, 1e-5 * w.abs().max().item())
        assert off <= tol, f"{case}: {k} differs from one process's by {off:.2e} (> {tol:.1e})"


def test_dpo_with_a_peft_model_refuses_on_every_rank(results):
    for r, run in enumerate(runs(os.path.join(results, "tsp", "dpo_peft_model"), 2)):
        error = run["error"]
        assert error is not None and "TSPDPOTrainer with a PeftModel (adapters ['default'])" in \
            error and "Pass the base model with peft_config=LoraConfig(...)" in error and \
            "tsp_size=1" in error, (r, error)
        assert run["collectives"] == {}, (r, "collectives before the refusal", run["collectives"])
