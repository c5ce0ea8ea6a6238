"""graphtrace: find the tensors a CUDA graph will read stale after a weight reload.

    import graphtrace as gt
    with gt.trace(model) as t:
        with gt.capture("decode_bs8") as g:
            model(x)
    reload_weights(model)
    report = t.diff()
    report.stale

Importing graphtrace does not import torch: reports can be read on a machine without it.
"""

from __future__ import annotations

from graphtrace._lazy import lazy_exports

__version__ = "0.1.0"

_LAZY = {
    "trace": "graphtrace.tracing",
    "capture": "graphtrace.tracing",
    "capture_cuda_graph": "graphtrace.tracing",
    "Trace": "graphtrace.tracing",
    "EmulatedGraph": "graphtrace.tracing",
    "GraphtraceError": "graphtrace.errors",
    "Guard": "graphtrace.guard",
    "StaleGraphError": "graphtrace.guard",
    "load_guard": "graphtrace.guard",
    "Report": "graphtrace.report",
    "ReportError": "graphtrace.report",
    "load_report": "graphtrace.report",
    "assert_no_stale": "graphtrace.report",
    "VERDICTS": "graphtrace.vocab",
    "STALE_VERDICTS": "graphtrace.vocab",
    "BlindSpot": "graphtrace.blindspots",
}

__all__ = ["__version__", *_LAZY]


__getattr__, __dir__ = lazy_exports(__name__, globals(), _LAZY)
del lazy_exports
