"""Compiled regions: what Inductor-compiled code reads, recorded as one op per call.

Note [Compiled regions]
~~~~~~~~~~~~~~~~~~~~~~~
Inside `torch.compile`d code a dispatch mode sees only extern kernels and custom ops: fused
kernels (C++ on CPU, Triton on CUDA) read parameters, buffers and every tensor Dynamo lifted
without reaching the dispatcher. The recording mode declares `ignore_compile_internals()`, so
Dynamo keeps the compiled frames it has (never de-compiles them) and we must look at the
boundary instead.

The boundary is `CompiledFxGraph.__call__(inputs)` (torch/_inductor/output_code.py): the one
class-level entry every Inductor graph goes through at run time, whether compiled before the
trace opened, inside it, or loaded from the FX graph cache (AOTAutograd's runtime wrappers
are closures made per graph, so they cannot be wrapped after the fact). While a trace is
open the class method is wrapped; it is restored when the trace closes. A call made while a
capture region is recording on this thread becomes one op `compiled::<region>` whose
arguments are, in order,

* the graph's inputs (read; those in `mutated_input_idxs` are also written, in a row after
  all the op's reads), named by Dynamo's
  graph-arg source (`L['self']._modules['0']._parameters['weight']`) when the graph was
  compiled while the trace was open, else `input<i>`;
* the constants compiled into the graph (`constants`, frozen parameters), read from the
  generated module that holds them and named by the attribute that holds them;

and whose output is the graph's output list. The extern kernels the graph calls stay
recorded as their own ops (before the region's op), so nothing already seen is lost.

An emulated graph (`gt.capture` on CPU) keeps the call, not the extern kernels inside it, and
replays it by calling the compiled code again on the captured inputs: like a real CUDA graph,
a copy reload is seen, a rebinding reload is not.

Compilation itself runs with the mode switched off (`ignore_compile_internals`), so
compile-time work is never recorded; only the region's first run is.

On CUDA each Triton launch (`CachingAutotuner.run`, the hook DebugMode uses) is recorded too,
as an op `triton::<kernel>` with the kernel's argument names (`triton_meta["signature"]`).
Launches that never reach Python (the C++ wrapper, `cpp_wrapper=True`) are a blind spot the
report names; the region's own op still records the graph's inputs.

Per capture and region, `region_ownership(trace)` says how many tensor inputs and constants were
owned by a watched model at capture time; the diff puts it into `report.meta["compiled"]`.

Note [frozen constants]
~~~~~~~~~~~~~~~~~~~~~~~
With `torch._inductor.config.freezing = True` (under no_grad) Inductor turns parameters into
compiled-in constants and folds what it computes from them at compile time: transposed
copies, MKL/oneDNN prepacked weights (tensors without a storage). A copy reload changes the
parameter; the constant keeps the old value, and the graph computes with it. No watched model
owns the constant, and no dispatch mode sees it being made (compilation runs with modes
off), so without more it is a blind spot of the whole region. While a trace is open
Inductor's `replace_node_with_constant` (the one function freezing and constant folding make
every constant with) is wrapped (at the trace's entry when Inductor's constant folding is
already imported, else when Dynamo first hands a graph to a compiler: an eager engine's
startup never imports freezing): for a constant computed from others (a folded node), the
get_attr constants it was computed from (transitively through the node's inputs) are noted
as its sources in the trace's lineage (`Lineage.derive`: a parameter frozen as itself is
its own storage, so the sources end at the parameters). A constant without a storage is
recorded through a stand-in on its proxy storage (graphtrace.opaque.stand_in) in the
region's op. At the capture's end lineage matches the constant to the parameters it came
from (`derived_from`), and once they change the edge is `unrefreshed` (Note [freshness] in
graphtrace/verdict.py) in the diff and the guard alike. Needs lineage (provenance on) and
a graph compiled while the trace is open; a graph compiled before, or loaded from the FX
graph cache, keeps its constants unexplained (the region's `compiled` blind spot says so).
"""

from __future__ import annotations

