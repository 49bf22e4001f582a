"""Accelerate: the example script with TSPAccelerator on 2 processes started by
``accelerate launch`` matches the unchanged script (plain Accelerator) on one process; inside the
script, save_state / load_state must round-trip exactly (it exits non-zero otherwise). A script
clipping with ``accelerator.clip_grad_norm_`` (tests/jobs/accelerate_job.py) matches one process in
float64 with clipping active and plain SGD (norms, first gradients, losses, weights) at
dp 2 x tsp 2 (TSP_SIZE from the launch environment), tsp 4 with 1 and 2 key/value heads, and
FSDP2 dp_shard 2 x tsp 2 from an accelerate config file and from code (each rank holding 1/4 of
the model); with ``mixed_precision="bf16"`` at dp 2 x tsp 2 it matches the plain Accelerator in
bf16 on one process within bf16's bounds; a PEFT PeftModel (LoRA) at dp 2 x tsp 2 matches it on
one process in float64, its base weights unchanged; with ``dynamo_backend="eager"`` each
decoder layer is compiled and dp 2 x tsp 2 trains as eager bit for bit; dynamo options per-layer
compilation cannot honour are refused."""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch

from tests.support import launch
from tests.support.reference import assert_close

SCRIPT = os.path.join(launch.ROOT, "examples", "accelerate_llama.py")


def run(cmd: list[str], **extra_env: str) -> str:
    """``cmd`` must end cleanly on every rank (``--num_processes``, else one)."""
    ranks = int(cmd[cmd.index("--num_processes") + 1]) if "--num_processes" in cmd else 1
    return launch.run(cmd, ranks, **extra_env).stdout


def load(out: str):
    with open(os.path.join(out, "losses.json")) as f:
        return json.load(f), torch.load(os.path.join(out, "weights.pt"))


def test_accelerate_launch_matches_one_process(tmp_path):
    plain, tsp = tmp_path / "plain", tmp_path / "tsp"
    plain.mkdir()
    tsp.mkdir()
    run([sys.executable, launch.EXIT_CLEANLY, SCRIPT, "--plain", "--out", str(plain)])
    accelerate = os.path.join(launch.BIN, "accelerate")
    stdout = run([accelerate, "launch", "--multi_gpu", "--num_processes", "2", launch.EXIT_CLEANLY,
                  SCRIPT, "--out", str(tsp)])
    assert "processes 2, TSP degree 2" in stdout, stdout
    (ref_losses, ref_weights), (losses, weights) = load(str(plain)), load(str(tsp))
    assert len(losses) == len(ref_losses) == 6
    for step, (a, b) in enumerate(zip(losses, ref_losses)):
        assert abs(a - b) <= 1e-5 * abs(b), f"step {step}: {a} vs {b}"
    # Weights after 6 AdamW steps at lr 1e-3: the plain model's loss is HF's float32
    # cross-entropy, TSP's the fused online log-sum-exp; their ~1e-7 rounding differences in the
    # gradients are divided by sqrt(v) per element, so elements with tiny gradients move by up to
    # ~2e-5 differently (measured; the same happens in float64, where HF still takes the loss in
    # float32). 1e-4 is 1.7% of the largest possible movement (6 x lr).
    assert sorted(weights) == sorted(ref_weights)
    for name, t in ref_weights.items():
        assert_close(weights[name], t, 1e-4, name)


JOB = os.path.join(launch.JOBS, "accelerate_job.py")


def job_run(out: str, kv_heads: int) -> list[dict]:
    """Every rank's losses, norms, final full weights and (where recorded) first gradients for
    one model, each rank's own (gathered over its TSP group): every replica's is compared."""
    import glob

    runs = []
    for r in range(len(glob.glob(os.path.join(out, "rank*.json")))):
        with open(os.path.join(out, f"rank{r}.json")) as f:
            res = json.load(f)
        run = {key: res[key][str(kv_heads)] for key in ("losses", "norms")}
        run["weights"] = torch.load(os.path.join(out, f"rank{r}_weights_kv{kv_heads}.pt"))
        grads = os.path.join(out, f"rank{r}_grads0_kv{kv_heads}.pt")
        if os.path.exists(grads):
            run["grads0"] = torch.load(grads)
        runs.append(run)
    return runs


