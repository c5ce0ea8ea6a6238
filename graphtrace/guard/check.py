"""The guard's check (`Guard`; the module doc of graphtrace.guard)."""

from __future__ import annotations

import dataclasses
import datetime as _dt
import json
import os
import tempfile
import weakref
from pathlib import Path
from typing import Iterable, Iterator, Mapping

import numpy as np
import pandas as pd
import torch
from torch.multiprocessing.reductions import StorageWeakRef

from graphtrace import __version__, stage
from graphtrace import verdict as engine
from graphtrace._compat import storage_from_weak_ref
from graphtrace.blindspots import BlindSpot
from graphtrace.derived import CopyPair, DerivedCopies
from graphtrace.errors import GraphtraceError
from graphtrace.guard.blind import BlindHolders, accepted_kinds, adopt_blind, handle_at, spot_row
from graphtrace.guard.describe import StaleGraphError, describe
from graphtrace.guard.manifest import FORMAT, FORMAT_VERSION, Required, _blind_json
from graphtrace.lineage import Derived
from graphtrace.owner_paths import PathSet, none_moved, resolve_path
from graphtrace.verdict import View, on_storage, owner_status, verdict_of
from graphtrace.vocab import GUARD_COLUMNS, GUARD_PROBLEMS, HOLDS, MOVED

__all__ = ["Guard", "empty_problems"]

_NO_CLEAN_PASS = object()  # Note [guard freshness fast path]: no clean pass yet
_PLAIN = (torch.Tensor, torch.nn.Parameter)  # the owners whose view is compared (owner_status)


def _geometry(tensor: torch.Tensor) -> tuple | None:
    """(dtype, shape, stride, storage offset) of a plain tensor, None where it has none."""
    try:
        return tensor.dtype, tensor.shape, tensor.stride(), tensor.storage_offset()
    except Exception:  # sparse and other layouts without strides: owner_status decides
        return None