import re
import sys
import threading
import weakref
from typing import Any, Callable, Iterable, Sequence

import torch

from graphtrace._compat import (
    CONSTANT_FOLDING,
    disable_current_modes,
    dispatch_stack_at,
    dispatch_stack_len,
    load_caching_autotuner,
    load_compiled_fx_graph,
    load_constant_makers,
    load_output_graph,
)
from graphtrace.blindspots import BlindSpot
from graphtrace.encoding import READ, REPLAY_FRESH, WRITE, pack_code
from graphtrace.opaque import is_opaque, proxy_storage, stand_in
from graphtrace.recorder import RecordingMode

__all__ = ["CompiledPatch", "CompiledRegion", "pair_triton_args", "source_to_path",
           "region_ownership", "blind_spots", "REGION_PREFIX", "TRITON_PREFIX"]

REGION_PREFIX = "compiled::"
TRITON_PREFIX = "triton::"


class _RegionPlan:
    """A `recorder._Plan` for an op that is no `OpOverload`: one row code per argument."""

    __slots__ = ("op_id", "positional", "by_keyword", "returns", "may_alias", "opaque")

    def __init__(self, op_id: int, positional: tuple, out_id: int, opaque: bool = False):
        self.op_id = op_id
        self.positional = positional
        self.by_keyword: dict = {}
        self.returns = (pack_code(out_id, READ),)  # one slot: the output list, as a Tensor[]
        self.may_alias = False
        self.opaque = opaque  # ScriptObject arguments: the native writer hands the op to PyWriter


class CompiledRegion:
    """One compiled graph as one trace sees it: its op name, argument names and plan.

    It is also the key of its plan in `Recorder.plans` (both writers look plans up by the
    op's object), so it lives as long as the trace. It holds no tensor: constants are read
    from the graph's generated module at each call.
    """

    __slots__ = ("name", "arg_names", "sources", "mutated", "constant_names", "plan",
                 "n_inputs", "graph_ref", "names_from", "opaque", "cpp_wrapper", "device_types",
                 "sources_checked", "stats_capture", "stats", "__weakref__")

    def __init__(self, name: str, graph: Any, names: Sequence[tuple] | None):
        self.name = name
        self.graph_ref = weakref.ref(graph)
        self.plan: _RegionPlan | None = None
        self.n_inputs = -1
        self.mutated = frozenset(int(i) for i in (getattr(graph, "mutated_input_idxs", None) or ()))
        self.sources: list[str | None] = [n[1] for n in names] if names else []
        self.arg_names: list[str] = [n[1] or n[0] for n in names] if names else []
        self.names_from = "dynamo" if names else "position"
        self.sources_checked = False
        self.stats_capture = None  # the capture `stats` (its calls, unreadable names) is for
        self.stats: dict = {}
        # (argument name, global name in the generated module) per constant compiled in
        self.constant_names: list[tuple[str, str]] = []
        for cname in (getattr(graph, "constants", None) or {}):
            self.constant_names.append((f"constant:{cname}", cname))
        for cname, orig in (getattr(graph, "frozen_param_names", None) or {}).items():
            self.constant_names.append((f"constant:{orig}", cname))
        # objects compiled in whose reads we cannot see (torchbind objects, opaque values)
        self.opaque = sorted(getattr(graph, "torchbind_constants", None) or {})
        kwargs = getattr(graph, "fx_kwargs", None) or {}
        self.cpp_wrapper = bool(kwargs.get("cpp_wrapper"))
        self.device_types = sorted(getattr(graph, "device_types", None) or ())

    def constants(self, graph: Any) -> list:
        """The constant tensors as the compiled code sees them now (its module's globals)."""
        if not self.constant_names:
            return []
        fn = getattr(graph, "current_callable", None)
        space = getattr(fn, "__globals__", None)
        if space is None:
            runner = getattr(graph, "compiled_fn_runner", None)
            space = getattr(getattr(runner, "call", None), "__globals__", None) or {}
        return [space.get(g) for _, g in self.constant_names]

    def mutated_inputs(self) -> list[int]:
        """The positions of the inputs the compiled code writes, in order."""
        return sorted(i for i in self.mutated if 0 <= i < self.n_inputs)

    def make_plan(self, names, args: Sequence) -> _RegionPlan:
        """Row codes: inputs and constants (read), then the mutated inputs again (written);
        arg ids interned."""
        n_inputs = self.n_inputs = len(args)
        if len(self.arg_names) != n_inputs:  # Dynamo's placeholders did not line up
            self.arg_names = [f"input{i}" for i in range(n_inputs)]
            self.sources = []
            self.names_from = "position"
        codes = [pack_code(names(a), READ) for a in self.arg_names]
        codes += [pack_code(names(a), READ) for a, _ in self.constant_names]
        # a mutated input is read too (a running stat's momentum update, `add_`): its write
        # row comes after every read (`_record` passes those inputs again at the end)
        codes += [pack_code(names(self.arg_names[i]), WRITE) for i in self.mutated_inputs()]
        self.plan = _RegionPlan(names(REGION_PREFIX + self.name), tuple(codes), names("out"),
                                opaque=any(is_opaque(a) for a in args))
        return self.plan


