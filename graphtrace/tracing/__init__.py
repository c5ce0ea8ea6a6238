"""Capture boundaries: `trace()`, `capture()`, emulated graphs, and CUDA graph captures.

One module per concept: the session (`Trace`, `trace()`, `capture()`,
`capture_cuda_graph()`: session.py), emulated graphs and their keeper (emulated.py), a
capture region (region.py), CUDA graph captures (cudagraphs.py: Note [CUDA graph capture
hooks], Note [CUDA graph labels]) and the recording rule (rule.py: Note [recording while
serving]). This package re-exports the session's public names.
"""

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
