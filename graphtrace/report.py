"""The result of a diff: frames, a graph, report folders and a check for test suites.

This module imports no torch: a report folder written on a GPU machine is read and
analysed anywhere (``load_report``), in Jupyter, in a terminal or in a project's pytest.

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
  ``origin`` (``""`` where NA), ``stale`` (True for stale, dangling, diverged), ``ops``,
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

import datetime as _dt
import fnmatch
import html
import json
import re
from pathlib import Path
from typing import Any, Iterable, Mapping

import numpy as np
import pandas as pd

from graphtrace.vocab import COLUMN_KINDS as _KINDS
from graphtrace.vocab import FRAMES, IMPACTS, SCHEMA, STALE_VERDICTS, VERDICTS

__all__ = [
    "VERDICTS",
    "STALE_VERDICTS",
    "IMPACTS",
    "FRAMES",
    "SCHEMA",
    "FORMAT",
    "FORMAT_VERSION",
    "Report",
    "ReportError",
    "load_report",
    "read_graphml",
    "assert_no_stale",
    "layer_of",
    "graph_names",
]

FORMAT = "graphtrace-report"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
GRAPHML = "graph.graphml"
GRAPHML_MAX_EDGES = 200_000

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


class ReportError(ValueError):
    """A report's frames or folder are not what graphtrace writes."""


# --------------------------------------------------------------------------- canonical form

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
    """A categorical string column in canonical form from codes into ``categories``:
    categories are the used values as strings, sorted; ``-1`` codes (NA) become ``""`` for
    ``str`` columns and ``""`` becomes NA for ``str?`` columns. Works on the categories,
    so a large categorical column costs one pass over its codes."""
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
    return bool(np.bincount(codes[codes >= 0] if has_na else codes, minlength=len(cats)).all())


def _canon_column(s: pd.Series, kind: str, categorical: bool, where: str) -> pd.Series:
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
                raise ReportError(f"{where}: missing values in an integer column")
            if s.dtype == np.int64:
                return s
            if pd.api.types.is_float_dtype(s.dtype) and not (s == s.round()).all():
                raise ReportError(f"{where}: non-integer values in an integer column")
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
                raise ReportError(f"{where}: missing values in a boolean column")
            return s.astype(bool)
        if kind == "boolean":
            return s.astype("boolean")
        if kind == "float":
            return s.astype("float64")
    except ReportError:
        raise
    except (TypeError, ValueError, OverflowError) as e:
        raise ReportError(f"{where}: cannot read as {kind}: {e}") from None
    raise ReportError(f"{where}: unknown column kind {kind!r}")


def _canon_frame(name: str, df: pd.DataFrame | None,
                 extra_kinds: Mapping[str, str] | None = None,
                 categorical: Iterable[str] = ()) -> pd.DataFrame:
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
        kinds[c] = k if k in _KINDS else "str?"
    categorical = set(categorical)
    out = {}
    for c in required + extras:
        out[c] = _canon_column(df[c].reset_index(drop=True), kinds[c], c in categorical,
                               f"{name}.{c}")
    return pd.DataFrame(out, index=pd.RangeIndex(len(df)), copy=not _copy_on_write())


def _copy_on_write() -> bool:
    """Under copy-on-write (pandas 3; an option on pandas 2) a canonical frame may reuse its
    input's columns without a copy: neither frame can change the other's values."""
    return _PANDAS_MAJOR >= 3 or pd.get_option("mode.copy_on_write") is True


def _frame_kinds(name: str, df: pd.DataFrame) -> tuple[dict[str, str], list[str]]:
    schema = dict(SCHEMA[name])
    kinds = {c: schema.get(c) or _kind_of(df[c]) for c in df.columns}
    for c in df.columns:
        if c not in schema and isinstance(df[c].dtype, pd.CategoricalDtype):
            kinds[c] = "str?"
    cats = [c for c in df.columns if isinstance(df[c].dtype, pd.CategoricalDtype)]
    return kinds, cats


