"""TRL's GRPO under TSP (``tsp_trl.TSPGRPOTrainer``), against TRL's own ``GRPOTrainer``: at tsp 2
(2 processes) against one process, and at dp 2 x tsp 2 (4 processes) against GRPOTrainer under
DDP on 2 processes, float32, a tiny Llama, beta 0.04 (TRL builds the reference model; under TSP a
second TSP model), sampling at temperature 0.9 with top-k, top-p and min-p, a reward computed
from the completion text, 3 steps: every rank logs the same loss, reward, reward_std, kl,
entropy, completion lengths, clip ratios, token count and grad_norm (1e-5 relative), and every
generation's completion tokens are the same, with TRL's default loss (dapo), grpo and dr_grpo,
with gradient accumulation (dapo's normaliser over the accumulated batch; bnpo's per
micro-batch), with num_iterations 2 (importance ratios; clipping acts), with two reward functions
weighted [1.0, 0.5] and scale_rewards "batch" (each function's logged rewards/<name>/mean and
/std too), and with top_entropy_quantile 0.5 (also at dp 2 x tsp 2: the quantile over both
replicas' tokens). Each reward function runs once per replica per generation (on rank 0 of each
TSP group). Float64 at tsp 2 (prompts of one length): the
first step's gradient of every parameter, gathered by name on every rank, within 1e-10 of one
process's (its head kernel computed in float64). Refused on every
rank before any collective, naming the numbers: use_vllm=True, a num_generations that does not
divide the replicas' generation batch (also one sized by steps_per_generation), a
generation_batch_size that is not whole steps of the replicas' global batch, the longest prompt
plus max_completion_length over max_position_embeddings; both generation sizes given: TRL's own
refusal.

One shared launch: the four runs start together (tests/jobs/grpo_job.py)."""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch

pytest.importorskip("trl")

from tests.support import hf_models, launch  # noqa: E402

JOB = os.path.join(launch.JOBS, "grpo_job.py")
CASES = ("dapo", "grpo", "dr_grpo", "bnpo", "accum", "iterations", "rewards", "entropy")
DP_CASES = ("dp", "dp_entropy")  # dp 2 x tsp 2 against DDP on 2 processes
GRADIENTS = ("grads64",)  # float64, the first step's gradients
REFUSALS = ("bad_num_generations", "use_vllm", "too_long", "bad_generation_batch",
            "bad_steps_per_generation", "both_sizes")
# compared on every step and rank (all of TRL's figures are, but for the step time)
KEYS = ("loss", "reward", "reward_std", "kl", "entropy", "completions/mean_length", "grad_norm",
        "num_tokens", "clip_ratio/region_mean")


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> str:
    """A tiny Llama whose end-of-sequence token (id 2) has about 7% of the probability (its head
    row along the mean final hidden state), so completions end at different lengths, and a
    word-level tokenizer over its ids (t0..t95), saved as the trainers load them."""
    model = hf_models.build("llama", torch.float32)
    with torch.no_grad():
        ids = torch.randint(3, 96, (4, 12), generator=torch.Generator().manual_seed(1))
        hidden = model.model(input_ids=ids).last_hidden_state
        row, mean = model.lm_head.weight[2], hidden.reshape(-1, hidden.shape[-1]).mean(0)
        row += (1.5 - (hidden @ row).mean()) * mean / mean.dot(mean)
    return hf_models.save_with_word_tokenizer(model, str(tmp_path_factory.mktemp("llama_grpo")))


