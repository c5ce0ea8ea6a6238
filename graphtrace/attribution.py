"""Which watched module is running: the FQN id on top of this thread's `module_stack`.

Every recorded op is attributed to the innermost watched module running when it was
dispatched. Two ways keep the stack, chosen by `gt.trace(modules=...)`:

- ``"forward"`` (default): each watched module gets an instance attribute ``forward``, a
  method bound to it that pushes its id, runs ``type(module).forward`` and pops, and an
  instance ``_call_impl`` (Note [one frame per module call]); hooks cost more:
  docs/performance.md, "Module attribution: forward wrappers against hooks". Because it is
  a bound method, a ``copy.deepcopy`` of a watched module gets a wrapper bound to the copy (it
  computes with the copy's own forward and is attributed to nothing), and ``pickle`` stores
  it as ``getattr(module, "forward")``. Modules that already carry an instance ``forward`` (someone
  else's wrapper) get hooks instead, so theirs is never shadowed.
- ``"hooks"``: a forward pre-hook and an ``always_call`` forward hook per module; slower, but
  ``module.forward`` stays untouched (for code that needs the very attribute).

Both are removed at trace exit, and paused while the model serves (Note [attribution while
serving] below). Under ``torch.compile`` Dynamo inlines wrappers and hooks, and both check
``torch.compiler.is_dynamo_compiling()`` first: in a graph they only call the class forward,
so its guards never see the stack, and ops inside compiled code are not attributed. Modules
that Dynamo's cached graphs already inlined get hooks even under ``"forward"``
(`compiled_inside`): hooks added after a compile are not guarded
(``torch._dynamo.config.skip_nnmodule_hook_guards``). The wrappers' frames are marked for
Dynamo to skip (`_dynamo_skips_wrapper`).
"""

from __future__ import annotations

import sys
import types
import weakref
from typing import Any, Callable

import torch

from graphtrace._compat import (
    DYNAMO_CACHE,
    MODULE_CALL_CODE,
    MODULE_FAST_PATH,
    MODULE_WRAPPED_CALL_CODE,
    dynamo_cache_entries,
    dynamo_skip_code,
)
from graphtrace.recorder import module_stack

MODES = ("forward", "hooks", "off")

# False when run, True where Dynamo traces it (it then never reads the stack)
_dynamo_compiling = torch.compiler.is_dynamo_compiling

# id(module) -> FQN id, for the modules whose forward is wrapped by the open trace (one trace
# is open at a time). A module missing here runs its plain forward, unattributed.
_fqn_ids: dict[int, int] = {}
if MODULE_FAST_PATH is not None:
    _MODULE_CALL_IMPL, _tracing_state, _global_hooks = MODULE_FAST_PATH
else:  # pragma: no cover - every tested torch has them: no one-frame call
    _MODULE_CALL_IMPL, _tracing_state, _global_hooks = None, None, ({}, {}, {}, {})
_global_forward_pre, _global_forward, _global_backward_pre, _global_backward = _global_hooks


def forward(self, *args, **kwargs):
    """graphtrace's attribution wrapper around ``type(self).forward`` (see module docstring)."""
    if _dynamo_compiling():  # Dynamo traces the class forward alone: no guard on the stack
        return type(self).forward(self, *args, **kwargs)
    fqn = _fqn_ids.get(id(self))
    if fqn is None:
        return type(self).forward(self, *args, **kwargs)
    stack = module_stack.stack
    stack.append(fqn)
    try:
        return type(self).forward(self, *args, **kwargs)
    finally:
        stack.pop()


