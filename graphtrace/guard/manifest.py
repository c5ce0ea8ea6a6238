"""The guard's manifest (docs/guard.md): `Required` and the JSON form of a guard's parts."""

from __future__ import annotations

import datetime as _dt
import os
from dataclasses import dataclass, field
from typing import Mapping

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from graphtrace.blindspots import BlindSpot
from graphtrace.lineage import Derived, Source
from graphtrace.verdict import View

__all__ = ["Required", "FORMAT", "FORMAT_VERSION"]

FORMAT = "graphtrace.guard"
FORMAT_VERSION = 1  # "internal", the views and "derived" were added within version 1
# (optional keys)
# Version counters mean something only in the process that read them: a manifest records
# its writer's token, and a reader in another process takes its baselines at attach time.
_PROCESS = f"{os.getpid()}:{id(object()):x}:{_dt.datetime.now().timestamp()}"

# Note [guard identity]
# ~~~~~~~~~~~~~~~~~~~~~
# A guard made from a trace holds one StorageWeakRef per required storage. A held weak
# reference keeps the StorageImpl allocation (so its address, `_cdata`) unique without
# keeping the data alive: "the owner's tensor has this `_cdata`" is exact identity, and
# `expired()` says whether the captured storage was freed (stale vs dangling). This is
# `identity == "storage"`.
#
# A manifest read from JSON has only the storage's base `data_ptr` and `nbytes`.
# `attach(model)` upgrades it where it can: an owner path that resolves to a storage with
# that very address and size is taken as the captured storage and a weak handle to it is
# kept from then on (identity "storage" again). So: load and attach *before* the weight
# update and the answers are the live guard's. Where no owner holds such a storage at
# attach time (attached after the update), identity stays "data_ptr": an owner "holds" when
# its storage has the captured address and size. That is weaker, because the caching
# allocator hands a freed address out again (94 of 100 frees here): a moved owner whose new
# storage landed at the old address reads as holding (a dangling read goes unseen), and the
# old storage's liveness is unknown, so a moved owner reads `stale` (never `dangling`).


