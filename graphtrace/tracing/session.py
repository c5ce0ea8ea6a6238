"""The session: `trace()` / `Trace`, and the capture boundaries `capture()` and
`capture_cuda_graph()`.

A `Trace` owns the recorder's tables. Recording happens only inside capture regions: an
explicit `capture(label)` (an emulated, replayable graph on any device) or any CUDA graph
captured while the trace is open (Note [CUDA graph capture hooks], Note [CUDA graph labels]).
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from typing import Any, Callable, Iterable

import torch

from graphtrace import clock
from graphtrace.attribution import ModuleAttribution
from graphtrace.blindspots import BlindSpot
from graphtrace.compiled import CompiledPatch
from graphtrace.derived import DerivedCopies
from graphtrace.errors import GraphtraceError
from graphtrace.owners import OwnerSnapshot
from graphtrace.recorder import Capture, Recorder
from graphtrace.scalars import BakedScalars
from graphtrace.tracing.cudagraphs import CudaGraphCaptures, _capture_watcher
from graphtrace.tracing.emulated import EmulatedGraph
from graphtrace.tracing.region import _Region
from graphtrace.tracing.rule import RECORD, RecordingRule

__all__ = ["GraphtraceError", "Trace", "EmulatedGraph", "trace", "capture", "active_trace"]


_active_lock = threading.Lock()
_active: "Trace | None" = None


def active_trace() -> "Trace | None":
    return _active



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


class Trace(RecordingRule, CudaGraphCaptures):
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
        self._attribution.native = native_module  # its module calls (Note [native module call])
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
        if self.recorder.captures:  # Note [owners at trace exit]
            self._match_owners()
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
        if self.recorder.captures:  # walk the models again and match every captured storage
            self._snapshot(self.owner_snapshot.refresh)
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

    def _match_owners(self) -> None:
        """Match the storages captured since the last snapshot (after each capture, at exit)."""
        self._snapshot(self.owner_snapshot.update)

    # Note [owners at trace exit]
    # ~~~~~~~~~~~~~~~~~~~~~~~~~~~
    # Owners are capture-time owners: each capture's end matches its storages against a walk
    # of the models then (cached, and walked again when a matched path moved). At exit the
    # trace only matches what is not matched yet (a CUDA region closed by the exit, a match
    # that failed); it does not walk the models again. A walk at exit (as before) cost a
    # short script a third walk of its model, and was wrong after an update made inside the
    # trace: it added the holders of the captured storages at exit to their owners, so a swap
    # of two captured weights (`a.weight, b.weight = b.weight, a.weight`) read `diverged`
    # with both names as owners from a diff after the block, and `stale` with the one
    # capture-time owner from a diff inside it. A trace without captures walks nothing.

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

    def _after_capture(self) -> None:
        with clock.section("trace: after capture"):
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

    def declare_state(self, tensors: Iterable[torch.Tensor]) -> int:
        """Declare the storages of `tensors` engine state no weight derives (a KV cache, an
        attention kernel's scratch buffer), so that a capture reading them is not found
        `unrefreshed` after an update (Note [engine state] in graphtrace/lineage/graph.py).
        Call it before the capture. Returns how many storages lineage knew; 0 without lineage."""
        if self.lineage is None:
            return 0
        known = 0
        for t in tensors:
            if not isinstance(t, torch.Tensor):
                continue
            try:
                known += self.lineage.forget(t.untyped_storage())
            except NotImplementedError:  # a storage-less layout: no lineage either
                continue
            except Exception as exc:  # fail open
                self.recorder.fail("declare_state", exc)
        return known

    # -- provenance --------------------------------------------------------------------------
    def models_changed(self) -> None:
        """The watched models were updated (weights pushed, holders rebuilt): captures from
        now on match their storages to owners on a fresh walk of each model."""
        for name in self.models:
            self.owner_snapshot.forget(name)

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
        """What lineage found beside the graphs' edges, graph or no graph (`Lineage.findings`:
        kinds vocab.FINDING_KINDS, columns vocab.FINDING_FIELDS). The same rows are
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
    and around weight updates, paused while the model serves; "always": whenever the trace
    is open. See Note [recording while serving] in graphtrace/tracing/rule.py.
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
