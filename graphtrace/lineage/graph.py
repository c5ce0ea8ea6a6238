"""`Lineage`, the storage-level dataflow graph provenance's dispatch mode
(graphtrace.provenance.ProvenanceMode: one mode, not a second) feeds through `record`, and
`match`, which gives each captured storage its `Derived` baselines (Note [lineage]).
"""

from __future__ import annotations

from typing import Callable, Mapping, NamedTuple

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from graphtrace._compat import free_weak_ref, storage_weak_ref, weak_ref_expired
from graphtrace._schema import tensors_in
from graphtrace.lineage.handles import DanglingSources, invisible_handle_ops
from graphtrace.lineage.ops import _OPS, _PLAIN, _op, _walk
from graphtrace.lineage.steps import CarriedOver, NonIdempotent

__all__ = ["ENV", "enabled_by_default", "Lineage", "Source", "Derived", "MAX_EDGES",
           "MAX_SOURCES", "SOURCE_KINDS", "HOOKS", "optimizer_hooks"]

# Note [lineage]
# ~~~~~~~~~~~~~~
# What: per op seen by provenance's mode (trace open, outside capture regions, the tracing
# thread), the storages it *wrote* -- each output whose storage is none of its inputs' (a
# fresh value), and each argument its schema marks written (`Tensor(a!)`: in-place targets
# and `out=` buffers, the alias_info graphtrace._schema.op_info reads) -- and the storages it
# *read* (every other tensor argument). A written storage W gets the sources
#     sources(W) = union over reads r of ({r: clock(r)} | sources(r))
# i.e. the transitive closure is taken at write time, so a chain `cache = -exp(A_log)` keeps
# A_log as a source of `cache` after the intermediate `exp(A_log)` is gone. `clock(s)` is
# the lineage write clock of s's last recorded write (a counter bumped per written storage:
# a storage-level version, unlike `Tensor._version`, which `.data` and `set_` tensors do not
# share). A full overwrite (copy_/fill_/zero_ or an `out=` buffer covering the whole
# storage) replaces W's sources; any other write (`mul_`, a copy into a slice) adds to them,
# since W's old value (or the rest of it) is still part of the new one. W is never its own
# source. A source seen through several paths keeps its oldest clock.
#
# Identity: a storage is its StorageImpl address held by one weak handle (`_weak_ref`, as
# ProvenanceTable does; nothing is kept alive); a node is dropped, and its address purged
# from every record, when its storage dies (a full sweep whenever nodes + edges doubled
# since the last one), so a reused address never inherits a dead storage's lineage.
#
# Bounds: at most MAX_SOURCES sources per written storage (the rest are dropped and
# counted: `truncated`) and MAX_EDGES source entries in all; when the cap is hit even after
# a sweep, lineage stops recording (counted: `ops_skipped`) and the diff names it as a
# `lineage` blind spot. Freshness then falls back to what the sources' owner paths say
# (identity and version counters, as the guard checks).
#
# Matching: after each capture, each newly captured storage with sources gets a `Derived`:
# its sources that a watched model's owner walk reaches as a parameter or buffer (their
# model, path, kind, a weak handle, the write clock recorded for them and their owner
# tensor's `_version` now), its own owners' `_version`s now, and `stale`: a source was
# written after it (lineage saw it) before the capture. The verdict engine
# (graphtrace.verdict.unrefreshed) compares those baselines with the live model later;
# the diff and the guard both ask it. What lineage cannot see: ops on other threads, code
# that bypasses the dispatcher (a C++ extension reading a raw pointer, torch.load), writes
# made while provenance is paused or off, and anything inside a capture region (a graph
# that rewrites a storage every replay is `internal`: Note [write before read]).

# Note [engine state]
# ~~~~~~~~~~~~~~~~~~~~
# An engine's KV cache and its attention kernels' scratch buffers are written by the model's
# forward (prefill writes the keys and values it computed from the weights), so lineage gives
# them the weights as sources. They are request state, not a value derived once: every
# request writes the slots it reads before reading them, and engines drop the cache's
# contents after a weight update (SGLang's flush after update_weights_*). Where a graph's op
# both writes and reads such a buffer (a custom attention op taking the cache as `Tensor(a!)`:
# graphtrace records its reads first), the capture reads it as an input, and freshness would
# call it `unrefreshed` after every update. An adapter names such buffers
# (`Trace.declare_state`) before the capture: `Lineage.forget` records a full write with no
# sources, so no `Derived` is matched to them; identity (owners, freed storages) is still
# checked. Only what the adapter names is forgotten: a derived cache an engine keeps across
# updates must not be declared state.

