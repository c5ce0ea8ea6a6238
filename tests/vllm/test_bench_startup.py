"""analysis/bench_startup.py runs: the three ways start the same engine and serve the same
tokens (one run each; the timing itself is the script's business, not a test's)."""

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
    for way in ("| off |", "| plugin |", "| trace_llm |"):
        assert way in text, way
    assert "same tokens from every way: yes" in text


def test_bench_startup_rejects_zero_runs():
    proc = subprocess.run([sys.executable, str(ROOT / "analysis" / "bench_startup.py"),
                           "--runs", "0"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "--runs must be at least 1" in proc.stderr