# Note [one frame per module call]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# A module call runs `Module.__call__` (`_wrapped_call_impl`), then `self._call_impl`, then
# `self.forward`: a forward wrapper alone adds a fourth Python frame, and with it an argument
# tuple and a keyword dict, per module call (measured: most of attribution's cost on a model
# that makes one module call per op; docs/performance.md, "A short script"). So a wrapped
# module also gets an instance `_call_impl` (`call`), which `_wrapped_call_impl` finds
# before the class's: on `nn.Module._call_impl`'s fast path -- no hooks on the module or
# global, no JIT tracing -- it pushes, runs `type(module).forward` and pops, in the frame
# torch's `_call_impl` would have run; the forward wrapper is not called. Otherwise (a hook,
# JIT tracing, Dynamo tracing it, someone else's `forward` or class `_call_impl` installed
# since) it hands the call to the class's `_call_impl`, which calls the forward wrapper as
# before: ops in hooks stay with the caller's module, ops in forward with this one, as with
# the wrapper alone. The fast-path test is the one `_call_impl` makes (the same eight hook
# tables and `torch._C._get_tracing_state()`), so the two paths cannot disagree on which a
# call takes. A module whose `_call_impl` someone else replaced on the instance keeps it (and
# the forward wrapper alone). Each module's `call` is its own function object whose closure
# cells hold the module's FQN id, forward wrapper, class forward and that forward bound to the
# module (`_call_for`), so a call reads them without a lookup and calls the forward with its
# own argument tuple (a call as `type(self).forward(self, *args)` builds a list and a tuple
# first); the test that `type(self).forward` is still that class forward sends a call to the
# class's `_call_impl` once someone replaced it, and the test that `self.forward` is still the
# wrapper is what tells a module's own call from a copy's. Removed with the wrapper; a deep
# copy gets a `call` bound to the copy, whose `forward` is not the wrapper in the cells, so it
# hands over to the class's `_call_impl`; pickle stores it as `getattr(module, "_call_impl")`,
# the class's.
# With the native recorder each module's `call` runs in C, no Python frame at all (Note
# [native module call] in graphtrace/csrc/recorder.cpp; `_call_for`): the same function, so
# all of the above holds, and Dynamo still inlines its bytecode.


def _call_with(fid: int, wrapper: Any, forward: Any, cls_forward: Any) -> Callable:
    """`call` with its module's values in closure cells (Note [one frame per module call])."""
    def call(self, *args, **kwargs):
        """graphtrace's `_call_impl` of a wrapped module (Note [one frame per module call])."""
        if (_dynamo_compiling() or self._forward_pre_hooks or self._forward_hooks
                or self._backward_pre_hooks or self._backward_hooks
                or _global_forward_pre or _global_forward or _global_backward_pre
                or _global_backward or _tracing_state() or self.forward is not wrapper
                or type(self)._call_impl is not _MODULE_CALL_IMPL
                or type(self).forward is not cls_forward):
            return type(self)._call_impl(self, *args, **kwargs)
        stack = module_stack.stack
        stack.append(fid)
        try:
            return forward(*args, **kwargs)
        finally:
            stack.pop()
    return call


call = _call_with(-1, None, None, None)  # the code every module's copy runs; its own cells: `_call_for`
_CALL_CELLS = call.__code__.co_freevars  # the order of `call.__closure__`'s cells


# id() of each recorder extension told where `call`'s stack, global hooks and cells are
# (Note [native module call] in graphtrace/csrc/recorder.cpp)
_configured: set[int] = set()


def _native_calls(native) -> bool:
    """Whether `native` (the recorder extension, or None) can run module calls, configured."""
    if native is None or _MODULE_CALL_IMPL is None:
        return False
    if id(native) not in _configured:
        native.configure_calls(module_stack, _global_hooks, _MODULE_CALL_IMPL,
                               (len(_CALL_CELLS), _CALL_CELLS.index("fid"),
                                _CALL_CELLS.index("wrapper"), _CALL_CELLS.index("cls_forward")))
        _configured.add(id(native))
    return True


_frame_skipped = False


def _dynamo_skips_wrapper() -> None:
    """Tell Dynamo to run the wrapper's frame as is and to look at the frames it calls: a
    module compiled before the trace opened then enters its cached graph at the class forward,
    as without the trace, instead of compiling the wrapper as a new frame (a recompile)."""
    global _frame_skipped
    if _frame_skipped:
        return
    _frame_skipped = True
    try:
        dynamo_skip_code(forward.__code__)
        dynamo_skip_code(call.__code__)
    except (ImportError, AttributeError):  # a torch without Dynamo: nothing compiles frames
        return


