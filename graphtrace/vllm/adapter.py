"""In-process graphtrace for a real vLLM engine (``VLLM_ENABLE_V1_MULTIPROCESSING=0``).

::

    import graphtrace.vllm as gv
    with gv.trace_llm() as vt:                 # opens graphtrace.trace() before the engine exists
        llm = LLM(model=..., enforce_eager=True)   # the worker's model is watched once it is loaded
        vt.attach(llm)                         # optional: enables vt.generate / vt.reload
        with vt.capture("decode", skip=1):     # CPU: record the first decode forward as an
            vt.generate(prompts, max_tokens=3)     # emulated graph (a CUDA graph on GPU is traced
        vt.capture_dummy("dummy_decode")       #   by the core without asking); or a dummy run
        vt.reload(new_weights)                 # collective_rpc("reload_weights", ...)
        report = vt.diff()                     # owners resolved again on the live vLLM model

Owner paths are vLLM's own FQNs (``model.layers.0.self_attn.qkv_proj.weight``; the model is
watched under the name ``""``). The model runner is watched as a second model named
``runner`` (``watch_runner=True``) so that the persistent input buffers a graph reads
(``runner.input_ids.gpu``, ``runner.positions.gpu``) are owned, not "external".

Every CUDA graph vLLM captures while the trace is open is recorded by graphtrace's core
(Note [CUDA graph capture hooks] in graphtrace/tracing/cudagraphs.py; vLLM's capture sites:
``capture_sites`` in graphtrace/vllm/releases.py).

What the recorder cannot see (oneDNN handles, KV cache via the forward context) is found
on the model by :mod:`graphtrace.vllm.blind` and reported as `graphtrace.BlindSpot` records
(``report.blind_spot_records``; the raw findings also in ``report.meta["vllm"]["blind_spots"]``;
``packed_copy`` and ``Trace.watch_copy``: graphtrace.vllm.blind's docstring).

In-process mode (``VLLM_ENABLE_V1_MULTIPROCESSING`` set or refused on entry): docs/vllm.md.

Provenance (Note [provenance]) costs every eager op its dispatch mode, so by default
(``pause_provenance=True``) it runs only while the engine loads, compiles and warms up
(``after_warmup`` pauses it) and again around each weight update (``before_update`` /
``after_update`` of graphtrace.vllm.hooks: ``reload_weights``, a weight-transfer session,
``model.load_weights``; and ``vt.reload``).
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Any, Iterable

import torch
from torch import nn

import graphtrace as gt
from graphtrace import clock
from graphtrace.errors import GraphtraceError
from graphtrace.tracing import active_trace
from graphtrace.vllm import blind, env, hooks, releases

logger = logging.getLogger("graphtrace.vllm")

__all__ = ["VllmTrace", "trace_llm", "find_worker", "find_model", "RunnerView", "MP_ENV"]


MP_ENV = "VLLM_ENABLE_V1_MULTIPROCESSING"
_MP_MESSAGE = (
    "this vLLM engine runs its engine core and worker in another process "
    "(VLLM_ENABLE_V1_MULTIPROCESSING is not 0), where an in-process trace cannot see them: "
    "enter graphtrace.vllm.trace_llm() before constructing LLM(...) (it sets "
    "VLLM_ENABLE_V1_MULTIPROCESSING=0), or set VLLM_ENABLE_V1_MULTIPROCESSING=0 yourself, or "
    "trace the worker processes with the plugin (GRAPHTRACE_VLLM=1; graphtrace.vllm.plugin)")


def _require_in_process() -> None:
    """Refuse an environment that asks vLLM for worker processes (set before the trace)."""
    value = os.environ.get(MP_ENV)
    if value is not None and value.strip() != "0":
        raise GraphtraceError(
            f"{MP_ENV}={value} asks vLLM to run the engine core in another process, which an "
            f"in-process trace cannot see: set {MP_ENV}=0 (or leave it unset: trace_llm() then "
            "sets it) before constructing LLM(...), or trace worker processes with the "
            "plugin (GRAPHTRACE_VLLM=1; graphtrace.vllm.plugin)")


class RunnerView(nn.Module):
    """Lets graphtrace walk a vLLM model runner (not an nn.Module) for owner paths.

    The walk sees ``runner.<attr>...`` paths; nn.Modules found there (the model, the
    sampler) are not walked again. Only the attributes in ``attrs`` are exposed (all of the
    runner's own attributes when ``attrs`` is None).
    """

    def __init__(self, runner: Any, attrs: Iterable[str] | None = None):
        super().__init__()
        if attrs is None:
            object.__setattr__(self, "runner", runner)
        else:
            view = _AttrView()
            for a in attrs:
                if hasattr(runner, a):
                    setattr(view, a, getattr(runner, a))
            object.__setattr__(self, "runner", view)

    def forward(self, *args, **kwargs):  # pragma: no cover - never called
        raise RuntimeError("RunnerView is a holder, not a model")


class _AttrView:
    """A plain attribute bag (walked like any user object)."""


# The model runner attributes a captured forward reads as inputs, every supported release's
# runners (V1 and V2: Note [runner buffers] in graphtrace/vllm/releases.py).
RUNNER_INPUT_ATTRS = releases.runner_input_attrs()


def find_worker(llm) -> Any:
    """The in-process vLLM worker behind ``llm`` (an ``LLM`` or ``LLMEngine``).

    Path in vLLM 0.32: ``llm.llm_engine.model_executor.driver_worker.worker`` (the executor
    is also ``llm.llm_engine.engine_core.engine_core.model_executor``). Raises `_MP_MESSAGE`
    when the engine core runs in another process.
    """
    engine = getattr(llm, "llm_engine", llm)
    executor = getattr(engine, "model_executor", None)
    if executor is None:
        core = getattr(getattr(engine, "engine_core", None), "engine_core", None)
        executor = getattr(core, "model_executor", None)
    if executor is None:
        raise GraphtraceError(_MP_MESSAGE)
    wrapper = getattr(executor, "driver_worker", None)
    if wrapper is None:
        raise GraphtraceError(
            f"{type(executor).__name__} has no in-process driver worker (tensor parallel "
            "workers live in other processes): use the worker plugin (GRAPHTRACE_VLLM=1)")
    return getattr(wrapper, "worker", wrapper)


def find_model(llm) -> nn.Module:
    """``llm.llm_engine.model_executor.driver_worker.worker.model_runner.get_model()``."""
    model = hooks.worker_model(find_worker(llm))
    if model is None:
        raise GraphtraceError("the vLLM worker has no model yet")
    return model


class _ForwardCapture:
    """Record chosen calls of a model's forward, each as one emulated graph (which calls:
    `VllmTrace.capture`); a single graph is labelled ``label``, several ``label#0``, ...
    This is the part of a step that vLLM's ``CUDAGraphWrapper`` would capture: the model's
    ``forward`` (``compute_logits`` and sampling run outside it).
    """

    def __init__(self, vt: "VllmTrace", label: str, forwards: int = 1, skip: int = 0,
                 auto_close: bool = False):
        if forwards < 1 or skip < 0:
            raise ValueError("forwards must be >= 1 and skip >= 0")
        self.vt = vt
        self.label = label
        self.forwards = forwards
        self.skip = skip
        self.auto_close = auto_close
        self.calls = 0
        self.graphs: list = []
        self._ctx = None
        self._handles: list = []
        self._thread = None
        self.closed = False

    def _label(self, i: int) -> str:
        return self.label if self.forwards == 1 else f"{self.label}#{i}"

    def open(self) -> "_ForwardCapture":
        model = self.vt.model
        if model is None:
            if os.environ.get(MP_ENV, "1") != "0":
                raise GraphtraceError(_MP_MESSAGE)
            raise GraphtraceError("no vLLM model is watched yet: capture after LLM(...) is built")
        self._handles = [model.register_forward_pre_hook(self._pre),
                         model.register_forward_hook(self._post, always_call=True)]
        return self

    def _pre(self, module, args):
        i = self.calls - self.skip
        self.calls += 1
        if self._ctx is not None or not (0 <= i < self.forwards):
            return
        try:
            ctx = gt.capture(self._label(i))
            graph = ctx.__enter__()
            self._ctx = ctx
            self._thread = threading.get_ident()
            self.graphs.append(graph)
        except Exception:
            if self.vt.strict:
                raise
            logger.exception("graphtrace: could not open capture %r", self._label(i))

    def _post(self, module, args, output):
        if self._ctx is None or self._thread != threading.get_ident():
            return
        ctx, self._ctx = self._ctx, None
        try:
            ctx.__exit__(None, None, None)
        except Exception:
            if self.vt.strict:
                raise
            logger.exception("graphtrace: could not close capture %r", self.label)
        if self.auto_close and self.calls - self.skip >= self.forwards:
            self.close()

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        if self._ctx is not None:
            ctx, self._ctx = self._ctx, None
            ctx.__exit__(None, None, None)
        for h in self._handles:
            h.remove()
        self._handles = []
        if self.vt.keep_graphs:
            self.vt.graphs.extend(self.graphs)

    def __enter__(self) -> "_ForwardCapture":
        return self.open()

    def __exit__(self, *exc) -> None:
        self.close()


class VllmTrace:
    """A graphtrace trace bound to one vLLM engine (see the module docs). Its keyword
    arguments: the options table of docs/vllm.md, "In process: trace_llm". ``provenance``
    is on by default because model loading, process-weights and reloads run inside the
    trace, so the sites point into vLLM's own files.
    """

    def __init__(self, *, strict: bool = False, watch_runner: bool = True,
                 keep_graphs: bool = True, runner_attrs: Iterable[str] | None = RUNNER_INPUT_ATTRS,
                 modules: str = "forward", provenance: bool | None = None,
                 pause_provenance: bool = True, in_process: bool = True,
                 guard=None, guard_dir=None):
        with clock.section("trace: construct"):  # Note [self clock] in graphtrace/clock.py
            self._construct(strict, watch_runner, keep_graphs, runner_attrs, modules, provenance,
                            pause_provenance, in_process, guard, guard_dir)

    def _construct(self, strict, watch_runner, keep_graphs, runner_attrs, modules, provenance,
                   pause_provenance, in_process, guard, guard_dir) -> None:
        self.strict = strict
        self.watch_runner = watch_runner
        self.keep_graphs = keep_graphs
        self.runner_attrs = tuple(runner_attrs) if runner_attrs is not None else None
        self.trace = gt.trace(strict=strict, modules=modules, provenance=provenance,
                              record="always")  # it steers provenance from vLLM's hooks
        self.llm = None
        self.worker = None
        self.model: nn.Module | None = None
        self.model_name: str | None = None
        self.graphs: list = []
        self.blind_spots: list[dict] = []
        self.reloads: list[dict] = []
        self._workers: list = []
        # the RunnerViews made here: a trace holds models weakly, so their maker keeps them
        self._runner_views: list[RunnerView] = []
        self._open = False
        self.pause_provenance = pause_provenance
        self.in_process = in_process
        self._env_set = False
        self.serve_guard = None
        self._said_unguarded = False
        if guard is not None:
            from graphtrace.vllm.serve import ServeGuard

            self.serve_guard = ServeGuard(self, guard, guard_dir)

    # -- lifecycle ---------------------------------------------------------------------------
    def __enter__(self) -> "VllmTrace":
        with clock.section("trace: enter"):
            return self._enter()

    def _enter(self) -> "VllmTrace":
        if self.in_process:
            _require_in_process()
            if MP_ENV not in os.environ:
                os.environ[MP_ENV] = "0"
                self._env_set = True
        self.trace.__enter__()
        self._open = True
        for event, fn in self._listeners():
            hooks.add_listener(event, fn)
        return self

    def __exit__(self, *exc) -> None:
        for event, fn in self._listeners():
            hooks.remove_listener(event, fn)
        if self.serve_guard is not None:
            self.serve_guard.close()
        self._open = False
        if self._env_set:
            os.environ.pop(MP_ENV, None)
            self._env_set = False
        self.trace.__exit__(*exc)

    def _listeners(self) -> list:
        out = [("after_load", self._on_load)]
        if self.serve_guard is not None:
            out.append(("before_update", self.serve_guard.before_update))
        else:
            out.append(("before_update", self._unguarded_update))
        if self.pause_provenance:
            out.append(("after_warmup", self._provenance_off))
            out += [("before_update", self._provenance_on),  # Note [weight updates] in hooks
                    ("after_update", self._provenance_off)]
        if self.serve_guard is not None:  # last: a raise there skips the listeners after it
            out.append(("after_update", self.serve_guard.after_update))
        return out

    def _unguarded_update(self, worker=None, method: str = "") -> None:
        """A weight update in a trace with no guard: said once (Note [one guard switch])."""
        if self._said_unguarded or active_trace() is not self.trace:
            return
        self._said_unguarded = True
        logger.warning(
            "graphtrace: a weight update (%s) ran in pid %d under a vLLM trace with no guard: "
            "nothing checks it before the engine serves from it (turn the guard on with "
            "trace_llm(guard='raise') or %s=guard; vt.diff() still reports). Said once per "
            "trace.", method or "?", os.getpid(), env.ENV_ON)

    def _provenance_off(self, worker=None, *args) -> None:
        if active_trace() is self.trace:
            self._steer_provenance(self.trace.pause_provenance)

    def _provenance_on(self, worker=None, *args) -> None:
        if active_trace() is self.trace:
            self._steer_provenance(self.trace.resume_provenance)

    def _steer_provenance(self, step) -> None:
        try:
            step()
        except GraphtraceError:  # another thread than the trace's: provenance stays as it is
            logger.debug("graphtrace: provenance not steered from thread %d",
                         threading.get_ident())

    def _on_load(self, worker) -> None:
        if active_trace() is not self.trace:
            return
        self.watch_worker(worker)
        model = hooks.worker_model(worker)  # a bare load_weights is an update too: lineage
        if model is not None:              # records it (provenance resumed), the guard checks it
            hooks.wrap_model_updates(model)
        if self.serve_guard is not None:
            self.serve_guard.watch_versions()  # Note [in-place writes]: the loaded weights

    # -- models ------------------------------------------------------------------------------
    def watch_worker(self, worker) -> "VllmTrace":
        """Watch a vLLM worker's model (vLLM FQNs) and its runner's input buffers."""
        if any(w is worker for w, _ in self._workers):
            return self
        model = hooks.worker_model(worker)
        if model is None:
            raise GraphtraceError("this vLLM worker has not loaded its model yet")
        n = len(self._workers)
        name = "" if n == 0 else f"engine{n}"
        self.trace.watch(model, name=name)
        if self.watch_runner:
            runner = getattr(worker, "model_runner", None)
            if runner is not None:
                view = RunnerView(runner, self.runner_attrs)
                self._runner_views.append(view)
                self.trace.watch(view, name="runner" if n == 0 else f"engine{n}.runner")
        self._workers.append((worker, name))
        if self.worker is None:
            self.worker, self.model, self.model_name = worker, model, name
        self._scan_blind_spots(model, name, getattr(worker, "vllm_config", None))
        return self

    def attach(self, llm) -> "VllmTrace":
        """Bind an in-process ``LLM``: its worker's model is watched (if not already)."""
        worker = find_worker(llm)  # refuses an engine built with multiprocessing on
        self.llm = llm
        self.watch_worker(worker)
        if self.worker is not worker:  # a second engine: make it current
            self.worker, self.model = worker, hooks.worker_model(worker)
        return self

    def _scan_blind_spots(self, model: nn.Module, name: str, vllm_config=None) -> None:
        with clock.section("vllm: blind-spot scan"):
            self._scan(model, name, vllm_config)

    def _scan(self, model: nn.Module, name: str, vllm_config) -> None:
        try:
            spots = blind.find_blind_spots(model, prefix=name)
            if vllm_config is not None:
                spots += blind.engine_blind_spots(vllm_config)
            for spot in spots:
                if spot not in self.blind_spots:
                    self.blind_spots.append(spot)
                    if spot["kind"] != "compiled":  # diff() says whether compiled code hid reads
                        self.trace.add_blind_spot(blind.record(spot))
                    if spot["kind"] == "packed_copy":  # Note [derived copies]
                        self.trace.watch_copy(spot["holder"].removeprefix(f"{name}:"),
                                              spot["path"].removeprefix(f"{name}:"), model=name)
        except Exception as exc:
            if self.strict:
                raise
            self.trace.record_error("vllm blind spot scan", exc)

    # -- captures ----------------------------------------------------------------------------
    def capture(self, label: str = "forward", *, forwards: int = 1, skip: int = 0) -> _ForwardCapture:
        """Record model forwards ``skip`` .. ``skip+forwards-1`` (0-based, counted from entry)
        inside the block as emulated graphs (e.g. ``with vt.capture("decode", skip=1):
        llm.generate(...)``: call 0 is the prefill, call 1 the first decode step)."""
        return _ForwardCapture(self, label, forwards, skip)

    def capture_dummy(self, label: str = "dummy_decode", num_tokens: int | None = None, *,
                      uniform_decode: bool = True):
        """Record one forward of vLLM's own dummy run (what ``capture_model`` runs under each
        CUDA graph on GPU) as an emulated graph; returns the EmulatedGraph."""
        if self.worker is None:
            raise GraphtraceError("no vLLM worker is watched yet")
        return capture_dummy_run(self, self.worker, label, num_tokens, uniform_decode)

    def recapture(self, captures: list) -> bool:
        """`graphtrace.serving.ServedEngine.recapture` for vLLM.

        vLLM 0.32 exposes no public way to re-capture its CUDA graphs (``capture_model`` and
        ``CUDAGraphWrapper.clear_all_graphs`` are runner internals, used at startup): on CUDA
        the problems stand. On CPU the emulated graphs of vLLM's dummy run
        (``GRAPHTRACE_VLLM_EMULATE``, ``graphtrace_capture_dummy``, ``vt.capture_dummy``) are
        dropped and recorded again; graphs of armed forwards are dropped (they need a new
        request to record).
        """
        if any(c.kind == "cuda" for c in captures):
            logger.error("graphtrace: recapture: vLLM 0.32 has no public API to re-capture "
                         "CUDA graphs; the problems stand")
            return False
        self.trace.models_changed()  # the updated model's
        dummy = [c.label for c in captures if c.info.get("dummy_run")]
        self.graphs.clear()  # the emulated graphs: the old storages die with them
        for label in dict.fromkeys(dummy):
            capture_dummy_run(self, self.worker, label, None, True)
        return True

    # -- engine helpers ----------------------------------------------------------------------
    def generate(self, prompts: list[list[int]] | None = None, max_tokens: int = 4) -> list[list[int]]:
        """Greedy generation from token-id prompts; returns the new token ids per prompt."""
        from vllm import SamplingParams

        if self.llm is None:
            raise GraphtraceError("call vt.attach(llm) first")
        if prompts is None:
            from graphtrace.vllm.tiny import PROMPTS
            prompts = PROMPTS
        sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, detokenize=False,
                            ignore_eos=True)
        outs = self.llm.generate([{"prompt_token_ids": list(p)} for p in prompts], sp,
                                 use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]

    def reload(self, weights: Iterable[tuple[str, torch.Tensor]] | None = None, *,
               weights_path: str | None = None, is_checkpoint_format: bool = True):
        """vLLM's own reload: ``collective_rpc("reload_weights", kwargs=...)``. ``weights``:
        ``(name, tensor)`` pairs in checkpoint format (None: reload from disk)."""
        kwargs: dict[str, Any] = {"is_checkpoint_format": is_checkpoint_format}
        if weights is not None:
            kwargs["weights_iterator"] = list(weights)
        if weights_path is not None:
            kwargs["weights_path"] = weights_path
        if self.llm is None and self.worker is None:
            raise GraphtraceError("nothing to reload: attach an LLM or watch a worker first")
        self.reloads.append({"weights": "given" if weights is not None else "disk",
                             "weights_path": weights_path or ""})
        paused = self.pause_provenance and not self.trace.provenance_recording
        if paused:  # a weight update: where the new tensors are made is worth recording
            self._provenance_on()
        try:
            if self.llm is not None:
                return self.llm.collective_rpc("reload_weights", kwargs=kwargs)
            return self.worker.reload_weights(**kwargs)
        finally:
            if paused:
                self._provenance_off()

    # -- results -----------------------------------------------------------------------------
    def info(self) -> dict:
        """Plain JSON facts about the engine (goes into ``report.meta['vllm']``)."""
        out: dict[str, Any] = {"blind_spots": [dict(s) for s in self.blind_spots],
                               "reloads": list(self.reloads),
                               "emulated_graphs": [g.label for g in self.graphs]}
        try:
            import vllm

            out["vllm_version"] = getattr(vllm, "__version__", "")
        except Exception:
            pass
        w = self.worker
        if w is not None:
            out["rank"] = hooks.worker_rank(w)
            out["worker"] = type(w).__name__
            out["model_runner"] = type(getattr(w, "model_runner", None)).__name__
            out["model_class"] = type(self.model).__name__ if self.model is not None else ""
            cfg = getattr(w, "vllm_config", None)
            mc = getattr(cfg, "model_config", None)
            if mc is not None:
                out["model"] = str(getattr(mc, "model", ""))
                out["dtype"] = str(getattr(mc, "dtype", "")).replace("torch.", "")
                out["quantization"] = str(getattr(mc, "quantization", "") or "")
                out["enforce_eager"] = bool(getattr(mc, "enforce_eager", False))
            cc = getattr(cfg, "compilation_config", None)
            if cc is not None:
                mode, cg = getattr(cc, "mode", ""), getattr(cc, "cudagraph_mode", "")
                out["compilation_mode"] = getattr(mode, "name", str(mode))
                out["cudagraph_mode"] = getattr(cg, "name", str(cg))
            out["pid"] = os.getpid()
        return out

    def diff(self):
        """``graphtrace`` diff of everything captured against the live vLLM model(s)."""
        for worker, name in self._workers:  # layers rebuilt by a reload can add blind spots
            self._scan_blind_spots(hooks.worker_model(worker), name)
        if not self.trace.saw_compiled:  # the core records compiled regions; none seen
            for spot in self.blind_spots:
                if spot["kind"] == "compiled":
                    self.trace.add_blind_spot(blind.record(spot))
        report = self.trace.diff()
        report.meta["vllm"] = _plain(self.info())
        return report

    def check(self, trigger: str = "check") -> dict:
        """The explicit end of a weight update (``guard=`` on): `ServingCore.check`."""
        if self.serve_guard is None:
            raise GraphtraceError("this VllmTrace has no guard: trace_llm(guard='raise')")
        return self.serve_guard.check(trigger)

    def guard(self):
        """A `graphtrace.Guard` of the graphs captured so far (docs/guard.md): check it after
        each weight update with ``guard.check()`` / ``guard.enforce()``."""
        return self.trace.guard()

    def __repr__(self) -> str:
        return f"<graphtrace.vllm.VllmTrace {self.trace!r}, {len(self.graphs)} emulated graphs>"


