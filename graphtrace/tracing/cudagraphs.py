"""CUDA graph captures: how a trace learns that one began or ended (torch's capture hooks or
a wrap of `CUDAGraph`: Note [CUDA graph capture hooks]), and the labels `capture(label,
cuda_graph=g)` gives them (Note [CUDA graph labels])."""

from __future__ import annotations

import threading
import weakref
from typing import TYPE_CHECKING, Any, Callable

import torch

from graphtrace._compat import CAPTURE_HOOKS
from graphtrace.errors import GraphtraceError
from graphtrace.tracing.region import _Region

if TYPE_CHECKING:
    from graphtrace.tracing.session import Trace

__all__ = ["CAPTURE_HOOKS_PUBLIC", "CAPTURE_HOOKS_WRAP", "CudaGraphCaptures"]


# Note [CUDA graph capture hooks]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# A trace learns that a CUDA graph capture began or ended in one of two ways, chosen once per
# trace and named in its report's meta["capture_hooks"]:
#
# - "torch.cuda.graphs hooks" (torch >= 2.14, `CAPTURE_HOOKS` from _compat): torch's public
#   register_graph_capture_start_hook / _end_hook, removed again when the trace closes. The
#   start hook runs right after capture began on the stream (so it issues no CUDA work), the
#   end hook once capture ended, before the graph is instantiated. torch swallows a hook's
#   exceptions (one consumer must not break a capture), so a strict trace keeps what its hook
#   raised and raises it when the trace closes. The pool a capture was given is not passed
#   to the hook: the graph's own `pool()` is recorded instead.
# - "CUDAGraph wrap" (torch 2.11 to 2.13): CUDAGraph.capture_begin/capture_end replaced by
#   wrappers while the trace is open (errors propagate from the wrapper).
#
# Both see the same captures: a `torch.cuda.graph` block, a bare capture_begin()/capture_end(),
# Inductor's cudagraph trees (all go through CUDAGraph.capture_begin/capture_end).
CAPTURE_HOOKS_PUBLIC = "torch.cuda.graphs hooks"
CAPTURE_HOOKS_WRAP = "CUDAGraph wrap"


def _graph_pool(graph) -> Any:
    """The memory pool a capturing graph uses (None where it cannot say)."""
    try:
        return graph.pool()
    except Exception:  # a graph whose C side is not set up (tests' fakes): no pool to name
        return None


class _CudaGraphHooks:
    """Learns of every CUDA graph capture through torch's public capture hooks."""

    how = CAPTURE_HOOKS_PUBLIC

    def __init__(self, trace: "Trace", hooks: tuple[Callable, Callable]):
        self.trace = weakref.ref(trace)  # the trace holds this: no cycle back
        self.register_start, self.register_end = hooks
        self.handles: list = []
        self.pending: list[BaseException] = []  # raised by a hook in strict mode (see Note)

    def install(self) -> None:
        trace_ref, pending = self.trace, self.pending

        def capture_started(graph) -> None:
            trace = trace_ref()
            if trace is not None:
                try:
                    trace._cuda_begin(graph, (_graph_pool(graph),), {})
                except BaseException as exc:  # strict: torch would swallow it
                    pending.append(exc)

        def capture_ended(graph) -> None:
            trace = trace_ref()
            if trace is not None:
                try:
                    trace._cuda_end(graph)
                except BaseException as exc:
                    pending.append(exc)

        self.handles = [self.register_start(capture_started), self.register_end(capture_ended)]

    def uninstall(self) -> None:
        handles, self.handles = self.handles, []
        for handle in handles:
            handle.remove()


