"""The vLLM plugin's guard policy (graphtrace/vllm/plugin.py, ``GRAPHTRACE_VLLM=guard``)
without vLLM: what a weight update that leaves a graph reading a stale storage does under
``GRAPHTRACE_GUARD=warn`` (logged, recorded, the update stands) and ``raise`` (the update
fails with `StaleGraphError`), and that a clean update passes both. The worker-side session
is a real `VllmTrace` (it imports no vLLM) whose model is watched and captured directly, as
the plugin's hooks would after ``Worker.load_model``; the update hooks are its ServeGuard's
listeners (graphtrace/vllm/serve.py). tests/vllm/test_guard_plugin.py runs the same policy inside a real engine."""

from __future__ import annotations

import json
import logging

import pytest
import torch

import graphtrace as gt
from graphtrace.vllm import plugin
from graphtrace.vllm.adapter import VllmTrace

HOLDER = "kernel.scale"


class Kernel:
    """What a quantization method keeps: a tensor its weight processing recomputes."""

    def __init__(self, scale: torch.Tensor):
        self.scale = scale


class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(4, 4)
        self.kernel = Kernel(torch.rand(4))

    def forward(self, x):
        return self.proj(x) * self.kernel.scale


def stale_update(model: Model) -> None:
    """The bug: the holder is rebound; the captured graph keeps reading the old tensor."""
    model.kernel.scale = torch.rand(4)


def clean_update(model: Model) -> None:
    """New values copied into the captured storages."""
    with torch.no_grad():
        model.proj.weight.copy_(torch.rand(4, 4))
        model.kernel.scale.copy_(torch.rand(4))


@pytest.fixture
def worker(monkeypatch, tmp_path):
    """The plugin's state in a worker process after load and capture: (model, guard folder)."""
    monkeypatch.setenv(plugin.ENV_ON, "guard")
    monkeypatch.setenv(plugin.ENV_DIR, str(tmp_path))
    monkeypatch.delenv(plugin.ENV_GUARD, raising=False)
    monkeypatch.delenv(plugin.ENV_STRICT, raising=False)
    vt = VllmTrace(strict=True, in_process=False, guard=plugin.guard_action,
                   guard_dir=plugin._guard_folder)  # as the plugin's _before_load makes it
    vt.__enter__()
    try:
        model = Model()
        vt.trace.watch(model)
        with gt.capture("decode") as g:
            model(torch.rand(2, 4))
        vt.graphs.append(g)  # kept alive like a CUDA graph's capture artifacts
        monkeypatch.setattr(plugin, "_session", vt)
        yield model, tmp_path / "guard" / "rank0"
    finally:
        vt.__exit__(None, None, None)


def weight_update(model: Model, update) -> None:
    """One weight update as the plugin's hooks see it (Note [weight updates]): a whole
    update (``reload_weights``), checked when it returns (Note [check before serve])."""
    guard = plugin.serve_guard()
    guard.before_update(None, "reload_weights")
    update(model)
    guard.after_update(None, "reload_weights")


def checks(folder) -> list[dict]:
    return [json.loads(line) for line in (folder / "checks.jsonl").read_text().splitlines()]


def test_warn_logs_a_stale_update_records_it_and_lets_it_stand(worker, monkeypatch, caplog):
    model, folder = worker
    monkeypatch.setenv(plugin.ENV_GUARD, "warn")
    assert plugin.guard_action() == "warn"
    with caplog.at_level(logging.WARNING, logger="graphtrace.vllm"):
        weight_update(model, stale_update)  # no exception: the update stands
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1, caplog.text
    text = warnings[0].getMessage()
    assert "after reload_weights" in text and "stale" in text and HOLDER in text
    (entry,) = checks(folder)
    assert entry["action"] == "warn" and not entry["ok"]
    assert entry["verdicts"] == ["stale"] and entry["owners"] == [HOLDER]
    problems = entry["problems_csv"]
    assert HOLDER in (folder / problems).read_text()
    status = plugin.rpc_guard_status()
    assert status["action"] == "warn" and status["checks"] == 1 and status["errors"] == 0
    assert status["last"] == entry


@pytest.mark.parametrize("setting", ["raise", None, "not-an-action"])
def test_raise_fails_a_stale_update_with_the_problems(worker, monkeypatch, caplog, setting):
    """`raise` is also the default, and what a value that is not an action falls back to."""
    model, folder = worker
    if setting is not None:
        monkeypatch.setenv(plugin.ENV_GUARD, setting)
    with caplog.at_level(logging.WARNING, logger="graphtrace.vllm"):
        assert plugin.guard_action() == "raise"
        with pytest.raises(gt.StaleGraphError, match=r"after reload_weights") as info:
            weight_update(model, stale_update)
    assert list(info.value.problems["owners"]) == [HOLDER]
    assert list(info.value.problems["verdict"]) == ["stale"]
    (entry,) = checks(folder)  # recorded before it raised
    assert entry["action"] == "raise" and not entry["ok"] and entry["owners"] == [HOLDER]
    if setting == "not-an-action":
        assert "'not-an-action' is not one of raise, warn, recapture" in caplog.text


@pytest.mark.parametrize("setting", ["warn", "raise"])
def test_a_clean_update_passes_silently_under_either_action(worker, monkeypatch, caplog,
                                                            setting):
    model, folder = worker
    monkeypatch.setenv(plugin.ENV_GUARD, setting)
    with caplog.at_level(logging.WARNING, logger="graphtrace.vllm"):
        weight_update(model, clean_update)
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text
    (entry,) = checks(folder)
    assert entry["ok"] and entry["action"] == setting and entry["n_problems"] == 0
    assert not list(folder.glob("problems-*.csv"))


def test_warn_then_raise_each_update_checked_on_its_own(worker, monkeypatch):
    """The action is read at each check: a warned update stands, and the next update under
    raise still fails while the graph reads the stale storage."""
    model, folder = worker
    monkeypatch.setenv(plugin.ENV_GUARD, "warn")
    weight_update(model, stale_update)
    monkeypatch.setenv(plugin.ENV_GUARD, "raise")
    with pytest.raises(gt.StaleGraphError):
        weight_update(model, clean_update)  # the graph still reads the first update's victim
    assert [(e["action"], e["ok"]) for e in checks(folder)] == [("warn", False),
                                                                ("raise", False)]