def capture_dummy_run(vt: VllmTrace, worker, label: str, num_tokens: int | None,
                      uniform_decode: bool):
    runner = worker.model_runner
    if num_tokens is None:
        sched = getattr(worker.vllm_config, "scheduler_config", None)
        num_tokens = int(getattr(sched, "max_num_seqs", 4) or 4)
    cap = _ForwardCapture(vt, label, forwards=1, skip=0)
    from vllm.config import set_current_vllm_config

    with cap, set_current_vllm_config(worker.vllm_config):
        runner._dummy_run(num_tokens, uniform_decode=uniform_decode)
    if not cap.graphs:
        raise GraphtraceError("the dummy run did not call the model's forward")
    # what a re-capture can record again by itself (plugin, GRAPHTRACE_GUARD=recapture)
    cap.graphs[0].capture.info.update(dummy_run=True, num_tokens=num_tokens)
    return cap.graphs[0]


def _plain(obj):
    import json

    return json.loads(json.dumps(obj, default=str))


# Note [one guard switch]
# ~~~~~~~~~~~~~~~~~~~~~~~
# The plugin turns its guard on from the environment (GRAPHTRACE_VLLM=guard, the action from
# GRAPHTRACE_GUARD); a user who set that environment and wrapped an in-process engine in
# `trace_llm()` (for its report) must get the same guard, not silently none: in one process
# the plugin leaves the worker to the open trace. So `trace_llm()` reads the same variables
# when `guard=` is not given: guard mode gives it the plugin's guard (the action read at each
# check, as the plugin does; checks written under $GRAPHTRACE_VLLM_DIR/guard/rank<R> unless
# `guard_dir=` is given). Explicit arguments win where the environment says nothing about
# them; where both speak and disagree -- `guard=None` (or False) under GRAPHTRACE_VLLM=guard,
# an action other than a GRAPHTRACE_GUARD that is set -- `trace_llm` raises GraphtraceError
# naming both, before anything is opened. A `VllmTrace` with no guard logs one warning at the
# first weight update it sees, so an unguarded engine is never silent about it.

