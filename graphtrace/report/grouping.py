"""Group keys of a report's edges: layers, display names of graphs, ``summary(by=...)``.

Public because :mod:`graphtrace.explore` groups and sorts the same way as
``Report.summary``; everything here is a function of frames, never of a Report.
"""

from __future__ import annotations

import re
from typing import Any, Iterable

import pandas as pd

from graphtrace.report.canonical import _as_strings, is_na
from graphtrace.vocab import VERDICTS

__all__ = [
    "GROUPINGS", "UNKNOWN_MODULE", "NO_OWNER", "NO_LAYER",
    "layer_of", "graph_names", "natural_key", "split_joined", "group_keys",
]

UNKNOWN_MODULE = "(unknown)"
NO_OWNER = "(none)"
NO_LAYER = "(none)"
GROUPINGS = ("verdict", "graph", "module", "layer", "op", "owner_kind", "access")

_LAYER_RE = re.compile(r"(?:^|\.)((?:layers|layer|h|blocks|block)\.\d+)(?=$|[.\[])")


def layer_of(path: str | None) -> str:
    """The ``layers.N`` component of a module or owner path, or ``""``.

    ``model.layers.3.mlp.down_proj`` -> ``layers.3``. ``h.N``, ``blocks.N``, ``layer.N``
    (GPT-2, ViT, BERT spellings) count as layers too and keep their own spelling.
    """
    if not isinstance(path, str) or not path:
        return ""
    m = _LAYER_RE.search(path)
    return m.group(1) if m else ""


def natural_key(s: Any) -> list[tuple[int, int, str]]:
    """Sort key that orders the numbers inside a name by value: ``layers.2`` before
    ``layers.10`` (the order of every grouped table)."""
    return [(0, int(t), "") if t.isdigit() else (1, 0, t)
            for t in re.split(r"(\d+)", str(s)) if t]


def graph_names(graph_ids: Iterable[int], labels: Iterable[Any]) -> dict[int, str]:
    """``{graph_id: name}`` for display: the label, or ``label#id`` where several graphs
    share a label (``#id`` for an empty one)."""
    pairs = {}
    for gid, label in zip(graph_ids, labels):
        pairs.setdefault(int(gid), "" if is_na(label) else str(label))
    count: dict[str, int] = {}
    for label in pairs.values():
        count[label] = count.get(label, 0) + 1
    return {gid: label if label and count[label] == 1 else f"{label}#{gid}"
            for gid, label in pairs.items()}


def split_joined(value: Any, sep: str) -> list[str]:
    """The distinct non-empty parts of a ``sep``-joined cell (``owners``, ``ops`` and
    ``owner_kinds`` of an edge are ``;``-joined), in order; ``[]`` for NA or ``""``."""
    if not isinstance(value, str) or not value:
        return []
    seen: dict[str, None] = {}
    for part in value.split(sep):
        part = part.strip()
        if part:
            seen.setdefault(part, None)
    return list(seen)


def group_keys(edges: pd.DataFrame, by: str) -> pd.Series:
    """One group key per edge (several for ``op`` and ``owner_kind``), indexed like edges.

    ``by`` is one of GROUPINGS. ``module``: the edge's module, ``(unknown)`` when empty.
    ``layer``: ``layers.N`` of the module, else of the first owner path that has one, else
    ``(none)``. ``op``: every distinct op of the edge. ``owner_kind``: every kind of
    owner, ``(none)`` for edges without owners. ``graph``: the graph's display name.
    """
    if by not in GROUPINGS:
        raise ValueError(f"by must be one of {', '.join(GROUPINGS)}; got {by!r}")
    if by == "verdict":
        keys = _as_strings(edges["verdict"]).astype(object)
    elif by == "graph":
        names = graph_names(edges["graph_id"], edges["graph"])
        keys = edges["graph_id"].map(names).astype(object)
    elif by == "access":
        keys = _as_strings(edges["access"]).astype(object)
    elif by == "module":
        keys = _as_strings(edges["module"]).astype(object).map(
            lambda m: m if isinstance(m, str) and m else UNKNOWN_MODULE)
    elif by == "layer":
        def _layer(row):
            lay = layer_of(row[0])
            if lay:
                return lay
            for p in split_joined(row[1], ";"):
                lay = layer_of(p)
                if lay:
                    return lay
            return NO_LAYER
        keys = pd.Series([_layer(r) for r in zip(edges["module"].astype(object),
                                                 edges["owners"].astype(object))],
                         index=edges.index, dtype=object)
    elif by == "op":
        keys = edges["ops"].astype(object).map(
            lambda v: split_joined(v, ";") or [""]).explode()
    else:  # owner_kind
        keys = edges["owner_kinds"].astype(object).map(
            lambda v: split_joined(v, ";") or [NO_OWNER]).explode()
    keys.name = by
    return keys


def _crosstab(edges: pd.DataFrame, by: str) -> pd.DataFrame:
    """``Report.summary(by=by)``: one row per group, one column per verdict and ``total``."""
    keys = group_keys(edges, by)
    verdicts = edges["verdict"].astype(object).reindex(keys.index)
    frame = pd.DataFrame({by: keys.to_numpy(), "verdict": verdicts.to_numpy()})
    table = pd.crosstab(frame[by], frame["verdict"]) if len(frame) else pd.DataFrame()
    table = table.reindex(columns=list(VERDICTS), fill_value=0)
    table = table.astype("int64")
    table["total"] = table.sum(axis=1).astype("int64")
    table.columns = pd.Index(list(table.columns), dtype=object)
    table.columns.name = None
    if by == "graph" and len(edges):
        names = graph_names(edges["graph_id"], edges["graph"])
        order = [names[g] for g in sorted(names)]
    else:
        order = sorted(table.index, key=natural_key)
    table = table.reindex(order)
    table.index = pd.Index(list(table.index), dtype=object, name=by)
    return table