def reference(kv_heads: int, rows_per_step: int, dtype=torch.float64, clip: float = 0.5,
              steps: int = 4, family: str = "llama") -> dict:
    """One process on the global batch of each step: the data-parallel replicas' batches of
    accelerate_job's sequential loader, consecutive rows."""
    from tests.jobs.accelerate_job import rows
    from tests.support import hf_models

    data = rows(16)
    batches = [data[rows_per_step * k: rows_per_step * (k + 1)] for k in range(steps)]
    return hf_models.sgd_reference(hf_models.build(family, dtype, kv_heads=kv_heads), batches,
                                   lr=0.5, clip=clip)


def assert_compiled_as_eager(out, ref: dict) -> None:
    """The compiled case: TSPAccelerator(dynamo_backend="eager") at dp 2 x tsp 2 compiled
    each decoder layer (compile_layers' mark) with no graph break and handed back the TSP model
    itself (no OptimizedModule: Accelerate compiled nothing whole), and every rank's losses,
    first gradients and final weights are the eager dp2 case's bit for bit, and the unmodified
    model's on one process to 1e-8."""
    from tests.support import hf_models

    eager, runs = job_run(str(out / "dp2"), 1), job_run(str(out / "compiled"), 1)
    assert len(runs) == 4
    for r, (run, want) in enumerate(zip(runs, eager)):
        with open(out / "compiled" / f"rank{r}.json") as f:
            compiled = json.load(f)["compiled"]
        assert compiled == {"layers": [True, True], "classes": ["TSPLlamaForCausalLM"],
                            "breaks": {}}, (r, compiled)
        assert run["losses"] == want["losses"], (r, run["losses"], want["losses"])
        for key in ("grads0", "weights"):
            for name, t in want[key].items():
                assert torch.equal(run[key][name], t), f"rank {r}: {key} {name} differs"
        hf_models.assert_matches_reference(run, ref, 1e-8, 1e-9, what=f"compiled, rank {r}: ")


FSDP2_YAML = os.path.join(launch.ROOT, "tests", "fixtures", "accelerate_fsdp2.yaml")


