"""The (graph, storage) edges of a recorder's captures: which rows make each edge, the view it
is described by, and its origin (Note [write before read]). diff builds the report's edges on
this; the guard keeps the same edges' storages, views and origins (imports no torch).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from graphtrace.encoding import FACTORY, READ, VIEW, WRITE

__all__ = ["CaptureEdges", "capture_edges", "writes", "OVERWRITES"]


class CaptureEdges(NamedTuple):
    """Per edge (graph, storage) of the raw accesses, ordered by graph then storage.

    `rows`: the access rows that read or write (not views), by edge then row; `starts`: where
    each edge's run of them starts; `first_row`: each edge's first such row; `view_row`: the
    row the edge is described by (its first read, else its first write); `has_read`,
    `has_write`; `internal`: every read of the graph from the storage comes after the graph
    overwrote it (origin internal)."""

    rows: np.ndarray
    starts: np.ndarray
    graph_id: np.ndarray
    storage_id: np.ndarray
    first_row: np.ndarray
    view_row: np.ndarray
    has_read: np.ndarray
    has_write: np.ndarray
    internal: np.ndarray

    def internal_storages(self, n_storages: int) -> np.ndarray:
        """Per storage id: is every edge of it internal? (False for storages without edges.)"""
        n_edges = np.bincount(self.storage_id, minlength=n_storages)
        n_internal = np.bincount(self.storage_id, weights=self.internal, minlength=n_storages)
        return (n_internal == n_edges) & (n_edges > 0)


def writes(access: np.ndarray) -> np.ndarray:
    """Which accesses write (in place or as a fresh output): two compares, where np.isin
    over int8 accesses takes ~100x longer (a sort or table per call)."""
    return (access == WRITE) | (access == FACTORY)


def capture_edges(raw: dict, n_storages: int, names: list, views: list) -> CaptureEdges:
    """The edges of `raw` (graphtrace.frames.raw_accesses), with `names` and `views` the
    recorder's interned op/arg names and views."""
    rows, starts = _edge_runs(raw, n_storages)
    access = raw["access"][rows]
    first_rows = rows[starts]
    big = np.iinfo(np.int64).max
    if len(starts):
        first_read = np.minimum.reduceat(np.where(access == READ, rows, big), starts)
        has_write = np.logical_or.reduceat(writes(access), starts)
    else:
        first_read, has_write = np.empty(0, np.int64), np.empty(0, bool)
    has_read = first_read != big
    return CaptureEdges(
        rows=rows, starts=starts, graph_id=raw["graph_id"][first_rows],
        storage_id=raw["storage_id"][first_rows], first_row=first_rows,
        view_row=np.where(has_read, first_read, first_rows), has_read=has_read,
        has_write=has_write, internal=_internal_edges(raw, rows, starts, names, views))


def _edge_runs(raw: dict, n_storages: int) -> tuple[np.ndarray, np.ndarray]:
    """The rows that read or write (not views), ordered by (graph, storage, row), and where
    each edge's run of them starts: every per-edge value is a reduce over its run."""
    touched = np.flatnonzero(raw["access"] != VIEW)
    key = raw["graph_id"][touched] * max(n_storages, 1) + raw["storage_id"][touched]
    order = np.argsort(key, kind="stable")  # stable: rows ascend within a run
    rows, key = touched[order], key[order]
    new = np.empty(len(rows), dtype=bool)
    new[:1] = True
    np.not_equal(key[1:], key[:-1], out=new[1:])
    return rows, np.flatnonzero(new)


# Note [write before read]
# ~~~~~~~~~~~~~~~~~~~~~~~~
# A storage a graph overwrites before it reads it is the graph's own: each replay recomputes
# what it then reads, whoever owned it at capture time. Legacy `torch.nn.utils.weight_norm`
# recomputes `weight` in a forward pre-hook and keeps it as an attribute: after the next eager
# call the attribute holds another tensor, yet every replay rewrites the captured one first.
# An edge's `origin` is `internal` when its first access in that graph overwrites a dense byte
# range that holds every later read of the graph from that storage, else `external`. An
# overwrite is a fresh output (factory), an `out=` argument, or the target of a pure
# overwrite (aten::copy_, fill_, zero_); other in-place ops (`add_`) read what they write.
# An owned storage whose every edge is internal is `stable` (graphtrace.verdict.verdict_of),
# its owners' statuses still listed in `owners`: no false alarm for what no replay reads stale.
OVERWRITES = ("aten::copy_", "aten::fill_.Scalar", "aten::fill_.Tensor", "aten::zero_")


def _view_extents(items: list) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per interned view: first and past-the-end byte of what it spans, and whether it
    covers that span densely (no holes, no overlap)."""
    n = len(items)
    lo, hi, dense = np.zeros(n, np.int64), np.zeros(n, np.int64), np.zeros(n, bool)
    for i, (dtype, shape, stride, offset) in enumerate(items):
        size = dtype.itemsize
        numel, extent = 1, 1
        ok = True
        for d, st in zip(shape, stride):
            numel *= d
            if st < 0:
                ok = False
            extent += (d - 1) * st
        if numel == 0:
            extent = 0
        lo[i] = offset * size
        hi[i] = lo[i] + extent * size
        dense[i] = ok and numel == extent
    return lo, hi, dense


def _internal_edges(raw: dict, rows: np.ndarray, starts: np.ndarray, names: list,
                    views: list) -> np.ndarray:
    """Per edge: does its graph overwrite the storage before reading it? (Note [write before
    read])."""
    if not len(starts):
        return np.zeros(0, dtype=bool)
    access = raw["access"][rows]
    ids = {n: i for i, n in enumerate(names)}
    first = rows[starts]
    first_access = raw["access"][first]
    over = first_access == FACTORY
    out_id = ids.get("out", -1)
    pure = [ids[n] for n in OVERWRITES if n in ids]
    over |= (first_access == WRITE) & ((raw["arg"][first] == out_id) | np.isin(raw["op"][first], pure))
    if not over.any():
        return over
    lo, hi, dense = _view_extents(views)
    v = raw["view"][rows]
    reads = access == READ
    big = np.iinfo(np.int64).max
    read_lo = np.minimum.reduceat(np.where(reads, lo[v], big), starts)
    read_hi = np.maximum.reduceat(np.where(reads, hi[v], -1), starts)
    fv = raw["view"][first]
    # the first access must also come before any read of the same op (rows of one op are
    # args first, so a read in the same op as a fresh output was read before it was made)
    first_seq = raw["seq"][first]
    read_seq = np.minimum.reduceat(np.where(reads, raw["seq"][rows], big), starts)
    return (over & dense[fv] & (read_lo >= lo[fv]) & (read_hi <= hi[fv])
            & (read_seq > first_seq))
