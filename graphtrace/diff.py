"""The reload diff: resolve every capture-time owner on the live model, give each edge a verdict.

Verdicts are per storage (every graph that touched it gets the same one). The rule
(`verdict_of`), each owner's status and `impact` are decided by the verdict engine
(graphtrace.verdict), which `Guard.check()` calls too; this module gathers what they need for
every edge of a trace at once and builds the report's frames. A dtype or shape change of a
moved owner since capture is also named in the report's blind spots (Note [impact]).
"""

from __future__ import annotations

import datetime as _dt
from typing import Iterable, Mapping

import numpy as np
import pandas as pd
import torch

from graphtrace import __version__, stage
from graphtrace import verdict as engine
from graphtrace.blindspots import BlindSpot
from graphtrace.edges import CaptureEdges, capture_edges
from graphtrace.encoding import VIEW
from graphtrace.fixes import detect_stack
from graphtrace.frames import accesses_frame, raw_accesses, view_table
from graphtrace.owners import OwnerSnapshot, gc_paused, resolve_path
from graphtrace.provenance import Provenance, edge_columns
from graphtrace.recorder import Recorder
from graphtrace.report import Report
from graphtrace.verdict import (
    DANGLING,
    DIVERGED,
    STALE,
    UNOWNED,
    UNREFRESHED,
    View,
    owner_status,
    storage_verdicts,
    verdict_of,
)
from graphtrace.vocab import (
    ACCESS_KINDS,
    COLUMNS,
    EDGE_ACCESSES,
    IMPACTS,
    MOVED,
    ORIGINS,
    OWNER_KINDS,
    VERDICTS,
)

__all__ = ["diff", "lineage_findings"]

EDGE_COLUMNS = COLUMNS["edges"]
OWNER_COLUMNS = COLUMNS["owners"]
STORAGE_COLUMNS = COLUMNS["storages"]