def test_data_parallel_and_tsp4_match_one_process(tmp_path):
    # 4 processes started by accelerate launch with an FSDP2 accelerate config file
    # (dp_shard 2 x tp 2, reshard_after_forward false), five runs: TSP_SIZE=2 from the launching
    # environment (dp 2 x tsp 2: gradients summed over the data-parallel dim), 1 key/value head;
    # then tsp_size=4 with one model of 1 and one of 2 key/value heads, and Granite (these three
    # do not see the launcher's FSDP variables: plain data parallel, as after --multi_gpu); then
    # FSDP2 dp_shard 2 x tsp 2 from that config file with the script unchanged (and a
    # save_state/load_state round trip), and from code (ParallelismConfig + plugin, with
    # activation_offload=True and checkpointed layers: the switch reaches parallelize); last,
    # dynamo_backend="eager" at dp 2 x tsp 2 (each decoder layer compiled). float64,
    # SGD at lr 0.5, clipping at 0.5 (norms 1.3-2.3: it acts at every step), so the weights
    # check the gradients' directions and the norms their sizes; the first gradients are
    # compared too.
    from tests.support import hf_models

    sgd = "--dtype float64 --optimizer sgd --lr 0.5 --clip 0.5"
    accelerate = os.path.join(launch.BIN, "accelerate")
    stdout = run([accelerate, "launch", "--config_file", FSDP2_YAML, "--num_processes", "4",
                  launch.EXIT_CLEANLY, JOB, "--out", str(tmp_path),
                  "--case", f"dp2 {sgd} --kv-heads 1 --metrics --round-trip --timeout 123",
                  "--case", f"tsp4 {sgd} --tsp-size 4 --kv-heads 1,2",
                  "--case", f"granite {sgd} --tsp-size 4 --kv-heads 2 --family granite "
                  f"--clip 0.2",
                  "--case", f"fsdp_yaml {sgd} --kv-heads 1 --launch-fsdp --round-trip",
                  "--case", f"fsdp_code {sgd} --kv-heads 1 --tsp-size 2 --fsdp-code 2 "
                  f"--activation-offload",
                  "--case", f"bf16 {BF16}",
                  "--case", f"lora {sgd} --kv-heads 1 --tsp-size 2 --lora 4",
                  "--case", f"compiled {sgd} --kv-heads 1 --tsp-size 2 --dynamo-backend "
                  f"eager"],
                 TSP_SIZE="2")
    assert "processes 4, distributed DistributedType.MULTI_CPU, TSP degree 2" in stdout, stdout
    assert "processes 4, distributed DistributedType.MULTI_CPU, TSP degree 4" in stdout, stdout
    assert "processes 4, distributed DistributedType.FSDP, TSP degree 2" in stdout, stdout
    dp2 = reference(1, rows_per_step=4)
    cases = [("dp2", 1, dp2), ("tsp4", 1, reference(1, rows_per_step=2)),
             # Granite: embedding, residual, attention and logits multipliers (its gradient norms
             # are 0.41-0.43: clipped at 0.2)
             ("granite", 2, reference(2, rows_per_step=2, family="granite", clip=0.2)),
             ("tsp4", 2, reference(2, rows_per_step=2)),
             # FSDP2 over dp_shard 2: the same global batches as dp2
             ("fsdp_yaml", 1, dp2), ("fsdp_code", 1, dp2)]
    for name, kv, ref in cases:
        assert min(ref["norms"]) > (0.2 if name == "granite" else 0.5), ref["norms"]  # clips
        runs = job_run(str(tmp_path / name), kv)
        assert len(runs) == 4, name
        for r, rank_run in enumerate(runs):  # every rank's own weights and gradients
            hf_models.assert_matches_reference(rank_run, ref, 1e-8, 1e-9,
                                               what=f"{name}, {kv} kv heads, rank {r}: ")
    assert_logged_metrics(str(tmp_path / "dp2"))
    # FSDP2 sharded (each rank holds 1/(tsp x dp_shard) = 1/4 of the model, up to the norms,
    # which TSP replicates and FSDP2 halves: +0.4%), with TSP's units (each decoder layer and
    # the root; Accelerate's own fully_shard would have added the embedding and the head) and
    # the options of each route: the config file's reshard_after_forward false, the plugin's
    # float64 reduce dtype (default None)
    for name, reshard, reduce in (("fsdp_yaml", False, "None"),
                                  ("fsdp_code", True, "torch.float64")):
        for r, fn in enumerate(sorted((tmp_path / name).glob("rank*.json"))):
            with open(fn) as f:
                fsdp = json.load(f)["fsdp"]
            floor = fsdp["full"] / 4
            assert floor <= fsdp["storage"] <= 1.01 * floor, (name, r, fsdp)
            assert fsdp["units"] == 3 and fsdp["reshard"] == [reshard] * 2, (name, r, fsdp)
            assert fsdp["reduce_dtype"] == [reduce], (name, r, fsdp)
    # InitProcessGroupKwargs(timeout=...) reaches every group of the TSP mesh (dp 2 x tsp 2), not
    # only the default one Accelerate gives it to
    for r, fn in enumerate(sorted((tmp_path / "dp2").glob("rank*.json"))):
        with open(fn) as f:
            timeouts = json.load(f)["group_timeouts"]
        assert set(timeouts.values()) == {123} and len(timeouts) >= 3, (r, timeouts)
    # TSPAccelerator(activation_offload=True) with checkpointed layers (fsdp_code, under FSDP2):
    # every rank moved each layer's input to the host and back at each of the 4 steps
    layers = hf_models.COMMON["num_hidden_layers"]
    for name in ("fsdp_code", "dp2"):
        for r, fn in enumerate(sorted((tmp_path / name).glob("rank*.json"))):
            with open(fn) as f:
                offload = json.load(f)["offload"]
            want = ([{"offloaded": 4 * layers, "brought_back": 4 * layers,
                      "prefetched": 4 * (layers - 1)}] if name == "fsdp_code" else [None])
            assert offload == want, (name, r, offload)
    assert_compiled_as_eager(tmp_path, dp2)
    assert_bf16_as_one_process(tmp_path)
    assert_lora_as_one_process(str(tmp_path / "lora"))
    with open(tmp_path / "fsdp_yaml" / "rank0.json") as f:  # the degree too (no TSP_SIZE there)
        assert json.load(f)["tsp_reason"] == "tp_size=2 of the ParallelismConfig"
    for r, fn in enumerate(sorted((tmp_path / "dp2").glob("rank*.json"))):  # and dp2 is not
        with open(fn) as f:
            assert json.load(f)["fsdp"] == {}, r


