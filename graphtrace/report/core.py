"""``Report``: a diff's frames, its networkx graph, summaries and display.

The format of its frames, graph and folder is described once, in graphtrace.report.
"""

from __future__ import annotations

import html
from pathlib import Path
from typing import Any, Iterable, Mapping

import pandas as pd

from graphtrace.blindspots import BlindSpot
from graphtrace.report.canonical import (
    _STR,
    ReportError,
    _canon_frame,
    _plain_meta,
    is_na,
)
from graphtrace.report.check import assert_no_stale
from graphtrace.report.grouping import _crosstab
from graphtrace.report.io import (
    FORMAT_VERSION,
    _fail_in_frame,
    _read_folder,
    _write_folder,
)
from graphtrace.report.validate import check_frames, check_meta
from graphtrace.vocab import (
    BLIND_SPOT_FIELDS,
    FINDING_FIELDS,
    FRAMES,
    HOLDS,
    IMPACTS,
    STALE_VERDICTS,
    VERDICTS,
)

__all__ = ["Report", "load_report"]


class Report:
    """What a diff found: frames (``accesses``, ``storages``, ``owners``, ``edges``), the
    derived ``stale`` frame, ``summary()``, a networkx ``graph`` and ``meta``.

    Build one from frames with the columns of docs/internals.md (``Report(...)`` or
    ``Report.from_frames(...)``); a frame left out is empty. Missing columns raise
    :class:`ReportError`. Read a folder with ``Report.load``.
    """

    def __init__(self, accesses: pd.DataFrame | None = None,
                 storages: pd.DataFrame | None = None,
                 owners: pd.DataFrame | None = None,
                 edges: pd.DataFrame | None = None,
                 meta: Mapping[str, Any] | None = None):
        self._setup({"accesses": accesses, "storages": storages, "owners": owners,
                     "edges": edges}, meta)

    def _setup(self, given: Mapping[str, pd.DataFrame | None],
               meta: Mapping[str, Any] | None, *,
               kinds: Mapping[str, Mapping[str, str]] | None = None,
               categorical: Mapping[str, Iterable[str]] | None = None,
               source: Path | None = None, manifest: dict | None = None) -> None:
        """Canonical frames from ``given``. A folder's reader also passes the column kinds
        and categorical columns its manifest records, and the folder and manifest."""
        kinds = kinds or {}
        cats = categorical or {}
        self._frames = {name: _canon_frame(name, given.get(name), kinds.get(name),
                                           cats.get(name, ()))
                        for name in FRAMES}
        self._meta = _plain_meta(meta)
        check_frames(self._frames)
        check_meta(self._meta)
        self._graph = None
        self._graphs = None
        self._source: Path | None = source
        self._manifest: dict = manifest if manifest is not None else {}

    @classmethod
    def from_frames(cls, accesses: pd.DataFrame | None = None,
                    storages: pd.DataFrame | None = None,
                    owners: pd.DataFrame | None = None,
                    edges: pd.DataFrame | None = None,
                    meta: Mapping[str, Any] | None = None) -> "Report":
        """Validate the frames' columns (clear :class:`ReportError` otherwise) and build."""
        return cls(accesses, storages, owners, edges, meta)

    @classmethod
    def load(cls, path: str | Path) -> "Report":
        """Read a folder written by :meth:`to_csv` back into an equal report.

        Imports no torch. Raises :class:`ReportError` (a ``ValueError``) with one clear
        line for a missing folder, a folder without ``manifest.json``, a foreign manifest,
        an unsupported ``format_version``, a manifest field of the wrong type, missing CSV
        files or columns, a file cut, edited or damaged since it was written, or a value
        the report cannot hold (named by file, column and row; see
        graphtrace.report.validate). ``graph.graphml`` is not needed: the graph is rebuilt from the frames.
        ``source`` and ``manifest`` of the result say where it came from.
        """
        folder = Path(path)
        read = _read_folder(folder)
        report = cls.__new__(cls)
        try:
            report._setup(read.frames, read.meta, kinds=read.kinds,
                          categorical=read.categorical, source=folder,
                          manifest=read.manifest)
        except ReportError as e:
            raise _fail_in_frame(folder, read, e) from None
        if not report._meta.get("stack"):  # older than meta["stack"] (Note [fix texts])
            _neutral_fixes(report._frames["edges"])
        return report

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
        """Rows of ``edges`` whose verdict is stale-like (``STALE_VERDICTS``; index kept)."""
        e = self.edges
        return e[e["verdict"].astype(object).isin(STALE_VERDICTS)]

    @property
    def findings(self) -> pd.DataFrame:
        """What lineage found beside the edges (``meta["findings"]``): one row per finding,
        columns ``vocab.FINDING_FIELDS`` (a handle whose source was freed: Note [dangling
        sources] in graphtrace/lineage/handles.py); empty for reports without lineage."""
        return findings_frame(self._meta.get("findings") or [])

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
    def blind_spots(self) -> list[str]:
        """What the recording could not see (for example Triton kernels), as text; the
        records behind them: `blind_spot_records`, `blind_spots_frame`."""
        return [b.text for b in self.blind_spot_records]

    @property
    def blind_spot_records(self) -> list[BlindSpot]:
        """What the recording could not see, one `graphtrace.BlindSpot` each (kind, text,
        holder path, op, model, graph); plain texts of older reports have kind ``other``."""
        return [BlindSpot.from_json(b) for b in self._meta.get("blind_spots") or []]

    @property
    def blind_spots_frame(self) -> pd.DataFrame:
        """The blind spots as a frame: one row per record, columns
        ``vocab.BLIND_SPOT_FIELDS`` plus ``n_edges``, the edges it concerns (`blind_spot_edges`)."""
        records = self.blind_spot_records
        df = pd.DataFrame([b.to_json() for b in records], columns=list(BLIND_SPOT_FIELDS),
                          dtype=object)
        df["n_edges"] = pd.Series([int(self._blind_spot_mask(b).sum()) for b in records],
                                  dtype="int64")
        return df

    def blind_spot_edges(self, spot: "BlindSpot | int") -> pd.DataFrame:
        """The rows of ``edges`` a blind spot concerns (a record, or its position in
        `blind_spot_records`): its holder is among the edge's owners or its op
        among the edge's ops."""
        if not isinstance(spot, BlindSpot):
            records = self.blind_spot_records
            if not isinstance(spot, int) or not -len(records) <= spot < len(records):
                raise IndexError(f"no blind spot {spot!r}: this report has {len(records)}")
            spot = records[spot]
        return self.edges[self._blind_spot_mask(spot)]

    def _blind_spot_mask(self, spot: BlindSpot) -> pd.Series:
        edges = self.edges
        if not (spot.holder or spot.op) or edges.empty:
            return pd.Series(False, index=edges.index)
        owners = edges["owners"].astype(object).to_numpy()
        ops = edges["ops"].astype(object).to_numpy()
        hit = [spot.matches(o, p) for o, p in zip(owners, ops)]
        return pd.Series(hit, index=edges.index, dtype=bool)

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

        ``summary()``: index ``verdict`` (every verdict, in contract order), columns ``edges``,
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
                **{k: int((imp == k).sum()) for k in IMPACTS},
            })
        out = pd.DataFrame(rows, index=pd.Index(list(VERDICTS), dtype=object, name="verdict"))
        return out.astype("int64")

    def counts(self) -> dict[str, int]:
        """``{verdict: number of edges}`` for every verdict."""
        vc = self.edges["verdict"].astype(object).value_counts()
        return {v: int(vc.get(v, 0)) for v in VERDICTS}

    # ---- graph
    @property
    def graph(self):
        """networkx ``MultiDiGraph`` of graphs, storages and owners (see graphtrace.report)."""
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
                       impact="" if is_na(r.impact) else str(r.impact),
                       origin="" if is_na(r.origin) else str(r.origin),
                       stale=str(r.verdict) in STALE_VERDICTS, ops=str(r.ops),
                       args=str(r.args), module=str(r.module), dtype=str(r.dtype),
                       shape=str(r.shape))
        for r in self.owners.itertuples(index=False):
            o, s = f"owner:{r.model}:{r.path}", f"storage:{int(r.storage_id)}"
            if s not in G:
                G.add_node(s, kind="storage", storage_id=int(r.storage_id),
                           stale=int(r.storage_id) in stale_sids)
            attrs = {"relation": "owned_at_capture", "status": str(r.status)}
            if not is_na(r.live_data_ptr):
                attrs["live_data_ptr"] = int(r.live_data_ptr)
            G.add_edge(o, s, key="owned_at_capture", **attrs)
            if str(r.status) == HOLDS:
                G.add_edge(o, s, key="owns_now", relation="owns_now")
        # lineage: source parameter -> derived storage (-> the graphs that read it, above)
        if "derived_from" in e.columns:
            pairs = e[["storage_id", "derived_from"]].astype({"derived_from": object})
            for sid, text in pairs.drop_duplicates().itertuples(index=False):
                for source in str(text or "").split("; "):
                    if not source:
                        continue
                    freed = source.endswith(" (freed)")
                    path = source.removesuffix(" (freed)")
                    model, _, bare = path.rpartition(":") if ":" in path else ("", "", path)
                    node = f"owner:{model}:{bare}"
                    if node not in G:
                        G.add_node(node, kind="owner", model=model, path=bare,
                                   owner_kind="source", status="")
                    G.add_edge(node, f"storage:{int(sid)}", key="derived_from",
                               relation="derived_from", freed=freed)
        return G

    # ---- files
    def to_csv(self, path: str | Path, *, graphml: bool | None = None) -> Path:
        """Write the report folder (created if needed): ``accesses.csv``, ``storages.csv``,
        ``owners.csv``, ``edges.csv``, ``graph.graphml`` and ``manifest.json``. Returns
        the folder. Atomic, and a folder that is not a report is refused (Note [What a
        report folder guarantees] in report/io.py).

        GraphML is for other graph tools; ``load_report`` rebuilds ``.graph`` from the CSVs.
        It costs ~10x the CSVs, so by default (``graphml=None``) it is left out above
        ``GRAPHML_MAX_EDGES`` edges, and the manifest says so; ``graphml=True`` forces it.
        """
        return _write_folder(path, self._frames, self._meta, lambda: self.graph, graphml)

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


def findings_frame(records: Iterable[Mapping]) -> pd.DataFrame:
    """A frame of finding records (dicts with `vocab.FINDING_FIELDS`; missing ones "")."""
    return pd.DataFrame([[str(r.get(c, "")) for c in FINDING_FIELDS] for r in records],
                        columns=list(FINDING_FIELDS), dtype=object)


def _neutral_fixes(edges: pd.DataFrame) -> None:
    """In the edges of a report without `meta["stack"]`, the neutral text in place of each
    fix text of an earlier release that named one stack's API (graphtrace.fixes)."""
    from graphtrace.fixes import LEGACY_TEXTS, neutral_text

    if "fix" not in edges.columns or not len(edges):
        return
    legacy = {text: neutral_text(kind) for text, kind in LEGACY_TEXTS.items()}
    col = edges["fix"]
    values = col.astype(object)
    if not values.isin(list(legacy)).any():
        return
    values = values.replace(legacy)
    edges["fix"] = values.astype("category") if isinstance(col.dtype, pd.CategoricalDtype) \
        else values


def load_report(path: str | Path) -> Report:
    """Read a folder written by :meth:`Report.to_csv` back into an equal :class:`Report`
    (:meth:`Report.load`; see there for the errors)."""
    return Report.load(path)