class _TritonKernel:
    """Plan key of one Triton kernel launch shape (per trace): kernel names repeat across
    graphs (`triton_poi_fused_add_0`), so keys are (name, argument codes)."""

    __slots__ = ("name", "plan", "__weakref__")

    def __init__(self, name: str, plan: _RegionPlan):
        self.name = name
        self.plan = plan


class _Replay:
    """What an emulated graph keeps for a compiled call: calling it runs the compiled code
    again on the captured inputs (like a CUDA graph replaying the region's kernels)."""

    __slots__ = ("graph", "n_inputs")

    def __init__(self, graph: Any, n_inputs: int):
        self.graph = graph
        self.n_inputs = n_inputs

    def __call__(self, *args):
        return self.graph.current_callable(list(args[:self.n_inputs]))

    def __repr__(self) -> str:
        return f"compiled region replay ({self.n_inputs} inputs)"


def pair_triton_args(signature: Any, args: Sequence, mutated: Iterable[str] = ()
                     ) -> list[tuple[str, torch.Tensor, bool]]:
    """(argument name, tensor, written) for each tensor a Triton launch passes.

    `signature` is the kernel's `triton_meta["signature"]` (a dict name -> type, or a list of
    names); launch arguments are positional in signature order (as DebugMode pairs them).
    Scalars and constexprs are skipped; extra arguments without a name get `arg<i>`.
    """
    keys = list(signature.keys()) if isinstance(signature, dict) else list(signature or ())
    written = set(mutated or ())
    out = []
    for i, value in enumerate(args):
        if isinstance(value, torch.Tensor):
            name = keys[i] if i < len(keys) else f"arg{i}"
            out.append((name, value, name in written))
    return out


_SOURCE_TOKEN = re.compile(r"\._(?:modules|parameters|buffers)\[('(?:[^'\\]|\\.)*')\]"
                           r"|\.([A-Za-z_]\w*)|\[([^\]]+)\]")


def source_to_path(source: str | None) -> tuple[str, str] | None:
    """A Dynamo graph-arg source relative to `L['self']` as an owner path and kind.

    `L['self']._modules['layers']._modules['0']._parameters['weight']` -> (`layers.0.weight`,
    `parameter`); `L['self'].kernel.keywords['perm']` -> (`kernel.keywords['perm']`,
    `attribute`). None for sources not under `L['self']` or with parts we cannot spell.
    """
    if not source or not source.startswith("L['self']"):
        return None
    rest = source[len("L['self']"):]
    parts: list[str] = []
    kind = "attribute"
    pos = 0
    while pos < len(rest):
        m = _SOURCE_TOKEN.match(rest, pos)
        if m is None:
            return None
        whole = m.group(0)
        if m.group(1) is not None:  # a registry entry: module, parameter or buffer name
            name = m.group(1)[1:-1]
            sep = "." if parts else ""
            parts.append(sep + name)
            kind = ("parameter" if whole.startswith("._parameters")
                    else "buffer" if whole.startswith("._buffers") else "attribute")
        elif m.group(2) is not None:
            parts.append(("." if parts else "") + m.group(2))
            kind = "attribute"
        else:
            if not parts:
                return None
            parts.append(f"[{m.group(3)}]")
            kind = "attribute"
        pos = m.end()
    if not parts:
        return None
    return "".join(parts), kind