def assert_lora_as_one_process(out: str) -> None:
    """The lora case: TSPAccelerator at dp 2 x tsp 2 preparing a PEFT PeftModel (rank-4 LoRA
    on the seven projections, tests/support/hf_models.py's lora_model) against the same
    PeftModel on one process (plain PEFT and torch, what the plain Accelerator runs on one
    process, with the loss in float64), float64, clipped SGD: every rank's losses, norms and
    first gradients (the adapters' alone) to 1e-8/1e-9, the adapters after 4 steps to 1e-8,
    every base weight bit for bit as built."""
    from tests.jobs.accelerate_job import rows
    from tests.support import hf_models

    data = rows(16)
    init = hf_models.build("llama", torch.float64, kv_heads=1).state_dict()
    ref = hf_models.sgd_reference(
        hf_models.lora_model(hf_models.build("llama", torch.float64, kv_heads=1), 4),
        [data[4 * k: 4 * (k + 1)] for k in range(4)], lr=0.5, clip=0.5)
    assert min(ref["norms"]) > 0.5 and all(".lora_" in n for n in ref["grads0"]), ref["norms"]
    # TSP's full state dict names a base weight as the Hugging Face model does
    ref["weights"] = {n.replace(".base_layer.", "."): w for n, w in ref["weights"].items()}
    runs = job_run(out, 1)
    assert len(runs) == 4
    for r, run in enumerate(runs):
        hf_models.assert_matches_reference(run, ref, 1e-8, 1e-9, what=f"lora, rank {r}: ")
        for name, w in run["weights"].items():
            base = name.removeprefix("base_model.model.")
            if ".lora_" not in name:
                assert torch.equal(w, init[base]), f"lora, rank {r}: base weight {name} moved"


# TSPAccelerator(mixed_precision="bf16"): float32 weights, bf16 autocast around the forward;
# clipped SGD as the float64 cases
BF16 = "--optimizer sgd --lr 0.5 --clip 0.5 --kv-heads 1 --mixed-precision bf16"


def assert_bf16_as_one_process(tmp_path) -> None:
    """The bf16 case (dp 2 x tsp 2) against the plain Accelerator(mixed_precision="bf16") on one
    process, 4 rows a step (the two replicas' batches), within bf16's bounds
    (tests/support/precision.py) on every rank; both really ran bf16 (first gradients >= 0.1 u
    from float32's)."""
    from tests.support import hf_models, precision

    one = tmp_path / "bf16_one_process"
    run([sys.executable, launch.EXIT_CLEANLY, JOB, "--plain", *BF16.split(), "--batch", "4",
         "--out", str(one)])
    (plain,) = job_run(str(one), 1)
    float32 = reference(1, rows_per_step=4, dtype=torch.float32)
    init = hf_models.build("llama", torch.float32, kv_heads=1).state_dict()
    precision.assert_within_bf16(plain, float32, init, "bf16, one process", exact=float32)
    runs = job_run(str(tmp_path / "bf16"), 1)
    assert len(runs) == 4
    for r, rank_run in enumerate(runs):  # each rank's own gathered gradients and weights
        precision.assert_within_bf16(rank_run, plain, init, f"bf16, dp 2 x tsp 2, rank {r}",
                                     exact=float32)
    print("bf16: " + precision.summary(runs[0], plain, init, float32))


