"""graphtrace as a vLLM general plugin: tracing inside worker processes.

Declared in pyproject.toml::

    [project.entry-points."vllm.general_plugins"]
    graphtrace = "graphtrace.vllm.plugin:register"

vLLM calls ``register()`` once in every process it starts (API server / process 0, engine
core, workers: ``load_general_plugins()``). It does nothing unless ``GRAPHTRACE_VLLM=1``.
When on, in each process that hosts a vLLM worker:

1. before ``Worker.load_model`` a :class:`~graphtrace.vllm.adapter.VllmTrace` is opened
   (so every CUDA graph vLLM captures later, at ``compile_or_warm_up_model``, is recorded);
2. after it the worker's model (``worker.model_runner.get_model()``) and the runner's input
   buffers are watched under vLLM's FQNs;
3. with ``GRAPHTRACE_VLLM_EMULATE=1`` (or ``=N`` tokens) an emulated capture of vLLM's own
   dummy decode run is recorded after warm-up (CPU: there are no CUDA graphs);
4. a report folder ``$GRAPHTRACE_VLLM_DIR/<tag>/rank<R>/`` is written when asked through
   ``collective_rpc`` and at worker shutdown (tag ``shutdown``).

Environment: ``GRAPHTRACE_VLLM=1`` (on), ``GRAPHTRACE_VLLM_DIR`` (default
``./graphtrace-vllm``), ``GRAPHTRACE_VLLM_EMULATE`` (``1`` or a token count),
``GRAPHTRACE_STRICT=1`` (raise instead of fail-open; tests), ``GRAPHTRACE_MODULES``
(module attribution: ``forward``, the default, ``hooks`` or ``off``; see graphtrace.attribution),
``GRAPHTRACE_PROVENANCE=0`` (no creation sites in the report: the worker's eager forwards then
run without provenance's dispatch mode; see Note [provenance] in graphtrace/provenance.py).

Guard mode, ``GRAPHTRACE_VLLM=guard``: all of the above, and after every weight update
(``reload_weights``, a weight-transfer session's ``finish_weight_update``, a bare
``model.load_weights`` run through ``collective_rpc``; Note [weight updates] in
graphtrace.vllm.hooks) each worker runs ``graphtrace.Guard.check()`` over the graphs
captured so far and writes ``$GRAPHTRACE_VLLM_DIR/guard/rank<R>/`` (``guard.json``: the
manifest; ``checks.jsonl``: one line per check; ``problems-<N>.csv``). ``GRAPHTRACE_GUARD``
says what a problem does: ``raise`` (default: the update fails with `graphtrace.StaleGraphError`
listing the problems, in every rank that has them), ``warn`` (logged; the update stands) or
``recapture`` (the graphs are captured again, then checked; see `_recapture`: vLLM 0.32 has no
public way to re-capture its CUDA graphs, so this re-records the plugin's emulated dummy-run
graphs on CPU and raises where it cannot). An internal error of the guard itself is logged
and counted, never raised (fail open), unless ``GRAPHTRACE_STRICT=1``.

From the client (string method names work across processes without pickling code)::

    llm.collective_rpc("graphtrace_capture", kwargs={"label": "decode", "skip": 1})  # arm
    llm.generate(...)                                   # the armed forward is recorded
    llm.collective_rpc("graphtrace_capture_dummy", kwargs={"label": "dummy_decode"})
    llm.collective_rpc("reload_weights", kwargs={...})
    paths = llm.collective_rpc("graphtrace_write_report", kwargs={"tag": "after_reload"})
    report = graphtrace.vllm.merge_reports(os.path.dirname(paths[0]))

The same functions are module-level here (``rpc_write_report`` ...) for
``collective_rpc(callable)`` in-process, where no pickling is needed.
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
from pathlib import Path

logger = logging.getLogger("graphtrace.vllm")

ENV_ON = "GRAPHTRACE_VLLM"
ENV_DIR = "GRAPHTRACE_VLLM_DIR"
ENV_EMULATE = "GRAPHTRACE_VLLM_EMULATE"
ENV_STRICT = "GRAPHTRACE_STRICT"
ENV_MODULES = "GRAPHTRACE_MODULES"
ENV_GUARD = "GRAPHTRACE_GUARD"
DEFAULT_DIR = "graphtrace-vllm"
GUARD_ACTIONS = ("raise", "warn", "recapture")
# Blind-spot kinds the worker guard accepts (Note [blind spots in the guard], graphtrace/guard.py):
# "forward context": attention ops fetch the KV cache by layer name inside the op; a weight
# update never touches the KV cache, and no holder can be checked, so it would fail every
# update. "opaque handle": vLLM's CPU linears read oneDNN handles (a pointer in a 0-d tensor);
# the handle's identity is guarded like any tensor (a rebuilt handle is a stale edge), only
# the packed weights behind it are unseen. docs/vllm.md.
GUARD_ACCEPT = ("forward context", "opaque handle")

_session = None          # the VllmTrace of this process (one per worker process)
_lock = threading.RLock()
_registered = False
_written: dict[str, str] = {}
_counter = 0

__all__ = ["register", "enabled", "guard_mode", "guard_action", "rpc_guard_status", "session",
           "modules_setting", "write_report", "rpc_write_report", "rpc_capture", "rpc_capture_dummy", "rpc_status", "WORKER_METHODS"]


def enabled() -> bool:
    return os.environ.get(ENV_ON, "") in ("1", "guard")


def guard_mode() -> bool:
    """``GRAPHTRACE_VLLM=guard``: check every weight update (see the module doc)."""
    return os.environ.get(ENV_ON, "") == "guard"


def guard_action() -> str:
    """``GRAPHTRACE_GUARD``: raise (default), warn or recapture."""
    value = os.environ.get(ENV_GUARD, "").strip().lower() or "raise"
    if value not in GUARD_ACTIONS:
        logger.warning("graphtrace: %s=%r is not one of %s; using 'raise'", ENV_GUARD, value,
                       ", ".join(GUARD_ACTIONS))
        return "raise"
    return value


def session():
    """This process's worker-side VllmTrace (None if the plugin did not start one)."""
    return _session