def _json_default(o: Any):
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
    if meta is None:
        return {}
    if not isinstance(meta, Mapping):
        raise ReportError(f"meta: expected a dict, got {type(meta).__name__}")
    try:
        return json.loads(json.dumps(dict(meta), default=_json_default))
    except (TypeError, ValueError) as e:
        raise ReportError(f"meta: not JSON-serialisable: {e}") from None


# --------------------------------------------------------------------------- grouping helpers

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


def _natural_key(s: Any):
    return [(0, int(t), "") if t.isdigit() else (1, 0, t)
            for t in re.split(r"(\d+)", str(s)) if t]


def graph_names(graph_ids: Iterable[int], labels: Iterable[Any]) -> dict[int, str]:
    """``{graph_id: name}`` for display: the label, or ``label#id`` where several graphs
    share a label (``#id`` for an empty one)."""
    pairs = {}
    for gid, label in zip(graph_ids, labels):
        pairs.setdefault(int(gid), "" if _is_na(label) else str(label))
    count: dict[str, int] = {}
    for label in pairs.values():
        count[label] = count.get(label, 0) + 1
    return {gid: label if label and count[label] == 1 else f"{label}#{gid}"
            for gid, label in pairs.items()}


UNKNOWN_MODULE = "(unknown)"
NO_OWNER = "(none)"
NO_LAYER = "(none)"
GROUPINGS = ("verdict", "graph", "module", "layer", "op", "owner_kind", "access")


def _split(value: Any, sep: str) -> list[str]:
    if not isinstance(value, str) or not value:
        return []
    seen: dict[str, None] = {}
    for part in value.split(sep):
        part = part.strip()
        if part:
            seen.setdefault(part, None)
    return list(seen)


