"""`gt.capture(label, cuda_graph=g)`: naming a real CUDA graph's capture (Note [CUDA graph
labels]) and `gt.capture_cuda_graph`, tested on a CPU.

A CPU torch cannot capture a CUDA graph, so the tests that follow a label into a capture
drive the trace's own CUDA begin/end path (`Trace._cuda_begin/_cuda_end`, what the wrapped
`CUDAGraph.capture_begin/capture_end` call) with a fake CUDAGraph subclass: there is no
public way to reach that path here. tests/gpu runs the real thing on CUDA.

How the trace learns of captures (Note [CUDA graph capture hooks]) is tested on both paths:
torch's public capture hooks, through a fake hook registry (and torch's own registry where
this torch has one, with a CUDAGraph whose C side does no CUDA work), and the wrap of
CUDAGraph.capture_begin/capture_end, around fake begin/end methods."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest
import torch
from torch.cuda.graphs import CUDAGraph

import graphtrace as gt
from graphtrace import _compat
from graphtrace.tracing import cudagraphs, region


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


# --------------------------------------------------------------------------------------
# how the trace learns of captures: torch's public hooks, or the wrap
# --------------------------------------------------------------------------------------

class FakeHookRegistry:
    """torch.cuda.graphs' global capture hooks as torch 2.14 has them: register(fn) returns a
    handle with remove(); a capture runs every start hook after it began and every end hook
    before it ends, swallowing their exceptions (as torch's _run_global_hooks does)."""

    def __init__(self):
        self.start, self.end = {}, {}

    def hooks(self):
        def register(table):
            def register_hook(fn):
                key = object()
                table[key] = fn
                return SimpleNamespace(remove=lambda: table.pop(key, None))
            return register_hook
        return register(self.start), register(self.end)

    def capture(self, graph, fn):
        self._run(self.start, graph)
        out = fn()
        self._run(self.end, graph)
        return out

    @staticmethod
    def _run(table, graph):
        for fn in list(table.values()):
            try:
                fn(graph)
            except Exception:
                pass


def test_public_capture_hooks_path(monkeypatch):
    registry = FakeHookRegistry()
    monkeypatch.setattr(cudagraphs, "CAPTURE_HOOKS", registry.hooks())
    unwrapped = CUDAGraph.__dict__.get("capture_begin")
    g, model, x = fake_graph(), torch.nn.Linear(4, 4), torch.ones(2, 4)
    with gt.trace(model, strict=True) as t:
        assert len(registry.start) == 1 and len(registry.end) == 1
        assert CUDAGraph.__dict__.get("capture_begin") is unwrapped  # no wrap beside the hooks
        with gt.capture("decode", cuda_graph=g):
            registry.capture(g, lambda: model(x))
        registry.capture(fake_graph(), lambda: model(x))
    assert registry.start == {} and registry.end == {}  # removed when the trace closed
    assert [(c.label, c.kind) for c in t.captures] == [("decode", "cuda"), ("graph1", "cuda")]
    assert t.captures[0].n_accesses > 0 and t.errors == []
    assert t.diff().meta["capture_hooks"] == "torch.cuda.graphs hooks"


def test_capture_wrap_path_without_public_hooks(monkeypatch):
    calls = []
    monkeypatch.setattr(cudagraphs, "CAPTURE_HOOKS", None)
    monkeypatch.setattr(CUDAGraph, "capture_begin", lambda self, *a, **k: calls.append("begin"))
    monkeypatch.setattr(CUDAGraph, "capture_end", lambda self: calls.append("end"))
    fake_begin = CUDAGraph.__dict__["capture_begin"]
    g, model = fake_graph(), torch.nn.Linear(4, 4)
    with gt.trace(model, strict=True) as t:
        assert CUDAGraph.__dict__["capture_begin"] is not fake_begin  # wrapped
        with gt.capture("decode", cuda_graph=g):
            g.capture_begin()
            model(torch.ones(2, 4))
            g.capture_end()
    assert CUDAGraph.__dict__["capture_begin"] is fake_begin  # unwrapped when it closed
    assert calls == ["begin", "end"]
    assert [(c.label, c.kind) for c in t.captures] == [("decode", "cuda")]
    assert t.captures[0].n_accesses > 0 and t.errors == []
    assert t.diff().meta["capture_hooks"] == "CUDAGraph wrap"


def test_the_path_follows_this_torch():
    if hasattr(torch.cuda.graphs, "register_graph_capture_start_hook"):  # torch >= 2.14
        assert _compat.CAPTURE_HOOKS == (torch.cuda.graphs.register_graph_capture_start_hook,
                                         torch.cuda.graphs.register_graph_capture_end_hook)
    else:
        assert _compat.CAPTURE_HOOKS is None
    model = torch.nn.Linear(4, 4)
    with gt.trace(model) as t:
        with gt.capture("step"):
            model(torch.ones(2, 4))
    expected = "CUDAGraph wrap" if _compat.CAPTURE_HOOKS is None else "torch.cuda.graphs hooks"
    assert t.diff().meta["capture_hooks"] == expected


def test_hook_errors_are_kept_despite_torch_swallowing_them(monkeypatch):
    registry = FakeHookRegistry()
    monkeypatch.setattr(cudagraphs, "CAPTURE_HOOKS", registry.hooks())

    def broken(self):
        raise RuntimeError("region open failed")

    monkeypatch.setattr(region._Region, "open", broken)
    with pytest.raises(RuntimeError, match="region open failed"):  # strict: raised at close
        with gt.trace(strict=True):
            registry.capture(fake_graph(), lambda: torch.ones(4) + 1)
    with gt.trace() as t:  # fail open: counted, the trace goes on
        registry.capture(fake_graph(), lambda: torch.ones(4) + 1)
    assert [e["where"] for e in t.errors][0] == "cuda capture_begin"


def _graph_without_cuda():
    """A torch.cuda.graphs.CUDAGraph (torch's own Python class, its hooks included) whose C
    methods do no CUDA work: capture_begin..capture_end run torch's real hook fan-out on CPU."""
    base = CUDAGraph.__bases__[0]  # torch._C._CUDAGraph

    class NoCuda(base):
        def capture_begin(self, pool=None, capture_error_mode="global"):
            pass

        def capture_end_pre(self):
            pass

        def capture_end_post(self):
            pass

        def instantiate(self):
            pass

    class Graph(CUDAGraph, NoCuda):
        pass

    return Graph.__new__(Graph)


@pytest.mark.skipif(_compat.CAPTURE_HOOKS is None, reason="this torch has no public capture hooks")
def test_torch_capture_hooks_reach_the_trace():
    g = _graph_without_cuda()
    unwrapped = CUDAGraph.__dict__["capture_begin"]
    with gt.trace(strict=True) as t:
        assert CUDAGraph.__dict__["capture_begin"] is unwrapped  # torch's hooks, no wrap
        with gt.capture("decode", cuda_graph=g):
            g.capture_begin()
            torch.add(torch.ones(4), 1)
            g.capture_end()
    g.capture_begin()  # after the trace: its hooks are gone
    g.capture_end()
    assert [(c.label, c.kind) for c in t.captures] == [("decode", "cuda")]
    assert t.captures[0].n_accesses > 0 and t.errors == []
