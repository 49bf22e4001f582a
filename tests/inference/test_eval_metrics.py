"""Evaluation that needs logits: ``tsp_core.full_logits`` gives every rank of a TSP group the
one-process logits (float64, 1e-10) and argmax ids (exact) of every token in the original order,
for plain, padded and packed rows and for batches already sharded; ``TSPTrainer.evaluate`` /
``predict`` with ``compute_metrics`` and ``preprocess_logits_for_metrics`` give one process's
metrics, ``eval_loss`` and predictions at tsp 2 and at dp 2 x tsp 2."""

from __future__ import annotations

import copy
import json
import os
import sys

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import tsp_core
from tests.support import dist_pool, hf_models, launch
from tests.support.reference import assert_close
from tsp_core.sequence.gather import gather_tokens
from tsp_core.sequence.layout import shard_batch, shift_labels


def packed_batch(vocab: int) -> tuple[dict, list[list[torch.Tensor]]]:
    """Two packed rows of 17 tokens (documents 5+9+3 and 17), positions restarting per document."""
    gen = torch.Generator().manual_seed(7)
    rows = [[torch.randint(0, vocab, (n,), generator=gen) for n in lengths]
            for lengths in ([5, 9, 3], [17])]
    ids = torch.stack([torch.cat(docs) for docs in rows])
    positions = torch.stack([torch.cat([torch.arange(len(d)) for d in docs]) for docs in rows])
    return {"input_ids": ids, "labels": ids.clone(), "position_ids": positions}, rows


class Wrapper(torch.nn.Module):
    def __init__(self, module: torch.nn.Module) -> None:
        super().__init__()
        self.module = module

    def forward(self, **kwargs):
        return self.module(**kwargs)


def full_logits_parity(tsp: int) -> dict:
    mesh = dist_pool.mesh(tsp)
    ref = hf_models.build("llama-tied", torch.float64)  # vocab 101: padded to a multiple of D
    model = tsp_core.parallelize(copy.deepcopy(ref), mesh)
    ids = torch.randint(0, 101, (3, 13), generator=torch.Generator().manual_seed(3))  # pads to 16
    labels = ids.clone()
    labels[1, 4:] = -100
    with torch.no_grad():
        want = ref(input_ids=ids).logits
    want_targets = shift_labels(labels)
    want_loss = hf_models.reference_loss(ref, ids, labels)
    with torch.no_grad():
        got = tsp_core.full_logits(model, {"input_ids": ids, "labels": labels})
        assert_close(got.logits, want, 1e-10, "logits")
        assert_close(got.loss, want_loss, 1e-10, "loss")
        assert torch.equal(got.targets, want_targets) and got.ids is None
        top = tsp_core.full_logits(model, {"input_ids": ids, "labels": labels}, argmax=True)
        assert torch.equal(top.ids, want.argmax(-1)) and top.logits is None
        assert torch.equal(top.targets, want_targets)
        assert_close(top.loss, want_loss, 1e-10, "loss (argmax)")
        bare = tsp_core.full_logits(model, {"input_ids": ids})  # no labels: no loss, no targets
        assert bare.loss is None and bare.targets is None
        assert_close(bare.logits, want, 1e-10, "logits without labels")
        assert torch.equal(tsp_core.full_logits(model, {"input_ids": ids}, argmax=True).ids,
                           want.argmax(-1))
    # a batch already sharded, under inference mode (what Lightning's validation_step gets):
    # the padded sequence
    with torch.inference_mode():
        sharded = tsp_core.full_logits(model, shard_batch({"input_ids": ids, "labels": labels},
                                                          mesh))
    with torch.no_grad():
        assert sharded.logits.shape == (3, 16, 101)
        assert_close(sharded.logits[:, :13], want, 1e-10, "logits of a sharded batch")
        assert torch.equal(sharded.targets[:, :13], want_targets)
        assert (sharded.targets[:, 13:] == -100).all()
        # packed rows: each document's logits are those of the document alone
        batch, docs = packed_batch(101)
        packed = tsp_core.full_logits(model, batch)
        packed_ids = tsp_core.full_logits(model, batch, argmax=True).ids
        want_packed = torch.stack([torch.cat([ref(input_ids=d[None]).logits[0] for d in row])
                                   for row in docs])
        assert_close(packed.logits, want_packed, 1e-10, "packed logits")
        assert torch.equal(packed_ids, want_packed.argmax(-1))
        starts = [[0, 5, 14], [0]]
        ends = [[4, 13, 16], [16]]  # last token of each document has no target
        for r, row in enumerate(batch["input_ids"]):
            for s, e in zip(starts[r], ends[r]):
                assert torch.equal(packed.targets[r, s:e], row[s + 1:e + 1])
                assert packed.targets[r, e] == -100
    # through a wrapper (Fabric's, Accelerate's), with autograd on: the loss keeps its graph
    wrapped = tsp_core.full_logits(Wrapper(model), {"input_ids": ids, "labels": labels})
    assert wrapped.loss.requires_grad and not wrapped.logits.requires_grad
    assert_close(wrapped.logits.detach(), want, 1e-10, "logits through a wrapper")
    with pytest.raises(ValueError, match="not parallelized"):
        tsp_core.full_logits(ref, {"input_ids": ids})
    return {"logits": got.logits, "ids": top.ids, "packed": packed.logits,
            "sharded": sharded.logits}


