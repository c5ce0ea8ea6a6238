"""How one capture record packs into integers: the one home of the layout (imports no torch).

A capture stores each recorded tensor as `ACCESS_FIELDS` int64s (see `Capture.accesses`):

    seq                                  the op's position in its capture
    code = arg id << ACCESS_BITS | access    the argument's interned name and its access
    slot = storage id << SID_SHIFT | view id  the storage and the interned (dtype, shape,
                                              stride, offset) view of it

graphtrace/csrc/recorder.cpp writes the same rows: it defines these constants once at its
top under the same names (kRead, kAccessBits, ...) and exports them from the extension
module, and tests/test_native.py checks the two agree.
"""

from __future__ import annotations

import numpy as np

from graphtrace.vocab import ACCESS_KINDS

__all__ = [
    "READ", "WRITE", "VIEW", "FACTORY", "ACCESS_BITS", "ACCESS_MASK", "SID_SHIFT", "VIEW_MASK",
    "ACCESS_FIELDS", "REPLAY_WROTE", "REPLAY_FRESH", "OUT_FRESH", "OUT_ALIAS", "OUT_MUTATED",
    "NATIVE_CONSTANTS", "pack_code", "code_access", "with_access", "pack_slot", "slot_storage",
    "unpack_rows",
]

# -- access (per recorded tensor): the index of its name in vocab.ACCESS_KINDS --------------
READ, WRITE, VIEW, FACTORY = (ACCESS_KINDS.index(a) for a in ("read", "write", "view", "factory"))

ACCESS_BITS = 2                       # low bits of a code that hold the access
ACCESS_MASK = (1 << ACCESS_BITS) - 1
SID_SHIFT = 32                        # a slot's storage id sits above its view id
VIEW_MASK = (1 << SID_SHIFT) - 1
ACCESS_FIELDS = 3                     # int64s per record: seq, code, slot

# -- replay flags: what a writer's record() returns, what an EmulatedGraph replays ----------
REPLAY_WROTE = 1   # the op wrote one of its inputs in place
REPLAY_FRESH = 2   # the op made a fresh output (replay copies it into the captured one)

# -- what the returns of an op are, per schema return slot (graphtrace._schema) -------------
OUT_FRESH, OUT_ALIAS, OUT_MUTATED = 0, 1, 2

# The names the native extension exports too (tests/test_native.py compares the values).
NATIVE_CONSTANTS = ("READ", "WRITE", "VIEW", "FACTORY", "ACCESS_BITS", "ACCESS_MASK",
                    "SID_SHIFT", "ACCESS_FIELDS", "REPLAY_WROTE", "REPLAY_FRESH")


def pack_code(arg: int, access: int) -> int:
    """A record's code: the argument's name id and its access."""
    return (arg << ACCESS_BITS) | access


def code_access(code: int) -> int:
    """The access of a record's code."""
    return code & ACCESS_MASK


def with_access(code: int, access: int) -> int:
    """The same argument's code with another access."""
    return (code & ~ACCESS_MASK) | access


def pack_slot(sid: int, view: int) -> int:
    """A record's slot: the storage id and the view id."""
    return (sid << SID_SHIFT) | view


def slot_storage(slot: int) -> int:
    """The storage id of a record's slot."""
    return slot >> SID_SHIFT


def unpack_rows(records, out: dict[str, np.ndarray]) -> None:
    """Unpack one capture's records (a buffer of int64s) into the columns of `out`, in place:
    `seq`, `arg`, `access`, `storage_id` and `view` (numpy casts to each column's dtype)."""
    rows = np.frombuffer(records, dtype=np.int64).reshape(-1, ACCESS_FIELDS)
    code, slot = rows[:, 1], rows[:, 2]
    out["seq"][:] = rows[:, 0]
    np.right_shift(code, ACCESS_BITS, out=out["arg"], casting="unsafe")
    np.bitwise_and(code, ACCESS_MASK, out=out["access"], casting="unsafe")
    np.right_shift(slot, SID_SHIFT, out=out["storage_id"], casting="unsafe")
    np.bitwise_and(slot, VIEW_MASK, out=out["view"], casting="unsafe")
