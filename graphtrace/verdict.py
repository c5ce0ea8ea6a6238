"""The verdict engine: the one place that decides what a captured storage's edges are.

`t.diff()` (every edge of a trace), `Guard.check()` (the required storages, live or loaded
from JSON) and every integration built on them call these functions; nothing else decides a
verdict, an owner's status or an impact: `owner_status` (Note [re-laid views]), the rule
(`verdict_of`, vectorised `storage_verdicts`), freshness (`freshness`, the pass diff and
guard share: Note [freshness]) and impact (`edge_impact`: Note [impact]).

tests/test_verdict.py checks the two forms of the rule against each other, and
tests/test_differential.py checks diff and guard against each other on every scenario.
"""

from __future__ import annotations

from typing import Iterable, NamedTuple

import numpy as np
import torch

from graphtrace.opaque import is_opaque, storage_of
from graphtrace.stage import same_storage
from graphtrace.vocab import HOLDS, MOVED, ORPHANED, OWNER_STATUSES, VERDICTS

__all__ = ["View", "same_view", "relaid_note", "on_storage", "owner_status", "verdict_of",
           "storage_verdicts", "impact_of", "edge_impact", "source_changed", "unrefreshed",
           "freshness_of", "unrefreshed_impact", "freed_sources", "Freshness", "freshness"]

# verdicts by their own word, from vocab (a word that left VERDICTS fails here, at import)
_V = {v: v for v in VERDICTS}
STABLE, STALE, DANGLING, DIVERGED, ORPHANED_VERDICT, UNOWNED, UNREFRESHED = (
    _V[v] for v in ("stable", "stale", "dangling", "diverged", "orphaned", "unowned",
                    "unrefreshed"))


class View(NamedTuple):
    """A tensor's geometry on its storage: what a graph read, or what an owner held."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int

    @classmethod
    def of(cls, tensor: torch.Tensor) -> "View":
        return cls(tensor.dtype, tuple(tensor.shape), tuple(tensor.stride()),
                   tensor.storage_offset())


# -- owner status ----------------------------------------------------------------------------

# Note [re-laid views]
# ~~~~~~~~~~~~~~~~~~~~
# A graph reads a storage through the view its op was given (dtype, shape, stride, storage
# offset), taken from what the owner held at capture. A reload can lay new data into the same
# storage under another view: vLLM 0.34's direct reload (VLLM_RELOAD_MODE=direct) views each
# re-laid-out parameter back to its checkpoint layout on its own storage, the loaders write
# there, and post-load processing must lay it out again as at capture. Where it does not (a
# one-shot "already processed" guard, a repack to another shape), the owner holds the right
# storage and a graph reads checkpoint bytes through its runtime view. So an owner holds the
# captured storage only under the view it had at capture (`same_view`: dtype, shape, storage
# offset and the strides of every dimension longer than one); the same storage under another
# view is `moved`, and the verdict is `stale` (the graph reads bytes laid out for another
# view), its note naming both views (`relaid_note`). An owner whose capture-time view is not
# known (an opaque handle, a manifest from before views were kept) is judged by storage alone.
# The guard's clean check compares views in the same native walk that compares storages
# (`PathSet.moved(views=)` over `paths_moved`): a tensor whose geometry is not exactly as at
# capture is left to `same_view` in Python, so this rule costs a clean check no second walk.

def same_view(a: View, b: View) -> bool:
    """Do `a` and `b` address the same elements the same way? The strides of dimensions of
    length one (and of empty views) address nothing, so they are not compared."""
    if a.dtype != b.dtype or tuple(a.shape) != tuple(b.shape):
        return False
    if any(n == 0 for n in a.shape):
        return True
    return a.offset == b.offset and all(
        n == 1 or s == t for n, s, t in zip(a.shape, a.stride, b.stride))


def _view_text(v: View) -> str:
    return (f"{_dtype_name(v.dtype)} {tuple(v.shape)} stride {tuple(v.stride)} "
            f"offset {v.offset}")


def relaid_note(read: View, owner: View, live: View) -> str:
    """The note of an owner that holds the captured storage under another view than at
    capture (Note [re-laid views]): the view the graph reads, the owner's then and now."""
    through = "" if same_view(read, owner) else f" (taken from the owner's {_view_text(owner)})"
    return (f"re-laid in the captured storage: the graph reads {_view_text(read)}{through}, "
            f"the owner now holds {_view_text(live)}")


