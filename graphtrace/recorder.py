"""The recording mode: bookkeeping of every storage each op touches during a capture.

The mode runs the op, then appends a few integers per tensor to columnar arrays. Names,
strings and DataFrames are built later, in `diff()`. Storages are held by weak reference
only (the raw `_weak_ref` handle that `StorageWeakRef` wraps), which is their identity:
Note [weak handles and the sweep] in docs/internals.md.
"""

from __future__ import annotations

import threading
import traceback
from array import array
from types import MethodType
from typing import Iterator, Mapping, Protocol, runtime_checkable

import numpy as np
import torch

from graphtrace._compat import (
    TorchDispatchMode,
    free_weak_ref,
    storage_from_weak_ref,
    storage_weak_ref,
    weak_ref_expired,
)
from graphtrace._schema import op_info, plain_tensors, tensors_in
from graphtrace.encoding import (
    ACCESS_FIELDS,
    ACCESS_MASK,
    FACTORY,
    OUT_MUTATED,
    READ,
    REPLAY_FRESH,
    REPLAY_WROTE,
    SID_SHIFT,
    VIEW,
    WRITE,
    pack_code,
    pack_slot,
    with_access,
)
from graphtrace.opaque import proxy_storage, type_name

__all__ = ["RecordingMode", "Writer", "PyWriter", "Recorder", "Capture", "StorageTable",
           "Registered", "Interner", "module_stack"]


class _ModuleStack(threading.local):
    def __init__(self):
        self.stack: list[int] = []


# Per-thread stack of the watched modules running (FQN ids, innermost last), kept by
# graphtrace.attribution; a writer reads its capturing thread's list directly.
module_stack = _ModuleStack()


class Interner:
    """Strings and small tuples to dense ints, so records stay integers."""

    __slots__ = ("ids", "items", "_lock")

    def __init__(self):
        self.ids: dict = {}
        self.items: list = []
        self._lock = threading.Lock()

    def __call__(self, item) -> int:
        i = self.ids.get(item)
        if i is None:
            with self._lock:  # two capturing threads must not hand out one id twice
                i = self.ids.get(item)
                if i is None:
                    self.items.append(item)
                    i = self.ids[item] = len(self.items) - 1
        return i


class Registered:
    """Storage ids `first` .. `end` - 1 of a StorageTable, by weak handle (0: released)."""

    __slots__ = ("table", "first", "end", "handles", "_set")

    def __init__(self, table: "StorageTable", first: int, handles: array,
                 shared: list | None = None):
        self.table = table
        self.first = first
        self.end = first + len(handles)
        self.handles = handles
        self._set = [None] if shared is None else shared  # [set(handles)] once made

    @property
    def handle_set(self) -> set:
        """`set(self.handles)`, made once per read of the table (see
        `StorageTable.registered_since`)."""
        found = self._set[0]
        if found is None:
            found = self._set[0] = set(self.handles)
        return found

    def matching(self, by_address: Mapping[int, object]) -> Iterator[tuple[int, int]]:
        """(storage id, address) of each of these storages whose StorageImpl address is a
        key of `by_address`: a set intersection, for the few such among many. A capture on
        another thread may have released one meanwhile and its address gone to a new
        storage: the table's index says whose the address is now."""
        for handle in by_address.keys() & self.handle_set:
            sid = self.table.find(handle)
            if sid is not None and self.first <= sid < self.end:
                yield sid, handle


