"""Checks of a report's values beyond their dtypes: vocabularies, keys, references, meta.

Every Report is checked once (built in memory or read from a folder), so a report that
loads can be displayed, summarised and written again. A defect raises one
:class:`ReportError` at the first bad row. What a folder adds (row counts, checksums): Note
[What a report folder guarantees] in graphtrace.report.io.
"""

from __future__ import annotations

from typing import Any, Mapping

import numpy as np
import pandas as pd

from graphtrace.blindspots import BlindSpot
from graphtrace.report.canonical import ReportError, _first, _frame_error
from graphtrace.vocab import (
    ACCESS_KINDS,
    EDGE_ACCESSES,
    IMPACTS,
    ORIGINS,
    OWNER_KINDS,
    OWNER_STATUSES,
    VERDICTS,
)

__all__ = ["VOCABULARIES", "JOINED_VOCABULARIES", "KEYS", "check_frames", "check_meta"]

# (frame, column) -> (its words, what they are called, NA allowed)
VOCABULARIES: dict[tuple[str, str], tuple[tuple[str, ...], str, bool]] = {
    ("edges", "verdict"): (VERDICTS, "verdicts", False),
    ("edges", "impact"): (IMPACTS, "impacts", True),
    ("edges", "origin"): (ORIGINS, "origins", True),
    ("edges", "access"): (EDGE_ACCESSES, "edge accesses", False),
    ("owners", "status"): (OWNER_STATUSES, "owner statuses", False),
    ("owners", "kind"): (OWNER_KINDS, "owner kinds", False),
    ("accesses", "access"): (ACCESS_KINDS, "access kinds", False),
    ("storages", "first_access"): (ACCESS_KINDS, "access kinds", False),
}
# (frame, column) -> (words, what they are called, separator): each part of a joined value
JOINED_VOCABULARIES = {("edges", "owner_kinds"): (OWNER_KINDS, "owner kinds", ";")}
# The rows the writer makes unique. accesses has no key: an op's list argument
# (aten::cat's `tensors`) records one row per element, equal rows included.
KEYS: dict[str, tuple[str, ...]] = {
    "storages": ("storage_id",),
    "owners": ("storage_id", "model", "path"),
    "edges": ("graph_id", "storage_id"),
}


def _bad_words(s: pd.Series, words: tuple[str, ...], na_ok: bool) -> np.ndarray:
    """Mask of values outside ``words`` (NA counts as bad unless ``na_ok``)."""
    if isinstance(s.dtype, pd.CategoricalDtype):
        cats = s.cat.categories
        bad_cats = ~np.asarray(cats.isin(words), dtype=bool)
        codes = s.cat.codes.to_numpy()
        bad = np.zeros(len(s), dtype=bool)
        if bad_cats.any():
            bad = bad_cats[np.where(codes < 0, 0, codes)] & (codes >= 0)
        if not na_ok:
            bad |= codes < 0
        return bad
    na = s.isna().to_numpy()
    bad = ~s.astype(object).isin(words).to_numpy() & ~na
    return bad | na if not na_ok else bad


def _duplicates(df: pd.DataFrame, key: tuple[str, ...]) -> np.ndarray:
    """`df.duplicated(key)`; for integer keys in sorted order (as the diff and a folder give
    them) by comparing neighbours, where hashing every row costs ~10x more."""
    cols = [df[c].to_numpy() for c in key]
    if all(c.dtype == np.int64 for c in cols):
        before = np.zeros(len(df) - 1, dtype=bool)  # row i's key < row i+1's
        equal = np.ones(len(df) - 1, dtype=bool)    # row i's key == row i+1's
        for c in cols:
            before |= equal & (c[:-1] < c[1:])
            equal &= c[:-1] == c[1:]
        if (before | equal).all():  # sorted: duplicates sit next to each other
            return np.concatenate(([False], equal))
    return df.duplicated(list(key)).to_numpy()


def _plain(value: Any) -> Any:
    """A numpy scalar as the Python value it holds (for messages)."""
    return value.item() if isinstance(value, np.generic) else value