def register() -> None:
    """The ``vllm.general_plugins`` entry point. Cheap and idempotent; off by default."""
    global _registered
    if not enabled():
        return
    with _lock:
        if _registered:
            return
        _registered = True
    from graphtrace.vllm import hooks

    hooks.add_listener("before_load", _before_load)
    hooks.add_listener("after_warmup", _after_warmup)
    hooks.add_listener("shutdown", _on_shutdown)
    hooks.add_listener("engine_loop", _engine_loop)
    if guard_mode():
        hooks.add_listener("after_load", _guard_after_load)
        hooks.add_listener("before_update", _guard_before_update)
        hooks.add_listener("after_update", _guard_after_update)
    atexit.register(_at_exit)
    logger.info("graphtrace: vLLM plugin registered in pid %d", os.getpid())


def _strict() -> bool:
    return os.environ.get(ENV_STRICT) == "1"


def modules_setting() -> str:
    """``GRAPHTRACE_MODULES``; "forward" when unset, or (with a warning) not understood."""
    from graphtrace.attribution import MODES

    value = os.environ.get(ENV_MODULES, "").strip().lower() or "forward"
    if value not in MODES:
        logger.warning("graphtrace: %s=%r is not one of %s; using 'forward'", ENV_MODULES,
                       value, ", ".join(MODES))
        return "forward"
    return value


def _unwrap(worker):
    """collective_rpc passes the WorkerWrapperBase; the real worker is ``.worker``."""
    inner = worker.__dict__.get("worker") if hasattr(worker, "__dict__") else None
    return inner if inner is not None else worker


