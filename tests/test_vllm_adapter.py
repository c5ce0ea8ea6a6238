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
