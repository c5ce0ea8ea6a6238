"""A plug-in of the lineage graph: handles ops make from the storages they read, and the
sources a live handle lost (`DanglingSources`, Note [dangling sources]); the function mode
that sees the handle ops the dispatch mode cannot (`HandleMode`, Note [handle mode]).
"""

from __future__ import annotations

from typing import Callable, Mapping, NamedTuple

import torch
from torch.overrides import TorchFunctionMode

from graphtrace._compat import op_schema, weak_ref_expired
from graphtrace._schema import op_info
from graphtrace.clock import CLOCK
from graphtrace.lineage.ops import _PLAIN, _returns_handle, _walk

__all__ = ["DanglingSources", "Handle", "HandleMode", "handle_mode", "invisible_handle_ops",
           "MAX_PENDING"]

# Note [dangling sources]
# ~~~~~~~~~~~~~~~~~~~~~~~
# A *handle* is a value an op makes from storages it read that may keep a raw pointer to
# them: an op outside aten/prim whose schema returns an int (vLLM's
# `_C::create_onednn_scaled_mm_handler(Tensor b, Tensor b_scales, ...) -> int`, a pointer to
# a native oneDNN primitive) or a ScriptObject. An int handle reaches a tensor through
# `torch.tensor(value)` (`aten::lift_fresh`: vLLM's `handler_tensor`), which lineage links
# back to the op by value (only 1-element int64 tensors, only while an int handle is
# pending). The handle's storage (the pointer tensor, or the ScriptObject's proxy storage,
# Note [opaque handles]) becomes a lineage node derived from what the op read, so it is
# `derived_from` and can be `unrefreshed` like any derived storage ("opaque handles as
# derived"). When the handle is made, the registered parameters and buffers among its
# sources are named (a walk of the watched models' registered tensors, cached and redone
# only on a miss) and held by weak handles.
#
# Later, a handle that is alive while one of those named sources was freed reads through a
# pointer to freed memory, unless it copied what it needed. Lineage cannot tell a copy from
# a pointer (the op is native code), so it uses what the model says now: a freed source whose
# owner path now reaches a live tensor (the model keeps that value in *another* storage: a
# reload's temporary, copied back into the original parameter and dropped) is `dangling`; a
# freed source whose path reaches nothing (the holder released it on purpose after the
# handle consumed it: vLLM sets the int8 weight to None after prepacking it) is `released`,
# listed but not a verdict. A plain tensor derived from a freed source is never dangling: a
# fresh tensor holds values, not pointers (a rebound source makes it `unrefreshed`). A
# captured handle with a dangling source gets the verdict `dangling` from the verdict
# engine (graphtrace.verdict.freed_sources; the guard asks the same weak handles); every
# live handle with a freed source, captured or not, is a row of `Trace.findings()`
# and of the report's `findings` (no graph needed).

MAX_PENDING = 1024      # int handles waiting for their tensor (Note [dangling sources])


class Handle(NamedTuple):
    """A handle an op made (Note [dangling sources]): the op, and the registered parameters
    and buffers among its sources then, as (model, path, kind, StorageWeakRef, data_ptr,
    nbytes)."""

    op: str
    sources: tuple
    site: str = ""   # where it was made (provenance's site text)



class DanglingSources:
    """Note [dangling sources]: the handles ops made (by their storage's address), the int
    handles waiting for the tensor that will hold them, and the findings: every live handle
    with a named source freed since."""

    def __init__(self):
        # address -> Handle; value -> (Handle, sources)
        self.handles: dict[int, Handle] = {}
        self.pending: dict[int, tuple] = {}

    def record_handle(self, graph, func, kind: str, args, kwargs, out) -> None:
        """A handle op the dispatch mode does not see (`HandleMode`): every tensor argument
        is read."""
        reads: dict[int, torch.UntypedStorage] = {}
        written: list = []
        _walk(args, False, False, written, reads)
        if kwargs:
            _walk(kwargs, False, True, written, reads)
        if reads:
            self.handle(graph, func, kind, reads, graph.sources_of(reads), out)

    def handle(self, graph, func, kind: str, reads: dict, sources: dict,
               out) -> None:
        """An op made a handle from `reads` (whose sources, with theirs, are `sources`)."""
        site = graph.site() if graph.site is not None else None
        handle = Handle(op_info(func).name, graph.named(sources, reads),
                        site(func) if site is not None else "")
        if kind == "object":
            from graphtrace.opaque import is_opaque, proxy_storage

            for obj in (out if isinstance(out, (list, tuple)) else (out,)):
                if is_opaque(obj):
                    self._set_handle(graph, proxy_storage(obj), handle, sources)
            return
        for value in (out if isinstance(out, (list, tuple)) else (out,)):
            if isinstance(value, int) and not isinstance(value, bool):
                if len(self.pending) >= MAX_PENDING:
                    self.pending.pop(next(iter(self.pending)))
                self.pending[value] = (handle, sources)

    def lift(self, graph, out) -> None:
        """`torch.tensor(value)` (aten::lift_fresh) made `out`: the tensor that holds a
        pending int handle?"""
        if not self.pending or type(out) not in _PLAIN or out.dtype != torch.int64 \
                or out.numel() != 1:
            return
        found = self.pending.pop(int(out.item()), None)
        if found is not None:
            self._set_handle(graph, out.untyped_storage(), *found)

    def _set_handle(self, graph, storage: torch.UntypedStorage, handle: Handle,
                    sources: dict) -> None:
        self.handles[graph.write(storage, sources, full=True)] = handle

    def handle_at(self, address: int) -> Handle | None:
        """The handle whose storage is at `address` (its named sources join its `Derived`)."""
        return self.handles.get(address)

    def findings(self, graph, models: Mapping[str, torch.nn.Module]) -> list[dict]:
        """One row per live handle and named source freed since it was made (Note [dangling
        sources])."""
        from graphtrace.owners import resolve_path

        nodes = graph.nodes
        live = {a: h for a, h in self.handles.items()
                if a in nodes and not weak_ref_expired(nodes[a][0])}
        rows: list[dict] = []
        freed = {a: [s[:4] for s in h.sources if s[3].expired()] for a, h in live.items()}
        freed = {a: f for a, f in freed.items() if f}
        if not freed:
            return rows
        holders = graph.holders(set(freed), models)
        for a, sources in sorted(freed.items()):
            h = live[a]
            for model, path, kind, _ref in sources:
                try:
                    now = resolve_path(models[model], path) if model in models else None
                except Exception:
                    now = None
                status = "dangling" if isinstance(now, torch.Tensor) else "released"
                rows.append({"kind": f"{status} source",
                             "holder": "; ".join(sorted(holders.get(a, []))), "op": h.op,
                             "source": (f"{model}:" if model else "") + path,
                             "source_kind": kind, "site": h.site, "n": 1})
        return rows

    def forget(self, a: int) -> None:
        """The storage at address `a` died (the graph's sweep)."""
        self.handles.pop(a, None)

    def release(self) -> None:
        self.handles, self.pending = {}, {}


