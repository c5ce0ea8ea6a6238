"""The recording mode: bookkeeping of every storage each op touches during a capture.

The mode runs the op, then appends a few integers per tensor to columnar arrays. Names,
strings and DataFrames are built later, in `diff()`. Storages are held by weak reference
only (the raw `_weak_ref` handle that `StorageWeakRef` wraps): a held weak reference keeps
the StorageImpl allocation, and so its address, unique without keeping its data alive, so
the handle is the storage's identity and `_expired` tells whether it was freed.
"""

from __future__ import annotations

import threading
import traceback
from array import array

import torch
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_iter

from graphtrace._schema import FACTORY, OUT_MUTATED, READ, VIEW, WRITE, op_info



class _ModuleStack(threading.local):
    def __init__(self):
        self.stack: list[int] = []


# Per-thread stack of the innermost watched module running (its FQN id), kept by module hooks.
module_stack = _ModuleStack()

# One access is three int64s: seq, (arg id << 2 | access kind), (storage id << 32 | view id).
ACCESS_FIELDS = 3


class Interner:
    """Strings and small tuples to dense ints, so records stay integers."""

    __slots__ = ("ids", "items")

    def __init__(self):
        self.ids: dict = {}
        self.items: list = []

    def __call__(self, item) -> int:
        i = self.ids.get(item)
        if i is None:
            i = self.ids[item] = len(self.items)
            self.items.append(item)
        return i


class StorageTable:
    """Every storage seen by any capture of one trace, by weak handle; never a strong ref."""

    __slots__ = ("index", "handles", "data_ptrs", "nbytes", "devices", "_device_names", "_lock",
                 "__weakref__")

    def __init__(self):
        self.index: dict[int, int] = {}  # weak handle (StorageImpl address) -> storage id
        self.handles = array("q")
        self.data_ptrs = array("q")
        self.nbytes = array("q")
        self.devices: list[str] = []
        self._device_names: dict = {}
        self._lock = threading.Lock()

    def lookup(self, storage: torch.UntypedStorage) -> int:
        sid = self.index.get(storage._cdata)
        if sid is not None:
            return sid
        device = storage.device
        name = self._device_names.get(device)
        if name is None:
            name = self._device_names[device] = str(device)
        with self._lock:
            sid = self.index.get(storage._cdata)
            if sid is None:
                handle = storage._weak_ref()
                sid = len(self.handles)
                self.handles.append(handle)
                self.data_ptrs.append(storage.data_ptr())
                self.nbytes.append(storage.nbytes())
                self.devices.append(name)
                self.index[handle] = sid
        return sid

    def alive(self, sid: int) -> bool:
        return not torch.UntypedStorage._expired(self.handles[sid])

    def upgrade(self, sid: int) -> torch.UntypedStorage | None:
        """A strong reference to a still-alive storage, for value checks in diff()."""
        if not self.alive(sid):
            return None
        return torch.UntypedStorage._new_with_weak_ptr(self.handles[sid])

    def release(self) -> None:
        free = torch.UntypedStorage._free_weak_ref
        for handle in self.handles:
            free(handle)
        self.handles = array("q")
        self.index.clear()

    def __del__(self):
        try:
            self.release()
        except Exception:  # interpreter shutdown: torch may already be gone
            pass


class Capture:
    """The columnar records of one captured graph."""

    __slots__ = ("graph_id", "label", "kind", "thread", "ops", "op_modules", "accesses", "info")

    def __init__(self, graph_id: int, label: str, kind: str):
        self.graph_id = graph_id
        self.label = label
        self.kind = kind  # "emulated" or "cuda"
        self.thread = threading.current_thread().name
        self.ops = array("i")          # op name id, per op
        self.op_modules = array("i")   # module FQN id (-1 unknown), per op
        self.accesses = array("q")     # ACCESS_FIELDS int64s per access
        self.info: dict = {}           # pool, stream, ... where known

    @property
    def n_ops(self) -> int:
        return len(self.ops)

    @property
    def n_accesses(self) -> int:
        return len(self.accesses) // ACCESS_FIELDS


_SCALARS = (type(None), int, float, bool, str)


def _plain_tensors(t: torch.Tensor):
    """The plain tensors inside a traceable wrapper subclass (or the tensor itself)."""
    if is_traceable_wrapper_subclass(t):
        names, _ = t.__tensor_flatten__()
        for name in names:
            yield from _plain_tensors(getattr(t, name))
    else:
        yield t