class StorageTable:
    """Every storage seen by any capture of one trace, by weak handle; never a strong ref.

    Pure Python, or backed by the native recorder's table (`native`), which both writers then
    register into; either way the columns read the same (they are synced on access).
    """

    __slots__ = ("_index", "_handles", "_data_ptrs", "_nbytes", "_devices", "_device_names",
                 "_lock", "_native", "_released", "_since", "__weakref__")

    def __init__(self, native=None):
        # weak handle (StorageImpl address) -> storage id; the native table keeps its own
        self._index: dict[int, int] = {}
        self._handles = array("q")
        self._data_ptrs = array("q")
        self._nbytes = array("q")
        self._devices: list[str] = []
        self._device_names: dict = {}
        self._lock = threading.Lock()
        self._native = None if native is None else native.Storages()
        self._released = 0  # the native table's sweep count when `_handles` was last read
        # registered_since's last read: (what it read, its handles, their set once made)
        self._since: tuple = ((), None, None)

    @property
    def native_table(self):
        """The native `Storages` table this one is backed by, else None (pure Python)."""
        return self._native

    def lookup(self, storage: torch.UntypedStorage) -> int:
        """The storage's id, registering it (one weak handle) on first sight."""
        if self._native is not None:
            return self._native.register(storage._cdata)  # `storage` keeps it alive meanwhile
        sid = self._index.get(storage._cdata)
        if sid is not None:
            return sid
        device = storage.device
        name = self._device_names.get(device)
        if name is None:
            name = self._device_names[device] = str(device)
        with self._lock:
            sid = self._index.get(storage._cdata)
            if sid is None:
                handle = storage_weak_ref(storage)
                sid = len(self._handles)
                self._handles.append(handle)
                self._data_ptrs.append(storage.data_ptr())
                self._nbytes.append(storage.nbytes())
                self._devices.append(name)
                self._index[handle] = sid
        return sid

    def __len__(self) -> int:
        return len(self._native) if self._native is not None else len(self._handles)

    def find(self, cdata: int) -> int | None:
        """The id of a registered storage (by its StorageImpl address), else None."""
        if self._native is not None:
            sid = self._native.find(cdata)
            return None if sid < 0 else sid
        return self._index.get(cdata)

    def _sync(self) -> None:
        """Pull what the native table registered since the last read into the columns."""
        native = self._native
        if native is None:
            return
        n = len(self._data_ptrs)
        if len(native) > n:
            handles, data_ptrs, nbytes, devices = native.since(n)
            self._handles.frombytes(handles)
            self._data_ptrs.frombytes(data_ptrs)
            self._nbytes.frombytes(nbytes)
            self._devices.extend(devices)
        released = native.released()
        if released != self._released:  # sweeps zeroed handles already read: read them again
            self._handles = array("q", native.handles())
            self._released = released

    def sweep(self, first: int) -> None:
        """Release the weak handles of storages `first`.. that are dead (a capture's
        intermediates, at its end). Only the native table sweeps; it also sweeps as it goes."""
        if self._native is not None:
            self._native.sweep(first)

    @property
    def handles(self) -> array:
        self._sync()
        return self._handles

    def registered_since(self, first: int) -> "Registered":
        """The storages registered from id `first` on: what a capture close matches, read
        without syncing the whole table. The owner snapshot, provenance and lineage each ask
        after a capture, usually from the same id: while nothing was registered or released
        meanwhile, the same (read-only) answer serves them all."""
        native = self._native
        key = ((first, len(native), native.released()) if native is not None
               else (first, len(self._handles), self._released))
        since = self._since
        if since[0] == key:
            return Registered(self, first, since[1], since[2])
        if native is not None:
            handles = array("q", native.handles_from(first))
        else:
            handles = self._handles[first:]
        got = Registered(self, first, handles)
        self._since = (key, handles, got._set)  # no reference back to this table
        return got

    @property
    def data_ptrs(self) -> array:
        self._sync()
        return self._data_ptrs

    @property
    def nbytes(self) -> array:
        self._sync()
        return self._nbytes

    @property
    def devices(self) -> list[str]:
        self._sync()
        return self._devices

    def native_bytes(self) -> int:
        """Heap bytes of the native table (0 without one): memory tracemalloc does not see."""
        return 0 if self._native is None else self._native.memory()

    def alive(self, sid: int) -> bool:
        if self._native is not None:
            return self._native.alive(sid)
        return not weak_ref_expired(self._handles[sid])

    def alive_mask(self) -> np.ndarray:
        """One bool per storage id: still alive."""
        if self._native is not None:
            return np.frombuffer(self._native.alive_mask(), dtype=bool).copy()
        expired = weak_ref_expired
        return np.fromiter((not expired(h) for h in self._handles), dtype=bool,
                           count=len(self._handles))

    def upgrade(self, sid: int) -> torch.UntypedStorage | None:
        """A strong reference to a still-alive storage, for value checks in diff()."""
        if self._native is not None:
            return self._native.upgrade(sid)
        if not self.alive(sid):
            return None
        return storage_from_weak_ref(self._handles[sid])

    def release(self) -> None:
        """Free every weak handle (the trace is done with these storages)."""
        if self._native is not None:
            self._sync()
            self._native.release()  # it owns the handles; the columns are copies
        else:
            free = free_weak_ref
            for handle in self._handles:
                free(handle)
        self._handles = array("q")
        self._index.clear()
        self._since = ((), None, None)

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
        self.accesses = array("q")     # ACCESS_FIELDS int64s per access (graphtrace.encoding)
        self.info: dict = {}           # pool, stream, ... where known

    @property
    def n_ops(self) -> int:
        return len(self.ops)

    @property
    def n_accesses(self) -> int:
        return len(self.accesses) // ACCESS_FIELDS


