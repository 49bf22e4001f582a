"""Render the figures of the docs from the records in docs/records/, so one figure has one source.

A record, ``docs/records/NAME.json``, is ``{"command": ..., "output": ...}``: the exact ``tsp``
command that produced it and the JSON that command wrote with ``--json`` (``tsp simulate``,
``tsp plan``, ``tsp bench``). A doc (README.md, docs/*.md) shows a record's figures only between

    <!-- record: BLOCK -->
    ...
    <!-- /record -->

lines, where BLOCK names one of the renderers below; what lies between them is generated. The
figures of :data:`FIGURES` are drawn from the records too, into docs/img/records/NAME.png, each
PNG carrying the numbers it was drawn from; ``--check`` compares those numbers with the records,
and the docs build (docs/hooks.py) draws them again into the site.

    python docs/scripts/render_records.py            # rewrite every block from the records
    python docs/scripts/render_records.py --check    # exit 1 and print the diff where they differ
    python docs/scripts/render_records.py --rerun NAME [NAME ...]  # run a record's command again

Why it lives in docs/scripts/: it maintains the docs and ships beside them in the repository; it
is not part of the ``tsp_core`` package nor a ``tsp`` command. tests/project/test_doc_records.py
runs the check in the test suite.
"""

from __future__ import annotations

import argparse
import difflib
import json
import os
import re
import shlex
import subprocess
import sys
import tempfile
import textwrap
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RECORDS = ROOT / "docs" / "records"
BLOCK = re.compile(r"^<!-- record: ([\w.+-]+) -->\n(.*?)^<!-- /record -->$", re.M | re.S)
GIB, GB, MIB = 2**30, 1e9, 2**20
KINDS = ("parameters", "gradients", "optimizer_states", "activations", "temporaries")

Loader = Callable[[str], dict]


def pages(root: Path = ROOT) -> list[Path]:
    """The docs that may hold record blocks."""
    return [root / "README.md", *sorted((root / "docs").glob("*.md"))]


def loader(records: Path = RECORDS) -> Loader:
    cache: dict[str, dict] = {}

    def load(name: str) -> dict:
        if name not in cache:
            cache[name] = json.loads((records / f"{name}.json").read_text(encoding="utf-8"))
        return cache[name]
    return load


# ------------------------------------------------------------------ tsp simulate records

def sim_rows(load: Loader, name: str) -> list[dict]:
    return load(name)["output"]


def sim(rows: list[dict], layout: str, seq: int) -> dict:
    """The one row of ``layout`` (a label such as "tp+cp(4x2)") at ``seq`` tokens."""
    hits = [r for r in rows if r["layout"] == layout and r["seq"] == seq]
    if len(hits) != 1:
        raise KeyError(f"{len(hits)} rows of {layout} at {seq} tokens in the record")
    return hits[0]


def best(rows: list[dict], family: str, seq: int) -> dict:
    """The lowest peak of a 2-D layout family ("tp+cp", "tp-sp+cp") over its meshes."""
    return min((r for r in rows if r["layout"].startswith(family + "(") and r["seq"] == seq),
               key=lambda r: r["peak_bytes"])


def gib(r: dict, kind: str | None = None) -> float:
    return (r["peak_bytes"] if kind is None else r["breakdown"].get(kind, 0)) / GIB


def mesh(r: dict) -> str:
    return r["layout"][r["layout"].index("("):]


def sim_table(rows: list[dict]) -> str:
    """The table ``tsp simulate`` prints (tsp_core/tools/cli.py), from its JSON."""
    head = (f"{'layout':<15} {'seq':>7} {'D':>3} {'peak GiB':>9} "
            + " ".join(f"{k[:11]:>11}" for k in KINDS))
    return "\n".join([head] + [
        f"{r['layout']:<15} {r['seq']:>7} {r['degree']:>3} {gib(r):>9.2f} "
        + " ".join(f"{gib(r, k):>11.2f}" for k in KINDS) for r in rows])


def command(load: Loader, name: str) -> str:
    return load(name)["command"]


def code(text: str) -> str:
    return f"```\n{text}\n```\n"


def para(text: str) -> str:
    """A paragraph of prose, wrapped at the docs' line length."""
    return textwrap.fill(" ".join(text.split()), 100, break_long_words=False,
                         break_on_hyphens=False) + "\n"


def simulate_7b(load: Loader) -> str:
    """README: the 7B peaks per layout at both lengths."""
    rows = sim_rows(load, "simulate-7b")
    out = ["| tokens | tsp | tp | tp-sp | cp | best tp+cp | best tp-sp+cp |",
           "|---|---|---|---|---|---|---|"]
    for seq in sorted({r["seq"] for r in rows}):
        a, b = best(rows, "tp+cp", seq), best(rows, "tp-sp+cp", seq)
        out.append(f"| {seq} | {gib(sim(rows, 'tsp', seq)):.2f} GiB | "
                   + " | ".join(f"{gib(sim(rows, k, seq)):.2f}" for k in ("tp", "tp-sp", "cp"))
                   + f" | {gib(a):.2f} {mesh(a)} | {gib(b):.2f} {mesh(b)} |")
    return "\n".join(out) + "\n"


def simulate_7b_summary(load: Loader) -> str:
    """design.md "What TSP buys": the 128K peaks in one sentence."""
    rows, seq = sim_rows(load, "simulate-7b"), 131072
    g = {k: gib(sim(rows, k, seq)) for k in ("tsp", "tp", "tp-sp")}
    return para(f"Measured with `tsp simulate` (7B shape, bf16, AdamW, full activation "
            f"checkpointing,\ndegree 8, {seq} tokens): {g['tsp']:.2f} GiB per rank under TSP "
            f"against {g['tp']:.2f} under `tp`, {g['tp-sp']:.2f}\nunder `tp-sp` and "
            f"{gib(best(rows, 'tp+cp', seq)):.2f} / {gib(best(rows, 'tp-sp+cp', seq)):.2f} for "
            f"the best `tp+cp` / `tp-sp+cp` meshes ([benchmarks.md](benchmarks.md#memory-at-the-"
            f"papers-scale-tsp-simulate)).")


def simulate_7b_full(load: Loader) -> str:
    """benchmarks.md: the command and the whole table."""
    return code(f"$ {command(load, 'simulate-7b')}\n" + sim_table(sim_rows(load, "simulate-7b")))


