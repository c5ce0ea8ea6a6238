"""`graphtrace.sglang.trace_engine` without SGLang: the switches it sets for the scheduler
processes an engine spawns, restored after, and a clear error where SGLang could not load
the plugin (the engine tests themselves: tests/sglang, `make test-sglang`)."""

from __future__ import annotations

import importlib.metadata as md
import os

import pytest

import graphtrace.sglang as gs
from graphtrace.errors import GraphtraceError
from graphtrace.sglang import env


class _EntryPoint:
    def __init__(self, value: str):
        self.name, self.value = "graphtrace", value


@pytest.fixture
def installed(monkeypatch):
    """graphtrace's entry point as an environment with graphtrace installed lists it."""
    monkeypatch.setattr(md, "entry_points", lambda group=None: [
        _EntryPoint("graphtrace.sglang.plugin:register")] if group == "sglang.srt.plugins" else [])
    for key in (env.ENV_ON, env.ENV_DIR, env.ENV_GUARD, env.ENV_EMULATE):
        monkeypatch.delenv(key, raising=False)


def test_trace_engine_sets_the_plugins_switches_and_restores_them(installed, tmp_path,
                                                                  monkeypatch):
    monkeypatch.setenv(env.ENV_GUARD, "warn")  # the caller's, restored after
    with gs.trace_engine(tmp_path, guard="raise", batch_sizes=(1, 4)) as st:
        assert env.guard_mode() and env.guard_action() == "raise"
        assert env.out_dir() == tmp_path.resolve() and env.guard_folder(1) == \
            tmp_path.resolve() / "guard" / "rank1"
        assert env.emulated_batch_sizes() == (1, 4)
        assert st.checks() == []
    assert os.environ[env.ENV_GUARD] == "warn"
    assert env.ENV_ON not in os.environ and env.ENV_DIR not in os.environ
    with gs.trace_engine(tmp_path, guard=None):
        assert env.enabled() and not env.guard_mode()
    assert env.emulated_batch_sizes() == env.DEFAULT_EMULATE


def test_trace_engine_refuses_where_sglang_cannot_load_the_plugin(monkeypatch, tmp_path):
    monkeypatch.setattr(md, "entry_points", lambda group=None: [])
    monkeypatch.delenv(env.ENV_ON, raising=False)
    with pytest.raises(GraphtraceError, match="plugin is not installed"):
        with gs.trace_engine(tmp_path):
            pass
    assert env.ENV_ON not in os.environ
    with pytest.raises(ValueError, match="not one of"):
        gs.trace_engine(tmp_path, guard="ignore")


def test_the_plugin_does_nothing_unless_switched_on(monkeypatch):
    from graphtrace.sglang import plugin

    monkeypatch.delenv(env.ENV_ON, raising=False)
    plugin.register()  # would import sglang's HookRegistry if it were on
    assert plugin.session() is None and not plugin._registered
