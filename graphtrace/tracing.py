"""Capture boundaries: `trace()`, `capture()`, emulated graphs, and CUDA graph wrapping.

A `Trace` owns the recorder's tables. Recording happens only inside capture regions: an
explicit `capture(label)` (an emulated, replayable graph on any device) or any CUDA graph
captured while the trace is open (`torch.cuda.graph`, bare `CUDAGraph.capture_begin()`),
which the trace wraps for its lifetime and unwraps when it closes. A CUDA graph's capture
is labelled by `capture(label, cuda_graph=g)` around it (see Note [CUDA graph labels]).
"""

from __future__ import annotations

import contextlib
import sys
import threading
import weakref
from typing import Any, Callable, Iterable

import torch

from graphtrace import clock
from graphtrace._compat import CAPTURE_HOOKS, SCRATCH, disable_current_modes, storage_use_count
from graphtrace._schema import map_tensors
from graphtrace.attribution import ModuleAttribution
from graphtrace.blindspots import BlindSpot
from graphtrace.compiled import CompiledPatch
from graphtrace.derived import DerivedCopies
from graphtrace.encoding import REPLAY_FRESH
from graphtrace.errors import GraphtraceError
from graphtrace.owners import OwnerSnapshot
from graphtrace.recorder import Capture, Recorder, RecordingMode
from graphtrace.scalars import BakedScalars, floats_in

__all__ = ["GraphtraceError", "Trace", "EmulatedGraph", "trace", "capture", "active_trace"]



RECORD = ("auto", "always")  # when provenance and lineage record: Note [recording while serving]
_active_lock = threading.Lock()
_active: "Trace | None" = None


def active_trace() -> "Trace | None":
    return _active



class _PyKeeper:
    """The kept ops and aliases of an emulated graph, in Python: the reference for the native
    Keeper (Note [native keep] in graphtrace/csrc/recorder.cpp), used without the native
    recorder. Note [Emulated graphs keep storages]."""

    __slots__ = ("ops", "floats", "_aliases", "_seen", "_made", "_scratch")

    def __init__(self):
        self.ops: list = []       # (func, args, kwargs, out, replay flags) per kept op
        self.floats: dict = {}    # each float the kept ops take -> the first op taking it
        self._aliases: dict = {}  # view key -> alias, so one view read twice is one alias
        self._seen: set = set()   # storages pinned so far
        self._made: set = set()   # storages first seen as an op's output: made in the region
        # (nbytes, device, [(alias, offset, shape, stride), ...]) per scratch storage
        self._scratch: list = []

    def pin(self, t: torch.Tensor, making: bool) -> torch.Tensor:
        """A plain alias of the storage, offset, size and stride a plain tensor or parameter
        `t` has now (`t` itself where an alias cannot carry what it is)."""
        if (t.layout != torch.strided or t.is_quantized or t.is_conj() or t.is_neg()
                or t.is_nested):
            return t  # what an alias cannot carry (a quantizer, a lazy flag, nested parts)
        try:
            storage = t.untyped_storage()
        except Exception:  # no storage (a functional wrapper): nothing to pin
            return t
        cdata = storage._cdata
        key = (cdata, t.dtype, t.shape, t.stride(), t.storage_offset())
        alias = self._aliases.get(key)
        if alias is None:
            if cdata not in self._seen:
                self._seen.add(cdata)
                if making:
                    self._made.add(cdata)
            if t.is_inference():  # its detach() would be one too: not writable outside
                alias = torch.empty(0, dtype=t.dtype, device=t.device).set_(
                    storage, t.storage_offset(), t.shape, t.stride())
            else:  # a new TensorImpl on the same storage and view: blind to `t.data = ...`
                alias = t.detach()
            self._aliases[key] = alias
        return alias

    def seal(self, release: bool) -> None:
        made, aliases = self._made, self._aliases
        self._made, self._seen, self._aliases = set(), set(), {}
        if not release or not made:
            return
        groups: dict[int, list] = {}  # storage made in the region -> its aliases
        for key, alias in aliases.items():
            if key[0] in made:
                groups.setdefault(key[0], []).append(alias)
        with torch.no_grad(), disable_current_modes():
            for cdata, pinned in groups.items():
                storage = pinned[0].untyped_storage()
                # our aliases and `storage` hold it; anything more is a holder outside the
                # graph, as is a holder of `storage` itself (the storage's one Python object:
                # `storage`, getrefcount's argument and the storage's own reference to it)
                if storage_use_count(cdata) > len(pinned) + 1 or sys.getrefcount(storage) > 3:
                    continue
                lent = [(a, a.storage_offset(), a.shape, a.stride()) for a in pinned]
                self._scratch.append((storage.nbytes(), storage.device, lent))
                for alias in pinned:
                    alias.set_()

    def lend(self) -> None:
        for nbytes, device, lent in self._scratch:
            fresh = torch.UntypedStorage(nbytes, device=device)
            for alias, offset, shape, stride in lent:
                alias.set_(fresh, offset, shape, stride)

    def reclaim(self) -> None:
        for _, _, lent in self._scratch:
            for alias, *_ in lent:
                alias.set_()

    def scratch(self) -> int:
        return len(self._scratch)


def _keep_slow(keeper, func, args, kwargs, out, replay_flags) -> None:
    """Keep one recorded op by the tensor walker (graphtrace._schema.map_tensors), pinning
    through `keeper`: the Python keeper's path, and the native one's for arguments its own
    walk does not cover (Note [native keep])."""
    if not replay_flags:  # 0: a pure view, which a graph bakes in and never re-runs
        return
    if torch.is_inference_mode_enabled():  # aliases must be normal tensors: one exit per op
        with torch.inference_mode(False):
            _keep_walk(keeper, func, args, kwargs, out, replay_flags)
    else:
        _keep_walk(keeper, func, args, kwargs, out, replay_flags)


def _keep_walk(keeper, func, args, kwargs, out, replay_flags) -> None:
    pin = keeper.pin

    def pin_input(t: torch.Tensor) -> torch.Tensor:
        return pin(t, False) if type(t) in _PLAIN else t  # a subclass's parts: kept whole

    def pin_output(t: torch.Tensor) -> torch.Tensor:
        return pin(t, True) if type(t) in _PLAIN else t

    found: list = []
    for a in args:
        floats_in(a, found)
    if kwargs:
        for a in kwargs.values():
            floats_in(a, found)
    floats = keeper.floats
    for v in found:
        if v == v:  # NaN matches nothing
            floats.setdefault(v, func)
    args = tuple([map_tensors(pin_input, a) for a in args])
    kwargs = {k: map_tensors(pin_input, v) for k, v in kwargs.items()} if kwargs else {}
    keeper.ops.append((func, args, kwargs, map_tensors(pin_output, out), replay_flags))


_PLAIN = (torch.Tensor, torch.nn.Parameter)


