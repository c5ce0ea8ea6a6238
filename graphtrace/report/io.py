"""Report folders: writing the CSVs, GraphML and manifest, and reading them back.

Works on frames and meta, never on a Report (``Report.to_csv`` and ``Report.load`` call
it), so the folder format lives here and the Report's behaviour in core.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import hashlib
import io
import json
import os
import re
import shutil
import tempfile
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping

import numpy as np
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
from graphtrace.vocab import ADDED_COLUMNS, COLUMN_KINDS, FRAMES, SCHEMA

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

# Note [What a report folder guarantees]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# A folder holds the four frames' CSVs, graph.graphml (optional, never read back) and
# manifest.json. The manifest records, besides the format and column kinds, each frame's
# row count (`rows`), each file's SHA-256 (`sha256`) and a `checksum`: the SHA-256 of the
# manifest's own JSON without that key (keys sorted, no spaces). Load checks all three when
# present, so a folder loads only as written: a CSV cut at a line end, edited, or a manifest
# value changed reads as a ReportError. Folders written before these keys existed (and
# folders made by hand, such as tests/data/reload_report) load without them; every folder's
# values are then checked as any Report's are (graphtrace.report.validate), and a CSV must
# end with a newline (a last line cut inside a field would otherwise still parse).
#
# Writing is atomic per folder: everything is written into a staging folder first. A new
# target is that folder renamed into place. An existing one is a graphtrace report (or holds
# none of a report's file names): its old manifest moves out first (from then on the folder
# is no report), then its old report files, then the new files move in, the manifest last.
# A failure on the way moves everything back, so the folder holds the old report whole, or
# (if the machine dies mid-swap) no manifest: never new CSVs under an old manifest. Files
# that are not the report's own stay where they are.

STAGE_PREFIX = ".graphtrace-write-"
_CHECKSUM = "checksum"


def _own_files() -> tuple[str, ...]:
    """The file names a report folder's writer owns (and replaces), the manifest last."""
    return (*(f"{name}.csv" for name in FRAMES), GRAPHML, MANIFEST)


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _manifest_checksum(manifest: Mapping[str, Any]) -> str:
    """SHA-256 of the manifest's JSON without its checksum (Note [What a report folder
    guarantees])."""
    body = {k: v for k, v in manifest.items() if k != _CHECKSUM}
    text = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return hashlib.sha256(text.encode("ascii")).hexdigest()


def _check_target(out: Path) -> None:
    """An existing folder may be written only if it is a graphtrace report or holds none of
    a report's file names (its own files are never overwritten)."""
    mpath = out / MANIFEST
    if mpath.exists():
        try:
            found = json.loads(mpath.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, ValueError, RecursionError):
            found = None
        if isinstance(found, dict) and found.get("format") == FORMAT:
            return
        raise ReportError(f"{out}: holds a {MANIFEST} that is not a graphtrace report's; "
                          "not overwriting it (write the report to another folder)")
    clash = [n for n in _own_files() if (out / n).exists()]
    if clash:
        raise ReportError(f"{out}: holds {', '.join(clash)} but is not a graphtrace report "
                          f"(no {MANIFEST}); not overwriting them (write the report to "
                          "another folder, or remove them)")


