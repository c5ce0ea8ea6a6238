"""analysis/bench_startup.py runs: the three ways start the same engine and serve the same
tokens, and it reports wall and CPU time per way and graphtrace's own time per section (one
run each; the timing itself is the script's business, not a test's)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.vllm

ROOT = Path(__file__).resolve().parents[2]


def test_bench_startup_runs_every_way(tmp_path):
    out = tmp_path / "startup.txt"
    proc = subprocess.run([sys.executable, str(ROOT / "analysis" / "bench_startup.py"),
                           "--runs", "1", "--out", str(out)], cwd=ROOT, capture_output=True,
                          text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    text = out.read_text()
    for title in ("## wall time of LLM(...)", "## CPU time of LLM(...)",
                  "## CPU time of the whole child"):
        rows = _table(text, title)
        assert [row[0] for row in rows] == ["off", "plugin", "trace_llm"], (title, rows)
        assert all(float(row[1]) > 0 for row in rows) and rows[0][4] == "1.000x", rows
    assert "same tokens from every way: yes" in text
    for title in ("## wall time of LLM(...)", "## CPU time of LLM(...)",
                  "## CPU time of the whole child", "## graphtrace's own time",
                  "## breakdown: exclusive seconds per section"):
        assert title in text, title
    own = _table(text, "## graphtrace's own time")
    assert [row[0] for row in own] == ["plugin", "trace_llm"]  # off has nothing of graphtrace
    for row in own:
        assert float(row[1].split()[0]) > 0 and row[2].endswith("%"), row
    sections = {row[0]: row[1:] for row in _table(text, "## breakdown")}
    # what each way runs at startup is accounted: the plugin's and trace_llm's entry points,
    # the trace's entry, provenance and lineage's dispatch mode while the model loads
    for name, way in (("plugin: register", 0), ("before_load: _before_load", 0),
                      ("import graphtrace.vllm.adapter", 3), ("trace: construct", 0),
                      ("trace: construct", 3), ("provenance: start (census of watched models)", 0),
                      ("provenance: dispatch mode (note)", 0),
                      ("provenance: dispatch mode (note)", 3),
                      ("lineage: dispatch mode (record)", 3), ("trace: watch", 0),
                      ("vllm: blind-spot scan", 3), ("after_load: VllmTrace._on_load", 3)):
        assert name in sections, (name, sorted(sections))
        assert int(sections[name][way + 2]) >= 1, (name, sections[name])
    assert "goal (issue 26: at most 1.02x off's median): wall " in text and ", CPU " in text


def _table(text: str, heading: str) -> list[list[str]]:
    """The body rows (cells stripped) of the markdown table under the heading starting with
    `heading`."""
    lines = text[text.index(heading):].splitlines()[1:]
    rows = [ln for ln in lines if ln.startswith("|")]
    start = lines.index(rows[0])
    body = []
    for ln in lines[start + 2:]:
        if not ln.startswith("|"):
            break
        body.append([c.strip() for c in ln.strip("|").split("|")])
    return body


def test_bench_startup_rejects_zero_runs():
    proc = subprocess.run([sys.executable, str(ROOT / "analysis" / "bench_startup.py"),
                           "--runs", "0"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "--runs must be at least 1" in proc.stderr
