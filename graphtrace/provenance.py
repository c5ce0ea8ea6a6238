"""Provenance: which op, called from which line of user code, made each storage.

See Note [provenance]; the diff's columns made from it (`created_at`, `live_created_at`,
`fix` in `report.edges`): `edge_columns`.
"""

from __future__ import annotations

import os
import sys
import sysconfig
import threading
import warnings
import weakref
from typing import TYPE_CHECKING, Callable, Iterable, Mapping

import numpy as np
import torch

from graphtrace._compat import (
    PROVENANCE,
    PROVENANCE_OFF,
    TorchDispatchMode,
    TorchIncompatible,
    current_dispatch_mode_stack,
    dispatch_stack_at,
    dispatch_stack_len,
    free_weak_ref,
    pop_mode,
    push_mode,
    storage_weak_ref,
    weak_ref_expired,
)
from graphtrace._schema import tensors_in
from graphtrace.clock import CLOCK
from graphtrace.fixes import Stack, fix_text
from graphtrace.sites import format_site, suggest_fix
from graphtrace.vocab import BEFORE_TRACE, NOT_RECORDED, STALE_VERDICTS

if TYPE_CHECKING:
    import pandas as pd

# edge_columns is the diff's (graphtrace.diff imports it), not part of this module's surface:
# it is the one function here that needs pandas, imported when it runs, so that opening a
# trace (an engine's startup) does not import pandas (~0.3 s)
__all__ = ["ENV", "enabled_by_default", "skipped_file", "ProvenanceTable", "ProvenanceMode",
           "Provenance", "DEPTH"]

# Note [provenance]
# ~~~~~~~~~~~~~~~~~
# What: while a trace is open, every storage an op creates on the thread that opened it,
# outside capture regions (model building, weight loading, process_weights_after_loading, a
# reload run inside the trace), is noted with its *site*: the op and the nearest DEPTH frames
# of user code that called it (frames in torch, graphtrace -- except graphtrace/demo -- the
# standard library, generated code "<...>", and any `__torch_dispatch__` /
# `__torch_function__` left out: another mode's dispatch method is not where a tensor is made).
# "Creates": an output whose storage is none of the op's inputs' (a view is not a creation),
# or the tensor `torch.tensor(...)` lifts (`aten::lift_fresh`, which aliases its input).
# The first sighting wins; the same storage seen again (a view, an in-place op) keeps it.
#
# Identity: a storage is its StorageImpl address held by a weak handle (`_weak_ref`; never
# its data), as in Note [weak handles and the sweep]; the table sweeps like the native one:
# each entry is checked once LAG..LAG+BATCH additions after its own, and the whole table
# whenever it has doubled since the last full sweep, so the headers of loading intermediates
# never pile up. `match` reads the site of each captured storage at the end of its capture
# (while it is alive, so a storage freed later still has one), the diff reads the live ones.
#
# Cost: the mode is a separate TorchDispatchMode (`ProvenanceMode`), never the capture mode.
# A capture region on the tracing thread pops it off the dispatch stack for the region
# (`pause`/`resume`), so capture pays nothing; if another mode sits above it then, it stays
# and passes ops through untouched. Dispatch modes are per thread: storages made on other
# threads are not seen ("not recorded"), nor those made by code that bypasses the dispatcher
# (torch.load, from_numpy, safetensors, Inductor's compiled kernels) or inside a capture.
# Like RecordingMode it sets `ignore_compile_internals`, so Dynamo compiles under it as
# without it and never sees it. Off: `graphtrace.trace(provenance=False)` or
# GRAPHTRACE_PROVENANCE=0 (what the vLLM plugin reads). Paused: `Trace.pause_provenance()` /
# `resume_provenance()` / `with t.provenance_paused():` take the mode off the stack for a
# while (the vLLM adapters pause it after warm-up and resume it around weight updates, so
# an engine's steady-state forwards pay nothing); storages made meanwhile are `not recorded`.
# A plain trace pauses and resumes itself by a rule: Note [recording while serving] in
# graphtrace/tracing/rule.py.
#
# "Before the trace": storages reachable from the models watched when the trace opens are
# noted as `before trace` (a census by the owner walk); anything else the trace never saw
# being made is `not recorded`. Neither is ever guessed into a site.

