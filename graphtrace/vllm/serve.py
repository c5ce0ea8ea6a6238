"""Check before serve: the guard's unit is the weight update, not the call.

One implementation for the worker plugin (``GRAPHTRACE_VLLM=guard``) and the in-process
``graphtrace.vllm.trace_llm(guard="raise")``: a :class:`ServeGuard` belongs to one
`VllmTrace`; the weight-update hooks of graphtrace.vllm.hooks mark it dirty; it is checked
once when the update is complete (Note [check before serve]).

Note [check before serve]
~~~~~~~~~~~~~~~~~~~~~~~~~
RL clients push weights through many doors (Note [weight updates] in graphtrace.vllm.hooks):
``reload_weights``; a transfer session (``start_weight_update`` .. ``finish_weight_update``);
the worker model's ``load_weights`` once per tensor (TRL colocate; OpenRLHF's
``collective_rpc("update_weight")``) or per bucket and then vLLM's
``process_weights_after_loading`` once (verl). A check after each call would run inside the
client's receive loop (a thousand checks per sync) and a raise there would leave the model
half-updated (and, in verl, be hidden as the ``__context__`` of its cleanup's error); the
rebinding that makes a graph stale may come last (verl's ``process_weights_after_loading``).
So every such entry point only marks the engine *dirty* (the guard is built from the
capture-time owners first, if graphs were captured since) and the check runs once:

1. at the end of an entry point that is a whole update by itself (``reload_weights``,
   ``finish_weight_update``): its caller gets `StaleGraphError` from that call;
2. at an explicit end of update: ``collective_rpc("graphtrace_check")`` (plugin) or
   ``vt.check()`` (in process);
3. otherwise before the next forward: vLLM 0.32's ``EngineCore.step`` (and
   ``step_with_batch_queue``) is wrapped; when unfinished requests wait and an update is
   pending, the check runs before ``scheduler.schedule()`` (batches still in flight under async
   scheduling are drained first, scheduling nothing new: `drain_step`). A step with only
   finished requests to hand to the workers (``has_requests()`` but no unfinished one: the
   step after a refusal) schedules no token and runs no forward; it is not checked, else the
   engine core's busy loop, which steps while ``has_requests()``, would check again and
   again while the refusal stands (it did: a check every ~20 ms, each a line of
   ``checks.jsonl`` and a CSV). A raise from the worker's ``execute_model``
   comes after the scheduler has scheduled the step's requests; they never get their
   ``update_from_output``, and the next ``generate`` spins forever (the issue's finding).
   Before scheduling, the step can be refused cleanly: every unfinished request is finished
   with ``RequestStatus.FINISHED_ERROR`` (``finish_reason="error"``; vLLM's own path for a
   request-level failure) and the step returns their outputs, so the client's request state
   is closed and the engine keeps serving. In one process (``LLM`` with
   ``VLLM_ENABLE_V1_MULTIPROCESSING=0``: RL colocate mode, ``trace_llm``) the client's
   ``LLMEngine.step`` then raises the `StaleGraphError` itself, after those outputs were
   processed: ``llm.generate`` raises it, unwrapped. With the engine core in its own process
   the worker's state is not visible to it: the engine core marks an update pending after
   every ``collective_rpc`` it forwards (the only way a client reaches a worker there) and
   asks the workers (``graphtrace_check``, a no-op where clean) before the next step; the
   refused requests finish with ``finish_reason="error"`` and the engine core logs why.
4. The client in another process: the plugin is loaded there too. Its wrapped
   ``LLMEngine.step``, when a step's outputs finish a request with an error, asks the workers
   through the normal RPC path (``collective_rpc("graphtrace_refusal")``, read-only: it marks
   nothing) for the standing refusal; once the client has no unfinished request left (the
   engine core refuses every step until a correct update, so the rest follow), ``llm.generate``
   raises that `StaleGraphError`, with the problems (holder paths) as a DataFrame, as in one
   process. An error that is not graphtrace's (no refusal stands) is left to vLLM.
5. ``AsyncLLM`` (``vllm serve``, async RL rollouts; its engine core is always in another
   process). Its ``generate`` yields each request's outputs from a queue that its output
   handler fills; an exception put there reaches the caller wrapped as
   ``EngineGenerateError`` (``generate`` re-raises only vLLM's client errors, dead-engine and
   input-stream errors as they are: vllm/v1/engine/async_llm.py:787-820), and nothing async
   can be awaited in the output handler's synchronous ``process_outputs``. So the hook is
   ``AsyncLLM.generate`` itself (`client_stream`, plugin processes only): the stream is
   passed through until a request's final output is finished with ``finish_reason="error"``;
   then it asks the workers as in 4. (``await engine.collective_rpc("graphtrace_refusal")``,
   one query shared by the requests of a refused step) and, where a refusal stands, raises
   it in place of that output, after vLLM's own stream has ended normally (its request
   state is closed, nothing to abort). ``async for out in engine.generate(...)`` raises the
   `StaleGraphError` itself, ``.problems`` with the holder; the other requests of the step
   get the same; the engine is not dead (``errored`` stays False) and serves again after a
   correct update. Behind ``vllm serve`` (the plugin is loaded in the API server process
   too) the exception cannot cross HTTP: the OpenAI server answers it as any non-vLLM
   exception, HTTP 500 ``InternalServerError`` with ``str(exc)`` as the message
   (vllm/entrypoints/serve/exception_handling/error_response.py), or, streamed, one ``data:
   {"error": ...}`` event; the message starts with ``StaleGraphError:`` (`REFUSED`) and
   names the holder (without the plugin in the client, vLLM's own answer to
   ``finish_reason="error"``: HTTP 500 "Internal server error"). A pooling model's
   ``AsyncLLM.encode`` is wrapped the same way; a refused pooling request ends with an empty
   pooling output, the marker `_errored` reads (`_refuse` gives it one, as vLLM's abort does:
   without it vLLM's output processor asserts the request has a detokenizer, and the
   AsyncLLM's output handler dies with the engine).

Note [in-place writes]
~~~~~~~~~~~~~~~~~~~~~~
A client may write the weights in place without any of the hooked entry points (its own
function, a direct ``p.copy_(new)`` on the worker's model). Each in-place op bumps the
tensor's version counter (autograd's; writes through ``p.data`` do not: ``.data`` has a
counter of its own). So before every step, a ServeGuard that is not dirty compares the sum of
its watched parameters' version counters (every parameter of the trace's models, held weakly;
a freed one counts as a change) with the sum taken when the model was loaded or after its
last check (or, for a guard made later, at its first step): a difference marks
the engine dirty ("in-place write") and the check runs before that step. The sum is taken
again after each check, so a hooked update that also bumps counters is checked once. The
parameters are walked (``model.parameters()``: milliseconds on an 80-layer model) when the
model is loaded and again only when a watched one was freed (an update that rebinds them,
as vLLM's reload does); a parameter rebound while the old one stays alive elsewhere is not
watched until then (its owners moving is the guard's own check). The sum
is taken in C++ (``versions_sum`` of graphtrace/csrc/recorder.cpp) when the trace records
natively, in Python otherwise. The test runs where the guard's worker is: in the engine core's
pre-step test when the worker shares its process (one process; the default single-worker
executor with the engine core in its own process); workers in processes of their own
(tensor parallelism) rely on a ``collective_rpc`` marking the update pending.
An in-place write is not itself stale (the graph reads the same storage); what it catches is
the rebinding that a client's own weight processing may do along with it.

The dirty flag is cleared only by a passing check (``raise``), or once the problems were
logged (``warn``) or re-captured away (``recapture``). So a refused engine refuses every
forward until a correct update (or a re-capture) passes. An internal error of the guard
is logged and counted and the engine serves (fail open), unless ``GRAPHTRACE_STRICT=1``.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
import weakref
from pathlib import Path
from typing import Callable

logger = logging.getLogger("graphtrace.vllm")

__all__ = ["ServeGuard", "ACTIONS", "GUARD_ACCEPT", "COMPLETE_UPDATES", "local_guards",
           "before_step", "drain_step", "DRAIN", "after_client_step", "client_step_failed",
           "client_stream", "mark_remote_update", "REFUSED"]

ACTIONS = ("raise", "warn", "recapture")
# Blind-spot kinds the engine's guard accepts (Note [blind spots in the guard], graphtrace/guard.py):
# "forward context": attention ops fetch the KV cache by layer name inside the op; a weight
# update never touches the KV cache, and no holder can be checked, so it would fail every
# update. "opaque handle" and "packed copy": vLLM's CPU linears read oneDNN handles (a pointer
# in a 0-d tensor) to a packed copy of the weight; the handle's identity is guarded like any
# tensor (a rebuilt handle is a stale edge of the graph that read the old one), only the packed
# weights behind it are unseen, and process_weights_after_loading rebuilds every handle (the
# holder moves on each such update). docs/vllm.md.
GUARD_ACCEPT = ("forward context", "opaque handle", "packed copy")
# Entry points that are a whole update by themselves: checked when they return.
COMPLETE_UPDATES = frozenset({"reload_weights", "finish_weight_update"})

_guards: "weakref.WeakSet[ServeGuard]" = weakref.WeakSet()
_lock = threading.RLock()


def local_guards() -> list["ServeGuard"]:
    """The ServeGuards of this process (one per guarded VllmTrace)."""
    return list(_guards)


class ServeGuard:
    """The update state of one guarded `VllmTrace` (Note [check before serve]).

    ``action``: ``raise``, ``warn`` or ``recapture``, or a callable returning one (the plugin
    reads ``GRAPHTRACE_GUARD`` at each check). ``folder``: where ``guard.json``,
    ``checks.jsonl`` and ``problems-<N>.csv`` go (a callable; None: nothing written, the
    entries are kept in ``history``).
    """

    def __init__(self, vt, action: str | Callable[[], str] = "raise",
                 folder: Callable[[], Path | None] | None = None):
        if isinstance(action, str) and action not in ACTIONS:
            raise ValueError(f"guard action {action!r} is not one of {', '.join(ACTIONS)}")
        self._vt = weakref.ref(vt)
        self._action = action
        self._folder = folder
        self.guard = None
        self.n_graphs = 0       # captures the guard covers
        self.first_graph = 0    # graphs captured before a recapture are gone
        self.checks = 0
        self.errors = 0
        self.dirty = False
        self.updates: list[str] = []  # the entry points that mutated weights since the last pass
        self.last: dict | None = None
        self.history: list[dict] = []
        self.refusal = None     # the StaleGraphError of the last check, while it stands
        # Note [in-place writes]: the watched parameters (weakly) and their version counters' sum
        self._watched: list | None = None
        self._versions = 0
        self._sum = None  # the native versions_sum, when the trace records natively
        with _lock:
            _guards.add(self)

    # -- state -----------------------------------------------------------------------------
    @property
    def vt(self):
        return self._vt()

    def action(self) -> str:
        value = self._action() if callable(self._action) else self._action
        return value if value in ACTIONS else "raise"

    def close(self) -> None:
        """Its trace ended: the engine's steps no longer consult it."""
        with _lock:
            _guards.discard(self)

    def folder(self) -> Path | None:
        return self._folder() if self._folder is not None else None

    def refresh(self):
        """The guard of the graphs captured so far (rebuilt when graphs were captured since)."""
        vt = self.vt
        captures = vt.trace.captures
        if self.guard is None or len(captures) != self.n_graphs:
            if len(captures) <= self.first_graph:
                self.guard = None
            else:
                self.guard = vt.trace.guard(first_graph=self.first_graph, accept=GUARD_ACCEPT)
                folder = self.folder()
                if folder is not None:
                    folder.mkdir(parents=True, exist_ok=True)
                    self.guard.to_json(folder / "guard.json")
            self.n_graphs = len(captures)
        return self.guard

    def mark(self, method: str) -> None:
        """A weight update starts (or goes on): the engine is dirty until a check passes. The
        guard is built now, from the capture-time owners, before the update moves them."""
        if self.dirty:  # the common case, once per call of a per-tensor sync: no lock
            updates = self.updates
            if not updates or updates[-1] != method:
                updates.append(method)
            return
        if self.vt is None:  # the trace is gone
            return
        with _lock:
            if not self.dirty:
                try:
                    if self.refresh() is None:
                        return  # no graph captured yet: nothing can read a stale storage
                except Exception:
                    self._failed("building the guard before " + method)
            self.dirty = True
            if not self.updates or self.updates[-1] != method:
                self.updates.append(method)

    # -- the check ---------------------------------------------------------------------------
    def check(self, trigger: str, *, force: bool = False) -> dict:
        """Check once if dirty (or ``force``): returns the check's entry ({"ok": True,
        "checked": False} when clean); raises `StaleGraphError` under ``raise`` (in the last
        rank, for all ranks: Note [one rank raises] in graphtrace.vllm.plugin)."""
        from graphtrace.guard import StaleGraphError, describe, empty_problems

        vt = self.vt
        several = _world_group() is not None
        if several:  # the ranks agree (every rank takes part): every rank checks, or none
            if not (_any_rank(self.dirty) or force) or vt is None:
                return {"ok": True, "checked": False}
        elif vt is None or not (self.dirty or force):
            return {"ok": True, "checked": False}
        action = self.action()
        problems, failure = empty_problems(), None
        with _lock:
            try:
                guard = self.refresh()
                if guard is not None:
                    problems = guard.check()
            except Exception:
                failure = sys.exc_info()
                self._failed("checking the guard (" + trigger + ")")
            if action == "recapture" and (_any_rank(len(problems) > 0) if several else len(problems)):
                try:  # a dummy run is collective under tensor parallelism: all ranks re-capture
                    problems = self._recapture(problems)
                except Exception:
                    failure = failure or sys.exc_info()
                    self._failed("re-capturing (" + trigger + ")")
            entry = self._record(trigger, problems, action)
            try:  # graphs captured from now on: their owners from a fresh walk
                vt.trace.models_changed()
            except Exception:
                self._failed("refreshing owners (" + trigger + ")")
            ranks = _gather_problems(problems, self.rank()) if several else None
            bad = any(len(f) for _, f in ranks) if several else bool(len(problems))
            what = self._what(trigger)
            if action != "raise" or not bad:  # all ranks agree: they stay dirty together
                self.dirty = False
                self.updates = []
        self._rebase_versions()  # writes from now on are the next update's
        self.refusal = None
        try:
            if action == "warn":
                if len(problems):
                    logger.warning("graphtrace guard (rank %s, %s): %s", self.rank(), what,
                                   describe(problems))
            elif not several:
                if len(problems):
                    raise StaleGraphError(f"graphtrace guard (rank {self.rank()}, {what}): "
                                          f"{describe(problems)}", problems)
            else:
                _raise_for_all_ranks(ranks, problems, what, self.rank())
        except StaleGraphError as exc:
            self.refusal = exc  # what a client in another process asks for (refusal_info)
            raise
        if failure is not None and _strict():
            raise failure[1].with_traceback(failure[2])
        return entry

    # -- in-place writes (Note [in-place writes]) ---------------------------------------------
    def watch_versions(self) -> None:
        """Take the watched parameters (those of the trace's models, weakly) and the sum of
        their version counters: the baseline `written_in_place` compares with."""
        try:
            vt = self.vt
            watched, total, seen = [], 0, set()
            for model in (vt.trace.models.values() if vt is not None else ()):
                for p in model.parameters():
                    if id(p) in seen:
                        continue
                    seen.add(id(p))
                    try:
                        version = p._version  # inference tensors have no version counter
                    except RuntimeError:
                        continue
                    watched.append(weakref.ref(p))
                    total += version
            self._watched, self._versions = watched, total
            native = getattr(vt.trace, "native", None) if vt is not None else None
            self._sum = getattr(native, "versions_sum", None)
        except Exception:
            self._watched = []
            self._failed("taking the parameters' version counters")

    def written_in_place(self) -> bool:
        """Was a watched parameter written in place (its version counter moved) or freed
        since `watch_versions`? Then the engine is marked dirty (once per such write)."""
        watched = self._watched
        if watched is None:  # the first step: the baseline
            self.watch_versions()
            return False
        if self._total(watched) == self._versions:
            return False
        self.mark("in-place write")
        self._rebase_versions()  # one mark per write, even while no graph is captured
        return True

    def _total(self, watched: list) -> int:
        """The sum of the watched parameters' version counters; -1 when one was freed."""
        total = self._sum(watched) if self._sum is not None else None
        if total is None:
            total = 0
            for ref in watched:
                p = ref()
                if p is None:
                    return -1
                total += p._version
        return total

    def _rebase_versions(self) -> None:
        """A new baseline: the sum again over the same parameters (microseconds), or a walk of
        the models' parameters (milliseconds on a big model) when one of them was freed."""
        watched = self._watched
        total = self._total(watched) if watched else -1
        if total < 0:
            self.watch_versions()
        else:
            self._versions = total

    def refusal_info(self) -> dict | None:
        """The standing refusal as plain data (it crosses vLLM's msgpack RPC): message,
        problems' rows and columns; None when the last check refused nothing."""
        exc = self.refusal
        if exc is None or not self.dirty:
            return None
        import json

        problems = exc.problems
        return {"message": str(exc), "columns": list(problems.columns),
                "rows": json.loads(problems.to_json(orient="values", default_handler=str))}

    def _what(self, trigger: str) -> str:
        updates = ", ".join(self.updates) or "no update"
        return f"{trigger} after {updates}" if trigger not in self.updates else f"after {updates}"

    def rank(self) -> int:
        from graphtrace.vllm import hooks

        vt = self.vt
        worker = vt.worker if vt is not None else None
        return hooks.worker_rank(worker) if worker is not None else 0

    def _failed(self, where: str) -> None:
        self.errors += 1
        logger.exception("graphtrace: guard error %s (fail open)", where)

    def _record(self, trigger: str, problems, action: str) -> dict:
        """One entry per check: in ``history``, and a line of ``checks.jsonl`` (with the
        problems in ``problems-<N>.csv``) when the guard has a folder."""
        import json

        self.checks += 1
        n = int(len(problems))
        entry = {"check": self.checks, "pid": os.getpid(), "rank": self.rank(),
                 "trigger": trigger, "updates": list(self.updates), "action": action,
                 "ok": not n, "checked": True, "n_problems": n,
                 "verdicts": sorted(set(problems["verdict"])) if n else [],
                 "owners": sorted(set(problems["owners"])) if n else [],
                 "graphs": len(self.guard.graphs) if self.guard is not None else 0,
                 "storages": len(self.guard) if self.guard is not None else 0,
                 "time": time.time()}
        folder = self.folder()
        if folder is not None and self.guard is not None:
            try:
                folder.mkdir(parents=True, exist_ok=True)
                if n:
                    problems.to_csv(folder / f"problems-{self.checks}.csv", index=False)
                    entry["problems_csv"] = f"problems-{self.checks}.csv"
                with open(folder / "checks.jsonl", "a") as f:
                    f.write(json.dumps(entry) + "\n")
            except Exception:
                self._failed("writing the guard check (" + trigger + ")")
        self.last = entry
        self.history.append(entry)
        del self.history[:-100]
        return entry

    def _recapture(self, problems):
        """``recapture``: capture the graphs again on the updated model, then check.

        vLLM 0.32 exposes no public way to re-capture its CUDA graphs (``capture_model`` and
        ``CUDAGraphWrapper.clear_all_graphs`` are runner internals, used at startup): on CUDA
        the problems stand. On CPU the emulated graphs of vLLM's dummy run
        (``GRAPHTRACE_VLLM_EMULATE``, ``graphtrace_capture_dummy``, ``vt.capture_dummy``) are
        dropped and recorded again; graphs of armed forwards are dropped (they need a new
        request to record). The guard then covers the new graphs only.
        """
        from graphtrace.vllm.adapter import capture_dummy_run

        vt = self.vt
        captures = vt.trace.captures
        if any(c.kind == "cuda" for c in captures[self.first_graph:]):
            logger.error("graphtrace: recapture: vLLM 0.32 has no public API to re-capture "
                         "CUDA graphs; the problems stand")
            return problems
        vt.trace.models_changed()  # the updated model's
        dummy = [c.label for c in captures[self.first_graph:] if c.info.get("dummy_run")]
        vt.graphs.clear()  # the emulated graphs: the old storages die with them
        self.first_graph = len(captures)
        for label in dict.fromkeys(dummy):
            capture_dummy_run(vt, vt.worker, label, None, True)
        self.guard = None
        guard = self.refresh()
        if guard is None:
            logger.warning("graphtrace: recapture: no graph could be re-recorded; nothing to guard")
            return problems.iloc[0:0]
        logger.info("graphtrace: recaptured %d graph(s) after a weight update", len(guard.graphs))
        return guard.check()

    def status(self) -> dict:
        return {"pid": os.getpid(), "action": self.action(), "dirty": self.dirty,
                "updates": list(self.updates), "checks": self.checks, "errors": self.errors,
                "storages": len(self.guard) if self.guard is not None else 0,
                "watched": len(self._watched or ()), "last": self.last, "folder": str(self.folder() or "")}

    # -- hook listeners (graphtrace.vllm.hooks events) ---------------------------------------
    def before_update(self, obj, method: str) -> None:
        self.mark(method)

    def after_update(self, obj, method: str) -> None:
        if method in COMPLETE_UPDATES:
            self.check(method)