_SCALARS = (type(None), int, float, bool, str)
_OPAQUE_VIEW = (torch.uint8, torch.Size([0]), (1,), 0)  # the view of a proxy storage
_STRIDED = torch.strided


class _Plan:
    """An op's schema facts with this trace's name ids filled in: one dict hit per call."""

    __slots__ = ("op_id", "positional", "by_keyword", "returns", "may_alias", "opaque")

    def __init__(self, func, names: "Interner"):
        info = op_info(func)
        self.op_id = names(info.name)
        # each tensor argument as its record code (encoding.pack_code), ready to append
        self.positional = tuple(None if e is None else pack_code(names(e[0]), e[1])
                                for e in info.positional)
        self.by_keyword = {k: pack_code(names(e[0]), e[1]) for k, e in info.by_keyword.items()}
        self.may_alias = info.may_alias
        self.opaque = info.opaque  # the native writer hands these ops to PyWriter
        n = len(info.returns)
        # each return slot as its code with access READ (0: the access is or-ed in per call),
        # None when mutated
        self.returns = tuple(None if slot == OUT_MUTATED
                             else pack_code(names("out" if n == 1 else f"out{i}"), READ)
                             for i, slot in enumerate(info.returns))


@runtime_checkable
class Writer(Protocol):
    """What RecordingMode calls on its capture's writer: PyWriter or the native one (see PyWriter)."""

    def record(self, func, args, kwargs, out) -> int:
        """Append the op's records; return its replay flags (encoding.REPLAY_*)."""
        ...

    def flush(self) -> None:
        """Land buffered records in the Capture's arrays."""
        ...