def _before_load(worker) -> None:
    global _session
    from graphtrace.tracing import active_trace
    from graphtrace.vllm.adapter import VllmTrace

    _add_worker_methods(type(worker))
    with _lock:
        if _session is not None:
            return
        if active_trace() is not None:
            logger.warning("graphtrace: a trace is already open in pid %d (graphtrace.vllm."
                           "trace_llm?); the plugin leaves this worker to it", os.getpid())
            return
        vt = VllmTrace(strict=_strict(), modules=modules_setting(), in_process=False)
        vt.__enter__()  # watches the worker's model right after load_model
        _session = vt


# -- guard mode --------------------------------------------------------------------------------

class _WorkerGuard:
    """This worker's guard: rebuilt when graphs were captured since, checked after updates."""

    def __init__(self):
        self.guard = None
        self.n_graphs = 0       # captures the guard covers (graph ids below first_graph dropped)
        self.first_graph = 0    # graphs captured before a recapture are gone
        self.checks = 0
        self.errors = 0
        self.last: dict | None = None

    def refresh(self):
        captures = _session.trace.captures
        if self.guard is None or len(captures) != self.n_graphs:
            if len(captures) <= self.first_graph:
                self.guard = None
            else:
                self.guard = _session.trace.guard(first_graph=self.first_graph,
                                                  accept=GUARD_ACCEPT)
                self.folder().mkdir(parents=True, exist_ok=True)
                self.guard.to_json(self.folder() / "guard.json")
            self.n_graphs = len(captures)
        return self.guard

    def folder(self) -> Path:
        from graphtrace.vllm import hooks

        rank = hooks.worker_rank(_session.worker) if _session.worker is not None else 0
        return out_dir() / "guard" / f"rank{rank}"


_guard_state: _WorkerGuard | None = None


def _guard_after_load(worker) -> None:
    from graphtrace.vllm import hooks

    model = hooks.worker_model(worker)
    if model is not None:
        hooks.wrap_model_updates(model)  # a bare load_weights is an update too


def _guard_before_update(obj, method: str) -> None:
    global _guard_state
    if _session is None:
        return
    with _lock:
        if _guard_state is None:
            _guard_state = _WorkerGuard()
        try:
            _guard_state.refresh()  # capture-time owners: made before the update changes them
        except Exception:
            _guard_failed("building the guard before " + method)


def _guard_after_update(obj, method: str) -> None:
    """Check this worker's guard after a weight update and act on GRAPHTRACE_GUARD. With
    several ranks every rank reaches the same collectives, whatever happened locally."""
    global _guard_state
    if _session is None:
        return
    import sys

    from graphtrace.guard import StaleGraphError, describe, empty_problems

    action = guard_action()
    several = _world_group() is not None
    problems, failure = empty_problems(), None
    with _lock:
        if _guard_state is None:
            _guard_state = _WorkerGuard()
        state = _guard_state
        try:
            guard = state.refresh()
            if guard is not None:
                problems = guard.check()
        except Exception:
            failure = sys.exc_info()
            _guard_failed("checking the guard after " + method)
        if action == "recapture" and (_any_rank(len(problems) > 0) if several else len(problems)):
            try:  # a dummy run is collective under tensor parallelism: all ranks re-capture
                problems = _recapture(state, problems)
            except Exception:
                failure = failure or sys.exc_info()
                _guard_failed("re-capturing after " + method)
        if failure is None and state.guard is not None:
            try:
                _record_check(state, method, problems, action)
            except Exception:
                failure = sys.exc_info()
                _guard_failed("writing the guard check after " + method)
    try:
        # graphs captured after this update: their owners from a fresh walk
        _session.trace.models_changed()
    except Exception:
        _guard_failed("refreshing owners after " + method)
    if action == "warn":
        if len(problems):
            logger.warning("graphtrace guard (rank %s, after %s): %s", _rank(), method,
                           describe(problems))
    elif not several:
        if len(problems):
            raise StaleGraphError(f"graphtrace guard (rank {_rank()}, after {method}): "
                                  f"{describe(problems)}", problems)
    else:
        _raise_for_all_ranks(problems, method)
    if failure is not None and _strict():
        raise failure[1].with_traceback(failure[2])


