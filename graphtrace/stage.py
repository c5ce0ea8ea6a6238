"""The per-storage stage the diff and the guard share, so the two cannot drift apart: what
each requires before it starts (`require`: the same error for the same misuse), the owner
snapshot brought up to date with what its walks had to cut (`owner_cuts`: `walk cut` blind
spots for both), and where a problem storage's graph should read now (`live_pointer`).
"""

from __future__ import annotations

from typing import Mapping

import numpy as np
import torch

from graphtrace.blindspots import BlindSpot
from graphtrace.errors import NothingToCheck

__all__ = ["require", "owner_cuts", "live_pointer", "same_storage"]

_VERB = {"diff": ("diff", "diff against"), "guard": ("guard", "guard against")}


def require(recorder, models: Mapping[str, torch.nn.Module], what: str) -> None:
    """Raise `NothingToCheck` (a GraphtraceError and a ValueError) when `recorder` recorded
    no capture or no model is watched; `what` is "diff" or "guard"."""
    verb, against = _VERB[what]
    if not recorder.captures:
        raise NothingToCheck(f"nothing to {verb}: the trace recorded no capture. Capture inside "
                             "`with graphtrace.trace(...)` with `graphtrace.capture(label)` or "
                             "a CUDA graph")
    if not models:
        raise NothingToCheck(f"nothing to {against}: no model is watched. Pass the model to "
                             "graphtrace.trace(model) or call t.watch(model) before the reload")


def owner_cuts(snapshot, models: Mapping[str, torch.nn.Module], recorder) -> list[BlindSpot]:
    """Match the storages the owner `snapshot` has not matched yet (a walk of a model it
    has not walked since it changed); what those walks had to cut, as blind spots (`walk
    cut`, or the records the walk made). Fails open: a failed update is a recorder error."""
    try:
        cut = snapshot.update(models, recorder.storages)
    except Exception as exc:
        recorder.fail("owner snapshot", exc)
        return []
    return [c if isinstance(c, BlindSpot) else BlindSpot("walk cut", c) for c in cut]


def same_storage(storage: torch.UntypedStorage, cdata: int | None, data_ptr: int | None,
                 nbytes: int | None) -> bool:
    """Is `storage` the captured one? The one place that decides it: by StorageImpl address
    where a weak handle kept one unique (`cdata`: exact identity), else by data address and
    size (a weaker answer: Note [guard identity] in graphtrace/guard/manifest.py). A storage whose
    data address cannot be read (a wrapper subclass's placeholder) has address 0."""
    if cdata is not None:
        return storage._cdata == cdata
    try:
        ptr = storage.data_ptr()
    except Exception:
        ptr = 0
    return ptr == data_ptr and storage.nbytes() == nbytes


def live_pointer(ptrs: np.ndarray, known: np.ndarray, moved: np.ndarray,
                 starts: np.ndarray) -> np.ndarray:
    """Where the graph should read now, per run of a storage's owner rows (runs start at
    `starts`): the row of the first known pointer of a moved owner, else of the first known
    one (a holder's); -1 if none is known. Per owner row: `ptrs` its live data_ptr, `known`
    whether there is one, `moved` whether it moved. Returns the picked row per run."""
    rows = np.arange(len(ptrs))
    none = len(ptrs)
    first_moved = np.minimum.reduceat(np.where(moved & known, rows, none), starts)
    first_known = np.minimum.reduceat(np.where(known, rows, none), starts)
    pick = np.where(first_moved < none, first_moved, first_known)
    return np.where(pick < none, pick, -1)