# -- the engine core (Note [check before serve], 3.) -------------------------------------------

_remote = {"on": False}  # the plugin's guard mode in a process without workers (engine core)
# collective_rpc methods that change no weights (graphtrace's own queries)
_READ_ONLY = frozenset({"graphtrace_check", "graphtrace_status", "graphtrace_guard_status",
                        "graphtrace_refusal",
                        "graphtrace_write_report", "graphtrace_capture",
                        "graphtrace_capture_dummy"})


def enable_remote() -> None:
    """This process forwards collective_rpc to guarded workers in other processes."""
    _remote["on"] = True


def mark_remote_update(core, method) -> None:
    """``EngineCore.collective_rpc`` ran ``method``: a worker may have changed weights."""
    if _remote["on"] and not (isinstance(method, str) and method in _READ_ONLY):
        core.__dict__["_graphtrace_pending"] = True


def before_step(core):
    """Before ``EngineCore.step`` schedules anything: None to go on, or the step's result
    (outputs finishing every unfinished request with an error) to refuse it."""
    local = [g for g in _guards if g.dirty or _written(g)] if _guards else ()
    pending = core.__dict__.get("_graphtrace_pending", False)
    if not local and not pending:
        return None
    try:
        if getattr(core, "batch_queue", None):
            return DRAIN  # batches in flight (async scheduling): finish them, schedule none
        if not core.scheduler.has_unfinished_requests():
            return None  # nothing to schedule, no forward: finished requests are flushed
    except Exception:
        logger.exception("graphtrace: before_step (ignored)")
        return None
    from graphtrace.guard import StaleGraphError

    try:
        for guard in local:
            guard.check("before_forward")
        if pending:
            core.model_executor.collective_rpc("graphtrace_check",
                                               kwargs={"trigger": "before_forward"})
            core.__dict__["_graphtrace_pending"] = False
        return None
    except StaleGraphError as exc:
        refused = exc
    except Exception as exc:  # from workers in other processes: the executor's own wrapper
        if "StaleGraphError" not in f"{type(exc).__name__}: {exc}" and "graphtrace guard" not in str(exc):
            if _strict():
                raise
            logger.exception("graphtrace: checking the workers before a step failed (fail open)")
            core.__dict__["_graphtrace_pending"] = False
            return None
        refused = exc
    logger.error("graphtrace: refusing to serve until a correct weight update: %s", refused)
    outputs = _refuse(core, refused)
    core.__dict__["_graphtrace_refused"] = refused
    return outputs, False


