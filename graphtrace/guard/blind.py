"""The guard's blind spots: Note [blind spots in the guard], Note [one look per holder]."""

from __future__ import annotations

from typing import Iterable, Mapping

import pandas as pd
import torch
from torch.multiprocessing.reductions import StorageWeakRef

from graphtrace.blindspots import BlindSpot
from graphtrace.errors import GraphtraceError
from graphtrace.opaque import storage_of
from graphtrace.owner_paths import PathSet, none_moved, resolve_path, resolve_value
from graphtrace.stage import same_storage
from graphtrace.vocab import BLIND_SPOT_KINDS, GUARD_UNCHECKED, HOLDS, MOVED, ORPHANED

__all__ = ["BlindHolders", "accepted_kinds", "adopt_blind", "guarded_blind", "handle_at",
           "opaque_spots", "spot_row"]


# Note [blind spots in the guard]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# What the recording could not see (an opaque handle's packed tensors, a compiled-in constant
# no model owns, a subclass that cannot be flattened, a walk cut short, KV-cache reads inside
# an op) is a blind spot of the report; a guard that passed over them would pass exactly the
# updates it cannot judge. So the guard keeps every blind spot that concerns its graphs (its
# graph is one of them, or it names none) and fails closed: after an update `check()` gives
# one row (verdict `unchecked`, `blind_spot` its kind, `note` its text, `owners` its holder,
# `statuses` what the holder did) for each one the update may have invalidated:
# - its holder (an owner path) reaches another storage or object now (`moved`), none
#   (`orphaned`), or the same tensor written in place (`written`: its version counter
#   moved, so what is behind it may have changed unseen), or for a baked scalar (Note
#   [baked scalars] in graphtrace/scalars.py) a value other than the captured one
#   (`changed`); a holder that owns a guarded storage and moved or is gone is already a
#   stale, dangling or orphaned row of that storage, so no second row;
# - it has no holder, or its holder did not resolve when the guard was made: it cannot be
#   checked at all (`statuses` empty).
# A holder that still reaches the very storage, unwritten, is taken as unchanged. The user
# accepts a kind with `t.guard(accept=[...])` / `guard.accept = [...]` / `load_guard(...,
# accept=...)` (kinds: vocab.BLIND_SPOT_KINDS; an unknown one is a GraphtraceError): its rows
# are left out of `check()`, so `enforce()` passes on them. The manifest keeps the records
# (optional key "blind_spots": kind, text, holder, op, model, graph, graph_id, and the
# holder's data_ptr/nbytes, adopted as a weak handle at attach time like the storages).

_NOT_AT_CAPTURE = frozenset({"dtype/shape change", "packed copy not rebuilt"})  # diff's findings


def accepted_kinds(kinds: Iterable[str]) -> frozenset[str]:
    """`kinds` checked against vocab.BLIND_SPOT_KINDS: a GraphtraceError names a bad one."""
    if isinstance(kinds, str):
        raise GraphtraceError(f"accept takes a list of blind-spot kinds, got the string "
                              f"{kinds!r}: write accept=[{kinds!r}]")
    try:
        kinds = frozenset(kinds)
    except TypeError:
        raise GraphtraceError(f"accept takes a list of blind-spot kinds, got "
                              f"{type(kinds).__name__}") from None
    unknown = sorted(k for k in kinds if k not in BLIND_SPOT_KINDS)
    if unknown:
        raise GraphtraceError(f"unknown blind-spot kind(s) {', '.join(map(repr, unknown))} in "
                              f"accept (kinds: {', '.join(BLIND_SPOT_KINDS)})")
    return kinds


def opaque_spots(rec, found, owners, first_graph: int) -> list[BlindSpot]:
    """One record per opaque handle (torch.ScriptObject) a guarded graph reads, held by its
    first owner path (what diff names per edge)."""
    if not rec.opaque:
        return []
    labels = {c.graph_id: c.label for c in rec.captures}
    out = []
    for g, sid in sorted(set(zip(found.graph_id.tolist(), found.storage_id.tolist()))):
        if g < first_graph or sid not in rec.opaque:
            continue
        held = sorted(owners.get(sid, ()))
        out.append(BlindSpot(
            "opaque handle", f"opaque handle {rec.opaque[sid]} (storage {sid}) read in graph "
            f"{labels.get(g, '')!r}: the tensors packed inside it are not seen",
            holder=held[0][1] if held else "", model=held[0][0] if held else "",
            graph=labels.get(g, "")))
    return out