@dataclass(slots=True, eq=False)
class Required:
    """One storage the guarded graphs read, as the guard keeps it: its identity at capture
    (`ref`, a weak handle; else `data_ptr` and `nbytes`: Note [guard identity]), whether it
    was freed before the guard was made (`dead`), the graphs that read it and the View each
    read (`views`), whether every graph writes it first (`internal`), its owners ((model,
    path, kind), sorted) with their Views at capture, and its freshness baselines
    (`derived`). `to_json` / `from_json`: its manifest entry (docs/guard.md)."""

    storage_id: int
    data_ptr: int
    nbytes: int
    device: str
    dtype: str
    shape: str
    dead: bool
    graphs: tuple[int, ...]
    ref: StorageWeakRef | None = None
    internal: bool = False
    views: list = field(default_factory=list)
    owners: list = field(default_factory=list)
    owner_views: dict = field(default_factory=dict)
    derived: Derived | None = None

    @classmethod
    def of(cls, s: "dict | Required") -> "Required":
        """From the dict `Guard(storages=...)` documents."""
        if isinstance(s, Required):
            return s
        return cls(s["storage_id"], int(s["data_ptr"]), int(s["nbytes"]), s["device"],
                   s["dtype"], s["shape"], not s["alive"], tuple(s["graphs"]), s.get("ref"),
                   bool(s.get("internal", False)),
                   list(s.get("views") or [None] * len(s["graphs"])), list(s["owners"]),
                   dict(s.get("owner_views") or {}), s.get("derived"))

    def to_json(self) -> dict:
        """The manifest entry, with its freshness baselines now as its "derived"."""
        owners = []
        for m, p, k in self.owners:
            entry = {"model": m, "path": p, "kind": k}
            view = self.owner_views.get((m, p))
            if view is not None:
                entry["view"] = _view_json(view)
            owners.append(entry)
        return {"storage_id": self.storage_id, "data_ptr": self.data_ptr, "nbytes": self.nbytes,
                "device": self.device, "dtype": self.dtype, "shape": self.shape,
                "alive": not self.dead, "graphs": list(self.graphs), "internal": self.internal,
                "views": [_view_json(v) if v is not None else None for v in self.views],
                "owners": owners,
                **({"derived": _derived_json(self.derived)} if self.derived is not None
                   else {})}

    @classmethod
    def from_json(cls, s: object, models: list, graphs: Mapping[int, str], fail) -> "Required":
        """A manifest entry read back (weak handle none: `Guard.attach` adopts one);
        `fail(what)` makes the error for a bad one."""
        if not isinstance(s, dict):
            raise fail(" is not an object")
        for key, tp in _TYPES.items():
            if not isinstance(s.get(key), tp):
                raise fail(f"[{key!r}] must be {tp.__name__}, got {s.get(key)!r}")
        if not all(g in graphs for g in s["graphs"]):
            raise fail(" names a graph id not in \"graphs\"")
        owners, owner_views = [], {}
        for j, o in enumerate(s["owners"]):
            if not (isinstance(o, dict) and o.get("model") in models
                    and isinstance(o.get("path"), str) and isinstance(o.get("kind"), str)):
                raise fail(f".owners[{j}] needs \"model\" (one of \"models\"), "
                           "\"path\" and \"kind\"")
            owners.append((o["model"], o["path"], o["kind"]))
            view = _view_from_json(o.get("view"), fail, f".owners[{j}].view")
            if view is not None:
                owner_views[(o["model"], o["path"])] = view
        derived = (_derived_from_json(s["derived"], models, fail, ".derived")
                   if s.get("derived") is not None else None)
        if not owners and derived is None:
            raise fail(" has no owner")
        if not isinstance(s.get("internal", False), bool):
            raise fail(f"['internal'] must be bool, got {s['internal']!r}")
        views = s.get("views")
        if views is not None and not (isinstance(views, list) and len(views) == len(s["graphs"])):
            raise fail("['views'] must be a list with one entry per graph")
        views = [_view_from_json(v, fail, f".views[{j}]")
                 for j, v in enumerate(views or [None] * len(s["graphs"]))]
        return cls.of({**s, "owners": sorted(owners), "ref": None, "views": views,
                       "owner_views": owner_views, "derived": derived})


_TYPES = {"storage_id": int, "data_ptr": int, "nbytes": int, "device": str, "dtype": str,
          "shape": str, "alive": bool, "graphs": list, "owners": list}


def _derived_json(d: Derived) -> dict:
    return {"sources": [{"model": s.model, "path": s.path, "kind": s.kind,
                         "data_ptr": s.data_ptr, "nbytes": s.nbytes, "version": s.version}
                        for s in d.sources],
            "owner_versions": [{"model": m, "path": p, "version": v}
                               for (m, p), v in d.owner_versions.items()],
            "stale": d.stale, "process": _PROCESS, **({"handle": True} if d.handle else {})}


def _derived_from_json(data: object, models: list, fail, where: str) -> Derived:
    """A manifest's "derived" entry; versions from another process are dropped (taken again
    at attach time: they count writes in the process that read them)."""
    try:
        same = data.get("process") == _PROCESS
        sources = []
        for s in data["sources"]:
            if not (s["model"] in models and isinstance(s["path"], str)
                    and isinstance(s["kind"], str) and isinstance(s["data_ptr"], int)
                    and isinstance(s["nbytes"], int)
                    and (s.get("version") is None or isinstance(s["version"], int))):
                raise TypeError
            sources.append(Source(s["model"], s["path"], s["kind"], None, s["data_ptr"],
                                  s["nbytes"], s.get("version") if same else None, 0))
        versions = {}
        for o in data.get("owner_versions", []):
            if not (o["model"] in models and isinstance(o["path"], str)
                    and (o.get("version") is None or isinstance(o["version"], int))):
                raise TypeError
            versions[(o["model"], o["path"])] = o.get("version") if same else None
        stale = data.get("stale", False)
        handle = data.get("handle", False)  # Note [dangling sources] in graphtrace/lineage/handles.py
        if not isinstance(stale, bool) or not isinstance(handle, bool) or not sources:
            raise TypeError
    except (TypeError, KeyError, AttributeError):
        raise fail(f"{where} must be an object with \"sources\" (a non-empty list of "
                   "{model, path, kind, data_ptr, nbytes, version}), \"owner_versions\" "
                   "and a bool \"stale\" (and \"handle\")") from None
    return Derived(tuple(sources), versions, stale, 0, handle)


