"""Capture boundaries: `trace()`, `capture()`, emulated graphs, and CUDA graph captures, one
module per concept (docs/internals.md). This package re-exports the session's public names."""

from graphtrace.tracing.emulated import EmulatedGraph
from graphtrace.tracing.session import (
    GraphtraceError,
    Trace,
    active_trace,
    capture,
    trace,
)
from graphtrace.tracing.session import (
    capture_cuda_graph as capture_cuda_graph,  # graphtrace.capture_cuda_graph (lazy)
)

__all__ = ["GraphtraceError", "Trace", "EmulatedGraph", "trace", "capture", "active_trace"]