def _raise_for_all_ranks(problems, method: str) -> None:
    """Note [one rank raises]."""
    from graphtrace.guard import StaleGraphError, describe

    ranks = _gather_problems(problems)
    bad = {rank: frame for rank, frame in ranks if len(frame)}
    if not bad:
        return
    if not _is_last_rank():
        if len(problems):
            logger.error("graphtrace guard (rank %s, after %s): %s (the last rank raises for "
                         "all ranks)", _rank(), method, describe(problems))
        return
    import pandas as pd

    text = "\n".join(f"rank {rank}: {describe(frame)}" for rank, frame in bad.items())
    merged = pd.concat([f.assign(rank=r) for r, f in bad.items()], ignore_index=True)
    raise StaleGraphError(f"graphtrace guard (after {method}), problems in rank(s) "
                          f"{', '.join(map(str, bad))} of {len(ranks)}:\n{text}", merged)


# Note [one rank raises]
# ~~~~~~~~~~~~~~~~~~~~~~
# vLLM 0.32's MultiprocExecutor.collective_rpc reads the workers' responses in rank order and
# raises at the first failed one, leaving the later ranks' responses in their queues: the
# *next* collective_rpc then reads those (measured here with tensor_parallel_size=2: the call
# after a failed reload got rank 1's StaleGraphError). So the ranks agree first (an
# all_gather_object over vLLM's world CPU group, which every rank reaches: every worker runs
# the same update) and only the last rank raises, for all of them, after the earlier ranks'
# successful responses were read. Each rank still writes its own check to checks.jsonl.


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


def _gather_problems(problems):
    """[(rank, problems)] of every rank of the world group, or None with one worker."""
    group = _world_group()
    if group is None:
        return None
    import pandas as pd
    import torch.distributed as dist

    mine = (_rank(), problems.to_dict("records"), list(problems.columns))
    gathered: list = [None] * group.world_size
    dist.all_gather_object(gathered, mine, group=group.cpu_group)
    return [(rank, pd.DataFrame(rows, columns=columns)) for rank, rows, columns in gathered]


def _rank() -> int:
    from graphtrace.vllm import hooks

    return hooks.worker_rank(_session.worker) if _session.worker is not None else 0


def _guard_failed(where: str) -> None:
    """Count and log an internal error of the guard (raised later only with GRAPHTRACE_STRICT=1,
    after the ranks agreed: Note [one rank raises])."""
    if _guard_state is not None:
        _guard_state.errors += 1
    logger.exception("graphtrace: guard error %s (fail open)", where)


def _record_check(state: _WorkerGuard, method: str, problems, action: str) -> None:
    """Append one line to ``guard/rank<R>/checks.jsonl``; problems to ``problems-<N>.csv``."""
    import json
    import time

    state.checks += 1
    folder = state.folder()
    folder.mkdir(parents=True, exist_ok=True)
    entry = {"check": state.checks, "pid": os.getpid(), "rank": _rank(), "trigger": method,
             "action": action, "ok": not len(problems), "n_problems": int(len(problems)),
             "verdicts": sorted(set(problems["verdict"])) if len(problems) else [],
             "owners": sorted(set(problems["owners"])) if len(problems) else [],
             "graphs": len(state.guard.graphs), "storages": len(state.guard),
             "time": time.time()}
    if len(problems):
        problems.to_csv(folder / f"problems-{state.checks}.csv", index=False)
        entry["problems_csv"] = f"problems-{state.checks}.csv"
    with open(folder / "checks.jsonl", "a") as f:
        f.write(json.dumps(entry) + "\n")
    state.last = entry