def _code(arg: int, access: int) -> int:
    return (arg << 2) | access


class _Plan:
    """An op's schema facts with this trace's name ids filled in: one dict hit per call."""

    __slots__ = ("op_id", "positional", "by_keyword", "returns", "may_alias")

    def __init__(self, func, names: "Interner"):
        info = op_info(func)
        self.op_id = names(info.name)
        # each tensor argument as its row code (arg id << 2 | access kind), ready to append
        self.positional = tuple(None if e is None else _code(names(e[0]), e[1])
                                for e in info.positional)
        self.by_keyword = {k: _code(names(e[0]), e[1]) for k, e in info.by_keyword.items()}
        self.may_alias = info.may_alias
        n = len(info.returns)
        # each return slot as its arg id << 2 (access bits added per call), None when mutated
        self.returns = tuple(None if slot == OUT_MUTATED
                             else names("out" if n == 1 else f"out{i}") << 2
                             for i, slot in enumerate(info.returns))


class RecordingMode(TorchDispatchMode):
    """Runs each op, then records (op, argument, access, storage, view) for every tensor.

    One instance per capture region, entered on the capturing thread only (dispatch mode
    stacks are thread-local, so two threads capturing at once never mix records).
    """

    def __init__(self, recorder: "Recorder", capture: Capture, emulated=None):
        super().__init__()
        self.recorder = recorder
        self.capture = capture
        self.emulated = emulated  # an EmulatedGraph that keeps (op, args, outputs) for replay
        self._plans = recorder.plans
        self._lookup = recorder.storages.lookup
        self._index = recorder.storages.index
        self._views = recorder.views
        self._slots: dict = {}  # (storage, dtype, shape, stride, offset) -> sid << 32 | view id
        self._append = capture.accesses.extend

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        """Observe, never alter: without this, Dynamo skips (de-compiles) every compiled frame
        run under the mode, for the rest of the process. The price: kernels fused by Inductor
        launch without the dispatcher and are not recorded (a blind spot the report names)."""
        return True

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if kwargs is None:
            kwargs = {}
        out = func(*args, **kwargs)
        try:
            replay = self._record(func, args, kwargs, out)
            if self.emulated is not None:
                self.emulated._keep(func, args, kwargs, out, replay)
        except Exception as exc:  # fail open: never break the traced program
            self.recorder.fail(f"recording {func}", exc)
        return out

    def _record(self, func, args, kwargs, out) -> int:
        """Append one row per tensor; return what replay must do (1: writes, 2: fresh outputs).

        The plain-tensor case is inlined: this loop runs for every argument of every op, and
        one dict hit on (storage, view) finds both ids for any tensor seen before.
        """
        plan = self._plans.get(func)
        if plan is None:
            plan = self._plans[func] = _Plan(func, self.recorder.names)
        cap = self.capture
        seq = len(cap.ops)
        cap.ops.append(plan.op_id)
        stack = module_stack.stack
        cap.op_modules.append(stack[-1] if stack else -1)
        slots, append = self._slots, self._append
        start = len(cap.accesses)
        inputs: list[int] = []
        wrote = False
        for value, code in zip(args, plan.positional):
            if code is None:
                continue
            tp = type(value)
            if tp is torch.Tensor or tp is torch.nn.Parameter:
                key = (value.untyped_storage()._cdata, value.dtype, value.shape, value.stride(),
                       value.storage_offset())
                slot = slots.get(key)
                if slot is None:
                    slot = self._slot(key, value)
                append((seq, code, slot))
                inputs.append(slot >> 32)
                wrote |= (code & 3) == WRITE
            elif tp not in _SCALARS:
                wrote |= self._put(seq, code, value, inputs)
        if kwargs:
            for name, value in kwargs.items():
                code = plan.by_keyword.get(name)
                if code is not None and type(value) not in _SCALARS:
                    wrote |= self._put(seq, code, value, inputs)
        fresh = False
        end_inputs = len(cap.accesses)
        if type(out) is torch.Tensor:
            name = plan.returns[0] if plan.returns else None
            if name is not None:  # None: a mutated argument, already recorded as a write
                key = (out.untyped_storage()._cdata, out.dtype, out.shape, out.stride(),
                       out.storage_offset())
                slot = slots.get(key)
                if slot is None:
                    slot = self._slot(key, out)
                fresh = (slot >> 32) not in inputs  # else a view (`_unsafe_view` claims fresh)
                append((seq, name | (FACTORY if fresh else VIEW), slot))
        elif isinstance(out, (tuple, list)):
            returns = plan.returns
            for i, value in enumerate(out):
                name = returns[i] if i < len(returns) else None
                if name is not None:
                    for item in tree_iter(value):
                        if isinstance(item, torch.Tensor):
                            fresh |= self._put_output(seq, name, item, inputs)
        elif isinstance(out, torch.Tensor) and plan.returns and plan.returns[0] is not None:
            fresh = self._put_output(seq, plan.returns[0], out, inputs)
        if plan.may_alias:
            self._unalias(start, end_inputs)
        return (1 if wrote else 0) | (2 if fresh else 0)

    def _unalias(self, start: int, end_inputs: int) -> None:
        """`Tensor(a) self` may alias the output or not (`aten::to` copies on a dtype change):
        an input the schema calls a view is a read when no output shares its storage."""
        rows = self.capture.accesses
        shared = {rows[i] >> 32 for i in range(end_inputs + 2, len(rows), ACCESS_FIELDS)}
        for i in range(start + 1, end_inputs, ACCESS_FIELDS):
            code = rows[i]
            if (code & 3) == VIEW and (rows[i + 1] >> 32) not in shared:
                rows[i] = (code & ~3) | READ

    def _slot(self, key: tuple, t: torch.Tensor) -> int:
        """(storage id << 32 | view id) for a tensor not seen in this capture yet."""
        sid = self._lookup(t.untyped_storage())
        slot = (sid << 32) | self._views(key[1:])
        self._slots[key] = slot
        return slot

    def _row(self, seq: int, code: int, t: torch.Tensor) -> int:
        key = (t.untyped_storage()._cdata, t.dtype, t.shape, t.stride(), t.storage_offset())
        slot = self._slots.get(key)
        if slot is None:
            slot = self._slot(key, t)
        self._append((seq, code, slot))
        return slot >> 32

    def _put(self, seq: int, code: int, value, inputs: list) -> bool:
        """Tensors inside subclasses and containers (Tensor[], Tensor?[]): the slow path."""
        found = False
        for item in (value,) if isinstance(value, torch.Tensor) else tree_iter(value):
            if isinstance(item, torch.Tensor):
                for t in _plain_tensors(item):
                    inputs.append(self._row(seq, code, t))
                    found = True
        return found and (code & 3) == WRITE

    def _put_output(self, seq: int, name: int, value: torch.Tensor, inputs: list) -> bool:
        """Outputs sharing an input's storage are views (`_unsafe_view` claims otherwise)."""
        fresh = False
        for t in _plain_tensors(value):
            sid = self._index.get(t.untyped_storage()._cdata)
            access = VIEW if sid is not None and sid in inputs else FACTORY
            self._row(seq, name | access, t)
            fresh |= access == FACTORY
        return fresh