@pytest.mark.parametrize("tsp", [2, 4])
def test_full_logits_match_one_process(pools, tsp):
    per_rank = pools.of(tsp).run(full_logits_parity, tsp)
    for r, res in enumerate(per_rank[1:], 1):  # bit-identical on every rank of the group
        for key, t in res.items():
            assert torch.equal(t, per_rank[0][key]), f"{key} differs on rank {r}"


def full_logits_softcapped(tsp: int) -> None:
    # Gemma 2's final logit soft-capping (hf_models: cap 3, logits near it) in the logits, the
    # argmax and the loss that full_logits computes itself
    mesh = dist_pool.mesh(tsp)
    ref = hf_models.build("gemma2", torch.float64)
    model = tsp_core.parallelize(copy.deepcopy(ref), mesh)
    ids = torch.randint(0, 96, (2, 13), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        want = ref(input_ids=ids).logits
        want_loss = hf_models.reference_loss(ref, ids, ids)
        got = tsp_core.full_logits(model, {"input_ids": ids, "labels": ids})
        assert_close(got.logits, want, 1e-10, "soft-capped logits")
        assert_close(got.loss, want_loss, 1e-10, "loss of soft-capped logits")
        top = tsp_core.full_logits(model, {"input_ids": ids}, argmax=True)
        assert torch.equal(top.ids, want.argmax(-1))


@pytest.mark.parametrize("tsp", [2, 4])
def test_full_logits_softcapped(pools, tsp):
    pools.of(tsp).run(full_logits_softcapped, tsp)


def logits_memory(tsp: int, batch: int, seq: int, hidden_size: int, vocab: int) -> dict:
    """Peak bytes MemTracker sees allocated by each way of getting the logits, beyond the local
    hidden states and the weights (which exist before)."""
    from torch.distributed._tools.mem_tracker import MemTracker

    from tsp_core.inference import logits as L
    from tsp_core.layers.vocab import TSPLMHead
    from tsp_core.sequence.gather import token_index

    mesh = dist_pool.mesh(tsp)
    head = TSPLMHead(mesh, vocab, hidden_size, dtype=torch.float32)
    hidden = torch.randn(batch, seq // tsp, hidden_size)
    index = token_index(torch.full((batch, 1), seq), tsp, mesh.layout)

    def peak(fn) -> int:
        tracker = MemTracker()
        with tracker:
            fn()
        (snap,) = tracker.get_tracker_snapshot("peak").values()
        return int(snap["Total"])

    return {"logits": peak(lambda: L._logits(head, gather_tokens(hidden, index, mesh.group))),
            "ids": peak(lambda: gather_tokens(L._argmax(head, hidden), index, mesh.group))}


@pytest.mark.parametrize("tsp", [2, 4])
def test_memory_of_logits_and_ids(pools, tsp):
    # the costs docs/api.md states: [B, S, V] (+ one [B, S, V/D] product) for logits; one
    # [B*S/D, V/D] chunk for ids (+ small terms: hidden states, two weight shards, the ids)
    b, s, h, v, e = 2, 512, 32, 4096, 4
    small = 4 * b * s * h * e + 4 * (v // tsp) * h * e + 64 * b * s
    for peak in pools.of(tsp).run(logits_memory, tsp, b, s, h, v):
        assert b * s * v * e <= peak["logits"] <= b * s * v * e * (1 + 1 / tsp) + small, peak
        chunk = b * s // tsp * v // tsp * e
        assert chunk <= peak["ids"] <= chunk + small, peak


# ------------------------------------------------------------------ the transformers Trainer

JOB = os.path.join(launch.JOBS, "trainer_eval_job.py")


def job_launch(model: str, out, nproc: int, *extra: str) -> tuple[list[str], int]:
    """The job's command on ``nproc`` processes (python for 1, torchrun otherwise)."""
    args = [JOB, "--model_path", model, "--out", str(out), "--output_dir", str(out / "o"),
            "--per_device_eval_batch_size", "2", "--report_to", "none", "--use_cpu", *extra]
    launcher = [sys.executable] if nproc == 1 else launch.torchrun(nproc)
    return [*launcher, launch.EXIT_CLEANLY, *args], nproc


def job_results(out, nproc: int) -> list[tuple[dict, dict]]:
    """Every rank's result of a job run in ``out``."""
    results = []
    for r in range(nproc):
        with open(out / f"rank{r}.json") as f:
            results.append((json.load(f), dict(np.load(out / f"rank{r}.npz"))))
    return results


@pytest.fixture(scope="module")
def saved_llama64(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("llama64"))
    hf_models.build("llama", torch.float64).save_pretrained(path)
    return path


def close(a: float, b: float, rel: float, what: str) -> None:
    assert abs(a - b) <= rel * abs(b), f"{what}: {a!r} vs {b!r} ({abs(a - b) / abs(b):.1e})"


def test_trainer_evaluate_and_predict_match_one_process(tmp_path, saved_llama64):
    from transformers import AutoModelForCausalLM

    from tests.jobs.trainer_eval_job import packed_documents

    # the three runs are independent: at the same time (the 1-process one alone leaves a core idle)
    launch.run_together(job_launch(saved_llama64, tmp_path / "plain", 1),
                        job_launch(saved_llama64, tmp_path / "tsp2", 2, "--tsp_size", "2"),
                        job_launch(saved_llama64, tmp_path / "dp2", 4, "--tsp_size", "2"))
    (plain, plain_arrays), = job_results(tmp_path / "plain", 1)
    runs = {"tsp 2": job_results(tmp_path / "tsp2", 2),
            "dp 2 x tsp 2": job_results(tmp_path / "dp2", 4)}
    # float64 references from the unmodified model: HF's own loss (the plain Trainer's eval_loss)
    # casts logits to float32, so it agrees with the float64 loss to ~1e-7 only
    model = AutoModelForCausalLM.from_pretrained(saved_llama64, dtype=torch.float64)
    ids = torch.from_numpy(plain_arrays["input_ids"])
    with torch.no_grad():
        logits = model(input_ids=ids).logits
        loss64 = F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten()).item()
        docs = packed_documents(model.config.vocab_size)
        per_doc = [model(input_ids=d[None]).logits[0] for d in docs]
    assert_close(torch.from_numpy(plain_arrays["predictions"]), logits, 1e-12, "plain predict")
    close(plain["metrics"]["eval_loss"], loss64, 1e-6, "plain eval_loss")
    for name, ranks in runs.items():
        for rank, (res, arrays) in enumerate(ranks):
            where = f"{name}, rank {rank}"
            for key in ("metrics", "argmax", "loss_only", "prediction_loss_only"):
                close(res[key]["eval_loss"], loss64, 1e-10, f"{where}: {key} eval_loss")
                close(res[key]["eval_loss"], plain[key]["eval_loss"], 1e-6,
                      f"{where}: {key} eval_loss against the plain Trainer")
            m, want = res["metrics"], plain["metrics"]
            assert m["eval_accuracy"] == want["eval_accuracy"], where
            close(m["eval_label_logprob"], want["eval_label_logprob"], 1e-10, f"{where}: logprob")
            for key in ("eval_accuracy", "eval_rows", "eval_id_checksum"):  # argmax ids: exact
                assert res["argmax"][key] == plain["argmax"][key], (where, key)
            assert res["metrics_calls"] > 0 and res["loss_only_calls"] == 0, where
            p, want = res["predict_metrics"], plain["predict_metrics"]
            assert p["test_accuracy"] == want["test_accuracy"], where
            close(p["test_label_logprob"], want["test_label_logprob"], 1e-10, where)
            close(p["test_loss"], loss64, 1e-10, f"{where}: test_loss")
            for key in ("predictions", "unlabelled"):  # [5, 23, 96], rows and tokens in order
                assert_close(torch.from_numpy(arrays[key]), logits, 1e-10, f"{where}: {key}")
            assert np.array_equal(arrays["label_ids"], plain_arrays["label_ids"]), where
            packed = torch.from_numpy(arrays["packed"])  # rows of 14 and 11 tokens, -100 after
            assert packed.shape == (2, 14, 96), (where, packed.shape)
            for row, pair in enumerate((per_doc[:2], per_doc[2:])):
                want_row = torch.cat(pair)
                assert_close(packed[row, :len(want_row)], want_row, 1e-10, f"{where}: packed")
                assert (packed[row, len(want_row):] == -100).all(), where