# -- handle ops with a composite kernel (Note [dangling sources]) -------------------------------

# Note [handle mode]
# ~~~~~~~~~~~~~~~~~~
# An op whose kernel is registered as CompositeImplicitAutograd (a C++ function given to
# `def` with no dispatch key: vLLM's `_C::create_onednn_scaled_mm_handler`) runs before the
# Python dispatch key and calls no other op, so provenance's dispatch mode never sees it.
# A TorchFunctionMode does (`torch.ops` calls go through `__torch_function__`). Lineage
# pushes one, `HandleMode`, only when such ops that make handles exist in this process
# (`invisible_handle_ops`: outside aten/prim, a tensor argument, an int or ScriptObject
# return, a composite kernel; found once per set of registered op names; looked for again
# every 256 ops when modules were imported and composite kernels registered since: vLLM
# registers `_C` after the trace may have opened), and only while provenance's mode is
# pushed and running; every other call it passes through after one dict lookup. It stays
# on the stack for the whole trace, capture regions included, so code compiled inside the
# trace is not compiled again there; code compiled outside the trace is compiled once more
# inside it (Dynamo guards on the function-mode stack), in processes with such ops only.
# Under Dynamo (`torch.compiler.is_compiling()`) it passes everything through; a function
# compiled while it is on the stack is compiled again once without it.

_INVISIBLE: dict = {}        # packet or overload -> (overload, "int" / "object")
_SCANNED = [-1]               # how many op names the last scan saw


def invisible_handle_ops() -> dict:
    """The handle ops the dispatch mode cannot see, by their packet and overloads (rescanned
    when the number of registered op names changed)."""
    from graphtrace._compat import HANDLE_OPS, all_op_names, has_kernel_for

    if not HANDLE_OPS:
        return _INVISIBLE
    names = all_op_names()
    if len(names) == _SCANNED[0]:
        return _INVISIBLE
    _SCANNED[0] = len(names)
    _INVISIBLE.clear()  # found again: a library that was destroyed takes its ops along
    for full in names:
        ns, _, rest = full.partition("::")
        if ns in ("aten", "prim", "prims") or not has_kernel_for(full, "CompositeImplicitAutograd"):
            continue
        try:
            packet = getattr(getattr(torch.ops, ns), rest.partition(".")[0])
            overloads = [getattr(packet, o) for o in packet.overloads()]
        except Exception:
            continue
        for overload in overloads:
            schema = op_schema(overload)
            kind = _returns_handle(overload, f"{ns}::x")
            if kind and any("Tensor" in str(a.type) for a in schema.arguments):
                _INVISIBLE[overload] = (overload, kind)
                if len(overloads) == 1:
                    _INVISIBLE[packet] = (overload, kind)
    return _INVISIBLE


class HandleMode(TorchFunctionMode):
    """Note [handle mode]. A class at module level: torch.compile's packages save the
    function-mode stack's types by name (vLLM's AOT compile)."""

    lineage_off = False

    def __init__(self, lineage, active: Callable[[], Callable[[], bool] | None]):
        super().__init__()
        self.lineage = lineage
        self.active = active

    def __reduce__(self):
        """torch.compile's packages pickle the function-mode stack (vLLM's AOT compile): an
        inert mode stands in for this one, with no lineage (nothing of the trace is saved)."""
        return (_inert_handle_mode, ())

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if torch.compiler.is_compiling():
            return out
        if CLOCK is not None:  # Note [self clock] in graphtrace/clock.py
            CLOCK.enter("lineage: handle mode")
        try:
            found = _INVISIBLE.get(func)
        except TypeError:  # an unhashable callable
            found = None
        if found is not None and not self.lineage_off and (self.active() or bool)():
            lineage = self.lineage
            try:
                lineage.record_handle(found[0], found[1], args, kwargs, out)
            except Exception as exc:  # fail open
                if lineage.fail is not None:
                    lineage.fail("lineage", exc)
        if CLOCK is not None:
            CLOCK.leave()
        return out


def _inert_handle_mode() -> HandleMode:
    mode = HandleMode(None, lambda: None)
    mode.lineage_off = True
    return mode


def handle_mode(lineage, active: Callable[[], Callable[[], bool] | None]):
    """A `HandleMode` for `lineage` when this process has invisible handle ops, else None.
    `active`: a weak method (no cycle through the mode) saying whether to note now."""
    if not invisible_handle_ops():
        return None
    return HandleMode(lineage, active)

