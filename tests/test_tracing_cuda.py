"""`gt.capture(label, cuda_graph=g)`: naming a real CUDA graph's capture (Note [CUDA graph
labels]) and `gt.capture_cuda_graph`, tested on a CPU.

A CPU torch cannot capture a CUDA graph, so the tests that follow a label into a capture
drive the trace's own CUDA begin/end path (`Trace._cuda_begin/_cuda_end`, what the wrapped
`CUDAGraph.capture_begin/capture_end` call) with a fake CUDAGraph subclass: there is no
public way to reach that path here. tests/gpu runs the real thing on CUDA."""

from __future__ import annotations

import threading

import pytest
import torch
from torch.cuda.graphs import CUDAGraph

import graphtrace as gt


class FakeGraph(CUDAGraph):
    """A CUDAGraph never constructed: the trace uses only its identity (and isinstance)."""


def fake_graph() -> FakeGraph:
    """A FakeGraph allocated without running a constructor. A CPU torch's CUDAGraph base is a
    dummy whose constructor raises; a CUDA build's is a C (pybind11) type whose constructor
    initialises CUDA, which fails without a GPU, and it refuses `object.__new__` ("not safe")
    but its own `__new__` only allocates. `FakeGraph()` cannot be used there: pybind11 checks
    that the C constructor ran."""
    try:
        return object.__new__(FakeGraph)           # the dummy base (CPU build)
    except TypeError:
        return CUDAGraph.__bases__[0].__new__(FakeGraph)  # torch._C._CUDAGraph (CUDA build)


def _capture_on(t, graph, x):
    """What the wrapped capture_begin/capture_end do around a capture of `graph`."""
    t._cuda_begin(graph, (), {})
    try:
        return torch.add(x, 1)
    finally:
        t._cuda_end(graph)


def test_label_reaches_the_cuda_capture():
    x = torch.ones(4)
    g, other = fake_graph(), fake_graph()
    with gt.trace(strict=True) as t:
        with gt.capture("decode", cuda_graph=g) as yielded:
            assert yielded is g
            _capture_on(t, g, x)
            _capture_on(t, other, x)  # another graph in the context keeps its generated label
        _capture_on(t, g, x)          # after the context: no label either
    assert [(c.label, c.kind) for c in t.captures] == [
        ("decode", "cuda"), ("graph1", "cuda"), ("graph2", "cuda")]
    assert t.captures[0].n_accesses > 0
    assert t.errors == []


def test_label_is_for_this_thread_only():
    x = torch.ones(4)
    g = fake_graph()
    with gt.trace(strict=True) as t:
        with gt.capture("decode", cuda_graph=g):
            worker = threading.Thread(target=_capture_on, args=(t, g, x))
            worker.start()
            worker.join()
            _capture_on(t, g, x)
    assert [c.label for c in t.captures] == ["graph0", "decode"]


def test_context_without_its_capture_is_an_error():
    g = fake_graph()
    with gt.trace() as t:
        with pytest.raises(gt.GraphtraceError, match=r"capture\('decode', cuda_graph=...\) closed "
                                                     r"without capturing its graph"):
            with gt.capture("decode", cuda_graph=g):
                pass
        with pytest.raises(KeyError):  # an error inside is not hidden by that one
            with gt.capture("decode", cuda_graph=g):
                raise KeyError("inner")
        with gt.capture("again", cuda_graph=g):  # the label was dropped: usable again
            with pytest.raises(gt.GraphtraceError, match="already labelled 'again'"):
                with gt.capture("twice", cuda_graph=g):
                    pass
            _capture_on(t, g, torch.ones(2))
    assert [c.label for c in t.captures] == ["again"]


def test_argument_validation():
    with pytest.raises(TypeError, match="cuda_graph must be a torch.cuda.CUDAGraph, got str"):
        gt.capture("decode", cuda_graph="g")
    with pytest.raises(TypeError, match="capture label must be a str"):
        gt.capture(3, cuda_graph=fake_graph())
    with pytest.raises(gt.GraphtraceError, match="inside `with graphtrace.trace"):
        with gt.capture("decode", cuda_graph=fake_graph()):
            pass


def test_emulated_capture_is_unchanged():
    x = torch.ones(4)
    with gt.trace(strict=True) as t:
        with gt.capture("prefill") as g:
            y = x * 2
    assert isinstance(g, gt.EmulatedGraph) and g.label == "prefill"
    assert [(c.label, c.kind) for c in t.captures] == [("prefill", "emulated")]
    x.fill_(3)
    g.replay()
    assert torch.equal(y, torch.full((4,), 6.0))


def test_capture_cuda_graph_needs_cuda_and_checks_its_arguments():
    if torch.cuda.is_available():
        pytest.skip("CUDA is available: tests/gpu captures for real")
    with pytest.raises(TypeError, match="needs a callable, got int"):
        gt.capture_cuda_graph(3, "decode")
    with pytest.raises(ValueError, match="warmup must be a non-negative int"):
        gt.capture_cuda_graph(lambda: None, "decode", warmup=-1)
    with pytest.raises(gt.GraphtraceError, match=r"needs CUDA .*use graphtrace.capture\(label\)"):
        gt.capture_cuda_graph(lambda: None, "decode")
