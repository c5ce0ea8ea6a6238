"""Every CUDA graph capture path of vLLM 0.32 ends in CUDAGraph.capture_begin/capture_end,
which graphtrace's trace wraps. Checked on the installed vLLM's source (no GPU needed), so a
vLLM upgrade that adds a capture path graphtrace would miss fails here."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.vllm

# file -> how it captures (vLLM 0.32)
KNOWN_CAPTURE_SITES = {
    "compilation/cuda_graph.py": "torch.cuda.graph",            # CUDAGraphWrapper (V1 runner)
    "compilation/breakable_cudagraph.py": "capture_begin",      # bare CUDAGraph.capture_begin()
    "v1/worker/gpu/cudagraph_utils.py": "torch.cuda.graph",     # Model Runner V2
    "v1/worker/encoder_cudagraph.py": "torch.cuda.graph",       # multimodal encoder graphs
    "v1/worker/gpu_ubatch_wrapper.py": "torch.cuda.graph",      # micro-batching (DBO)
    "v1/spec_decode/gemma4.py": "torch.cuda.graph",             # a drafter's own graphs
    "model_executor/warmup/rocm_segmented_attn_autotune_warmup.py": "torch.cuda.graph",
}
CAPTURE_RE = re.compile(r"torch\.cuda\.graph\(|\.capture_begin\(")
BYPASS_RE = re.compile(r"make_graphed_callables|_C\._CUDAGraph|cudaStreamBeginCapture")


def _vllm_root() -> Path:
    import vllm

    return Path(vllm.__file__).parent


def test_capture_sites_are_the_known_ones():
    root = _vllm_root()
    found, bypass = {}, []
    for f in root.rglob("*.py"):
        text = f.read_text(errors="replace")
        code = "\n".join(ln for ln in text.splitlines() if not ln.lstrip().startswith("#"))
        rel = f.relative_to(root).as_posix()
        if CAPTURE_RE.search(code):
            found[rel] = "capture_begin" if ".capture_begin(" in code else "torch.cuda.graph"
        if BYPASS_RE.search(code):
            bypass.append(rel)
    assert found == KNOWN_CAPTURE_SITES
    assert bypass == []


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
