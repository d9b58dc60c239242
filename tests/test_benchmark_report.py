"""benchmarks/report.py turns the committed results into BENCHMARKS.md and its plot."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _report(monkeypatch):
    # report.py imports its sibling report_more.py, as it does when run as a script
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    spec = importlib.util.spec_from_file_location("rgpu_report", ROOT / "benchmarks" / "report.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_report_writes_tables_targets_and_plot_from_the_results(tmp_path, monkeypatch):
    report = _report(monkeypatch)
    out = report.write_markdown(tmp_path / "BENCHMARKS.md", tmp_path / "plots")
    text = out.read_text()
    png = tmp_path / "plots" / "latency.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "](plots/latency.png)" in text
    latency = json.loads((ROOT / "benchmarks" / "results" / "latency.json").read_text())
    # each mode's 50 ms row shows the measured number and its verdict, as the JSON has them
    for mode, target in latency["ours"]["targets_at_50ms"].items():
        row = next(
            line
            for line in text.splitlines()
            if line.startswith(f"| {report.MODE_LABEL[mode]} | <")
        )
        assert f"| {target['ms_per_step']:.1f} |" in row
        assert row.endswith("| yes |" if target["met"] else "| **no** |")
    core = json.loads((ROOT / "benchmarks" / "results" / "core.json").read_text())
    assert f"| {core['transfer']['upload_MBps']['median']:,.0f} |" in text
    assert "## Reading these numbers" in text  # benchmarks/NOTES.md is appended