def _group_keys(edges: pd.DataFrame, by: str) -> pd.Series:
    """One group key per edge (several for ``op`` and ``owner_kind``), indexed like edges.

    ``module``: the edge's module, ``(unknown)`` when empty. ``layer``: ``layers.N`` of the
    module, else of the first owner path that has one, else ``(none)``. ``op``: every
    distinct op of the edge. ``owner_kind``: every kind of owner, ``(none)`` for edges
    without owners. ``graph``: the graph label.
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
            for p in _split(row[1], ";"):
                lay = layer_of(p)
                if lay:
                    return lay
            return NO_LAYER
        keys = pd.Series([_layer(r) for r in zip(edges["module"].astype(object),
                                                 edges["owners"].astype(object))],
                         index=edges.index, dtype=object)
    elif by == "op":
        keys = edges["ops"].astype(object).map(lambda v: _split(v, ";") or [""]).explode()
    else:  # owner_kind
        keys = edges["owner_kinds"].astype(object).map(
            lambda v: _split(v, ";") or [NO_OWNER]).explode()
    keys.name = by
    return keys


def _crosstab(edges: pd.DataFrame, by: str) -> pd.DataFrame:
    keys = _group_keys(edges, by)
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
        order = sorted(table.index, key=_natural_key)
    table = table.reindex(order)
    table.index = pd.Index(list(table.index), dtype=object, name=by)
    return table


# --------------------------------------------------------------------------- the report

def _native(v: Any) -> Any:
    if isinstance(v, np.generic):
        return v.item()
    return v


def _is_na(v: Any) -> bool:
    try:
        return bool(pd.isna(v))
    except (TypeError, ValueError):
        return False


class Report:
    """What a diff found: frames (``accesses``, ``storages``, ``owners``, ``edges``), the
    derived ``stale`` frame, ``summary()``, a networkx ``graph`` and ``meta``.

    Build one from frames with the columns of docs/internals.md (``Report(...)`` or
    ``Report.from_frames(...)``); a frame left out is empty. Missing columns raise
    :class:`ReportError`.
    """

    def __init__(self, accesses: pd.DataFrame | None = None,
                 storages: pd.DataFrame | None = None,
                 owners: pd.DataFrame | None = None,
                 edges: pd.DataFrame | None = None,
                 meta: Mapping[str, Any] | None = None, *,
                 _kinds: Mapping[str, Mapping[str, str]] | None = None,
                 _categorical: Mapping[str, Iterable[str]] | None = None):
        kinds = _kinds or {}
        cats = _categorical or {}
        given = {"accesses": accesses, "storages": storages, "owners": owners, "edges": edges}
        self._frames = {name: _canon_frame(name, given[name], kinds.get(name),
                                           cats.get(name, ()))
                        for name in FRAMES}
        self._meta = _plain_meta(meta)
        bad = set(self._frames["edges"]["verdict"].unique()) - set(VERDICTS)
        if bad:
            raise ReportError(
                f"edges.verdict: unknown verdicts {', '.join(sorted(map(str, bad)))} "
                f"(verdicts are {', '.join(VERDICTS)})")
        self._graph = None
        self._graphs = None
        self._source: Path | None = None
        self._manifest: dict = {}

    @classmethod
    def from_frames(cls, accesses: pd.DataFrame | None = None,
                    storages: pd.DataFrame | None = None,
                    owners: pd.DataFrame | None = None,
                    edges: pd.DataFrame | None = None,
                    meta: Mapping[str, Any] | None = None) -> "Report":
        """Validate the frames' columns (clear :class:`ReportError` otherwise) and build."""
        return cls(accesses, storages, owners, edges, meta)

    # ---- frames
    @property
    def accesses(self) -> pd.DataFrame:
        return self._frames["accesses"]

    @property
    def storages(self) -> pd.DataFrame:
        return self._frames["storages"]

    @property
    def owners(self) -> pd.DataFrame:
        return self._frames["owners"]

    @property
    def edges(self) -> pd.DataFrame:
        return self._frames["edges"]

    @property
    def stale(self) -> pd.DataFrame:
        """Rows of ``edges`` whose verdict is stale, dangling or diverged (index kept)."""
        e = self.edges
        return e[e["verdict"].astype(object).isin(STALE_VERDICTS)]

    @property
    def meta(self) -> dict:
        return self._meta

    @property
    def source(self) -> Path | None:
        """The folder this report was loaded from (None when built in memory)."""
        return self._source

    @property
    def manifest(self) -> dict:
        """The loaded folder's ``manifest.json`` ({} when built in memory)."""
        return self._manifest

    @property
    def errors(self) -> list:
        """Internal errors the recorder counted (fail-open): ``{where, message, traceback}``."""
        return list(self._meta.get("errors") or [])

    @property
    def blind_spots(self) -> list:
        """What the recording could not see (for example Triton kernels), as text."""
        return list(self._meta.get("blind_spots") or [])

    @property
    def graphs(self) -> pd.DataFrame:
        """One row per captured graph: ``graph_id``, ``label``, ``kind``, ``n_ops``,
        ``n_accesses``, ``thread`` (from ``meta["graphs"]``; derived from the frames where
        the meta lacks it)."""
        if self._graphs is None:
            self._graphs = self._build_graphs()
        return self._graphs.copy()

    def _build_graphs(self) -> pd.DataFrame:
        cols = ["graph_id", "label", "kind", "n_ops", "n_accesses", "thread"]
        rows = {}
        for g in self._meta.get("graphs") or []:
            if isinstance(g, Mapping) and "graph_id" in g:
                rows[int(g["graph_id"])] = {c: g.get(c) for c in cols}
        for frame in (self.accesses, self.edges):
            pairs = frame[["graph_id", "graph"]].astype({"graph": object}).drop_duplicates()
            for gid, label in pairs.itertuples(index=False):
                rows.setdefault(int(gid), {"graph_id": int(gid), "label": label})
        acc = self.accesses
        n_acc = acc.groupby("graph_id").size() if len(acc) else pd.Series(dtype="int64")
        n_ops = (acc.groupby("graph_id")["seq"].nunique() if len(acc)
                 else pd.Series(dtype="int64"))
        out = []
        for gid in sorted(rows):
            r = {c: rows[gid].get(c) for c in cols}
            r["graph_id"] = gid
            if r["n_accesses"] is None:
                r["n_accesses"] = int(n_acc.get(gid, 0))
            if r["n_ops"] is None:
                r["n_ops"] = int(n_ops.get(gid, 0))
            r["label"] = "" if r["label"] is None else str(r["label"])
            r["kind"] = "" if r["kind"] is None else str(r["kind"])
            r["thread"] = "" if r["thread"] is None else str(r["thread"])
            out.append(r)
        df = pd.DataFrame(out, columns=cols)
        return df.astype({"graph_id": "int64", "n_ops": "int64", "n_accesses": "int64",
                          "label": _STR, "kind": _STR, "thread": _STR})

    # ---- summaries
    def summary(self, by: str | None = None) -> pd.DataFrame:
        """Counts by verdict.

        ``summary()``: index ``verdict`` (all six, in contract order), columns ``edges``,
        ``storages`` and ``graphs`` (distinct), and ``manifest``, ``latent``, ``unknown``
        (edges by impact). ``summary(by=...)`` with ``graph``, ``module``, ``layer``,
        ``op``, ``owner_kind`` or ``access``: one row per group (naturally sorted), one
        column per verdict plus ``total``; an edge with several ops or owner kinds counts
        in each of them.
        """
        e = self.edges
        if by is not None and by != "verdict":
            return _crosstab(e, by)
        verdict = e["verdict"].astype(object)
        impact = e["impact"].astype(object)
        rows = []
        for v in VERDICTS:
            m = (verdict == v).to_numpy()
            sub = e[m]
            imp = impact[m]
            rows.append({
                "edges": int(m.sum()),
                "storages": int(sub["storage_id"].nunique()),
                "graphs": int(sub["graph_id"].nunique()),
                "manifest": int((imp == "manifest").sum()),
                "latent": int((imp == "latent").sum()),
                "unknown": int((imp == "unknown").sum()),
            })
        out = pd.DataFrame(rows, index=pd.Index(list(VERDICTS), dtype=object, name="verdict"))
        return out.astype("int64")

    def counts(self) -> dict[str, int]:
        """``{verdict: number of edges}`` for all six verdicts."""
        vc = self.edges["verdict"].astype(object).value_counts()
        return {v: int(vc.get(v, 0)) for v in VERDICTS}

    # ---- graph
    @property
    def graph(self):
        """networkx ``MultiDiGraph`` of graphs, storages and owners (see module doc)."""
        if self._graph is None:
            self._graph = self._build_graph()
        return self._graph

    def _build_graph(self):
        import networkx as nx

        G = nx.MultiDiGraph()
        G.graph["name"] = "graphtrace report"
        G.graph["format_version"] = FORMAT_VERSION
        graphs = self.graphs
        for r in graphs.itertuples(index=False):
            G.add_node(f"graph:{r.graph_id}", kind="graph", graph_id=int(r.graph_id),
                       label=str(r.label), capture=str(r.kind),
                       n_accesses=int(r.n_accesses))
        e = self.edges
        stale_sids = set(e.loc[e["verdict"].astype(object).isin(STALE_VERDICTS),
                               "storage_id"].tolist())
        for r in self.storages.itertuples(index=False):
            sid = int(r.storage_id)
            G.add_node(f"storage:{sid}", kind="storage", storage_id=sid,
                       data_ptr=int(r.data_ptr), nbytes=int(r.nbytes), device=str(r.device),
                       alive=bool(r.alive), first_access=str(r.first_access),
                       stale=sid in stale_sids)
        for r in self.owners.itertuples(index=False):
            node = f"owner:{r.model}:{r.path}"
            if node not in G:
                G.add_node(node, kind="owner", model=str(r.model), path=str(r.path),
                           owner_kind=str(r.kind), status=str(r.status))
        for r in e.itertuples(index=False):
            g, s = f"graph:{int(r.graph_id)}", f"storage:{int(r.storage_id)}"
            if g not in G:
                G.add_node(g, kind="graph", graph_id=int(r.graph_id), label=str(r.graph),
                           capture="", n_accesses=0)
            if s not in G:
                G.add_node(s, kind="storage", storage_id=int(r.storage_id),
                           stale=int(r.storage_id) in stale_sids)
            rel = str(r.access)
            G.add_edge(g, s, key=rel, relation=rel, verdict=str(r.verdict),
                       impact="" if _is_na(r.impact) else str(r.impact),
                       origin="" if _is_na(r.origin) else str(r.origin),
                       stale=str(r.verdict) in STALE_VERDICTS, ops=str(r.ops),
                       args=str(r.args), module=str(r.module), dtype=str(r.dtype),
                       shape=str(r.shape))
        for r in self.owners.itertuples(index=False):
            o, s = f"owner:{r.model}:{r.path}", f"storage:{int(r.storage_id)}"
            if s not in G:
                G.add_node(s, kind="storage", storage_id=int(r.storage_id),
                           stale=int(r.storage_id) in stale_sids)
            attrs = {"relation": "owned_at_capture", "status": str(r.status)}
            if not _is_na(r.live_data_ptr):
                attrs["live_data_ptr"] = int(r.live_data_ptr)
            G.add_edge(o, s, key="owned_at_capture", **attrs)
            if str(r.status) == "holds":
                G.add_edge(o, s, key="owns_now", relation="owns_now")
        return G

    # ---- files
    def to_csv(self, path: str | Path, *, graphml: bool | None = None) -> Path:
        """Write the report folder (created if needed): ``accesses.csv``, ``storages.csv``,
        ``owners.csv``, ``edges.csv``, ``graph.graphml`` and ``manifest.json`` (written
        last). Returns the folder.

        GraphML is for other graph tools; ``load_report`` rebuilds ``.graph`` from the CSVs.
        It costs ~10x the CSVs, so by default (``graphml=None``) it is left out above
        ``GRAPHML_MAX_EDGES`` edges, and the manifest says so; ``graphml=True`` forces it.
        """
        import networkx as nx

        from graphtrace import __version__

        out = Path(path)
        out.mkdir(parents=True, exist_ok=True)
        dtypes, categorical = {}, {}
        for name in FRAMES:
            df = self._frames[name]
            df.to_csv(out / f"{name}.csv", index=False, lineterminator="\n")
            dtypes[name], categorical[name] = _frame_kinds(name, df)
        if graphml is None:
            graphml = len(self._frames["edges"]) <= GRAPHML_MAX_EDGES
        files = {name: f"{name}.csv" for name in FRAMES}
        if graphml:
            nx.write_graphml(self.graph, out / GRAPHML)
            files["graph"] = GRAPHML
        else:
            (out / GRAPHML).unlink(missing_ok=True)
        manifest = {
            "format": FORMAT,
            "format_version": FORMAT_VERSION,
            "graphtrace_version": __version__,
            "torch_version": self._meta.get("torch_version"),
            "created": self._meta.get("created")
            or _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            "written": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            "files": files,
            "graphml_skipped": None if graphml else (
                f"{len(self._frames['edges'])} edges > {GRAPHML_MAX_EDGES}: write it with "
                "to_csv(dir, graphml=True); Report.graph rebuilds the graph from the CSVs"),
            "dtypes": dtypes,
            "categorical": categorical,
            "meta": self._meta,
        }
        tmp = out / (MANIFEST + ".tmp")
        tmp.write_text(json.dumps(manifest, indent=2, default=_json_default) + "\n")
        tmp.replace(out / MANIFEST)
        return out

    # ---- checks
    def check(self, *, allow: Iterable[str] | str = ()) -> None:
        """``assert_no_stale(self, allow=allow)``."""
        assert_no_stale(self, allow=allow)

    # ---- display
    def _headline(self) -> str:
        n_graphs = len(self.graphs)
        n_err = int(self._meta.get("n_errors", len(self.errors)) or 0)
        parts = [f"{n_graphs} graph{'s' if n_graphs != 1 else ''}",
                 f"{len(self.edges)} edge{'s' if len(self.edges) != 1 else ''}",
                 f"{len(self.stale)} stale-like",
                 f"{n_err} error{'s' if n_err != 1 else ''}"]
        if self.blind_spots:
            n = len(self.blind_spots)
            parts.append(f"{n} blind spot{'s' if n != 1 else ''}")
        return ", ".join(parts)

    def __repr__(self) -> str:
        counts = self.counts()
        verdicts = " ".join(f"{v}={n}" for v, n in counts.items() if n)
        return f"<graphtrace Report: {self._headline()}; {verdicts or 'no edges'}>"

    def _repr_html_(self) -> str:
        s = self.summary()
        head = "".join(f"<th>{html.escape(c)}</th>" for c in ["verdict", *s.columns])
        body = []
        for v, row in s.iterrows():
            style = ' style="color:#b00020;font-weight:bold"' if (
                v in STALE_VERDICTS and row["edges"]) else ""
            cells = "".join(f"<td>{int(x)}</td>" for x in row)
            body.append(f"<tr{style}><td>{html.escape(str(v))}</td>{cells}</tr>")
        return (f"<div><b>graphtrace Report</b>: {html.escape(self._headline())}"
                f"<table><thead><tr>{head}</tr></thead><tbody>{''.join(body)}</tbody>"
                f"</table></div>")