PAPER_128K = {"tp": 70.0, "tp+cp": 85.0, "tsp": 38.8}  # GB per GPU, 7B, 128K tokens, 8 x MI300X


def simulate_7b_ratios(load: Loader) -> str:
    """benchmarks.md: TSP's peak against each layout at 128K, beside the paper's ratios."""
    rows = sim_rows(load, "simulate-7b")
    t = gib(sim(rows, "tsp", 131072))
    p = PAPER_128K
    lines = ["| TSP against | peak | TSP / it | paper |", "|---|---|---|---|"]
    for label, r, target, paper in (
            ("`tp`", sim(rows, "tp", 131072), 0.6,
             f"{p['tsp']} / {p['tp']} = {p['tsp'] / p['tp']:.2f}"),
            (None, best(rows, "tp+cp", 131072), 0.5,
             f"{p['tsp']} / {p['tp+cp']} = {p['tsp'] / p['tp+cp']:.2f}"),
            (None, best(rows, "tp-sp+cp", 131072), None, "-"),
            ("`tp-sp`", sim(rows, "tp-sp", 131072), None, "-"),
            ("`cp`", sim(rows, "cp", 131072), None, "-")):
        if label is None:
            label = f"best `{r['layout'][:r['layout'].index('(')]}` {mesh(r)}"
        ratio = t / gib(r)
        shown = f"**{ratio:.2f}** (target <= {target})" if target else f"{ratio:.2f}"
        lines.append(f"| {label} | {gib(r):.2f} GiB | {shown} | {paper} |")
    s = {k: gib(sim(rows, k, 16384)) for k in ("tsp", "tp", "tp-sp")}
    return ("\n".join(lines) + "\n\n" + para(
        f"At 16384 tokens model state dominates, as in the paper: TSP {s['tsp']:.2f} GiB, `tp` "
        f"{s['tp']:.2f} GiB ({s['tsp'] / s['tp']:.2f}), `tp-sp` {s['tp-sp']:.2f} GiB "
        f"({s['tsp'] / s['tp-sp']:.2f}); the paper found TSP 31.0 GB and TP 31.5 GB."))


def simulate_7b_none(load: Loader) -> str:
    """benchmarks.md: the table without activation checkpointing."""
    rows = sim_rows(load, "simulate-7b-none")
    a = {k: gib(sim(rows, k, 131072), "activations") for k in ("tsp", "tp-sp")}
    return (code(f"$ {command(load, 'simulate-7b-none')}\n" + sim_table(rows))
            + "\n" + para(f"Here `tp-sp` keeps {a['tp-sp'] / a['tsp']:.1f}x TSP's activations at "
                           "131072 tokens."))


PAPER_ACCOUNTING = (38.8, 70.0, 85.0, 140.0, 31.0, 31.5)  # TSP, TP, TP+SP x2 at 128K; TSP, TP 16K


def paper_accounting(load: Loader) -> str:
    """benchmarks.md: four accountings of ours against the paper's six per-GPU figures (GB)."""
    def figures(name: str, master: bool) -> list[float]:
        rows = sim_rows(load, name)

        def gb(r: dict) -> float:  # + 8 bytes per local bf16 parameter: fp32 master and moments
            extra = 4 * r["breakdown"].get("parameters", 0) if master else 0
            return (r["peak_bytes"] + extra) / GB
        big = sorted((r for r in rows if r["layout"].startswith("tp+cp(") and r["seq"] == 131072),
                     key=lambda r: r["peak_bytes"])  # the smaller first
        return [gb(sim(rows, "tsp", 131072)), gb(sim(rows, "tp", 131072)), *map(gb, big),
                gb(sim(rows, "tsp", 16384)), gb(sim(rows, "tp", 16384))]

    def fmt(values: list[float], bold: bool) -> str:
        err = [abs(v - p) / p for v, p in zip(values, PAPER_ACCOUNTING)]
        e = f"{100 * sum(err) / len(err):.0f}% / {100 * max(err):.0f}%"
        return (f"{values[0]:.1f} | {values[1]:.1f} | {values[2]:.1f} / {values[3]:.1f} | "
                f"{values[4]:.1f} | {values[5]:.1f} | " + (f"**{e}**" if bold else e))

    def against(ours: float, paper: float) -> str:
        return f"{100 * abs(ours - paper) / paper:.0f}% {'below' if ours < paper else 'above'}"

    p = PAPER_ACCOUNTING
    lines = ["| accounting | TSP 128K | TP 128K | TP+SP 128K | TSP 16K | TP 16K "
             "| mean / max error |",
             "|---|---|---|---|---|---|---|",
             f"| paper | {p[0]} | {p[1]} | {p[2]} / {p[3]} | {p[4]} | {p[5]} | |"]
    for label, name, master in (
            ("full recompute, bf16 AdamW (simulated)", "simulate-7b", False),
            ("**full recompute, fp32 master + moments**", "simulate-7b", True),
            ("no recompute, bf16 AdamW (simulated)", "simulate-7b-none", False),
            ("no recompute, fp32 master + moments", "simulate-7b-none", True)):
        bold = master and name == "simulate-7b"
        lines.append(f"| {label} | {fmt(figures(name, master), bold)} |")
    v = figures("simulate-7b", True)
    return ("\n".join(lines) + "\n\n" + para(
        "(TP+SP: our (2x4) and (4x2) `tp+cp` meshes, smaller first, against the paper's 85.0 / "
        "140.0; the paper does not say which of its meshes gave which.) Full recompute with "
        f"mixed-precision optimizer state comes closest: `tp` at 131072 tokens "
        f"{against(v[1], p[1])} ({v[1]:.1f} vs {p[1]} GB), TSP {against(v[0], p[0])} the paper's "
        f"{p[0]} GB, the 2-D layouts {against(v[2], p[2])} and {against(v[3], p[3])}. The "
        "paper's TSP figure is higher than ours by more than any transient we can account for "
        "(allocator caching, NCCL buffers and the optimizer step are not simulated), so our "
        f"TSP/TP ratio ({v[0] / v[1]:.2f} in this accounting) is better than the paper's "
        f"{p[0] / p[1]:.2f}; we report ours and do not tune toward theirs."))


