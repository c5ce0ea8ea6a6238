"""Fixtures shared by the test files: the writer each recorder test runs on, the hand-made
report folder, and the reload backends of the demo (vLLM's only where it is installed)."""

from __future__ import annotations

import gc
import importlib.util
import os
from pathlib import Path

import pytest

REPORT_FIXTURE = Path(__file__).parent / "data" / "reload_report"


@pytest.fixture(params=["python", "native"])
def writer(request, monkeypatch) -> str:
    """Runs a test on both access writers (GRAPHTRACE_NATIVE picks the default); a test file
    opts in for every test with ``pytestmark = pytest.mark.usefixtures("writer")``."""
    monkeypatch.setenv("GRAPHTRACE_NATIVE", "0" if request.param == "python" else "1")
    return request.param


@pytest.fixture(scope="module")
def report():
    """The hand-made report folder tests/data/reload_report, loaded (see tests/data/README.md)."""
    from graphtrace.report import load_report

    return load_report(REPORT_FIXTURE)


@pytest.fixture
def vllm_installed() -> None:
    """Skips the test where vLLM is not installed; fails it instead under
    GRAPHTRACE_REQUIRE_VLLM=1 (the CI job that installs vLLM)."""
    if importlib.util.find_spec("vllm") is None:
        if os.environ.get("GRAPHTRACE_REQUIRE_VLLM") == "1":
            pytest.fail("GRAPHTRACE_REQUIRE_VLLM=1 but vLLM is not installed")
        pytest.skip("vLLM is not installed")


@pytest.fixture(params=["builtin", pytest.param("vllm", marks=pytest.mark.vllm)])
def reload_backend(request) -> str:
    """The demo's reload backends: the built-in one and vLLM's real layerwise reload."""
    if request.param == "vllm":
        request.getfixturevalue("vllm_installed")
    return request.param


@pytest.fixture
def gc_off():
    """The garbage collector off: what must die must die by reference counting alone."""
    from graphtrace.owners import gc_paused

    gc.collect()
    with gc_paused():
        yield


@pytest.fixture
def tiny_llama():
    """A factory of tiny transformers ``LlamaForCausalLM`` models, all of one config (vocabulary
    64, 2 layers, width 32), random init: ``tiny_llama(seed=0)`` seeds torch, then builds one
    in eval mode."""
    transformers = pytest.importorskip("transformers")
    import torch

    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, max_position_embeddings=64)

    def make(seed: int = 0):
        torch.manual_seed(seed)
        return transformers.LlamaForCausalLM(cfg).eval()

    return make


@pytest.fixture
def traced_llama(tiny_llama):
    """A `tiny_llama` captured once, emulated, in a strict trace: ``(model, trace, [graph])``;
    the graph is kept alive by the returned list, as an engine's capture artifacts keep
    theirs."""
    import torch

    import graphtrace as gt

    model = tiny_llama()
    ids = torch.randint(0, 64, (1, 8))
    with torch.no_grad(), gt.trace(model, strict=True) as t:
        with gt.capture("prefill") as g:
            model(ids)
    return model, t, [g]
