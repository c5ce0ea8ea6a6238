"""Torch-free helpers on a :class:`~graphtrace.report.Report`, for notebooks and plots.

(Named ``graphtrace.analysis`` before; the top-level ``analysis/`` folder holds benchmark and
audit scripts, not this.)

Each helper is a small stateless function of a report: frames first, then drawing helpers,
each returning a matplotlib ``Figure`` (made with the Agg canvas, never pyplot, so nothing
opens a window); pass ``ax=`` to draw into an axes of your own. In Jupyter run ``%matplotlib
inline`` once: without it IPython shows a returned figure as text, since only a matplotlib
backend registers the PNG formatter.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pandas as pd

from graphtrace.report import (
    Report,
    graph_names,
    group_keys,
    layer_of,
    natural_key,
    split_joined,
)
from graphtrace.vocab import IMPACTS, STALE_VERDICTS, VERDICTS

__all__ = [
    "VERDICT_COLORS",
    "layer_of",
    "stale_by",
    "ownership_by_graph",
    "verdicts_per_layer",
    "read_matrix",
    "stale_subgraph",
    "plot_verdicts_per_layer",
    "draw_stale_subgraph",
    "plot_read_matrix",
]

# One colour per verdict, in the order of vocab.VERDICTS.
VERDICT_COLORS = dict(zip(VERDICTS, (
    "#4caf50", "#d62728", "#6a1b9a", "#ff7f0e", "#9e9e9e", "#90caf9", "#c2185b"), strict=True))


# --------------------------------------------------------------------------- frames

def stale_by(report: Report, by: str = "module") -> pd.DataFrame:
    """Stale-like edges grouped by ``module``, ``layer``, ``op``, ``owner_kind`` or ``graph``.

    One row per group that has any (groups: `graphtrace.report.group_keys`): a column per
    stale-like verdict, ``total``, impact counts ``manifest``, ``latent``, ``unknown``, and
    the distinct ``storages`` and ``graphs`` involved. Sorted by ``total`` (descending),
    then by group name in natural order.
    """
    stale = report.stale
    cols = [*STALE_VERDICTS, "total", *IMPACTS, "storages", "graphs"]
    keys = group_keys(stale, by)
    if keys.empty:
        return pd.DataFrame({c: pd.Series([], dtype="int64") for c in cols},
                            index=pd.Index([], dtype=object, name=by))
    rows = stale.loc[keys.index]
    frame = pd.DataFrame({
        by: keys.to_numpy(),
        "verdict": rows["verdict"].astype(object).to_numpy(),
        "impact": rows["impact"].astype(object).to_numpy(),
        "storage_id": rows["storage_id"].to_numpy(),
        "graph_id": rows["graph_id"].to_numpy(),
    })
    out = {}
    for key, g in frame.groupby(by, sort=False):
        rec = {v: int((g["verdict"] == v).sum()) for v in STALE_VERDICTS}
        rec["total"] = len(g)
        for imp in IMPACTS:
            rec[imp] = int((g["impact"] == imp).sum())
        rec["storages"] = int(g["storage_id"].nunique())
        rec["graphs"] = int(g["graph_id"].nunique())
        out[key] = rec
    order = sorted(out, key=lambda k: (-out[k]["total"], natural_key(k)))
    df = pd.DataFrame([out[k] for k in order], columns=cols,
                      index=pd.Index(order, dtype=object, name=by))
    return df.astype("int64")


def _blind_spot_counts(report: Report, graphs: pd.DataFrame) -> list[int]:
    """A blind spot without a ``graph`` applies to every graph; one with a ``graph`` (label
    or id) applies to that graph only."""
    counts = []
    records = report.blind_spot_records
    for gid, label in zip(graphs["graph_id"], graphs["label"]):
        counts.append(sum(not b.graph or b.graph in (label, str(gid)) for b in records))
    return counts


def ownership_by_graph(report: Report) -> pd.DataFrame:
    """What each captured graph saw, and how much of it has a known owner.

    Columns: ``graph_id``, ``graph``, ``kind`` (emulated/cuda), ``ops``, ``accesses``
    (rows recorded), ``storages`` (distinct storages accessed, views included),
    ``edges`` (storages read or written), ``owned`` (edges with a capture-time owner),
    ``owned_fraction`` (owned / edges; NaN without edges), ``unowned_internal``,
    ``unowned_external``, ``stale`` (stale-like edges) and ``blind_spots``.
    """
    graphs = report.graphs
    acc, e = report.accesses, report.edges
    n_acc = acc.groupby("graph_id").size()
    n_sto = acc.groupby("graph_id")["storage_id"].nunique()
    verdict = e["verdict"].astype(object)
    origin = e["origin"].astype(object)
    unowned = verdict == "unowned"
    per = pd.DataFrame({
        "graph_id": e["graph_id"],
        "edge": 1,
        "owned": (e["n_owners"] > 0).astype("int64"),
        "unowned_internal": (unowned & (origin == "internal")).astype("int64"),
        "unowned_external": (unowned & (origin == "external")).astype("int64"),
        "stale": verdict.isin(STALE_VERDICTS).astype("int64"),
    }).groupby("graph_id").sum().reindex(graphs["graph_id"], fill_value=0)
    rows = []
    for gid, label, kind, n_ops in zip(graphs["graph_id"], graphs["label"], graphs["kind"],
                                       graphs["n_ops"]):
        p = per.loc[gid]
        rows.append({
            "graph_id": int(gid), "graph": label, "kind": kind, "ops": int(n_ops),
            "accesses": int(n_acc.get(gid, 0)), "storages": int(n_sto.get(gid, 0)),
            "edges": int(p["edge"]), "owned": int(p["owned"]),
            "owned_fraction": p["owned"] / p["edge"] if p["edge"] else float("nan"),
            "unowned_internal": int(p["unowned_internal"]),
            "unowned_external": int(p["unowned_external"]),
            "stale": int(p["stale"]),
        })
    cols = ["graph_id", "graph", "kind", "ops", "accesses", "storages", "edges", "owned",
            "owned_fraction", "unowned_internal", "unowned_external", "stale", "blind_spots"]
    df = pd.DataFrame(rows, columns=cols[:-1])
    df["blind_spots"] = pd.Series(_blind_spot_counts(report, graphs), dtype="int64")
    ints = {c: "int64" for c in cols if c not in ("graph", "kind", "owned_fraction")}
    return df.astype(ints | {"owned_fraction": "float64"})


def verdicts_per_layer(report: Report) -> pd.DataFrame:
    """Edges by layer (rows, natural order) and verdict (columns, plus ``total``)."""
    return report.summary(by="layer")


def read_matrix(report: Report, *, stale_only: bool = False) -> pd.DataFrame:
    """Graph x storage matrix of verdicts.

    Index: graph labels, by graph id (``label#id`` where labels repeat); columns: storage
    ids, ascending; values: the verdict of the edge, NaN where the graph did not read or
    write that storage. With ``stale_only``, only storages that have a stale-like edge.
    """
    e = report.edges
    graphs = report.graphs
    sids = e["storage_id"]
    if stale_only:
        sids = report.stale["storage_id"]
    columns = sorted(set(int(s) for s in sids))
    names = graph_names(graphs["graph_id"], graphs["label"])
    gids = graphs["graph_id"].tolist()
    row = {gid: i for i, gid in enumerate(gids)}
    col = {sid: j for j, sid in enumerate(columns)}
    values = np.full((len(gids), len(columns)), np.nan, dtype=object)
    for gid, sid, v in zip(e["graph_id"], e["storage_id"], e["verdict"].astype(object)):
        j = col.get(int(sid))
        if j is not None:
            values[row[int(gid)], j] = v
    return pd.DataFrame(values, index=pd.Index([names[g] for g in gids], dtype=object,
                                               name="graph"),
                        columns=pd.Index(columns, dtype="int64", name="storage_id"))


def _matches(path: Any, target: str) -> bool:
    """``target`` is a dotted component run of ``path`` (``layers.0`` in ``model.layers.0.mlp``)."""
    if not isinstance(path, str) or not path:
        return False
    if path == target or layer_of(path) == target:
        return True
    p = "." + path.replace("[", ".[") + "."
    t = "." + target.replace("[", ".[")
    return (t + ".") in p or (t + "[") in p


def stale_subgraph(report: Report, layer_or_module: str | None = None):
    """The part of ``report.graph`` around stale-like edges, as a new ``MultiDiGraph``.

    Keeps each stale-like edge whose module, or one of whose owner paths, contains
    ``layer_or_module`` as whole dotted components (``"layers.1"``, ``"layers.1.kernel"``,
    ``"lm_head"``; ``None`` keeps all): its graph node, its storage node, every owner of
    that storage, and every edge among them (so stable reads of the same storages by
    other kept graphs are kept too). Empty when nothing matches.
    """
    nodes: set[str] = set()
    owners_of: dict[int, list[str]] = {}
    for r in report.owners.itertuples(index=False):
        owners_of.setdefault(int(r.storage_id), []).append(f"owner:{r.model}:{r.path}")
    for r in report.stale.itertuples(index=False):
        if layer_or_module is not None:
            paths = [r.module, *split_joined(r.owners, ";")]
            if not any(_matches(p, layer_or_module) for p in paths):
                continue
        sid = int(r.storage_id)
        nodes.add(f"graph:{int(r.graph_id)}")
        nodes.add(f"storage:{sid}")
        nodes.update(owners_of.get(sid, []))
    return report.graph.subgraph(nodes).copy()


# --------------------------------------------------------------------------- drawing

def _figure(ax, figsize):
    if ax is not None:
        return ax.figure, ax
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=figsize, layout="constrained")
    FigureCanvasAgg(fig)
    return fig, fig.add_subplot()


def _short(text: str, n: int) -> str:
    """Clip a path to ``n`` characters keeping its layer and its tail:
    ``layers.3...kernel.workspace``."""
    text = str(text)
    if len(text) <= n:
        return text
    head = layer_of(text)
    if head and len(head) + 3 + 8 <= n:
        return head + "..." + text[-(n - len(head) - 3):]
    return "..." + text[-(n - 3):]


def plot_verdicts_per_layer(report: Report, *, ax=None, figsize=(8, 4)):
    """Stacked bars: edges per layer, coloured by verdict. Returns the Figure."""
    table = verdicts_per_layer(report)
    fig, ax = _figure(ax, figsize)
    x = np.arange(len(table))
    bottom = np.zeros(len(table))
    for v in VERDICTS:
        vals = table[v].to_numpy(dtype=float) if len(table) else np.zeros(0)
        if vals.any():
            ax.bar(x, vals, bottom=bottom, color=VERDICT_COLORS[v], label=v,
                   edgecolor="white", linewidth=0.5)
            bottom += vals
    ax.set_xticks(x, [str(i) for i in table.index],
                  rotation=45 if len(table) > 8 else 0, ha="right" if len(table) > 8 else "center")
    ax.set_xlabel("layer")
    ax.set_ylabel("edges (graph, storage)")
    ax.set_title("Verdicts per layer")
    if len(table):
        ax.legend(loc="upper right", fontsize="small", frameon=False)
    else:
        ax.text(0.5, 0.5, "no edges", ha="center", va="center", transform=ax.transAxes)
    return fig


def draw_stale_subgraph(report: Report, layer_or_module: str | None = None, *, ax=None,
                        figsize=(10, 5), max_nodes: int = 120):
    """Draw ``stale_subgraph``: owners (left), storages (middle), graphs (right).

    Read edges are coloured by verdict; ``owned_at_capture`` is dashed, ``owns_now``
    solid green; freed storages are hollow. Returns the Figure.
    """
    from matplotlib.lines import Line2D

    H = stale_subgraph(report, layer_or_module)
    fig, ax = _figure(ax, figsize)
    ax.set_axis_off()
    title = "Stale subgraph" + (f" around {layer_or_module}" if layer_or_module else "")
    ax.set_title(title)
    if H.number_of_nodes() == 0:
        ax.text(0.5, 0.5, "no stale edges", ha="center", va="center", transform=ax.transAxes)
        return fig
    if H.number_of_nodes() > max_nodes:
        ax.text(0.5, 0.5, f"{H.number_of_nodes()} nodes: too many to draw "
                f"(narrow it with layer_or_module)", ha="center", va="center",
                transform=ax.transAxes)
        return fig
    columns = {"owner": 0.0, "storage": 1.0, "graph": 2.0}
    by_kind: dict[str, list[str]] = {k: [] for k in columns}
    for n, d in H.nodes(data=True):
        by_kind.setdefault(d.get("kind", "storage"), []).append(n)
    by_kind["storage"].sort(key=natural_key)
    rank = {n: i for i, n in enumerate(by_kind["storage"])}
    by_kind["owner"].sort(key=lambda n: (min((rank.get(s, 0) for s in H.successors(n)),
                                             default=0), natural_key(n)))
    by_kind["graph"].sort(key=natural_key)
    pos = {}
    for kind, ns in by_kind.items():
        for i, n in enumerate(ns):
            pos[n] = (columns.get(kind, 1.0), 1.0 - (i + 1) / (len(ns) + 1))
    for u, v, k, d in H.edges(keys=True, data=True):
        (x0, y0), (x1, y1) = pos[u], pos[v]
        if d.get("relation") == "owned_at_capture":
            style = dict(color="#616161", linestyle="--", linewidth=1)
        elif d.get("relation") == "owns_now":
            style = dict(color=VERDICT_COLORS["stable"], linewidth=2, alpha=0.6)
        else:
            style = dict(color=VERDICT_COLORS.get(d.get("verdict"), "#000000"),
                         linewidth=2.5 if d.get("stale") else 1)
        ax.annotate("", xy=(x1, y1), xytext=(x0, y0),
                    arrowprops=dict(arrowstyle="-|>", shrinkA=6, shrinkB=6, **style))
    markers = {"owner": "s", "storage": "o", "graph": "D"}
    for n, d in H.nodes(data=True):
        kind = d.get("kind", "storage")
        x, y = pos[n]
        if kind == "storage":
            face = "white" if d.get("alive") is False else "#424242"
            label = f"s{d.get('storage_id')}" + (f" {d['nbytes']}B" if "nbytes" in d else "")
            if d.get("alive") is False:
                label += " (freed)"
        elif kind == "owner":
            face = "#8d6e63"
            label = _short(d.get("path", n), 44) + f" [{d.get('owner_kind', '')}]"
        else:
            face = "#1565c0"
            label = str(d.get("label", n))
        ax.plot([x], [y], marker=markers.get(kind, "o"), markersize=9, color=face,
                markeredgecolor="#212121", linestyle="none")
        ha = "right" if kind == "owner" else ("left" if kind == "graph" else "center")
        dx = {"right": -0.05, "left": 0.05, "center": 0.0}[ha]
        dy = 0.035 if ha == "center" else 0.0
        ax.text(x + dx, y + dy, label, ha=ha, va="center", fontsize=8)
    ax.set_xlim(-1.3, 2.8)
    ax.set_ylim(0, 1)
    handles = [Line2D([], [], color=VERDICT_COLORS[v], linewidth=2.5, label=v)
               for v in STALE_VERDICTS]
    handles += [Line2D([], [], color="#616161", linestyle="--", label="owned at capture"),
                Line2D([], [], color=VERDICT_COLORS["stable"], linewidth=2, alpha=0.6,
                       label="owns now")]
    ax.legend(handles=handles, loc="lower center", ncol=5, fontsize="small", frameon=False,
              bbox_to_anchor=(0.5, -0.08))
    return fig


def plot_read_matrix(report: Report, *, stale_only: bool = False, ax=None, figsize=None,
                     max_labels: int = 60):
    """Graph x storage matrix, cells coloured by verdict (blank: not accessed).

    Storage ticks name the first owner path where there is one. Returns the Figure.
    """
    from matplotlib.colors import ListedColormap
    from matplotlib.patches import Patch

    m = read_matrix(report, stale_only=stale_only)
    if figsize is None:
        figsize = (max(6.0, min(18.0, 0.35 * m.shape[1] + 3)),
                   max(3.0, min(12.0, 0.4 * m.shape[0] + 2)))
    fig, ax = _figure(ax, figsize)
    ax.set_title("Storages read per graph" + (" (stale only)" if stale_only else ""))
    if m.size == 0:
        ax.set_axis_off()
        ax.text(0.5, 0.5, "no edges", ha="center", va="center", transform=ax.transAxes)
        return fig
    code = {v: i for i, v in enumerate(VERDICTS)}
    values = np.array([[code.get(v, np.nan) if isinstance(v, str) else np.nan for v in row]
                       for row in m.to_numpy()], dtype=float)
    cmap = ListedColormap([VERDICT_COLORS[v] for v in VERDICTS]).with_extremes(bad="white")
    ax.imshow(np.ma.masked_invalid(values), cmap=cmap, vmin=-0.5, vmax=len(VERDICTS) - 0.5,
              aspect="auto", interpolation="nearest")
    first_owner = {}
    for r in report.owners.itertuples(index=False):
        first_owner.setdefault(int(r.storage_id), str(r.path))
    if m.shape[1] <= max_labels:
        ax.set_xticks(np.arange(m.shape[1]),
                      [_short(first_owner.get(s, f"s{s}"), 32) for s in m.columns],
                      rotation=60, ha="right", fontsize=7)
    ax.set_xlabel("storage")
    if m.shape[0] <= max_labels:
        ax.set_yticks(np.arange(m.shape[0]), [str(i) for i in m.index], fontsize=8)
    ax.set_ylabel("graph")
    present = [v for v in VERDICTS if (values == code[v]).any()]
    ax.legend(handles=[Patch(color=VERDICT_COLORS[v], label=v) for v in present],
              loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize="small", frameon=False)
    return fig