# Note [derived during updates]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# Matching after a capture names the sources a captured storage had *then*. A storage the
# graph captured made from no weight (a scale a kernel method keeps, set up when the test or
# the engine built it) may first be written from a weight during a later weight update: an
# RL client's per-tensor sync (TRL's `sync_weights`, OpenRLHF's `update_weight`) calls a
# weight loader that refreshes it in place from the weight it just loaded. Lineage records
# that write (it records during updates), but no `Derived` existed to judge it, so a later
# update that loads a new weight and leaves the storage alone went unseen: the graph reads
# the old value at the same address, identity holds. So the trace matches again, late
# (`match_late`, through `catch_up`, before each diff, guard build and guard check, and only
# when lineage's clock moved since the last time): every captured storage that has no
# `Derived` yet and that lineage saw written since from a registered parameter or buffer (the
# cached walk of them; a write from a checkpoint tensor alone, a load, is passed over) gets
# one, taken as at a capture's match (sources and their clocks from the write, the owners'
# version counters now, `stale` when a source was written after it). The freshness rule then
# judges it like any derived storage (Note [freshness] in graphtrace/verdict.py): the next
# update that writes the source and not the storage makes it `unrefreshed`, `derived_from`
# naming the source. Cost: a set intersection of the captured storages with lineage's nodes
# per clock move, and an owner walk only when a storage is matched. What it cannot see: a
# storage captured with no owner that becomes derived later (the guard keeps only the
# storages that were owned or derived when it was built).

# Note [lineage plug-ins]
# ~~~~~~~~~~~~~~~~~~~~~~~
# The graph records dataflow; what it finds beyond freshness is done by plug-ins it feeds as
# it records, as torch's DebugMode adds its features as hooks: `DanglingSources`
# (graphtrace/lineage/handles.py), `NonIdempotent` and `CarriedOver` (graphtrace/lineage/
# steps.py), registered in that order (the order of their findings). A plug-in is any
# object with some of the hooks in `HOOKS`; each gets the graph as its first argument (a
# plug-in keeps no reference to it: no cycle) and is called only where its hook is defined:
# - `written(graph, func, op, written, reads)`: an op outside optimizer steps wrote
#   `written` ((tensor, an out= argument?)) having read `reads` (address -> storage);
# - `read(graph, func, reads, sources)`: an op read `reads`, whose sources with theirs are
#   `sources` (address -> clock);
# - `handle(graph, func, kind, reads, sources, out)`: an op that makes a handle ("int" or
#   "object": ops.py's `_returns_handle`) ran; the graph records nothing else of it;
# - `record_handle(graph, func, kind, args, kwargs, out)`: such an op seen by the function
#   mode instead (Note [handle mode]); `lift(graph, out)`: `aten::lift_fresh` made `out`;
# - `wrote(graph, storage, address, sources)`: the graph wrote a storage for an op;
# - `handle_at(address)`: a handle whose named sources join its `Derived` at matching;
# - `findings(graph, models)`: its rows for `Lineage.findings` (graphtrace.vocab
#   FINDING_FIELDS); `forget(address)`: a storage died (the sweep); `release()`.
# Hooks are looked up once, when the plug-in is added (`Lineage.add`), so the per-op path
# costs a loop over the few plug-ins that have that hook.

HOOKS = ("written", "read", "handle", "record_handle", "lift", "wrote", "handle_at",
         "findings", "forget", "release")

ENV = "GRAPHTRACE_LINEAGE"
MAX_EDGES = 1_000_000   # source entries kept in all (see Note [lineage])
MAX_SOURCES = 64        # sources kept per written storage
SOURCE_KINDS = ("parameter", "buffer")  # owner kinds `derived_from` names


def enabled_by_default() -> bool:
    """GRAPHTRACE_LINEAGE: on unless "0", "off", "false" or "no" (needs provenance)."""
    import os

    value = os.environ.get(ENV, "").strip().lower()
    if value in ("", "1", "on", "true", "yes"):
        return True
    if value in ("0", "off", "false", "no"):
        return False
    raise ValueError(f"{ENV}={value!r}: use 1 or 0")