def compiled_inside(model: torch.nn.Module) -> set[int]:
    """ids of the modules of `model` that Dynamo's cached graphs may have inlined: those below
    a module whose class forward Dynamo compiled (a frame it enters), and every module under
    one that `Module.compile()` compiled (its `_call_impl` is the frame). Their graphs guard on
    each inlined module's `__dict__` having no `forward`, so an instance wrapper there would
    make Dynamo compile again. An entry module keeps its wrapper (`_dynamo_skips_wrapper`)."""
    if not DYNAMO_CACHE:  # warned at import (graphtrace._compat)
        return set()
    compiled_codes: dict = {}

    def entry(module) -> bool:
        code = getattr(type(module).forward, "__code__", None)
        if code is None:
            return False
        if code not in compiled_codes:
            compiled_codes[code] = bool(dynamo_cache_entries(code))
        return compiled_codes[code]

    inside: set[int] = set()
    seen: set[tuple[int, bool]] = set()
    stack = [(model, False)]  # iterative, each module at most twice (outside, then under a
    while stack:              # compiled one): module trees may be deep, shared or cyclic
        module, under = stack.pop()
        if (id(module), under) in seen:
            continue
        seen.add((id(module), under))
        if under:
            inside.add(id(module))
        if getattr(module, "_compiled_call_impl", None) is not None:
            inside.add(id(module))
            under = True
        elif entry(module):
            under = True
        stack.extend((child, under) for child in module.children())
    return inside


def _push_hook(fqn: int, live: list[bool]) -> Callable:
    def push(module, args):  # `live`: not after a pause removed the pop hook mid-call
        if not _dynamo_compiling() and live[0]:
            module_stack.stack.append(fqn)
    return push


def _pop_hook(fqn: int) -> Callable:
    def pop(module, args, output):
        if not _dynamo_compiling():
            stack = module_stack.stack
            if stack and stack[-1] == fqn:  # not pushed when the hooks came mid-call
                stack.pop()
    return pop


def is_wrapper(method: object) -> bool:
    """Whether `method` is one of graphtrace's bound forward wrappers."""
    return (isinstance(method, types.MethodType)
            and getattr(method.__func__, "__code__", None) is forward.__code__)


def is_call(method: object) -> bool:
    """Whether `method` is one of graphtrace's bound `_call_impl` overrides."""
    return (isinstance(method, types.MethodType)
            and getattr(method.__func__, "__code__", None) is call.__code__)


def is_keeper(method: object) -> bool:
    """Whether `method` is one of graphtrace's bound forward wrappers or `_call_impl`
    overrides: what an owner walk steps over (they reach the module and graphtrace's own
    cells, never a user's tensor)."""
    return is_wrapper(method) or is_call(method)


def _call_cells(module: torch.nn.Module, fid: int, wrapper: types.MethodType) -> dict:
    """What a module's `call` reads from its cells, by cell name."""
    cls_forward = type(module).forward
    return {"fid": fid, "wrapper": wrapper, "cls_forward": cls_forward,
            "forward": types.MethodType(cls_forward, module)}


def _call_for(module: torch.nn.Module, fid: int, wrapper: types.MethodType,
              native=None) -> types.MethodType:
    """`call` bound to `module`, with its own cells (Note [one frame per module call]); run in
    C where `native` (the recorder extension) can (Note [native module call])."""
    cells = {k: types.CellType(v) for k, v in _call_cells(module, fid, wrapper).items()}
    fn = types.FunctionType(call.__code__, call.__globals__, "_call_impl", None,
                            tuple(cells[name] for name in _CALL_CELLS))
    if _native_calls(native):
        native.set_native_call(fn)
    return types.MethodType(fn, module)


def _wrapper_for(module: torch.nn.Module) -> types.MethodType:
    """`forward` bound to `module`, as its own function object whose `__wrapped__` is the class
    forward, so that `inspect.signature(module.forward)` reads the real signature."""
    fn = types.FunctionType(forward.__code__, forward.__globals__, "forward")
    cls_forward = type(module).forward
    fn.__wrapped__ = cls_forward
    fn.__qualname__ = getattr(cls_forward, "__qualname__", "forward")
    fn.__doc__ = getattr(cls_forward, "__doc__", None)
    return types.MethodType(fn, module)


