"""The figures of docs/memory.md, docs/long-context.md and docs/benchmarks.md are drawn from the
records in docs/records/ (docs/scripts/render_records.py ``FIGURES``), by the docs build
(docs/hooks.py) and into the copies in docs/img/records/, which carry the numbers they were drawn
from. Each figure's numbers are computed again here from the record's JSON, apart from the
script; the published points against the table docs/long-context.md cites them in; a stale copy
is seen; and the build's hook draws from the records, not from the copy in docs/."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from tests.support import launch

ROOT = Path(__file__).resolve().parents[2]
RECORDS = ROOT / "docs" / "records"
SCRIPT = ROOT / "docs" / "scripts" / "render_records.py"
GIB, MIB = 2**30, 2**20


@pytest.fixture(scope="module")
def records():
    return launch.load_script(SCRIPT, "render_records")


def output(name: str):
    return json.loads((RECORDS / f"{name}.json").read_text(encoding="utf-8"))["output"]


def series(data: dict) -> dict[str, list[list[float]]]:
    return {s["label"]: s["points"] for s in data["series"]}


def test_the_memory_figure_is_every_layouts_simulated_peak(records):
    data = records.memory_7b_d8(records.loader())
    want: dict[str, list[list[float]]] = {}
    for r in sorted(output("simulate-7b"), key=lambda r: r["seq"]):
        assert r["degree"] == 8 and r["model"] == "7b"
        want.setdefault(r["layout"], []).append([r["seq"], r["peak_bytes"] / GIB])
    assert series(data) == want and len(want) == 8, series(data)


def test_the_longest_context_figure_is_ours_beside_theirs(records):
    data = records.longest_context_llama8b(records.loader())
    ours: dict[bool, dict[int, int]] = {True: {}, False: {}}
    for r in (r for path in RECORDS.glob("simulate-llama8b-*.json") for r in output(path.stem)):
        if r["layout"] != "tsp" or r["batch"] != 1 or r.get("lora") or r.get("step") == "grpo":
            continue  # the figure is full fine-tuning of one sequence
        host = r.get("host_bytes", 0) * min(8, r["degree"])
        if r["peak_bytes"] <= 0.9 * 80e9 and host <= 1.5 * 2**40:  # fits 80 GB, whatever row
            at = ours[bool(r.get("activation_offload"))]
            at[r["degree"]] = max(at.get(r["degree"], 0), r["seq"])
    got = series(data)
    assert got["TSP, with offload (tsp simulate)"] == [[8, 6_029_312], [32, 16_777_216]]
    assert got["TSP, without offload (tsp simulate)"] == [[8, 1_572_864]]
    for offload, label in ((True, "with"), (False, "without")):
        want = sorted(map(list, ours[offload].items()))
        assert got[f"TSP, {label} offload (tsp simulate)"] == want
    # theirs: labelled as published, with the source, the numbers of docs/long-context.md's table
    table = (ROOT / "docs" / "long-context.md").read_text(encoding="utf-8")
    cited = [(system, int(gpus), float(m) * 1e6) for system, gpus, m in re.findall(
        r"^\| (ALST|TRL) \| (\d+) x H100 80 GB \| ([\d.]+)M tokens \|", table, re.M)]
    theirs = [s for s in data["series"] if s["kind"] == "published"]
    drawn = [(s["label"].split()[2], g, q) for s in theirs for g, q in s["points"]]
    assert sorted(drawn) == sorted(cited) and len(cited) == 3, (drawn, cited)
    assert all(s["label"].startswith("published by ") for s in theirs)
    assert all(s["label"].startswith("TSP") for s in data["series"] if s["kind"] == "ours")


def test_the_bytes_figure_crosses_where_the_formula_says(records):
    data = records.layer_bytes_small_d2(records.loader())
    recs = output("bench-small-d2")["records"]
    for label in ("tsp", "tp-sp"):
        want = sorted([r["seq"], r["layer_forward_bytes"] / MIB]
                      for r in recs if r["layout"] == label)
        assert series(data)[f"{label} (tsp bench)"] == want
    # docs/benchmarks.md: equal at B*S = (W_att + W_mlp) / ((4 - 2/g) h) = 16 h^2 / 2h for `small`
    # (h 256, g 1, F 4h)
    h = 256
    assert data["crossover"] == (4 * h * h + 3 * h * 4 * h) / ((4 - 2) * h) == 2048


def test_the_copies_carry_the_records_numbers_and_a_stale_one_is_seen(records, tmp_path):
    load = records.loader()
    assert records.check_figures(load) == [], "run python docs/scripts/render_records.py"
    for name, make in records.FIGURES.items():
        assert records.figure_data(records.figure_path(name)) == json.loads(json.dumps(make(load)))
    stale = json.loads(json.dumps(records.memory_7b_d8(load)))
    stale["series"][0]["points"][0][1] += 0.01
    (tmp_path / "docs" / "img" / "records").mkdir(parents=True)
    for name, make in records.FIGURES.items():
        data = stale if name == "memory-7b-d8" else make(load)
        records.figure_path(name, tmp_path).write_bytes(records.draw(data))
    assert records.check_figures(load, tmp_path) == [
        "docs/img/records/memory-7b-d8.png differs from what docs/records draw"]


def test_every_figure_is_shown_in_a_doc(records):
    text = "".join(p.read_text(encoding="utf-8") for p in records.pages(ROOT))
    for name in records.FIGURES:
        assert f"](img/records/{name}.png)" in text, name


def test_the_build_draws_each_figure_from_the_records(records, tmp_path):
    from mkdocs.config import load_config
    from mkdocs.structure.files import File, Files

    config = load_config(str(ROOT / "mkdocs.yml"), site_dir=str(tmp_path / "site"))
    name = "memory-7b-d8"
    old = tmp_path / "docs" / "img" / "records" / f"{name}.png"
    old.parent.mkdir(parents=True)
    old.write_bytes(b"a stale copy")
    files = Files([File(f"img/records/{name}.png", str(tmp_path / "docs"), str(tmp_path / "site"),
                        use_directory_urls=True)])
    files = config.plugins.on_files(files, config=config)  # the build's files event
    load = records.loader()
    for n, make in records.FIGURES.items():
        (f,) = [f for f in files if f.src_uri == f"img/records/{n}.png"]
        png = tmp_path / f"{n}.png"
        png.write_bytes(f.content_bytes)
        assert records.figure_data(png) == json.loads(json.dumps(make(load))), n
