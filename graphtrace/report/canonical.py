"""The canonical form of a report's frames and meta (see the format in graphtrace.report).

Every frame a :class:`~graphtrace.report.Report` holds goes through ``_canon_frame`` once,
in memory or when read from a folder, so the two compare equal with ``pandas.testing``.
"""

from __future__ import annotations

import datetime as _dt
import json
from pathlib import Path
from typing import Any, Iterable, Mapping

import numpy as np
import pandas as pd

from graphtrace.vocab import ADDED_COLUMNS, COLUMN_KINDS, SCHEMA

__all__ = ["ReportError", "is_na"]


class ReportError(ValueError):
    """A report's frames or folder are not what graphtrace writes.

    A defect in one frame's values also says where: ``frame`` (``"edges"``), ``column``
    (one name, or several joined by ``", "`` for a key) and ``row`` (0-based, as in the
    frame; ``None`` when the defect is not one row's). ``Report.load`` turns them into the
    file and its line.
    """

    def __init__(self, message: str, *, frame: str | None = None, column: str | None = None,
                 row: int | None = None, detail: str | None = None):
        super().__init__(message)
        self.frame, self.column, self.row = frame, column, row
        self.detail = message if detail is None else detail

    def __reduce__(self):
        return (_rebuild_error, (str(self), self.frame, self.column, self.row, self.detail))


def _rebuild_error(message, frame, column, row, detail) -> "ReportError":
    return ReportError(message, frame=frame, column=column, row=row, detail=detail)


def _frame_error(frame: str, column: str, row: int | None, detail: str) -> ReportError:
    """A defect in ``frame.column`` at ``row`` (see ReportError)."""
    where = f"{frame}.{column}" if ", " not in column else f"{frame} ({column})"
    at = "" if row is None else f", row {row}"
    return ReportError(f"{where}{at}: {detail}", frame=frame, column=column, row=row,
                       detail=detail)


def _first(mask) -> int | None:
    """The first True position of a boolean array-like (None when there is none)."""
    hits = np.flatnonzero(np.asarray(mask, dtype=bool))
    return int(hits[0]) if len(hits) else None


def is_na(value: Any) -> bool:
    """Is ``value`` a missing scalar (None, NaN, NA, NaT)? False for anything pandas cannot
    test, such as a list: frame cells read from a report are checked with it."""
    try:
        return bool(pd.isna(value))
    except (TypeError, ValueError):
        return False


# Dtypes a column kind is read as from CSV (string kinds read as _STR); kinds whose
# missing values are read from "".
_READ_DTYPES = {"int": "int64", "Int": "Int64", "bool": "bool", "boolean": "boolean",
               "float": "float64"}
_NULLABLE = {"Int", "boolean", "float", "str?"}


def _string_dtype():
    """pandas' default string dtype (``str`` on pandas 3, ``object`` before)."""
    return pd.Series(["x"]).dtype


_STR = _string_dtype()
# pandas < 3 parses floats fast but not exactly unless asked; pandas 3 is exact by default
# (and deprecates the option).
_PANDAS_MAJOR = int(pd.__version__.split(".")[0])
_EXACT_FLOATS = {"float_precision": "round_trip"} if _PANDAS_MAJOR < 3 else {}


def _kind_of(series: pd.Series) -> str:
    dtype = series.dtype
    if isinstance(dtype, pd.CategoricalDtype):
        return "str?"
    if pd.api.types.is_bool_dtype(dtype):
        return "boolean" if isinstance(dtype, pd.BooleanDtype) else "bool"
    if pd.api.types.is_integer_dtype(dtype):
        return "Int" if isinstance(dtype, pd.api.extensions.ExtensionDtype) else "int"
    if pd.api.types.is_float_dtype(dtype):
        return "float"
    return "str?"


def _as_strings(s: pd.Series) -> pd.Series:
    """``s`` in pandas' default string dtype; missing values are NaN."""
    if _STR != object:  # pandas >= 3: the "str" dtype already means exactly this
        return s if s.dtype == _STR else s.astype(_STR)
    out = s.astype(object)
    mask = out.notna().to_numpy()
    values = out.to_numpy(copy=True)
    values[mask] = [v if isinstance(v, str) else str(v) for v in values[mask]]
    values[~mask] = np.nan
    return pd.Series(values, index=s.index, name=s.name, dtype=object)