def _written(guard: ServeGuard) -> bool:
    try:
        return guard.written_in_place()
    except Exception:
        if _strict():
            raise
        guard._failed("comparing version counters")
        return False


DRAIN = object()  # before_step's answer while batches are in flight


def drain_step(core, step):
    """One ``step_with_batch_queue`` that schedules nothing: it waits for the oldest batch in
    flight and processes its output, so that the check can run before the next schedule (a
    refusal cannot finish requests whose batch is still running). Untested: vLLM 0.32's CPU
    platform turns async scheduling off, so its engine core never has a batch queue here."""
    scheduler = core.scheduler
    scheduler.has_requests = lambda: False  # an instance attribute shadows the method
    try:
        return step(core)
    finally:
        scheduler.__dict__.pop("has_requests", None)


def refusal_error(refused: BaseException) -> dict:
    """The keyword that carries a refusal in vLLM's own error path, where the release has
    one (``Release.error_path``, graphtrace/vllm/releases.py): from 0.33 an
    ``EngineCoreOutput.error`` (``RequestError``) reaches an ``AsyncLLM`` caller as
    ``GenerationError(message)``, across processes and HTTP, with no client-side wrapper; a
    synchronous ``LLM`` ignores it and sees ``finish_reason="error"`` as on 0.32. Empty on
    0.32 (and on a release outside the table: the 0.32 path)."""
    from graphtrace.vllm import releases

    try:
        rel = releases.release()
    except LookupError:
        return {}
    if rel.error_path != "EngineCoreOutput.error":
        return {}
    from vllm.outputs import RequestError

    return {"error": RequestError(code="graphtrace_stale_graph",
                                  message=f"{type(refused).__name__}: {refused}")}


