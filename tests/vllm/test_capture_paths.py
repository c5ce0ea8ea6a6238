"""Every CUDA graph capture path of the installed vLLM release ends in
CUDAGraph.capture_begin/capture_end,
which graphtrace's trace wraps. Checked on the installed vLLM's source (no GPU needed), so a
vLLM upgrade that adds a capture path graphtrace would miss fails here."""

from __future__ import annotations

import inspect

import pytest

pytestmark = pytest.mark.vllm

def test_capture_sites_are_the_known_ones():
    """The installed release's capture sites are its row's (graphtrace/vllm/releases.py),
    every one through CUDAGraph.capture_begin (nothing bypasses it)."""
    from graphtrace.vllm import contract, releases

    rel = releases.release()
    problems = contract.check_capture_sites(rel)
    assert problems == [], "\n".join(problems)
    assert "v1/worker/gpu/cudagraph_utils.py" in rel.capture_sites  # Model Runner V2


def test_torch_cuda_graph_goes_through_capture_begin_and_end():
    import torch.cuda.graphs as graphs

    assert "capture_begin" in inspect.getsource(graphs.graph.__enter__)
    assert "capture_end" in inspect.getsource(graphs.graph.__exit__)


def test_trace_wraps_capture_begin_while_open_and_hooks_the_worker():
    from torch.cuda.graphs import CUDAGraph
    from vllm.v1.worker.gpu_worker import Worker

    import graphtrace.vllm as gv

    begin, end = CUDAGraph.capture_begin, CUDAGraph.capture_end
    with gv.trace_llm():
        assert CUDAGraph.capture_begin is not begin and CUDAGraph.capture_end is not end
        for name in ("load_model", "compile_or_warm_up_model", "shutdown"):
            assert getattr(Worker.__dict__[name], "__graphtrace_wrapped__", False), name
    assert CUDAGraph.capture_begin is begin and CUDAGraph.capture_end is end