def _recording_mode(trace) -> Any:
    """This thread's innermost graphtrace recording mode of `trace`, if one is recording
    (looked at from the top of the stack, where it usually is: once per compiled call)."""
    recorder = trace.recorder
    for i in range(dispatch_stack_len() - 1, -1, -1):
        mode = dispatch_stack_at(i)
        if isinstance(mode, RecordingMode) and mode.recorder is recorder:
            return mode
    return None


class _Pending(threading.local):
    names: list | None = None


class CompiledPatch:
    """Wraps Inductor's run-time boundary (and Triton launches) while a trace is open.

    Fail open: an error in our bookkeeping is counted (`recorder.fail`) and the compiled code
    runs as it would have; in strict mode it raises.
    """

    def __init__(self, trace):
        self._trace = weakref.ref(trace)  # the trace holds this patch: no cycle back
        self.saved: list[tuple[type, str, Any]] = []
        self.regions: dict[int, CompiledRegion] = {}   # id(CompiledFxGraph) -> region
        self.kernels: dict[tuple, _TritonKernel] = {}  # (name, argument codes) -> key
        self.seen: dict[int, dict[CompiledRegion, dict]] = {}  # graph id -> region -> stats
        self._pending = _Pending()
        self._names_by_graph: dict[int, tuple[weakref.ref, list]] = {}
        self._lock = threading.Lock()
        self._makers_wrapped = False  # Note [frozen constants]: wrapped on first need
        self.n_triton = 0

    @property
    def trace(self):
        """The trace this patch records into (installed wrappers hold it only while open)."""
        return self._trace()

    # -- install / uninstall -----------------------------------------------------------------
    def _wrap(self, cls: type, name: str, make: Callable[[Callable], Callable]) -> None:
        original = cls.__dict__.get(name)
        if original is None:
            return
        self.saved.append((cls, name, original))
        setattr(cls, name, make(getattr(cls, name)))

    def install(self) -> None:
        try:
            CompiledFxGraph = load_compiled_fx_graph()
        except Exception as exc:  # a torch without Inductor: nothing compiled to see
            self.trace.add_blind_spot(f"compiled: Inductor's boundary could not be hooked "
                                      f"({type(exc).__name__}: {exc}); reads of compiled code "
                                      "outside extern kernels are not recorded",
                                      kind="compiled")
            return
        self._wrap(CompiledFxGraph, "__call__", self._make_call)
        self._wrap(CompiledFxGraph, "post_compile", self._make_post_compile)
        try:
            OutputGraph = load_output_graph()
            self._wrap(OutputGraph, "call_user_compiler", self._make_user_compiler)
            hooked = True
        except Exception:  # names fall back to positions
            hooked = False
        # Note [frozen constants]: wrapped now when already imported (~50 ms to import in an
        # eager vLLM engine), else in call_user_compiler
        if not hooked or CONSTANT_FOLDING in sys.modules:
            self._wrap_constant_makers()
        if torch.cuda.is_available():
            try:
                CachingAutotuner = load_caching_autotuner()
                self._wrap(CachingAutotuner, "run", self._make_triton_run)
            except Exception as exc:
                self.trace.add_blind_spot(f"compiled: Triton launches cannot be hooked "
                                          f"({type(exc).__name__}); only compiled regions' "
                                          "inputs are recorded", kind="compiled")

    def _wrap_constant_makers(self) -> None:
        if self._makers_wrapped:
            return
        self._makers_wrapped = True
        try:
            for module in load_constant_makers():
                self._wrap(module, "replace_node_with_constant", self._make_constant_maker)
        except Exception:  # folded constants stay unexplained (a `compiled` blind spot)
            pass

    def uninstall(self) -> None:
        for cls, name, original in reversed(self.saved):
            setattr(cls, name, original)
        self.saved.clear()
        self._makers_wrapped = False

    # -- compile time: Dynamo's names for the graph's inputs ---------------------------------
    def _make_user_compiler(self, original):
        pending = self._pending
        patch = self

        def call_user_compiler(output_graph, gm, *args, **kwargs):
            if not patch._makers_wrapped:
                patch._wrap_constant_makers()  # before Inductor folds anything
            outer = pending.names
            try:
                pending.names = _dynamo_names(gm)
            except Exception:
                pending.names = None
            try:
                return original(output_graph, gm, *args, **kwargs)
            finally:
                pending.names = outer

        return call_user_compiler

    def _make_post_compile(self, original):
        patch = self

        def post_compile(graph, example_inputs, *args, **kwargs):
            out = original(graph, example_inputs, *args, **kwargs)
            try:
                names = patch._pending.names
                graph_kwargs = args[1] if len(args) > 1 else kwargs.get("graph_kwargs") or {}
                if (names is not None and not graph_kwargs.get("is_backward")
                        and _same_shapes(names, example_inputs)):
                    patch._names_by_graph[id(graph)] = (weakref.ref(graph), names)
            except Exception as exc:
                patch.trace.recorder.fail("compiled: naming a compiled graph's inputs", exc)
            return out

        return post_compile

    def _make_constant_maker(self, original):
        patch = self

        def replace_node_with_constant(gm, node, constant=None, name=None):
            try:  # before the call: it erases `node` (and its inputs with it)
                if constant is not None and getattr(node, "op", None) != "placeholder":
                    patch._note_constant(gm, node, constant)
            except Exception as exc:
                trace = patch.trace
                if trace is not None:
                    trace.recorder.fail("compiled: noting a folded constant's sources", exc)
            return original(gm, node, constant, name)

        return replace_node_with_constant

    def _note_constant(self, gm, node, constant) -> None:
        """The get_attr constants `node` is computed from, as `constant`'s lineage sources
        (Note [frozen constants])."""
        trace = self.trace
        lineage = trace.lineage if trace is not None else None
        if lineage is None or not isinstance(constant, torch.Tensor):
            return
        sources, seen = [], set()
        todo = list(node.all_input_nodes)
        while todo:
            n = todo.pop()
            if n in seen:
                continue
            seen.add(n)
            if n.op == "get_attr":
                value = getattr(gm, n.target, None)
                if isinstance(value, torch.Tensor):
                    sources.append(_storage_or_proxy(value))
            else:
                todo.extend(n.all_input_nodes)
        if sources:
            lineage.derive(_storage_or_proxy(constant), sources)

    # -- run time ----------------------------------------------------------------------------
    def region_of(self, graph) -> CompiledRegion:
        region = self.regions.get(id(graph))
        if region is not None and region.graph_ref() is graph:
            return region
        with self._lock:
            named = self._names_by_graph.get(id(graph))
            names = named[1] if named is not None and named[0]() is graph else None
            kwargs = getattr(graph, "fx_kwargs", None) or {}
            gid = kwargs.get("graph_id")
            label = str(getattr(graph, "compile_region_name", None) or (
                f"graph{gid}" if gid is not None else f"graph_{len(self.regions)}"))
            taken = {r.name for r in self.regions.values()}
            if label in taken:  # two graphs of one name (e.g. loaded from a cache): one op each
                label = next(f"{label}_{i}" for i in range(1, len(taken) + 2)
                             if f"{label}_{i}" not in taken)
            region = self.regions[id(graph)] = CompiledRegion(label, graph, names)
        return region

    def _make_call(self, original):
        patch = self
        trace = self.trace
        recorder = trace.recorder
        regions = self.regions
        storages = recorder.storages
        native = storages.native_table
        table = storages if native is None else native  # native: len and sweep without a frame
        sweep = table.sweep

        def __call__(graph, inputs):
            mode = _recording_mode(trace)
            if mode is None:
                return original(graph, inputs)
            try:
                region = regions.get(id(graph))
                if region is None or region.graph_ref() is not graph:
                    region = patch.region_of(graph)
                args = tuple(inputs)  # the compiled code clears `inputs` (boxed convention)
            except Exception as exc:
                recorder.fail("compiled: before a compiled region", exc)
                return original(graph, inputs)
            first = len(table)
            emulated = mode.emulated
            if emulated is None:
                out = original(graph, inputs)
            else:
                mode.emulated = None  # the region replays as one op
                try:
                    out = original(graph, inputs)
                finally:
                    mode.emulated = emulated
            try:
                patch._record(mode, region, graph, args, out, emulated)
            except Exception as exc:
                recorder.fail(f"compiled: recording {REGION_PREFIX}{region.name}", exc)
                trace.add_blind_spot(f"compiled: region {region.name!r} ran in capture "
                                     f"{mode.capture.label!r} but its reads could not be "
                                     "recorded (see report.errors)", kind="compiled",
                                     op=REGION_PREFIX + region.name, graph=mode.capture.label)
            try:  # the graph's buffers are dead now: Note [weak handles and the sweep]
                sweep(first)
            except Exception as exc:
                recorder.fail("compiled: sweeping a region call's dead buffers", exc)
            return out

        return __call__

    def _record(self, mode, region: CompiledRegion, graph, args: tuple, out, emulated) -> None:
        if region.plan is not None and region.n_inputs != len(args):
            # a plan is never changed under its key (the native writer caches plans by key):
            # another input count gets a region object of its own
            with self._lock:
                region = self.regions[id(graph)] = CompiledRegion(
                    f"{region.name}_{len(args)}in", graph, None)
        if region.plan is None:
            recorder = self.trace.recorder
            recorder.plans[region] = region.make_plan(recorder.names, args)
        constants = region.constants(graph) if region.constant_names else None
        if constants:  # a constant without a storage: its stand-in (Note [frozen constants])
            constants = [c if not isinstance(c, torch.Tensor) or c.layout == torch.strided
                         else _stand_in(c) for c in constants]
        values = args + tuple(constants) if constants else args
        mutated = region.mutated_inputs()
        if mutated:  # the plan's write rows, after the constants (one per name: make_plan)
            values += tuple(args[i] for i in mutated)
        flags = mode.record_only(region, values, None, out)
        if emulated is not None:
            with disable_current_modes():  # keep() makes aliases: ops no mode may record
                emulated.keep(_Replay(graph, len(args)), values, {}, out, flags | REPLAY_FRESH)
        capture = mode.capture
        if region.stats_capture is capture:  # this capture's stats, kept on the region
            region.stats["calls"] += 1
            return
        seen = self.seen.get(capture.graph_id)
        if seen is None:
            seen = self.seen[capture.graph_id] = {}
        stats = seen.get(region)
        if stats is None:
            stats = seen[region] = {"calls": 0, "unreadable": []}
            stats["unreadable"] = self._note_blind_spots(region, capture.label, constants or [])
        stats["calls"] += 1
        region.stats_capture, region.stats = capture, stats
        if region.names_from == "dynamo" and not region.sources_checked:
            region.sources_checked = True
            _source_owners(self.trace, region, args)

    def _note_blind_spots(self, region: CompiledRegion, label: str, constants: list) -> list:
        """Say what this region reads that we cannot record; return those names."""
        op = REGION_PREFIX + region.name

        def add(text: str) -> None:
            self.trace.add_blind_spot(text, kind="compiled", op=op, graph=label)

        if region.opaque:
            add(f"compiled: region {region.name!r} (capture {label!r}) holds compiled-in "
                f"objects ({', '.join(region.opaque)}) whose tensor reads are not recorded")
        missing = [a for (a, _), c in zip(region.constant_names, constants)
                   if not isinstance(c, torch.Tensor)]
        if missing:
            add(f"compiled: region {region.name!r} (capture {label!r}): constants "
                f"{', '.join(missing)} could not be read from the compiled module")
        if region.cpp_wrapper and "cuda" in region.device_types:
            add(f"compiled: region {region.name!r} (capture {label!r}) launches its Triton "
                "kernels from C++ (cpp_wrapper): per-kernel launches are not recorded, only "
                "the region's inputs and constants")
        return missing + list(region.opaque)

    # -- Triton launches (CUDA) --------------------------------------------------------------
    def _make_triton_run(self, original):
        patch = self
        trace = self.trace

        def run(autotuner, *args, benchmark_run=False, **kwargs):
            mode = None if benchmark_run else _recording_mode(trace)
            out = original(autotuner, *args, benchmark_run=benchmark_run, **kwargs)
            if mode is not None:
                try:
                    patch._record_triton(mode, autotuner, args)
                except Exception as exc:
                    trace.recorder.fail("compiled: recording a Triton launch", exc)
            return out

        return run

    def _record_triton(self, mode, autotuner, args: tuple) -> None:
        name = getattr(getattr(autotuner, "fn", None), "__name__", "kernel")
        signature = (getattr(autotuner, "triton_meta", None) or {}).get("signature", {})
        mutated = getattr(autotuner, "mutated_arg_names", ()) or ()
        pairs = pair_triton_args(signature, args, mutated)
        recorder = self.trace.recorder
        codes = tuple(pack_code(recorder.names(n), WRITE if w else READ) for n, _, w in pairs)
        key = self.kernels.get((name, codes))
        if key is None:
            plan = _RegionPlan(recorder.names(TRITON_PREFIX + name), codes, recorder.names("out"))
            plan.returns = ()
            key = self.kernels[(name, codes)] = _TritonKernel(name, plan)
            recorder.plans[key] = plan
        mode.writer.record(key, tuple(t for _, t, _ in pairs), {}, None)
        self.n_triton += 1