def check_frames(frames: Mapping[str, pd.DataFrame]) -> None:
    """Vocabularies, keys and references of canonical frames (ReportError otherwise)."""
    for (name, column), (words, called, na_ok) in VOCABULARIES.items():
        s = frames[name][column]
        bad = _bad_words(s, words, na_ok)
        if bad.any():
            row = _first(bad)
            value = s.iloc[row]
            raise _frame_error(name, column, row,
                               f"unknown value {'NA' if pd.isna(value) else repr(str(value))}"
                               f" ({called} are {', '.join(words)})")
    for (name, column), (words, called, sep) in JOINED_VOCABULARIES.items():
        s = frames[name][column].astype(object)
        for value in pd.unique(s):
            parts = str(value).split(sep) if str(value) else []
            if all(p in words for p in parts):
                continue
            row = _first((s == value).to_numpy())
            wrong = next(p for p in parts if p not in words)
            raise _frame_error(name, column, row,
                               f"unknown value {wrong!r} in {str(value)!r} ({called} are "
                               f"{', '.join(words)}, joined by {sep!r})")
    for name, key in KEYS.items():
        df = frames[name]
        if len(df) < 2:
            continue
        dup = _duplicates(df, key)
        if dup.any():
            row = _first(dup)
            values = ", ".join(f"{c}={_plain(df[c].iloc[row])!r}" for c in key)
            raise _frame_error(name, ", ".join(key), row,
                               f"duplicate key ({values}): one row per "
                               f"({', '.join(key)})")
    storages = frames["storages"]
    if len(storages):  # frames built by hand may leave storages out; a folder has them
        known = storages["storage_id"].to_numpy()
        for name in ("edges", "owners", "accesses"):
            sids = frames[name]["storage_id"].to_numpy()
            missing = ~np.isin(sids, known)
            if missing.any():
                row = _first(missing)
                raise _frame_error(name, "storage_id", row,
                                   f"storage {int(sids[row])} is not in storages")


# ------------------------------------------------------------------------------ meta

def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _type_name(x: Any) -> str:
    return "null" if x is None else type(x).__name__


# meta["graphs"] entries: key -> (test, what it must be); graph_id is required
_GRAPH_KEYS = {
    "graph_id": (lambda v: _is_int(v) and v >= 0, "an integer >= 0"),
    "label": (lambda v: isinstance(v, str), "a string"),
    "kind": (lambda v: isinstance(v, str), "a string"),
    "n_ops": (lambda v: _is_int(v) and v >= 0, "an integer >= 0"),
    "n_accesses": (lambda v: _is_int(v) and v >= 0, "an integer >= 0"),
    "thread": (lambda v: isinstance(v, str), "a string"),
}
_ERROR_TEXT = ("where", "message", "traceback")
_OPTIONAL_TEXT = ("graphtrace_version", "torch_version", "created")


def check_meta(meta: Mapping[str, Any]) -> None:
    """The meta keys docs/internals.md lists have the types it gives them (ReportError
    otherwise). Any of them may be null or left out; other keys are free JSON."""
    def bad(key: str, what: str) -> ReportError:
        return ReportError(f"meta.{key}: {what}")

    for key in _OPTIONAL_TEXT:
        if meta.get(key) is not None and not isinstance(meta[key], str):
            raise bad(key, f"expected a string, got {_type_name(meta[key])}")
    if "format_version" in meta and not _is_int(meta["format_version"]):
        raise bad("format_version", f"expected an integer, got "
                                    f"{_type_name(meta['format_version'])}")
    n_errors = meta.get("n_errors")
    if n_errors is not None and not (_is_int(n_errors) and n_errors >= 0):
        raise bad("n_errors", f"expected an integer >= 0, got {n_errors!r}")
    for key in ("errors", "blind_spots", "graphs", "models"):
        if meta.get(key) is not None and not isinstance(meta[key], list):
            raise bad(key, f"expected a list, got {_type_name(meta[key])}")
    for i, e in enumerate(meta.get("errors") or []):
        if not isinstance(e, dict):
            raise bad(f"errors[{i}]", f"expected an object, got {_type_name(e)}")
        for k in _ERROR_TEXT:
            if k in e and not isinstance(e[k], str):
                raise bad(f"errors[{i}].{k}", f"expected a string, got {_type_name(e[k])}")
    for i, b in enumerate(meta.get("blind_spots") or []):
        if not isinstance(b, (str, dict)):
            raise bad(f"blind_spots[{i}]", f"expected a string or an object, got "
                                           f"{_type_name(b)}")
        try:
            BlindSpot.from_json(b)
        except (TypeError, ValueError) as exc:
            raise bad(f"blind_spots[{i}]", str(exc)) from None
    seen: set[int] = set()
    for i, g in enumerate(meta.get("graphs") or []):
        if not isinstance(g, dict):
            raise bad(f"graphs[{i}]", f"expected an object, got {_type_name(g)}")
        if "graph_id" not in g:
            raise bad(f"graphs[{i}]", "no graph_id")
        for k, (ok, what) in _GRAPH_KEYS.items():
            if k in g and not ok(g[k]):
                raise bad(f"graphs[{i}].{k}", f"expected {what}, got {g[k]!r}")
        if g["graph_id"] in seen:
            raise bad(f"graphs[{i}].graph_id", f"graph {g['graph_id']} listed twice")
        seen.add(g["graph_id"])
    for i, m in enumerate(meta.get("models") or []):
        if not isinstance(m, str):
            raise bad(f"models[{i}]", f"expected a string, got {_type_name(m)}")