def _refuse(core, refused: BaseException) -> dict:
    """Finish every unfinished request with FINISHED_ERROR; the step's outputs for them
    (carrying the refusal's text in vLLM's error field where there is one)."""
    from collections import defaultdict

    import torch
    from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs, FinishReason
    from vllm.v1.request import RequestStatus

    error = refusal_error(refused)
    finished = core.scheduler.finish_requests(None, RequestStatus.FINISHED_ERROR) or []
    by_client: dict[int, list] = defaultdict(list)
    for request in finished:
        # a pooling request's error output carries an empty pooling output, as vLLM's own
        # abort does (v1/engine/output_processor.py, abort_requests): with none the client's
        # output processor asserts it has a detokenizer, which pooling requests lack
        pooled = torch.empty(0) if getattr(request, "pooling_params", None) is not None else None
        by_client[getattr(request, "client_index", 0)].append(EngineCoreOutput(
            request.request_id, [], finish_reason=FinishReason.ERROR, pooling_output=pooled,
            **error))
    return {client: EngineCoreOutputs(finished_requests={o.request_id for o in outs},
                                      outputs=outs)
            for client, outs in by_client.items()}


def after_client_step(llm_engine, outputs) -> None:
    """The client's ``LLMEngine.step``, after it processed the step's ``outputs``: raise the
    refusal of the step (Note [check before serve], 4.). In process, the engine core's; with
    the engine core in another process, the workers' (asked when a step finished requests
    with an error), raised once the client has no unfinished request left."""
    client = getattr(llm_engine, "engine_core", None)
    core = getattr(client, "engine_core", None)
    if core is not None and hasattr(core, "__dict__"):  # the engine core in this process
        refused = core.__dict__.pop("_graphtrace_refused", None)
        if refused is not None:
            raise refused
        return
    if not _remote["on"]:
        return
    state = llm_engine.__dict__
    if "_graphtrace_refused" not in state:
        if not any(map(_errored, outputs or ())):
            return
        refused = _ask_refusal(llm_engine)
        if refused is None:
            return
        state["_graphtrace_refused"] = refused
    if not llm_engine.has_unfinished_requests():  # every request closed: the engine is clean
        raise state.pop("_graphtrace_refused")