def simulate_7b_1layer(load: Loader) -> str:
    """memory.md: the one-layer step's peak at both degrees."""
    rows = sim_rows(load, "simulate-7b-1layer")
    by_d = {r["degree"]: gib(r) for r in rows}
    return (para("The peak of the whole step is the sum of what was alive at one moment; at this "
                 "shape it falls in the attention's backward (a kernel call of one round, beside "
                 "one head group's gathered K/V and its float32 dK/dV), with every layer's saved "
                 "activations still alive (1 layer, 131072 tokens: "
                 + ", ".join(f"{v:.2f} GiB at D={d}" for d, v in sorted(by_d.items())) + ").")
            + "\nRun it yourself (about 20 s; the phases are in the JSON):\n\n"
            + code(command(load, "simulate-7b-1layer")))


def fsdp_table(rows: list[dict]) -> str:
    """The table ``tsp simulate --dp-shard`` prints (tsp_core/tools/cli.py), from its JSON."""
    from tsp_core.plan.fsdp_sim import FSDP_WORKING_SET

    head = (f"{'layout':<15} {'seq':>7} {'D':>3} {'dp':>3} {'GPUs':>5} {'peak GiB':>9} "
            + " ".join(f"{k[:11]:>11}" for k in KINDS) + f" {'fsdp':>11}")
    return "\n".join([head] + [
        f"{r['layout']:<15} {r['seq']:>7} {r['degree']:>3} {r['dp_shard']:>3} {r['gpus']:>5} "
        f"{gib(r):>9.2f} " + " ".join(f"{gib(r, k):>11.2f}" for k in KINDS)
        + f" {sum(r['breakdown'].get(k, 0) for k in FSDP_WORKING_SET) / GIB:>11.2f}"
        for r in rows])


def fsdp_row(rows: list[dict], layout: str, dp: int) -> dict | None:
    return next((r for r in rows if r["layout"] == layout and r["dp_shard"] == dp), None)


def simulate_70b_fsdp(load: Loader) -> str:
    """benchmarks.md: the Llama-2-70B table under FSDP2 and the peaks side by side."""
    rows = sim_rows(load, "simulate-70b-fsdp")
    out = ["| GPUs (8 x dp_shard) | dp_shard | TSP | tp-sp | TSP / tp-sp | tp "
           "| model state (both) |",
           "|---|---|---|---|---|---|---|"]
    for dp in sorted({r["dp_shard"] for r in rows}):
        t, sp, tp = (fsdp_row(rows, k, dp) for k in ("tsp", "tp-sp", "tp"))
        state = gib(t, "parameters") + gib(t, "optimizer_states")
        out.append(f"| {t['gpus']} | {dp} | {gib(t):.2f} | {gib(sp):.2f} | "
                   f"{gib(t) / gib(sp):.2f} | {f'{gib(tp):.2f}' if tp else '-'} | {state:.1f} |")
    return (code(f"$ {command(load, 'simulate-70b-fsdp')}\n" + fsdp_table(rows))
            + "\nPer-rank peaks side by side (GiB = 2^30 bytes):\n\n" + "\n".join(out) + "\n")


def simulate_deepseek_v3_128k(load: Loader) -> str:
    """benchmarks.md: DeepSeek-V3's whole model at 128K tokens under TSP and FSDP2, per rank."""
    rows = sim_rows(load, "simulate-deepseek-v3-128k")
    r = rows[0]
    state = gib(r, "parameters") + gib(r, "optimizer_states")
    return (code(f"$ {command(load, 'simulate-deepseek-v3-128k')}\n" + fsdp_table(rows))
            + "\n" + para(
                f"{gib(r):.2f} GiB per rank on {r['gpus']} GPUs ({r['degree']} x dp_shard "
                f"{r['dp_shard']}), {r['layers']} layers, {r['seq']:,} tokens: model state "
                f"(weights and AdamW's states) {state:.2f} GiB, the step's temporaries "
                f"{gib(r, 'temporaries'):.2f} GiB and the checkpointed activations "
                f"{gib(r, 'activations'):.2f} GiB. {r['seconds']:.0f} s of simulation.") + "\n")


# ------------------------------------------------------------------ tsp plan records

def plan_rows(load: Loader, name: str) -> list[dict]:
    return load(name)["output"]["ranking"]


def planner_check_7b(load: Loader) -> str:
    """planning.md: the planner's peaks against ``tsp simulate``'s, every layout at D=8."""
    rows = sim_rows(load, "simulate-7b")
    plans = {16384: plan_rows(load, "plan-7b-16k"), 131072: plan_rows(load, "plan-7b-paper")}
    out = ["| layout | tokens | `tsp simulate` GiB | planner GiB | error | planner's peak moment |",
           "|---|---|---|---|---|---|"]
    for r in rows:
        p = next(c for c in plans[r["seq"]] if c["label"] == r["layout"] and c["degree"] == 8
                 and c["dp_shard"] == 1)
        s = gib(r)
        out.append(f"| {r['layout']} | {r['seq']} | {s:.2f} | {p['memory_gib']:.2f} | "
                   f"{100 * (p['memory_gib'] - s) / s:+.1f}% | {p['peak_moment']} |")
    return "\n".join(out) + "\n"


def planner_check_70b(load: Loader) -> str:
    """planning.md: the planner's peaks against ``tsp simulate --dp-shard``'s (Llama-2-70B, D=8)."""
    rows = sim_rows(load, "simulate-70b-fsdp")
    plans = plan_rows(load, "plan-70b")
    out = ["| layout | dp_shard | GPUs | `tsp simulate` GiB | planner GiB | error | planner's peak "
           "moment |", "|---|---|---|---|---|---|---|"]
    order = ("tsp", "tp", "tp-sp")
    for r in sorted(rows, key=lambda r: (order.index(r["layout"]), r["dp_shard"])):
        p = next(c for c in plans if c["label"] == r["layout"] and c["degree"] == 8
                 and c["dp_shard"] == r["dp_shard"])
        s = gib(r)
        out.append(f"| {r['layout']} | {r['dp_shard']} | {r['gpus']} | {s:.2f} | "
                   f"{p['memory_gib']:.2f} | {100 * (p['memory_gib'] - s) / s:+.1f}% | "
                   f"{p['peak_moment']} |")
    return "\n".join(out) + "\n"