class EmulatedGraph:
    """A replayable record of a capture region with CUDA graph address semantics.

    Replay re-runs the recorded ops on the storages they saw at capture time and copies
    fresh results into the outputs the capture returned. See Note [Emulated graphs keep
    storages]. Like a real graph's capture artifacts, it keeps the storages it read from
    outside and its outputs alive (drop the graph to free them), not its intermediates.
    `native` (graphtrace.native's module, as a trace's recorder has it) keeps ops in C++.
    """

    __slots__ = ("label", "capture", "_keeper", "_ops", "__weakref__")

    def __init__(self, label: str, native=None):
        self.label = label
        self.capture: Capture | None = None
        keeper = getattr(native, "Keeper", None) if native is not None else None
        self._keeper = keeper(_keep_slow, SCRATCH) if keeper is not None else _PyKeeper()
        self._ops: list = self._keeper.ops

    @property
    def native_keeper(self):
        """The native Keeper a capture's native Writer keeps ops into, else None."""
        return None if isinstance(self._keeper, _PyKeeper) else self._keeper

    def keep(self, func, args, kwargs, out, replay_flags: int) -> None:
        """Keep one recorded op for replay (`replay_flags` as the writer returned them)."""
        _keep_slow(self._keeper, func, args, kwargs, out, replay_flags)

    def seal(self) -> None:
        """At the end of the capture: let go of the storages the region made that nothing
        outside the graph holds (its intermediates); replay lends them afresh. Note
        [Emulated graphs keep storages]."""
        self._keeper.seal(SCRATCH)

    def replay(self) -> None:
        """Run the kept ops again. One replay at a time per graph (its scratch aliases are
        pointed at fresh storages for the replay), as a CUDA graph's pool is one."""
        with torch.no_grad(), disable_current_modes():
            keeper = self._keeper
            keeper.lend()
            try:
                for func, args, kwargs, out, replay_flags in self._ops:
                    result = func(*args, **kwargs)
                    if replay_flags & REPLAY_FRESH:
                        _copy_into(out, result)
            finally:
                keeper.reclaim()

    def baked_floats(self) -> dict:
        """Each float the kept ops take as an argument (graphtrace.scalars.floats_in) -> the
        first op taking it: what the graph baked in (Note [baked scalars])."""
        return dict(self._keeper.floats)

    def kept_ops(self) -> list:
        """The ops kept for replay: (func, args, kwargs, out, replay flags) each."""
        return list(self._ops)

    def __len__(self) -> int:
        return len(self._ops)

    def __repr__(self) -> str:
        return f"EmulatedGraph({self.label!r}, ops={len(self._ops)})"


def _copy_into(dst, src) -> None:
    if isinstance(dst, torch.Tensor):
        if dst is not src and isinstance(src, torch.Tensor):
            if dst.untyped_storage()._cdata != src.untyped_storage()._cdata:
                dst.copy_(src)
    elif isinstance(dst, (tuple, list)):
        for d, s in zip(dst, src):
            _copy_into(d, s)


# Note [Emulated graphs keep storages]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# A CUDA graph bakes in addresses: what it reads is fixed at capture, whatever Python does
# to the tensor objects afterwards (`param.data = ...`, `model.to()/.half()/.float()` rebind
# a tensor's storage in place of the object). So an emulated graph keeps no tensor object
# of the capture: `keep` replaces each plain tensor argument and output by an alias made at
# capture time, pinned to the storage, offset, size and stride the op saw (requires_grad
# off): `t.detach()`, a new TensorImpl on t's storage and view that `t.data = ...` does not
# touch (it shares t's version counter, so a replay's writes count as writes). Aliases are
# made outside inference mode: a capture under `torch.inference_mode()` replays anywhere. An
# inference tensor's detach() is an inference tensor again (not writable in place outside
# inference mode), so its alias is `empty(0).set_(storage, offset, size, stride)`, a normal
# tensor. What an alias cannot carry is kept as is: quantized tensors (their quantizer),
# conj/neg views, nested tensors and subclasses (their own parts). keep() runs per recorded
# op, so it walks the shapes ops take (tensors, scalars, plain tuples and lists) itself and
# leaves anything else to pytree.
# A graph keeps what a CUDA graph's pool would, not every intermediate: at the region's end
# `seal` looks at each storage first pinned as an op's output (made in the region). When
# nothing but the graph's own aliases holds it (the storage's use count), it is scratch: its
# aliases are emptied in place (size 0 on a 0-byte storage; their storage offset, size and
# stride kept beside them) and the storage is freed. Each replay lends the scratch aliases
# fresh storages at their views and empties them again after it, as a graph's pool lends its
# intermediates memory for the replay; the kept ops themselves never change, and one graph
# replays one at a time. A storage made in the region that something else holds (the
# region's outputs, a cache the model kept) stays pinned, and replay copies fresh results
# into it, as before. The alias map goes at seal. Without storage use counts (a torch that
# lacks `_storage_Use_Count`: graphtrace._compat.SCRATCH) nothing is released.
# The keeping itself is a keeper's: `_PyKeeper` above in Python, and with the native
# recorder its Keeper (Note [native keep] in graphtrace/csrc/recorder.cpp), which the
# capture's native Writer keeps each op into right after recording it.
class _Region:
    """One open capture on one thread: the mode pushed, its records, maybe a replayable graph."""

    __slots__ = ("trace", "capture", "mode", "graph", "first_storage", "paused", "seeded")

    def __init__(self, trace: "Trace", label: str | None, kind: str, emulate: bool):
        self.trace = trace
        self.first_storage = len(trace.recorder.storages)
        self.capture = trace.recorder.new_capture(label, kind)
        self.graph = EmulatedGraph(self.capture.label, trace.recorder.native) if emulate else None
        if self.graph is not None:
            self.graph.capture = self.capture
        self.mode = RecordingMode(trace.recorder, self.capture, self.graph)
        self.paused = None
        self.seeded: list[int] | None = None

    def open(self) -> None:
        self.seeded = self.trace._capture_opens()  # Note [attribution while serving]
        try:
            provenance = self.trace.provenance  # never runs under a capture: Note [provenance]
            self.paused = provenance.pause() if provenance is not None else None
            self.mode.__enter__()
        except BaseException:
            self.trace._capture_closes(self.seeded)
            self.seeded = None
            raise

    def close(self) -> None:
        self.mode.__exit__(None, None, None)
        if self.seeded is not None:
            self.trace._capture_closes(self.seeded)
            self.seeded = None
        if self.trace.provenance is not None:
            self.trace.provenance.resume(self.paused)
        self.mode.finish()
        if self.graph is not None:
            self.graph.seal()  # lets go of its intermediates: Note [Emulated graphs keep storages]
        self.trace.recorder.storages.sweep(self.first_storage)  # its dead intermediates
        try:
            self.trace._after_capture(self.capture)
            if self.graph is not None:
                self.trace._note_scalars(self.capture.label, self.graph)
        finally:
            self.trace.recorder.unpin(self.capture)