class Source(NamedTuple):
    """One registered parameter or buffer a captured storage was derived from."""

    model: str
    path: str
    kind: str
    ref: StorageWeakRef | None    # the source storage when it was matched (exact identity)
    data_ptr: int                 # ... and its address and size (a guard read from JSON)
    nbytes: int
    version: int | None           # its owner tensor's `_version` when matched
    clock: int                    # its lineage clock when matched (0: never written)


class Derived(NamedTuple):
    """What freshness needs of one captured storage (Note [lineage])."""

    sources: tuple[Source, ...]
    owner_versions: dict          # (model, path) -> the captured storage's owner's `_version`
    stale: bool                   # a source was rewritten after it, before the capture
    clock: int                    # its own lineage clock when matched
    handle: bool = False          # a handle (Note [dangling sources]): a freed source dangles

    @property
    def derived_from(self) -> str:
        """The `derived_from` text: the sources' paths, sorted, unique, '; '-joined."""
        return "; ".join(sorted({(f"{s.model}:" if s.model else "") + s.path
                                 for s in self.sources}))

    def marked(self, freed) -> str:
        """`derived_from` with each source of `freed` marked ` (freed)`."""
        names = {(f"{s.model}:" if s.model else "") + s.path for s in freed}
        return "; ".join(p + " (freed)" if p in names else p
                         for p in self.derived_from.split("; "))