class PyWriter:
    """The per-op path in Python: appends one row per tensor to the capture's arrays.

    The reference for the native writer (graphtrace/csrc/recorder.cpp), which gives the same
    rows and hands this writer what it does not handle itself (tensor subclasses, dicts).
    Made on the capturing thread: it keeps that thread's module stack.
    """

    __slots__ = ("recorder", "capture", "stack", "_plans", "_lookup", "_find", "_views",
                 "_slots", "_append")

    def __init__(self, recorder: "Recorder", capture: Capture):
        self.recorder = recorder
        self.capture = capture
        self.stack = module_stack.stack
        self._plans = recorder.plans
        self._lookup = recorder.storages.lookup
        self._find = recorder.storages.find
        self._views = recorder.views
        self._slots: dict = {}  # view key (see _slot_of) -> slot (encoding.pack_slot)
        self._append = capture.accesses.extend

    def fallback(self, func, args, kwargs, out) -> int:
        """record() for an op the native writer hands over. Its table releases the handles of
        dead storages, so an address cached here may belong to a new storage by now."""
        self._slots.clear()
        return self.record(func, args, kwargs, out)

    def flush(self) -> None:
        """Nothing to land: this writer appends to the Capture's arrays directly."""

    def record(self, func, args, kwargs, out) -> int:
        """Append one row per tensor; return its replay flags (`Writer.record`).

        This loop runs for every argument of every op: one dict hit on the view key
        (storage, view) finds both ids for any tensor seen before.
        """
        plan = self._plans.get(func)
        if plan is None:
            plan = self.recorder.plan(func)
        cap = self.capture
        seq = len(cap.ops)
        cap.ops.append(plan.op_id)
        stack = self.stack
        cap.op_modules.append(stack[-1] if stack else -1)
        slot_of, append = self._slot_of, self._append
        start = len(cap.accesses)
        inputs: list[int] = []
        wrote = False
        for value, code in zip(args, plan.positional):
            if code is None:
                continue
            tp = type(value)
            if (tp is torch.Tensor or tp is torch.nn.Parameter) and value.layout is _STRIDED:
                slot = slot_of(value)
                append((seq, code, slot))
                inputs.append(slot >> SID_SHIFT)
                wrote |= (code & ACCESS_MASK) == WRITE
            elif tp not in _SCALARS:
                wrote |= self._put(seq, code, value, inputs)
        if kwargs:
            for name, value in kwargs.items():
                code = plan.by_keyword.get(name)
                if code is not None and type(value) not in _SCALARS:
                    wrote |= self._put(seq, code, value, inputs)
        fresh = False
        end_inputs = len(cap.accesses)
        if type(out) is torch.Tensor and out.layout is _STRIDED:
            name = plan.returns[0] if plan.returns else None
            if name is not None:  # None: a mutated argument, already recorded as a write
                slot = slot_of(out)
                # else a view (`_unsafe_view` claims fresh)
                fresh = (slot >> SID_SHIFT) not in inputs
                append((seq, name | (FACTORY if fresh else VIEW), slot))
        elif isinstance(out, (tuple, list)):
            returns = plan.returns
            # one return slot: `out` is that slot's Tensor[] (unbind, split, _foreach_*)
            named = ((returns[0], out),) if len(returns) == 1 else (
                (returns[i] if i < len(returns) else None, value) for i, value in enumerate(out))
            for name, value in named:
                if name is not None:
                    for item in tensors_in(value):
                        fresh |= self._put_output(seq, name, item, inputs)
        elif isinstance(out, torch.Tensor) and plan.returns and plan.returns[0] is not None:
            fresh = self._put_output(seq, plan.returns[0], out, inputs)
        if plan.may_alias:
            self._unalias(start, end_inputs)
        return (REPLAY_WROTE if wrote else 0) | (REPLAY_FRESH if fresh else 0)

    def _unalias(self, start: int, end_inputs: int) -> None:
        """`Tensor(a) self` may alias the output or not (`aten::to` copies on a dtype change):
        an input the schema calls a view is a read when no output shares its storage."""
        rows = self.capture.accesses
        shared = {rows[i] >> SID_SHIFT for i in range(end_inputs + 2, len(rows), ACCESS_FIELDS)}
        for i in range(start + 1, end_inputs, ACCESS_FIELDS):
            code = rows[i]
            if (code & ACCESS_MASK) == VIEW and (rows[i + 1] >> SID_SHIFT) not in shared:
                rows[i] = with_access(code, READ)

    def _slot_of(self, t: torch.Tensor) -> int:
        """The tensor's slot (encoding.pack_slot), by its view key: (storage, dtype, shape,
        stride, offset), the one place that key is made."""
        key = (t.untyped_storage()._cdata, t.dtype, t.shape, t.stride(), t.storage_offset())
        slot = self._slots.get(key)
        if slot is None:  # not seen in this capture yet
            slot = self._slots[key] = pack_slot(self._lookup(t.untyped_storage()),
                                                self._views(key[1:]))
        return slot

    def _row(self, seq: int, code: int, t: torch.Tensor) -> int:
        slot = self._slot_of(t)
        self._append((seq, code, slot))
        return slot >> SID_SHIFT

    def _opaque(self, seq: int) -> None:
        """A tensor without a storage (mkldnn's prepacked weights, sparse): say which op."""
        self.recorder.opaque_ops.add(self.recorder.names.items[self.capture.ops[seq]])

    def _put(self, seq: int, code: int, value, inputs: list) -> bool:
        """Tensors inside subclasses and containers (Tensor[], Tensor?[]), and opaque handles:
        the slow path."""
        found = False
        walked = plain_tensors(value) if isinstance(value, torch.Tensor) else tensors_in(
            value, opaque=True)
        for item in walked:
            if isinstance(item, torch.ScriptObject):
                inputs.append(self._opaque_row(seq, code, item))
            elif item.layout is not _STRIDED:
                self._opaque(seq)
            else:
                inputs.append(self._row(seq, code, item))
                found = True
        return found and (code & ACCESS_MASK) == WRITE

    def _opaque_row(self, seq: int, code: int, obj: torch.ScriptObject) -> int:
        """An opaque handle read (Note [opaque handles]): a row on its proxy storage."""
        sid = self._lookup(proxy_storage(obj))
        self.recorder.note_opaque(sid, obj, self.capture)
        self._append((seq, with_access(code, READ), pack_slot(sid, self._views(_OPAQUE_VIEW))))
        return sid

    def _put_output(self, seq: int, name: int, value: torch.Tensor, inputs: list) -> bool:
        """Outputs sharing an input's storage are views (`_unsafe_view` claims otherwise)."""
        fresh = False
        for t in plain_tensors(value):
            if t.layout is not _STRIDED:
                self._opaque(seq)
                continue
            sid = self._find(t.untyped_storage()._cdata)
            access = VIEW if sid is not None and sid in inputs else FACTORY
            self._row(seq, name | access, t)
            fresh |= access == FACTORY
        return fresh