class _Resolved(dict):
    """A model's owner path -> what it reaches now: the paths it is given, and any other
    resolved on its own on first use (`resolve_path`; None where it no longer resolves)."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def __missing__(self, path: str):
        try:
            found = resolve_path(self.model, path)
        except Exception:  # a path the model breaks in new ways: unresolved, like orphaned
            found = None
        self[path] = found
        return found


def _live_paths(models: dict, snapshot: OwnerSnapshot, fail) -> dict[str, Mapping]:
    """Per watched model: each capture-time owner path -> what it reaches on the live model
    now (`_Resolved`). The snapshot resolves the paths it matched (its cached walk's PathSet:
    only those paths, not a whole new walk). A failure is counted (`fail(where, exc)`) and
    every path then resolved on its own: diff() reports, it does not raise."""
    try:
        found = snapshot.live_owners(models)
    except Exception as exc:
        fail("resolving owner paths on the live models", exc)
        found = {}
    live = {}
    for name, model in models.items():
        paths = _Resolved(model)
        paths.update(found.get(name, {}))
        live[name] = paths
    return live


def _resolve_owners(handles, captured: dict, sids: np.ndarray,
                    live: Mapping[str, Mapping], view_of=None) -> tuple[pd.DataFrame, dict, dict]:
    """One row per (storage, capture-time owner), with its status on the live model (`live`:
    `_live_paths`; an owner of a model no longer watched is orphaned; `view_of(sid, model,
    path)`: the owner's capture-time view, Note [re-laid views]); rows in the order of
    `sids` (ascending), then model, path and owner kind. Also, per storage with a moved
    owner, the live tensor the first one moved to and that owner's (model, path)."""
    rows = []
    moved_to: dict[int, torch.Tensor] = {}  # storage id -> a live tensor an owner moved to
    moved_by: dict[int, tuple[str, str]] = {}  # storage id -> that owner's (model, path)
    owned = np.fromiter(captured, dtype=np.int64, count=len(captured))
    for sid in np.intersect1d(sids, owned, assume_unique=True).tolist():  # ascending
        owners = captured[sid]
        if not owners:
            continue
        handle = handles[sid]
        for model, path, owner_kind in (sorted(owners) if len(owners) > 1 else owners):
            paths = live.get(model)  # a path not among the matched: resolved on its own
            tensor = paths[path] if paths is not None else None
            view = view_of(sid, model, path) if view_of is not None else None
            status, ptr = owner_status(tensor, handle, view=View(*view) if view else None)
            if status == MOVED and sid not in moved_to:
                moved_to[sid] = tensor
                moved_by[sid] = (model, path)
            rows.append((sid, model, path, owner_kind, status, pd.NA if ptr is None else ptr))
    frame = pd.DataFrame(rows, columns=OWNER_COLUMNS)
    frame["live_data_ptr"] = frame["live_data_ptr"].astype("Int64")
    return frame, moved_to, moved_by


def _joined(keys: np.ndarray, codes: np.ndarray, names, sep: str,
            distinct: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """Join names[codes] per run of equal keys (keys sorted): (unique keys, joined texts);
    `distinct`: each name once per run, in first-seen order. Vectorised: a run of one name
    is that very name object; longer runs are joined as the comments below say."""
    if len(keys) == 0:
        return keys, np.empty(0, dtype=object)
    names = np.asarray(names, dtype=object)
    new = np.r_[True, keys[1:] != keys[:-1]]
    starts = np.flatnonzero(new)
    out = names[codes[starts]]
    lengths = np.diff(starts, append=len(keys))
    several = lengths > 1
    # runs short enough to pack their codes into one integer: runs with the same names in the
    # same order (most of them: every graph reads a layer's weight through the same ops) are
    # joined once
    bits = int(len(names) + 1).bit_length()
    packed = several & (lengths <= 62 // bits)
    if packed.any():
        run_starts, run_lengths = starts[packed], lengths[packed]
        rows = np.flatnonzero(np.repeat(packed, lengths))
        pos = rows - np.repeat(run_starts, run_lengths)
        offsets = np.r_[0, np.cumsum(run_lengths)[:-1]]
        key = np.add.reduceat((codes[rows].astype(np.int64) + 1) << (bits * pos), offsets)
        _, first, inverse = np.unique(key, return_index=True, return_inverse=True)
        runs = (names[codes[s:s + n]].tolist() for s, n in
                zip(run_starts[first].tolist(), run_lengths[first].tolist()))
        texts = np.array([sep.join(dict.fromkeys(r) if distinct else r) for r in runs]
                         + [None], dtype=object)[:-1]  # an object array of str, not '<U..'
        out[packed] = texts[inverse.reshape(-1)]
    several &= ~packed
    if several.any():
        rows = np.flatnonzero(np.repeat(several, lengths))  # the rows of those runs
        if distinct:  # each run's first row of each code, in row order
            _, firsts = np.unique(keys[rows] * (len(names) + 1) + codes[rows],
                                  return_index=True)
            rows = rows[np.sort(firsts)]
        first = new[rows]
        # one take from [sep + names, names]: a run's first name bare, the others after sep
        items = np.concatenate([sep + names, names])[codes[rows] + first * len(names)]
        out[several] = np.add.reduceat(items, np.flatnonzero(first))
    return keys[starts], out


def _freshness(lineage, sids: np.ndarray, handles, alive: np.ndarray, internal: np.ndarray,
               live: Mapping[str, Mapping], n_storages: int
               ) -> tuple[np.ndarray, dict, np.ndarray, dict]:
    """Per storage id: is it unrefreshed, the `derived_from` text of each captured storage
    lineage matched (a freed source marked `(freed)`), is it a handle with a dangling
    source, and the impact of each unrefreshed one: the verdict engine's `freshness` pass,
    the guard's too, with what lineage saw."""
    flags = np.zeros(n_storages, dtype=bool)
    freed = np.zeros(n_storages, dtype=bool)
    derived = lineage.captured if lineage is not None else {}
    if not derived:
        return flags, {}, freed, {}

    def resolve(model: str, path: str):
        paths = live.get(model)
        return paths[path] if paths is not None else None

    matched = np.intersect1d(sids, np.fromiter(derived, dtype=np.int64, count=len(derived)),
                             assume_unique=True).tolist()
    found = engine.freshness(((sid, derived[sid], handles[sid], alive[sid], internal[sid])
                              for sid in matched), resolve, lineage)
    flags[list(found.unrefreshed)] = True
    freed[list(found.freed)] = True
    texts = {sid: found.derived_from(sid, derived[sid]) for sid in matched}
    return flags, texts, freed, found.unrefreshed


def _per_storage(owners: pd.DataFrame, alive: np.ndarray, internal: np.ndarray,
                 unrefreshed: np.ndarray | None = None,
                 freed: np.ndarray | None = None) -> pd.DataFrame:
    """Owner names, verdict and live pointer of every owned storage (index: storage id).

    `owners` rows come sorted by storage id, then model and path (as `_resolve_owners` makes
    them), so every per-storage value is a reduce over the storage's run of rows. `alive`,
    `internal`: per storage id (Note [write before read])."""
    columns = ["owners", "owner_kinds", "n_owners", "live_data_ptr", "verdict"]
    if owners.empty:
        return pd.DataFrame(columns=columns, index=pd.Index([], dtype=np.int64))
    sid = owners["storage_id"].to_numpy(dtype=np.int64)
    keys, paths = _joined(sid, np.arange(len(sid)), owners["path"].to_numpy(dtype=object), "; ")
    starts = np.flatnonzero(np.r_[True, sid[1:] != sid[:-1]])
    status = owners["status"].to_numpy(dtype=object)
    owner_kind = owners["kind"].to_numpy(dtype=object)
    n_owners = np.diff(starts, append=len(sid))
    verdict = storage_verdicts(status, n_owners, alive[keys], internal[keys],
                               None if unrefreshed is None else unrefreshed[keys],
                               None if freed is None else freed[keys])
    kinds = np.full(len(keys), "", dtype=object)
    for k in sorted(OWNER_KINDS):  # sorted, ';'-joined
        has = np.logical_or.reduceat(owner_kind == k, starts)
        kinds = np.where(has, np.where(kinds == "", k, kinds + ";" + k), kinds)
    return pd.DataFrame({"owners": paths, "owner_kinds": kinds,
                         "n_owners": n_owners,
                         "live_data_ptr": _live_pointer(owners["live_data_ptr"], status == MOVED,
                                                        starts),
                         "verdict": verdict},
                        index=pd.Index(keys, dtype=np.int64))


def _live_pointer(ptrs: pd.Series, moved: np.ndarray, starts: np.ndarray):
    """stage.live_pointer on the owners frame's Int64 column: NA where none is known."""
    pick = stage.live_pointer(ptrs.to_numpy(dtype=np.int64, na_value=0),
                              ptrs.notna().to_numpy(), moved, starts)
    return ptrs.array.take(pick, allow_fill=True)


def _joined_runs(codes: np.ndarray, group: np.ndarray, names: np.ndarray) -> np.ndarray:
    """Per run (group ids 0..n-1, rows sorted by group then row): the distinct names of its
    codes in first-seen order, ';'-joined."""
    return _joined(group, codes, names, ";", distinct=True)[1]


def _owner_columns(per_storage: pd.DataFrame, sids: np.ndarray,
                   unrefreshed: np.ndarray | None = None,
                   freed: np.ndarray | None = None) -> dict:
    """The per-storage owner columns at each edge's storage; edges of unowned storages get
    no owners and the verdict unowned (unrefreshed where `unrefreshed` says so)."""
    at = per_storage.index.get_indexer(sids)  # -1 (no owner) picks the fill appended last

    def values(column: str, fill) -> np.ndarray:
        return np.append(per_storage[column].to_numpy(dtype=object), [fill])

    verdict = pd.Categorical(values("verdict", UNOWNED), VERDICTS)[at]
    if unrefreshed is not None and len(sids):
        unowned_fresh = (at < 0) & unrefreshed[sids]
        if unowned_fresh.any():
            verdict[unowned_fresh] = UNREFRESHED
    if freed is not None and len(sids):  # an unowned handle with a dangling source
        unowned_freed = (at < 0) & freed[sids]
        if unowned_freed.any():
            verdict[unowned_freed] = verdict_of((), True, source_freed=True)

    return {  # categoricals are made per storage, then taken: no per-edge string hashing
        "owners": pd.Series(values("owners", "")).array.take(at),  # typed once per storage
        "owner_kinds": pd.Categorical(values("owner_kinds", ""))[at],
        "n_owners": np.append(per_storage["n_owners"].to_numpy(dtype=np.int64), 0)[at],
        "live_data_ptr": per_storage["live_data_ptr"].astype("Int64").array.take(at, allow_fill=True),
        "verdict": verdict,
    }


def _impacts(recorder, verdict: pd.Categorical, sids: np.ndarray, views: np.ndarray,
             moved_to: dict, moved_by: dict, snapshot: OwnerSnapshot,
             notes: list[BlindSpot], fresh_impacts: Mapping[int, str] = {}) -> pd.Categorical:
    """`impact` per edge: the verdict engine's `edge_impact` (the guard's too), once per
    problem storage and view; `fresh_impacts`: per storage id, `unrefreshed_impact`. A
    moved owner's dtype or shape change since capture is appended to `notes`, one text per
    storage and view, naming the owners."""
    owners = snapshot.owners
    names = ["", *IMPACTS]
    codes = np.zeros(len(sids), dtype=np.int64)
    items = recorder.views.items
    cache: dict[tuple[int, int], int] = {}
    problem = (verdict == STALE) | (verdict == DIVERGED) | (verdict == DANGLING) | (
        verdict == UNREFRESHED)
    for i in np.flatnonzero(problem).tolist():
        k = sid, v = int(sids[i]), int(views[i])
        if k not in cache:
            word = str(verdict[i])
            live = moved_to.get(sid) if word in (STALE, DIVERGED) else None
            owner = snapshot.view_of(sid, *moved_by[sid]) if live is not None else None
            old = recorder.storages.upgrade(sid) if live is not None else None
            impact, note = engine.edge_impact(
                word, old, View(*items[v]), live, View(*owner) if owner else None,
                fresh_impacts.get(sid, "unknown"))
            relaid = old is not None and engine.on_storage(live, old)  # Note [re-laid views]
            del old
            cache[k] = names.index(impact) if impact is not None else 0
            if note:
                found = sorted(owners.get(sid, ()))
                paths = ", ".join(sorted(p for _, p, _ in found))
                notes.append(BlindSpot(
                    "dtype/shape change", f"storage {sid} ({paths}): {note}; impact {impact}"
                    if relaid else f"storage {sid} ({paths}): {note} since capture; "
                    f"impact {impact} compares values cast to a common dtype",
                    holder=found[0][1] if found else "", model=found[0][0] if found else ""))
        codes[i] = cache[k]
    return pd.Categorical.from_codes(codes, names)


def _edges(found: CaptureEdges, raw: dict, accesses: pd.DataFrame, names: list,
           nbytes: np.ndarray) -> dict:
    """Edge columns up to `shape`, from the capture's edges (graphtrace.edges)."""
    rows, starts = found.rows, found.starts
    new = np.zeros(len(rows), dtype=bool)
    new[starts] = True
    run = np.cumsum(new)  # the run of each row, from 1
    run -= 1
    names_arr = np.asarray(names, dtype=object)
    sids, view_row = found.storage_id, found.view_row
    return {
        "graph_id": found.graph_id,
        "graph": accesses["graph"].array[found.first_row],  # categoricals: a take of codes
        "storage_id": sids,
        "access": pd.Categorical.from_codes(  # EDGE_ACCESSES: read, read+write, write
            np.where(found.has_read, np.where(found.has_write, 1, 0), 2), list(EDGE_ACCESSES)),
        "ops": _joined_runs(raw["op"][rows], run, names_arr),
        "args": _joined_runs(raw["arg"][rows], run, names_arr),
        "module": accesses["module"].array[found.first_row],
        "data_ptr": accesses["data_ptr"].to_numpy()[view_row],
        "nbytes": nbytes[sids] if len(sids) else sids,
        "dtype": accesses["dtype"].array[view_row],
        "shape": accesses["shape"].array[view_row],
    }


def _storages(table, alive: np.ndarray, nbytes: np.ndarray, access: np.ndarray,
              sids: np.ndarray, first_rows: np.ndarray) -> pd.DataFrame:
    """One row per storage; `first_access`: the access of its first reading or writing row
    (the earliest first row of its edges), else view."""
    n = len(alive)
    first = np.full(n, len(access), dtype=np.int64)
    np.minimum.at(first, sids, first_rows)
    seen = first < len(access)
    first_code = np.full(n, VIEW, dtype=np.int64)
    first_code[seen] = access[first[seen]]
    return pd.DataFrame({
        "storage_id": np.arange(n, dtype=np.int64),
        "data_ptr": np.frombuffer(table.data_ptrs, dtype=np.int64) if n else np.empty(0, np.int64),
        "nbytes": nbytes,
        "device": list(table.devices),
        "alive": alive,
        "first_access": np.asarray(ACCESS_KINDS, dtype=object)[first_code],
    }, columns=STORAGE_COLUMNS)


def _opaque_blind_spots(rec, edges: dict) -> list[BlindSpot]:
    """One record per opaque handle a graph reads: what graphtrace cannot look inside."""
    found = []
    for i in np.flatnonzero(np.isin(edges["storage_id"], list(rec.opaque))).tolist():
        sid = int(edges["storage_id"][i])
        owners = edges["owners"][i] or "no watched owner"
        found.append(BlindSpot(
            "opaque handle",
            f"opaque handle {rec.opaque[sid]} (storage {sid}, {owners}) read by "
            f"{edges['ops'][i]} in graph {edges['graph'][i]!r}: graphtrace sees which "
            "object the graph reads, not the tensors packed inside it (a change made "
            "inside the same object is not seen; impact unknown)",
            holder=(edges["owners"][i] or "").split("; ")[0], op=edges["ops"][i].split(";")[0],
            graph=str(edges["graph"][i])))
    return found


def _add(spots: list[BlindSpot], new: Iterable[BlindSpot]) -> None:
    """Append the records of `new` whose text is not in `spots` yet."""
    texts = {b.text for b in spots}
    for b in new:
        if b.text not in texts:
            texts.add(b.text)
            spots.append(b)


def _rows_where(column: pd.Series, test) -> np.ndarray:
    """`test(text)` for each row of `column` as text, run once per distinct value (a
    categorical's categories; else its factorized values): a boolean array."""
    if isinstance(column.dtype, pd.CategoricalDtype):
        codes = column.cat.codes.to_numpy()
        values = [str(c) for c in column.cat.categories] + ["nan"]  # code -1: a missing value
    else:
        codes, uniq = pd.factorize(column.astype(str))
        values = [str(v) for v in uniq] + ["nan"]
    hit = np.fromiter((bool(test(v)) for v in values), dtype=bool, count=len(values))
    return hit[codes]


def _unseen_pointers(edges: pd.DataFrame, named: set = frozenset()) -> list[BlindSpot]:
    """A pointer-valued tensor (one int64) that a custom op reads, with no lineage behind it
    (made by a producer lineage cannot see: a raw pointer taken in C++, an op no mode sees):
    an `opaque handle` blind spot naming its holder, never a silent `stable` (Note
    [dangling sources] in graphtrace/lineage/handles.py). Holders in `named` already have one (the
    vLLM adapter names its oneDNN handles)."""
    if edges.empty:
        return []
    pick = (_rows_where(edges["dtype"], lambda d: d in ("int64", "torch.int64"))
            & _rows_where(edges["shape"], lambda s: s in ("()", "(1,)", "[]", "[1]"))
            & _rows_where(edges["derived_from"], lambda d: d == ""))
    # rare: most edges fail the categorical tests above, so the text columns are read last,
    # and only on the rows left
    if pick.any():
        pick[pick] = _rows_where(edges["owners"][pick], lambda o: o != "")
    if pick.any():
        pick[pick] = _rows_where(edges["ops"][pick], lambda o: any(
            not p.startswith("aten::") for p in o.split(";") if p))
    out = []
    picked = zip(edges["owners"][pick].astype(str), edges["ops"][pick].astype(str))
    for holder, op in sorted(set(picked)):
        if holder.split("; ")[0] in named:  # an integration already said what it is
            continue
        custom = next(p for p in op.split(";") if p and not p.startswith("aten::"))
        out.append(BlindSpot(
            "opaque handle", f"{holder}: a pointer-valued tensor read by {custom}, made by a "
            "producer lineage did not see (a raw pointer taken in C++, an op no mode sees): "
            "what it points to, and whether that is fresh, is unknown",
            holder=holder.split("; ")[0], op=custom))
    return out


def lineage_findings(lineage, models: Mapping[str, torch.nn.Module], fail) -> list[dict]:
    """What lineage's plug-ins found beside the edges, graph or not (`Lineage.findings`,
    `Report.findings`); none when that fails (fail open)."""
    if lineage is None:
        return []
    try:
        return lineage.findings(models)  # its plug-ins' (Note [lineage plug-ins])
    except Exception as exc:  # fail open
        fail("findings", exc)
        return []


def diff(recorder: "Recorder", snapshot: OwnerSnapshot, models: Mapping[str, torch.nn.Module],
         blind_spots: Iterable["str | BlindSpot"] = (), provenance: "Provenance | None" = None,
         extra_meta: Mapping | None = None, lineage=None) -> "Report":
    """The Report of a reload: every edge of `recorder`'s captures, its capture-time owners
    (`snapshot`, updated first with the storages it has not matched yet) resolved on the
    live `models` (name -> module, as the snapshot was taken). `blind_spots`: records (or
    texts, kind ``other``) for the report's meta, plus what that update's owner walks had to
    cut. `provenance`: the
    trace's creation sites (graphtrace.provenance), for `created_at` / `live_created_at`.
    `extra_meta`: more entries for the meta (the compiled regions' coverage,
    graphtrace.compiled). `lineage`: the trace's graphtrace.lineage.Lineage, for freshness
    (`unrefreshed`, `derived_from`; Note [freshness] in graphtrace/verdict.py)."""
    rec = recorder
    stage.require(rec, models, "diff")
    spots: list[BlindSpot] = []
    _add(spots, (BlindSpot.from_json(b) for b in blind_spots))
    _add(spots, stage.owner_cuts(snapshot, models, rec))  # storages seen since the last snapshot
    raw = raw_accesses(rec)
    views = view_table(rec.views.items)
    accesses = accesses_frame(rec, raw, views)
    table = rec.storages
    n_storages = len(table.handles)
    alive = table.alive_mask()
    nbytes = np.frombuffer(table.nbytes, dtype=np.int64) if n_storages else np.empty(0, np.int64)
    found = capture_edges(raw, n_storages, rec.names.items, rec.views.items)
    edges = _edges(found, raw, accesses, rec.names.items, nbytes)
    sids, internal, view_row = found.storage_id, found.internal, found.view_row
    # a storage is internal when every edge of it is (Note [write before read])
    internal_storage = found.internal_storages(n_storages)

    # -- owners, verdicts, impact: per storage, then onto the edges ----------------------------
    edge_sids = np.flatnonzero(np.bincount(sids, minlength=n_storages))  # sorted, no hashing
    with gc_paused():
        live = _live_paths(models, snapshot, rec.fail)
        owners, moved_to, moved_by = _resolve_owners(table.handles, snapshot.owners, edge_sids,
                                                     live, snapshot.view_of)
        try:
            unrefreshed, derived_from, freed, fresh_impacts = _freshness(
                lineage, edge_sids, table.handles, alive, internal_storage, live, n_storages)
        except Exception as exc:  # fail open: identity verdicts still stand
            rec.fail("freshness", exc)
            unrefreshed, derived_from, fresh_impacts = np.zeros(n_storages, dtype=bool), {}, {}
            freed = np.zeros(n_storages, dtype=bool)
    edges.update(_owner_columns(_per_storage(owners, alive, internal_storage, unrefreshed,
                                             freed),
                                sids, unrefreshed, freed))
    verdict = edges["verdict"]
    edges["origin"] = pd.Categorical.from_codes(np.where(internal, 1, 0), list(ORIGINS))
    notes: list[BlindSpot] = []
    edges["impact"] = _impacts(rec, verdict, sids, raw["view"][view_row], moved_to, moved_by,
                               snapshot, notes, fresh_impacts)
    _add(spots, notes)
    stack = detect_stack(models.values())  # whose fix texts (Note [fix texts], fixes.py)
    edges.update(edge_columns(provenance, table, sids, verdict, owners, moved_to, stack))
    texts = [""] + sorted(set(derived_from.values()))
    code = {t: i for i, t in enumerate(texts)}
    per_storage = np.zeros(n_storages, dtype=np.int64)  # per storage, then onto the edges
    for sid, text in derived_from.items():
        per_storage[sid] = code[text]
    edges["derived_from"] = pd.Categorical.from_codes(per_storage[sids], texts)
    if lineage is not None and (lineage.ops_skipped or lineage.truncated):
        _add(spots, [BlindSpot("lineage", f"lineage hit its cap: {lineage.ops_skipped} ops not "
                               f"recorded (max {lineage.max_edges} edges), "
                               f"{lineage.truncated} storages' sources cut at "
                               f"{lineage.max_sources}; freshness of what they wrote falls "
                               "back to identity and version counters")])

    storages = _storages(table, alive, nbytes, raw["access"], sids, found.first_row)
    if rec.opaque:
        opaque_sids = np.fromiter(rec.opaque, dtype=np.int64)
        storages.loc[opaque_sids, "device"] = "opaque"
        _add(spots, _opaque_blind_spots(rec, edges))
    edges = pd.DataFrame(edges, columns=EDGE_COLUMNS, copy=False)  # fresh columns: no copy
    if lineage is not None:
        _add(spots, _unseen_pointers(edges, {b.holder for b in spots
                                             if b.kind == "opaque handle"}))

    meta = {
        "graphtrace_version": __version__,
        "torch_version": torch.__version__,
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "errors": list(rec.errors),
        "n_errors": rec.n_errors,
        "blind_spots": [b.to_json() for b in spots],
        "graphs": [{"graph_id": c.graph_id, "label": c.label, "kind": c.kind, "n_ops": c.n_ops,
                    "n_accesses": c.n_accesses, "thread": c.thread} for c in rec.captures],
        "models": list(models),
        "stack": stack.to_json(),
        "provenance": provenance.meta() if provenance is not None else {"enabled": False},
        "findings": lineage_findings(lineage, models, rec.fail),
    }
    meta.update(extra_meta or {})
    return Report(accesses=accesses, storages=storages, owners=owners, edges=edges, meta=meta)