class Guard:
    """The owned storages captured graphs read, their owners and graphs; see the module doc.

    Made by ``Trace.guard()`` or `load_guard`; ``check()`` / ``enforce()`` after each update.
    """

    def __init__(self, *, models: Iterable[str], graphs: Mapping[int, str],
                 storages: list[dict], source: str = "trace", lineage=None,
                 blind_spots: Iterable[dict] = (), accept: Iterable[str] = (),
                 copies: Iterable["CopyPair | dict"] = ()):
        """`storages`: per required storage a `Required`, or the dict `Required.of` reads
        (its fields; `alive` for `dead`; with `derived`, no owner needed). `lineage`: the trace's
        graphtrace.lineage.Lineage, held by weak reference: while it lives (and records), writes
        it saw count too, as in the diff (Note [freshness]). `blind_spots`: what the recording
        could not see in these graphs, each a dict with the `BlindSpot` (`spot`), `graph_id`
        (-1: every graph) and its holder's identity at capture (`ref`, `data_ptr`, `nbytes`,
        `version`; Note [blind spots in the guard]); `accept`: the blind-spot kinds the user
        accepts (`check()` leaves them out). `copies`: the packed copies and the weights they
        are made from (`Trace.watch_copy`; CopyPair, or dicts with model, copy, source:
        fingerprinted at attach), checked as the diff checks them (Note [derived copies] in
        graphtrace/derived.py)."""
        self.accept = accept  # validated by the property
        self._blind: list[dict] = [dict(b) for b in blind_spots]
        self._copy_errors: list[tuple[str, BaseException]] = []  # a pair that failed its check
        self._copies = DerivedCopies(lambda where, exc, errors=self._copy_errors:
                                     errors.append((where, exc)))
        for pair in copies:
            pair = (dataclasses.replace(pair) if isinstance(pair, CopyPair)
                    else CopyPair(pair["model"], pair["copy"], pair["source"]))
            self._copies.pairs[(pair.model, pair.copy)] = pair
        self._holders: BlindHolders | None = None  # made on first check (Note [one look
        # per holder] in graphtrace/guard/blind.py)
        self._model_names = list(models)
        self._models: dict[str, weakref.ref | None] = {n: None for n in self._model_names}
        self.graphs: dict[int, str] = dict(graphs)
        self.source = source
        self._storages = [Required.of(s) for s in storages]
        # owner rows, flat: (storage index, model, path, kind); sorted by index, model, path
        self._owners: list[tuple[int, str, str, str]] = [
            (i, m, p, k) for i, r in enumerate(self._storages) for m, p, k in r.owners]
        self._lineage = weakref.ref(lineage) if lineage is not None else None
        self._late = lineage.late if lineage is not None else 0  # Note [derived during updates]
        self._fresh_paths: dict | None = None  # model -> (paths, PathSet), made on first use
        # Note [guard freshness fast path]: the lineage clock of the last freshness pass that
        # found nothing (_NO_CLEAN_PASS: none yet), and per model the sources' PathSet with
        # their StorageImpls and version counters (None: to be made; False: cannot be)
        self._fresh_clean: object = _NO_CLEAN_PASS
        self._fresh_sources: list | bool | None = None
        self._owner_views: list[View | None] = [
            r.owner_views.get((m, p)) for r in self._storages for m, p, _ in r.owners]
        self._geometry: dict | None = None  # _nothing_moved's views, made on first use
        self._exact: list[View | None] | None = None  # _exact_views, made on first use
        # per model: its owner paths resolved together, and the owner rows they answer
        rows: dict[str, list[int]] = {}
        for r, (_, m, _, _) in enumerate(self._owners):
            rows.setdefault(m, []).append(r)
        self._paths = {m: (PathSet(self._owners[r][2] for r in rs), rs) for m, rs in rows.items()}
        # the fast path of check(): the native module, and per model the StorageImpl each
        # owner path reached at capture (None when any storage is known by address only)
        self._native = None
        req = self._storages
        self._expected: dict[str, list[int]] | None = (
            {m: [req[self._owners[r][0]].ref.cdata for r in rs] for m, rs in rows.items()}
            if all(r.ref is not None for r in req) else None)

    # -- models ------------------------------------------------------------------------------
    def attach(self, model: torch.nn.Module, name: str | None = None) -> "Guard":
        """Check against `model` (by weak reference) under `name`; with one model name,
        `name` may be left out. Storages known by address are upgraded: Note [guard identity]."""
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"a guard attaches to a torch.nn.Module, got {type(model).__name__}")
        if name is None:
            if len(self._model_names) != 1:
                raise GraphtraceError(
                    f"this guard checks {len(self._model_names)} models "
                    f"({', '.join(map(repr, self._model_names))}): pass name=...")
            name = self._model_names[0]
        if name not in self._models:
            raise GraphtraceError(f"this guard has no model named {name!r} (its models: "
                                  f"{', '.join(map(repr, self._model_names))})")
        self._models[name] = weakref.ref(model)
        self._adopt(name, model)
        return self

    def _adopt(self, name: str, model: torch.nn.Module) -> None:
        self._adopt_sources(name, model)
        adopt_blind(self._blind, name, model)
        if self._copies.pairs:  # fingerprinted now where the trace did not (from JSON)
            self._copies.refresh({name: model})
        self._holders = None  # grouped again: adopted handles are part of a holder's key
        for i, m, path, _ in self._owners:
            r = self._storages[i]
            if m != name or r.ref is not None or r.dead:
                continue
            r.ref = handle_at(resolve_path(model, path), r.data_ptr, r.nbytes)

    def _adopt_sources(self, name: str, model: torch.nn.Module) -> None:
        """Freshness baselines a manifest from another process cannot carry, taken now: a
        weak handle to each source storage still at its recorded address and size, and
        the version counters of the sources and of the storage's owners."""
        for r, d in self._derived():
            sources = []
            for src in d.sources:
                if src.model == name and (src.ref is None or src.version is None):
                    tensor = resolve_path(model, src.path)
                    if src.ref is None:
                        src = src._replace(ref=handle_at(tensor, src.data_ptr, src.nbytes))
                    if src.version is None and isinstance(tensor, torch.Tensor):
                        src = src._replace(version=tensor._version)
                sources.append(src)
            versions = dict(d.owner_versions)
            for (m, p), v in d.owner_versions.items():
                if m == name and v is None:
                    tensor = resolve_path(model, p)
                    versions[(m, p)] = tensor._version if isinstance(tensor, torch.Tensor) \
                        else None
            r.derived = d._replace(sources=tuple(sources), owner_versions=versions)
        self._fresh_sources = None  # the fast path's baselines, made again (Note above)

    def _derived(self) -> Iterator[tuple[Required, Derived]]:
        """The required storages with freshness baselines (Note [freshness] in
        graphtrace/verdict.py), and those baselines."""
        return ((r, r.derived) for r in self._storages if r.derived is not None)

    def _live_models(self) -> dict[str, torch.nn.Module]:
        live = {}
        for name in self._model_names:
            ref = self._models[name]
            model = ref() if ref is not None else None
            if model is None:
                what = "was never attached" if ref is None else "was freed"
                label = f"model {name!r}" if name else "the model"
                raise GraphtraceError(f"{label} of this guard {what}: call "
                                      f"guard.attach(model{', name=' + repr(name) if name else ''})")
            live[name] = model
        return live

    @property
    def models(self) -> list[str]:
        return list(self._model_names)

    # -- checks ------------------------------------------------------------------------------
    def check(self) -> pd.DataFrame:
        """One row per (graph, storage) whose storage's owners no longer all hold it
        (columns: graphtrace.vocab.GUARD_COLUMNS; verdicts: GUARD_PROBLEMS); empty when
        every captured storage is still where its owners point."""
        models = self._live_models()
        self._adopt_late()
        blind = self._blind_rows(models) + self._copy_rows(models)
        if self._nothing_moved(models):  # every owner still holds its storage
            fresh = self._freshness(models, set())
            if not fresh.unrefreshed and not blind and not fresh.freed:
                return empty_problems()
        req = self._storages
        tensors: list = [None] * len(self._owners)
        for name, (paths, rows) in self._paths.items():
            for r, tensor in zip(rows, paths.resolve(models[name])):
                tensors[r] = tensor
        statuses: list[str] = []
        live_ptrs: list[int | None] = []
        bad: set[int] = set()
        for (i, _, _, _), tensor, view, exact in zip(self._owners, tensors, self._owner_views,
                                                     self._exact_views()):
            r = req[i]
            if exact is not None and type(tensor) in _PLAIN and _geometry(tensor) == exact:
                view = None  # exactly the view it had: `same_view` holds, not asked
            status, ptr = owner_status(tensor, r.ref.cdata if r.ref is not None else None,
                                       data_ptr=r.data_ptr, nbytes=r.nbytes, dead=r.dead,
                                       view=view)
            statuses.append(status)
            live_ptrs.append(ptr)
            if status != HOLDS:
                bad.add(i)
        fresh = self._freshness(models, bad)
        if not bad and not fresh.unrefreshed and not blind and not fresh.freed:
            return empty_problems()
        return self._problems(bad | set(fresh.unrefreshed) | set(fresh.freed), statuses,
                              live_ptrs, tensors, fresh, blind)

    def _adopt_late(self) -> None:
        """Note [derived during updates] in graphtrace/lineage/graph.py: the `Derived` lineage made
        since for storages this guard holds with none (its trace matches first)."""
        lineage = self._lineage() if self._lineage is not None else None
        if lineage is None:
            return
        lineage.catch_up()
        if lineage.late == self._late:
            return
        self._late = lineage.late
        captured = lineage.captured
        for r in self._storages:
            if r.derived is None and r.storage_id in captured:
                r.derived = captured[r.storage_id]
                self._fresh_paths = self._fresh_sources = None  # made again with it
                self._fresh_clean = _NO_CLEAN_PASS

    def _blind_rows(self, models: Mapping[str, torch.nn.Module]) -> list[tuple]:
        """The rows of the blind spots the update may have invalidated (Note [blind spots
        in the guard]), one look per distinct holder (graphtrace/guard/blind.py)."""
        if not self._blind:
            return []
        if self._holders is None:
            self._holders = BlindHolders(self._blind, {(m, p) for _, m, p, _ in self._owners})
        return self._holders.rows(self._accept, models, self.graphs, self._native)

    def _copy_rows(self, models: Mapping[str, torch.nn.Module]) -> list[tuple]:
        """A row per packed copy not rebuilt since its source changed, as the diff finds
        them (DerivedCopies.check), unless that kind is accepted; a pair that could not be
        checked is one too (fail closed)."""
        kind = "packed copy not rebuilt"
        if not self._copies.pairs or kind in self._accept:
            return []
        found = self._copies.check(models)
        found += [BlindSpot(kind, f"packed copy could not be checked ({where}: {exc!r})")
                  for where, exc in self._copy_errors]
        self._copy_errors.clear()
        return [spot_row(b, "not rebuilt", self.graphs) for b in found]

    def _nothing_moved(self, models: Mapping[str, torch.nn.Module]) -> bool:
        """Does every owner path still reach the storage it reached at capture, under the
        view it had then where that is known (Note [re-laid views] in graphtrace/verdict.py)?
        Answered by `PathSet.moved` when the guard was made from a trace with the native
        module; False (look at every owner) otherwise, or on any doubt."""
        native, expected = self._native, self._expected
        if native is None or expected is None or not self._paths:
            return False
        if self._geometry is None:  # per model: each owner's View at capture, or None
            exact = self._exact_views()
            self._geometry = {name: [exact[r] for r in rows]
                              for name, (_, rows) in self._paths.items()}
        return none_moved(models, native, ((name, paths, expected[name], None, self._geometry[name])
                                           for name, (paths, _) in self._paths.items()))

    def _exact_views(self) -> list[View | None]:
        """Per owner row its View at capture as `_geometry(tensor)` compares it (shape a
        torch.Size), or None where unknown; made once."""
        if self._exact is None:
            self._exact = [View(v.dtype, torch.Size(v.shape), tuple(v.stride), v.offset)
                           if v is not None else None for v in self._owner_views]
        return self._exact

    # Note [guard rebaseline]
    # ~~~~~~~~~~~~~~~~~~~~~~~~
    # Freshness compares version counters with the baselines taken at the capture (Note
    # [freshness] in graphtrace/verdict.py). After an update that changed a source in place
    # and recomputed the derived storage in place (its owners' versions moved: fresh), every
    # later check would resolve the owners' paths again to reach the same conclusion, and an
    # update after it that changes the source again *without* recomputing would still look
    # rewritten (the owners' versions differ from the capture's). So a check that finds a
    # derived storage fresh although a source's version moved takes the versions now as its
    # baseline: the next check costs what a clean one does, and finds that second update
    # `unrefreshed`. Only where every source still has its storage (a rebound source keeps
    # its baseline); a guard read from JSON rebaselines its version counters alike.

    # Note [guard freshness fast path]
    # ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
    # Freshness asks of every derived storage whether a source changed since it was last
    # written; in Python that is a walk of every source path per check (3x an identity-only
    # check on bench_guard's 80 layers). When the last freshness pass found nothing, the
    # answer can only change if a source's path now reaches another storage or a tensor with
    # another version counter than its baseline (what freshness_of compares), or lineage
    # recorded a write since (its clock moved: a rewrite of a derived storage or a source).
    # So a check first asks the native `paths_moved` over the sources' paths, with their
    # StorageImpls and version counters, and compares lineage's clock with that pass's; only
    # when something differs (or cannot be decided: no native module, a source known by
    # address only, two baselines for one path, a derived storage already stale at its
    # capture) does the full pass run. A rebaseline makes the source baselines afresh.

    def _sources_unchanged(self, models: Mapping[str, torch.nn.Module]) -> bool:
        """Note [guard freshness fast path]: True when the last freshness pass found nothing
        and provably nothing it compares changed since."""
        native = self._native
        if native is None or self._fresh_clean is _NO_CLEAN_PASS:
            return False
        lineage = self._lineage() if self._lineage is not None else None
        if (lineage.clock if lineage is not None else None) != self._fresh_clean:
            return False
        sources = self._fresh_sources
        if sources is None:
            sources = self._fresh_sources = self._source_baselines()
        return sources is not False and none_moved(models, native, sources)

    def _source_baselines(self) -> list | bool:
        """Per model: (its name, PathSet of the sources' paths, their StorageImpls, their
        versions, None), or False when a source cannot be compared that way."""
        want: dict[tuple[str, str], tuple[int, int]] = {}
        for _, d in self._derived():
            if d.stale:
                return False
            for src in d.sources:
                if src.ref is None or src.version is None:
                    return False
                key, base = (src.model, src.path), (src.ref.cdata, src.version)
                if want.setdefault(key, base) != base:
                    return False
        by_model: dict[str, list[str]] = {}
        for m, p in sorted(want):
            by_model.setdefault(m, []).append(p)
        return [(m, PathSet(ps), [want[(m, p)][0] for p in ps], [want[(m, p)][1] for p in ps],
                 None) for m, ps in by_model.items()]

    def _freshness(self, models: Mapping[str, torch.nn.Module], bad: set[int]) -> engine.Freshness:
        """Of the derived storages not in `bad` (whose owners all hold them, or that have
        none): the verdict engine's `freshness` pass, the diff's too. A storage found fresh
        is rebaselined (Note [guard rebaseline])."""
        if not any(self._derived()):
            return engine.Freshness({}, {}, [])
        unchanged = self._sources_unchanged(models)  # Note [guard freshness fast path]
        lineage = self._lineage() if self._lineage is not None else None
        resolve = self._resolver(models, batch=not unchanged)
        found = engine.freshness(
            ((i, r.derived, r.ref.cdata if r.ref is not None else None,
              not r.ref.expired() if r.ref is not None else not r.dead, r.internal)
             for i, r in enumerate(self._storages) if i not in bad),
            resolve, lineage, sources_unchanged=unchanged)
        for i in found.fresh:
            r = self._storages[i]
            self._rebaseline(r, r.derived, resolve, lineage)
        if not unchanged:
            self._fresh_clean = _NO_CLEAN_PASS if found.unrefreshed else (
                lineage.clock if lineage is not None else None)
        return found

    def _resolver(self, models: Mapping[str, torch.nn.Module], batch: bool):
        """`resolve(model, path)` for a freshness pass: what a path reaches now, each
        resolved once; `batch`: the sources' paths resolved together first (a full pass)."""
        found: dict[tuple[str, str], object] = {}
        if batch:
            if self._fresh_paths is None:  # the sources' paths, resolved together
                by_model: dict[str, set] = {}
                for _, d in self._derived():
                    for src in d.sources:
                        by_model.setdefault(src.model, set()).add(src.path)
                self._fresh_paths = {m: (sorted(ps), PathSet(sorted(ps)))
                                     for m, ps in by_model.items()}
            for name, (paths, path_set) in self._fresh_paths.items():
                model = models.get(name)
                if model is not None:
                    found.update(zip(((name, p) for p in paths), path_set.resolve(model)))

        def resolve(model: str, path: str):
            # an owner's path: only where a source changed (freshness_of), resolved then
            key = (model, path)
            if key not in found:
                try:
                    found[key] = resolve_path(models[model], path) if model in models else None
                except Exception:
                    found[key] = None
            return found[key]

        return resolve

    def _rebaseline(self, r: Required, d: Derived, resolve, lineage) -> None:
        """Note [guard rebaseline]."""
        moved = False
        for s in d.sources:
            t = resolve(s.model, s.path)
            if s.version is not None and isinstance(t, torch.Tensor) and t._version != s.version:
                moved = True
                break
        if not moved:
            return
        sources = []
        for s in d.sources:
            t = resolve(s.model, s.path)
            if not isinstance(t, torch.Tensor):
                return
            try:
                st = t.untyped_storage()
                same = stage.same_storage(st, s.ref.cdata if s.ref is not None else None,
                                          s.data_ptr, s.nbytes)
                version = t._version
            except Exception:
                return
            if not same:
                return
            clock = s.clock
            if lineage is not None and s.ref is not None:
                clock = max(clock, lineage.clock_of(s.ref.cdata))
            sources.append(s._replace(version=version if s.version is not None else None,
                                      clock=clock))
        versions = {}
        for (m, p), v in d.owner_versions.items():
            t = resolve(m, p)
            versions[(m, p)] = t._version if isinstance(t, torch.Tensor) else v
        r.derived = d._replace(sources=tuple(sources), owner_versions=versions)
        self._fresh_sources = None  # the fast path's baselines, made again (Note above)

    def _problems(self, bad: set[int], statuses: list[str], live_ptrs: list,
                  tensors: list, fresh: engine.Freshness, blind: list[tuple] = ()) -> pd.DataFrame:
        by_storage: dict[int, list[int]] = {}
        for row, (i, *_rest) in enumerate(self._owners):
            if i in bad:
                by_storage.setdefault(i, []).append(row)
        order = sorted(bad)
        runs = [by_storage.get(i, []) for i in order]
        live_of = self._live_pointers(order, runs, statuses, live_ptrs)
        rows = []
        for i, owner_rows in zip(order, runs):
            st = [statuses[r] for r in owner_rows]
            req = self._storages[i]
            ref = req.ref
            alive = (not ref.expired()) if ref is not None else not req.dead
            verdict = verdict_of(st, alive, req.internal, i in fresh.unrefreshed, i in fresh.freed)
            if verdict not in GUARD_PROBLEMS:
                continue
            moved = [r for r in owner_rows if statuses[r] == MOVED]
            live = live_of.get(i, pd.NA)
            kinds = sorted({self._owners[r][3] for r in owner_rows})
            old = _upgrade(ref) if verdict in ("stale", "diverged") else None
            impacts: dict[View | None, tuple[object, str]] = {}
            derived = req.derived
            derived_from = fresh.derived_from(i, derived) if derived is not None else ""
            now, now_view = ((tensors[moved[0]], self._owner_views[moved[0]]) if moved
                             else (None, None))
            relaid = old is not None and now is not None and on_storage(now, old)
            for g, view in zip(req.graphs, req.views):
                if view not in impacts:  # the diff's rule (verdict.edge_impact)
                    impact, note = engine.edge_impact(verdict, old, view, now, now_view,
                                                      fresh.unrefreshed.get(i, "unknown"))
                    # Note [re-laid views]: both views named where the owner is re-laid
                    impacts[view] = (pd.NA if impact is None else impact,
                                     note if relaid else "")
                impact, note = impacts[view]
                rows.append((g, self.graphs.get(g, ""), req.storage_id, req.data_ptr,
                             req.nbytes, req.dtype, req.shape,
                             "; ".join(self._owners[r][2] for r in owner_rows),
                             ";".join(kinds), ";".join(st), live, verdict, impact,
                             "storage" if ref is not None else "data_ptr",
                             derived_from, "", note))
            del old, now
        rows.sort(key=lambda r: (r[0], r[2]))  # by graph, then storage
        rows.extend(blind)  # after the edges: Note [blind spots in the guard]
        columns = dict(zip(GUARD_COLUMNS, map(list, zip(*rows)))) if rows else {
            c: [] for c in GUARD_COLUMNS}
        columns["live_data_ptr"] = pd.array(columns["live_data_ptr"], dtype="Int64")
        for c in ("graph_id", "storage_id", "data_ptr", "nbytes"):
            columns[c] = np.asarray(columns[c], dtype=np.int64)
        return pd.DataFrame(columns, columns=GUARD_COLUMNS)

    @staticmethod
    def _live_pointers(order: list[int], runs: list[list[int]], statuses: list[str],
                       live_ptrs: list) -> dict[int, object]:
        """Per storage of `order` with owner rows (`runs`: its rows), where its graphs
        should read now: the diff's rule (stage.live_pointer)."""
        kept = [(i, rs) for i, rs in zip(order, runs) if rs]
        if not kept:
            return {}
        flat = [r for _, rs in kept for r in rs]
        starts = np.cumsum([0] + [len(rs) for _, rs in kept[:-1]])
        known = np.array([live_ptrs[r] is not None for r in flat], dtype=bool)
        ptrs = np.array([live_ptrs[r] or 0 for r in flat], dtype=np.int64)
        moved = np.array([statuses[r] == MOVED for r in flat], dtype=bool)
        picks = stage.live_pointer(ptrs, known, moved, starts).tolist()
        return {i: live_ptrs[flat[k]] if k >= 0 else pd.NA for k, (i, _) in zip(picks, kept)}

    def enforce(self) -> None:
        """Raise `StaleGraphError` listing every problem `check()` finds (blind spots the
        update may have invalidated included, unless their kind is in `accept`); return if
        clean."""
        problems = self.check()
        if len(problems):
            raise StaleGraphError(describe(problems), problems)

    # -- the manifest ------------------------------------------------------------------------
    @property
    def manifest(self) -> pd.DataFrame:
        """The required storages, one row per (graph, owner): graph_id, graph, storage_id,
        model, path, kind, data_ptr, nbytes, device, dtype, shape (what the JSON holds)."""
        req = self._storages
        rows = [(g, self.graphs.get(g, ""), req[i].storage_id, m, p, k, req[i].data_ptr,
                 req[i].nbytes, req[i].device, req[i].dtype, req[i].shape)
                for i, m, p, k in self._owners for g in req[i].graphs]
        return pd.DataFrame(rows, columns=["graph_id", "graph", "storage_id", "model", "path",
                                           "kind", "data_ptr", "nbytes", "device", "dtype",
                                           "shape"])

    def to_dict(self) -> dict:
        """The manifest as plain JSON data (format in docs/guard.md)."""
        return {
            "format": FORMAT,
            "format_version": FORMAT_VERSION,
            "graphtrace_version": __version__,
            "torch_version": torch.__version__,
            "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            "models": list(self._model_names),
            "graphs": [{"graph_id": g, "label": label} for g, label in self.graphs.items()],
            "storages": [r.to_json() for r in self._storages],
            **({"blind_spots": [_blind_json(b) for b in self._blind]} if self._blind else {}),
            **({"copies": [{"model": p.model, "copy": p.copy, "source": p.source}
                           for p in self._copies.pairs.values()]} if self._copies.pairs else {}),
        }

    def to_json(self, path: str | os.PathLike) -> Path:
        """Write the manifest to `path` atomically (a failed write leaves no partial file)."""
        path = Path(path)
        text = json.dumps(self.to_dict(), indent=1)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
        try:
            with os.fdopen(fd, "w") as f:
                f.write(text)
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        return path

    # -- misc --------------------------------------------------------------------------------
    def __len__(self) -> int:
        """The number of required storages."""
        return len(self._storages)

    @property
    def accept(self) -> frozenset[str]:
        """The blind-spot kinds (vocab.BLIND_SPOT_KINDS) this guard's `check()` leaves out:
        what the user accepted not to see (Note [blind spots in the guard])."""
        return self._accept

    @accept.setter
    def accept(self, kinds: Iterable[str]) -> None:
        self._accept = accepted_kinds(kinds)

    @property
    def blind_spots(self) -> list[BlindSpot]:
        """The blind spots of the guarded graphs that `check()` looks at after each update."""
        return [b["spot"] for b in self._blind]

    @property
    def n_owners(self) -> int:
        """The number of (storage, owner path) pairs a check resolves."""
        return len(self._owners)

    @property
    def identity(self) -> dict[str, int]:
        """How many required storages are checked by weak handle ("storage") and how many by
        address and size only ("data_ptr"; Note [guard identity])."""
        by_handle = sum(r.ref is not None for r in self._storages)
        return {"storage": by_handle, "data_ptr": len(self._storages) - by_handle}

    def __repr__(self) -> str:
        attached = [n for n, r in self._models.items() if r is not None and r() is not None]
        return (f"<graphtrace.Guard from {self.source}: {len(self)} storages, "
                f"{len(self._owners)} owners, {len(self.graphs)} graphs, "
                f"models {self._model_names} ({len(attached)} attached), "
                f"identity {self.identity}>")


def _upgrade(ref: StorageWeakRef | None) -> torch.UntypedStorage | None:
    """A strong reference to the captured storage for a value check, None if it was freed or
    is known by address only; dropped by the caller right after the check."""
    if ref is None or ref.expired():
        return None
    try:
        return storage_from_weak_ref(ref.cdata)
    except Exception:
        return None


_EMPTY: pd.DataFrame | None = None


def empty_problems() -> pd.DataFrame:
    """A clean check's frame: made once, copied (a copy costs a tenth of building one)."""
    global _EMPTY
    if _EMPTY is None:
        ints = ("graph_id", "storage_id", "data_ptr", "nbytes")
        _EMPTY = pd.DataFrame({c: pd.Series(dtype="int64" if c in ints else "Int64"
                                            if c == "live_data_ptr" else object)
                               for c in GUARD_COLUMNS})
    return _EMPTY.copy(deep=False)