def client_step_failed(llm_engine) -> None:
    """The client's ``LLMEngine.step`` raised before `after_client_step`: drop the engine
    core's refusal of that step (in process), else the client's next, unrelated call would
    raise it (a refusal that still stands is raised again by the next refused step)."""
    client = getattr(llm_engine, "engine_core", None)
    core = getattr(client, "engine_core", None)
    if core is not None and hasattr(core, "__dict__"):
        core.__dict__.pop("_graphtrace_refused", None)


def _errored(output) -> bool:
    """A request's final output says it failed: a completion with ``finish_reason="error"``,
    or a pooling output whose data is empty (how `_refuse` and vLLM's abort end a pooling
    request; a pooling model's real output is never empty)."""
    if not getattr(output, "finished", False):
        return False
    completions = getattr(output, "outputs", None)
    if isinstance(completions, list):
        return any(getattr(c, "finish_reason", None) == "error" for c in completions)
    data = getattr(completions, "data", None)  # PoolingOutput
    return data is not None and hasattr(data, "numel") and data.numel() == 0


def _ask_refusal(llm_engine):
    """The workers' standing refusal (``collective_rpc("graphtrace_refusal")``, the normal
    RPC path) as one `StaleGraphError`, or None (the error was not graphtrace's)."""
    try:
        answers = llm_engine.collective_rpc("graphtrace_refusal")
    except Exception:
        if _strict():
            raise
        logger.exception("graphtrace: asking the workers why a step failed (ignored)")
        return None
    return _refusal(answers)


