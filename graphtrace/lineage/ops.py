"""What lineage needs to know of an op, once per OpOverload: where its written arguments are,
whether it makes fresh storages, overwrites, makes a handle or reads the storage it writes
(`_op`), and the walk of one argument's tensors (`_walk`), for the graph and its plug-ins.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from graphtrace._compat import op_schema
from graphtrace._schema import op_info, tensors_in
from graphtrace.edges import OVERWRITES
from graphtrace.encoding import OUT_FRESH, WRITE

__all__: list[str] = []


_PLAIN = (torch.Tensor, torch.nn.Parameter)
# in-place ops whose new value of `self` does not depend on its old one (Note [non-idempotent
# steps]); every other `aten::name_` op reads the storage it writes
_SELF_FREE = frozenset({
    "copy_", "fill_", "zero_", "index_put_", "index_copy_", "index_fill_", "masked_fill_",
    "masked_scatter_", "set_", "resize_", "resize_as_", "uniform_", "normal_", "random_",
    "bernoulli_", "exponential_", "geometric_", "cauchy_", "log_normal_", "detach_",
    "requires_grad_", "as_strided_", "t_", "transpose_", "squeeze_", "unsqueeze_",
    "swapdims_", "swapaxes_", "scatter_.src", "scatter_.value", "copy_sparse_to_sparse_"})


class _Op(NamedTuple):
    """Per OpOverload: where its written arguments are and whether it can make new storages."""

    positional: tuple          # per positional argument: None, or True when it is written
    by_keyword: dict           # name -> True when written (tensor-carrying arguments only)
    fresh: bool                # some return is a fresh tensor
    writes: bool               # some argument is written
    overwrites: bool           # copy_ / fill_ / zero_: a full write replaces the sources
    handle: str                # "int" / "object": it returns a handle (Note [dangling sources])
    lift: bool                 # aten::lift_fresh: where `torch.tensor(int handle)` arrives
    self_reads: bool           # an in-place op whose new value depends on the old one


_OPS: dict = {}


def _op(func) -> _Op:
    found = _OPS.get(func)
    if found is None:
        info = op_info(func)
        positional = tuple(None if e is None else e[1] == WRITE for e in info.positional)
        by_keyword = {n: a == WRITE for n, a in info.by_keyword.values()}
        found = _OPS[func] = _Op(positional, by_keyword,
                                 any(r == OUT_FRESH for r in info.returns),
                                 any(by_keyword.values()), info.name in OVERWRITES,
                                 _returns_handle(func, info.name),
                                 info.name == "aten::lift_fresh", _self_reads(info.name))
    return found


def _self_reads(name: str) -> bool:
    """Does the in-place op `name` (`aten::mul_.Tensor`) read the `self` it writes?"""
    base = name.split("::", 1)[-1]
    stem = base.split(".", 1)[0]
    if stem.startswith("_foreach_"):  # torch.optim's multi-tensor updates
        stem = stem[len("_foreach"):]
    return stem.endswith("_") and not stem.startswith("_") and stem not in _SELF_FREE \
        and base not in _SELF_FREE


def _returns_handle(func, name: str) -> str:
    """"int" or "object" when `func` is an op outside aten/prim returning an int or a
    ScriptObject (Note [dangling sources]); "" otherwise."""
    if name.split("::", 1)[0] in ("aten", "prim"):
        return ""
    try:
        types = [str(r.type) for r in op_schema(func).returns]
    except Exception:
        return ""
    if any(t.startswith("__torch__.") for t in types):
        return "object"
    return "int" if any(t in ("int", "SymInt") for t in types) else ""


def _walk(value, writes: bool, keyword: bool, written: list, reads: dict) -> None:
    """The tensors of one argument (any nesting) as written (with whether the argument was a
    keyword, an `out=`) or as read storages by address: the slow path of `Lineage.record`."""
    for t in tensors_in(value):
        if writes:
            written.append((t, keyword))
            continue
        try:
            s = t.untyped_storage()
        except Exception:  # storage-less layouts: nothing to follow
            continue
        reads[s._cdata] = s