def _storage_or_proxy(t: torch.Tensor) -> torch.UntypedStorage:
    """A tensor's storage, or for one without (mkldnn/MKL-packed) its proxy storage."""
    if t.layout == torch.strided:
        return t.untyped_storage()
    return proxy_storage(t)


def _stand_in(t: torch.Tensor) -> torch.Tensor:
    with disable_current_modes():  # set_ is an op no mode may record
        return stand_in(t)


def _shape_of(value) -> tuple | None:
    """A tensor's shape when every size is a plain int, else None. Never int() a SymInt: that
    would specialize a dynamic size (a guard added to the graph being compiled)."""
    shape = getattr(value, "shape", None)
    if shape is None or not all(type(d) is int for d in shape):
        return None
    return tuple(shape)


def _same_shapes(names: list, example_inputs: Sequence) -> bool:
    """Dynamo's placeholders line up with the compiled graph's inputs: as many, and the
    tensor shapes agree position by position (AOTAutograd may add, drop or reorder inputs)."""
    if len(names) != len(example_inputs):
        return False
    for entry, example in zip(names, example_inputs):
        want, got = entry[2], _shape_of(example)
        if want is not None and got is not None and want != got:
            return False
    return True


def _dynamo_names(gm) -> list[tuple[str, str | None, tuple | None]]:
    """(placeholder name, graph-arg source name or None, example shape or None) per
    placeholder of Dynamo's graph."""
    out = []
    for node in gm.graph.find_nodes(op="placeholder"):
        source = None
        arg = node.meta.get("grapharg")
        src = getattr(arg, "source", None)
        if src is not None:
            try:
                source = src.name() if callable(getattr(src, "name", None)) else str(src.name)
            except Exception:
                source = None
        out.append((node.name, source, _shape_of(node.meta.get("example_value"))))
    return out