def assert_logged_metrics(out: str) -> None:
    """tsp_metrics() every 2 optimizer steps (save_state and load_state between steps 2-3 and
    4-5 must not count), against each step's own counters on every rank; rank 0's are what the
    tracker received."""
    import glob

    from tests.support import metrics_check

    runs = []
    for fn in sorted(glob.glob(os.path.join(out, "rank*.json"))):
        with open(fn) as f:
            runs.append(json.load(f))
    for r, run in enumerate(runs):
        assert len(run["step_counts"]) == 6 and len(run["metric_rows"]) == 3, (r, run)
        metrics_check.assert_windows(run["metric_rows"], run["step_counts"], 2, f"rank {r}")
    with open(os.path.join(out, "tracker.jsonl")) as f:
        logged = [json.loads(line) for line in f]
    assert [row.pop("step") for row in logged] == [2, 4, 6], logged
    assert logged == runs[0]["metric_rows"], (logged, runs[0]["metric_rows"])


def test_packed_batches(tmp_path):
    # the first step's batch packs documents 0 and 1 of the example into one row; its loss is the
    # unmodified model's on each document alone
    import runpy

    import torch.nn.functional as F
    from transformers import LlamaConfig, LlamaForCausalLM

    accelerate = os.path.join(launch.BIN, "accelerate")
    stdout = run([accelerate, "launch", "--multi_gpu", "--num_processes", "2", launch.EXIT_CLEANLY,
                  SCRIPT, "--packed", "--out", str(tmp_path)])
    assert "processes 2, TSP degree 2" in stdout, stdout
    with open(os.path.join(tmp_path, "losses.json")) as f:
        first = json.load(f)[0]
    docs = runpy.run_path(SCRIPT)["documents"](32)[:2]
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128,
                                         num_hidden_layers=2, num_attention_heads=4,
                                         num_key_value_heads=2, max_position_embeddings=64))
    total, count = 0.0, 0
    with torch.no_grad():
        for d in docs:
            t = torch.tensor(d["input_ids"])[None]
            total += F.cross_entropy(model(input_ids=t).logits[0, :-1], t[0, 1:],
                                     reduction="sum").item()
            count += t.shape[1] - 1
    assert abs(first - total / count) <= 1e-5 * total / count, (first, total / count)


FSDP_REFUSALS = [
    # (plugin options or None, TSPAccelerator keyword arguments, words the error must name)
    (dict(fsdp_version=1), {}, "FSDP2 only, not fsdp_version=1"),
    (dict(cpu_offload=True), {}, "cpu_offload"),
    (dict(activation_checkpointing=True), {}, "activation_checkpointing"),
    (dict(cpu_ram_efficient_loading=True), {}, "cpu_ram_efficient_loading"),
    (dict(auto_wrap_policy="SIZE_BASED_WRAP", min_num_params=1000), {}, "SIZE_BASED_WRAP"),
    (dict(ignored_modules="lm_head"), {}, "ignored_modules"),
    # the numbers: no data-parallel rank left to shard over; a dp_shard_size that does not fit
    ({}, dict(tsp_size=4), r"tsp_size \(4\) x dp_replicate_size \(1\) takes all 4 processes"),
    ({}, dict(tsp_size=None, parallelism_config=("dp_shard_size", 4, "tp_size", 2)),
     r"dp_shard_size \(4\) x tsp_size \(2\) = 8 does not match the world size \(4\)"),
    ({}, dict(tsp_size=2, parallelism_config=("tp_size", 4)),
     r"tp_size \(4\) is the TSP degree, and tsp_size is 2"),
    # fp16 on the CPU, where Accelerate would train in float32 (no autocast, no GradScaler)
    (None, dict(mixed_precision="fp16"), r"TSPAccelerator: fp16 mixed precision on the CPU "
                                         r"would train in float32"),
    (None, dict(env=("ACCELERATE_MIXED_PRECISION", "fp16")), r"fp16 mixed precision on the CPU"),
    # dp_shard without an FSDP plugin: Accelerate would shard nothing
    (None, dict(tsp_size=None, parallelism_config=("dp_shard_size", 2, "tp_size", 2)),
     r"dp_shard_size \(2\) shards data parallel with FSDP2, and no FSDP plugin is given"),
    # torch.compile the TSP way (each decoder layer, torch.compile's default mode): a mode or
    # backend options would otherwise be dropped; from the plugin, or accelerate launch's
    # --dynamo_mode (the environment)
    (None, dict(dynamo_plugin=dict(backend="inductor", mode="max-autotune")),
     r"TSPAccelerator compiles each decoder layer with tsp_core.parallelize\(\.\.\., "
     r"compile='inductor'\), which cannot honour mode='max-autotune'"),
    (None, dict(dynamo_backend="aot_eager", env=("ACCELERATE_DYNAMO_MODE", "reduce-overhead")),
     r"compile='aot_eager'\), which cannot honour mode='reduce-overhead'"),
    (None, dict(dynamo_plugin=dict(backend="inductor", options={"max_autotune": True})),
     r"cannot honour options=\{'max_autotune': True\}"),
    (None, dict(dynamo_plugin=dict(backend="inductor", dynamic=True)),
     r"cannot honour dynamic=True"),
]


