"""What every part of ``gpu-check`` shares: the check record, the device description, the error
measure and the report writers."""

from __future__ import annotations

import json
import math
import platform
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

# bf16 dense tensor-core peaks (no sparsity), TFLOP/s, from the vendors' data sheets. Matched on
# torch.cuda.get_device_name: H100 SXM reports "NVIDIA H100 80GB HBM3", H200 SXM "NVIDIA H200".
# PCIe / NVL parts have lower clocks and power: not listed, so no ratio is claimed for them.
BF16_PEAKS = (("H200 NVL", None), ("H100 PCIe", None), ("H100 NVL", None),
              ("H200", 989.4), ("H100", 989.4), ("A100", 312.0))


@dataclass
class Check:
    """One line of the report. ``tolerance`` None marks a measurement (``ok``: it ran and gave a
    finite figure); otherwise ``ok`` means ``measured <= tolerance``."""

    name: str
    ok: bool
    tolerance: float | None
    measured: float | None
    unit: str = ""
    note: str = ""
    detail: dict[str, Any] = field(default_factory=dict)

    def line(self) -> str:
        status = "ok  " if self.ok else "FAIL"
        meas = "n/a" if self.measured is None else f"{self.measured:.4g}"
        tol = "" if self.tolerance is None else f" (tolerance {self.tolerance:.3g})"
        unit = f" {self.unit}" if self.unit else ""
        note = f"  [{self.note}]" if self.note else ""
        return f"{status} {self.name}: {meas}{unit}{tol}{note}"


def within(name: str, measured: float, tolerance: float, **kw: Any) -> Check:
    """A comparison check; NaN never passes."""
    ok = math.isfinite(measured) and measured <= tolerance
    return Check(name, ok, tolerance, measured, **kw)


def measurement(name: str, value: float | None, unit: str, note: str = "", **kw: Any) -> Check:
    """A figure with no pass/fail threshold: ok when it was measured and is finite."""
    ok = value is not None and math.isfinite(value)
    return Check(name, ok, None, value, unit, note, **kw)


def failure(name: str, error: BaseException | str) -> Check:
    """A part that raised: one failing check naming the error, so the run still reports."""
    return Check(name, False, None, None, note=f"raised: {error!s}"[:500])


def rel_err(actual: torch.Tensor, ref: torch.Tensor) -> float:
    """max |actual - ref| / max |ref|: the error relative to the reference's scale (a per-element
    relative error would blow up at entries near zero, which attention outputs and gradients
    have plenty of)."""
    if actual.shape != ref.shape:
        raise ValueError(f"shape {tuple(actual.shape)} != reference {tuple(ref.shape)}")
    diff = (actual.double() - ref.double()).abs().max().item()
    scale = ref.double().abs().max().item()
    return diff / scale if scale > 0 else diff


def device_info(device: str) -> dict[str, Any]:
    info: dict[str, Any] = {"type": device, "torch": torch.__version__,
                            "python": platform.python_version(),
                            "cpu_threads": torch.get_num_threads()}
    try:
        import transformers
        info["transformers"] = transformers.__version__
    except ImportError:
        pass
    if device == "cuda":
        info.update(name=torch.cuda.get_device_name(0),
                    capability=".".join(map(str, torch.cuda.get_device_capability(0))),
                    cuda=torch.version.cuda,
                    memory_gib=round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1),
                    bf16_peak_tflops=bf16_peak(torch.cuda.get_device_name(0)))
    else:
        info.update(name=platform.processor() or platform.machine(), capability=None,
                    bf16_peak_tflops=None)
    return info


def bf16_peak(name: str) -> float | None:
    for key, peak in BF16_PEAKS:
        if key in name:
            return peak
    return None


def to_json(checks: list[Check]) -> list[dict[str, Any]]:
    """Plain JSON (no NaN tokens): a non-finite figure becomes null, its value kept in the note."""
    rows = []
    for c in checks:
        row = asdict(c)
        m = row["measured"]
        if isinstance(m, float) and not math.isfinite(m):
            row["measured"], row["note"] = None, f"measured {m}; {row['note']}"
        rows.append(row)
    return rows


def from_json(rows: list[dict[str, Any]]) -> list[Check]:
    return [Check(**r) for r in rows]


