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

from graphtrace._schema import FACTORY, OUT_FRESH, OUT_MUTATED, READ, VIEW, WRITE, op_info

# Per-thread stack of the innermost watched module running (its FQN id), kept by module hooks.
module_stack = threading.local()

ACCESS_FIELDS = 5  # seq, arg id, access kind, storage id, view id


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

    __slots__ = ("index", "handles", "data_ptrs", "nbytes", "devices", "_lock", "__weakref__")

    def __init__(self):
        self.index: dict[int, int] = {}  # weak handle (StorageImpl address) -> storage id
        self.handles = array("q")
        self.data_ptrs = array("q")
        self.nbytes = array("q")
        self.devices: list[str] = []
        self._lock = threading.Lock()

    def lookup(self, storage: torch.UntypedStorage) -> int:
        sid = self.index.get(storage._cdata)
        if sid is not None:
            return sid
        with self._lock:
            sid = self.index.get(storage._cdata)
            if sid is None:
                handle = storage._weak_ref()
                sid = len(self.handles)
                self.handles.append(handle)
                self.data_ptrs.append(storage.data_ptr())
                self.nbytes.append(storage.nbytes())
                self.devices.append(str(storage.device))
                self.index[handle] = sid
        return sid

    def find(self, storage: torch.UntypedStorage) -> int | None:
        """The id of a storage seen before, or None (a new storage at an old address is None)."""
        return self.index.get(storage._cdata)

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
        self.accesses = array("q")     # ACCESS_FIELDS ints per access
        self.info: dict = {}           # pool, stream, ... where known

    @property
    def n_ops(self) -> int:
        return len(self.ops)

    @property
    def n_accesses(self) -> int:
        return len(self.accesses) // ACCESS_FIELDS


def _plain_tensors(t: torch.Tensor):
    """A tensor, or the plain tensors inside a traceable wrapper subclass."""
    if is_traceable_wrapper_subclass(t):
        names, _ = t.__tensor_flatten__()
        for name in names:
            yield from _plain_tensors(getattr(t, name))
    else:
        yield t


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

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        try:
            kind = self._record(func, args, kwargs, out)
            if self.emulated is not None:
                self.emulated._keep(func, args, kwargs, out, kind)
        except Exception as exc:  # fail open: never break the traced program
            self.recorder.fail("record " + str(func), exc)
        return out

    def _record(self, func, args, kwargs, out) -> int:
        rec = self.recorder
        info = op_info(func)
        cap = self.capture
        seq = len(cap.ops)
        cap.ops.append(rec.names(info.name))
        stack = getattr(module_stack, "stack", None)
        cap.op_modules.append(stack[-1] if stack else -1)
        put = self._put
        inputs: set[int] = set()
        wrote = False
        positional = info.positional
        for i, value in enumerate(args):
            entry = positional[i] if i < len(positional) else None
            if entry is not None:
                wrote |= put(seq, entry, value, inputs)
        for key, value in kwargs.items():
            entry = info.by_keyword.get(key)
            if entry is not None:
                wrote |= put(seq, entry, value, inputs)
        fresh = False
        returns = info.returns
        if isinstance(out, torch.Tensor):
            out = (out,)
        elif not isinstance(out, (tuple, list)):
            out = ()
        for i, value in enumerate(out):
            slot = returns[i] if i < len(returns) else OUT_FRESH
            if slot == OUT_MUTATED:
                continue  # already recorded as a write on its argument
            name = "out" if len(returns) == 1 else f"out{i}"
            fresh |= self._put_output(seq, name, value, inputs)
        # What replay must do with this op: nothing for pure views, re-run writers and producers.
        return (1 if wrote else 0) | (2 if fresh else 0)

    def _put(self, seq, entry, value, inputs) -> bool:
        name, access = entry
        if isinstance(value, torch.Tensor):
            self._put_tensor(seq, name, access, value, inputs)
            return access == WRITE
        if value is None or isinstance(value, (int, float, bool, str)):
            return False
        wrote = False
        for item in tree_iter(value):  # Tensor[], Tensor?[], nested containers
            if isinstance(item, torch.Tensor):
                self._put_tensor(seq, name, access, item, inputs)
                wrote |= access == WRITE
        return wrote

    def _put_tensor(self, seq, name, access, tensor, inputs) -> None:
        rec = self.recorder
        arg = rec.names(name)
        for t in _plain_tensors(tensor):
            storage = t.untyped_storage()
            sid = rec.storages.lookup(storage)
            inputs.add(sid)
            view = rec.views((t.dtype, tuple(t.shape), t.stride(), t.storage_offset()))
            self.capture.accesses.extend((seq, arg, access, sid, view))

    def _put_output(self, seq, name, value, inputs) -> bool:
        """Outputs sharing an input's storage are views (`_unsafe_view` claims otherwise)."""
        fresh = False
        for item in tree_iter(value):
            if not isinstance(item, torch.Tensor):
                continue
            rec = self.recorder
            arg = rec.names(name)
            for t in _plain_tensors(item):
                sid = rec.storages.lookup(t.untyped_storage())
                access = VIEW if sid in inputs else FACTORY
                fresh |= access == FACTORY
                view = rec.views((t.dtype, tuple(t.shape), t.stride(), t.storage_offset()))
                self.capture.accesses.extend((seq, arg, access, sid, view))
        return fresh


class Recorder:
    """Tables shared by all captures of one trace, and the fail-open error log."""

    MAX_KEPT_ERRORS = 50

    def __init__(self, strict: bool = False):
        self.strict = strict
        self.storages = StorageTable()
        self.names = Interner()   # op names, argument names, module FQNs
        self.views = Interner()   # (dtype, shape, stride, offset)
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