class RecordingMode(TorchDispatchMode):
    """Runs each op, then hands (op, args, kwargs, outputs) to the capture's writer.

    One instance per capture region, entered on the capturing thread only (dispatch mode
    stacks are thread-local, so two threads capturing at once never mix records). The mode
    only does bookkeeping: it never changes what the op computes.
    """

    def __init__(self, recorder: "Recorder", capture: Capture, emulated=None):
        super().__init__()
        self.recorder = recorder
        self.capture = capture
        self.writer: Writer = recorder.new_writer(capture)
        self._record = self.writer.record
        self._native = recorder.native is not None
        self.fast_writer = None
        self._emulated = None  # the graph after_op keeps ops for (in Python)
        self.emulated = emulated  # an EmulatedGraph that keeps (op, args, outputs) for replay
        if self._native:  # Note [native dispatch] in graphtrace/csrc/recorder.cpp
            self.__torch_dispatch__ = MethodType(recorder.native.dispatch, self)

    @property
    def emulated(self):
        """The EmulatedGraph this mode also keeps ops for, or None (records only)."""
        return self._graph

    @emulated.setter
    def emulated(self, graph) -> None:
        keeper = getattr(graph, "native_keeper", None) if graph is not None else None
        if self._native:  # the native Writer keeps ops into a native keeper itself
            self.writer.set_keeper(keeper)
        # the native dispatch records by itself unless a graph must keep ops in Python
        self._emulated = graph if keeper is None or not self._native else None
        self._graph = graph
        self.fast_writer = self.writer if self._native and self._emulated is None else None

    def record_only(self, func, args, kwargs, out) -> int:
        """The writer's record of one op, not kept for the emulated graph (a compiled region
        keeps its own replay op: graphtrace.compiled)."""
        graph = self._graph
        if graph is None:
            return self.writer.record(func, args, kwargs, out)
        self.emulated = None
        try:
            return self.writer.record(func, args, kwargs, out)
        finally:
            self.emulated = graph

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
        self.after_op(func, args, kwargs, out)
        return out

    def after_op(self, func, args, kwargs, out) -> None:
        """Record one op that ran (and keep it for an emulated graph); fail open."""
        try:
            replay = self._record(func, args, kwargs, out)
            if self._emulated is not None:
                self._emulated.keep(func, args, kwargs, out, replay)
        except Exception as exc:  # fail open: never break the traced program
            self.recorder.fail(f"recording {func}", exc)

    def record_failed(self, func, exc: BaseException) -> None:
        """The native dispatch's error path: counted, or raised in strict mode."""
        if not isinstance(exc, Exception):  # KeyboardInterrupt and the like: not ours
            raise exc
        self.recorder.fail(f"recording {func}", exc)

    def finish(self) -> None:
        """Land buffered rows in the Capture (the native writer buffers until now)."""
        self.__dict__.pop("__torch_dispatch__", None)  # the bound method refers to the mode
        try:
            if self._native:
                self.writer.set_keeper(None)  # the graph's keeper is sealed next
            self.writer.flush()
        except Exception as exc:
            self.recorder.fail("flushing the capture's records", exc)


