"""``assert_no_stale``: the check a project's test suite runs on a report."""

from __future__ import annotations

import fnmatch
import re
from typing import Any, Iterable, Protocol

import pandas as pd

from graphtrace.report.canonical import is_na
from graphtrace.report.grouping import split_joined
from graphtrace.vocab import STALE_VERDICTS, VERDICTS

__all__ = ["assert_no_stale", "StaleEdges", "owner_labels"]


class StaleEdges(Protocol):
    """What the check reads of a report: a `Report` is one (core.py imports this module, so
    this one names the two frames it needs instead of importing `Report`)."""

    @property
    def stale(self) -> pd.DataFrame: ...

    @property
    def owners(self) -> pd.DataFrame: ...


def owner_labels(report: StaleEdges) -> dict[int, list[str]]:
    """storage_id -> ``[path (kind, status), ...]`` from the owners frame (also the CLI's)."""
    out: dict[int, list[str]] = {}
    for r in report.owners.itertuples(index=False):
        name = f"{r.model}:{r.path}" if r.model else str(r.path)
        out.setdefault(int(r.storage_id), []).append(f"{name} ({r.kind}, {r.status})")
    return out


def _glob_match(path: str, pattern: str) -> bool:
    if path == pattern or fnmatch.fnmatchcase(path, pattern):
        return True
    # Owner paths hold brackets (``keywords['perm']``): also try them literally.
    literal = re.sub(r"[\[\]]", lambda m: "[" + m.group(0) + "]", pattern)
    return fnmatch.fnmatchcase(path, literal)


def _allowed_mask(edges: pd.DataFrame, allow: Iterable[str]) -> pd.Series:
    verdicts = {a for a in allow if a in VERDICTS}
    globs = [a for a in allow if a not in VERDICTS]
    mask = edges["verdict"].astype(object).isin(verdicts)
    if globs:
        def ok(owners: Any) -> bool:
            paths = split_joined(owners, ";")
            return bool(paths) and all(any(_glob_match(p, g) for g in globs) for p in paths)
        mask = mask | edges["owners"].astype(object).map(ok).astype(bool)
    return mask


def assert_no_stale(report: StaleEdges, *, allow: Iterable[str] | str = (),
                    limit: int = 50) -> None:
    """Fail (``AssertionError``) when the report has stale-like edges (``STALE_VERDICTS``).

    The message lists each offending edge: graph, verdict, impact, ops and its owners
    with kind and status. ``allow`` accepts known ones: verdict names (``"latent"`` is
    not a verdict; use ``"stale"``...) or owner path globs (``"layers.*.kernel.*"``); an
    edge is allowed when its verdict is allowed or every one of its owner paths matches
    an allowed glob. Brackets in globs also match literally.
    """
    if isinstance(allow, str):
        allow = (allow,)
    allow = tuple(allow)
    stale = report.stale
    bad = stale[~_allowed_mask(stale, allow)] if allow else stale
    if bad.empty:
        return
    owners = {k: "; ".join(v) for k, v in owner_labels(report).items()}
    counts = bad["verdict"].astype(object).value_counts()
    by = ", ".join(f"{int(counts[v])} {v}" for v in STALE_VERDICTS if v in counts)
    n_graphs = bad["graph_id"].nunique()
    lines = [f"{len(bad)} stale-like edge{'s' if len(bad) != 1 else ''} after reload "
             f"({by}) in {n_graphs} graph{'s' if n_graphs != 1 else ''}:"]
    for r in bad.head(limit).itertuples(index=False):
        impact = "" if is_na(r.impact) else f" ({r.impact})"
        who = owners.get(int(r.storage_id)) or r.owners or "no owner"
        lines.append(f"  - graph {r.graph!r} storage {int(r.storage_id)}: {r.verdict}"
                     f"{impact}; ops {r.ops}; owners {who}")
    if len(bad) > limit:
        lines.append(f"  ... and {len(bad) - limit} more")
    lines.append("Pass allow=(verdict names or owner path globs) to accept known ones.")
    raise AssertionError("\n".join(lines))