class _CaptureContext:
    """`with gt.capture(label) as g:` -- g is the EmulatedGraph of the region; with
    `cuda_graph=g`, the region is g's own capture (Note [CUDA graph labels])."""

    def __init__(self, label: str | None, emulate: bool = True, cuda_graph: Any = None):
        self.label = label
        self.emulate = emulate
        self.cuda_graph = cuda_graph
        self._region: _Region | None = None
        self._trace: Trace | None = None

    def __enter__(self) -> EmulatedGraph | Capture | Any:
        trace = _active
        if trace is None:
            raise GraphtraceError(
                "graphtrace.capture() must be used inside `with graphtrace.trace(...)`: "
                "open a trace first so the capture has somewhere to be recorded")
        if self.cuda_graph is not None:
            trace._label_cuda_graph(self.cuda_graph, self.label)
            self._trace = trace
            return self.cuda_graph
        if trace._open_region() is not None:
            raise GraphtraceError("capture regions do not nest: this thread is already capturing "
                                  f"{trace._open_region().capture.label!r}")
        self._region = _Region(trace, self.label, "emulated", self.emulate)
        trace._set_region(self._region)
        self._region.open()
        return self._region.graph if self.emulate else self._region.capture

    def __exit__(self, exc_type, *exc) -> None:
        if self.cuda_graph is not None:
            trace, self._trace = self._trace, None
            captured = trace._unlabel_cuda_graph(self.cuda_graph)
            if not captured and exc_type is None:
                raise GraphtraceError(
                    f"capture({self.label!r}, cuda_graph=...) closed without capturing its graph: "
                    "call torch.cuda.graph(g) (or g.capture_begin()) inside it, on this thread")
            return
        region, self._region = self._region, None
        region.trace._set_region(None)
        region.close()


# Note [CUDA graph labels]
# ~~~~~~~~~~~~~~~~~~~~~~~~
# Every CUDA graph captured while a trace is open is recorded (through torch's capture hooks,
# or by wrapping CUDAGraph.capture_begin/capture_end: Note [CUDA graph capture hooks]), under a
# generated label. To name it, wrap the capture:
#
#     with gt.capture("decode", cuda_graph=g):
#         with torch.cuda.graph(g):
#             model(x)
#
# Inside the context, a capture of `g` begun on this thread is recorded under "decode"; no
# emulated region is opened (the real graph is the record, and it is replayed with
# g.replay()). Other graphs, and `g` captured on other threads, keep their generated labels.
# The context must see `g` captured: closing it without a capture is a GraphtraceError.
# Without `cuda_graph`, capture() opens an emulated region as before. `capture_cuda_graph`
# is the warm-up-and-capture recipe built on it.


def capture(label: str | None = None, *, emulate: bool = True,
            cuda_graph: Any = None) -> _CaptureContext:
    """Mark a region to record like a CUDA graph capture; yields a replayable EmulatedGraph.

    `cuda_graph`: a torch.cuda.CUDAGraph whose capture inside this context (on this thread)
    is recorded under `label` instead of an emulated region; yields the graph itself. See
    Note [CUDA graph labels].
    """
    if label is not None and not isinstance(label, str):
        raise TypeError(f"capture label must be a str, got {type(label).__name__}")
    if cuda_graph is not None:
        from torch.cuda.graphs import CUDAGraph

        if not isinstance(cuda_graph, CUDAGraph):
            raise TypeError(f"cuda_graph must be a torch.cuda.CUDAGraph, got "
                            f"{type(cuda_graph).__name__}")
    return _CaptureContext(label, emulate, cuda_graph)


def capture_cuda_graph(fn: Callable[[], Any], label: str | None = None, *, warmup: int = 2,
                       graph: Any = None, pool: Any = None) -> tuple[Any, Any]:
    """Warm `fn` up on a side stream, then capture `fn()` into a CUDA graph: (graph, output).

    The recipe vLLM and torch's docs use: warm-up calls outside the capture (lazy
    initialisation, autotuning, allocator growth must not happen inside it), then
    `torch.cuda.graph(graph, pool=pool)`. Inside an open trace the capture is recorded under
    `label` (Note [CUDA graph labels]); outside one it is a plain capture. `graph`: a
    CUDAGraph to capture into (e.g. `CUDAGraph(keep_graph=True)`); default a new one.
    """
    if not callable(fn):
        raise TypeError(f"capture_cuda_graph needs a callable, got {type(fn).__name__}")
    if not isinstance(warmup, int) or warmup < 0:
        raise ValueError(f"warmup must be a non-negative int, got {warmup!r}")
    if not torch.cuda.is_available():
        raise GraphtraceError("capture_cuda_graph needs CUDA (torch.cuda.is_available() is "
                              "False); use graphtrace.capture(label) for an emulated graph")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph() if graph is None else graph
    label_it = capture(label, cuda_graph=graph) if _active is not None else contextlib.nullcontext()
    with label_it:
        with torch.cuda.graph(graph, pool=pool):
            out = fn()
    return graph, out


# Note [CUDA graph capture hooks]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# A trace learns that a CUDA graph capture began or ended in one of two ways, chosen once per
# trace and named in its report's meta["capture_hooks"]:
#
# - "torch.cuda.graphs hooks" (torch >= 2.14, `CAPTURE_HOOKS` from _compat): torch's public
#   register_graph_capture_start_hook / _end_hook, removed again when the trace closes. The
#   start hook runs right after capture began on the stream (so it issues no CUDA work), the
#   end hook once capture ended, before the graph is instantiated. torch swallows a hook's
#   exceptions (one consumer must not break a capture), so a strict trace keeps what its hook
#   raised and raises it when the trace closes. The pool a capture was given is not passed
#   to the hook: the graph's own `pool()` is recorded instead.
# - "CUDAGraph wrap" (torch 2.11 to 2.13): CUDAGraph.capture_begin/capture_end replaced by
#   wrappers while the trace is open (errors propagate from the wrapper).
#
# Both see the same captures: a `torch.cuda.graph` block, a bare capture_begin()/capture_end(),
# Inductor's cudagraph trees (all go through CUDAGraph.capture_begin/capture_end).
CAPTURE_HOOKS_PUBLIC = "torch.cuda.graphs hooks"
CAPTURE_HOOKS_WRAP = "CUDAGraph wrap"


def _graph_pool(graph) -> Any:
    """The memory pool a capturing graph uses (None where it cannot say)."""
    try:
        return graph.pool()
    except Exception:  # a graph whose C side is not set up (tests' fakes): no pool to name
        return None


class _CudaGraphHooks:
    """Learns of every CUDA graph capture through torch's public capture hooks."""

    how = CAPTURE_HOOKS_PUBLIC

    def __init__(self, trace: "Trace", hooks: tuple[Callable, Callable]):
        self.trace = weakref.ref(trace)  # the trace holds this: no cycle back
        self.register_start, self.register_end = hooks
        self.handles: list = []
        self.pending: list[BaseException] = []  # raised by a hook in strict mode (see Note)

    def install(self) -> None:
        trace_ref, pending = self.trace, self.pending

        def capture_started(graph) -> None:
            trace = trace_ref()
            if trace is not None:
                try:
                    trace._cuda_begin(graph, (_graph_pool(graph),), {})
                except BaseException as exc:  # strict: torch would swallow it
                    pending.append(exc)

        def capture_ended(graph) -> None:
            trace = trace_ref()
            if trace is not None:
                try:
                    trace._cuda_end(graph)
                except BaseException as exc:
                    pending.append(exc)

        self.handles = [self.register_start(capture_started), self.register_end(capture_ended)]

    def uninstall(self) -> None:
        handles, self.handles = self.handles, []
        for handle in handles:
            handle.remove()


