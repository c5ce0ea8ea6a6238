"""Cases whose reload is vLLM's own (layerwise reload) run through vLLM's real reload code."""

from __future__ import annotations

import pytest

from graphtrace.demo.cases import CASES, spec

VLLM_CASES = [c.name for c in CASES.values() if c.uses_vllm_reload]


def test_some_cases_use_vllms_reload():
    assert len(VLLM_CASES) >= 5


@pytest.mark.parametrize("name", VLLM_CASES)
def test_case_through_vllms_layerwise_reload(name):
    results = spec.run_case(CASES[name], "vllm")
    for r in results:
        assert not r.error, r.error
        assert r.outcome.backend == "vllm"
        assert r.ok, [f for f in r.findings if not f.ok]