def _categorical(codes: np.ndarray, categories, kind: str, index, name) -> pd.Series:
    """A categorical string column in canonical form (graphtrace.report) from codes into
    ``categories``. Works on the categories, so a large categorical column costs one pass
    over its codes."""
    codes = np.asarray(codes)
    na = codes < 0
    has_na = bool(na.any())
    if _canonical_categories(codes, categories, kind, has_na):
        dtype = pd.CategoricalDtype(pd.Index(np.asarray(categories, dtype=object), dtype=_STR))
        return pd.Series(pd.Categorical.from_codes(codes, dtype=dtype), index=index, name=name)
    cats = [str(c) for c in categories]
    n = len(cats)
    used = (np.bincount(codes[~na] if has_na else codes, minlength=n) > 0) if n \
        else np.zeros(0, dtype=bool)
    values = {cats[i] for i in np.flatnonzero(used)}
    if kind == "str":
        if has_na:
            values.add("")
    else:
        values.discard("")
    order = sorted(values)
    pos = {v: i for i, v in enumerate(order)}
    na_code = pos.get("", -1) if kind == "str" else -1
    mapping = np.array([pos.get(c, -1) for c in cats] + [na_code], dtype=np.int64)
    new = mapping[np.where(na, n, codes)]
    dtype = pd.CategoricalDtype(pd.Index(np.array(order, dtype=object), dtype=_STR))
    return pd.Series(pd.Categorical.from_codes(new, dtype=dtype), index=index, name=name)


def _canonical_categories(codes: np.ndarray, categories, kind: str, has_na: bool) -> bool:
    """Are these codes and categories canonical already (as diff and load_report make them):
    strings, sorted, all used, NA where the kind wants it? Then no remap pass is needed."""
    cats = pd.Index(categories)
    if kind == "str" and has_na or kind != "str" and "" in cats:
        return False
    if not (cats.is_monotonic_increasing and pd.api.types.infer_dtype(cats) == "string"):
        return False
    used = codes[codes >= 0] if has_na else codes
    seen = np.zeros(len(cats), dtype=bool)
    seen[used[:8192]] = True  # every category used in the first rows already (the common
    if seen.all():            # case for verdicts, ops, dtypes): no pass over them all
        return True
    return bool(np.bincount(used, minlength=len(cats)).all())


def _canon_column(s: pd.Series, kind: str, categorical: bool, frame: str,
                  column: str) -> pd.Series:
    if kind in ("str", "str?"):
        if isinstance(s.dtype, pd.CategoricalDtype):
            return _categorical(s.cat.codes.to_numpy(), s.cat.categories, kind,
                                s.index, s.name)
        v = _as_strings(s)
        if kind == "str":
            if v.isna().any():
                v = v.fillna("")
        else:
            empty = v == ""
            if empty.any():
                v = v.mask(empty)
        if categorical:
            codes, uniques = pd.factorize(v)
            return _categorical(codes, list(uniques), kind, v.index, v.name)
        return v
    try:
        if kind == "int":
            if s.isna().any():
                raise _frame_error(frame, column, _first(s.isna()),
                                   "missing value in an integer column")
            if s.dtype == np.int64:
                return s
            if pd.api.types.is_float_dtype(s.dtype) and not (s == s.round()).all():
                raise _frame_error(frame, column, _first(s != s.round()),
                                   "non-integer value in an integer column")
            return s.astype("int64")
        if kind == "Int":
            if s.dtype == "Int64":
                return s
            if s.dtype == object:
                return pd.Series(pd.array(s.where(s.notna(), None).tolist(), dtype="Int64"),
                                 index=s.index, name=s.name)
            return s.astype("Int64")
        if kind == "bool":
            if s.dtype == bool:
                return s
            if s.isna().any():
                raise _frame_error(frame, column, _first(s.isna()),
                                   "missing value in a boolean column")
            return s.astype(bool)
        if kind == "boolean":
            return s.astype("boolean")
        if kind == "float":
            return s.astype("float64")
    except ReportError:
        raise
    except (TypeError, ValueError, OverflowError) as e:
        raise _frame_error(frame, column, None, f"cannot read as {kind}: {e}") from None
    raise _frame_error(frame, column, None, f"unknown column kind {kind!r}")


