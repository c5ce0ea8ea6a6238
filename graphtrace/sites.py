"""Creation sites and suggested fixes as report text (imports no torch).

A *site* says which op made a storage and from which lines of user code (which, and how
sites are recorded: Note [provenance] in graphtrace/provenance.py). Its text, as the
`created_at` / `live_created_at` columns of `report.edges` hold it::

    site  := op " at " frame ( " < " frame )*
    frame := file ":" line " in " function

e.g. ``aten::_to_copy at /src/kernels.py:213 in _perm_from_g_idx < /src/kernels.py:281 in
process_weights_after_loading``: the frame after each ``<`` called the one before it.
`suggest_fix` picks the fix a stale-like edge needs (the words: `graphtrace.vocab.FIXES`).
"""

from __future__ import annotations

from typing import Iterable, NamedTuple

from graphtrace.vocab import FIXES, MOVED, PROVENANCE_MARKS

__all__ = ["Frame", "Site", "format_site", "parse_site", "CALLABLE_STEPS", "suggest_fix"]


class Frame(NamedTuple):
    file: str
    line: int
    function: str

    def __str__(self) -> str:
        return f"{self.file}:{self.line} in {self.function}"


class Site(NamedTuple):
    op: str                   # e.g. "aten::_to_copy"
    frames: tuple[Frame, ...]  # nearest first

    def __str__(self) -> str:
        return format_site(self.op, self.frames)


def format_site(op: str, frames: Iterable[tuple[str, int, str]]) -> str:
    """A site's text (the grammar above); `frames` nearest first."""
    text = " < ".join(str(Frame(*f)) for f in frames)
    return f"{op} at {text}" if text else f"{op} at ?"


def parse_site(text: str) -> Site | None:
    """The Site a `created_at` text names; None for "" and the marks ("before trace",
    "not recorded"). Raises ValueError for text that is neither."""
    if not text or text in PROVENANCE_MARKS:
        return None
    op, sep, rest = text.partition(" at ")
    if not sep or not op or " " in op:
        raise ValueError(f"not a creation site: {text!r} (expected 'OP at FILE:LINE in FUNC')")
    frames = []
    if rest != "?":
        for part in rest.split(" < "):
            where, sep, function = part.rpartition(" in ")
            file, colon, line = where.rpartition(":")
            if not sep or not colon or not line.isdigit():
                raise ValueError(f"not a frame: {part!r} in site {text!r} "
                                 "(expected 'FILE:LINE in FUNC')")
            frames.append(Frame(file, int(line), function))
    return Site(op, tuple(frames))


#: path steps that mean "held inside a callable" (graphtrace.owners path grammar): a partial's
#: arguments, a closure cell, default values
CALLABLE_STEPS = (".keywords[", ".args[", ".__closure__[", ".__defaults__", ".__kwdefaults__")


def suggest_fix(verdict: str, owners: Iterable[tuple[str, str, str]]) -> str:
    """The FIXES key for a storage's edges ("" when none applies): `verdict` is its verdict,
    `owners` its capture-time owners as (path, kind, status).

    An unrefreshed storage (its value is old, its storage right) -> recompute-in-place.
    Otherwise chosen from the owners that moved, most specific first: one inside a callable (partial
    keyword, closure) -> read-through-layer; a freed storage (dangling) -> recapture; a
    registered parameter or buffer -> copy-in-place; a plain attribute -> register-or-copy.
    """
    if verdict == "unrefreshed":  # the storage is right, its value old (Note [freshness])
        return "recompute-in-place"
    if verdict not in ("stale", "dangling", "diverged"):
        return ""
    moved = [(path, kind) for path, kind, status in owners if status == MOVED]
    if any(step in path for path, _ in moved for step in CALLABLE_STEPS):
        key = "read-through-layer"
    elif verdict == "dangling":
        key = "recapture"
    elif any(kind in ("parameter", "buffer") for _, kind in moved):
        key = "copy-in-place"
    elif moved:
        key = "register-or-copy"
    else:
        return ""
    assert key in FIXES
    return key