def _refusal(answers):
    """One `StaleGraphError` from the workers' ``refusal_info`` answers (None where none
    refused). Its message says what it is, for clients that see only the text (an HTTP
    client of ``vllm serve``: Note [check before serve], 5.)."""
    import pandas as pd

    from graphtrace.guard import StaleGraphError

    answers = [a for a in answers or () if a]
    if not answers:
        return None
    frames = [pd.DataFrame(a["rows"], columns=a["columns"]) for a in answers]
    problems = frames[0] if len(frames) == 1 else pd.concat(frames, ignore_index=True)
    return StaleGraphError(REFUSED + "\n".join(a["message"] for a in answers), problems)


REFUSED = "StaleGraphError: the engine refuses to serve until a correct weight update: "


# -- the async client (Note [check before serve], 5.) ------------------------------------------

def client_stream(engine, stream):
    """``AsyncLLM.generate``'s (or ``encode``'s) output ``stream`` for one request, as its
    caller iterates it: unchanged, except that a final output that says the request failed
    (`_errored`) while the workers' refusal stands is replaced by raising that
    `StaleGraphError`."""
    if not _remote["on"]:
        return stream
    return _refusing_stream(engine, stream)


async def _refusing_stream(engine, stream):
    import contextlib

    refused = None
    async with contextlib.aclosing(stream):  # closed early by the caller: vLLM aborts the request
        async for out in stream:
            if refused is None and _errored(out):
                refused = await _ask_refusal_async(engine)
                if refused is not None:
                    continue  # the request's last output: the stream ends after it
            yield out
    if refused is not None:
        raise refused