# --------------------------------------------------------------------------- reading

def _fail(path: Path, message: str) -> ReportError:
    return ReportError(f"{path}: {message}")


def _read_manifest(folder: Path) -> dict:
    if not folder.exists():
        raise _fail(folder, "no such report folder")
    if not folder.is_dir():
        raise _fail(folder, "not a folder (a report is a folder written by Report.to_csv)")
    mpath = folder / MANIFEST
    if not mpath.is_file():
        raise _fail(folder, f"not a graphtrace report (no {MANIFEST})")
    try:
        manifest = json.loads(mpath.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise _fail(mpath, f"unreadable manifest: {e}") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        found = manifest.get("format") if isinstance(manifest, dict) else type(manifest).__name__
        raise _fail(mpath, f"not a graphtrace report manifest (format={found!r}, "
                           f"expected {FORMAT!r})")
    version = manifest.get("format_version")
    if version != FORMAT_VERSION or isinstance(version, bool):
        raise _fail(mpath, f"unsupported format_version {version!r} "
                           f"(this graphtrace reads {FORMAT_VERSION})")
    return manifest


def load_report(path: str | Path) -> Report:
    """Read a folder written by :meth:`Report.to_csv` back into an equal :class:`Report`.

    Imports no torch. Raises :class:`ReportError` (a ``ValueError``) with one clear line
    for a missing folder, a folder without ``manifest.json``, a foreign manifest, an
    unsupported ``format_version``, missing CSV files or columns, or unreadable values.
    ``graph.graphml`` is not needed: the graph is rebuilt from the frames.
    """
    folder = Path(path)
    manifest = _read_manifest(folder)
    files = manifest.get("files") if isinstance(manifest.get("files"), dict) else {}
    dtypes = manifest.get("dtypes") if isinstance(manifest.get("dtypes"), dict) else {}
    cats = (manifest.get("categorical") if isinstance(manifest.get("categorical"), dict)
            else {})
    csvs = {name: folder / Path(str(files.get(name) or f"{name}.csv")).name
            for name in FRAMES}
    missing = [p.name for p in csvs.values() if not p.is_file()]
    if missing:
        raise _fail(folder, f"incomplete report: missing {', '.join(missing)}")
    frames = {}
    for name in FRAMES:
        cat_cols = cats.get(name) if isinstance(cats.get(name), list) else []
        frames[name] = _read_frame(name, csvs[name], dtypes.get(name) or {}, cat_cols)
    meta = manifest.get("meta")
    if meta is not None and not isinstance(meta, dict):
        raise _fail(folder / MANIFEST, "meta is not an object")
    try:
        report = Report(frames["accesses"], frames["storages"], frames["owners"],
                        frames["edges"], meta, _kinds=dtypes,
                        _categorical={k: v for k, v in cats.items() if isinstance(v, list)})
    except ReportError as e:
        raise _fail(folder, str(e)) from None
    report._source = folder
    report._manifest = manifest
    return report


def _read_frame(name: str, csv: Path, kinds: Mapping[str, str],
                categorical: Iterable[str] = ()) -> pd.DataFrame:
    schema = dict(SCHEMA[name])
    try:
        header = pd.read_csv(csv, nrows=0).columns.tolist()
    except (pd.errors.EmptyDataError, pd.errors.ParserError, UnicodeDecodeError,
            OSError, ValueError) as e:
        raise _fail(csv, f"unreadable CSV: {str(e).splitlines()[0] if str(e) else e!r}") \
            from None
    missing = [c for c in schema if c not in header]
    if missing:
        raise _fail(csv, f"missing columns: {', '.join(missing)} "
                         f"(a {name} file has: {', '.join(schema)})")
    dtype, na_values = {}, {}
    for c in header:
        k = schema.get(c) or kinds.get(c) or "str?"
        if k not in _KINDS:
            k = "str?"
        dtype[c] = _READ_DTYPES.get(k, _STR)
        if c in categorical and k in ("str", "str?"):
            dtype[c] = "category"
        na_values[c] = [""] if k in _NULLABLE else []
    try:
        return pd.read_csv(csv, dtype=dtype, keep_default_na=False, na_values=na_values,
                           **_EXACT_FLOATS)
    except (pd.errors.ParserError, UnicodeDecodeError, OSError, ValueError,
            TypeError, OverflowError) as e:
        msg = str(e).splitlines()[0] if str(e) else repr(e)
        raise _fail(csv, f"unreadable values: {msg}") from None


def read_graphml(path: str | Path):
    """Read a report's ``graph.graphml`` (or the folder holding it) as a MultiDiGraph."""
    import networkx as nx

    p = Path(path)
    if p.is_dir():
        p = p / GRAPHML
    if not p.is_file():
        raise ReportError(f"{p}: no such GraphML file")
    return nx.read_graphml(p, force_multigraph=True, edge_key_type=str)


# --------------------------------------------------------------------------- test-suite check

def _owner_labels(report: Report) -> dict[int, str]:
    """storage_id -> ``path (kind, status); ...`` from the owners frame."""
    out: dict[int, list[str]] = {}
    for r in report.owners.itertuples(index=False):
        name = f"{r.model}:{r.path}" if r.model else str(r.path)
        out.setdefault(int(r.storage_id), []).append(f"{name} ({r.kind}, {r.status})")
    return {k: "; ".join(v) for k, v in out.items()}


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
            paths = _split(owners, ";")
            return bool(paths) and all(any(_glob_match(p, g) for g in globs) for p in paths)
        mask = mask | edges["owners"].astype(object).map(ok).astype(bool)
    return mask


def assert_no_stale(report: Report, *, allow: Iterable[str] | str = (),
                    limit: int = 50) -> None:
    """Fail (``AssertionError``) when the report has stale, dangling or diverged edges.

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
    owners = _owner_labels(report)
    counts = bad["verdict"].astype(object).value_counts()
    by = ", ".join(f"{int(counts[v])} {v}" for v in STALE_VERDICTS if v in counts)
    n_graphs = bad["graph_id"].nunique()
    lines = [f"{len(bad)} stale-like edge{'s' if len(bad) != 1 else ''} after reload "
             f"({by}) in {n_graphs} graph{'s' if n_graphs != 1 else ''}:"]
    for r in bad.head(limit).itertuples(index=False):
        impact = "" if _is_na(r.impact) else f" ({r.impact})"
        who = owners.get(int(r.storage_id)) or r.owners or "no owner"
        lines.append(f"  - graph {r.graph!r} storage {int(r.storage_id)}: {r.verdict}"
                     f"{impact}; ops {r.ops}; owners {who}")
    if len(bad) > limit:
        lines.append(f"  ... and {len(bad) - limit} more")
    lines.append("Pass allow=(verdict names or owner path globs) to accept known ones.")
    raise AssertionError("\n".join(lines))