def on_storage(tensor: object, storage: torch.UntypedStorage | None) -> bool:
    """Is `tensor` a tensor on `storage` itself (a moved owner that was re-laid: Note
    [re-laid views])?"""
    try:
        return storage is not None and isinstance(tensor, torch.Tensor) and \
            tensor.untyped_storage()._cdata == storage._cdata
    except Exception:  # no storage (meta, functional wrappers)
        return False


def owner_status(tensor: object, cdata: int | None = None, *, data_ptr: int = 0,
                 nbytes: int = 0, dead: bool = False,
                 view: View | None = None) -> tuple[str, int | None]:
    """(status, live data_ptr) of one capture-time owner whose path now reaches `tensor`.

    The captured storage is `cdata`, else `data_ptr` and `nbytes`, as `same_storage` takes
    them (`dead`: it was freed before that was recorded, so nothing holds it). `tensor` None:
    the path no longer resolves (orphaned). `view`: the owner's View at capture; the captured
    storage under another view is moved (Note [re-laid views]). The live pointer is 0 for an
    opaque handle and None where unknown."""
    if tensor is None:
        return ORPHANED, None
    plain = type(tensor) is torch.Tensor or type(tensor) is torch.nn.Parameter
    try:
        if plain:  # most owners
            storage, ptr = tensor.untyped_storage(), tensor.data_ptr()
        else:
            storage = storage_of(tensor)  # an opaque handle's proxy storage too
            ptr = 0 if is_opaque(tensor) else tensor.data_ptr()
        same = (cdata is not None or not dead) and same_storage(storage, cdata, data_ptr, nbytes)
        if same and plain and view is not None:
            same = same_view(view, View.of(tensor))
    except Exception:  # no storage (meta, functional wrappers): not the captured one
        return MOVED, None
    return (HOLDS if same else MOVED), ptr


# -- the rule --------------------------------------------------------------------------------

def verdict_of(statuses: Iterable[str], alive: bool, internal: bool = False,
               unrefreshed: bool = False, source_freed: bool = False) -> str:
    """The verdict of one captured storage from its capture-time owners' statuses now.

    No owner -> unowned; an owned storage that every graph overwrites before it reads it
    (`internal`: origin internal on all its edges) -> stable, whatever its owners did, since
    each replay recomputes what it then reads (legacy weight_norm's `weight`, recomputed in
    a forward pre-hook and kept as an attribute); otherwise some hold and some do not ->
    diverged; all hold -> stable; some moved -> stale if the captured storage is alive,
    else dangling; all orphaned -> orphaned. Freshness (`unrefreshed`: the storage's sources
    changed since it was last written, Note [freshness]) turns what would be stable (every
    owner holds it) or unowned into unrefreshed; identity problems come first. A handle
    whose source was freed while the model keeps that value elsewhere (`source_freed`:
    `freed_sources`) is dangling wherever it would be stable, unowned or unrefreshed.
    """
    statuses = list(statuses)
    bad = set(statuses) - set(OWNER_STATUSES)
    if bad:
        raise ValueError(f"unknown owner status {sorted(bad)[0]!r} (statuses are "
                         f"{', '.join(OWNER_STATUSES)})")
    if internal:
        return STABLE if statuses else UNOWNED
    if not statuses:
        return DANGLING if source_freed else UNREFRESHED if unrefreshed else UNOWNED
    holds = [s == HOLDS for s in statuses]
    if any(holds):
        if not all(holds):
            return DIVERGED
        return DANGLING if source_freed else UNREFRESHED if unrefreshed else STABLE
    if MOVED in statuses:
        return STALE if alive else DANGLING
    return ORPHANED_VERDICT