class Recorder:
    """Tables shared by all captures of one trace, and the fail-open error log."""

    MAX_KEPT_ERRORS = 50

    def __init__(self, strict: bool = False):
        self.strict = strict
        self.storages = StorageTable()
        self.names = Interner()   # op names, argument names, module FQNs
        self.views = Interner()   # (dtype, shape, stride, offset)
        self.plans: dict = {}     # OpOverload -> _Plan
        self.captures: list[Capture] = []
        self.errors: list[dict] = []
        self.n_errors = 0
        self._lock = threading.Lock()

    def new_capture(self, label: str | None, kind: str) -> Capture:
        with self._lock:
            graph_id = len(self.captures)
            cap = Capture(graph_id, label or f"graph{graph_id}", kind)
            self.captures.append(cap)
        return cap

    def fail(self, where: str, exc: BaseException) -> None:
        """Count an internal error; raise it only in strict mode."""
        if self.strict:
            raise exc
        self.n_errors += 1
        if len(self.errors) < self.MAX_KEPT_ERRORS:
            self.errors.append({
                "where": where,
                "message": f"{type(exc).__name__}: {exc}",
                "traceback": "".join(traceback.format_exception(exc)),
            })


__all__ = ["RecordingMode", "Recorder", "Capture", "StorageTable", "module_stack",
           "READ", "WRITE", "VIEW", "FACTORY", "ACCESS_FIELDS"]