class _CudaGraphPatch:
    """Wraps CUDAGraph.capture_begin/end so that every CUDA graph capture is recorded (torch
    without public capture hooks)."""

    how = CAPTURE_HOOKS_WRAP

    def __init__(self, trace: "Trace"):
        self.trace = weakref.ref(trace)  # the trace holds this patch: no cycle back
        self.cls = None
        self.saved: dict[str, Callable] = {}
        self.pending: list[BaseException] = []  # (errors propagate from the wrappers)

    def install(self) -> None:
        try:
            from torch.cuda.graphs import CUDAGraph
        except Exception:  # a build without torch.cuda graphs: nothing to wrap
            return
        self.cls = CUDAGraph
        self.saved = {"capture_begin": CUDAGraph.__dict__.get("capture_begin"),
                      "capture_end": CUDAGraph.__dict__.get("capture_end")}
        begin = CUDAGraph.capture_begin
        end = CUDAGraph.capture_end
        trace_ref = self.trace

        def capture_begin(graph, *args, **kwargs):
            out = begin(graph, *args, **kwargs)
            trace = trace_ref()
            if trace is not None:
                trace._cuda_begin(graph, args, kwargs)
            return out

        def capture_end(graph, *args, **kwargs):
            trace = trace_ref()
            if trace is not None:
                trace._cuda_end(graph)
            return end(graph, *args, **kwargs)

        CUDAGraph.capture_begin = capture_begin
        CUDAGraph.capture_end = capture_end

    def uninstall(self) -> None:
        if self.cls is None:
            return
        for name, fn in self.saved.items():
            if fn is None:
                delattr(self.cls, name)
            else:
                setattr(self.cls, name, fn)
        self.cls = None


def _capture_watcher(trace: "Trace") -> "_CudaGraphHooks | _CudaGraphPatch":
    """torch's public capture hooks where this torch has them, else the wrap (Note [CUDA graph
    capture hooks])."""
    hooks = CAPTURE_HOOKS
    return _CudaGraphHooks(trace, hooks) if hooks is not None else _CudaGraphPatch(trace)


# Note [recording while serving]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# Provenance and lineage (one dispatch mode on the tracing thread: Note [provenance]) cost a
# dispatch per op, which a model that serves while its trace stays open should not pay. So
# under `record="auto"` (the default of `graphtrace.trace`) they record while the model is
# built, loaded, processed and captured, and around weight updates, and pause while it
# serves. The rule, on the thread that opened the trace:
#
# - they PAUSE when a watched model's forward begins outside capture regions once the trace
#   has a graph (a forward pre-hook on each watched model; not inside compiled code, which
#   Dynamo inlines). Code between a capture and the model's next forward -- a reload right
#   after capturing, a guard built, a diff -- is still recorded;
# - they RESUME when an update begins: `load_state_dict` on a watched model (a pre-hook), or
#   a parameter or buffer registered on any module (torch's global registration hooks:
#   `register_parameter`, assigning an `nn.Parameter`, `register_buffer`: what vLLM-style
#   reloads do when they rebuild a layer's tensors), and record until the next forward;
# - `with t.updating(): ...` records inside the block whatever came before, and a forward
#   inside it does not pause them.
#
# An update that begins with none of these signals after the model served -- values written
# in place (`p.data.copy_(new)`, `p.copy_(new)`), `p.data = new`, `torch.utils.swap_tensors`,
# a plain tensor attribute set -- is not recorded: its new tensors read `not recorded`, and
# freshness falls back to version counters (Note [lineage]), which `.data` writes do not
# bump. Wrap such an update in `t.updating()`, or open the trace with `record="always"`
# (record whenever the trace is open, as before this rule). Steering by hand takes over:
# after `t.pause_provenance()` or `t.resume_provenance()` (and `t.provenance_paused()`, made
# of them) the rule no longer pauses or resumes anything in that trace. The vLLM adapter
# opens its trace with `record="always"` and steers by hand from vLLM's own warm-up and
# update hooks (`pause_provenance=True`). A CUDA graph's replay is not a signal (serving
# that only replays graphs runs no op through the mode; eager ops around the replays do,
# until a watched model's forward). Module attribution pauses with them, and the serve hooks
# come off meanwhile, so a serving forward passes no graphtrace code (Note [attribution while
# serving] in graphtrace/attribution.py). Cost: docs/performance.md, "A trace open while the
# model serves".