class _CudaGraphPatch:
    """Wraps CUDAGraph.capture_begin/end so that every CUDA graph capture is recorded (torch
    without public capture hooks)."""

    how = CAPTURE_HOOKS_WRAP

    def __init__(self, trace: "Trace"):
        self.trace = weakref.ref(trace)  # the trace holds this patch: no cycle back
        self.cls = None
        self.saved: dict[str, Callable] = {}
        self.pending: list[BaseException] = []  # (errors propagate from the wrappers)

    def install(self) -> None:
        try:
            from torch.cuda.graphs import CUDAGraph
        except Exception:  # a build without torch.cuda graphs: nothing to wrap
            return
        self.cls = CUDAGraph
        self.saved = {"capture_begin": CUDAGraph.__dict__.get("capture_begin"),
                      "capture_end": CUDAGraph.__dict__.get("capture_end")}
        begin = CUDAGraph.capture_begin
        end = CUDAGraph.capture_end
        trace_ref = self.trace

        def capture_begin(graph, *args, **kwargs):
            out = begin(graph, *args, **kwargs)
            trace = trace_ref()
            if trace is not None:
                trace._cuda_begin(graph, args, kwargs)
            return out

        def capture_end(graph, *args, **kwargs):
            trace = trace_ref()
            if trace is not None:
                trace._cuda_end(graph)
            return end(graph, *args, **kwargs)

        CUDAGraph.capture_begin = capture_begin
        CUDAGraph.capture_end = capture_end

    def uninstall(self) -> None:
        if self.cls is None:
            return
        for name, fn in self.saved.items():
            if fn is None:
                delattr(self.cls, name)
            else:
                setattr(self.cls, name, fn)
        self.cls = None


def _capture_watcher(trace: "Trace") -> "_CudaGraphHooks | _CudaGraphPatch":
    """torch's public capture hooks where this torch has them, else the wrap (Note [CUDA graph
    capture hooks])."""
    hooks = CAPTURE_HOOKS
    return _CudaGraphHooks(trace, hooks) if hooks is not None else _CudaGraphPatch(trace)


def _current_stream() -> str:
    try:
        return str(torch.cuda.current_stream())
    except Exception:  # no CUDA runtime (a fake graph in tests): nothing to name
        return ""


# Note [CUDA graph labels]
# ~~~~~~~~~~~~~~~~~~~~~~~~
# Every CUDA graph captured while a trace is open is recorded (through torch's capture hooks,
# or by wrapping CUDAGraph.capture_begin/capture_end: Note [CUDA graph capture hooks]), under a
# generated label. To name it, wrap the capture:
#
#     with gt.capture("decode", cuda_graph=g):
#         with torch.cuda.graph(g):
#             model(x)
#
# Inside the context, a capture of `g` begun on this thread is recorded under "decode"; no
# emulated region is opened (the real graph is the record, and it is replayed with
# g.replay()). Other graphs, and `g` captured on other threads, keep their generated labels.
# The context must see `g` captured: closing it without a capture is a GraphtraceError.
# Without `cuda_graph`, capture() opens an emulated region as before. `capture_cuda_graph`
# is the warm-up-and-capture recipe built on it.


class CudaGraphCaptures:
    """The CUDA graph captures of a `Trace` (a part of it): their labels, and the region each
    one opens on its thread (Note [CUDA graph labels], Note [CUDA graph capture hooks])."""

    def _label_cuda_graph(self, graph, label: str | None) -> None:
        key = (threading.get_ident(), id(graph))
        if key in self._cuda_labels:
            raise GraphtraceError(f"this CUDA graph is already labelled "
                                  f"{self._cuda_labels[key][0]!r} on this thread")
        self._cuda_labels[key] = [label, False]

    def _unlabel_cuda_graph(self, graph) -> bool:
        """Drop the label of `graph` on this thread; whether a capture of it began meanwhile."""
        entry = self._cuda_labels.pop((threading.get_ident(), id(graph)), None)
        return bool(entry and entry[1])

    def _cuda_begin(self, graph, args, kwargs) -> None:
        entry = self._cuda_labels.get((threading.get_ident(), id(graph)))
        if entry is not None:
            entry[1] = True
        outer = self._open_region()
        if outer is not None:  # recorded once, by the region already open on this thread
            self.add_blind_spot(f"a CUDA graph was captured inside capture region "
                                f"{outer.capture.label!r}: its ops are recorded there",
                                kind="nested capture", graph=outer.capture.label or "")
            return
        try:
            label = entry[0] if entry is not None else None
            region = _Region(self, label, "cuda", emulate=False)
            pool = args[0] if args else kwargs.get("pool")
            region.capture.info = {"pool": repr(pool) if pool is not None else "",
                                   "stream": _current_stream()}
            self._cuda_regions[id(graph)] = region
            region.open()
        except Exception as exc:
            self.recorder.fail("cuda capture_begin", exc)

    def _cuda_end(self, graph) -> None:
        region = self._cuda_regions.pop(id(graph), None)
        if region is not None:
            try:
                region.close()
            except Exception as exc:
                self.recorder.fail("cuda capture_end", exc)
