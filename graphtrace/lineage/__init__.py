"""Lineage: which storages each op wrote from which storages it read (freshness): the
dataflow graph (graph.py, Note [lineage]) and its plug-ins; the modules: docs/internals.md.
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
from graphtrace.lineage.handles import MAX_PENDING, Handle, handle_mode

__all__ = ["ENV", "enabled_by_default", "Lineage", "Source", "Derived", "Handle", "MAX_EDGES",
           "MAX_SOURCES", "MAX_PENDING", "SOURCE_KINDS", "handle_mode", "optimizer_hooks"]