@pytest.fixture(scope="module")
def outs(tmp_path_factory, saved) -> dict[str, str]:
    """The four runs, started together: GRPOTrainer on one process and TSPGRPOTrainer at tsp 2
    on every case (and the refusals), GRPOTrainer under DDP on 2 processes and TSPGRPOTrainer at
    dp 2 x tsp 2 on the data-parallel case."""
    root = tmp_path_factory.mktemp("grpo")
    out = {name: str(root / name) for name in ("one", "tsp2", "ddp", "dp2_tsp2")}

    def job(name: str, mode: str, cases: tuple[str, ...]) -> list[str]:
        return [launch.EXIT_CLEANLY, JOB, "--model_path", saved, "--out", out[name], "--mode",
                mode, "--case", *cases]

    launch.run_together(([sys.executable, *job("one", "plain", CASES + GRADIENTS)], 1),
                        (launch.torchrun(2, *job("tsp2", "tsp", CASES + GRADIENTS + REFUSALS)),
                         2),
                        (launch.torchrun(2, *job("ddp", "plain", DP_CASES)), 2),
                        (launch.torchrun(4, *job("dp2_tsp2", "tsp", DP_CASES)), 4), timeout=400)
    return out


def result(out: str, case: str, rank: int) -> dict:
    with open(os.path.join(out, case, f"rank{rank}.json")) as f:
        return json.load(f)


def assert_same_run(got: dict, want: dict, what: str) -> None:
    """The same completion tokens at every generation, and the same log rows: the same figures
    (TSP's own tsp/* added), each within 1e-5 of the reference's size (1e-8 absolute: a kl or
    loss of exactly 0 at the first step)."""
    first = next((g for g, (a, b) in enumerate(zip(got["completions"], want["completions"]))
                  if a != b), None)
    assert got["completions"] == want["completions"], \
        f"{what}: completions differ from generation {first} of {len(want['completions'])}"
    assert len(got["rows"]) == len(want["rows"]) == 3, (what, got["rows"])
    for step, (row, ref) in enumerate(zip(got["rows"], want["rows"])):
        assert {k for k in row if not k.startswith("tsp/")} == set(ref), (what, step)
        for key in (*KEYS, *(k for k in ref if k.startswith("rewards/"))):
            if key in ref:  # a step that reuses a generation logs no reward or lengths
                assert abs(row[key] - ref[key]) <= 1e-5 * abs(ref[key]) + 1e-8, \
                    f"{what}, step {step}: {key} {row[key]} vs {ref[key]}"


def assert_informative(run: dict, what: str) -> None:
    """The reference run exercises what is compared: completions of several lengths (some
    ended by EOS), a nonzero kl and loss, a reward that varies."""
    lengths = {len(c) for gen in run["completions"] for c in gen}
    assert len(lengths) > 2 and min(lengths) < 8, (what, lengths)
    assert max(row["kl"] for row in run["rows"]) > 1e-3, (what, run["rows"])
    assert max(abs(row["loss"]) for row in run["rows"]) > 1e-4, (what, run["rows"])
    assert max(row.get("reward_std", 0) for row in run["rows"]) > 0.05, (what, run["rows"])


@pytest.mark.parametrize("case", CASES)
def test_grpo_tsp2_matches_one_process(outs, case):
    want = result(outs["one"], case, 0)
    assert_informative(want, case)
    for rank in range(2):
        assert_same_run(result(outs["tsp2"], case, rank), want, f"tsp 2, {case}, rank {rank}")
    if case == "iterations":  # each generation is used twice: ratios move and get clipped
        assert max(row["clip_ratio/region_mean"] for row in want["rows"]) > 0.1, want["rows"]
    if case in ("bnpo", "entropy"):  # not the default loss on the same completions
        base = result(outs["one"], "accum" if case == "bnpo" else "dapo", 0)["rows"]
        assert any(abs(r["loss"] - b["loss"]) > 1e-4 for r, b in zip(want["rows"], base))
    if case == "rewards":  # both functions logged, the weighted sum as the reward
        for row in want["rows"]:
            means = [row[f"rewards/{f}/mean"] for f in ("even_fraction", "length_fraction")]
            assert abs(row["reward"] - (means[0] + 0.5 * means[1])) <= 1e-6, row