def storage_verdicts(status: np.ndarray, n_owners: np.ndarray, alive: np.ndarray,
                     internal: np.ndarray | None = None,
                     unrefreshed: np.ndarray | None = None,
                     source_freed: np.ndarray | None = None) -> np.ndarray:
    """`verdict_of`, vectorised: per storage, its verdict (an object array).

    `status`: the owner statuses of all storages, one run per storage in storage order;
    `n_owners`: each storage's run length (0: no owner, unowned); `alive`, `internal`,
    `unrefreshed`, `source_freed`: per storage, as `verdict_of` takes them (the last three
    default to all False)."""
    n_owners = np.asarray(n_owners, dtype=np.int64)
    internal = (np.zeros(len(n_owners), dtype=bool) if internal is None
                else np.asarray(internal, dtype=bool))
    unrefreshed = (np.zeros(len(n_owners), dtype=bool) if unrefreshed is None
                   else np.asarray(unrefreshed, dtype=bool))
    if (len(status) != n_owners.sum() or len(alive) != len(n_owners)
            or len(internal) != len(n_owners) or (n_owners < 0).any()):
        raise ValueError(f"storage_verdicts needs one status per owner ({len(status)} for "
                         f"{n_owners.sum()} owners) and one alive and internal flag per "
                         f"storage ({len(alive)}, {len(internal)} for {len(n_owners)} storages)")
    if len(unrefreshed) != len(n_owners):
        raise ValueError(f"storage_verdicts needs one unrefreshed flag per storage "
                         f"({len(unrefreshed)} for {len(n_owners)} storages)")
    source_freed = (np.zeros(len(n_owners), dtype=bool) if source_freed is None
                    else np.asarray(source_freed, dtype=bool))
    if len(source_freed) != len(n_owners):
        raise ValueError(f"storage_verdicts needs one source_freed flag per storage "
                         f"({len(source_freed)} for {len(n_owners)} storages)")
    unrefreshed = unrefreshed & ~internal  # a graph that rewrites it keeps it fresh
    source_freed = source_freed & ~internal
    verdict = np.full(len(n_owners), UNOWNED, dtype=object)
    owned = n_owners > 0
    verdict[~owned & unrefreshed] = UNREFRESHED
    verdict[~owned & source_freed] = DANGLING
    if not owned.any():
        return verdict
    status = np.asarray(status, dtype=object)
    holds_row = status == HOLDS
    moved_row = status == MOVED
    # an unknown status: the compares the rule needs anyway, no sort of every owner row
    unknown = ~(holds_row | moved_row | (status == ORPHANED))
    if unknown.any():
        raise ValueError(f"unknown owner status {str(status[np.argmax(unknown)])!r} (statuses "
                         f"are {', '.join(OWNER_STATUSES)})")
    starts = np.cumsum(n_owners[owned]) - n_owners[owned]  # runs of owned storages only
    holds = np.logical_or.reduceat(holds_row, starts)
    moved = np.logical_or.reduceat(moved_row, starts)
    verdict[owned] = np.select(
        [internal[owned], holds & ~np.logical_and.reduceat(holds_row, starts),
         holds & source_freed[owned], holds & unrefreshed[owned], holds,
         moved & np.asarray(alive, dtype=bool)[owned], moved],
        [STABLE, DIVERGED, DANGLING, UNREFRESHED, STABLE, STALE, DANGLING],
        default=ORPHANED_VERDICT)
    return verdict


# -- freshness -------------------------------------------------------------------------------