class Lineage:
    """The storage-level dataflow graph of one trace (Note [lineage])."""

    def __init__(self, fail: Callable[[str, BaseException], None] | None = None, *,
                 max_edges: int | None = None, max_sources: int | None = None):
        self.fail = fail
        self.max_edges = MAX_EDGES if max_edges is None else max_edges
        self.max_sources = MAX_SOURCES if max_sources is None else max_sources
        # address -> [weak handle, clock of its last recorded write, {source address: clock}]
        self.nodes: dict[int, list] = {}
        self.clock = 0
        self.n_edges = 0
        self.n_ops = 0            # ops that wrote something, recorded
        self.ops_skipped = 0      # ops not recorded because the cap was hit
        self.truncated = 0        # written storages whose sources were cut at max_sources
        self._mark = 0
        self.captured: dict[int, Derived] = {}   # recorder storage id -> Derived
        self._matched = 0
        self.models: Callable[[], Mapping[str, torch.nn.Module]] | None = None  # watched
        self.optimizer_steps = 0  # > 0 inside torch.optim's step (not a process step)
        self.site: Callable | None = None  # func -> its call site's text (provenance's)
        # Note [handle mode]: called (a weak method) when handle ops appear after the start
        self.want_handle_mode: Callable | None = None
        self._tick = 0
        self._looked = (-1, 0)  # (composite registrations, len(sys.modules)) at the last look
        self._registered: dict[int, list] | None = None  # address -> [(model, path, kind, ref)]
        self._geometry: dict[int, tuple[int, int]] = {}  # address -> (data_ptr, nbytes)
        # Note [derived during updates]: the trace's late match (a weak callable), lineage's
        # clock at its last run, and how many `Derived` it made in all
        self.rematch: Callable[[], None] | None = None
        self._late_clock = 0
        self.late = 0
        # Note [lineage plug-ins]: the plug-ins, and per hook the bound hooks that have it
        self.detectors: list = []
        self._hooks: dict[str, list] = {hook: [] for hook in HOOKS}
        for detector in (DanglingSources(), NonIdempotent(), CarriedOver()):
            self.add(detector)

    def add(self, detector) -> None:
        """Register a plug-in: the hooks of `HOOKS` it has are called from now on (Note
        [lineage plug-ins])."""
        self.detectors.append(detector)
        for hook in HOOKS:
            found = getattr(detector, hook, None)
            if found is not None:
                self._hooks[hook].append(found)

    def findings(self, models: Mapping[str, torch.nn.Module]) -> list[dict]:
        """What the plug-ins found beside the edges, in their order (`Report.findings`)."""
        return [row for hook in self._hooks["findings"] for row in hook(self, models)]

    # -- recording (the per-op hook) -----------------------------------------------------
    def _node(self, storage: torch.UntypedStorage, address: int) -> list:
        node = self.nodes.get(address)
        if node is None:
            node = self.nodes[address] = [storage_weak_ref(storage), 0, None]
        return node

    def write(self, storage: torch.UntypedStorage, sources: dict, full: bool) -> int:
        """`storage` is written now from `sources` (address -> clock), as Note [lineage] says
        (`full`: a write of the whole storage; the oldest `max_sources` kept). Every write goes
        through here: ops, declared copies, handles, derived constants. Returns its address."""
        a = storage._cdata
        node = self.nodes.get(a)
        if node is None:
            node = self._node(storage, a)
        self.clock += 1
        node[1] = self.clock
        old = node[2]
        if full or not old:
            new = dict(sources)
        else:
            new = dict(old)
            for b, c in sources.items():
                if b not in new or c < new[b]:
                    new[b] = c
        new.pop(a, None)
        if len(new) > self.max_sources:
            self.truncated += 1
            new = dict(sorted(new.items(), key=lambda kv: kv[1])[:self.max_sources])
        self.n_edges += len(new) - (len(old) if old else 0)
        node[2] = new or None
        return a

    def record(self, func, args, kwargs, out) -> None:
        """Note what `func` wrote from what it read (called by provenance's mode)."""
        self._tick += 1
        if not self._tick & 255 and self.want_handle_mode is not None:
            self._look_for_handle_ops()
        op = _OPS.get(func)
        if op is None:
            op = _op(func)
        hooks = self._hooks
        if op.lift:
            for hook in hooks["lift"]:
                hook(self, out)
            return
        if not op.writes and not op.fresh:
            return
        reads: dict[int, torch.UntypedStorage] = {}
        written: list = []  # (tensor, an out= argument?)
        positional = op.positional
        n = len(positional)
        for i, a in enumerate(args):
            if i >= n:
                break
            w = positional[i]
            if w is None:
                continue
            if type(a) in _PLAIN:  # the common case: one plain tensor
                if w:
                    written.append((a, False))
                else:
                    try:
                        s = a.untyped_storage()
                    except NotImplementedError:  # storage-less (an mkldnn-packed weight): as _walk
                        continue
                    reads[s._cdata] = s
                continue
            _walk(a, w, False, written, reads)
        if kwargs:
            for name, a in kwargs.items():
                w = op.by_keyword.get(name)
                if w is not None:
                    _walk(a, w, True, written, reads)
        if written and self.optimizer_steps == 0:  # Note [non-idempotent steps]
            for hook in hooks["written"]:
                hook(self, func, op, written, reads)
        nodes = self.nodes
        sources = self.sources_of(reads)
        if reads:  # Note [carried-over state]: a read ends a load cycle
            for hook in hooks["read"]:
                hook(self, func, reads, sources)
        if op.handle and reads:  # Note [dangling sources]
            for hook in hooks["handle"]:
                hook(self, func, op.handle, reads, sources, out)
            return
        targets: list = []  # (storage, replace its sources?)
        seen: set = set()
        for t, is_out in written:
            try:
                s = t.untyped_storage()
            except Exception:
                continue
            a = s._cdata
            if a in seen:
                continue
            seen.add(a)
            if not sources and a not in nodes:
                continue  # nothing recorded flows into a storage lineage does not know
            full = (is_out or op.overwrites) and t.storage_offset() == 0 and \
                t.numel() * t.element_size() >= s.nbytes() and t.is_contiguous()
            targets.append((s, full))
        if op.fresh and sources:  # a fresh value made from nothing recorded needs no node
            if type(out) in _PLAIN:
                s = out.untyped_storage()
                a = s._cdata
                if a not in seen and a not in reads:
                    targets.append((s, True))
            else:
                for t in tensors_in(out if isinstance(out, (list, tuple)) else (out,)):
                    try:
                        s = t.untyped_storage()
                    except Exception:
                        continue
                    a = s._cdata
                    if a in seen or a in reads:
                        continue
                    seen.add(a)
                    targets.append((s, True))
        if not targets:
            return
        if self.n_edges >= self.max_edges:
            self.sweep()
            if self.n_edges >= self.max_edges:
                self.ops_skipped += 1
                return
        self.n_ops += 1
        wrote = hooks["wrote"]
        for s, full in targets:
            a = self.write(s, sources, full)
            for hook in wrote:
                hook(self, s, a, sources)
        if len(nodes) + self.n_edges > 2 * self._mark + 4096:
            self.sweep()

    def sources_of(self, reads: dict) -> dict[int, int]:
        """The sources of what an op read: each read storage and its own sources (the oldest
        clock of a source seen twice)."""
        nodes = self.nodes
        sources: dict[int, int] = {}
        for a, s in reads.items():
            node = nodes.get(a)
            if node is None:
                node = self._node(s, a)
            src = node[2]
            if src:
                if sources:
                    for b, cb in src.items():
                        if b not in sources or cb < sources[b]:
                            sources[b] = cb
                else:
                    sources = dict(src)
            c = node[1]
            if a not in sources or c < sources[a]:
                sources[a] = c
        return sources

    def _look_for_handle_ops(self) -> None:
        """Note [handle mode]: the look every 256 ops, after new imports only (a count of
        composite kernels, ~0.4 ms)."""
        import sys

        from graphtrace._compat import HANDLE_OPS, registrations_for

        n = len(sys.modules)
        if n == self._looked[1] or not HANDLE_OPS:
            return
        composite = len(registrations_for("CompositeImplicitAutograd"))
        seen, self._looked = self._looked[0], (composite, n)
        if composite == seen:
            return
        if invisible_handle_ops():
            want = self.want_handle_mode()
            self.want_handle_mode = None
            if want is not None:
                want()

    @staticmethod
    def holders(addresses: set, models: Mapping[str, torch.nn.Module]) -> dict[int, list[str]]:
        """Address -> the owner paths (any kind) that reach the storage there now."""
        import warnings

        from graphtrace.opaque import storage_of
        from graphtrace.owners import walk_owners

        holders: dict[int, list[str]] = {}
        for name, model in models.items():
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", RuntimeWarning)
                for path, _kind, t in walk_owners(model):
                    try:
                        a = storage_of(t)._cdata
                    except Exception:
                        continue
                    if a in addresses:
                        holders.setdefault(a, []).append((f"{name}:" if name else "") + path)
        return holders

    def record_handle(self, func, kind: str, args, kwargs, out) -> None:
        """A handle op the dispatch mode does not see (`HandleMode`, Note [handle mode]):
        handed to the plug-ins that take handles."""
        for hook in self._hooks["record_handle"]:
            hook(self, func, kind, args, kwargs, out)

    def declare(self, copy, source) -> None:
        """Declared lineage (`Trace.watch_copy`): the storage of `copy` (a tensor or an
        opaque handle) is derived from that of `source` as of now."""
        from graphtrace.opaque import storage_of

        if copy is None or not isinstance(source, torch.Tensor):
            return
        src = source.untyped_storage()
        self.write(storage_of(copy), self.sources_of({src._cdata: src}), full=False)

    def registered_tensors(self, refresh: bool) -> dict[int, list]:
        """Address -> [(model, path, kind, StorageWeakRef)] of the watched models'
        registered parameters and buffers (cached; `refresh`: walk again)."""
        if self._registered is None or refresh:
            self._geometry: dict[int, tuple[int, int]] = {}  # address -> (data_ptr, nbytes)
            found: dict[int, list] = {}
            refs: dict[int, StorageWeakRef] = {}
            models = self.models() if self.models is not None else {}
            for name, model in models.items():
                for kind, named in (("parameter", model.named_parameters),
                                    ("buffer", model.named_buffers)):
                    for path, t in named(remove_duplicate=False):
                        try:
                            st = t.untyped_storage()
                        except Exception:
                            continue
                        a = st._cdata
                        if a not in refs:
                            refs[a] = StorageWeakRef(st)
                            self._geometry[a] = (st.data_ptr(), st.nbytes())
                        found.setdefault(a, []).append((name, path, kind, refs[a]))
            self._registered = found
        return self._registered

    def named(self, sources: dict, direct) -> tuple:
        """The registered parameters and buffers among `sources` (addresses), with weak
        handles to their storages; the cached walk is redone once when one of the `direct`
        reads is not in it (a parameter registered since, a reload's temporary)."""
        def hit(registered, a):
            entries = registered.get(a)
            return entries is not None and not entries[0][3].expired()

        registered = self.registered_tensors(False)
        if not all(hit(registered, a) for a in direct):
            registered = self.registered_tensors(True)
        named = [entry + self._geometry[a] for a in sources if hit(registered, a)
                 for entry in registered[a]]
        return tuple(sorted(named, key=lambda n: (n[0], n[1])))


    def derive(self, target: torch.UntypedStorage,
               sources: "list[torch.UntypedStorage]") -> None:
        """Note that `target` was made from `sources` by code the dispatch mode does not see
        (a constant Inductor folded or prepacked at compile time from parameters: Note
        [frozen constants] in graphtrace/compiled.py): a full write of `target` whose
        sources are `sources` and theirs, as `record` would note it."""
        merged = self.sources_of({s._cdata: s for s in sources})
        merged.pop(target._cdata, None)
        if merged:
            self.write(target, merged, full=True)

    def forget(self, storage: torch.UntypedStorage) -> bool:
        """Note [engine state]: a full write of `storage` with no sources; whether lineage
        knew it."""
        if storage._cdata not in self.nodes:
            return False
        self.write(storage, {}, full=True)
        return True

    # -- memory ------------------------------------------------------------------------------
    def sweep(self) -> None:
        """Drop the nodes of dead storages and purge their addresses from every record."""
        expired, free = weak_ref_expired, free_weak_ref
        nodes = self.nodes
        dead = [a for a, node in nodes.items() if expired(node[0])]
        for a in dead:
            node = nodes.pop(a)
            for hook in self._hooks["forget"]:
                hook(a)
            free(node[0])
            if node[2]:
                self.n_edges -= len(node[2])
        if dead:
            gone = set(dead)
            for node in nodes.values():
                src = node[2]
                if src and not gone.isdisjoint(src):
                    kept = {b: c for b, c in src.items() if b not in gone}
                    self.n_edges -= len(src) - len(kept)
                    node[2] = kept or None
        self._mark = len(nodes) + self.n_edges

    def release(self) -> None:
        free = free_weak_ref
        nodes, self.nodes = self.nodes, {}
        for node in nodes.values():
            free(node[0])
        self.n_edges = 0
        self._registered = None
        for hook in self._hooks["release"]:
            hook()

    def __del__(self):
        try:
            self.release()
        except Exception:  # interpreter shutdown
            pass

    def __len__(self) -> int:
        return len(self.nodes)

    def clock_of(self, address: int) -> int:
        """The lineage clock of the live storage at `address` (0: no recorded write)."""
        node = self.nodes.get(address)
        return 0 if node is None or weak_ref_expired(node[0]) else node[1]

    def stale_since(self, address: int, derived: Derived) -> bool | None:
        """None when lineage saw no write to the storage at `address` since `derived` was
        matched; else whether one of its sources was written after its latest write."""
        node = self.nodes.get(address)
        if node is None or node[1] <= derived.clock or weak_ref_expired(node[0]):
            return None
        record = node[2] or {}
        for s in derived.sources:
            if s.ref is not None and s.ref.cdata in record and \
                    self.clock_of(s.ref.cdata) > record[s.ref.cdata]:
                return True
        return False

    # -- matching (after each capture) -------------------------------------------------------
    def match(self, storages, snapshot, models: Mapping[str, torch.nn.Module]) -> None:
        """A `Derived` for each storage `storages` (the recorder's StorageTable) registered
        since the last call that has recorded sources reaching a parameter or buffer of
        `models` (through `snapshot`'s cached owner walks, graphtrace.owners)."""

        self._registered = None  # walked again when next needed (Note [non-idempotent steps])
        new = storages.registered_since(self._matched)
        self._matched = new.end
        nodes = self.nodes
        found = []  # O(storages registered), not O(nodes)
        for a in new.handle_set:
            node = nodes.get(a)
            if node is not None and node[2]:
                sid = storages.find(a)
                if sid is not None and new.first <= sid < new.end:
                    found.append((sid, a))
        found.sort()
        if found:
            self._match_found(found, snapshot, models)

    def _match_found(self, found: list, snapshot, models: Mapping[str, torch.nn.Module]) -> int:
        """A `Derived` for each (storage id, address) of `found` whose recorded sources reach a
        parameter or buffer of `models`; returns how many were made."""
        from graphtrace.owners import resolve_path

        made = 0
        walks = {}
        for name, model in models.items():
            try:
                walks[name] = snapshot.owners_by_storage(name, model)
            except Exception as exc:
                if self.fail is not None:
                    self.fail("lineage match", exc)
        tensors: dict[tuple[str, str], object] = {}

        def tensor(model: str, path: str):
            key = (model, path)
            if key not in tensors:
                try:
                    tensors[key] = resolve_path(models[model], path)
                except Exception:
                    tensors[key] = None
            return tensors[key]

        nodes = self.nodes
        for sid, address in found:
            node = nodes[address]
            sources, stale = [], False
            for src, clock in node[2].items():
                hit = False
                for name, by_storage in walks.items():
                    for path, kind in by_storage.get(src, ()):
                        if kind not in SOURCE_KINDS:
                            continue
                        t = tensor(name, path)
                        try:
                            st = t.untyped_storage()
                        except Exception:
                            continue
                        if st._cdata != src:
                            continue
                        hit = True
                        sources.append(Source(name, path, kind, StorageWeakRef(st),
                                              st.data_ptr(), st.nbytes(), t._version, clock))
                if hit:
                    src_node = nodes.get(src)
                    if src_node is not None and src_node[1] > clock:
                        stale = True  # the source was rewritten after this storage was
            handle = next((h for h in (at(address) for at in self._hooks["handle_at"])
                           if h is not None), None)
            if handle is not None:  # its sources named when it was made (Note [dangling sources])
                have = {(s.model, s.path, s.ref.cdata) for s in sources}
                for model, path, kind, ref, ptr, nbytes in handle.sources:
                    if (model, path, ref.cdata) not in have:
                        sources.append(Source(model, path, kind, ref, ptr, nbytes, None,
                                              node[2].get(ref.cdata, 0)))
            if not sources:
                continue
            versions = {}
            for m, p, _k in sorted(snapshot.owners.get(sid, ())):
                t = tensor(m, p)
                if isinstance(t, torch.Tensor):
                    versions[(m, p)] = t._version
            self.captured[sid] = Derived(tuple(sorted(sources, key=lambda s: (s.model, s.path))),
                                         versions, stale, node[1], handle is not None)
            made += 1
        return made

    def catch_up(self) -> None:
        """Note [derived during updates]: let the trace match what lineage saw written since
        the last look (nothing to do while its clock has not moved)."""
        if self.rematch is not None and self.clock != self._late_clock:
            self.rematch()

    def match_late(self, storages, snapshot, models: Mapping[str, torch.nn.Module]) -> int:
        """Note [derived during updates]: a `Derived` for each storage captured earlier with
        none yet that lineage saw written, since the last call, from a parameter or buffer of
        `models`. Returns how many were made (`late` counts them all)."""
        since, self._late_clock = self._late_clock, self.clock
        if not self._matched or since == self.clock:
            return 0
        nodes, captured = self.nodes, self.captured
        registered = self.registered_tensors(False)
        done = storages.registered_since(0)
        found = []
        for a in done.handle_set & nodes.keys():  # the captured storages lineage knows
            node = nodes[a]
            if node[1] <= since or not node[2] or registered.keys().isdisjoint(node[2]):
                continue  # not written since, or from no registered tensor (a load)
            sid = storages.find(a)
            if sid is not None and sid < self._matched and sid not in captured:
                found.append((sid, a))
        if not found:
            return 0
        found.sort()
        made = self._match_found(found, snapshot, models)
        self.late += made
        return made

    def meta(self) -> dict:
        return {"enabled": True, "ops": self.n_ops, "nodes": len(self.nodes),
                "edges": self.n_edges, "max_edges": self.max_edges,
                "ops_skipped": self.ops_skipped, "truncated": self.truncated,
                "captured_derived": len(self.captured),
                "handles": sum(len(d.handles) for d in self.detectors if hasattr(d, "handles"))}



def optimizer_hooks(lineage: "Lineage") -> list:
    """Global torch.optim step hooks that tell `lineage` when an optimizer step runs (its
    in-place updates are training, not a non-idempotent process step: Note [non-idempotent
    steps]); the lineage is held weakly. Remove them with `.remove()`."""
    import weakref

    from torch.optim.optimizer import (
        register_optimizer_step_post_hook,
        register_optimizer_step_pre_hook,
    )

    ref = weakref.ref(lineage)

    def pre(optimizer, args, kwargs) -> None:
        found = ref()
        if found is not None:
            found.optimizer_steps += 1

    def post(optimizer, args, kwargs) -> None:
        found = ref()
        if found is not None:
            found.optimizer_steps = max(0, found.optimizer_steps - 1)

    return [register_optimizer_step_pre_hook(pre), register_optimizer_step_post_hook(post)]