def _write_files(stage: Path, frames: Mapping[str, pd.DataFrame], meta: dict,
                 graph: Callable[[], Any], graphml: bool | None) -> list[str]:
    """Write the report's files into ``stage``; their names, the manifest last."""
    import networkx as nx

    from graphtrace import __version__

    dtypes, categorical, rows, sha = {}, {}, {}, {}
    for name in FRAMES:
        df = frames[name]
        csv = stage / f"{name}.csv"
        df.to_csv(csv, index=False, lineterminator="\n", encoding="utf-8")
        dtypes[name], categorical[name] = _frame_kinds(name, df)
        rows[name] = len(df)
        sha[csv.name] = _sha256_file(csv)
    if graphml is None:
        graphml = len(frames["edges"]) <= GRAPHML_MAX_EDGES
    files = {name: f"{name}.csv" for name in FRAMES}
    if graphml:
        nx.write_graphml(graph(), stage / GRAPHML)
        files["graph"] = GRAPHML
        sha[GRAPHML] = _sha256_file(stage / GRAPHML)
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
        "rows": rows,
        "sha256": sha,
        "meta": meta,
    }
    manifest = json.loads(json.dumps(manifest, default=_json_default))  # as it reads back
    manifest[_CHECKSUM] = _manifest_checksum(manifest)
    (stage / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n", encoding="utf-8")
    return [*(f"{name}.csv" for name in FRAMES), *([GRAPHML] if graphml else []), MANIFEST]


def _swap_in(stage: Path, out: Path, names: list[str]) -> None:
    """Replace the report files of the existing folder ``out`` by ``names`` from ``stage``
    (Note [What a report folder guarantees]); on failure put the old ones back."""
    backup = Path(tempfile.mkdtemp(prefix=STAGE_PREFIX + "old-", dir=out))
    moved_out: list[str] = []
    moved_in: list[str] = []
    try:
        for name in (MANIFEST, *_own_files()[:-1]):  # the old manifest first
            if (out / name).exists():
                os.replace(out / name, backup / name)
                moved_out.append(name)
        for name in names:  # the new manifest last
            os.replace(stage / name, out / name)
            moved_in.append(name)
    except BaseException:
        for name in reversed(moved_in):
            with contextlib.suppress(OSError):
                os.replace(out / name, stage / name)
        for name in reversed(moved_out):  # the old manifest last
            with contextlib.suppress(OSError):
                os.replace(backup / name, out / name)
        with contextlib.suppress(OSError):
            backup.rmdir()  # only when every old file went back
        raise
    shutil.rmtree(backup, ignore_errors=True)


def _write_folder(path: str | Path, frames: Mapping[str, pd.DataFrame], meta: dict,
                  graph: Callable[[], Any], graphml: bool | None) -> Path:
    """Write ``frames`` (canonical) and ``meta`` as a report folder, atomically; ``graph()``
    gives the networkx graph, asked for only when GraphML is written. See ``Report.to_csv``
    and Note [What a report folder guarantees]."""
    out = Path(path)
    if out.exists() and not out.is_dir():
        raise ReportError(f"{out}: exists and is not a folder (a report is a folder)")
    existing = out.is_dir()
    if existing:
        _check_target(out)
    else:
        out.parent.mkdir(parents=True, exist_ok=True)
    stage = Path(tempfile.mkdtemp(prefix=STAGE_PREFIX, dir=out if existing else out.parent))
    try:
        names = _write_files(stage, frames, meta, graph, graphml)
        if existing:
            _swap_in(stage, out, names)
        else:
            try:
                os.rename(stage, out)
            except OSError:  # made meanwhile by someone else
                if not out.is_dir():
                    raise
                _check_target(out)
                _swap_in(stage, out, names)
    finally:
        if stage.exists():
            shutil.rmtree(stage, ignore_errors=True)
    return out


# --------------------------------------------------------------------------- reading

def _fail(path: Path, message: str) -> ReportError:
    return ReportError(f"{path}: {message}")


def _at_row(column: str, row: int | None) -> str:
    """``column x, row 3 (line 5)``: the CSV's header is line 1."""
    col = f"column{'s' if ', ' in column else ''} {column}"
    return col if row is None else f"{col}, row {row} (line {row + 2})"


@dataclass
class _Folder:
    """What a report folder holds, ready for ``Report``: frames as read (not yet
    canonical), the kinds and categorical columns the manifest records, meta, manifest,
    and the CSV each frame came from."""

    frames: dict[str, pd.DataFrame]
    kinds: dict[str, Mapping[str, str]]
    categorical: dict[str, list[str]]
    meta: dict | None
    manifest: dict
    paths: dict[str, Path]


def _fail_in_frame(folder: Path, read: _Folder, error: ReportError) -> ReportError:
    """A ReportError from checking the frames or meta read from ``folder``, as one line
    naming the file (and the column and row for a frame's values)."""
    if error.frame in read.paths:
        return _fail(read.paths[error.frame],
                     f"{_at_row(error.column or '?', error.row)}: {error.detail}")
    if str(error).startswith("meta"):
        return _fail(folder / MANIFEST, str(error))
    return _fail(folder, str(error))


_HEX64 = re.compile(r"[0-9a-f]{64}")


def _check_manifest(manifest: dict, mpath: Path) -> None:
    """Every manifest field the reader uses has the type the writer gives it."""
    def bad(key: str, what: str, got: Any) -> ReportError:
        shown = "null" if got is None else (repr(got) if isinstance(got, (str, int, float))
                                            else type(got).__name__)
        return _fail(mpath, f"{key}: expected {what}, got {shown[:80]}")

    def mapping(key: str, keys: Iterable[str] | None) -> dict:
        value = manifest.get(key)
        if value is None:
            return {}
        if not isinstance(value, dict):
            raise bad(key, "an object", value)
        if keys is not None:
            unknown = [k for k in value if k not in keys]
            if unknown:
                raise bad(f"{key}.{unknown[0]}", f"one of {', '.join(keys)}", unknown[0])
        return value

    for key in ("graphtrace_version", "torch_version", "created", "written",
                "graphml_skipped"):
        if manifest.get(key) is not None and not isinstance(manifest[key], str):
            raise bad(key, "a string", manifest[key])
    for name, file in mapping("files", (*FRAMES, "graph")).items():
        if not isinstance(file, str) or not file or Path(file).name != file:
            raise bad(f"files.{name}", "a file name", file)
    for name, kinds in mapping("dtypes", FRAMES).items():
        if not isinstance(kinds, dict):
            raise bad(f"dtypes.{name}", "an object", kinds)
        schema = dict(SCHEMA[name])
        for column, kind in kinds.items():
            want = schema.get(column)
            if kind not in COLUMN_KINDS or (want is not None and kind != want):
                raise bad(f"dtypes.{name}.{column}",
                          repr(want) if want else f"one of {', '.join(COLUMN_KINDS)}", kind)
    for name, columns in mapping("categorical", FRAMES).items():
        if not isinstance(columns, list) or not all(isinstance(c, str) for c in columns):
            raise bad(f"categorical.{name}", "a list of column names", columns)
    for name, n in mapping("rows", FRAMES).items():
        if not isinstance(n, int) or isinstance(n, bool) or n < 0:
            raise bad(f"rows.{name}", "an integer >= 0", n)
    for file, digest in mapping("sha256", None).items():
        if not isinstance(digest, str) or not _HEX64.fullmatch(digest):
            raise bad(f"sha256.{file}", "a SHA-256 in hex", digest)
    checksum = manifest.get(_CHECKSUM)
    if _CHECKSUM in manifest:
        if not isinstance(checksum, str) or not _HEX64.fullmatch(checksum):
            raise bad(_CHECKSUM, "a SHA-256 in hex", checksum)
        try:
            expected = _manifest_checksum(manifest)
        except (RecursionError, ValueError):
            raise _fail(mpath, "unreadable manifest: nested too deeply") from None
        if checksum != expected:
            raise _fail(mpath, "the manifest differs from the one written (its checksum "
                               "does not match): it was edited or damaged")
    meta = manifest.get("meta")
    if meta is not None and not isinstance(meta, dict):
        raise bad("meta", "an object", meta)


def _read_manifest(folder: Path) -> dict:
    if not folder.exists():
        raise _fail(folder, "no such report folder")
    if not folder.is_dir():
        raise _fail(folder, "not a folder (a report is a folder written by Report.to_csv)")
    mpath = folder / MANIFEST
    if not mpath.is_file():
        raise _fail(folder, f"not a graphtrace report (no {MANIFEST})")
    try:
        manifest = json.loads(mpath.read_bytes().decode("utf-8"))
    except RecursionError:
        raise _fail(mpath, "unreadable manifest: nested too deeply") from None
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise _fail(mpath, f"unreadable manifest: {e}") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        found = manifest.get("format") if isinstance(manifest, dict) else type(manifest).__name__
        if not isinstance(found, (str, int, float, type(None))):
            found = type(found).__name__
        raise _fail(mpath, f"not a graphtrace report manifest (format={found!r}, "
                           f"expected {FORMAT!r})")
    version = manifest.get("format_version")
    if version != FORMAT_VERSION or isinstance(version, bool) or isinstance(version, float):
        shown = version if isinstance(version, (str, int, float, type(None))) \
            else type(version).__name__
        raise _fail(mpath, f"unsupported format_version {shown!r} "
                           f"(this graphtrace reads {FORMAT_VERSION})")
    _check_manifest(manifest, mpath)
    return manifest


def _read_folder(folder: Path) -> _Folder:
    """Read a report folder's manifest and CSVs; ReportError (naming the file) when it is
    not a report, a file is missing or damaged, or a value cannot be read."""
    manifest = _read_manifest(folder)
    files = manifest.get("files") or {}
    dtypes = manifest.get("dtypes") or {}
    cats = manifest.get("categorical") or {}
    rows = manifest.get("rows") or {}
    sha = manifest.get("sha256") or {}
    csvs = {name: folder / (files.get(name) or f"{name}.csv") for name in FRAMES}
    missing = [p.name for p in csvs.values() if not p.is_file()]
    if missing:
        raise _fail(folder, f"incomplete report: missing {', '.join(missing)}")
    frames = {}
    for name in FRAMES:
        csv = csvs[name]
        try:
            data = csv.read_bytes()
        except OSError as e:
            raise _fail(csv, f"unreadable file: {e}") from None
        digest = sha.get(csv.name)
        if digest is not None and hashlib.sha256(data).hexdigest() != digest:
            raise _fail(csv, "the file differs from the one written (its SHA-256 does not "
                             f"match {MANIFEST}): it was edited, cut or damaged")
        if data and not data.endswith(b"\n"):
            raise _fail(csv, "the file does not end with a newline: its last line is cut")
        frames[name] = _read_frame(name, csv, data, dtypes.get(name) or {},
                                   cats.get(name) or [])
        if name in rows and len(frames[name]) != rows[name]:
            raise _fail(csv, f"{len(frames[name])} rows, but {MANIFEST} records "
                             f"{rows[name]}: rows were lost or added")
    return _Folder(frames=frames, kinds=dtypes, categorical=dict(cats),
                   meta=manifest.get("meta"), manifest=manifest, paths=csvs)


def _first_line(e: BaseException) -> str:
    return str(e).splitlines()[0] if str(e) else repr(e)


_INT_TEXT = re.compile(r"\s*[+-]?\d+\s*")
_INT64 = (-(2**63), 2**63 - 1)


def _unreadable(kind: str, values: pd.Series) -> np.ndarray:
    """Mask of CSV texts a column of ``kind`` cannot hold (to find the first bad row)."""
    text = values.astype(object).to_numpy()
    nullable = kind in _NULLABLE
    out = np.zeros(len(text), dtype=bool)
    for i, t in enumerate(text):
        if t == "" and nullable:
            continue
        if kind in ("int", "Int"):
            ok = bool(_INT_TEXT.fullmatch(t)) and _INT64[0] <= int(t) <= _INT64[1]
        elif kind in ("bool", "boolean"):
            ok = t.strip().lower() in ("true", "false")
        elif kind == "float":
            try:
                float(t)
                ok = True
            except ValueError:
                ok = False
        else:
            ok = True
        out[i] = not ok
    return out


def _locate(csv: Path, data: bytes, dtype: Mapping[str, Any], kinds: Mapping[str, str],
            error: BaseException) -> ReportError:
    """The first column and row a typed read failed on (the error's text when none)."""
    try:
        text = pd.read_csv(io.BytesIO(data), dtype=str, keep_default_na=False,
                           na_filter=False)
        for c in text.columns:
            if dtype.get(c) in (_STR, "category"):
                continue
            bad = _unreadable(kinds.get(c, "str"), text[c])
            if bad.any():
                row = int(np.flatnonzero(bad)[0])
                value = str(text[c].iloc[row])
                return _fail(csv, f"{_at_row(str(c), row)}: cannot read {value[:40]!r} as "
                                  f"{kinds.get(c)}")
    except (pd.errors.ParserError, UnicodeDecodeError, ValueError, TypeError):
        pass
    return _fail(csv, f"unreadable values: {_first_line(error)}")


def _read_frame(name: str, csv: Path, data: bytes, kinds: Mapping[str, str],
                categorical: Iterable[str] = ()) -> pd.DataFrame:
    schema = dict(SCHEMA[name])
    try:
        header = pd.read_csv(io.BytesIO(data), nrows=0).columns.tolist()
    except (pd.errors.EmptyDataError, pd.errors.ParserError, UnicodeDecodeError,
            OSError, ValueError) as e:
        raise _fail(csv, f"unreadable CSV: {_first_line(e)}") from None
    added = {c: v for c, v in ADDED_COLUMNS.get(name, {}).items() if c not in header}
    missing = [c for c in schema if c not in header and c not in added]
    if missing:
        raise _fail(csv, f"missing columns: {', '.join(missing)} "
                         f"(a {name} file has: {', '.join(schema)})")
    unknown = [c for c in categorical if c not in header]
    if unknown:
        raise _fail(csv, f"{MANIFEST} says column {unknown[0]} is categorical, but the file "
                         "has no such column")
    dtype, na_values, kind_of = {}, {}, {}
    for c in header:
        k = schema.get(c) or kinds.get(c) or "str?"
        if k not in COLUMN_KINDS:
            k = "str?"
        kind_of[c] = k
        dtype[c] = _READ_DTYPES.get(k, _STR)
        if c in categorical and k in ("str", "str?"):
            dtype[c] = "category"
        na_values[c] = [""] if k in _NULLABLE else []
    try:
        with warnings.catch_warnings():  # a bad number warns before it raises
            warnings.simplefilter("ignore", RuntimeWarning)
            frame = pd.read_csv(io.BytesIO(data), dtype=dtype, keep_default_na=False,
                                na_values=na_values, **_EXACT_FLOATS)
    except (pd.errors.ParserError, UnicodeDecodeError, OSError, ValueError,
            TypeError, OverflowError) as e:
        raise _locate(csv, data, dtype, kind_of, e) from None
    for c, v in added.items():  # a column added after format 1 (an older report)
        frame[c] = pd.Series([v] * len(frame), dtype=_READ_DTYPES.get(schema[c], _STR))
    return frame


def read_graphml(path: str | Path):
    """Read a report's ``graph.graphml`` (or the folder holding it) as a MultiDiGraph."""
    import networkx as nx

    p = Path(path)
    if p.is_dir():
        p = p / GRAPHML
    if not p.is_file():
        raise ReportError(f"{p}: no such GraphML file")
    return nx.read_graphml(p, force_multigraph=True, edge_key_type=str)