_GUARD_UNSET = object()


def _env_guard(guard, guard_dir):
    """(guard, guard_dir, from the environment?) for `trace_llm` (Note [one guard switch])."""
    action = env.guard_setting()
    on = env.guard_mode()
    if guard is _GUARD_UNSET:
        return (env.guard_action, guard_dir, True) if on else (None, guard_dir, False)
    if (guard is None or guard is False) and on:
        raise GraphtraceError(
            f"trace_llm(guard={guard!r}) turns the guard off, but the environment turns it on "
            f"({env.ENV_ON}=guard): unset {env.ENV_ON} (or set it to 1) for a trace with no guard, "
            "or leave guard= out to use the environment's guard")
    if isinstance(guard, str) and action in env.GUARD_ACTIONS and guard != action:
        raise GraphtraceError(
            f"trace_llm(guard={guard!r}) contradicts {env.ENV_GUARD}={action} in the environment: "
            f"pass guard={action!r}, leave guard= out, or change {env.ENV_GUARD}")
    return (None if guard is False else guard), guard_dir, False


def trace_llm(*, guard=_GUARD_UNSET, guard_dir=None, **kwargs) -> VllmTrace:
    """``with trace_llm() as vt: llm = LLM(...)``: see :class:`VllmTrace` (its keyword
    arguments); ``guard=`` left out or contradicting the environment: Note [one guard switch]."""
    guard, guard_dir, from_env = _env_guard(guard, guard_dir)
    if not from_env or guard_dir is not None:
        return VllmTrace(guard=guard, guard_dir=guard_dir, **kwargs)
    import weakref

    made: list = []  # the trace, weakly: its guard's folder names its worker's rank

    def folder():
        vt = made[0]() if made else None
        return env.guard_folder(vt.worker if vt is not None else None)

    vt = VllmTrace(guard=guard, guard_dir=folder, **kwargs)
    made.append(weakref.ref(vt))
    return vt
