"""What a failed guard check says: `StaleGraphError` and `describe` (one line per storage)."""

from __future__ import annotations

import pandas as pd

from graphtrace.errors import GraphtraceError
from graphtrace.vocab import GUARD_PROBLEMS, GUARD_UNCHECKED

__all__ = ["StaleGraphError", "describe"]


class StaleGraphError(GraphtraceError):
    """A weight update left captured graphs reading storages their owners no longer hold.

    ``problems`` is the DataFrame `Guard.check()` returned (one row per problem edge).
    """

    def __init__(self, message: str, problems: pd.DataFrame):
        super().__init__(message)
        self.problems = problems

    def __reduce__(self):  # crosses vLLM's process boundaries (collective_rpc errors)
        return (type(self), (str(self), self.problems))


_WHAT = {"stale": "owners moved; the graph reads the old values",
         "dangling": "owners moved and the captured storage was freed; the graph reads freed memory",
         "diverged": "owners disagree: some hold the captured storage, others moved",
         "orphaned": "the owner path no longer resolves",
         "unrefreshed": "derived from parameters or buffers that changed since it was last "
                        "written; the graph reads an old value at the right address"}


def describe(problems: pd.DataFrame, limit: int = 20) -> str:
    """A readable list of `check()`'s problems, one line per storage (its graphs named)."""
    if problems.empty:
        return "no problems: every captured storage is still where its owners point"
    blind = problems[problems["verdict"] == GUARD_UNCHECKED] if "blind_spot" in problems \
        else problems.iloc[:0]
    edges = problems.drop(index=blind.index)
    lines = _describe_edges(edges, limit) if len(edges) else []
    if len(blind):
        lines.append(f"{len(blind)} blind spot(s) of the captured graphs may have been "
                     "invalidated by the update and cannot be checked (accept a kind with "
                     "t.guard(accept=[...]) once you know it is safe):")
        for r in blind.head(limit).itertuples(index=False):
            what = {"": "nothing to check it by", "moved": "its holder moved",
                    "orphaned": "its holder is gone", "changed": "its holder's value changed",
                    "written": "its holder was written in place",
                    "not rebuilt": "its source changed since"}.get(r.statuses, r.statuses)
            lines.append(f"  {r.blind_spot}: {r.note} [{what}]")
        if len(blind) > limit:
            lines.append(f"  ... and {len(blind) - limit} more (guard.check() has all)")
    return "\n".join(lines)


def _describe_edges(problems: pd.DataFrame, limit: int) -> list[str]:
    n_storages = problems["storage_id"].nunique()
    n_graphs = problems["graph_id"].nunique()
    lines = [f"{n_storages} captured storage(s) read by {n_graphs} graph(s) are no longer "
             f"where their owners point after the weight update "
             f"({len(problems)} problem edge(s)):"]
    for shown, (sid, rows) in enumerate(problems.groupby("storage_id", sort=True)):
        if shown == limit:
            lines.append(f"  ... and {n_storages - limit} more storage(s) (guard.check() has all)")
            break
        r = rows.iloc[0]
        graphs = ", ".join(dict.fromkeys(rows["graph"].astype(str)))
        derived = f"; derived from {r['derived_from']}" if r.get("derived_from") else ""
        lines.append(f"  {r['verdict']:<8} storage {sid} ({r['dtype']} {r['shape']}, "
                     f"{r['nbytes']} bytes) owned by {r['owners']} [{r['statuses']}]"
                     f"{derived}; read by: {graphs}")
        if r.get("note"):  # a re-laid owner: both views (Note [re-laid views])
            lines.append(f"           {r['note']}")
    for verdict in GUARD_PROBLEMS:
        if (problems["verdict"] == verdict).any():
            lines.append(f"  ({verdict}: {_WHAT[verdict]})")
    return lines

