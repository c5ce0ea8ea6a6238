"""The guard: after every weight update, are the storages the captured graphs read still
where their capture-time owners point?

``guard = t.guard()`` keeps, for every *owned* storage a captured graph reads or writes, a
weak handle to it and its owner paths; nothing else from the trace and nothing alive (models
by weak reference). ``guard.check()`` re-resolves just those paths on the live model(s)
(`graphtrace.owners.resolve_path`) and asks the verdict engine (graphtrace.verdict) what each
storage is, as diff does, so verdicts and impacts agree with ``t.diff()`` by construction.
Its manifest (docs/guard.md) is read back here or in an engine without graphtrace (what
such a guard can and cannot tell: Note [guard identity] in graphtrace/guard/manifest.py).
"""

from graphtrace.guard.blind import accepted_kinds
from graphtrace.guard.build import guard_of, load_guard
from graphtrace.guard.check import Guard, empty_problems
from graphtrace.guard.describe import StaleGraphError, describe
from graphtrace.guard.manifest import FORMAT, FORMAT_VERSION

__all__ = ["Guard", "StaleGraphError", "load_guard", "guard_of", "accepted_kinds",
           "describe", "empty_problems", "FORMAT", "FORMAT_VERSION"]
