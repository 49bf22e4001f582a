"""tsp_size="auto" in every adapter: the resolution function each one calls (the planner's
smallest degree inside a node that fits, from inputs every rank has), and one real 2-process run
through TSPAccelerator (the degree it builds, and an impossible budget refused on every rank)."""

from __future__ import annotations

import logging
import os
import re
import subprocess
from types import SimpleNamespace

import pytest

from tests.support import launch
from tsp_core.baselines.layouts import LayoutSpec
from tsp_core.plan.auto import TSPChoice, choose_tsp_size, log_choice
from tsp_core.plan.cost import auto_tsp_size
from tsp_core.plan.memory import estimate
from tsp_core.plan.traffic import ModelShape

LLAMA_7B = {"hidden_size": 4096, "num_attention_heads": 32, "num_key_value_heads": 32,
            "intermediate_size": 11008, "num_hidden_layers": 32, "vocab_size": 32000,
            "max_position_embeddings": 4096}
TINY = {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 4,
        "intermediate_size": 128, "num_hidden_layers": 2, "vocab_size": 128,
        "max_position_embeddings": 64}
SHAPE_7B = ModelShape(4096, 32, 32, 11008, 32, 32000)
NO_GPU = {"cuda_memory": lambda: []}


def test_auto_is_the_planners_smallest_fitting_degree():
    # 8 x 80 GB at 128K tokens: D=1 (94.4 GiB planned) does not fit 0.9 x 80 GB, D=2 (45.3) does
    c = choose_tsp_size("auto", model_config=LLAMA_7B, local_processes=8, seq_len=131072, env={},
                        cuda_memory=lambda: [80 * 10 ** 9] * 8)
    assert c.size == auto_tsp_size(SHAPE_7B, 131072, 8, 80e9) == 2 and c.auto
    assert "GPU memory (8 visible" in c.reason and "D=1 would need 94.4" in c.reason, c.reason
    # the sequence length defaults to max_position_embeddings (4096 -> D=1), TSP_SEQ_LEN wins
    assert choose_tsp_size("auto", model_config=LLAMA_7B, local_processes=8, env={},
                           cuda_memory=lambda: [80 * 10 ** 9]).size == 1
    long = choose_tsp_size("auto", model_config=LLAMA_7B, local_processes=8,
                           env={"TSP_SEQ_LEN": "131072", "TSP_MEMORY_GB": "40"}, **NO_GPU)
    usable = 0.9 * 40e9
    assert estimate(SHAPE_7B, LayoutSpec("tsp", long.size), 131072).peak <= usable
    assert estimate(SHAPE_7B, LayoutSpec("tsp", long.size // 2), 131072).peak > usable
    assert "TSP_SEQ_LEN" in long.reason and "TSP_MEMORY_GB" in long.reason
    # the smallest visible GPU decides; on CPU the host's memory over the node's processes
    small = choose_tsp_size("auto", model_config=LLAMA_7B, local_processes=8, seq_len=131072,
                            env={}, cuda_memory=lambda: [80 * 10 ** 9, 40 * 10 ** 9])
    assert small.size == long.size
    cpu = choose_tsp_size("auto", model_config=TINY, local_processes=2, env={}, **NO_GPU)
    assert cpu.size == 1 and "host memory / 2 processes" in cpu.reason
    # an explicit size is taken as given, planner or not
    assert choose_tsp_size("4", model_config=None, local_processes=8, env={}).size == 4


def test_auto_refusals_name_what_binds(tmp_path):
    with pytest.raises(ValueError, match=r"needs the model's config.*TSP_MODEL_CONFIG"):
        choose_tsp_size("auto", local_processes=2, env={}, **NO_GPU)
    no_len = {k: v for k, v in TINY.items() if k != "max_position_embeddings"}
    with pytest.raises(ValueError, match=r"needs a sequence length: pass tsp_seq_len"):
        choose_tsp_size("auto", model_config=no_len, local_processes=2, env={}, **NO_GPU)
    with pytest.raises(ValueError, match=r"no TSP degree inside a node of 2 GPUs fits 64 tokens.*"
                                         r"D=2: 0\.0 GiB > 0\.0 GiB.*memory from TSP_MEMORY_GB"):
        choose_tsp_size("auto", model_config=TINY, local_processes=2,
                        env={"TSP_MEMORY_GB": "0.0005"}, **NO_GPU)
    with pytest.raises(ValueError, match=r"D=8: D \(8\) must divide num_attention_heads \(12\)"):
        choose_tsp_size("auto", model_config={**LLAMA_7B, "num_attention_heads": 12,
                                              "num_key_value_heads": 12},
                        local_processes=8, seq_len=1 << 22, memory_gb=80, **NO_GPU, env={})
    # a checkpoint folder's config.json through TSP_MODEL_CONFIG (Fabric, Accelerate)
    import json

    (tmp_path / "config.json").write_text(json.dumps(TINY))
    c = choose_tsp_size("auto", local_processes=2, env={"TSP_MODEL_CONFIG": str(tmp_path),
                                                         "TSP_MEMORY_GB": "0.001"}, **NO_GPU)
    assert c.size == 2  # D=1 plans 1.14 MB, D=2 0.56 MB, 0.9 MB usable


def test_the_choice_is_a_warning_once_on_rank_0(caplog):
    # configured logging at WARNING (run_clm.py's root logger) shows it; other ranks and sizes
    # given explicitly say nothing (a run without any handler gets a [tsp] line on stderr: the
    # 2-process run below)
    chosen = TSPChoice(2, "tsp_size='auto' chose D=2: ...", auto=True)
    with caplog.at_level(logging.WARNING):
        log_choice(chosen, env={"RANK": "1"})
        log_choice(TSPChoice(2, "tsp_size=2 given"), env={"RANK": "0"})
        log_choice(chosen, env={"RANK": "0"})
    said = [(r.name, r.levelno, r.getMessage()) for r in caplog.records]
    assert said == [("tsp_core.auto", logging.WARNING, chosen.reason)], said


def test_lightning_resolution():
    from tsp_lightning.common import TSPMeshMixin, resolve_sizes

    dp, choice = resolve_sizes("auto", "auto", 2, 8, LLAMA_7B, 131072, 80)
    assert (dp, choice.size) == (8, 2)
    assert resolve_sizes(None, "auto", 2, 8)[1].size == 8  # unset: every process of a node
    with pytest.raises(ValueError, match=r"tsp_size \(3\) must divide the world size \(16\)"):
        resolve_sizes(3, "auto", 2, 8)
    # the Trainer strategies read the LightningModule's model's config; Fabric needs it given
    mixin = TSPMeshMixin()
    mixin._set_auto_inputs(None, None, None)
    mixin._lightning_module = SimpleNamespace(model=SimpleNamespace(config=SimpleNamespace(**TINY)))
    assert mixin._model_config().hidden_size == 64
    fabric = TSPMeshMixin()
    fabric._set_auto_inputs(64, 0.001, None)
    with pytest.raises(ValueError, match="needs the model's config"):
        resolve_sizes("auto", "auto", 1, 2, fabric._model_config(), 64, 0.001)


def test_accelerate_resolution(monkeypatch):
    from tsp_accelerate.accelerator import choose_accelerate_tsp_size

    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    monkeypatch.setenv("TSP_SEQ_LEN", "131072")
    assert choose_accelerate_tsp_size("auto", None, LLAMA_7B, memory_gb=80).size == 2
    monkeypatch.setenv("TSP_SIZE", "auto")
    assert choose_accelerate_tsp_size(None, None, LLAMA_7B, memory_gb=80).size == 2
    # the argument wins over TSP_SIZE
    assert choose_accelerate_tsp_size(4, None, LLAMA_7B).size == 4
    monkeypatch.delenv("TSP_SIZE")
    assert choose_accelerate_tsp_size(None, None).size == 8


def test_transformers_resolution(tmp_path, monkeypatch):
    from transformers import HfArgumentParser

    from tsp_transformers.trainer import TSPTrainingArguments, resolve_tsp_size

    (args,) = HfArgumentParser(TSPTrainingArguments).parse_args_into_dataclasses(
        ["--output_dir", str(tmp_path), "--tsp_size", "auto", "--tsp_seq_len", "131072",
         "--tsp_memory_gb", "80", "--per_device_train_batch_size", "2", "--use_cpu"])
    (plain,) = HfArgumentParser(TSPTrainingArguments).parse_args_into_dataclasses(
        ["--output_dir", str(tmp_path), "--tsp_size", "2", "--use_cpu"])
    assert plain.tsp_size == 2
    model = SimpleNamespace(config=SimpleNamespace(**LLAMA_7B))
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    monkeypatch.setenv("WORLD_SIZE", "8")
    choice = resolve_tsp_size(args, model)
    want = auto_tsp_size(SHAPE_7B, 131072, 8, 80e9, batch=2)
    assert choice.size == want == 4 and "x batch 2" in choice.reason


def test_deepspeed_resolution(monkeypatch):
    from tsp_deepspeed.engine import resolve_tsp_size

    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    model = SimpleNamespace(config=SimpleNamespace(**LLAMA_7B))
    section = {"size": "auto", "seq_len": 131072, "memory_gb": 80}
    one = resolve_tsp_size(model, "auto", section, {"train_micro_batch_size_per_gpu": 1})
    two = resolve_tsp_size(model, "auto", section, {"train_micro_batch_size_per_gpu": 2})
    assert (one.size, two.size) == (2, 4)
    assert resolve_tsp_size(model, None, {}, {}).size == 8


def test_every_adapter_shares_one_default_rule(monkeypatch, tmp_path):
    """The argument > TSP_SIZE > every process of a node, in all four adapters alike
    (tsp_core.plan.auto.resolve_degree): the same environment gives the same degree."""
    from tsp_accelerate.accelerator import choose_accelerate_tsp_size
    from tsp_deepspeed.engine import resolve_tsp_size as deepspeed_size
    from tsp_lightning.common import resolve_sizes
    from tsp_transformers.trainer import TSPTrainingArguments
    from tsp_transformers.trainer import resolve_tsp_size as trainer_size

    for key in ("TSP_SIZE", "ACCELERATE_USE_PARALLELISM_CONFIG", "WORLD_SIZE"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    model = SimpleNamespace(config=SimpleNamespace(**LLAMA_7B))

    def degrees(given):
        args = TSPTrainingArguments(output_dir=str(tmp_path), use_cpu=True, tsp_size=given)
        return (resolve_sizes(given, "auto", 1, 8)[1].size,
                choose_accelerate_tsp_size(given, None).size,
                trainer_size(args, model).size, deepspeed_size(model, given, {}, {}).size)

    assert degrees(None) == (8, 8, 8, 8)
    monkeypatch.setenv("TSP_SIZE", "2")
    assert degrees(None) == (2, 2, 2, 2)
    assert degrees(4) == (4, 4, 4, 4)  # the argument wins over TSP_SIZE


def _torchrun(ok: bool, **env: str) -> subprocess.CompletedProcess:
    # a run that should work ends through tests/support/exit_cleanly.py and must end cleanly on both
    # ranks (tests/support/launch.py); one that should fail exits the ordinary way, so that the
    # first rank to exit 3 does not leave too soon for torchrun to let the other print its refusal
    job = os.path.join(launch.JOBS, "auto_job.py")
    cmd = launch.torchrun(2, launch.EXIT_CLEANLY, job) if ok else launch.torchrun(2, job)
    return launch.run(cmd, ranks=2, expect_clean=ok, timeout=240, TSP_SEQ_LEN="64", **env)


def test_two_processes_build_the_planned_degree_or_all_refuse(monkeypatch):
    monkeypatch.delenv("TSP_SIZE", raising=False)
    # TINY at 64 tokens plans 1.14 MB at D=1, 0.56 MB at D=2: 1 MB (0.9 usable) makes it D=2
    ok = _torchrun(True, TSP_MEMORY_GB="0.001")
    for rank in (0, 1):
        assert re.search(rf"rank {rank}: degree 2, dp 1, loss \d", ok.stdout), ok.stdout
    assert "[tsp] tsp_size='auto' chose D=2" in ok.stderr, ok.stderr[-2000:]
    bad = _torchrun(False, TSP_MEMORY_GB="0.0005")
    assert bad.returncode != 0
    for rank in (0, 1):
        assert re.search(rf"rank {rank} refused: tsp_size='auto': no TSP degree inside a node of 2 "
                         r"GPUs fits 64 tokens.*D=2: .* GiB >", bad.stdout), \
            bad.stdout + bad.stderr[-2000:]