ENV = "GRAPHTRACE_PROVENANCE"
DEPTH = 4              # user frames kept per site, nearest first
_MAX_WALK = 96         # frames looked at per site at most
_LAG, _BATCH = 64, 64  # young-entry sweep (see Note [provenance])
_BEFORE = -1           # site id of a storage alive when the trace opened
_MODE_METHODS = frozenset({"__torch_dispatch__", "__torch_function__"})
_LIFTS = frozenset({torch.ops.aten.lift_fresh.default, torch.ops.aten.lift_fresh_copy.default})


def enabled_by_default() -> bool:
    """GRAPHTRACE_PROVENANCE: on unless "0", "off", "false" or "no"."""
    value = os.environ.get(ENV, "").strip().lower()
    if value in ("", "1", "on", "true", "yes"):
        return PROVENANCE  # off where this torch lacks what it needs (warned at import)
    if value in ("0", "off", "false", "no"):
        return False
    raise ValueError(f"{ENV}={value!r}: use 1 or 0")


def _dir(path: str) -> str:
    return os.path.join(os.path.dirname(os.path.abspath(path)), "")


_TORCH_DIR = _dir(torch.__file__)
_GRAPHTRACE_DIR = _dir(__file__)
_USER_DIRS = (os.path.join(_GRAPHTRACE_DIR, "demo", ""),)  # graphtrace's own "user code"
_STDLIB_DIRS = tuple({os.path.join(os.path.abspath(p), "") for p in (
    sysconfig.get_paths().get("stdlib"), sysconfig.get_paths().get("platstdlib")) if p})


def skipped_file(filename: str) -> bool:
    """Is a frame in `filename` left out of sites (torch, graphtrace, stdlib, generated)?"""
    if filename.startswith("<"):
        return True
    path = os.path.abspath(filename)
    if path.startswith(_TORCH_DIR):
        return True
    if path.startswith(_GRAPHTRACE_DIR):
        return not path.startswith(_USER_DIRS)
    if path.startswith(_STDLIB_DIRS):
        return "site-packages" not in path and "dist-packages" not in path
    return False


def _storages(obj) -> Iterable[torch.UntypedStorage]:
    """The storages of the plain tensors in `obj` (the tensor walker: graphtrace._schema)."""
    for t in tensors_in(obj):
        try:
            yield t.untyped_storage()
        except Exception:  # sparse and other storage-less layouts: nothing to note
            continue


class ProvenanceTable:
    """Storage (StorageImpl address, one weak handle each) -> site id; never a strong ref.

    `sites[i]` is site i as (op, frames); `_BEFORE` (-1) marks a storage alive when the trace
    opened. Swept as Note [provenance] says."""

    __slots__ = ("index", "young", "sites", "site_ids", "n_added", "_mark",
                 "__weakref__")

    def __init__(self):
        self.index: dict[int, tuple[int, int]] = {}   # address -> (weak handle, site id)
        self.young: list[int] = []
        self.sites: list[tuple[str, tuple]] = []
        self.site_ids: dict[tuple, int] = {}
        self.n_added = 0
        self._mark = 0

    def site_id(self, key: tuple) -> int:
        i = self.site_ids.get(key)
        if i is None:
            self.sites.append(key)
            i = self.site_ids[key] = len(self.sites) - 1
        return i

    def add(self, storage: torch.UntypedStorage, site: int) -> None:
        address = storage._cdata
        if address in self.index:
            return
        self.index[address] = (storage_weak_ref(storage), site)
        self.n_added += 1
        young = self.young
        young.append(address)
        if len(young) >= _LAG + _BATCH:
            self._sweep_young()

    def _sweep_young(self) -> None:
        batch = self.young[:_BATCH]
        del self.young[:_BATCH]
        self._drop_dead(batch)
        if len(self.index) > 2 * self._mark + 1024:
            self.sweep()

    def _drop_dead(self, addresses: Iterable[int]) -> None:
        index = self.index
        expired, free = weak_ref_expired, free_weak_ref
        for address in addresses:
            entry = index.get(address)
            if entry is not None and expired(entry[0]):
                del index[address]
                free(entry[0])

    def sweep(self) -> None:
        """Release the weak handles of every dead storage."""
        self._drop_dead(list(self.index))
        self.young = [a for a in self.young if a in self.index]
        self._mark = len(self.index)

    def find(self, address: int) -> int | None:
        """The site id of the live storage at `address` (`_BEFORE`: before the trace), else
        None. Exact: a held weak handle keeps that address from being reused."""
        entry = self.index.get(address)
        return None if entry is None else entry[1]

    def release(self) -> None:
        free = free_weak_ref
        index, self.index = self.index, {}
        for handle, _ in index.values():
            free(handle)
        self.young = []

    def __len__(self) -> int:
        return len(self.index)

    def __del__(self):
        try:
            self.release()
        except Exception:  # interpreter shutdown: torch may already be gone
            pass


