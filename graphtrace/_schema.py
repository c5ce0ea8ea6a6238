"""Argument parsing: what an op does to each tensor it touches, read off its schema.

Kept apart from the recorder (as torch/cuda/_sanitizer.py keeps argument parsing apart
from event handling) and cached per `OpOverload`, so the dispatch hot path is one dict hit.
"""

from __future__ import annotations

import torch

from graphtrace._compat import (
    Argument,
    ClassType,
    JitType,
    OpOverload,
    is_traceable_wrapper_subclass,
    op_schema,
    tree_iter,
    tree_map_only,
)
from graphtrace.encoding import OUT_ALIAS, OUT_FRESH, OUT_MUTATED, READ, VIEW, WRITE

__all__ = ["OpInfo", "op_name", "parse_schema", "op_info", "plain_tensors", "tensors_in",
           "map_tensors", "NO_TENSORS"]


class OpInfo:
    """Per-OpOverload facts the recorder needs on every call."""

    __slots__ = ("name", "positional", "by_keyword", "returns", "may_alias", "opaque")

    def __init__(self, name: str, positional: tuple, by_keyword: dict, returns: tuple,
                 may_alias: bool, opaque: bool = False):
        self.name = name
        # positional[i] / by_keyword[name] = (argument name, access) for tensor-carrying args
        self.positional = positional
        self.by_keyword = by_keyword
        self.returns = returns  # one OUT_* per return slot
        # True when some input is `Tensor(a)`: the output may share its storage (views, and
        # ops like aten::to that alias only when nothing changes)
        self.may_alias = may_alias
        # True when some argument is a ScriptObject (a packed handle): recorded as an opaque
        # read (graphtrace.opaque), by the Python writer
        self.opaque = opaque


def op_name(func: OpOverload) -> str:
    """`aten::mm`, `aten::add.Tensor`, `graphtrace::permute_cols` (overload only when not default)."""
    schema = op_schema(func)
    return f"{schema.name}.{schema.overload_name}" if schema.overload_name else schema.name


def _carries_tensors(type_str: str) -> bool:
    return "Tensor" in type_str


# torch's distributed classes (a process group, a reduce op, a pending work): communicators
# that pack no tensors, so not opaque handles (a tensor-parallel forward's all_reduce reads one)
_NO_PACKED_TENSORS = ("__torch__.torch.classes.c10d.",)


def _carries_objects(t: JitType) -> bool:
    """A ScriptObject argument (`__torch__.torch.classes.quantized.LinearPackedParamsBase`),
    also inside Optional[...] or a list; not torch's communicators (`_NO_PACKED_TENSORS`)."""
    if isinstance(t, ClassType):
        return not t.qualified_name().startswith(_NO_PACKED_TENSORS)
    return any(_carries_objects(c) for c in t.containedTypes())


def _access_of(arg: Argument) -> int:
    info = arg.alias_info
    if info is None:
        return READ
    # `Tensor(a!)`: mutated in place or an out= buffer. `Tensor(a)`: aliased by the output, a view.
    return WRITE if info.is_write else VIEW


def parse_schema(func: OpOverload) -> OpInfo:
    schema = op_schema(func)
    positional = []
    by_keyword = {}
    opaque = False
    for arg in schema.arguments:
        entry = (arg.name, _access_of(arg)) if _carries_tensors(str(arg.type)) else None
        if entry is None and _carries_objects(arg.type):
            entry, opaque = (arg.name, READ), True
        if not arg.kwarg_only:
            positional.append(entry)
        if entry is not None:
            by_keyword[arg.name] = entry
    returns = []
    for ret in schema.returns:
        info = ret.alias_info
        if info is None:
            returns.append(OUT_FRESH)
        elif info.is_write:
            returns.append(OUT_MUTATED)
        else:
            returns.append(OUT_ALIAS)
    may_alias = any(access == VIEW for _, access in by_keyword.values())
    return OpInfo(op_name(func), tuple(positional), by_keyword, tuple(returns), may_alias, opaque)


_CACHE: dict = {}


def op_info(func) -> OpInfo:
    info = _CACHE.get(func)
    if info is None:
        info = _CACHE[func] = parse_schema(func)
    return info


# The types of what ops take and return besides tensors and containers: values that hold no
# tensor, kept as they are where a walk over an op's arguments looks for tensors (anything
# else it hands to pytree).
NO_TENSORS = frozenset({type(None), bool, int, float, complex, str, torch.dtype, torch.device,
                        torch.layout, torch.memory_format, torch.Size})


# Note [the tensor walker]
# ~~~~~~~~~~~~~~~~~~~~~~~~
# The one walk over what an op takes or returns, for the recorder (which storages an op
# touches), provenance (which storages an op made) and emulated graphs (pinning each tensor an
# op saw). The shapes ops really use (a tensor, a scalar, a plain tuple, list or dict of them)
# are walked here without pytree, which costs ~1 us per call; anything else (namedtuples,
# tensor subclasses, registered containers) goes through pytree. `tensors_in` flattens
# traceable wrapper subclasses to the plain tensors they hold (what an op really reads);
# `map_tensors` hands each tensor, subclass or not, to its function whole.
_PLAIN = (torch.Tensor, torch.nn.Parameter)


def tensors_in(value: object, opaque: bool = False):
    """The plain tensors in `value` (Note [the tensor walker]), and with `opaque` also the
    opaque handles (torch.ScriptObject) it holds."""
    tp = type(value)
    if tp is torch.Tensor or tp is torch.nn.Parameter:
        yield value
        return
    if tp in NO_TENSORS:
        return
    if tp is tuple or tp is list:
        for item in value:
            yield from tensors_in(item, opaque)
        return
    if tp is dict:
        for item in value.values():
            yield from tensors_in(item, opaque)
        return
    for item in tree_iter(value):
        if isinstance(item, torch.Tensor):
            yield from plain_tensors(item)
        elif opaque and isinstance(item, torch.ScriptObject):
            yield item


def map_tensors(fn, value: object) -> object:
    """`value` with every tensor in it replaced by `fn(tensor)` (Note [the tensor walker])."""
    tp = type(value)
    if tp is torch.Tensor or tp is torch.nn.Parameter:
        return fn(value)
    if tp in NO_TENSORS:
        return value
    if tp is tuple or tp is list:
        mapped = [map_tensors(fn, v) for v in value]
        return tuple(mapped) if tp is tuple else mapped
    return tree_map_only(torch.Tensor, fn, value)  # subclasses, dicts, namedtuples


def plain_tensors(t: torch.Tensor):
    """The plain tensors inside a traceable wrapper subclass (or the tensor itself): what an
    op really reads or writes when it is handed a subclass such as TwoTensor."""
    if is_traceable_wrapper_subclass(t):
        names, _ = t.__tensor_flatten__()
        for name in names:
            yield from plain_tensors(getattr(t, name))
    else:
        yield t