async def _ask_refusal_async(engine):
    """`_ask_refusal` for an ``AsyncLLM``: ``await engine.collective_rpc("graphtrace_refusal")``,
    one query for all the requests a step refused (their streams wait on the same one)."""
    import asyncio

    state = engine.__dict__
    query = state.get("_graphtrace_refusal_query")
    if query is None:
        query = asyncio.ensure_future(engine.collective_rpc("graphtrace_refusal"))
        state["_graphtrace_refusal_query"] = query

        def done(_):
            if state.get("_graphtrace_refusal_query") is query:
                del state["_graphtrace_refusal_query"]
        query.add_done_callback(done)
    try:
        answers = await asyncio.shield(query)  # a cancelled waiter leaves it to the others
    except Exception:
        if _strict():
            raise
        logger.exception("graphtrace: asking the workers why a request failed (ignored)")
        return None
    return _refusal(answers)


# -- several ranks (Note [one rank raises] in graphtrace/vllm/plugin.py) -----------------------

def _strict() -> bool:
    return os.environ.get("GRAPHTRACE_STRICT") == "1"


def _world_group():
    try:
        from vllm.distributed.parallel_state import get_world_group

        group = get_world_group()
    except Exception:  # no distributed state (tests, a bare worker)
        return None
    return group if getattr(group, "world_size", 1) > 1 else None