class ProvenanceMode(TorchDispatchMode):
    """Runs each op and hands its outputs to `Provenance.note`; `paused`: pass through."""

    def __init__(self, provenance: "Provenance"):
        super().__init__()
        self.provenance = provenance
        self.paused = False

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        """Observe, never alter (Note [provenance]; RecordingMode.ignore_compile_internals)."""
        return True

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if kwargs is None:
            kwargs = {}
        out = func(*args, **kwargs)
        if not self.paused:
            if CLOCK is not None:  # Note [self clock] in graphtrace/clock.py
                CLOCK.enter("provenance: dispatch mode (note)")
            try:
                self.provenance.note(func, args, kwargs, out)
            except Exception as exc:  # fail open: never break the traced program
                self.provenance.fail("provenance", exc)
            lineage = self.provenance.lineage
            if lineage is not None:  # the same mode records lineage (Note [lineage])
                if CLOCK is not None:
                    CLOCK.leave()
                    CLOCK.enter("lineage: dispatch mode (record)")
                try:
                    lineage.record(func, args, kwargs, out)
                except Exception as exc:
                    self.provenance.fail("lineage", exc)
            if CLOCK is not None:
                CLOCK.leave()
        return out


class Provenance:
    """The provenance of one trace: its table, its mode on the tracing thread, and the site
    of each captured storage (`captured`: recorder storage id -> site id)."""

    def __init__(self, fail: Callable[[str, BaseException], None], depth: int = DEPTH):
        self.fail = fail
        self.depth = depth
        self.table = ProvenanceTable()
        self.mode = ProvenanceMode(self)
        self.lineage = None  # a graphtrace.lineage.Lineage when the trace records lineage
        self.handle_mode = None  # lineage's TorchFunctionMode (Note [handle mode])
        self._optimizer_hooks: list = []  # lineage's (Note [non-idempotent steps])
        self.captured: dict[int, int] = {}
        self.thread: int | None = None
        self._matched = 0
        self._skip: dict[str, bool] = {}
        self._op_names: dict = {}
        self._lock = threading.Lock()
        self.n_census = 0
        self._suspended: str | None = None  # what `suspend` did, for `unsuspend`
        self.n_suspends = 0

    # -- lifecycle (graphtrace.tracing calls these) ----------------------------------------
    def start(self, models: Mapping[str, torch.nn.Module]) -> None:
        """Note the watched models' storages as `before trace`, then push the mode on this
        thread."""
        from graphtrace.owners import walk_owners

        if not PROVENANCE:  # asked for explicitly on a torch without it: say why
            raise TorchIncompatible(PROVENANCE_OFF)
        for model in models.values():
            with warnings.catch_warnings():  # what the walk cuts is reported by the owner walk
                warnings.simplefilter("ignore", RuntimeWarning)
                walked = list(walk_owners(model))
            for _, _, tensor in walked:
                for storage in _storages(tensor):
                    self.table.add(storage, _BEFORE)
                    self.n_census += 1
            del walked
        self.thread = threading.get_ident()
        self.mode.__enter__()
        if self.lineage is not None:  # Note [handle mode] in graphtrace/lineage/handles.py
            from graphtrace.lineage import optimizer_hooks

            self.lineage.site = weakref.WeakMethod(self.site_text)
            self._optimizer_hooks = optimizer_hooks(self.lineage)
            self._push_handle_mode()
            if self.handle_mode is None:  # look again later (Note [handle mode])
                self.lineage.want_handle_mode = weakref.WeakMethod(self._push_handle_mode)

    def stop(self) -> None:
        """Take the mode off this thread's dispatch stack (wherever it sits) and sweep."""
        if self.thread is None:
            return
        if self.thread != threading.get_ident():  # cannot reach another thread's stack
            self.mode.paused = True
            self.fail("provenance", RuntimeError(
                "the trace was closed on another thread than it was opened on: provenance "
                "stays paused on the opening thread"))
        else:
            # a suspended mode goes back on the stack first, so that it leaves through its
            # __exit__ (which restores torch's mode flags; popped alone, it would not)
            self.unsuspend()
            stack = current_dispatch_mode_stack()
            if self.mode in stack:
                above = [pop_mode() for _ in range(len(stack) - 1 - stack.index(self.mode))]
                self.mode.__exit__(None, None, None)
                for mode in reversed(above):
                    push_mode(mode)
            self.mode.paused = True
            self._pop_handle_mode()
        for hook in self._optimizer_hooks:
            hook.remove()
        self._optimizer_hooks = []
        self.thread = None
        self._suspended = None
        self.table.sweep()
        if self.lineage is not None:
            self.lineage.sweep()

    def site_text(self, func) -> str:
        """The text of the user code's call site of `func` now (for lineage's records)."""
        return self.text(self._site(func))

    def _noting(self) -> bool:
        """Is provenance's mode running on this thread (pushed, not paused)? For lineage's
        handle mode, which must not note inside a capture region."""
        if self.mode.paused or self.thread != threading.get_ident():
            return False
        return self.mode in current_dispatch_mode_stack()

    def _push_handle_mode(self) -> None:
        from graphtrace.lineage import handle_mode

        if self.handle_mode is not None or self.thread != threading.get_ident():
            return
        self.handle_mode = handle_mode(self.lineage, weakref.WeakMethod(self._noting))
        if self.handle_mode is not None:
            self.handle_mode.__enter__()

    def _pop_handle_mode(self) -> None:
        from graphtrace._compat import function_stack_at, function_stack_len

        mode, self.handle_mode = self.handle_mode, None
        if mode is None:
            return
        n = function_stack_len()
        if n and function_stack_at(n - 1) is mode:
            mode.__exit__(None, None, None)
        else:  # another function mode sits above it: leave it there, switched off
            mode.lineage_off = True

    def pause(self) -> str | None:
        """Before a capture region opens on this thread: take the mode off (it must not run
        under the capture). Returns what `resume` undoes."""
        if self.thread != threading.get_ident():
            return None
        top = dispatch_stack_len() - 1
        if top >= 0 and dispatch_stack_at(top) is self.mode:
            pop_mode()
            return "popped"
        if not self.mode.paused:
            self.mode.paused = True
            return "flag"
        return None

    def resume(self, token: str | None) -> None:
        if token == "popped":
            push_mode(self.mode)
        elif token == "flag":
            self.mode.paused = False

    @property
    def suspended(self) -> bool:
        return self._suspended is not None

    def suspend(self) -> None:
        """Stop noting until `unsuspend` (Trace.pause_provenance; Note [provenance]), as
        `pause` does. Idempotent."""
        if self._suspended is None and self.thread == threading.get_ident():
            self._suspended = self.pause() or "none"
            self.n_suspends += 1

    def unsuspend(self) -> None:
        if self._suspended is not None and self.thread == threading.get_ident():
            token, self._suspended = self._suspended, None
            self.resume(token)

    # -- recording ---------------------------------------------------------------------------
    def note(self, func, args, kwargs, out) -> None:
        """Note the storages `func` created (Note [provenance])."""
        index = self.table.index
        tp = type(out)
        if tp is torch.Tensor or tp is torch.nn.Parameter:
            storage = out.untyped_storage()
            if storage._cdata in index:
                return
            new = [storage]
        else:
            new = []
            for storage in _storages(out):
                address = storage._cdata
                if address not in index and all(s._cdata != address for s in new):
                    new.append(storage)
            if not new:
                return
        if func not in _LIFTS:
            inputs = {s._cdata for s in _storages((args, kwargs))}
            new = [s for s in new if s._cdata not in inputs]
            if not new:
                return
        site = self._site(func)
        for storage in new:
            self.table.add(storage, site)

    def _site(self, func) -> int:
        frames = []
        skip = self._skip
        f = sys._getframe(1)
        walked = 0
        while f is not None and len(frames) < self.depth and walked < _MAX_WALK:
            code = f.f_code
            skipped = skip.get(code.co_filename)
            if skipped is None:
                skipped = skip[code.co_filename] = skipped_file(code.co_filename)
            if not skipped and code.co_name not in _MODE_METHODS:
                frames.append((code.co_filename, f.f_lineno, code.co_name))
            f = f.f_back
            walked += 1
        name = self._op_names.get(func)
        if name is None:
            name = self._op_names[func] = _op_name(func)
        return self.table.site_id((name, tuple(frames)))

    # -- reading -----------------------------------------------------------------------------
    def match(self, storages) -> None:
        """Read the site of each storage `storages` (the recorder's StorageTable) registered
        since the last call, while it is alive (after each capture)."""
        with self._lock:
            new = storages.registered_since(self._matched)
            index = self.table.index
            for sid, handle in new.matching(index):  # storages made outside any capture
                self.captured[sid] = index[handle][1]
            self._matched = new.end

    def text(self, site: int | None) -> str:
        """A site id as report text: the site, `before trace`, or `not recorded` (None)."""
        if site is None:
            return NOT_RECORDED
        if site == _BEFORE:
            return BEFORE_TRACE
        op, frames = self.table.sites[site]
        return format_site(op, frames)

    def site_of(self, tensor: torch.Tensor | None) -> int | None:
        """The site id of the storage `tensor` uses now, None when not recorded."""
        if tensor is None:
            return None
        try:
            return self.table.find(tensor.untyped_storage()._cdata)
        except Exception:  # storage-less tensors
            return None

    def meta(self) -> dict:
        return {"enabled": True, "depth": self.depth, "storages_noted": self.table.n_added,
                "census": self.n_census, "sites": len(self.table.sites),
                "live_entries": len(self.table), "suspends": self.n_suspends,
                "lineage": (self.lineage.meta() if self.lineage is not None
                            else {"enabled": False})}