# Note [attribution while serving]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# Only a capture's writer reads the module stack. So under the rule of Note [recording while
# serving] (graphtrace/tracing/rule.py) the keepers are off while the model serves: when the rule
# pauses provenance and lineage, `pause()` removes the wrappers and hooks (and the trace its
# serve hooks), and a serving forward runs `nn.Module._call_impl`'s fast path, as with no
# trace. `resume()` puts them back, on every watched model's modules as they are then, when an
# update begins (the rule resumes), when the rule is taken over by hand, and for each capture
# region opened while paused (on any thread: the last region to close pauses them again).
# - Dynamo: a graph compiled with a keeper in place guards on it (a wrapper's code, the
#   length of a module's `_forward_hooks`), and one compiled without on its absence. So
#   `pause()` keeps the keepers of the modules `compiled_inside` finds (their graphs may have
#   inlined them), and a module compiled while paused gets hooks at `resume()`, as one compiled
#   before the trace does; nothing else a graph sees changes (the keepers skip the stack under
#   Dynamo). A graph that inlined a module outside the watched models (a compiled function
#   calling a submodule) is not found, and compiles once more.
# - A capture opened inside forwards that began while paused (an engine capturing a new size
#   lazily): `seed()` puts the watched modules whose `_call_impl` frames run on this thread on
#   its stack, and `unseed()` takes them off when the region closes. A module whose hooks were
#   read by a call begun before the pause pushes nothing (its `live` flag), since its pop hook
#   is gone by the end of that call.


