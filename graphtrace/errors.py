"""The exception every layer raises for misuse of the graphtrace API (imports no torch)."""

from __future__ import annotations

__all__ = ["GraphtraceError", "NothingToCheck"]


class GraphtraceError(RuntimeError):
    """Misuse of the graphtrace API (raised to the caller, never from inside a traced op)."""


class NothingToCheck(GraphtraceError, ValueError):
    """`t.diff()` or `t.guard()` with nothing to check: no capture, or no watched model.
    A ValueError too, which `t.diff()` raised for it before (graphtrace.stage.require)."""