def _view_json(view: View) -> dict:
    return {"dtype": str(view.dtype).removeprefix("torch."), "shape": list(view.shape),
            "stride": list(view.stride), "offset": view.offset}


def _view_from_json(data: object, fail, where: str) -> View | None:
    if data is None:
        return None
    try:
        dtype = getattr(torch, data["dtype"])
        if not isinstance(dtype, torch.dtype):
            raise TypeError
        shape, stride, offset = data["shape"], data["stride"], data["offset"]
        if not (all(isinstance(x, int) for x in [*shape, *stride, offset])
                and len(shape) == len(stride)):
            raise TypeError
    except (TypeError, KeyError, AttributeError):
        raise fail(f"{where} must be null or an object with \"dtype\" (a torch dtype name), "
                   f"\"shape\" and \"stride\" (int lists of one length) and an int \"offset\"; "
                   f"got {data!r}") from None
    return View(dtype, tuple(shape), tuple(stride), offset)


def _copies_from_json(data: dict, models: list, fail) -> list[dict]:
    """The optional "copies" entry: [{model, copy, source}] (older manifests: none)."""
    copies = data.get("copies") or []
    for k, c in enumerate(copies if isinstance(copies, list) else [None]):
        if not (isinstance(c, dict) and c.get("model") in models
                and isinstance(c.get("copy"), str) and isinstance(c.get("source"), str)):
            raise fail(f"copies[{k}] needs \"model\" (one of \"models\"), \"copy\" and "
                       "\"source\" (owner paths)")
    return copies


def _list(data: dict, key: str, fail) -> list:
    value = data.get(key)
    if not isinstance(value, list):
        raise fail(f"{key!r} must be a list")
    return value


def _blind_json(entry: dict) -> dict:
    return {**entry["spot"].to_json(), "graph_id": entry["graph_id"],
            "data_ptr": entry["data_ptr"], "nbytes": entry["nbytes"],
            "version": entry["version"], "value": entry.get("value"), "process": _PROCESS}


def _blind_from_json(data: object, models: list, graphs: dict, fail, where: str) -> dict:
    try:
        spot = BlindSpot.from_json({k: data[k] for k in ("kind", "text", "holder", "op",
                                                           "model", "graph") if k in data})
        graph_id, ptr, nbytes, version = (data.get("graph_id", -1), data.get("data_ptr"),
                                          data.get("nbytes"), data.get("version"))
        value = data.get("value")
        if value is not None and (type(value) not in (int, float)):
            raise TypeError
        if not (isinstance(graph_id, int) and (graph_id == -1 or graph_id in graphs)
                and all(v is None or (isinstance(v, int) and not isinstance(v, bool))
                        for v in (ptr, nbytes, version))
                and (spot.model in models or not spot.holder)):
            raise TypeError
    except (TypeError, ValueError, KeyError, AttributeError):
        raise fail(f"{where} must be a blind spot object (kind, text, holder, op, model, graph; "
                   "graph_id: -1 or one of \"graphs\"; data_ptr, nbytes, version: int or "
                   f"null; model one of \"models\"), got {data!r}") from None
    same = data.get("process") == _PROCESS
    return {"spot": spot, "graph_id": graph_id, "ref": None, "data_ptr": ptr,
            "nbytes": nbytes, "version": version if same else None,
            "value": float(value) if value is not None else None}