def _recapture(state: _WorkerGuard, problems):
    """GRAPHTRACE_GUARD=recapture: capture the graphs again on the updated model, then check.

    vLLM 0.32 exposes no public way to re-capture its CUDA graphs (``capture_model`` and
    ``CUDAGraphWrapper.clear_all_graphs`` are runner internals, used at startup): on CUDA
    the problems stand and the update fails. On CPU the plugin's own emulated graphs of
    vLLM's dummy run (``GRAPHTRACE_VLLM_EMULATE``, ``graphtrace_capture_dummy``) are
    dropped and recorded again; graphs of armed forwards (``graphtrace_capture``) are dropped
    (they need a new request to record). The guard then covers the new graphs only.
    """
    from graphtrace.vllm.adapter import capture_dummy_run

    captures = _session.trace.captures
    if any(c.kind == "cuda" for c in captures[state.first_graph:]):
        logger.error("graphtrace: GRAPHTRACE_GUARD=recapture: vLLM 0.32 has no public API "
                     "to re-capture CUDA graphs; failing the update instead")
        return problems
    _session.trace.models_changed()  # the updated model's
    worker = _session.worker
    dummy = [c.label for c in captures[state.first_graph:] if c.info.get("dummy_run")]
    _session.graphs.clear()  # the emulated graphs: the old storages die with them
    state.first_graph = len(captures)
    for label in dict.fromkeys(dummy):
        capture_dummy_run(_session, worker, label, None, True)
    state.guard = None
    guard = state.refresh()
    if guard is None:
        logger.warning("graphtrace: recapture: no graph could be re-recorded; nothing to guard")
        return problems.iloc[0:0]
    logger.info("graphtrace: recaptured %d graph(s) after a weight update", len(guard.graphs))
    return guard.check()


def rpc_guard_status(worker=None) -> dict:
    """This worker's guard: mode, action, checks run, the last check's entry."""
    state = _guard_state
    return {"pid": os.getpid(), "guard_mode": guard_mode(), "action": guard_action(),
            "checks": state.checks if state else 0, "errors": state.errors if state else 0,
            "storages": len(state.guard) if state and state.guard is not None else 0,
            "last": state.last if state else None,
            "folder": str(state.folder()) if state and _session is not None else ""}


def _after_warmup(worker) -> None:
    value = os.environ.get(ENV_EMULATE, "")
    if _session is None or value in ("", "0"):
        return
    n = int(value) if value.isdigit() and int(value) > 1 else None
    _session.capture_dummy("dummy_decode", n)


def _engine_loop(engine_core) -> None:
    """The engine core's busy loop starts: make a SIGTERM always wake it, so that its workers
    are shut down (and write their reports) instead of killed (Note [lost SIGTERM] in
    graphtrace/vllm/hooks.py)."""
    from vllm.v1.engine import EngineCoreRequestType

    from graphtrace.vllm import hooks

    inputs = engine_core.input_queue
    if not hooks.wake_on_signals(lambda: inputs.put_nowait((EngineCoreRequestType.WAKEUP, None))):
        logger.warning("graphtrace: could not watch SIGTERM in the engine core (pid %d); a "
                       "shutdown may lose the workers' shutdown reports", os.getpid())


def _on_shutdown(worker) -> None:
    _final_report(_unwrap(worker), "Worker.shutdown")


def _at_exit() -> None:
    _final_report(None, "atexit")


def _final_report(worker, trigger: str) -> None:
    if _session is None or "shutdown" in _written:
        return
    try:
        if not _session.trace.captures:
            logger.info("graphtrace: nothing was captured in pid %d; no report", os.getpid())
            _written["shutdown"] = ""
            return
        write_report(worker, tag="shutdown", trigger=trigger)
    except Exception:
        if _strict():
            raise
        logger.exception("graphtrace: could not write the shutdown report")


def out_dir(override: str | os.PathLike | None = None) -> Path:
    return Path(override or os.environ.get(ENV_DIR) or DEFAULT_DIR)