MOE_SECTION = ("planning.md#mixture-of-experts-mixtral-8x7b-qwen3-30b-a3b-any-mixtral--qwen3-moe"
               "-config")
MOE = (("Mixtral-8x7B", 32, "simulate-mixtral-128k", "plan-mixtral-128k"),
       ("Qwen3-30B-A3B", 48, "simulate-qwen3-moe-128k", "plan-qwen3-moe-128k"))


def planner_check_moe(load: Loader) -> str:
    """planning.md: the planner's peaks against ``tsp simulate``'s for the whole MoE models at
    128K tokens (D=8)."""
    out = ["| model | layers | tokens | layout | `tsp simulate` GiB | planner GiB | error | "
           "planner's peak moment |", "|---|---|---|---|---|---|---|---|"]
    for model, layers, simulated, planned in MOE:
        plans = plan_rows(load, planned)
        for r in sim_rows(load, simulated):
            p = next(c for c in plans if c["label"] == r["layout"] and c["degree"] == 8
                     and c["dp_shard"] == 1)
            s = gib(r)
            out.append(f"| {model} | {layers} | {r['seq']} | {r['layout']} | {s:.2f} | "
                       f"{p['memory_gib']:.2f} | {100 * (p['memory_gib'] - s) / s:+.1f}% | "
                       f"{p['peak_moment']} |")
    return "\n".join(out) + "\n"


def simulate_mixtral_128k(load: Loader) -> str:
    """moe.md: the Mixtral-8x7B simulation at 128K tokens and TSP's share of the others' peaks."""
    rows = sim_rows(load, "simulate-mixtral-128k")
    g = {r["layout"]: gib(r) for r in rows}
    return (code(f"$ {command(load, 'simulate-mixtral-128k')}\n" + sim_table(rows)) + "\n"
            + para(f"TSP's peak is {g['tsp'] / g['tp']:.2f} of `tp`'s and "
                   f"{g['tsp'] / g['tp-sp']:.2f} of `tp-sp`'s; the planner's estimates beside "
                   f"these: [planning.md]({MOE_SECTION})."))


def simulate_qwen3_moe_128k(load: Loader) -> str:
    """moe.md: Qwen3-30B-A3B's TSP peak at 128K tokens, in one sentence."""
    r = sim(sim_rows(load, "simulate-qwen3-moe-128k"), "tsp", 131072)
    return para(f"Qwen3-30B-A3B (48 layers, 128K, D = 8): {gib(r):.2f} GiB "
                f"(`{command(load, 'simulate-qwen3-moe-128k')}`).")


def plan_table(load: Loader, name: str, top: int) -> str:
    """What ``tsp plan`` prints (tsp_core/plan/command.py), from its JSON, as a table."""
    d = load(name)["output"]
    out = [f"$ {command(load, name)}",
           f"{'#':>3} {'layout':<15} {'D':>3} {'GiB/GPU':>8} {'fits':>4} {'replicas':>8} "
           f"{'tokens/s':>10} {'step s':>7} {'comm s':>7}  links"]
    for i, c in enumerate(d["ranking"][:top], 1):
        links = ", ".join(f"{k} {v}" for k, v in c["links"].items() if v != "none")
        rep = (f"{c['active_replicas']}/{c['replicas']}" if c["active_replicas"] < c["replicas"]
               else str(c["replicas"]))
        out.append(f"{i:>3} {c['label']:<15} {c['degree']:>3} {c['memory_gib']:>8.1f} "
                   f"{'yes' if c['fits'] else 'NO':>4} {rep:>8} {c['tokens_per_s']:>10.3g} "
                   f"{c['step_s']:>7.2f} {c['exposed_comm_s']:>7.2f}  {links}")
    out += [f"cannot run: {line}" for line in d["cannot_run"]]
    b = d["choice"]
    out.append(f"choice: {b['label']} at D={b['degree']} x {b['replicas']} replicas: fits "
               f"({b['memory_gib']:.1f} GiB), highest predicted tokens/s "
               f"({b['tokens_per_s']:.3g}); {b['exposed_comm_s']:.2f} s of {b['step_s']:.2f} s "
               f"per step is exposed communication")
    out += [f"predicted {k}: {v:.2f}x (paper, matched TP+SP: {d['paper']['tsp_vs_matched_tp_sp']})"
            for k, v in d["ratios"].items()]
    return code("\n".join(out))


def plan_7b_paper(load: Loader) -> str:
    """planning.md "The paper's setting": the ranking and what it predicts against the others."""
    d = load("plan-7b-paper")["output"]
    ranking, ratios = d["ranking"], d["ratios"]

    def top(layout: str, degree: int) -> dict:
        return max((c for c in ranking if c["layout"] == layout and c["degree"] == degree),
                   key=lambda c: c["tokens_per_s"])
    tsp = top("tsp", 8)
    two_d = next(k for k in ratios if "tp+cp" in k)
    one_d = next(k for k in ratios if "tp-sp on" in k)
    best2 = top("tp+cp", 16)
    split = next(c for c in ranking if c["label"] == "tp+cp(8x2)")
    cp = top("cp", 8)
    gap = abs(tsp["tokens_per_s"] - cp["tokens_per_s"]) / cp["tokens_per_s"]
    return (plan_table(load, "plan-7b-paper", 30) + "\n" + para(
            f"The model gives TSP D=8 {ratios[two_d]:.2f}x the best tp+cp on 16 GPUs "
            f"({best2['label'][len('tp+cp'):].strip('()')}; "
            f"{tsp['tokens_per_s'] / split['tokens_per_s']:.1f}x the paper's split, TP 8 x SP 2) "
            f"and {ratios[one_d]:.2f}x tp-sp on 8 GPUs. The paper reports 2.0-2.6x against "
            "matched TP+SP for *forward* throughput with its own kernels; the model predicts "
            "training steps, no constant was set to reproduce that ratio. TSP and cp at D=8 are "
            f"{100 * gap:.1f}% apart: both expose the same K/V volume and the model hides TSP's "
            "weight traffic; if the prefetch hides less than the model assumes, cp wins."))


# ------------------------------------------------------------------ tsp bench records