class Trace:
    """Everything recorded between `trace()` entry and `diff()`; see `graphtrace.trace`."""

    def __init__(self, model: torch.nn.Module | None = None, *, strict: bool = False,
                 name: str | None = None, native: bool | None = None, modules: str = "forward",
                 provenance: bool | None = None, lineage: bool | None = None,
                 record: str = "auto"):
        from graphtrace import native as _native
        from graphtrace.lineage import Lineage
        from graphtrace.lineage import enabled_by_default as lineage_by_default
        from graphtrace.provenance import Provenance, enabled_by_default

        if record not in RECORD:
            raise ValueError(f"record must be one of {RECORD}, got {record!r}")
        self._attribution = ModuleAttribution(modules)  # checks `modules` before any build
        with clock.section("native: load the recorder extension"):
            native_module = _native.resolve(native)
        self.recorder = Recorder(strict=strict, native=native_module)
        self.strict = strict
        # watched models by weak reference: a trace never keeps a model (or its storages) alive
        self._models: dict[str, weakref.ref] = {}
        self.blind_spots: list[BlindSpot] = []
        self.baked_scalars = BakedScalars()  # Note [baked scalars] in graphtrace/scalars.py
        # packed/derived copies and the weights they are made from (Note [derived copies])
        self.derived = DerivedCopies(self.recorder.fail)
        self._regions = threading.local()
        self._cuda_regions: dict[int, _Region] = {}
        self._cuda_labels: dict[tuple[int, int], list] = {}  # (thread, id(graph)) -> [label, captured]
        # capture-time owners of the captured storages, matched after each capture
        self.owner_snapshot = OwnerSnapshot(self.recorder.native)
        # creation sites of storages made outside capture regions (Note [provenance])
        self.provenance = (Provenance(self.recorder.fail)
                           if (enabled_by_default() if provenance is None else provenance)
                           else None)
        # which storages each op wrote from which it read, in provenance's mode (Note [lineage])
        if self.provenance is not None and (lineage_by_default() if lineage is None else lineage):
            self.provenance.lineage = Lineage(self.recorder.fail)
            trace = weakref.ref(self)  # no cycle: the lineage names handles' sources by it
            self.provenance.lineage.models = lambda: (trace().models if trace() is not None
                                                      else {})
            # Note [derived during updates] in graphtrace/lineage/graph.py
            self.provenance.lineage.rematch = lambda: (trace()._match_late()
                                                       if trace() is not None else None)
        # when provenance and lineage pause themselves (Note [recording while serving])
        self.record = record
        self._auto_paused = False  # paused by that rule: the next update resumes it
        self._updating = 0         # depth of `with t.updating():` blocks
        self._manual = False       # pause_provenance()/resume_provenance() called: no rule
        self._model_hooks: dict[str, list] = {}  # model name -> its update hooks' handles
        self._serve_hooks: dict[str, Any] = {}   # model name -> its serve hook, while recording
        self._global_hooks: list = []
        self._capturing = 0  # capture regions open, all threads (Note [attribution while serving])
        self._capturing_lock = threading.Lock()
        self._patch = _capture_watcher(self)  # Note [CUDA graph capture hooks]
        self.compiled_regions = CompiledPatch(self)  # compiled regions: Note [Compiled regions]
        self._open = False
        self._closed = False
        if model is not None:
            self.watch(model, name=name)

    # -- lifecycle ---------------------------------------------------------------------------
    def __enter__(self) -> "Trace":
        global _active
        with _active_lock:
            if _active is not None:
                raise GraphtraceError("graphtrace.trace() does not nest: a trace is already open "
                                      "in this process; close it before opening another")
            if self._closed:
                raise GraphtraceError("this trace was already closed; start a new graphtrace.trace()")
            _active = self
        self._open = True
        for name, model in self.models.items():
            self._attribute_modules(name, model)
        self._patch.install()
        if self.provenance is not None:
            try:
                with clock.section("provenance: start (census of watched models)"):
                    self.provenance.start(self.models)
            except Exception as exc:
                self.recorder.fail("provenance start", exc)
        with clock.section("compiled: install hooks"):
            self.compiled_regions.install()
        self._install_update_hooks()
        return self

    def __exit__(self, *exc) -> None:
        global _active
        self._remove_update_hooks()
        self._patch.uninstall()
        self.compiled_regions.uninstall()
        for region in list(self._cuda_regions.values()):
            region.close()
        self._cuda_regions.clear()
        if self.provenance is not None:
            try:
                self.provenance.stop()
            except Exception as exc:
                self.recorder.fail("provenance stop", exc)
        self._attribution.uninstall()
        with _active_lock:
            _active = None
        self._open = False
        self._closed = True
        self._refresh_owners()
        pending, self._patch.pending[:] = list(self._patch.pending), []
        if pending and (not exc or exc[0] is None):  # strict: raised in torch's capture hook
            raise pending[0]

    # -- models ------------------------------------------------------------------------------
    def watch(self, model: torch.nn.Module, name: str | None = None) -> "Trace":
        """Learn who owns each storage in `model`; call any time before the reload."""
        with clock.section("trace: watch"):  # Note [self clock] in graphtrace/clock.py
            return self._watch(model, name)

    def _watch(self, model: torch.nn.Module, name: str | None) -> "Trace":
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"graphtrace can only watch a torch.nn.Module, got {type(model).__name__}")
        if name is None:
            name = "" if not self._models else f"model{len(self._models)}"
        if not isinstance(name, str):
            raise TypeError(f"model name must be a str, got {type(name).__name__}")
        if name in self._models and self._models[name]() is not None:
            if self._models[name]() is model:
                return self
            raise GraphtraceError(f"a model named {name!r} is already watched; pass name=...")
        self._models[name] = weakref.ref(model)
        if self._open:
            self._attribute_modules(name, model)
            self._hook_model(name, model)
        self.owner_snapshot.forget(name)
        if self.recorder.captures:
            self._refresh_owners()
        return self

    @property
    def models(self) -> dict[str, torch.nn.Module]:
        """The watched models still alive, by name (the trace holds them weakly)."""
        live = {}
        for name, ref in self._models.items():
            model = ref()
            if model is not None:
                live[name] = model
        return live

    def _live_models(self) -> dict[str, torch.nn.Module]:
        """Every watched model; a GraphtraceError naming any that was garbage-collected."""
        live = self.models
        dropped = [name for name in self._models if name not in live]
        if dropped:
            names = ", ".join(repr(n) for n in dropped)
            raise GraphtraceError(
                f"watched model {names} was garbage-collected before diff(): graphtrace holds "
                "models weakly, so keep a reference to each watched model until its diff()")
        return live

    def _attribute_modules(self, name: str, model: torch.nn.Module) -> None:
        self._attribution.install(model, self.recorder.names, f"{name}:" if name else "")

    def _refresh_owners(self) -> None:
        """Walk the watched models again (trace exit, watch) and match captured storages."""
        self._snapshot(self.owner_snapshot.refresh)

    def _match_owners(self) -> None:
        """Match the storages captured since the last snapshot (after each capture)."""
        self._snapshot(self.owner_snapshot.update)

    def _snapshot(self, step) -> None:
        try:
            with clock.section("owners: snapshot"):
                cut = step(self.models, self.recorder.storages)
        except Exception as exc:  # fail open: the engine goes on, the report says so
            self.recorder.fail("owner snapshot", exc)
            return
        for text in cut:  # what the owner walk had to cut goes into the report, not stderr
            self.add_blind_spot(text, kind="walk cut")

    # -- capture regions ---------------------------------------------------------------------
    def _open_region(self) -> _Region | None:
        return getattr(self._regions, "region", None)

    def _set_region(self, region: _Region | None) -> None:
        self._regions.region = region

    def _after_capture(self, capture: Capture) -> None:
        with clock.section("trace: after capture"):
            self._after_capture_steps()

    def _after_capture_steps(self) -> None:
        self._match_owners()
        if self.derived.pairs:
            self.derived.refresh(self.models)
        if self.provenance is not None:
            try:
                self.provenance.match(self.recorder.storages)
            except Exception as exc:
                self.recorder.fail("provenance match", exc)
            if self.provenance.lineage is not None:
                try:
                    self.provenance.lineage.match(self.recorder.storages, self.owner_snapshot,
                                                  self.models)
                except Exception as exc:
                    self.recorder.fail("lineage match", exc)
        for op in sorted(self.recorder.opaque_ops):
            self.add_blind_spot(f"opaque tensors: {op} was given tensors without a storage "
                                "(e.g. mkldnn-prepacked weights, as Inductor's CPU freezing "
                                "makes); what they hold is not recorded",
                                kind="opaque handle", op=op)

    def _note_scalars(self, label: str, graph: "EmulatedGraph") -> None:
        """The floats this emulated graph baked in that watched attributes held (fail open)."""
        try:
            self.baked_scalars.note_found(label, graph.baked_floats(), self.models,
                                          self.recorder.native)
        except Exception as exc:
            self.recorder.fail("baked scalars", exc)

    def _label_cuda_graph(self, graph, label: str | None) -> None:
        key = (threading.get_ident(), id(graph))
        if key in self._cuda_labels:
            raise GraphtraceError(f"this CUDA graph is already labelled "
                                  f"{self._cuda_labels[key][0]!r} on this thread")
        self._cuda_labels[key] = [label, False]

    def _unlabel_cuda_graph(self, graph) -> bool:
        """Drop the label of `graph` on this thread; whether a capture of it began meanwhile."""
        entry = self._cuda_labels.pop((threading.get_ident(), id(graph)), None)
        return bool(entry and entry[1])

    def _cuda_begin(self, graph, args, kwargs) -> None:
        entry = self._cuda_labels.get((threading.get_ident(), id(graph)))
        if entry is not None:
            entry[1] = True
        outer = self._open_region()
        if outer is not None:  # recorded once, by the region already open on this thread
            self.add_blind_spot(f"a CUDA graph was captured inside capture region "
                                f"{outer.capture.label!r}: its ops are recorded there",
                                kind="nested capture", graph=outer.capture.label or "")
            return
        try:
            label = entry[0] if entry is not None else None
            region = _Region(self, label, "cuda", emulate=False)
            pool = args[0] if args else kwargs.get("pool")
            region.capture.info = {"pool": repr(pool) if pool is not None else "",
                                   "stream": _current_stream()}
            self._cuda_regions[id(graph)] = region
            region.open()
        except Exception as exc:
            self.recorder.fail("cuda capture_begin", exc)

    def _cuda_end(self, graph) -> None:
        region = self._cuda_regions.pop(id(graph), None)
        if region is not None:
            try:
                region.close()
            except Exception as exc:
                self.recorder.fail("cuda capture_end", exc)

    # -- results -----------------------------------------------------------------------------
    @property
    def captures(self) -> list[Capture]:
        return list(self.recorder.captures)

    @property
    def errors(self) -> list[dict]:
        return list(self.recorder.errors)

    def add_blind_spot(self, text: "str | BlindSpot", *, kind: str = "other", holder: str = "",
                       op: str = "", model: str = "", graph: str = "") -> BlindSpot:
        """Say what the recorder cannot see (opaque handles, kernels launched off the
        dispatcher): a sentence, or a `BlindSpot`; `kind` (vocab.BLIND_SPOT_KINDS), the owner
        path (`holder`) and `op` it concerns let the report match it to edges. A record
        whose text is already there is not added again; returns the record kept."""
        spot = text if isinstance(text, BlindSpot) else BlindSpot(
            kind, text, holder=holder, op=op, model=model, graph=graph)
        for known in self.blind_spots:
            if known.text == spot.text:
                return known
        self.blind_spots.append(spot)
        return spot

    def watch_copy(self, copy: str, source: str, *, model: str = "") -> "Trace":
        """Tell the trace that the tensor (or packed handle) at path `copy` is made from the
        registered weight at path `source`, both on the watched model `model`: the diff then
        reports a ``packed copy not rebuilt`` blind spot when the source changed while the
        copy stayed the same (Note [derived copies] in graphtrace/derived.py). Call it once
        the copy is built; the fingerprint is taken now and again after each capture. With
        lineage on, it is also declared lineage (a producer graphtrace cannot see, such as a
        C++ extension reading a raw pointer): the copy is derived from the source from now
        on, so a captured copy is `unrefreshed` once the source changes and the copy does
        not (`Lineage.declare`)."""
        for name, value in (("copy", copy), ("source", source), ("model", model)):
            if not isinstance(value, str):
                raise TypeError(f"watch_copy: {name} must be a str, got {type(value).__name__}")
        if model not in self._models:
            raise GraphtraceError(f"watch_copy: no watched model is named {model!r}; watch it "
                                  "first (t.watch(model, name=...))")
        with clock.section("derived: fingerprint copies"):
            self.derived.add(model, copy, source, self.models)
        if self.lineage is not None:
            from graphtrace.owners import resolve_path

            live = self.models.get(model)
            try:
                self.lineage.declare(resolve_path(live, copy), resolve_path(live, source))
            except Exception as exc:  # fail open: the fingerprint above still stands
                self.recorder.fail("watch_copy lineage", exc)
        return self

    # -- provenance --------------------------------------------------------------------------
    def models_changed(self) -> None:
        """The watched models were updated (weights pushed, holders rebuilt): captures from
        now on match their storages to owners on a fresh walk of each model."""
        from graphtrace.guard import models_changed

        models_changed(self.owner_snapshot, self.models)

    def record_error(self, where: str, exc: BaseException) -> None:
        """Count an internal error of an integration around this trace (raised when strict),
        as the recorder counts its own: it reaches the report's `errors`."""
        self.recorder.fail(where, exc)

    @property
    def native(self):
        """The native module (graphtrace.native) this trace records with, or None."""
        return self.recorder.native

    @property
    def saw_compiled(self) -> bool:
        """Whether a compiled region (torch.compile) was called inside a capture."""
        return bool(self.compiled_regions.seen)

    # -- recording while serving (Note [recording while serving]) ---------------------------
    def _rule_on(self) -> bool:
        return self.provenance is not None and self.record == "auto"

    def _install_update_hooks(self) -> None:
        """The signals of an update beginning and of serving (Note [recording while
        serving]): global parameter/buffer registration hooks, per watched model a
        `load_state_dict` pre-hook and a forward pre-hook. Removed at exit."""
        if not self._rule_on():
            return
        from torch.nn.modules.module import (
            register_module_buffer_registration_hook,
            register_module_parameter_registration_hook,
        )

        registered = _RuleHook(self, "update")
        self._global_hooks = [register_module_parameter_registration_hook(registered),
                              register_module_buffer_registration_hook(registered)]
        for name, model in self.models.items():
            self._hook_model(name, model)

    def _hook_model(self, name: str, model: torch.nn.Module) -> None:
        if not self._rule_on():
            return
        for handle in self._model_hooks.pop(name, ()):
            handle.remove()
        self._model_hooks[name] = [
            model.register_load_state_dict_pre_hook(_RuleHook(self, "update"))]
        old = self._serve_hooks.pop(name, None)
        if old is not None:
            old.remove()
        if not self._auto_paused:
            self._serve_hooks[name] = model.register_forward_pre_hook(
                _RuleHook(self, "serve"), prepend=True)

    def _hook_serving(self, on: bool) -> None:
        """The forward pre-hooks that pause the rule: on while it records, off while paused,
        so that a serving forward passes no hook (Note [attribution while serving])."""
        if not on:
            for handle in self._serve_hooks.values():
                handle.remove()
            self._serve_hooks.clear()
            return
        for name, model in self.models.items():
            if name not in self._serve_hooks:
                self._serve_hooks[name] = model.register_forward_pre_hook(
                    _RuleHook(self, "serve"), prepend=True)

    def _remove_update_hooks(self) -> None:
        for handle in self._global_hooks:
            handle.remove()
        self._global_hooks = []
        for handles in self._model_hooks.values():
            for handle in handles:
                handle.remove()
        self._model_hooks.clear()
        self._hook_serving(False)
        self._auto_paused = False

    def _attribution_on(self) -> None:
        """Module attribution back on (an update began, the rule was taken over by hand)."""
        try:
            self._attribution.resume()
        except Exception as exc:  # fail open: attribution off costs names, never the engine
            self.recorder.fail("module attribution resume", exc)

    def _attribution_off(self) -> None:
        """The rule paused: module attribution off too, unless a capture is open (on any
        thread); the last one to close turns it off then (Note [attribution while serving])."""
        with self._capturing_lock:
            if self._capturing or not self._auto_paused:
                return
            try:
                self._attribution.pause()
            except Exception as exc:
                self.recorder.fail("module attribution pause", exc)

    def _capture_opens(self) -> list[int]:
        """A capture region opens on this thread: attribution on for it, and the watched
        modules already running put on this thread's module stack (what `seed` found)."""
        with self._capturing_lock:
            self._capturing += 1
            if self._attribution.paused:
                self._attribution_on()
        try:
            return self._attribution.seed()
        except Exception as exc:
            self.recorder.fail("module attribution seed", exc)
            return []

    def _capture_closes(self, seeded: list[int]) -> None:
        self._attribution.unseed(seeded)
        with self._capturing_lock:
            self._capturing -= 1
        self._attribution_off()

    def _serving(self) -> None:
        """A watched model's forward began: under ``record="auto"``, once graphs exist,
        provenance and lineage pause (Note [recording while serving])."""
        p = self.provenance
        if (p is None or self.record != "auto" or self._manual or not self._open
                or self._updating
                or p.suspended or not self.recorder.captures
                or p.thread != threading.get_ident() or self._open_region() is not None
                or self._cuda_regions):
            return
        try:
            p.suspend()
            self._auto_paused = p.suspended
        except Exception as exc:  # fail open: recording on costs time, never the engine
            self.recorder.fail("provenance pause", exc)
        if self._auto_paused:  # Note [attribution while serving]
            self._hook_serving(False)
            self._attribution_off()

    def _update_begins(self) -> None:
        """An update began (Note [recording while serving]): undo the rule's pause."""
        p = self.provenance
        if (p is None or not self._auto_paused or self._manual
                or p.thread != threading.get_ident()):
            return
        try:
            p.unsuspend()
            self._auto_paused = False
        except Exception as exc:
            self.recorder.fail("provenance resume", exc)
        self._rule_records()

    def _rule_records(self) -> None:
        """The rule's pause is over: attribution and the serve hooks back on."""
        self._attribution_on()
        self._hook_serving(self._rule_on() and not self._manual)

    @contextlib.contextmanager
    def updating(self):
        """``with t.updating(): update(model)``: provenance and lineage record inside the
        block, paused or not before it, and a watched model's forward inside it does not
        pause them. After it, a pause made by `pause_provenance()` is restored; otherwise
        they record until the model serves again (Note [recording while serving]). For an
        update graphtrace cannot see begin (`p.data = new`, `p.data.copy_(new)` after the
        model served). Call on the thread that opened the trace."""
        if not self._open:
            raise GraphtraceError("t.updating() needs the trace open: use it inside "
                                  "`with graphtrace.trace(...) as t:`")
        p = self.provenance
        if p is not None:
            self._check_thread("updating")
        user_paused = p is not None and p.suspended and self._manual
        self._updating += 1
        if p is not None and p.suspended:
            self._auto_paused = False
            p.unsuspend()
            self._rule_records()
        try:
            yield self
        finally:
            self._updating -= 1
            if not self._updating and p is not None and self._open and user_paused:
                p.suspend()

    @property
    def provenance_recording(self) -> bool:
        """Is provenance on and not paused (its dispatch mode on the opening thread)?"""
        p = self.provenance
        return p is not None and self._open and not p.suspended

    def pause_provenance(self) -> None:
        """Stop noting creation sites (an engine's steady state: its eager forwards then run
        without provenance's dispatch mode); idempotent. Storages made meanwhile read
        ``not recorded``. From then on provenance is steered by hand (the rule of Note
        [recording while serving] stops). Call on the thread that opened the trace."""
        if self.provenance is not None and self._open:
            self._check_thread("pause_provenance")
            self.provenance.suspend()
            self._auto_paused = False
            self._manual = True  # steered by hand from now on: Note [recording while serving]
            self._attribution_on()

    def resume_provenance(self) -> None:
        """Note creation sites again after `pause_provenance` (around a weight update); steered
        by hand from then on, as after `pause_provenance`."""
        if self.provenance is not None and self._open:
            self._check_thread("resume_provenance")
            self.provenance.unsuspend()
            self._auto_paused = False
            self._manual = True
            self._attribution_on()

    @contextlib.contextmanager
    def provenance_paused(self):
        """``with t.provenance_paused(): ...``: no creation sites noted inside the block."""
        was = self.provenance_recording
        self.pause_provenance()
        try:
            yield self
        finally:
            if was:
                self.resume_provenance()

    def _check_thread(self, what: str) -> None:
        if self.provenance.thread not in (None, threading.get_ident()):
            raise GraphtraceError(f"{what}() must run on the thread that opened the trace "
                                  "(provenance's dispatch mode lives on that thread's stack)")

    @property
    def accesses(self):
        """Every recorded access as a DataFrame (columns in docs/internals.md)."""
        from graphtrace.frames import accesses_frame

        return accesses_frame(self.recorder)

    def diff(self):
        """Resolve capture-time owners on the live model(s) and classify every edge."""
        from graphtrace.diff import diff

        models = self._live_models() if self.recorder.captures else self.models  # no capture: say that
        spots = self._spots_now(models)
        if self.derived.pairs:
            spots += self.derived.check(models)
        if self.baked_scalars.records:
            spots += self.baked_scalars.check(models)
        extra = {"capture_hooks": self._patch.how}  # Note [CUDA graph capture hooks]
        rows = self._compiled_rows()
        if rows:  # per capture and compiled region: what was attributed (compiled.py)
            extra["compiled"] = rows
            spots += self._compiled_spots(spots, rows)
        return diff(self.recorder, self.owner_snapshot, models, spots,
                    provenance=self.provenance, extra_meta=extra, lineage=self.lineage)

    def _match_late(self) -> None:
        """Note [derived during updates] in graphtrace/lineage/graph.py (fail open)."""
        lineage = self.lineage
        if lineage is None or not self.recorder.captures:
            return
        try:
            lineage.match_late(self.recorder.storages, self.owner_snapshot, self.models)
        except Exception as exc:
            self.recorder.fail("lineage late match", exc)

    def _spots_now(self, models: dict[str, torch.nn.Module]) -> list[BlindSpot]:
        """What a diff and a guard both do first: lineage caught up (Note [derived during
        updates] in graphtrace/lineage/graph.py), then the trace's blind spots, the storages
        captured since the last owner match matched first, so what that walk cut is one of
        them (a `walk cut` both see, and every later diff)."""
        if self.lineage is not None:
            self.lineage.catch_up()
        if self.recorder.captures and models:
            self._match_owners()
        return list(self.blind_spots)

    @staticmethod
    def _compiled_spots(spots: list[BlindSpot], rows: list[dict]) -> list[BlindSpot]:
        """The compiled regions' blind spots (graphtrace.compiled) not already in `spots`."""
        from graphtrace.compiled import blind_spots

        known = {s.text for s in spots}
        return [s for s in blind_spots(rows) if s.text not in known]

    def _compiled_rows(self) -> list[dict]:
        """graphtrace.compiled.region_ownership of the captures ([] without compiled regions)."""
        from graphtrace.compiled import region_ownership

        if not (self.compiled_regions.seen and self.recorder.captures and self.models):
            return []
        self._match_owners()  # region_ownership counts owners: match the newest storages first
        return region_ownership(self)

    @property
    def lineage(self):
        """The trace's `graphtrace.lineage.Lineage` (None when lineage or provenance is off)."""
        return self.provenance.lineage if self.provenance is not None else None

    def findings(self):
        """What lineage found beside the graphs' edges, graph or no graph: one row per live
        handle and source of it that was freed (`kind` `dangling source`, or `released
        source` when the model dropped that path on purpose; Note [dangling sources] in
        graphtrace/lineage/handles.py), columns graphtrace.vocab.FINDING_FIELDS. The same rows are
        `t.diff().findings`. Empty without lineage."""
        from graphtrace.diff import lineage_findings
        from graphtrace.report.core import findings_frame

        return findings_frame(lineage_findings(self.lineage, self.models, self.recorder.fail))

    def guard(self, first_graph: int = 0, *, accept: Iterable[str] = ()):
        """A `graphtrace.guard.Guard` of the owned storages captured so far (graph ids from
        `first_graph`): weak handles and owner paths only; ``guard.check()`` /
        ``guard.enforce()`` after each weight update (docs/guard.md). The blind spots of
        those graphs go in too, and fail the check after an update that may have
        invalidated them unless their kind is in `accept` (e.g. ``["opaque handle"]``;
        kinds: vocab.BLIND_SPOT_KINDS; Note [blind spots in the guard] in graphtrace/guard/blind.py)."""
        from graphtrace.guard import accepted_kinds, guard_of

        accept = accepted_kinds(accept)
        models = self._live_models() if self.recorder.captures else self.models
        spots = self._spots_now(models)
        if self.recorder.captures:
            try:
                spots += self._compiled_spots(spots, self._compiled_rows())
            except Exception as exc:  # fail open here: the guard still checks identity
                self.recorder.fail("compiled regions for the guard", exc)
        baked = self.baked_scalars.spots()
        values = {b: self.baked_scalars.value_of(b) for b in baked}
        return guard_of(self.recorder, self.owner_snapshot, models, first_graph,
                        lineage=self.lineage, blind_spots=spots + baked, accept=accept,
                        values=values, copies=self.derived.pairs.values())

    def __repr__(self) -> str:
        state = "open" if self._open else ("closed" if self._closed else "new")
        n = sum(c.n_accesses for c in self.recorder.captures)
        return (f"<graphtrace.Trace {state} ({self.recorder.backend} recorder): "
                f"{len(self.recorder.captures)} graphs, {n} accesses, "
                f"{len(self.recorder.storages.handles)} storages, {len(self.models)} models, "
                f"{self.recorder.n_errors} errors>")