def _source_owners(trace, region: CompiledRegion, args: tuple) -> None:
    """Dynamo's sources as owner evidence: an input passed as `L['self'].<path>` whose path
    reaches the very same storage on a watched model is owned by that path (found even where
    the owner walk stops). Once per region and trace."""
    from graphtrace.owners import resolve_path

    table = trace.recorder.storages
    for source, value in zip(region.sources, args):
        found = source_to_path(source) if isinstance(value, torch.Tensor) else None
        if found is None:
            continue
        path, kind = found
        cdata = value.untyped_storage()._cdata
        sid = table.find(cdata)
        if sid is None:
            continue
        for name, model in trace.models.items():
            try:
                live = resolve_path(model, path)
            except Exception:
                continue
            if isinstance(live, torch.Tensor) and live.untyped_storage()._cdata == cdata:
                trace.owner_snapshot.owners.setdefault(sid, set()).add((name, path, kind))


def region_ownership(trace, raw: dict | None = None) -> list[dict]:
    """Per capture and compiled region: calls, tensor inputs and constants (distinct argument
    names), and how many of them a watched model owned at capture time (`owned_*`), read from
    the records themselves; `derived_constants`: constants no model owns that lineage ties to
    the parameters they were folded from (Note [frozen constants]); `unreadable`: what the
    region reads that could not be recorded."""
    import numpy as np

    from graphtrace.frames import raw_accesses

    patch = getattr(trace, "compiled_regions", None)
    if patch is None or not patch.seen:
        return []
    raw = raw_accesses(trace.recorder) if raw is None else raw
    names = trace.recorder.names.items
    owners = trace.owner_snapshot.owners
    owned_sids = np.fromiter(owners, dtype=np.int64, count=len(owners))
    lineage = getattr(trace, "lineage", None)
    derived = lineage.captured if lineage is not None else {}
    derived_sids = np.fromiter(derived, dtype=np.int64, count=len(derived))
    labels = {c.graph_id: c.label for c in trace.recorder.captures}
    out_id = trace.recorder.names("out")
    rows = []
    for graph_id, regions in sorted(patch.seen.items()):
        in_graph = raw["graph_id"] == graph_id
        for region, stats in regions.items():
            if region.plan is None:
                continue
            at = in_graph & (raw["op"] == region.plan.op_id) & (raw["arg"] != out_id)
            args, sids = raw["arg"][at], raw["storage_id"][at]
            owned = np.isin(sids, owned_sids)
            tied = ~owned & np.isin(sids, derived_sids)  # Note [frozen constants]
            is_constant = np.array([names[a].startswith("constant:") for a in args.tolist()],
                                   dtype=bool)
            def count(mask):
                return int(len(np.unique(args[mask])))
            rows.append({
                "graph_id": int(graph_id), "graph": labels.get(graph_id, ""),
                "region": REGION_PREFIX + region.name, "calls": stats["calls"],
                "names": region.names_from,
                "tensor_inputs": count(~is_constant), "owned_inputs": count(~is_constant & owned),
                "constants": count(is_constant), "owned_constants": count(is_constant & owned),
                "derived_constants": count(is_constant & tied),
                "unreadable": list(stats["unreadable"]),
            })
    return rows


def blind_spots(rows: list[dict]) -> list[BlindSpot]:
    """What `region_ownership` rows say the report cannot vouch for: constants compiled in that no
    watched model owns and lineage cannot tie to parameters, and compiled-in objects whose
    reads were not recorded."""
    out = []
    for row in rows:
        def spot(text: str) -> BlindSpot:
            return BlindSpot("compiled", text, op=row["region"], graph=row["graph"])

        foreign = row["constants"] - row["owned_constants"] - row.get("derived_constants", 0)
        if foreign:
            out.append(spot(f"compiled: region {row['region']} (capture {row['graph']!r}) reads "
                            f"{foreign} compiled-in constant(s) that no watched model owns "
                            "and lineage did not see made (folded at compile time, e.g. by "
                            "freezing, before the trace opened): a reload never reaches them"))
        if row["unreadable"]:
            out.append(spot(f"compiled: region {row['region']} (capture {row['graph']!r}): "
                            f"{', '.join(row['unreadable'])} could not be recorded"))
    return out
