"""Building a guard: from a trace (`guard_of`) or from its JSON manifest (`load_guard`)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Iterable, Mapping

import numpy as np
import torch
from torch.multiprocessing.reductions import StorageWeakRef

from graphtrace import stage
from graphtrace.blindspots import BlindSpot
from graphtrace.derived import CopyPair
from graphtrace.errors import GraphtraceError
from graphtrace.guard.blind import accepted_kinds, guarded_blind, opaque_spots
from graphtrace.guard.check import Guard
from graphtrace.guard.manifest import (
    FORMAT,
    FORMAT_VERSION,
    Required,
    _blind_from_json,
    _copies_from_json,
    _list,
)
from graphtrace.owners import OwnerSnapshot, gc_paused
from graphtrace.recorder import Recorder
from graphtrace.verdict import View

__all__ = ["guard_of", "load_guard"]


# -- from a trace ----------------------------------------------------------------------------

@gc_paused()  # the build allocates much, collects nothing: owners.gc_paused
def guard_of(recorder: "Recorder", snapshot: "OwnerSnapshot",
             models: Mapping[str, torch.nn.Module], first_graph: int = 0,
             lineage=None, blind_spots: Iterable[BlindSpot] = (),
             accept: Iterable[str] = (), values: Mapping[BlindSpot, float] | None = None,
             copies: Iterable[CopyPair] = ()) -> Guard:
    """The guard of `recorder`'s captures (ids from `first_graph`): their owned storages by
    weak handle, with the capture-time owners `snapshot` holds (updated first with the
    storages it has not matched yet, as diff does), checked against `models`. With the
    trace's `lineage`, the storages it matched to sources (owned or not) carry their
    `Derived` baselines, and `check()` gives `unrefreshed` too (Note [freshness]).
    `blind_spots`, `accept`: the trace's records and the kinds accepted (`Trace.guard`; the
    opaque handles the graphs read join them); `values`: the float a `baked scalar` record's
    holder held at capture; `copies`: the trace's packed copies with their fingerprints."""
    from graphtrace.edges import capture_edges

    accept = accepted_kinds(accept)  # a bad kind fails before any work
    from graphtrace.frames import raw_accesses

    rec = recorder
    stage.require(rec, models, "guard")
    cuts = stage.owner_cuts(snapshot, models, rec)  # storages seen since the last snapshot
    owners = snapshot.owners
    raw = raw_accesses(rec)
    table = rec.storages
    views = rec.views.items
    found = capture_edges(raw, len(table.handles), rec.names.items, views)
    # the edges of owned storages in the guarded graphs, by storage then graph (diff's edges)
    derived = lineage.captured if lineage is not None else {}
    owned = np.fromiter(set(owners) | set(derived), dtype=np.int64)
    keep = np.flatnonzero((found.graph_id >= first_graph) & np.isin(found.storage_id, owned))
    keep = keep[np.lexsort((found.graph_id[keep], found.storage_id[keep]))]
    edges_of: dict[int, list[int]] = {}
    for e, sid in zip(keep.tolist(), found.storage_id[keep].tolist()):
        edges_of.setdefault(sid, []).append(e)
    view_ids = raw["view"][found.view_row]

    data_ptrs, nbytes, devices = table.data_ptrs, table.nbytes, table.devices
    storages = []
    for sid, edges in edges_of.items():
        dtype, shape, _stride, _offset = views[view_ids[edges[0]]]  # described as diff does
        strong = table.upgrade(sid)
        ref = StorageWeakRef(strong) if strong is not None else None
        del strong  # never kept: the guard holds the weak handle only
        sid_owners = sorted(owners.get(sid, ()))
        owner_views = {(m, p): View(*v) for m, p, _ in sid_owners
                       if (v := snapshot.view_of(sid, m, p)) is not None}
        storages.append({
            "storage_id": sid, "data_ptr": data_ptrs[sid], "nbytes": nbytes[sid],
            "device": devices[sid], "dtype": str(dtype).removeprefix("torch."),
            "shape": str(tuple(shape)), "alive": ref is not None, "ref": ref,
            "graphs": found.graph_id[edges].tolist(),
            "internal": bool(found.internal[edges].all()),
            "views": [View(*views[v]) for v in view_ids[edges].tolist()],
            "owners": sid_owners, "owner_views": owner_views, "derived": derived.get(sid)})
    graphs = {c.graph_id: c.label for c in rec.captures if c.graph_id >= first_graph}
    spots = list(blind_spots) + cuts + opaque_spots(rec, found, owners, first_graph)
    blind = guarded_blind(spots, graphs, models, values or {})
    guard = Guard(models=list(models), graphs=graphs, storages=storages, source="trace",
                  lineage=lineage, blind_spots=blind, accept=accept, copies=copies)
    guard._native = rec.native  # check()'s fast path (a trace's guard: every storage by handle)
    for name, model in models.items():
        guard.attach(model, name=name)
    return guard


# -- from JSON -------------------------------------------------------------------------------

def load_guard(path: str | os.PathLike, model: torch.nn.Module | None = None, *,
               models: Mapping[str, torch.nn.Module] | None = None,
               accept: Iterable[str] = ()) -> Guard:
    """Read a manifest written by `Guard.to_json`; attach `model` (one watched model) or
    `models` ({name: model}) now, or later with `Guard.attach`. `accept`: blind-spot kinds
    `check()` leaves out (as `Trace.guard(accept=...)`). Bad input raises
    GraphtraceError naming the file and the entry."""
    accept = accepted_kinds(accept)
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise GraphtraceError(f"no guard manifest at {path}") from None
    except (OSError, ValueError) as exc:
        raise GraphtraceError(f"{path}: not a readable JSON guard manifest ({exc})") from None
    guard = _from_dict(data, str(path))
    guard.accept = accept
    if model is not None:
        guard.attach(model)
    for name, m in (models or {}).items():
        guard.attach(m, name=name)
    return guard


def _from_dict(data: object, where: str) -> Guard:
    def fail(what: str) -> GraphtraceError:
        return GraphtraceError(f"{where}: {what}")

    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise fail(f"not a graphtrace guard manifest (\"format\" must be {FORMAT!r})")
    if data.get("format_version") != FORMAT_VERSION:
        raise fail(f"format_version {data.get('format_version')!r} is not {FORMAT_VERSION}")
    models = data.get("models")
    if not isinstance(models, list) or not all(isinstance(m, str) for m in models):
        raise fail("\"models\" must be a list of model names")
    graphs = {}
    for k, g in enumerate(_list(data, "graphs", fail)):
        if not (isinstance(g, dict) and isinstance(g.get("graph_id"), int)
                and isinstance(g.get("label"), str)):
            raise fail(f"graphs[{k}] needs an int \"graph_id\" and a str \"label\"")
        graphs[g["graph_id"]] = g["label"]
    storages = [Required.from_json(st, models, graphs, lambda what, k=k: fail(
        f"storages[{k}]{what}")) for k, st in enumerate(_list(data, "storages", fail))]
    blind = [_blind_from_json(b, models, graphs, fail, f"blind_spots[{k}]")
             for k, b in enumerate(data.get("blind_spots") or [])]  # optional (older: none)
    return Guard(models=models, graphs=graphs, storages=storages, source=where,
                 blind_spots=blind, copies=_copies_from_json(data, models, fail))