# Note [freshness]
# ~~~~~~~~~~~~~~~~
# A storage a graph reads can be where its owners point (identity holds) and still hold an
# old value: one derived from sources that changed since (Megatron-LM #6723's
# `_A_neg_exp_cache = -exp(A_log)`, filled once; a refit copies new A_log in place). Lineage
# (Note [lineage] in graphtrace/lineage/graph.py) names each captured storage's sources -- the
# registered parameters and buffers it was derived from -- and takes their baselines at the
# end of its capture (`Derived`, with `stale`: Note [lineage], "Matching").
# Later, the storage is `unrefreshed` when
#   (stale, or some source changed since: its path now reaches another storage, or its
#    owner tensor's `_version` advanced, or lineage saw a write to it)
#   and it was not rewritten since (none of its owners' `_version`s advanced and lineage saw
#    no write to it).
# Only version counters and storage identity: no values are read. A source whose path no
# longer resolves is no evidence either way (the owner walk reports what moved). What a
# check cannot see: an in-place write through a tensor with its own version counter
# (`param.data.copy_`) made while lineage is not recording (after the trace, or from a
# guard read from JSON); a rewrite of an unowned storage then (it has no path to read a
# version from). `impact`: graphtrace does not recompute the derived value, so it is
# `unknown`, except where the sources' values are known unchanged: every source that changed
# was *rebound* to a storage holding the same bytes as its old one, which is still alive (a
# graph or a holder keeps it) and which lineage saw no write to since the match -- a
# same-weights reload that binds new tensors: the derived value is still what recomputing it
# would give, `latent` (wrong only after the next real update), as for a stale edge
# (`unrefreshed_impact`). A source changed in place (its version moved, or lineage saw a
# write) has no old value left to compare: `unknown`. Byte compares run for unrefreshed
# storages only (problems), never on a clean check; a guard read from JSON holds no weak
# handles, so its impact stays `unknown`.

def source_changed(tensor: object, cdata: int | None, data_ptr: int, nbytes: int,
                   version: int | None) -> bool:
    """Did a source change since its baseline? `tensor`: what its owner path reaches now
    (None: no longer resolves: no evidence); `cdata`: the source storage's StorageImpl
    address when a weak handle to it is held (else `data_ptr` and `nbytes` identify it:
    `same_storage`); `version`: its owner tensor's `_version` then (None: unknown)."""
    if not isinstance(tensor, torch.Tensor):
        return False
    try:
        if not same_storage(tensor.untyped_storage(), cdata, data_ptr, nbytes):
            return True
        return version is not None and tensor._version != version
    except Exception:  # no storage (meta, functional wrappers): another storage than the source
        return True


def unrefreshed(stale: bool, changed: Iterable[bool], owner_versions: Iterable[tuple]) -> bool:
    """The freshness rule (Note [freshness]): `stale` (a source was rewritten after the
    storage, before the capture), `changed` (per source, `source_changed` or a write lineage
    saw), `owner_versions`: per owner of the storage, (what its path reaches now, its
    `_version` at the baseline). A rewrite lineage saw is judged before (`freshness_of`)."""
    if not (stale or any(changed)):
        return False
    for tensor, version in owner_versions:
        if isinstance(tensor, torch.Tensor) and version is not None:
            try:
                if tensor._version != version:
                    return False
            except Exception:
                continue
    return True


# -- impact ----------------------------------------------------------------------------------

# Note [impact]
# ~~~~~~~~~~~~~
# A stale or diverged edge is `manifest` when the values the graph reads (its view of the
# captured storage) differ from what the moved owner holds now, `latent` when they are equal
# (a same-weights reload: wrong only after the next real update), `unknown` where graphtrace
# cannot compare (an opaque handle, a freed or meta storage, dtypes without comparison).
# The graph's view is compared with *the same view* of the owner's live tensor: the view is
# placed on the live storage at the same position relative to the owner's tensor as it had
# at capture (`owner`: the owner's capture-time View), so a transposed read (`weight.t()` for
# aten::mm) compares transposed with transposed, and a shape or dtype the view has is never
# mistaken for a change of the owner. A change is named (the note) only when the owner's own
# dtype or shape differs from its capture-time one: a dtype move compares values cast to a
# common dtype; a shape change is `manifest` (the graph reads a tensor of another shape than
# the model holds). Without the owner's capture-time View (an older manifest), the view is
# placed at its captured storage offset.

