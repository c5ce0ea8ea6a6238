"""graphtrace's own time, section by section (``GRAPHTRACE_CLOCK=1``; off by default).

Used to account what tracing adds to an engine's startup (analysis/bench_startup.py)::

    GRAPHTRACE_CLOCK=1 python ...      # then, in that process:
    from graphtrace import clock
    clock.CLOCK.report()  # {"sections": {name: {"wall_s", "cpu_s", "calls"}}, "wall_s", "cpu_s"}

See Note [self clock].
"""

from __future__ import annotations

import os
import threading
import time
from contextlib import contextmanager, nullcontext

__all__ = ["ENV", "Clock", "CLOCK", "section", "outside"]

ENV = "GRAPHTRACE_CLOCK"

# Note [self clock]
# ~~~~~~~~~~~~~~~~~
# graphtrace's entry points that run during an engine's startup (the plugin's `register`,
# each hook listener, a trace's construction and entry, the owner walk, the blind-spot scan,
# the dispatch modes' own work per op, the import-time patching of vLLM's modules) open a
# named *section*; code of the engine that runs inside one (the wrapped original method, the
# op a dispatch mode forwards) is an `outside` section. Time is exclusive: a section's time
# is its own wall (time.perf_counter) and CPU (time.process_time: the whole process, so a
# torch op's intra-op threads count) less that of the sections nested in it; `outside` time
# counts for no one. The sum over named sections is graphtrace's own time. Not seen: the
# Python call of a mode's `__torch_dispatch__` / `__torch_function__` itself (torch's mode
# machinery around it, a few microseconds per op; `calls` says how many), and imports made
# at a module's top level before any section opens (the benchmark times its own imports).
# Off (the default) every hook is a `None` check: `CLOCK` is None and `section` returns a
# shared null context. Read once, at import: set the variable before importing graphtrace.


class Clock:
    """Exclusive wall and CPU time per named section, per thread (see Note [self clock])."""

    def __init__(self):
        self.totals: dict[str, list] = {}  # name -> [wall, cpu, calls]
        self._local = threading.local()
        self._lock = threading.Lock()

    def _stack(self) -> list:
        stack = getattr(self._local, "stack", None)
        if stack is None:
            stack = self._local.stack = []
        return stack

    def enter(self, name: str | None) -> None:
        """Open a section (`None`: the engine's own code inside graphtrace's)."""
        self._stack().append([name, time.perf_counter(), time.process_time(), 0.0, 0.0])

    def leave(self) -> None:
        wall, cpu = time.perf_counter(), time.process_time()
        stack = self._stack()
        name, w0, c0, child_w, child_c = stack.pop()
        wall -= w0
        cpu -= c0
        if stack:
            stack[-1][3] += wall
            stack[-1][4] += cpu
        if name is not None:
            with self._lock:
                entry = self.totals.get(name)
                if entry is None:
                    entry = self.totals[name] = [0.0, 0.0, 0]
                entry[0] += wall - child_w
                entry[1] += cpu - child_c
                entry[2] += 1

    @contextmanager
    def section(self, name: str | None):
        self.enter(name)
        try:
            yield
        finally:
            self.leave()

    def report(self) -> dict:
        """Plain JSON: each section's exclusive seconds and calls, and their sums."""
        with self._lock:
            sections = {k: {"wall_s": v[0], "cpu_s": v[1], "calls": v[2]}
                        for k, v in sorted(self.totals.items(), key=lambda kv: -kv[1][0])}
        return {"sections": sections,
                "wall_s": sum(s["wall_s"] for s in sections.values()),
                "cpu_s": sum(s["cpu_s"] for s in sections.values())}


def _from_env() -> Clock | None:
    value = os.environ.get(ENV, "").strip().lower()
    return Clock() if value in ("1", "on", "true", "yes") else None


#: The process's clock, or None (the default: nothing is timed).
CLOCK: Clock | None = _from_env()
_NULL = nullcontext()


def section(name: str):
    """``with clock.section("owners"): ...``; a shared null context when the clock is off."""
    return CLOCK.section(name) if CLOCK is not None else _NULL


def outside():
    """The engine's own code run inside a section (not graphtrace's time)."""
    return CLOCK.section(None) if CLOCK is not None else _NULL
