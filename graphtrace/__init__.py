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

__version__ = "0.1.0"

_LAZY = {
    "trace": "graphtrace.tracing",
    "capture": "graphtrace.tracing",
    "capture_cuda_graph": "graphtrace.tracing",
    "Trace": "graphtrace.tracing",
    "EmulatedGraph": "graphtrace.tracing",
    "GraphtraceError": "graphtrace.tracing",
    "Report": "graphtrace.report",
    "ReportError": "graphtrace.report",
    "load_report": "graphtrace.report",
    "assert_no_stale": "graphtrace.report",
    "VERDICTS": "graphtrace.vocab",
    "STALE_VERDICTS": "graphtrace.vocab",
}

__all__ = ["__version__", *_LAZY]


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'graphtrace' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_LAZY))