def write_json(path: str, data: dict[str, Any]) -> None:
    with open(path, "w") as f:
        json.dump(data, f, indent=1, default=str)
        f.write("\n")


def _fmt(x: float | None) -> str:
    return "" if x is None else f"{x:.4g}"


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


PART_TITLES = {"a": "flash pieces vs dense float64", "b": "whole model at tsp 1 vs Hugging Face",
               "c": "one rank of D = 8, one decoder layer (fake process group)",
               "d": "plain Hugging Face decoder layer (reference for c)",
               "e": "long context at tsp 1: host offload and tiles",
               "f": "one Llama-3-8B-shaped layer at tsp 1, compiled vs eager",
               "summary": "summary"}


# measurements left out of the summary table (their part's own table has them)
NOT_IN_SUMMARY = ("b.world", "c.nonfinite")
# of part (e)'s many figures, the summary shows what tiling and offload cost and keep
E_SUMMARY = ("e.tiles.mlp.cost", "e.tiles.loss.cost", "e.offload.exposed", "e.offload.copy_time",
             "e.offload.kept_off", "e.offload.kept_on")


def _in_summary(name: str) -> bool:
    return name in E_SUMMARY if name.startswith("e.") else name not in NOT_IN_SUMMARY


def summary_rows(checks: list[dict[str, Any]]) -> list[str]:
    """One row per part: checks passed, the tightest comparison (measured / tolerance, 1 = at
    the limit) and the part's measurements."""
    rows = ["| part | passed | tightest check (measured / tolerance) | measurements |",
            "|---|---|---|---|"]
    for key, title in PART_TITLES.items():
        mine = [c for c in checks if c["name"].split(".")[0] == key]
        if not mine:
            continue
        ratios = [(c["measured"] / c["tolerance"], c["name"]) for c in mine
                  if c["tolerance"] and c["measured"] is not None]
        tight = f"{max(ratios)[0]:.2g} ({max(ratios)[1]})" if ratios else ""
        figures = ", ".join(f"{c['name'].split('.', 1)[1]} {_fmt(c['measured'])} {c['unit']}"
                            for c in mine if c["tolerance"] is None and _in_summary(c["name"]))
        passed = sum(c["ok"] for c in mine)
        rows.append(f"| ({key}) {title} | {passed} of {len(mine)} | {_cell(tight)} | "
                    f"{_cell(figures)} |")
    return rows


def _config_line(key: str, value: Any) -> str:
    if key == "simulation" and isinstance(value, dict):
        phases = value.get("phases", {})
        value = ", ".join(f"{k} {sum(v.values()) / 2**30:.4g} GiB" for k, v in phases.items()
                          if k in ("attention_forward", "attention_backward", "mlp_forward",
                                   "mlp_backward"))
        return f"- tsp simulate (c's prediction, added per phase): {value}"
    if isinstance(value, dict):
        value = ", ".join(f"{k}={v}" for k, v in value.items())
    return f"- {key}: {value}"


def markdown(data: dict[str, Any]) -> str:
    """The report: the device, the shapes, a summary table, then one table per part."""
    dev = data["device"]
    out = [f"# gpu-check on {dev.get('name')} ({dev['type']})", "",
           f"torch {dev['torch']}, transformers {dev.get('transformers')}, capability "
           f"{dev.get('capability')}, bf16 peak {dev.get('bf16_peak_tflops')} TFLOP/s; "
           f"{data['summary']['failed']} of {data['summary']['checks']} checks failed; "
           f"{data['summary']['seconds']:.1f} s.", ""]
    out += [_config_line(k, v) for k, v in data.get("config", {}).items()]
    out += ["", "## Summary", ""] + summary_rows(data["checks"])
    for key, title in PART_TITLES.items():
        rows = [c for c in data["checks"] if c["name"].split(".")[0] == key]
        if not rows or key == "summary":
            continue
        out += ["", f"## ({key}) {title}", "",
                "| check | ok | measured | tolerance | unit | note |", "|---|---|---|---|---|---|"]
        out += [f"| {c['name']} | {'yes' if c['ok'] else '**NO**'} | {_fmt(c['measured'])} | "
                f"{_fmt(c['tolerance'])} | {_cell(c['unit'])} | {_cell(c['note'])} |"
                for c in rows]
    return "\n".join(out) + "\n"