def bench_small_d2(load: Loader) -> str:
    """benchmarks.md: the CPU bench table, as ``tsp bench`` prints it, and the figures quoted."""
    from tsp_core.tools import bench

    rec = load("bench-small-d2")["output"]
    rs = [bench.BenchRecord(**r) for r in rec["records"]]
    by = {(r.layout, r.seq): r for r in rs}
    seqs = sorted({r.seq for r in rs})
    lo, hi = seqs[0], seqs[-1]
    mib = {k: r.layer_forward_bytes / MIB for k, r in by.items()}
    fwd = ", ".join(f"{mib[('tsp', s)]:.1f} vs {mib[('tp', s)]:.1f} at {s}" for s in seqs)
    t_hi, sp_hi = by[("tsp", hi)], by[("tp-sp", hi)]
    peak = max(t_hi.peak_bytes) / max(sp_hi.peak_bytes)
    ran = {r.name for r in rs}
    skipped = [f"skipped {n}: degree {rs[0].degree} has no split T x S with T and S > 1"
               for n in rec["config"]["layouts"].split(",") if n not in ran]
    return (code("\n".join([f"$ {command(load, 'bench-small-d2')}", *skipped, bench.table(rs)]))
            + "\n" + para(
                f"In this run (MiB per layer forward, TSP vs `tp`): {fwd}. Whole step at {hi} "
                f"tokens: TSP {t_hi.step_bytes / MIB:.0f} MiB, `tp-sp` "
                f"{sp_hi.step_bytes / MIB:.0f}. TSP's wait: "
                f"{100 * by[('tsp', lo)].wait_fraction:.1f}% at {lo} tokens, "
                f"{100 * t_hi.wait_fraction:.1f}% at {hi}. Peak per rank at {hi} tokens: TSP "
                f"{max(t_hi.peak_bytes) / MIB:.0f} MiB, `tp-sp` {max(sp_hi.peak_bytes) / MIB:.0f} "
                f"({100 * peak:.0f}%)."))


def llama8b_fit(r: dict, gpu_gb: int) -> tuple[float, bool, float, bool]:
    """(the GPU limit, offloaded, host bytes per node, fits) of a Llama-3.1-8B row: a GPU peak of
    at most 90% of the GPU's memory and at most 1.5 TiB of host memory per 8-GPU node."""
    limit = 0.9 * gpu_gb * GB
    offload = bool(r.get("activation_offload"))
    host = r.get("host_bytes", 0) * min(8, r["degree"])
    return limit, offload, host, r["peak_bytes"] <= limit and host <= 1.5 * 2**40


def long_context_llama8b(load: Loader) -> str:
    """long-context.md: TSP's measured rows for Llama-3.1-8B (whole model, full recompute, bf16
    AdamW), each against 90% of its GPU's memory and 1.5 TiB of host memory per 8-GPU node."""
    lines = ["| GPUs | tokens | offload | GPU peak GiB | of the limit (90% of the GPU) | "
             "host GiB per node | fits |",
             "|---|---|---|---|---|---|---|"]
    cmds = []
    for name, gpu_gb in LONG_CONTEXT_RECORDS:
        (r,) = sim_rows(load, name)
        limit, offload, host, fits = llama8b_fit(r, gpu_gb)
        lines.append(f"| {r['degree']} x {gpu_gb} GB | {r['seq']:,} | "
                     f"{'yes' if offload else 'no'} | {gib(r):.2f} | "
                     f"{r['peak_bytes'] / limit:.1%} | {host / GIB:.0f} | "
                     f"{'yes' if fits else 'no'} |")
        cmds.append(command(load, name))
    return "\n".join(lines) + "\n\nThe commands:\n\n" + code("\n".join(cmds))


