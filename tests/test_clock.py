"""graphtrace's own time (graphtrace.clock, Note [self clock]): exclusive sections, off by
default, and the sections a real trace opens when GRAPHTRACE_CLOCK=1."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from graphtrace import clock

ROOT = Path(__file__).resolve().parents[1]


class _FakeTime:
    """perf_counter / process_time that advance by hand (no timed assertions)."""

    def __init__(self):
        self.wall = 0.0
        self.cpu = 0.0

    def perf_counter(self):
        return self.wall

    def process_time(self):
        return self.cpu

    def advance(self, wall, cpu):
        self.wall += wall
        self.cpu += cpu


@pytest.fixture
def fake_time(monkeypatch):
    fake = _FakeTime()
    monkeypatch.setattr(clock, "time", fake)
    return fake


def test_sections_are_exclusive_and_outside_counts_for_no_one(fake_time):
    c = clock.Clock()
    with c.section("outer"):
        fake_time.advance(1.0, 0.5)
        with c.section("inner"):
            fake_time.advance(2.0, 2.0)
            with c.section(None):  # the engine's own code run inside graphtrace's
                fake_time.advance(10.0, 10.0)
            fake_time.advance(0.25, 0.25)
        with c.section(None):
            fake_time.advance(5.0, 5.0)
        fake_time.advance(0.5, 0.0)
    with c.section("inner"):
        fake_time.advance(1.0, 1.0)
    rep = c.report()
    assert rep["sections"]["outer"] == {"wall_s": 1.5, "cpu_s": 0.5, "calls": 1}
    assert rep["sections"]["inner"] == {"wall_s": 3.25, "cpu_s": 3.25, "calls": 2}
    assert list(rep["sections"]) == ["inner", "outer"]  # largest first
    assert rep["wall_s"] == 4.75 and rep["cpu_s"] == 3.75
    assert None not in rep["sections"]


def test_a_raising_section_still_closes(fake_time):
    c = clock.Clock()
    with pytest.raises(ValueError):
        with c.section("boom"):
            fake_time.advance(1.0, 1.0)
            raise ValueError("x")
    with c.section("after"):
        fake_time.advance(2.0, 2.0)
    rep = c.report()["sections"]
    assert rep["boom"]["wall_s"] == 1.0 and rep["after"]["wall_s"] == 2.0  # not nested in boom


def _child(code: str, env_value: str | None) -> dict:
    env = dict(os.environ)
    env.pop(clock.ENV, None)
    if env_value is not None:
        env[clock.ENV] = env_value
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


TRACED = r"""
import json, torch
import graphtrace as gt
from graphtrace import clock
model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU())
with gt.trace(model, strict=True) as t:
    w = model[0].weight.detach() * 2  # made inside the trace: provenance notes it
    with gt.capture("g"):
        model(torch.ones(1, 4))
print(json.dumps(clock.CLOCK.report() if clock.CLOCK is not None else None))
"""


def test_off_by_default_and_on_by_env():
    assert _child(TRACED, None) is None
    rep = _child(TRACED, "1")
    sections = rep["sections"]
    for name in ("native: load the recorder extension",
                 "provenance: start (census of watched models)", "compiled: install hooks",
                 "trace: watch", "provenance: dispatch mode (note)",
                 "lineage: dispatch mode (record)", "trace: after capture", "owners: snapshot"):
        assert name in sections, (name, sorted(sections))
    assert sections["provenance: dispatch mode (note)"]["calls"] >= 1
    assert all(s["wall_s"] >= 0 and s["calls"] >= 1 for s in sections.values())
    assert rep["wall_s"] == pytest.approx(sum(s["wall_s"] for s in sections.values()))
