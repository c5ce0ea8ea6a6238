"""Lineage: which storages each op wrote from which storages it read (freshness).

The dataflow graph (`Lineage`, graphtrace/lineage/graph.py: Note [lineage]) and its
plug-ins (Note [lineage plug-ins]): non-idempotent steps and carried-over state
(graphtrace/lineage/steps.py), handles and their dangling sources with the function mode
that sees handle ops (graphtrace/lineage/handles.py); what an op's schema says lineage
needs (graphtrace/lineage/ops.py).
"""

from graphtrace.lineage.graph import (
    ENV,
    MAX_EDGES,
    MAX_SOURCES,
    SOURCE_KINDS,
    Derived,
    Lineage,
    Source,
    enabled_by_default,
    optimizer_hooks,
)
from graphtrace.lineage.handles import (
    MAX_PENDING,
    Handle,
    HandleMode,
    handle_mode,
    invisible_handle_ops,
)

__all__ = ["ENV", "enabled_by_default", "Lineage", "Source", "Derived", "Handle", "MAX_EDGES",
           "MAX_SOURCES", "MAX_PENDING", "SOURCE_KINDS", "HandleMode", "handle_mode",
           "invisible_handle_ops", "optimizer_hooks"]
