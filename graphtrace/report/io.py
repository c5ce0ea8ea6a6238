"""Report folders: writing the CSVs, GraphML and manifest, and reading them back.

Works on frames and meta, never on a Report (``Report.to_csv`` and ``Report.load`` call
it), so the folder format lives here and the Report's behaviour in core.
"""

from __future__ import annotations

import datetime as _dt
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping

import pandas as pd

from graphtrace.report.canonical import (
    _EXACT_FLOATS,
    _NULLABLE,
    _READ_DTYPES,
    _STR,
    ReportError,
    _frame_kinds,
    _json_default,
)
from graphtrace.vocab import COLUMN_KINDS, FRAMES, SCHEMA

__all__ = ["FORMAT", "FORMAT_VERSION", "MANIFEST", "GRAPHML", "GRAPHML_MAX_EDGES",
           "read_graphml"]

FORMAT = "graphtrace-report"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
GRAPHML = "graph.graphml"
GRAPHML_MAX_EDGES = 200_000


def _now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


# --------------------------------------------------------------------------- writing

def _write_folder(path: str | Path, frames: Mapping[str, pd.DataFrame], meta: dict,
                  graph: Callable[[], Any], graphml: bool | None) -> Path:
    """Write ``frames`` (canonical) and ``meta`` as a report folder; ``graph()`` gives the
    networkx graph, asked for only when GraphML is written. See ``Report.to_csv``."""
    import networkx as nx

    from graphtrace import __version__

    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    dtypes, categorical = {}, {}
    for name in FRAMES:
        df = frames[name]
        df.to_csv(out / f"{name}.csv", index=False, lineterminator="\n")
        dtypes[name], categorical[name] = _frame_kinds(name, df)
    if graphml is None:
        graphml = len(frames["edges"]) <= GRAPHML_MAX_EDGES
    files = {name: f"{name}.csv" for name in FRAMES}
    if graphml:
        nx.write_graphml(graph(), out / GRAPHML)
        files["graph"] = GRAPHML
    else:
        (out / GRAPHML).unlink(missing_ok=True)
    manifest = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "graphtrace_version": __version__,
        "torch_version": meta.get("torch_version"),
        "created": meta.get("created") or _now(),
        "written": _now(),
        "files": files,
        "graphml_skipped": None if graphml else (
            f"{len(frames['edges'])} edges > {GRAPHML_MAX_EDGES}: write it with "
            "to_csv(dir, graphml=True); Report.graph rebuilds the graph from the CSVs"),
        "dtypes": dtypes,
        "categorical": categorical,
        "meta": meta,
    }
    tmp = out / (MANIFEST + ".tmp")
    tmp.write_text(json.dumps(manifest, indent=2, default=_json_default) + "\n")
    tmp.replace(out / MANIFEST)
    return out


# --------------------------------------------------------------------------- reading

def _fail(path: Path, message: str) -> ReportError:
    return ReportError(f"{path}: {message}")


@dataclass
class _Folder:
    """What a report folder holds, ready for ``Report``: frames as read (not yet
    canonical), the kinds and categorical columns the manifest records, meta, manifest."""

    frames: dict[str, pd.DataFrame]
    kinds: dict[str, Mapping[str, str]]
    categorical: dict[str, list[str]]
    meta: dict | None
    manifest: dict


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


def _read_folder(folder: Path) -> _Folder:
    """Read a report folder's manifest and CSVs; ReportError (naming the file) when it is
    not a report, a file is missing or a value cannot be read."""
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
    return _Folder(frames=frames, kinds=dtypes,
                   categorical={k: v for k, v in cats.items() if isinstance(v, list)},
                   meta=meta, manifest=manifest)


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
        if k not in COLUMN_KINDS:
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