def _op_name(func) -> str:
    try:
        name = func.name()  # "aten::_to_copy", "aten::sort.stable"
    except Exception:
        name = str(func)
    return name.replace(".default", "")


def edge_columns(provenance: Provenance | None, storages, sids: np.ndarray, verdict,
                 owners: pd.DataFrame, moved_to: Mapping[int, torch.Tensor],
                 stack: Stack | None = None) -> dict:
    """`created_at`, `live_created_at` and `fix` for each edge (storage ids `sids`, verdicts
    `verdict`), from the owners frame of the diff and the live tensor each moved storage's
    owner holds now (`moved_to`). Owned edges only; "" elsewhere, and everywhere when
    provenance is off (`fix` is still given, its text for `stack`: graphtrace.fixes)."""
    import pandas as pd

    n = len(sids)
    owned = np.unique(owners["storage_id"].to_numpy(dtype=np.int64)) if len(owners) else \
        np.empty(0, np.int64)
    owned_list = owned.tolist()
    # a storage's verdict is the same on each of its edges: read one edge per owned storage
    sids = np.asarray(sids)
    if n and len(owned):
        edge_of = np.full(int(max(sids.max(), owned.max())) + 1, -1, dtype=np.int64)
        edge_of[sids] = np.arange(n)
        picked = edge_of[owned]
        verdict = pd.Categorical(verdict)
        names = np.append(np.asarray(verdict.categories, dtype=object), "")
        of_owned = names[np.where(picked >= 0, np.asarray(verdict.codes)[picked], -1)].tolist()
    else:
        of_owned = [""] * len(owned_list)
    # only stale-like storages get a fix or a live site: their owner rows alone are read
    stale_like = {sid for sid, v in zip(owned_list, of_owned) if v in STALE_VERDICTS}
    rows: dict[int, list] = {}
    if stale_like:
        few = owners[owners["storage_id"].isin(list(stale_like))]
        for r in few.itertuples(index=False):
            rows.setdefault(int(r.storage_id), []).append((str(r.path), str(r.kind),
                                                           str(r.status)))
    if provenance is not None:
        provenance.match(storages)  # storages registered since the last capture ended
        texts: dict = {}  # site id -> text: many storages share a site

        def text(site):
            found = texts.get(site)
            if found is None:
                found = texts[site] = provenance.text(site)
            return found

        captured = provenance.captured
        created = [text(captured.get(sid)) for sid in owned_list]
        live = [text(provenance.site_of(moved_to.get(sid)))
                if sid in stale_like and sid in moved_to else "" for sid in owned_list]
    else:
        created = [""] * len(owned_list)
        live = [""] * len(owned_list)
    fixes = []
    for sid, v in zip(owned_list, of_owned):
        key = suggest_fix(v, rows.get(sid, ())) if sid in stale_like else ""
        fixes.append(fix_text(key, stack))
    at = np.searchsorted(owned, sids) if len(owned) else np.zeros(n, dtype=np.int64)
    hit = (at < len(owned)) & (owned[np.minimum(at, max(len(owned) - 1, 0))] == sids) \
        if len(owned) else np.zeros(n, dtype=bool)

    def column(values: list) -> pd.Categorical:
        cats = pd.Categorical(values + [""])
        codes = np.where(hit, cats.codes[np.minimum(at, len(values))], cats.codes[-1])
        return pd.Categorical.from_codes(codes, cats.categories)

    return {"created_at": column(created), "live_created_at": column(live),
            "fix": column(fixes)}