def _is_last_rank() -> bool:
    group = _world_group()
    return group is None or group.rank_in_group == group.world_size - 1


def _any_rank(flag: bool) -> bool:
    """True on every rank if it is True on any (an all_gather over the world CPU group)."""
    import torch.distributed as dist

    group = _world_group()
    gathered: list = [None] * group.world_size
    dist.all_gather_object(gathered, bool(flag), group=group.cpu_group)
    return any(gathered)


def _gather_problems(problems, rank: int):
    """[(rank, problems)] of every rank of the world group."""
    import pandas as pd
    import torch.distributed as dist

    group = _world_group()
    mine = (rank, problems.to_dict("records"), list(problems.columns))
    gathered: list = [None] * group.world_size
    dist.all_gather_object(gathered, mine, group=group.cpu_group)
    return [(r, pd.DataFrame(rows, columns=columns)) for r, rows, columns in gathered]


def _raise_for_all_ranks(ranks, problems, what: str, rank: int) -> None:
    """Note [one rank raises] in graphtrace/vllm/plugin.py; `ranks`: `_gather_problems`."""
    from graphtrace.guard import StaleGraphError, describe

    bad = {r: frame for r, frame in ranks if len(frame)}
    if not bad:
        return
    if not _is_last_rank():
        if len(problems):
            logger.error("graphtrace guard (rank %s, %s): %s (the last rank raises for all "
                         "ranks)", rank, what, describe(problems))
        return
    import pandas as pd

    text = "\n".join(f"rank {r}: {describe(frame)}" for r, frame in bad.items())
    merged = pd.concat([f.assign(rank=r) for r, f in bad.items()], ignore_index=True)
    raise StaleGraphError(f"graphtrace guard ({what}), problems in rank(s) "
                          f"{', '.join(map(str, bad))} of {len(ranks)}:\n{text}", merged)