@pytest.mark.parametrize("case", DP_CASES)
def test_grpo_dp2_tsp2_matches_ddp(outs, case):
    ddp = [result(outs["ddp"], case, r) for r in range(2)]
    assert ddp[0]["completions"] != ddp[1]["completions"]  # each replica its own prompts
    assert_informative(ddp[0], f"ddp, {case}")
    for rank in range(4):  # ranks 0, 1 are replica 0 (DDP's process 0); 2, 3 replica 1
        assert_same_run(result(outs["dp2_tsp2"], case, rank), ddp[rank // 2],
                        f"dp 2 x tsp 2, {case}, rank {rank}")


def test_grpo_first_step_gradients_float64(outs):
    """Float64, tsp 2 against one process (TRL's head kernel, float32 inside, computed in
    float64 there: grpo_job.ExactHead): the same completions, then every parameter's gradient of
    the first step (before the SGD step, no clipping), gathered from the shards by name on every
    rank, within 1e-10 of the reference's largest. Prompts of one length: a left-padded row is
    rotated under TSP, and Hugging Face's and TSP's float32 rotary tables at the other positions
    round differently (~1e-7 relative; the float32 cases cover the rotation)."""
    want = result(outs["one"], "grads64", 0)
    ref = torch.load(os.path.join(outs["one"], "grads64", "rank0_grads.pt"))
    scale = max(g.abs().max().item() for g in ref.values())
    assert scale > 1e-3, scale  # the advantages are not all zero
    zero = [name for name, g in ref.items() if not g.any()]
    assert not zero, f"no gradient in the reference for {zero}"
    for rank in range(2):
        got = result(outs["tsp2"], "grads64", rank)
        assert got["completions"] == want["completions"], f"rank {rank}: completions differ"
        grads = torch.load(os.path.join(outs["tsp2"], "grads64", f"rank{rank}_grads.pt"))
        assert set(grads) == set(ref), (rank, set(grads) ^ set(ref))
        for name, g in ref.items():
            assert grads[name].dtype == torch.float64 and grads[name].shape == g.shape, name
            err = (grads[name] - g).abs().max().item()
            assert err <= 1e-10 * scale, f"rank {rank}: {name} differs by {err:.3g} " \
                                         f"(largest gradient {scale:.3g})"


def test_reward_runs_once_per_replica_per_generation(outs):
    for out, ranks, cases in ((outs["tsp2"], 2, CASES + GRADIENTS),
                              (outs["dp2_tsp2"], 4, DP_CASES)):
        for case in cases:
            generations = len(result(out, case, 0)["completions"])  # 3, iterations: 2
            calls = [result(out, case, r)["reward_calls"] for r in range(ranks)]
            funcs = len(calls[0])  # case rewards: 2 functions, each called once
            assert funcs == (2 if case == "rewards" else 1), (case, calls)
            assert calls == [[generations] * funcs, [0] * funcs] * (ranks // 2), (case, calls)


@pytest.mark.parametrize("case, needle", [
    ("use_vllm", "use_vllm=True is not supported with tsp_size 2"),
    ("bad_num_generations", "num_generations (3) must divide the generation batch (4 = "
                            "per_device_train_batch_size 4 x 1 data-parallel replica(s)"),
    ("too_long", "the longest prompt of train_dataset (6 tokens) + max_completion_length (251) "
                 "= 257 tokens exceeds the model's rotary limit (config.max_position_embeddings "
                 "256): set max_completion_length to at most 250, or drop the prompts longer "
                 "than 5 tokens"),
    ("bad_generation_batch", "generation_batch_size (6) must be a multiple of the global batch "
                             "(4 = per_device_train_batch_size 4 x 1 data-parallel replica(s) "
                             "(2 processes / tsp_size 2))"),
    ("bad_steps_per_generation", "num_generations (2) must divide the generation batch (3 = "
                                 "per_device_train_batch_size 1 x 1 data-parallel replica(s) (2 "
                                 "processes / tsp_size 2) x steps_per_generation 3)"),
    # the same arithmetic with or without replicas: TRL's own message
    ("both_sizes", "'generation_batch_size' and 'steps_per_generation' can not be both "
                   "configured at the same time"),
])
def test_refused_on_every_rank_before_any_collective(outs, case, needle):
    for rank in range(2):
        got = result(outs["tsp2"], case, rank)
        assert needle in got.get("error", ""), (rank, got)
        assert got["collectives"] == 0, (rank, got)