def guarded_blind(spots: Iterable[BlindSpot], graphs: Mapping[int, str],
                   models: Mapping[str, torch.nn.Module], values: Mapping) -> list[dict]:
    """The records that concern the guarded `graphs`, each with its holder's identity now."""
    ids = {label: g for g, label in graphs.items()}
    out, seen = [], set()
    for spot in spots:
        if spot.kind in _NOT_AT_CAPTURE or (spot.graph and spot.graph not in ids):
            continue
        key = (spot.kind, spot.holder, spot.model, spot.op, spot.graph)
        if key in seen:  # one row per holder and graph, however many texts
            continue
        seen.add(key)
        entry = {"spot": spot, "graph_id": ids.get(spot.graph, -1), "ref": None,
                 "data_ptr": None, "nbytes": None, "version": None,
                 "value": values.get(spot)}  # a baked scalar's value at capture
        model = models.get(spot.model) if spot.holder else None
        if model is not None and entry["value"] is None:
            _hold(entry, resolve_path(model, spot.holder))
        out.append(entry)
    return out


def ptr_of(storage: torch.UntypedStorage) -> int:
    """A storage's data_ptr; 0 for a wrapper subclass's placeholder (reading it raises)."""
    try:
        return storage.data_ptr()
    except Exception:
        return 0


def _hold(entry: dict, target: object) -> None:
    """Remember `target` (what the holder reaches) as the blind spot's holder identity."""
    storage = storage_or_none(target)
    if storage is None:
        return
    entry["ref"] = StorageWeakRef(storage)
    entry["data_ptr"] = ptr_of(storage)
    entry["nbytes"] = storage.nbytes()
    entry["version"] = target._version if isinstance(target, torch.Tensor) else None


def _holder_status(entry: dict, target: object) -> str:
    """What a blind spot's holder did since the guard was made: "holds", "moved", "orphaned",
    "written", or "" (nothing to check: no holder identity)."""
    if entry.get("value") is not None:  # a baked scalar: its holder's value (Note [baked scalars])
        return HOLDS if target == entry["value"] else ORPHANED if target is None else "changed"
    if entry["ref"] is None and entry["data_ptr"] is None:
        return ""
    if target is None:
        return ORPHANED
    storage = storage_or_none(target)
    if storage is None:
        return MOVED
    ref = entry["ref"]
    if not same_storage(storage, ref.cdata if ref is not None else None, entry["data_ptr"],
                        entry["nbytes"]):
        return MOVED
    version = target._version if isinstance(target, torch.Tensor) else None
    if entry["version"] is not None and version != entry["version"]:
        return "written"
    return HOLDS


# Note [one look per holder]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~
# A float a norm module holds (`eps`) is baked into every graph: one `baked scalar` record
# per module *and graph*, 161 x 67 on an 80-layer LayerNorm model, each once a Python
# resolve at every check (18-20 ms; issue 39). Records of one holder with one baseline (the
# value, or the storage, version and address it reached) share their answer, so
# `BlindHolders` groups them: one look per distinct holder, and each group keeps its records
# (so a row still names every graph). A check first asks the native `paths_moved` whether
# any holder with a weak handle or a value moved (as `Guard._nothing_moved` does for owner
# paths; `PathSet.moved` compares a float baseline by value); only when one did, or a
# holder is known by address alone, does Python look at the holders, once each
# (`_holder_status`, the one rule both paths answer by). Records with nothing to check by
# give their rows at every check.