def long_context_llama8b_lora(load: Loader) -> str:
    """long-context.md: the longest Llama-3.1-8B sequence with LoRA (bf16 base, float32 adapters)
    and QLoRA (the base's projections NF4) on 8 x 80 GB, without and with offload, beside full
    fine-tuning's rows at the same GPUs."""
    lines = ["| fine-tuning | offload | tokens | GPU peak GiB | of the limit (90% of the GPU) | "
             "host GiB per node | weights GiB | gradients GiB | optimizer states GiB | "
             "activations GiB | fits |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    cmds = []
    for name, r in ((n, r) for n in LORA_RECORDS for r in sim_rows(load, n)):
        limit, offload, host, fits = llama8b_fit(r, 80)
        lines.append(f"| {tuning(r)} | {'yes' if offload else 'no'} | {r['seq']:,} | "
                     f"{gib(r):.2f} | {r['peak_bytes'] / limit:.1%} | {host / GIB:.0f} | "
                     f"{weights(r) / GIB:.2f} | {gib(r, 'gradients'):.2f} | "
                     f"{gib(r, 'optimizer_states'):.2f} | {gib(r, 'activations'):.2f} | "
                     f"{'yes' if fits else 'no'} |")
        if r.get("lora") and command(load, name) not in cmds:
            cmds.append(command(load, name))
    kinds = "LoRA and QLoRA" if any("--qlora" in c.split() for c in cmds) else "LoRA"
    return ("\n".join(lines) + "\n\n" + lora_note(load) + f"\nThe {kinds} commands:\n\n"
            + code("\n".join(cmds)))


def tuning(r: dict) -> str:
    """A row's fine-tuning: full, LoRA r=R or QLoRA r=R."""
    if not r.get("lora"):
        return "full"
    return f"{'QLoRA' if r.get('qlora') else 'LoRA'} r={r['lora']}"


def weights(r: dict) -> int:
    """A row's resident weights: its parameters and buffers (QLoRA's NF4 shards are buffers)."""
    return r["breakdown"]["parameters"] + r["breakdown"].get("buffers", 0)


def lora_note(load: Loader) -> str:
    """The LoRA and QLoRA rows against full fine-tuning's, in words: each fine-tuning's longest
    fitting row, without offload and with it, and why the next length does not fit (a simulated
    row that does not, or, bound by the host, the host bytes one step more would take)."""
    rows = [r for n in LORA_RECORDS for r in sim_rows(load, n)]

    def longest(kind: str, offload: bool) -> tuple[dict, str] | None:
        mine = sorted((r for r in rows if tuning(r).split()[0] == kind
                       and bool(r.get("activation_offload")) == offload), key=lambda r: r["seq"])
        fit = [r for r in mine if llama8b_fit(r, 80)[3]]
        if not fit:
            return None
        fit = fit[-1]
        over = next((r for r in mine if r["seq"] > fit["seq"]), None)
        if over is not None:
            return fit, f"{over['seq']:,} does not"
        step, host = 2 * fit["degree"], llama8b_fit(fit, 80)[2]
        more = host / fit["seq"] * (fit["seq"] + step) - 1.5 * 2**40
        return fit, (f"bound by the host: its layer inputs take {host / GIB:,.0f} GiB per node, "
                     f"and {fit['seq'] + step:,} tokens, one step more, would take "
                     f"{more / MIB:,.0f} MiB more than 1.5 TiB")

    def per_token(r: dict) -> str:
        return f"{r['breakdown']['activations'] / r['seq']:,.0f}"

    def temps(r: dict) -> int:
        return r["breakdown"]["temporaries"]

    (fo, _), (lo, lo_why) = longest("full", False), longest("LoRA", False)
    text = (
        f"Without offload LoRA fits {lo['seq']:,} tokens ({lo_why}), "
        f"{lo['seq'] / fo['seq'] - 1:+.1%} against full fine-tuning's {fo['seq']:,} (searched "
        f"in steps of 131,072 tokens): the AdamW states shrink from "
        f"{gib(fo, 'optimizer_states'):.2f} to {gib(lo, 'optimizer_states'):.2f} GiB per rank, "
        f"while the activations, most of the peak, take {per_token(lo)} bytes per token of the "
        f"sequence against full fine-tuning's {per_token(fo)}.")
    if found := longest("QLoRA", False):
        qo, qo_why = found
        text += (f" QLoRA fits {qo['seq']:,} tokens ({qo_why}), "
                 f"{qo['seq'] / lo['seq'] - 1:+.1%} against LoRA: its weights take "
                 f"{weights(qo) / GIB:.2f} GiB per rank against LoRA's {weights(lo) / GIB:.2f} "
                 f"(the base's projections as NF4 shards: "
                 f"{qo['breakdown'].get('buffers', 0) / GIB:.2f} GiB).")
    (full, _), (lw, why) = longest("full", True), longest("LoRA", True)
    limit = llama8b_fit(lw, 80)[0]
    text += (f" With offload LoRA fits {lw['seq']:,} tokens ({why}; full fine-tuning: "
             f"{full['seq']:,}, bound by the GPU), its GPU peak {gib(lw):.2f} GiB, "
             f"{lw['peak_bytes'] / limit:.1%} of the limit, with {per_token(lw)} bytes of "
             f"activations per token of the sequence (full fine-tuning: {per_token(full)}).")
    if found := longest("QLoRA", True):
        (qw, _) = found
        text += (f" QLoRA with offload fits {qw['seq']:,} tokens too, bound by the host alike, "
                 f"its GPU peak {gib(qw):.2f} GiB ({qw['peak_bytes'] / limit:.1%}), "
                 f"{(lw['peak_bytes'] - qw['peak_bytes']) / GIB:.2f} GiB below LoRA's: its "
                 f"weights take {weights(qw) / GIB:.2f} GiB against LoRA's "
                 f"{weights(lw) / GIB:.2f} (the NF4 shards "
                 f"{qw['breakdown'].get('buffers', 0) / GIB:.2f}), and its temporaries at the "
                 f"peak {(temps(lw) - temps(qw)) / MIB:.0f} MiB less.")
    return para(text)


# LoRA's and QLoRA's rows and full fine-tuning's beside them on 8 x 80 GB, without offload, then
# with it (long_context_llama8b_lora)
LORA_RECORDS = ("simulate-llama8b-1.5m", "simulate-llama8b-lora16-1.55m",
                "simulate-llama8b-qlora16-1.7m", "simulate-llama8b-5.75m-offload",
                "simulate-llama8b-lora16-6m-offload", "simulate-llama8b-qlora16-6m-offload")


# the records behind long_context_llama8b, in the table's order, with their GPU's memory (GB)
LONG_CONTEXT_RECORDS = (("simulate-llama8b-4m-offload", 80),
                        ("simulate-llama8b-5.75m-offload", 80),
                        ("simulate-llama8b-1.5m", 80),
                        ("simulate-llama8b-16m-offload", 80),
                        ("simulate-llama8b-6m-offload", 141),
                        ("simulate-llama8b-2.75m", 141))


def grpo_llama8b(load: Loader) -> str:
    """trl.md: one GRPO step of Llama-3.1-8B (8 rows of a 512-token prompt and a 32,768-token
    completion, full recompute, bf16 AdamW) per layout: the step's peak and its parts, the
    plain training step's peak at the same shape, and the rollout's computed peak, each against
    90% of an 80 GB GPU."""
    grpo = sim_rows(load, "simulate-llama8b-grpo-32k")
    train = {(r["layout"], r["degree"]): r for r in sim_rows(load, "simulate-llama8b-train-32k")}
    limit = 0.9 * 80 * GB
    lines = ["| layout | GPUs | GRPO step peak GiB | policy + reference parameters | gradients "
             "| optimizer states | activations | temporaries | plain step peak GiB | "
             "rollout GiB (computed) | fits 80 GB (step, rollout) |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    label = {("tp-sp", 1): "one GPU: the Hugging Face model (`tp-sp` at D = 1)",
             ("tsp", 1): "one GPU: TSP's code (`tsp` at D = 1)"}
    for r in sorted(grpo, key=lambda r: (r["degree"], r["layout"] != "tp-sp")):
        t = train[(r["layout"], r["degree"])]
        params = gib(r, "parameters")
        ref = r["reference_bytes"] / GIB
        fits = ", ".join("yes" if b <= limit else "no"
                         for b in (r["peak_bytes"], r["rollout_bytes"]))
        name = label.get((r["layout"], r["degree"]), f"`{r['layout']}`")
        lines.append(f"| {name} | {r['degree']} | {gib(r):.2f} | "
                     f"{params - ref:.2f} + {ref:.2f} | {gib(r, 'gradients'):.2f} | "
                     f"{gib(r, 'optimizer_states'):.2f} | {gib(r, 'activations'):.2f} | "
                     f"{gib(r, 'temporaries'):.2f} | {gib(t):.2f} | "
                     f"{r['rollout_bytes'] / GIB:.2f} | {fits} |")
    cmds = [command(load, n) for n in ("simulate-llama8b-grpo-32k", "simulate-llama8b-train-32k")]
    tsp, sp = (next(r for r in grpo if r["layout"] == n and r["degree"] == 8)
               for n in ("tsp", "tp-sp"))
    added = (tsp["peak_bytes"] - train[("tsp", 8)]["peak_bytes"]) / GIB
    logits = sp["batch"] * sp["seq"] * -(-128256 // sp["degree"]) * 4 / GIB
    one = next(r for r in grpo if r["layout"] == "tsp" and r["degree"] == 1)
    resident = (gib(one, "parameters") + gib(one, "optimizer_states")
                + gib(one, "buffers"))
    kv = one["rollout_bytes"] / GIB - resident
    note = para(
        f"On 8 GPUs the GRPO step adds {added:.2f} GiB to TSP's plain step, the reference's "
        f"{tsp['reference_bytes'] / GIB:.2f} GiB of parameters and its per-token "
        f"log-probabilities; the rollout needs {tsp['rollout_bytes'] / GIB:.2f} GiB. `tp-sp` "
        f"holds the same parameters and optimizer states, but its Hugging Face head makes the "
        f"float32 logits of all {sp['batch']} x {sp['seq']:,} tokens over its 1/{sp['degree']} "
        f"of the vocabulary ({logits:.1f} GiB each copy), which TSP's tiled head never does: "
        f"its step peaks at {gib(sp):.2f} GiB, over an 80 GB GPU. That is `tp-sp` as TRL would "
        f"run it, with the Hugging Face head. A `tp-sp` run whose head computed the "
        f"log-probabilities a chunk of tokens at a time would not hold those logits, and would "
        f"need less; that is not simulated here. One GPU holds neither the "
        f"step nor the rollout: the two models and the AdamW states are {resident:.2f} GiB "
        f"there, the rollout's KV cache {kv:.1f} GiB more.")
    return ("\n".join(lines) + "\n\n" + note + "\nThe commands:\n\n"
            + code("\n".join(cmds)))


RENDERERS: dict[str, Callable[[Loader], str]] = {
    "simulate-7b": simulate_7b,
    "simulate-7b-summary": simulate_7b_summary,
    "simulate-7b-full": simulate_7b_full,
    "simulate-7b-ratios": simulate_7b_ratios,
    "simulate-7b-none": simulate_7b_none,
    "paper-accounting": paper_accounting,
    "simulate-7b-1layer": simulate_7b_1layer,
    "planner-check-7b": planner_check_7b,
    "simulate-70b-fsdp": simulate_70b_fsdp,
    "planner-check-70b": planner_check_70b,
    "plan-7b-paper": plan_7b_paper,
    "bench-small-d2": bench_small_d2,
    "planner-check-moe": planner_check_moe,
    "simulate-mixtral-128k": simulate_mixtral_128k,
    "simulate-qwen3-moe-128k": simulate_qwen3_moe_128k,
    "long-context-llama8b": long_context_llama8b,
    "grpo-llama8b": grpo_llama8b,
    "long-context-llama8b-lora": long_context_llama8b_lora,
    "simulate-deepseek-v3-128k": simulate_deepseek_v3_128k,
}


# ------------------------------------------------------------------ figures

# What other systems publish for Llama-3.1-8B on H100 80 GB GPUs, all with activation checkpoints
# offloaded to host memory: (system, source, ((GPUs, tokens), ...)), as docs/long-context.md cites
# them. UPipe is not here: no number with a public source was found for this setting.
PUBLISHED = (("ALST", "arXiv 2506.13996", ((8, 3_700_000), (32, 15_000_000))),
             ("TRL", "TRL documentation, context parallelism", ((8, 1_000_000),)))
FIGURES_DIR = "img/records"  # under docs/: each figure is FIGURES_DIR/NAME.png


def memory_7b_d8(load: Loader) -> dict:
    """memory.md: every layout's per-rank peak against the sequence length (7B, D = 8)."""
    rows = sim_rows(load, "simulate-7b")
    series = [{"label": label, "kind": "ours",
               "points": [[r["seq"], gib(r)] for r in sorted(
                   (r for r in rows if r["layout"] == label), key=lambda r: r["seq"])]}
              for label in dict.fromkeys(r["layout"] for r in rows)]
    return {"title": "7B, D = 8, full recompute, bf16 AdamW: per-rank peak (tsp simulate; "
                     "lines join the simulated lengths)",
            "xlabel": "sequence length (tokens)", "ylabel": "peak GiB per rank",
            "records": ["simulate-7b"], "series": series}


def longest_context_llama8b(load: Loader) -> dict:
    """long-context.md: TSP's longest fitting Llama-3.1-8B sequence on 80 GB GPUs against the GPU
    count (tsp simulate), beside the points ALST and TRL publish (labelled as theirs)."""
    best: dict[bool, dict[int, int]] = {}
    names = [name for name, gpu_gb in LONG_CONTEXT_RECORDS if gpu_gb == 80]
    for name in names:
        (r,) = sim_rows(load, name)
        _, offload, _, fits = llama8b_fit(r, 80)
        if fits:
            at = best.setdefault(offload, {})
            at[r["degree"]] = max(at.get(r["degree"], 0), r["seq"])
    series = [{"label": f"TSP, {'with' if off else 'without'} offload (tsp simulate)",
               "kind": "ours", "points": [[g, q] for g, q in sorted(best[off].items())]}
              for off in sorted(best, reverse=True)]
    series += [{"label": f"published by {system} ({source}), with offload", "kind": "published",
                "points": [list(p) for p in points]} for system, source, points in PUBLISHED]
    return {"title": "Llama-3.1-8B on H100 80 GB: the longest sequence that fits",
            "xlabel": "GPUs", "ylabel": "tokens", "xlog": 2, "ylog": 2, "records": names,
            "series": series}


def crossover(a: list[list[float]], b: list[list[float]]) -> float | None:
    """The first length where ``a`` stops being above ``b`` (piecewise linear between the shared
    lengths), or None when it never does."""
    pts = [(x, ya - yb) for (x, ya), (_, yb) in zip(a, b)]
    for (x0, d0), (x1, d1) in zip(pts, pts[1:]):
        if d0 > 0 >= d1:
            return x0 + (x1 - x0) * d0 / (d0 - d1)
    return None


def layer_bytes_small_d2(load: Loader) -> dict:
    """benchmarks.md: bytes moved per layer forward against the sequence length, TSP vs tp-sp,
    measured by tsp bench, and the length where TSP starts moving fewer."""
    recs = load("bench-small-d2")["output"]["records"]
    series = [{"label": f"{label} (tsp bench)", "kind": "ours",
               "points": [[r["seq"], r["layer_forward_bytes"] / MIB] for r in sorted(
                   (r for r in recs if r["layout"] == label), key=lambda r: r["seq"])]}
              for label in ("tsp", "tp-sp")]
    return {"title": "small Llama, D = 2: bytes moved per layer forward (tsp bench)",
            "xlabel": "sequence length (tokens)", "ylabel": "MiB per layer forward", "xlog": 2,
            "records": ["bench-small-d2"], "series": series,
            "crossover": crossover(series[0]["points"], series[1]["points"])}


FIGURES: dict[str, Callable[[Loader], dict]] = {
    "memory-7b-d8": memory_7b_d8,
    "longest-context-llama8b": longest_context_llama8b,
    "layer-bytes-small-d2": layer_bytes_small_d2,
}


def draw(data: dict) -> bytes:
    """The PNG of a figure's data; the data rides in its ``Description`` text, so a test (and
    ``--check``) can compare a PNG with its records without comparing pixels."""
    import io

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    for s in data["series"]:
        xs, ys = zip(*s["points"])
        ours = s["kind"] == "ours"
        ax.plot(xs, ys, marker="o" if ours else "D", linestyle="-" if ours else ":",
                markersize=6 if ours else 8, fillstyle="full" if ours else "none",
                label=s["label"])
    if data.get("crossover"):
        ax.axvline(data["crossover"], color="grey", linestyle="--", linewidth=1,
                   label=f"crossover: {data['crossover']:.0f} tokens")
    if data.get("xlog"):
        ax.set_xscale("log", base=data["xlog"])
    if data.get("ylog"):
        ax.set_yscale("log", base=data["ylog"])
    ax.set(title=data["title"], xlabel=data["xlabel"], ylabel=data["ylabel"])
    ax.title.set_fontsize(10)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    out = io.BytesIO()
    fig.savefig(out, format="png", dpi=100,
                metadata={"Software": None, "Description": json.dumps(data, sort_keys=True)})
    plt.close(fig)
    return out.getvalue()


def figure_data(png: Path) -> dict | None:
    """The data a PNG written by :func:`draw` was drawn from (None for any other file)."""
    from PIL import Image

    with Image.open(png) as im:
        text = getattr(im, "text", {}).get("Description")
    return json.loads(text) if text else None


def figure_path(name: str, root: Path = ROOT) -> Path:
    return root / "docs" / FIGURES_DIR / f"{name}.png"


def check_figures(load: Loader, root: Path = ROOT) -> list[str]:
    """The figures whose PNG is missing or was drawn from other numbers than the records hold."""
    stale = []
    for name, make in FIGURES.items():
        path = figure_path(name, root)
        now = json.loads(json.dumps(make(load), sort_keys=True))
        if not path.exists() or figure_data(path) != now:
            stale.append(f"{path.relative_to(root)} differs from what docs/records draw")
    return stale


def draw_figures(load: Loader, root: Path = ROOT) -> list[Path]:
    """Write every figure whose PNG differs from what the records draw."""
    changed = []
    for name in [s.split(" ")[0] for s in check_figures(load, root)]:
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(draw(FIGURES[path.stem](load)))
        changed.append(path)
    return changed


# ------------------------------------------------------------------ rendering and checking

def render_text(text: str, load: Loader, where: str = "") -> str:
    """``text`` with every record block regenerated."""
    def one(m: re.Match) -> str:
        name = m.group(1)
        if name not in RENDERERS:
            raise SystemExit(f"{where}: unknown record block {name!r}; known: "
                             f"{', '.join(sorted(RENDERERS))}")
        return f"<!-- record: {name} -->\n{RENDERERS[name](load)}<!-- /record -->"
    return BLOCK.sub(one, text)


def check(paths: list[Path], load: Loader) -> list[str]:
    """The unified diffs of the docs whose blocks differ from what the records render."""
    diffs = []
    for path in paths:
        text = path.read_text(encoding="utf-8")
        new = render_text(text, load, str(path))
        if new != text:
            diffs.append("".join(difflib.unified_diff(
                text.splitlines(True), new.splitlines(True), f"{path} (in the doc)",
                f"{path} (rendered from docs/records)")))
    return diffs


def render(paths: list[Path], load: Loader) -> list[Path]:
    changed = []
    for path in paths:
        text = path.read_text(encoding="utf-8")
        new = render_text(text, load, str(path))
        if new != text:
            path.write_text(new, encoding="utf-8")
            changed.append(path)
    return changed


def run_command(cmd: str) -> dict:
    """Run a record's ``tsp`` command (its ``--json`` into a temporary file) and return the JSON."""
    argv = shlex.split(cmd)
    if argv[0] != "tsp" or "--json" not in argv:
        raise ValueError(f"a record's command is `tsp ... --json FILE`, got {cmd!r}")
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "out.json"
        argv[argv.index("--json") + 1] = str(out)
        tsp = Path(sys.executable).with_name("tsp")
        subprocess.run([str(tsp) if tsp.exists() else "tsp", *argv[1:]], check=True,
                       env={"OMP_NUM_THREADS": "1", **os.environ})
        return json.loads(out.read_text(encoding="utf-8"))


def write_record(name: str, cmd: str, output: dict | list, records: Path = RECORDS) -> Path:
    path = records / f"{name}.json"
    path.write_text(json.dumps({"command": cmd, "output": output}, indent=1) + "\n",
                    encoding="utf-8")
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true",
                        help="change nothing; exit 1 and print the diff where a block differs")
    parser.add_argument("--rerun", nargs="+", metavar="NAME",
                        help="run these records' commands again and rewrite the records first")
    args = parser.parse_args(argv)
    for name in args.rerun or []:
        cmd = loader()(name)["command"]
        print(f"{name}: {cmd}", file=sys.stderr)
        write_record(name, cmd, run_command(cmd))
    if args.check:
        diffs = check(pages(), loader()) + check_figures(loader())
        for d in diffs:
            print(d)
        return 1 if diffs else 0
    for path in render(pages(), loader()) + draw_figures(loader()):
        print(f"rendered {path.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