def impact_of(old: torch.UntypedStorage | None, view: View, live: object,
              owner: View | None = None) -> tuple[str, str]:
    """(impact, note) of a graph that reads `view` of the captured storage `old` while its
    owner now holds `live` (Note [impact]); `owner`: the owner's capture-time View. The note
    names a dtype or shape change of the owner since capture ("" if none)."""
    if old is None or live is None or is_opaque(live):  # opaque: identity only
        return "unknown", ""
    try:
        new_storage = live.untyped_storage()
        if new_storage.device.type == "meta":
            return "unknown", ""  # a reload that failed half-way left the model without data
        # a wrapper subclass's placeholder storage has no data (reading its pointer raises;
        # reading its bytes would crash): nothing to compare
        new_storage.data_ptr(), old.data_ptr()
    except Exception:
        return "unknown", ""
    note = _change_note(owner, live)
    if owner is not None and on_storage(live, old):  # Note [re-laid views]
        note = relaid_note(view, owner, View.of(live))
    if owner is not None and tuple(live.shape) != owner.shape:
        return "manifest", note  # the graph reads a tensor of another shape than the model holds
    offset, stride = view.offset, view.stride
    if owner is not None:
        same_place = (view.dtype == owner.dtype and tuple(live.stride()) == owner.stride)
        if not same_place:  # another layout (or a reinterpreting view): compare whole tensors
            view = owner
            offset, stride = live.storage_offset(), tuple(live.stride())
        else:
            offset = live.storage_offset() + (view.offset - owner.offset)
    try:
        was = torch.empty(0, dtype=view.dtype, device=old.device).set_(
            old, view.offset, view.shape, view.stride)
        now = torch.empty(0, dtype=live.dtype, device=new_storage.device).set_(
            new_storage, offset, view.shape, stride)
    except Exception:  # the live storage does not hold the view: the graph reads other data
        return "manifest", note or "the live tensor does not hold the view the graph reads"
    try:
        was, now = was.cpu(), now.cpu()
        if was.dtype != now.dtype:
            common = torch.promote_types(was.dtype, now.dtype)
            was, now = was.to(common), now.to(common)
        same = torch.equal(was, now)
    except Exception:  # dtypes without comparison kernels: say so rather than guess
        return "unknown", note
    return ("latent" if same else "manifest"), note


def edge_impact(verdict: str, old: torch.UntypedStorage | None, view: View | None,
                live: object, live_view: View | None,
                fresh: str = "unknown") -> tuple[str | None, str]:
    """(impact, note) of a graph reading `view` of a storage with `verdict`, the one rule
    diff and guard both call: `impact_of` (`old`, the captured storage, against `live`, what
    the first moved owner holds now, with its capture-time View `live_view`) for stale and
    diverged, unknown where either is missing; unknown for dangling; `fresh` (the storage's
    `unrefreshed_impact`) for unrefreshed; None for any other verdict."""
    if verdict in (STALE, DIVERGED):
        if old is None or view is None or live is None:
            return "unknown", ""
        return impact_of(old, view, live, live_view)
    if verdict == DANGLING:
        return "unknown", ""
    if verdict == UNREFRESHED:
        return fresh, ""
    return None, ""


def _change_note(owner: View | None, live: torch.Tensor) -> str:
    if owner is None:
        return ""
    notes = []
    if live.dtype != owner.dtype:
        notes.append(f"dtype {_dtype_name(owner.dtype)} -> {_dtype_name(live.dtype)}")
    if tuple(live.shape) != owner.shape:
        notes.append(f"shape {owner.shape} -> {tuple(live.shape)}")
    return "; ".join(notes)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def freshness_of(derived, resolve, lineage=None, address: int | None = None) -> bool:
    """Is the captured storage of `derived` (a graphtrace.lineage.Derived) unrefreshed now?
    `resolve(model, path)`: what an owner path reaches on the live model. `lineage` (the
    trace's, while it is alive) and the storage's StorageImpl `address` add what lineage saw
    since the capture: a rewrite of the storage is judged by its new record (its sources'
    clocks then against now), a write to a source counts as a change (Note [freshness])."""
    if lineage is not None and address is not None:
        now = lineage.stale_since(address, derived)
        if now is not None:
            return now
    changed = []
    for s in derived.sources:
        cdata = s.ref.cdata if s.ref is not None else None
        moved = source_changed(resolve(s.model, s.path), cdata, s.data_ptr, s.nbytes, s.version)
        if not moved and lineage is not None and cdata is not None:
            moved = lineage.clock_of(cdata) > s.clock
        changed.append(moved)
    if not (derived.stale or any(changed)):  # the owners' paths are resolved only when needed
        return False
    return unrefreshed(derived.stale, changed,
                       [(resolve(m, p), v) for (m, p), v in derived.owner_versions.items()])