@pytest.mark.parametrize("options, kwargs, words", FSDP_REFUSALS)
def test_fsdp_options_tsp_cannot_honour_are_refused(monkeypatch, options, kwargs, words):
    # what TSP cannot honour raises with the fix, in the constructor, before any collective
    # (no process group exists afterwards), on a 4-process world
    import torch.distributed as dist
    from accelerate import ParallelismConfig
    from accelerate.utils import FullyShardedDataParallelPlugin

    from tsp_accelerate import TSPAccelerator

    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    monkeypatch.setenv("FSDP_CPU_RAM_EFFICIENT_LOADING", "False")  # a plugin may set it
    for key in ("TSP_SIZE", "ACCELERATE_USE_FSDP", "ACCELERATE_USE_PARALLELISM_CONFIG"):
        monkeypatch.delenv(key, raising=False)
    kwargs = {"tsp_size": 2, **kwargs}
    if "env" in kwargs:  # as accelerate launch --mixed_precision sets it
        monkeypatch.setenv(*kwargs.pop("env"))
    if "parallelism_config" in kwargs:
        pairs = kwargs["parallelism_config"]
        kwargs["parallelism_config"] = ParallelismConfig(**dict(zip(pairs[::2], pairs[1::2])))
    if "dynamo_plugin" in kwargs:
        from accelerate.utils import TorchDynamoPlugin

        kwargs["dynamo_plugin"] = TorchDynamoPlugin(**kwargs["dynamo_plugin"])
    if options is not None:
        kwargs["fsdp_plugin"] = FullyShardedDataParallelPlugin(**{"fsdp_version": 2, **options})
    with pytest.raises(ValueError, match=words):
        TSPAccelerator(**kwargs)
    assert not dist.is_initialized()


def test_a_model_compiled_whole_is_refused():
    # torch.compile(model) before prepare would compile the whole TSP model: refused, naming the
    # accelerator's dynamo_backend (each decoder layer compiled)
    from tsp_accelerate.compiling import refuse_compiled_model

    refuse_compiled_model(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match=r"torch.compile wrapped whole \(an OptimizedModule\); "
                                         r"TSP compiles each decoder layer instead: pass the model "
                                         r"itself and dynamo_backend="):
        refuse_compiled_model(torch.compile(torch.nn.Linear(2, 2)))


def test_wrap_policy_may_only_name_the_decoder_layer():
    from tests.support import hf_models
    from tsp_accelerate.accelerator import _check_wrap_classes

    model = hf_models.build("llama", torch.float32)
    _check_wrap_classes(["LlamaDecoderLayer"], model)
    with pytest.raises(ValueError, match=r"names \['LlamaMLP'\]: TSP's FSDP2 units are each "
                                         r"decoder layer \(LlamaDecoderLayer\) and the root"):
        _check_wrap_classes(["LlamaDecoderLayer", "LlamaMLP"], model)
