"""The result of a diff: frames, a graph, report folders and a check for test suites.

This package imports no torch: a report folder written on a GPU machine is read and
analysed anywhere (``load_report``), in Jupyter, in a terminal or in a project's pytest.
Its modules: docs/internals.md's layout table. This docstring is the one description of the
format.

Frames (columns in docs/internals.md) are kept in one canonical form so that a report and
the report read back from its folder compare equal with ``pandas.testing``:

- integer columns are ``int64``; ``live_data_ptr`` is the nullable ``Int64``;
- ``alive`` is ``bool``;
- string columns use pandas' default string dtype. A missing value in a string column
  is ``""`` (unknown), except in ``impact`` and ``origin``, where it is NA and ``""`` is
  read as NA. Categorical string columns stay categorical, with their categories sorted
  and unused ones dropped (both in memory and when read back);
- the index is a fresh ``RangeIndex``; columns are in the documented order, extra columns
  after them (their dtypes are recorded in the manifest and restored);
- ``meta`` is plain JSON data (tuples become lists).

``Report.graph`` is a ``networkx.MultiDiGraph`` built from the frames on first use:

- ``graph:<graph_id>`` (``kind="graph"``, ``graph_id``, ``label``, ``capture``,
  ``n_accesses``), ``storage:<storage_id>`` (``kind="storage"``, ``storage_id``,
  ``data_ptr``, ``nbytes``, ``device``, ``alive``, ``first_access``, ``stale``),
  ``owner:<model>:<path>`` (``kind="owner"``, ``model``, ``path``, ``owner_kind``,
  ``status``);
- graph -> storage, one per row of ``edges``: key and ``relation`` are the row's
  ``access`` (``read``, ``write``, ``read+write``); attributes ``verdict``, ``impact``,
  ``origin`` (``""`` where NA), ``stale`` (True for ``STALE_VERDICTS``), ``ops``,
  ``args``, ``module``, ``dtype``, ``shape``. Edges point from the graph to what it
  touches, so every storage is a sink: its predecessors are the graphs that read it and
  the owners that held it;
- owner -> storage with key/relation ``owned_at_capture`` for every row of ``owners``
  (attributes ``status`` and, when known, ``live_data_ptr``), and a second edge
  ``owns_now`` where the owner still holds the captured storage (status ``holds``).

GraphML cannot store missing values: an NA attribute is left out (or ``""`` for
``impact``/``origin``).
"""

from __future__ import annotations

from graphtrace.report.canonical import ReportError, is_na
from graphtrace.report.check import assert_no_stale
from graphtrace.report.core import Report, load_report
from graphtrace.report.grouping import (
    GROUPINGS,
    NO_LAYER,
    NO_OWNER,
    UNKNOWN_MODULE,
    graph_names,
    group_keys,
    layer_of,
    natural_key,
    split_joined,
)
from graphtrace.report.io import (
    FORMAT,
    FORMAT_VERSION,
    GRAPHML,
    GRAPHML_MAX_EDGES,
    MANIFEST,
    read_graphml,
)
from graphtrace.vocab import FRAMES, IMPACTS, SCHEMA, STALE_VERDICTS, VERDICTS

__all__ = [
    # vocabulary (defined in graphtrace.vocab), re-exported for report users
    "VERDICTS",
    "STALE_VERDICTS",
    "IMPACTS",
    "FRAMES",
    "SCHEMA",
    # the folder format
    "FORMAT",
    "FORMAT_VERSION",
    "MANIFEST",
    "GRAPHML",
    "GRAPHML_MAX_EDGES",
    # reports
    "Report",
    "ReportError",
    "load_report",
    "read_graphml",
    "assert_no_stale",
    # grouping helpers (shared with graphtrace.explore and the CLI)
    "GROUPINGS",
    "UNKNOWN_MODULE",
    "NO_OWNER",
    "NO_LAYER",
    "layer_of",
    "graph_names",
    "natural_key",
    "split_joined",
    "group_keys",
    "is_na",
]
