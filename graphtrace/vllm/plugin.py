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

Environment: the table of docs/vllm.md, "Worker processes: the plugin".

Guard mode, ``GRAPHTRACE_VLLM=guard``: all of the above, and every weight update (Note [weight
updates] in graphtrace.vllm.hooks) is checked once, before the engine serves from it (when:
Note [check before serve] in graphtrace/vllm/serve.py; what ``GRAPHTRACE_GUARD`` does and what
each worker writes: docs/guard.md, "In vLLM").

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

from graphtrace.serving import STRICT_ENV, strict
from graphtrace.vllm.env import (  # noqa: F401 - the names stay importable from here
    ENV_DIR,
    ENV_GUARD,
    ENV_ON,
    enabled,
    guard_action,
    guard_folder,
    guard_mode,
    out_dir,
)

logger = logging.getLogger("graphtrace.vllm")

ENV_EMULATE = "GRAPHTRACE_VLLM_EMULATE"
ENV_STRICT = STRICT_ENV
ENV_MODULES = "GRAPHTRACE_MODULES"

_session = None          # the VllmTrace of this process (one per worker process)
_lock = threading.RLock()
_registered = False
_written: dict[str, str] = {}
_counter = 0

__all__ = ["register", "enabled", "guard_mode", "guard_action", "guard_folder", "rpc_guard_status",
           "rpc_check",
           "rpc_refusal",
           "serve_guard", "session",
           "modules_setting", "write_report", "rpc_write_report", "rpc_capture", "rpc_capture_dummy", "rpc_status", "WORKER_METHODS"]


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
    from graphtrace import clock

    with clock.section("plugin: register"):  # Note [self clock] in graphtrace/clock.py
        _register()


def _register() -> None:
    from graphtrace.vllm import hooks

    hooks.add_listener("before_load", _before_load)
    hooks.add_listener("after_warmup", _after_warmup)
    hooks.add_listener("shutdown", _on_shutdown)
    hooks.add_listener("engine_loop", _engine_loop)
    if guard_mode():  # a process without workers (the engine core) asks them before a step
        from graphtrace.vllm import serve

        serve.enable_remote()
    atexit.register(_at_exit)
    logger.info("graphtrace: vLLM plugin registered in pid %d", os.getpid())


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
        vt = VllmTrace(strict=strict(), modules=modules_setting(), in_process=False,
                       guard=guard_action if guard_mode() else None, guard_dir=_guard_folder)
        vt.__enter__()  # watches the worker's model right after load_model
        _session = vt


# -- guard mode (Note [check before serve] in graphtrace/vllm/serve.py) -------------------------

def _guard_folder() -> Path | None:
    if _session is None:
        return None
    return guard_folder(_session.worker)


def serve_guard():
    """This worker's `graphtrace.vllm.serve.ServeGuard` (None outside guard mode)."""
    return _session.serve_guard if _session is not None else None


# Note [one rank raises]
# ~~~~~~~~~~~~~~~~~~~~~~
# vLLM 0.32's MultiprocExecutor.collective_rpc reads the workers' responses in rank order and
# raises at the first failed one, leaving the later ranks' responses in their queues: the
# *next* collective_rpc then reads those (measured here with tensor_parallel_size=2: the call
# after a failed reload got rank 1's StaleGraphError). So the ranks agree first (an
# all_gather_object over vLLM's world CPU group, which every rank reaches: every worker runs
# the same update) and only the last rank raises, for all of them, after the earlier ranks'
# successful responses were read. Each rank still writes its own check to checks.jsonl.



def rpc_guard_status(worker=None) -> dict:
    """This worker's guard: mode, action, dirty, checks run, the last check's entry."""
    guard = serve_guard()
    out = {"pid": os.getpid(), "guard_mode": guard_mode(), "action": guard_action(),
           "checks": 0, "errors": 0, "storages": 0, "last": None, "folder": "",
           "dirty": False, "updates": []}
    if guard is not None:
        out.update(guard.status())
    return out


def rpc_check(worker=None, trigger: str = "graphtrace_check") -> dict:
    """The explicit end of a weight update (Note [check before serve], 2.): `ServingCore.check`."""
    guard = serve_guard()
    if guard is None:
        return {"ok": True, "checked": False, "guard_mode": guard_mode()}
    return guard.check(trigger)


def rpc_refusal(worker=None) -> dict | None:
    """The standing refusal of this worker's guard (`ServeGuard.refusal_info`), or None: what
    a client with the engine core in another process raises (Note [check before serve])."""
    guard = serve_guard()
    return guard.refusal_info() if guard is not None else None


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
        if strict():
            raise
        logger.exception("graphtrace: could not write the shutdown report")


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


WORKER_METHODS = {
    "graphtrace_write_report": rpc_write_report,
    "graphtrace_capture": rpc_capture,
    "graphtrace_capture_dummy": rpc_capture_dummy,
    "graphtrace_status": rpc_status,
    "graphtrace_guard_status": rpc_guard_status,
    "graphtrace_check": rpc_check,
    "graphtrace_refusal": rpc_refusal,
}


def _add_worker_methods(cls) -> None:
    """Make ``collective_rpc("graphtrace_...")`` resolve on the worker (like a worker
    extension class, without taking the ``worker_extension_cls`` slot); a function set on the
    class is a method: the worker is its first argument."""
    for name, fn in WORKER_METHODS.items():
        if not hasattr(cls, name):
            setattr(cls, name, fn)