def unrefreshed_impact(derived, resolve, lineage=None) -> str:
    """`latent` or `unknown`: the impact of an unrefreshed storage (Note [freshness]).
    `derived`: its graphtrace.lineage.Derived; `resolve(model, path)`: what a source's path
    reaches now; `lineage`: the trace's, while it lives (without it: `unknown`)."""
    if lineage is None or derived.stale:
        return "unknown"
    rebound = False
    for s in derived.sources:
        if s.ref is None or s.ref.expired() or lineage.clock_of(s.ref.cdata) > s.clock:
            return "unknown"  # no old value left, or lineage saw it written since
        now = resolve(s.model, s.path)
        if not source_changed(now, s.ref.cdata, s.data_ptr, s.nbytes, s.version):
            continue
        try:
            new = now.untyped_storage()
            if same_storage(new, s.ref.cdata, s.data_ptr, s.nbytes):
                return "unknown"  # changed in place (its version moved): no old value
            old = _storage_from_weak_ref(s.ref.cdata)
            if old is None or old.nbytes() != new.nbytes() or old.device != new.device:
                return "unknown"
            same = torch.equal(torch.empty(0, dtype=torch.uint8, device=old.device).set_(old),
                               torch.empty(0, dtype=torch.uint8, device=new.device).set_(new))
        except Exception:  # no storage, no bytes to compare: say so rather than guess
            return "unknown"
        if not same:
            return "unknown"
        rebound = True
    return "latent" if rebound else "unknown"


def _storage_from_weak_ref(cdata: int):
    from graphtrace._compat import storage_from_weak_ref

    return storage_from_weak_ref(cdata)


def freed_sources(derived, resolve) -> list:
    """The sources of a handle (`derived`, a graphtrace.lineage.Derived with `handle`) that
    were freed while it lives and whose owner path now reaches a live tensor (Note [dangling
    sources] in graphtrace/lineage/handles.py). Weak handles only: a guard read from JSON
    (no handles) finds none. `resolve(model, path)`: what an owner path reaches now."""
    if derived is None or not getattr(derived, "handle", False):
        return []
    return [s for s in derived.sources
            if s.ref is not None and s.ref.expired()
            and isinstance(resolve(s.model, s.path), torch.Tensor)]


class Freshness(NamedTuple):
    """What `freshness` found, by the caller's storage keys."""

    unrefreshed: dict  # key -> its impact (`unrefreshed_impact`)
    freed: dict  # key -> its dangling sources (`freed_sources`)
    fresh: list  # the keys looked at and found fresh (the guard rebaselines them)

    def derived_from(self, key, derived) -> str:
        """The `derived_from` text of `derived` (the storage at `key`), freed sources marked."""
        gone = self.freed.get(key)
        return derived.marked(gone) if gone else derived.derived_from


def freshness(storages: Iterable[tuple], resolve, lineage=None, *,
              sources_unchanged: bool = False) -> Freshness:
    """Freshness of captured storages, the one pass diff and guard call (Note [freshness]).
    `storages`: (key, Derived or None, StorageImpl address or None, alive, internal) each;
    one not derived, not alive or `internal` (Note [write before read] in
    graphtrace/edges.py) is not looked at. `resolve(model, path)`: what an owner path
    reaches now; `lineage`: the trace's, while it lives. `sources_unchanged`: the caller knows no
    source changed since a pass found every storage fresh (the guard's fast path: Note
    [guard freshness fast path] in graphtrace/guard/check.py): dangling sources only."""
    found = Freshness({}, {}, [])
    for key, derived, address, alive, internal in storages:
        if derived is None or not alive or internal:
            continue
        gone = freed_sources(derived, resolve)
        if gone:
            found.freed[key] = gone
        if sources_unchanged:
            continue
        if freshness_of(derived, resolve, lineage, address):
            found.unrefreshed[key] = unrefreshed_impact(derived, resolve, lineage)
        else:
            found.fresh.append(key)
    return found