def write_report(worker=None, tag: str | None = None,
                 directory: str | os.PathLike | None = None, trigger: str = "collective_rpc") -> str:
    """Diff this process's trace against the live model; write ``<dir>/<tag>/rank<R>/``."""
    global _counter
    if _session is None:
        raise RuntimeError("graphtrace: the vLLM plugin is not tracing this process "
                           f"(set {ENV_ON}=1 before the engine starts)")
    from graphtrace.vllm import hooks

    with _lock:
        if tag is None:
            _counter += 1
            tag = f"rpc{_counter}"
        w = _unwrap(worker) if worker is not None else _session.worker
        rank = hooks.worker_rank(w) if w is not None else 0
        folder = out_dir(directory) / tag / f"rank{rank}"
        if (folder / "manifest.json").exists() and _written.get(tag) != str(folder):
            folder = folder.with_name(f"rank{rank}-pid{os.getpid()}")  # another engine, same rank
        report = _session.diff()
        report.meta["vllm"]["tag"] = tag
        report.meta["vllm"]["trigger"] = trigger
        report.to_csv(folder)
        _written[tag] = str(folder)
        logger.info("graphtrace: wrote %s", folder)
        return str(folder)


# -- collective_rpc entry points (first argument: the worker or its wrapper) ------------------

def rpc_write_report(worker, tag: str | None = None, directory: str | None = None) -> str:
    return write_report(worker, tag=tag, directory=directory, trigger="collective_rpc")


def rpc_capture(worker, label: str = "decode", forwards: int = 1, skip: int = 0) -> int:
    """Arm an emulated capture of the worker model's next forwards (``skip`` first skipped);
    it disarms itself after ``forwards`` recorded calls. Returns the number of graphs so far."""
    if _session is None:
        raise RuntimeError("graphtrace: the vLLM plugin is not tracing this process")
    from graphtrace.vllm.adapter import _ForwardCapture

    cap = _ForwardCapture(_session, label, forwards, skip, auto_close=True)
    cap.open()
    return len(_session.trace.captures)


def rpc_capture_dummy(worker, label: str = "dummy_decode", num_tokens: int | None = None) -> int:
    """Record one emulated graph of vLLM's dummy run now; returns the number of graphs."""
    if _session is None:
        raise RuntimeError("graphtrace: the vLLM plugin is not tracing this process")
    from graphtrace.vllm.adapter import capture_dummy_run

    capture_dummy_run(_session, _unwrap(worker), label, num_tokens, True)
    return len(_session.trace.captures)


def rpc_status(worker=None) -> dict:
    """Small plain dict: is this process tracing, what it watches and has captured."""
    from graphtrace.vllm import hooks

    w = _unwrap(worker) if worker is not None else None
    out = {"pid": os.getpid(), "enabled": enabled(), "tracing": _session is not None,
           "rank": hooks.worker_rank(w) if w is not None else None}
    if _session is not None:
        out.update(models=list(_session.trace.models),
                   graphs=[c.label for c in _session.trace.captures],
                   blind_spots=len(_session.blind_spots), written=dict(_written))
    return out


def _method(fn):
    def method(self, *args, **kwargs):
        return fn(self, *args, **kwargs)
    method.__name__ = fn.__name__
    method.__doc__ = fn.__doc__
    return method


WORKER_METHODS = {
    "graphtrace_write_report": rpc_write_report,
    "graphtrace_capture": rpc_capture,
    "graphtrace_capture_dummy": rpc_capture_dummy,
    "graphtrace_status": rpc_status,
    "graphtrace_guard_status": rpc_guard_status,
}


def _add_worker_methods(cls) -> None:
    """Make ``collective_rpc("graphtrace_...")`` resolve on the worker (like a worker
    extension class, without taking the ``worker_extension_cls`` slot)."""
    for name, fn in WORKER_METHODS.items():
        if not hasattr(cls, name):
            setattr(cls, name, _method(fn))