def _canon_frame(name: str, df: pd.DataFrame | None,
                extra_kinds: Mapping[str, str] | None = None,
                categorical: Iterable[str] = ()) -> pd.DataFrame:
    """Frame ``name`` (one of FRAMES) in canonical form; None is an empty frame.

    ``extra_kinds`` gives the kinds of extra columns (else read from their dtypes);
    ``categorical`` names string columns kept categorical. Raises ReportError for
    missing or duplicate columns and values a column's kind cannot hold.
    """
    schema = SCHEMA[name]
    required = [c for c, _ in schema]
    if df is None:
        df = pd.DataFrame({c: pd.Series([], dtype=_READ_DTYPES.get(k, _STR))
                           for c, k in schema})
    if not isinstance(df, pd.DataFrame):
        raise ReportError(f"{name}: expected a pandas DataFrame, got {type(df).__name__}")
    if df.columns.duplicated().any():
        dup = sorted(set(df.columns[df.columns.duplicated()].astype(str)))
        raise ReportError(f"{name}: duplicate columns: {', '.join(dup)}")
    added = {c: v for c, v in ADDED_COLUMNS.get(name, {}).items() if c not in df.columns}
    if added:  # a column added after format 1: an older frame gets its default
        df = df.assign(**{c: [v] * len(df) for c, v in added.items()})
    missing = [c for c in required if c not in df.columns]
    if missing:
        raise ReportError(
            f"{name}: missing columns: {', '.join(missing)} "
            f"(a {name} frame has: {', '.join(required)})")
    extras = [c for c in df.columns if c not in required]
    kinds = dict(schema)
    extra_kinds = dict(extra_kinds or {})
    for c in extras:
        k = extra_kinds.get(c) or _kind_of(df[c])
        kinds[c] = k if k in COLUMN_KINDS else "str?"
    categorical = set(categorical)
    out = {}
    for c in required + extras:
        out[c] = _canon_column(df[c].reset_index(drop=True), kinds[c], c in categorical,
                               name, str(c))
    return pd.DataFrame(out, index=pd.RangeIndex(len(df)), copy=not _copy_on_write())


def _copy_on_write() -> bool:
    """Under copy-on-write (pandas 3; an option on pandas 2) a canonical frame may reuse its
    input's columns without a copy: neither frame can change the other's values."""
    return _PANDAS_MAJOR >= 3 or pd.get_option("mode.copy_on_write") is True


def _frame_kinds(name: str, df: pd.DataFrame) -> tuple[dict[str, str], list[str]]:
    """``({column: kind}, [categorical columns])`` of a canonical frame, for the manifest."""
    schema = dict(SCHEMA[name])
    kinds = {c: schema.get(c) or _kind_of(df[c]) for c in df.columns}
    for c in df.columns:
        if c not in schema and isinstance(df[c].dtype, pd.CategoricalDtype):
            kinds[c] = "str?"
    cats = [c for c in df.columns if isinstance(df[c].dtype, pd.CategoricalDtype)]
    return kinds, cats


def _json_default(o: Any):
    """``json.dumps(default=...)`` for meta values: numpy scalars and arrays, sets, paths
    and dates as plain JSON; anything else as its repr."""
    if isinstance(o, np.generic):
        return o.item()
    if isinstance(o, np.ndarray):
        return o.tolist()
    if isinstance(o, (set, frozenset)):
        return sorted(o, key=str)
    if isinstance(o, (Path, _dt.datetime, _dt.date)):
        return str(o)
    return repr(o)


def _plain_meta(meta: Mapping[str, Any] | None) -> dict:
    """``meta`` as plain JSON data (what it reads back as from a manifest)."""
    if meta is None:
        return {}
    if not isinstance(meta, Mapping):
        raise ReportError(f"meta: expected a dict, got {type(meta).__name__}")
    try:
        return json.loads(json.dumps(dict(meta), default=_json_default))
    except RecursionError:
        raise ReportError("meta: nested too deeply") from None
    except (TypeError, ValueError) as e:
        raise ReportError(f"meta: not JSON-serialisable: {e}") from None
