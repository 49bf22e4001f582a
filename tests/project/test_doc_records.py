"""One figure, one source: the figures of README.md and docs/*.md that come from ``tsp simulate``,
``tsp plan`` and ``tsp bench`` are rendered from the records in docs/records/ by
docs/scripts/render_records.py. The docs' blocks equal what the records render (and the check sees
a block that does not), every record says the command that wrote it and is shown somewhere, and
one simulate record is computed again here from its command: the records cannot drift from the
code."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest

from tests.support import launch
from tsp_core.plan.simulate import SimulationRequest, record_dict, simulate_many
from tsp_core.tools import cli

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "docs" / "scripts" / "render_records.py"
RERUN = ("simulate-7b-1layer", 8)  # the cheapest record's row at this degree (about 15 s of CPU)


@pytest.fixture(scope="module")
def records():
    return launch.load_script(SCRIPT, "render_records")


def test_the_docs_equal_the_records(records, capsys):
    diffs = records.check(records.pages(ROOT), records.loader())
    assert not diffs, ("docs differ from docs/records (run python docs/scripts/render_records.py):"
                       "\n" + "\n".join(diffs))
    assert records.main(["--check"]) == 0


def test_the_check_sees_a_block_that_differs(records, tmp_path, capsys):
    load = records.loader()
    good = f"# t\n\n<!-- record: simulate-7b -->\n{records.simulate_7b(load)}<!-- /record -->\n"
    page = tmp_path / "page.md"
    page.write_text(good, encoding="utf-8")
    assert records.check([page], load) == []
    tsp = f"{records.gib(records.sim(records.sim_rows(load, 'simulate-7b'), 'tsp', 131072)):.2f}"
    wrong = good.replace(f"| {tsp} GiB |", "| 12.90 GiB |")
    assert wrong != good
    page.write_text(wrong, encoding="utf-8")
    (diff,) = records.check([page], load)
    assert "-| 131072 | 12.90 GiB |" in diff and f"+| 131072 | {tsp} GiB |" in diff, diff
    page.write_text(good.replace("record: simulate-7b ", "record: no-such-block "),
                    encoding="utf-8")
    with pytest.raises(SystemExit, match="unknown record block 'no-such-block'"):
        records.check([page], load)


def test_every_record_names_its_command_and_is_shown(records):
    blocks = {name for p in records.pages(ROOT)
              for name, _ in records.BLOCK.findall(p.read_text(encoding="utf-8"))}
    used: set[str] = set()
    for name in blocks:
        seen: list[str] = []

        def spy(record: str, _seen=seen) -> dict:
            _seen.append(record)
            return records.loader()(record)
        records.RENDERERS[name](spy)
        used |= set(seen)
    for path in sorted((ROOT / "docs" / "records").glob("*.json")):
        rec = json.loads(path.read_text(encoding="utf-8"))
        argv = shlex.split(rec["command"])
        assert argv[0] == "tsp" and argv[1] in ("simulate", "plan", "bench"), rec["command"]
        assert "--json" in argv, f"{path.name}: the command does not write the JSON"
        assert path.stem in used, f"{path.name} is rendered in no doc"


def test_a_simulate_record_is_what_the_code_computes(records):
    name, degree = RERUN
    rec = records.loader()(name)
    args = cli.parser().parse_args(shlex.split(rec["command"])[1:])
    (row,) = [r for r in rec["output"] if r["degree"] == degree]
    asked = (args.model, args.layers, args.recompute, args.optimizer, args.dtype, args.batch)
    assert asked == (row["model"], row["layers"], row["recompute"], row["optimizer"],
                     row["dtype"], row["batch"]), "the record's command did not write this row"
    assert row["seq"] in args.seq and row["degree"] in args.degree
    req = SimulationRequest(row["name"], row["tp"], row["cp"], row["seq"], args.model,
                            args.layers, args.batch, args.recompute, args.optimizer, args.dtype,
                            row["dp_shard"])
    (now,) = simulate_many([req], jobs=1)
    got = record_dict(now)
    assert (got["peak_bytes"], got["breakdown"]) == (row["peak_bytes"], row["breakdown"]), (
        f"{name} at D={degree}: the code now computes {got['peak_bytes']} bytes "
        f"{got['breakdown']}, the record says {row['peak_bytes']} {row['breakdown']}; "
        f"run python docs/scripts/render_records.py --rerun {name}")
