"""graphtrace.vllm.trace_llm's in-process mode, without vLLM (the adapter imports no vLLM)."""

from __future__ import annotations

import os

import pytest

import graphtrace as gt
import graphtrace.vllm as gv
from graphtrace.vllm.adapter import MP_ENV


@pytest.fixture
def no_mp_env(monkeypatch):
    monkeypatch.delenv(MP_ENV, raising=False)


def test_trace_llm_sets_in_process_mode_and_restores_it(no_mp_env):
    with gv.trace_llm() as vt:
        assert os.environ[MP_ENV] == "0"
        assert vt.trace.provenance_recording  # loading is recorded until warm-up
    assert MP_ENV not in os.environ


def test_trace_llm_keeps_an_explicit_zero(monkeypatch):
    monkeypatch.setenv(MP_ENV, "0")
    with gv.trace_llm():
        pass
    assert os.environ[MP_ENV] == "0"


@pytest.mark.parametrize("value", ["1", "yes"])
def test_trace_llm_refuses_multiprocessing_and_says_what_to_do(monkeypatch, value):
    monkeypatch.setenv(MP_ENV, value)
    with pytest.raises(gt.GraphtraceError, match=rf"{MP_ENV}={value} .* set {MP_ENV}=0 .*"
                                                 r"GRAPHTRACE_VLLM=1"):
        gv.trace_llm().__enter__()
    assert gt.tracing.active_trace() is None  # nothing was opened
    with gv.trace_llm(in_process=False):  # the plugin's way: leave the environment alone
        assert os.environ[MP_ENV] == value


class _MultiprocessLLM:
    """What an LLM built with multiprocessing on looks like here: no executor in-process."""

    class llm_engine:
        engine_core = object()


def test_attach_refuses_an_engine_built_multiprocess(no_mp_env):
    with gv.trace_llm() as vt:
        with pytest.raises(gt.GraphtraceError, match="before constructing LLM"):
            vt.attach(_MultiprocessLLM())
        assert vt.llm is None
        with pytest.raises(gt.GraphtraceError, match="capture after LLM"):
            vt.capture("decode").open()


# -- Note [one guard switch] in graphtrace/vllm/adapter.py ---------------------------------------

@pytest.fixture
def guard_env(monkeypatch, no_mp_env):
    monkeypatch.delenv("GRAPHTRACE_VLLM", raising=False)
    monkeypatch.delenv("GRAPHTRACE_GUARD", raising=False)
    return monkeypatch


def test_trace_llm_takes_the_plugins_guard_from_the_environment(guard_env, tmp_path):
    from graphtrace.vllm import plugin

    guard_env.setenv("GRAPHTRACE_VLLM", "guard")
    guard_env.setenv("GRAPHTRACE_VLLM_DIR", str(tmp_path))
    with gv.trace_llm() as vt:
        assert vt.serve_guard is not None and vt.serve_guard.action() == "raise"
        guard_env.setenv("GRAPHTRACE_GUARD", "warn")  # read at each check, as the plugin does
        assert vt.serve_guard.action() == "warn"
        assert vt.serve_guard.folder() == plugin.guard_folder() == tmp_path / "guard" / "rank0"
    guard_env.setenv("GRAPHTRACE_VLLM", "1")  # the plugin on, no guard: none here either
    assert gv.trace_llm().serve_guard is None


def test_explicit_guard_arguments_win_where_the_environment_is_silent(guard_env):
    assert gv.trace_llm().serve_guard is None
    assert gv.trace_llm(guard="warn").serve_guard.action() == "warn"
    guard_env.setenv("GRAPHTRACE_VLLM", "guard")  # guard mode, no action named
    assert gv.trace_llm(guard="recapture").serve_guard.action() == "recapture"
    guard_env.setenv("GRAPHTRACE_GUARD", "warn")
    assert gv.trace_llm(guard="warn").serve_guard.action() == "warn"  # they agree
    assert gv.trace_llm(guard=lambda: "raise").serve_guard.action() == "raise"


@pytest.mark.parametrize("explicit, env, named", [
    (None, {"GRAPHTRACE_VLLM": "guard"}, "GRAPHTRACE_VLLM=guard"),
    (False, {"GRAPHTRACE_VLLM": "guard"}, "GRAPHTRACE_VLLM=guard"),
    ("raise", {"GRAPHTRACE_VLLM": "guard", "GRAPHTRACE_GUARD": "warn"}, "GRAPHTRACE_GUARD=warn"),
    ("warn", {"GRAPHTRACE_GUARD": "recapture"}, "GRAPHTRACE_GUARD=recapture"),
])
def test_a_guard_argument_that_contradicts_the_environment_is_refused(guard_env, explicit,
                                                                      env, named):
    for key, value in env.items():
        guard_env.setenv(key, value)
    with pytest.raises(gt.GraphtraceError, match=rf"trace_llm\(guard={explicit!r}\).*{named}"):
        gv.trace_llm(guard=explicit)
    assert gt.tracing.active_trace() is None  # refused before anything was opened


def test_a_trace_with_no_guard_says_so_once_at_its_first_update(guard_env, caplog):
    from graphtrace.vllm import hooks

    with caplog.at_level("WARNING", logger="graphtrace.vllm"), gv.trace_llm(strict=True):
        for _ in range(3):
            hooks._fire("before_update", object(), "load_weights")
    said = [r.getMessage() for r in caplog.records if "no guard" in r.getMessage()]
    assert len(said) == 1 and "load_weights" in said[0], said
    caplog.clear()
    with caplog.at_level("WARNING", logger="graphtrace.vllm"), \
            gv.trace_llm(strict=True, guard="raise"):
        hooks._fire("before_update", object(), "load_weights")  # nothing captured: no check
    assert not [r for r in caplog.records if "no guard" in r.getMessage()]