class Recorder:
    """Tables shared by all captures of one trace, and the fail-open error log."""

    MAX_KEPT_ERRORS = 50

    def __init__(self, strict: bool = False, native=None):
        self.strict = strict
        self.native = native      # graphtrace.native's module, or None: the Python writer
        self.storages = StorageTable(native)
        self.names = Interner()   # op names, argument names, module FQNs
        self.views = Interner()   # (dtype, shape, stride, offset)
        self.plans: dict = {}     # OpOverload -> _Plan
        self.captures: list[Capture] = []
        self.opaque: dict[int, str] = {}  # storage id of an opaque handle's proxy -> its type
        self._pins: dict[int, list] = {}  # graph id -> opaque handles read, until unpin()
        self.errors: list[dict] = []
        self.n_errors = 0
        self.opaque_ops: set[str] = set()  # ops given tensors without storage (not recorded)
        self._lock = threading.Lock()

    @property
    def backend(self) -> str:
        return "python" if self.native is None else "native"

    def plan(self, func) -> _Plan:
        """The op's plan, made on first sight (both writers call this)."""
        plan = self.plans.get(func)
        if plan is None:
            with self._lock:
                plan = self.plans.get(func)
                if plan is None:
                    plan = self.plans[func] = _Plan(func, self.names)
        return plan

    def new_writer(self, capture: Capture) -> Writer:
        """The writer of one capture (made on its capturing thread: see PyWriter): the native
        Writer when this recorder has one, with a PyWriter for what it hands over."""
        writer = PyWriter(self, capture)
        if self.native is None:
            return writer
        return self.native.Writer(capture, self.storages.native_table, self.views, self.plan,
                                  writer.stack, writer.fallback)

    def note_opaque(self, sid: int, obj: torch.ScriptObject, capture: Capture) -> None:
        """Remember that `sid` is an opaque handle's proxy, and keep the handle's wrapper
        until the capture's owners are matched (Note [opaque handles])."""
        if sid not in self.opaque:
            self.opaque[sid] = type_name(obj)
        self._pins.setdefault(capture.graph_id, []).append(obj)

    def unpin(self, capture: Capture) -> None:
        """Drop the opaque handles a capture kept (its owners are matched now)."""
        self._pins.pop(capture.graph_id, None)

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

