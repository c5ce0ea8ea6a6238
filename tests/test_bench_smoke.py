"""The benchmark scripts run (--quick) and print their tables; timings are never asserted."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")

ROOT = Path(__file__).resolve().parents[1]


def _run(script: str, *args: str, timeout: int = 120) -> str:
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    # the graphtrace of this checkout, not whichever one the environment installed
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    proc = subprocess.run([sys.executable, str(ROOT / "analysis" / script), "--quick", *args],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{script} --quick exited {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc.stdout


def test_bench_overhead_quick(tmp_path):
    out_file = tmp_path / "overhead.txt"
    out = _run("bench_overhead.py", "--out", str(out_file))
    # every workload has its table: this project's blocks, a transformers decode step over a
    # static KV cache, and an elementwise-heavy stack
    for workload in ("blocks", "decode", "elementwise"):
        assert f"## recorder overhead per capture: {workload}" in out, workload
    assert "transformers LlamaForCausalLM" in out
    assert out.count("goal: graphtrace emulate=True added cost <= 1.5x") == 3
    for row in ("no mode (baseline)", "no-op TorchDispatchMode", "graphtrace emulate=False",
                "graphtrace emulate=True", "DebugMode", "CUDA sanitizer", "liveness tracker",
                "gt.trace open, outside capture", "gt.trace open, outside capture, provenance off"):
        assert row in out, row
    assert "added / no-op" in out
    assert "outside captures, provenance off (gt.trace(provenance=False)): forward wrappers" in out
    assert "## memory" in out and "B/access" in out
    # recording keeps no tensor memory alive: every watched intermediate expired
    assert "-> no tensor memory kept" in out
    assert out_file.read_text().startswith("# graphtrace recorder overhead")


def test_bench_overhead_profile_names_every_phase():
    """--profile prints where a capture's time goes, phase by phase; every phase it times
    still exists in graphtrace (a renamed one would be printed as not timed)."""
    results = ROOT / "analysis" / "results" / "bench_overhead.txt"
    before = results.stat().st_mtime_ns if results.exists() else None
    out = _run("bench_overhead.py", "--workload", "elementwise", "--recorders", "core",
               "--profile")
    assert "## per-capture profile: elementwise" in out
    for phase in ("capture enter", "capture exit", "owner snapshot update",
                  "cached walk still valid?", "provenance match", "baked scalars"):
        assert phase in out, phase
    assert "emulate=False: per capture" in out and "emulate=True: per capture" in out
    assert "not timed" not in out
    # core recorders only, and nothing written: --profile and --recorders core are for looking
    assert "DebugMode" not in out
    assert (results.stat().st_mtime_ns if results.exists() else None) == before


def test_bench_scale_quick(tmp_path):
    out_file = tmp_path / "scale.txt"
    out = _run("bench_scale.py", "--out", str(out_file))
    assert "## trace + diff + report at scale" in out
    header = next(line for line in out.splitlines() if line.startswith("source"))
    for col in ("accesses", "storages", "edges", "diff s", "frames s", "diff/frames",
                "µs/access", "peak MiB", "csv s", "load s"):
        assert col in header, col
    assert "real " in out and "synthetic " in out
    assert "round trip ok" in out and "MISMATCH" not in out
    assert out_file.read_text().startswith("# graphtrace trace + diff + report at scale")


def test_bench_guard_quick(tmp_path):
    out_file = tmp_path / "guard.txt"
    out = _run("bench_guard.py", "--out", str(out_file))
    assert "| guard.check(), clean" in out and "| t.diff()" in out
    assert "ratio diff / check:" in out
    assert "| its frames alone" in out and "ratio diff / its frames:" in out
    # the rebound holder is found by both, with the same edges
    assert "found by check and diff alike (3 edges, stale): yes" in out
    assert "parameters 39 (9 per layer)" in out
    assert out_file.read_text().startswith("# graphtrace guard.check() vs t.diff()")


def test_bench_guard_float_holders_quick():
    """Issue 39's model: LayerNorms whose eps every graph bakes (9 norms x 3 graphs records);
    the rebound holder is still found by both."""
    out = _run("bench_guard.py", "--norm", "layernorm", "--clock", "cpu")
    assert "norm layernorm, parameters 48 (11 per layer), blind-spot records 27," in out
    assert "found by check and diff alike (3 edges, stale): yes" in out


def test_bench_overhead_script_quick():
    out = _run("bench_overhead.py", "--workload", "script", "--recorders", "core")
    assert "## recorder overhead per capture: script" in out
    for row in ("script: trace + 1 capture, emulate=False", "emulate=True, modules=off",
                "trace enter", "## where the short script's time goes (cProfile"):
        assert row in out, row


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("valgrind") is None, reason="valgrind is not installed")
def test_callgrind_overhead_quick():
    """The instruction counts (issue 39): a tiny workload under callgrind prints every ratio
    line, each a number (about a minute: torch imported under valgrind)."""
    out = _run("callgrind_overhead.py", timeout=300)
    rows = re.findall(r"^\| emulate=(True|False), modules='(forward|off)' \| ([\d.]+)x \| "
                      r"([\d.]+)x \| ([\d.]+)x \|", out, re.M)
    assert len(rows) == 4, out
    assert all(float(r[4]) > 0 for r in rows)  # graphtrace adds instructions to a capture
    for emulate in (False, True):
        assert re.search(rf"^script \(trace entered, one capture, trace closed\), "
                         rf"emulate={emulate}: [\d.]+x the no-op", out, re.M), out
        assert re.search(rf"^goal: a capture inside an open trace, emulate={emulate}, .*: "
                         rf"[\d.]+x -> (met|NOT met)$", out, re.M), out


def test_callgrind_overhead_says_when_valgrind_is_missing(tmp_path):
    """Without valgrind on PATH the script exits 2 naming it (it measures nothing else)."""
    env = dict(os.environ, PATH=str(tmp_path))  # an empty folder: no valgrind, no cc
    proc = subprocess.run([sys.executable, str(ROOT / "analysis" / "callgrind_overhead.py"),
                           "--quick"], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 2 and "valgrind is not on PATH" in proc.stderr


def test_bench_serving_quick(tmp_path):
    out_file = tmp_path / "serving.txt"
    out = _run("bench_serving.py", "--out", str(out_file))
    for workload in ("mlp", "elementwise", "identity"):
        assert f"## {workload}:" in out, workload
    for row in ("no trace open", "gt.trace(model) (defaults)", "defaults, after a load_state_dict",
                'record="always"', "provenance=False"):
        assert row in out, row
    assert out.count("goal: defaults <= 1.1x no trace") == 3
    assert out.count("+us/call") == 3 and "11 module calls per forward" in out  # identity, 4 blocks
    # what the rule says: paused while serving by default, recording with record="always"
    rows = {line[:34].strip(): line.split()[-1] for line in out.splitlines()
            if line.startswith(("gt.trace(model)", "defaults,", 'record="always"'))}
    assert set(rows.values()) == {"no", "yes"} and rows['record="always"'] == "yes", rows
    assert out_file.read_text().startswith("# graphtrace: a trace left open while the model serves")


def test_bench_sync_quick(tmp_path):
    out_file = tmp_path / "sync.txt"
    out = _run("bench_sync.py", "--out", str(out_file))
    header = next(line for line in out.splitlines() if line.startswith("| model"))
    for col in ("sync, no hook (ms)", "per update: hooks + one check (ms)", "old per-call cost (ms)",
                "checks per update", "stale update refused", "in-place write checked"):
        assert col in header, col
    columns = [c.strip() for c in header.split("|")]
    rows = [line.split("|") for line in out.splitlines() if line.startswith(("| tiny", "| big"))]
    assert len(rows) == 2
    for row in rows:  # one check per update, an in-place write checked, the rebinding caught
        cell = dict(zip(columns, (c.strip() for c in row)))
        assert cell["checks per update"] == "1", row
        assert cell["in-place write checked"] == "yes" and cell["stale update refused"] == "yes"
    assert out_file.read_text().startswith("# check before serve")