class ModuleAttribution:
    """Installs and removes the module stack keepers of one trace; pauses them while the
    model serves (Note [attribution while serving])."""

    __slots__ = ("mode", "wrapped", "hooks", "seen", "ids", "models", "fqn_id", "paused",
                 "native")

    def __init__(self, mode: str = "forward"):
        if mode not in MODES:
            raise ValueError(f"modules must be one of {', '.join(map(repr, MODES))}; got {mode!r}")
        self.mode = mode
        self.wrapped: list[torch.nn.Module] = []
        # id(module) -> (its hooks' push flag, False once they are removed; their handles)
        self.hooks: dict[int, tuple[list[bool], Any, Any]] = {}
        self.seen: set[int] = set()
        self.ids: dict[int, int] = {}  # id(module) -> FQN id, every module attributed now
        self.models: list[tuple[weakref.ref, str]] = []  # (model, prefix), in watch order
        self.fqn_id: Callable[[str], int] | None = None
        self.paused = False
        # the recorder extension that runs module calls (Note [native module call]), or None:
        # the Python `call`. Set by the trace.
        self.native = None

    def install(self, model: torch.nn.Module, fqn_id: Callable[[str], int], prefix: str = "") -> None:
        """Attribute ops to every module of `model`; a module shared with an earlier model keeps
        its first name. While paused, `model` is remembered and attributed from `resume()`."""
        if self.mode == "off":
            return
        self.fqn_id = fqn_id
        self.models.append((weakref.ref(model), prefix))
        if not self.paused:
            self._attach(model, prefix)

    def _attach(self, model: torch.nn.Module, prefix: str) -> None:
        wrap = self.mode == "forward"
        inlined = compiled_inside(model) if wrap else set()
        if wrap:
            _dynamo_skips_wrapper()
        for fqn, module in model.named_modules():
            if id(module) in self.seen:
                continue
            self.seen.add(id(module))
            fid = self.fqn_id(prefix + fqn)
            self.ids[id(module)] = fid
            mine = module.__dict__.get("forward")
            if wrap and is_wrapper(mine) and mine.__self__ is module:  # kept while paused
                _fqn_ids[id(module)] = fid
                self._fast_call(module, fid, mine)
                self.wrapped.append(module)
                continue
            if id(module) in self.hooks:  # kept while paused
                continue
            if (wrap and id(module) not in inlined and "forward" not in module.__dict__
                    and not isinstance(module, torch.jit.ScriptModule)):
                wrapper = module.__dict__["forward"] = _wrapper_for(module)
                _fqn_ids[id(module)] = fid
                self._fast_call(module, fid, wrapper)
                self.wrapped.append(module)
                continue
            live = [True]
            self.hooks[id(module)] = (
                live, module.register_forward_pre_hook(_push_hook(fid, live)),
                module.register_forward_hook(_pop_hook(fid), always_call=True))

    def _fast_call(self, module: torch.nn.Module, fid: int, wrapper: types.MethodType) -> None:
        """The one-frame call of a wrapped module (Note [one frame per module call])."""
        mine = module.__dict__.get("_call_impl")
        if _MODULE_CALL_IMPL is None:
            return
        if mine is None and type(module)._call_impl is _MODULE_CALL_IMPL:
            module.__dict__["_call_impl"] = _call_for(module, fid, wrapper, self.native)
        elif is_call(mine) and mine.__self__ is module:  # kept while paused: its id now
            cells = dict(zip(_CALL_CELLS, mine.__func__.__closure__))
            for name, value in _call_cells(module, fid, wrapper).items():
                cells[name].cell_contents = value

    def _detach(self, keep: set[int] = frozenset()) -> None:
        """Remove the keepers, but those of the modules in `keep`."""
        kept = []
        for module in self.wrapped:
            if id(module) in keep:
                kept.append(module)
                continue
            _fqn_ids.pop(id(module), None)
            c = module.__dict__.get("_call_impl")
            if is_call(c) and c.__self__ is module:
                del module.__dict__["_call_impl"]
            f = module.__dict__.get("forward")
            if is_wrapper(f) and f.__self__ is module:  # leave alone whatever replaced it since
                del module.__dict__["forward"]
        for key in [k for k in self.hooks if k not in keep]:
            live, pre, post = self.hooks.pop(key)
            live[0] = False  # a call that read its hooks before the removal pushes nothing
            pre.remove()
            post.remove()
        self.wrapped = kept
        self.seen.clear()
        self.ids.clear()

    def pause(self) -> None:
        """The model serves: remove the keepers until `resume()`, but those of modules
        `compiled_inside` finds (Note [attribution while serving])."""
        if self.mode == "off" or self.paused:
            return
        self.paused = True
        keep: set[int] = set()
        if self.wrapped or self.hooks:
            for ref, _ in self.models:
                model = ref()
                if model is not None:
                    keep |= compiled_inside(model)
        self._detach(keep)

    def resume(self) -> None:
        """Attribute again every watched model's modules, as they are now."""
        if self.mode == "off" or not self.paused:
            return
        self.paused = False
        live = [(ref(), prefix) for ref, prefix in self.models]
        self.models = [(weakref.ref(m), p) for m, p in live if m is not None]
        for model, prefix in live:
            if model is not None:
                self._attach(model, prefix)

    def uninstall(self) -> None:
        self._detach()
        self.models.clear()
        self.paused = False

    def seed(self) -> list[int]:
        """A capture opens on this thread: put on its module stack the attributed modules whose
        calls began while the keepers were off (`nn.Module._call_impl` frames running on this
        thread, outermost first, and `__call__` frames with none below them: a native `call`
        runs no frame), when the stack holds the outer part of them; what was put."""
        if self.mode == "off" or not self.ids:
            return []
        walked = []
        impls = (MODULE_CALL_CODE, call.__code__)
        frame, callee = sys._getframe(1), None
        while frame is not None:
            code = frame.f_code
            if any(code is c for c in impls) or (
                    code is MODULE_WRAPPED_CALL_CODE
                    and (callee is None or not any(callee.f_code is c for c in impls))):
                # a `_call_impl` frame, or `__call__` straight into forward: a native call
                fid = self.ids.get(id(frame.f_locals.get("self")))
                if fid is not None:
                    walked.append(fid)
            frame, callee = frame.f_back, frame
        walked.reverse()
        stack = module_stack.stack
        n = len(stack)
        if len(walked) <= n or stack != walked[:n]:
            return []
        missing = walked[n:]
        stack.extend(missing)
        return missing

    @staticmethod
    def unseed(seeded: list[int]) -> None:
        """The capture closes: take off what `seed()` put there, if it is still on top."""
        if seeded:
            stack = module_stack.stack
            if stack[-len(seeded):] == seeded:
                del stack[-len(seeded):]


__all__ = ["ModuleAttribution", "MODES", "is_wrapper", "is_keeper", "compiled_inside"]