class BlindHolders:
    """A guard's blind-spot records grouped by holder (Note [one look per holder])."""

    __slots__ = ("entries", "_fixed", "_keys", "_members", "_owned", "_fast", "_slow")

    def __init__(self, entries: list[dict], owned: set[tuple[str, str]]):
        self.entries = entries
        self._fixed: list[int] = []  # records with no holder identity: a row at every check
        self._keys: list[tuple[str, str, dict]] = []  # per holder: model, path, first record
        self._members: list[list[int]] = []  # per holder: its records
        self._owned: list[bool] = []  # per holder: an owner path of a guarded storage
        index: dict[tuple, int] = {}
        for k, e in enumerate(entries):
            spot, value, ref = e["spot"], e.get("value"), e["ref"]
            if value is None and ref is None and e["data_ptr"] is None:
                self._fixed.append(k)
                continue
            key = (spot.model, spot.holder, value, ref.cdata if ref is not None else None,
                   e["data_ptr"], e["nbytes"], e["version"])
            h = index.get(key)
            if h is None:
                h = index[key] = len(self._keys)
                self._keys.append((spot.model, spot.holder, e))
                self._members.append([])
                self._owned.append((spot.model, spot.holder) in owned)
            self._members[h].append(k)
        # per model: the holders native paths_moved can decide (a weak handle or a value)
        by_model: dict[str, list[int]] = {}
        self._slow: list[int] = []  # known by address only: Python looks at every check
        for h, (model, path, e) in enumerate(self._keys):
            decidable = path and (e.get("value") is not None or e["ref"] is not None)
            (by_model.setdefault(model, []) if decidable else self._slow).append(h)
        self._fast = [
            (m, PathSet(self._keys[h][1] for h in hs),
             [self._baseline(self._keys[h][2]) for h in hs],
             [self._keys[h][2]["version"] if self._keys[h][2].get("value") is None
              else None for h in hs], None)
            for m, hs in by_model.items()]

    @staticmethod
    def _baseline(e: dict) -> int | float:
        return e["value"] if e.get("value") is not None else e["ref"].cdata

    def __len__(self) -> int:
        """The number of distinct holders a check may look at."""
        return len(self._keys)

    def rows(self, accept: frozenset, models: Mapping[str, torch.nn.Module],
             graphs: Mapping[int, str], native=None) -> list[tuple]:
        """Guard rows (GUARD_COLUMNS) for the records the update may have invalidated, in
        record order (Note [blind spots in the guard])."""
        look = self._slow if none_moved(models, native, self._fast) else range(len(self._keys))
        out = [(k, _row(self.entries[k], "", None, graphs)) for k in self._fixed]
        for h in look:
            model_name, path, e = self._keys[h]
            model = models.get(model_name)
            resolve = resolve_value if e.get("value") is not None else resolve_path
            target = resolve(model, path) if (model is not None and path) else None
            status = _holder_status(e, target)
            if status == HOLDS or (status in (MOVED, ORPHANED) and self._owned[h]
                                   and e.get("value") is None):
                continue
            out.extend((k, _row(self.entries[k], status, target, graphs))
                       for k in self._members[h])
        out.sort(key=lambda kr: kr[0])
        return [r for k, r in out if self.entries[k]["spot"].kind not in accept]


def _row(entry: dict, status: str, target: object, graphs: Mapping[int, str]) -> tuple:
    """One guard row (GUARD_COLUMNS, verdict `unchecked`) for a blind-spot record."""
    spot = entry["spot"]
    live = pd.NA
    if status in (MOVED, "written") and entry.get("value") is None:
        storage = storage_or_none(target)
        live = ptr_of(storage) if storage is not None else pd.NA
    g = entry["graph_id"]
    return (g, graphs.get(g, spot.graph), -1, entry["data_ptr"] or 0, entry["nbytes"] or 0,
            "", "", spot.holder, "", status, live, GUARD_UNCHECKED, pd.NA,
            "storage" if entry["ref"] is not None else "data_ptr", "", spot.kind, spot.text)


def spot_row(spot: BlindSpot, status: str, graphs: Mapping[int, str]) -> tuple:
    """One guard row for a record found at the check itself (a packed copy not rebuilt):
    every graph, no holder identity kept."""
    return _row({"spot": spot, "graph_id": -1, "ref": None, "data_ptr": None, "nbytes": None},
                status, None, graphs)


def adopt_blind(blind: list[dict], name: str, model: torch.nn.Module) -> None:
    """A manifest's blind spots known by address: a weak handle (and version) taken where
    the holder still reaches a storage of that address and size (Note [guard identity])."""
    for entry in blind:
        spot = entry["spot"]
        if spot.model != name or not spot.holder or entry["ref"] is not None \
                or entry["data_ptr"] is None:
            continue
        target = resolve_path(model, spot.holder)
        entry["ref"] = handle_at(target, entry["data_ptr"], entry["nbytes"])
        if entry["ref"] is not None and entry["version"] is None \
                and isinstance(target, torch.Tensor):
            entry["version"] = target._version


def handle_at(target: object, data_ptr: int, nbytes: int) -> StorageWeakRef | None:
    """A weak handle to the storage `target` reaches where it has the captured address and
    size (a manifest's entry upgraded at attach: Note [guard identity]), else None."""
    storage = storage_or_none(target)
    if storage is None or not same_storage(storage, None, data_ptr, nbytes):
        return None
    return StorageWeakRef(storage)


def storage_or_none(tensor: object) -> torch.UntypedStorage | None:
    """The storage behind `tensor` (graphtrace.opaque.storage_of), None where it has none."""
    if tensor is None:
        return None
    try:
        return storage_of(tensor)
    except Exception:
        return None