class _RuleHook:
    """A hook of Note [recording while serving]: "update" (an update begins) or "serve" (a
    forward begins). Holds its trace weakly; pickled or copied with a model, it becomes
    `_no_hook` (a copy of a watched model is not watched)."""

    __slots__ = ("trace", "kind")

    def __init__(self, trace: "Trace", kind: str):
        self.trace = weakref.ref(trace)
        self.kind = kind

    def __call__(self, *args):
        trace = self.trace()
        if trace is None:
            return None
        if self.kind == "update":
            if trace._auto_paused:
                trace._update_begins()
        elif not trace._auto_paused and not _compiling():  # Dynamo inlines hooks: skip there
            trace._serving()
        return None

    def __reduce__(self):
        return (_inert_hook, ())


def _no_hook(*args) -> None:
    return None


def _inert_hook():
    return _no_hook


def _compiling() -> bool:
    try:
        return torch.compiler.is_compiling()
    except Exception:  # a torch without torch.compiler: nothing compiles
        return False


def _current_stream() -> str:
    try:
        return str(torch.cuda.current_stream())
    except Exception:  # no CUDA runtime (a fake graph in tests): nothing to name
        return ""


def trace(model: torch.nn.Module | None = None, *, strict: bool = False,
          name: str | None = None, native: bool | None = None, modules: str = "forward",
          provenance: bool | None = None, lineage: bool | None = None,
          record: str = "auto") -> Trace:
    """Open a trace: every capture region and CUDA graph captured inside it is recorded.

    `model` (optional) is watched for owners; add more with `t.watch(model, name=...)`.
    `strict=True` raises internal errors instead of counting them (for tests).
    `native`: record with the C++ writer (True: required), the Python one (False), or as
    GRAPHTRACE_NATIVE says (None; default auto: C++ when it can be built). Same records.
    `modules`: how recorded ops learn the watched module they ran in: "forward" (default;
    wraps each module's forward while the trace is open), "hooks" (forward hooks: slower,
    leaves `module.forward` untouched) or "off" (no attribution; cheapest).
    See graphtrace.attribution.
    `provenance`: note where each storage made outside capture regions was created, for
    the report's `created_at` / `live_created_at` columns (True; None: as
    GRAPHTRACE_PROVENANCE says, default on; False: off). See Note [provenance] in
    graphtrace/provenance.py.
    `lineage`: with provenance, record which storages each op wrote from which it read, so
    a storage derived from parameters that changed since is `unrefreshed` (True; None: as
    GRAPHTRACE_LINEAGE says, default on; False: off). See Note [lineage] in
    graphtrace/lineage/graph.py.
    `record`: when provenance and lineage record: "auto" (default) while loading, capturing
    and around weight updates, paused while the model serves (from a watched model's
    forward once graphs exist until an update begins: `load_state_dict`, a parameter or
    buffer registered, `t.updating()`); "always": whenever the trace is open. See Note
    [recording while serving] in graphtrace/tracing.py.
    """
    if model is not None and not isinstance(model, torch.nn.Module):
        raise TypeError(f"graphtrace.trace() takes a torch.nn.Module, got {type(model).__name__}")
    if native not in (None, True, False):
        raise TypeError(f"native must be True, False or None, got {native!r}")
    if provenance not in (None, True, False):
        raise TypeError(f"provenance must be True, False or None, got {provenance!r}")
    if lineage not in (None, True, False):
        raise TypeError(f"lineage must be True, False or None, got {lineage!r}")
    return Trace(model, strict=strict, name=name, native=native, modules=modules,
                 provenance=provenance, lineage=lineage, record=record)
