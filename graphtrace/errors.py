"""The exception every layer raises for misuse of the graphtrace API (imports no torch)."""

from __future__ import annotations

__all__ = ["GraphtraceError"]


class GraphtraceError(RuntimeError):
    """Misuse of the graphtrace API (raised to the caller, never from inside a traced op)."""
