"""Where graphtrace hooks into a vLLM worker (vLLM 0.32 to 0.34: the same targets in each; what
every supported release must provide is graphtrace/vllm/releases.py, checked by contract.py).

vLLM builds the model in ``Worker.load_model`` (``vllm.v1.worker.gpu_worker.Worker``; the
CPU worker inherits it), captures CUDA graphs in ``compile_or_warm_up_model`` and releases
everything in ``shutdown``. This module wraps those three methods once per process, lazily:
the wrapping happens when ``vllm.v1.worker.gpu_worker`` (and ``cpu_worker``) are imported,
so a process that never hosts a worker (the API server, process 0 with multiprocessing on)
never imports the worker modules because of us. The engine core's busy loop
(``vllm.v1.engine.core``) is wrapped the same way, for Note [lost SIGTERM].

Listeners are plain callables ``fn(worker)``:

* ``before_load``: before the model is built (open the trace here so that every capture,
  even one during loading, is recorded);
* ``after_load``: the model exists (``worker.model_runner.get_model()``): watch it;
* ``after_warmup``: after ``compile_or_warm_up_model`` (CUDA graphs captured; on CPU the
  place for an emulated capture, the KV cache exists);
* ``shutdown``: before ``Worker.shutdown`` runs;
* ``before_update`` / ``after_update``: around every weight update, once per outermost update
  (Note [weight updates]);
* ``engine_loop``: the engine core's busy loop starts (``EngineCoreProc.run_busy_loop``, in
  the engine-core process's main thread; the listener gets the engine core, not a worker).

A listener's exception is logged and swallowed (fail open): tracing never breaks the engine,
unless ``GRAPHTRACE_STRICT=1``, and except `graphtrace.StaleGraphError`, which a guard
raises on purpose to fail the update (fail closed).

Note [weight updates]
~~~~~~~~~~~~~~~~~~~~~
vLLM 0.32 changes a worker's weights through: ``Worker.reload_weights`` (layerwise reload; it
calls ``model.load_weights`` inside), the weight-transfer session ``Worker.start_weight_update``
(or ``start_draft_weight_update``) .. ``update_weights`` (per chunk) .. ``finish_weight_update``
(RL trainers; ``update_weights`` calls ``model.load_weights`` per chunk; a chunk that fails
ends the session, as vLLM's worker does), a bare ``model.load_weights(weights)`` (TRL colocate
calls it on the worker's model directly, OpenRLHF and verl through ``collective_rpc``), and
``vllm.model_executor.model_loader.utils.process_weights_after_loading``, which verl calls
itself once after its buckets (wrapped as a module attribute: a caller that imported the name
before the plugin registered keeps the original; verl imports it when it calls it). The model
class's ``load_weights`` is wrapped when the model is loaded (`wrap_model_updates`).
``before_update`` fires when the outermost of these starts, ``after_update`` when it ends
without raising: calls nested inside another, and ``load_weights`` inside an open transfer
session, fire nothing (the model is half-updated until the session finishes). What the
guard does with them: Note [check before serve] in graphtrace/vllm/serve.py, which also
explains the wrapped ``EngineCore.step`` / ``collective_rpc``, ``LLMEngine.step`` and
``AsyncLLM.generate`` / ``encode``.
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.util
import logging
import os
import sys
import threading
from typing import Callable

from graphtrace import clock
from graphtrace.serving import strict
from graphtrace.vllm import releases

__all__ = [
    "EVENTS", "add_listener", "remove_listener", "install", "uninstall", "wake_on_signals",
    "worker_model", "worker_rank", "wrap_model_updates", "serve_through", "SERVE_POINTS",
    "DRAIN", "targets",
]

logger = logging.getLogger("graphtrace.vllm")

EVENTS = ("before_load", "after_load", "after_warmup", "shutdown", "before_update",
          "after_update", "engine_loop")
# tuples, replaced on change: firing (once per load_weights call of a per-tensor sync) copies none
_listeners: dict[str, tuple[Callable, ...]] = {e: () for e in EVENTS}
_lock = threading.RLock()
_patched: set[str] = set()

def _by_module() -> dict[str, list]:
    """module -> (class name or None, method name, before, after) of the release table's
    hooks (`releases.HOOKS`, which says what each wraps)."""
    by_module: dict[str, list] = {}
    for hook in releases.HOOKS:
        cls, _, method = hook.qualname.rpartition(".")
        by_module.setdefault(hook.module, []).append((cls or None, method, hook.before,
                                                      hook.after))
    return by_module


_TARGETS = _by_module()


def targets() -> list[str]:
    """Every wrapped entry point as ``module:Class.method`` (``module:function``)."""
    return [hook.target for hook in releases.HOOKS]


def add_listener(event: str, fn: Callable) -> None:
    if event not in _listeners:
        raise ValueError(f"unknown event {event!r}; events: {', '.join(EVENTS)}")
    with _lock:
        if fn not in _listeners[event]:
            _listeners[event] = (*_listeners[event], fn)
    install()


def remove_listener(event: str, fn: Callable) -> None:
    with _lock:
        if fn in _listeners[event]:
            _listeners[event] = tuple(f for f in _listeners[event] if f != fn)


def _fire(event: str, worker, *args) -> None:
    for fn in _listeners[event]:
        try:
            if clock.CLOCK is None:
                fn(worker, *args)
            else:  # Note [self clock] in graphtrace/clock.py
                with clock.CLOCK.section(f"{event}: {getattr(fn, '__qualname__', fn)}"):
                    fn(worker, *args)
        except Exception as exc:
            if strict() or _fails_closed(exc):
                raise
            logger.exception("graphtrace: %s listener %r failed (ignored)", event, fn)


def _fails_closed(exc: Exception) -> bool:
    """A guard's verdict (StaleGraphError) fails the weight update on purpose."""
    from graphtrace.guard import StaleGraphError

    return isinstance(exc, StaleGraphError)


class _UpdateState(threading.local):
    def __init__(self):
        self.depth = 0          # weight-update calls running on this thread
        self.session = False    # a weight-transfer session is open (start .. finish)


_update_state = _UpdateState()


def _wrap_update(cls, method: str, role: str) -> None:
    """Wrap one weight-update entry point (Note [weight updates]); `role`: "call" (a whole
    update), "start", "chunk" or "finish" (a transfer session's calls)."""
    original = cls.__dict__.get(method)
    if original is None or getattr(original, "__graphtrace_wrapped__", False):
        return

    @functools.wraps(original)
    def wrapper(self, *args, **kwargs):
        state = _update_state
        outer = state.depth == 0 and not state.session
        if outer and role not in ("chunk", "finish"):
            _fire("before_update", self, method)
        state.depth += 1
        ok = False
        try:
            with clock.outside():
                result = original(self, *args, **kwargs)
            ok = True
        finally:
            state.depth -= 1
            if state.depth == 0 and role in ("start", "chunk", "finish"):
                state.session = _session_open(self, role, ok, state.session)
        if ok and state.depth == 0 and not state.session and role not in ("start", "chunk"):
            _fire("after_update", self, method)
        return result

    wrapper.__graphtrace_wrapped__ = True
    wrapper.__graphtrace_original__ = original
    setattr(cls, method, wrapper)


def _session_open(worker, role: str, ok: bool, was_open: bool) -> bool:
    """Is a transfer session open after ``role`` ran? The worker's own record
    (``Worker._weight_update_active``, vLLM 0.32): a chunk that fails ends vLLM's session
    (``update_weights`` resets it before re-raising), and a later ``load_weights`` must be an
    update of its own again, not a silent part of a session that no ``finish`` will close."""
    active = getattr(worker, "_weight_update_active", None)
    if isinstance(active, bool):
        return active
    if not ok:
        return was_open
    return {"start": True, "finish": False}.get(role, was_open)


def wrap_model_updates(model) -> None:
    """Make ``type(model).load_weights`` a weight update (fires the update events when it is
    the outermost one); idempotent."""
    cls = type(model)
    if "load_weights" not in cls.__dict__:  # inherited: wrap where it is defined
        for base in cls.__mro__[1:]:
            if "load_weights" in base.__dict__:
                cls = base
                break
        else:
            return
    with _lock:
        _wrap_update(cls, "load_weights", "call")
        _model_classes.add(cls)


_model_classes: set = set()


def _wrap(cls, method: str, before: str | None, after: str | None) -> None:
    original = cls.__dict__.get(method)
    if original is None or getattr(original, "__graphtrace_wrapped__", False):
        return

    @functools.wraps(original)
    def wrapper(self, *args, **kwargs):
        # Fire once per worker object even when a subclass calls super().method().
        key = f"_graphtrace_in_{method}"
        outer = not self.__dict__.get(key, False)
        if outer:
            self.__dict__[key] = True
        loading = method == "load_model"  # weight processing inside it is no update
        try:
            if outer and before:
                _fire(before, self)
            if loading:
                _update_state.depth += 1
            try:
                with clock.outside():
                    result = original(self, *args, **kwargs)
            finally:
                if loading:
                    _update_state.depth -= 1
            if outer and after:
                _fire(after, self)
            return result
        finally:
            if outer:
                self.__dict__.pop(key, None)

    wrapper.__graphtrace_wrapped__ = True
    wrapper.__graphtrace_original__ = original
    setattr(cls, method, wrapper)


# The engine's per-step and per-RPC points of Note [check before serve]
# (graphtrace/vllm/serve.py), handed over by that module when it is imported
# (`serve_through`): the hooks never import it, so adapter, hooks and serve form no circle.
# Until then (no guard in this process) the wrapped methods only call the originals.
SERVE_POINTS = ("before_step", "drain_step", "mark_remote_update", "after_client_step",
                "client_step_failed", "client_stream")
_serve: dict[str, Callable] = {}
DRAIN = object()  # before_step's answer while batches are in flight


def serve_through(**points: Callable) -> None:
    """Route the wrapped engine points to ``points`` (names: `SERVE_POINTS`)."""
    unknown = sorted(set(points) - set(SERVE_POINTS))
    if unknown:
        raise ValueError(f"unknown serve points {unknown}; points: {', '.join(SERVE_POINTS)}")
    with _lock:
        _serve.update(points)


def _wrap_serve(cls, method: str, role: str) -> None:
    """Wrap one of the engine's points above by its role (``releases.HOOKS``): ``step`` may
    be refused before it schedules anything, ``rpc`` marks an update pending, the client's
    ``client_step`` and ``client_stream`` raise a refusal."""
    original = cls.__dict__.get(method)
    if original is None or getattr(original, "__graphtrace_wrapped__", False):
        return
    if role == "step":
        def wrapper(self, *args, **kwargs):
            before = _serve.get("before_step")
            if before is None:
                return original(self, *args, **kwargs)
            with clock.section("serve: before step"):
                refused = before(self)
            if refused is DRAIN:
                return _serve["drain_step"](self, original)
            if refused is not None:
                return refused
            return original(self, *args, **kwargs)
    elif role == "client_stream":  # an async generator function: its stream, wrapped
        def wrapper(self, *args, **kwargs):
            stream = original(self, *args, **kwargs)
            through = _serve.get("client_stream")
            return stream if through is None else through(self, stream)
    elif role == "rpc":
        def wrapper(self, method, *args, **kwargs):
            try:
                return original(self, method, *args, **kwargs)
            finally:
                mark = _serve.get("mark_remote_update")
                if mark is not None:
                    with clock.section("serve: rpc"):
                        mark(self, method)
    else:
        def wrapper(self, *args, **kwargs):
            try:
                result = original(self, *args, **kwargs)
            except BaseException:
                failed = _serve.get("client_step_failed")
                if failed is not None:
                    failed(self)
                raise
            after = _serve.get("after_client_step")
            if after is not None:
                with clock.section("serve: after client step"):
                    after(self, result)
            return result
    functools.update_wrapper(wrapper, original)
    wrapper.__graphtrace_wrapped__ = True
    wrapper.__graphtrace_original__ = original
    setattr(cls, method, wrapper)


def _patch_module(name: str) -> None:
    with _lock:
        if name in _patched:
            return
        module = sys.modules.get(name)
        if module is None:
            return
        for cls_name, method, before, after in _TARGETS[name]:
            cls = module if cls_name is None else getattr(module, cls_name, None)
            if cls is None:
                continue
            if before == "update":
                _wrap_update(cls, method, after)
            elif before in ("step", "rpc", "client_step", "client_stream"):
                _wrap_serve(cls, method, before)
            else:
                _wrap(cls, method, before, after)
        _patched.add(name)


class _PostImportFinder(importlib.abc.MetaPathFinder):
    """Patch the worker modules right after they are first imported."""

    def find_spec(self, fullname, path, target=None):
        if fullname not in _TARGETS or fullname in _patched:
            return None
        for finder in sys.meta_path:
            if finder is self:
                continue
            find = getattr(finder, "find_spec", None)
            if find is None:
                continue
            spec = find(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        loader = spec.loader
        if loader is None or not hasattr(loader, "exec_module"):
            return None
        exec_module = loader.exec_module

        class _Loader(importlib.abc.Loader):
            def create_module(self, spec):
                return loader.create_module(spec)

            def exec_module(self, module):
                exec_module(module)
                try:
                    with clock.section("hooks: patch vLLM modules"):
                        _patch_module(fullname)
                except Exception:
                    logger.exception("graphtrace: could not patch %s", fullname)

        spec.loader = _Loader()
        return spec


_finder: _PostImportFinder | None = None


def install() -> None:
    """Wrap the worker methods now (modules already imported) or when they are imported."""
    global _finder
    with _lock:
        for name in _TARGETS:
            if name in sys.modules:
                _patch_module(name)
        if _finder is None and any(n not in _patched for n in _TARGETS):
            _finder = _PostImportFinder()
            sys.meta_path.insert(0, _finder)


def uninstall() -> None:
    """Restore the original methods (tests)."""
    global _finder
    with _lock:
        for name in list(_patched):
            module = sys.modules.get(name)
            for cls_name, method, _b, _a in _TARGETS[name]:
                cls = module if cls_name is None else getattr(module, cls_name, None)
                fn = cls.__dict__.get(method) if cls is not None else None
                if fn is not None and getattr(fn, "__graphtrace_wrapped__", False):
                    setattr(cls, method, fn.__graphtrace_original__)
            _patched.discard(name)
        for cls in list(_model_classes):
            fn = cls.__dict__.get("load_weights")
            if fn is not None and getattr(fn, "__graphtrace_wrapped__", False):
                setattr(cls, "load_weights", fn.__graphtrace_original__)
        _model_classes.clear()
        _signal_wakes.clear()
        if _finder is not None and _finder in sys.meta_path:
            sys.meta_path.remove(_finder)
        _finder = None
        for event in _listeners:
            _listeners[event] = ()


# Note [lost SIGTERM]
# ~~~~~~~~~~~~~~~~~~~
# With multiprocessing on, the client stops the engine by SIGTERMing the engine-core process
# and SIGKILLs its whole process tree 5 s later if it is still alive (vllm/v1/utils.py
# `shutdown`, `kill_process_tree`). The engine core's SIGTERM handler (v1/engine/core.py,
# `run_engine_core`) only records the request and wakes the busy loop; the worker then writes
# its shutdown report in `Worker.shutdown` once the executor closes its death pipe. But the
# handler is Python code, and CPython runs Python handlers in the main thread only, when it
# next checks for them between bytecodes; the C-level handler that takes the signal does not
# wake a main thread that is asleep in a lock. The idle engine core's main thread sleeps in
# `input_queue.get()` (a lock acquire, no timeout). A SIGTERM taken after its last check but
# before it falls asleep (or taken by another thread) is never acted on: the engine core
# sleeps until the SIGKILL, and the worker dies with it before it hears of any shutdown. The
# window is wide in practice: the client sends SIGTERM as soon as it has the last reply, and
# that reply is sent by the engine's output thread, which gets the GIL exactly when the main
# thread drops it to go to sleep. On a busy 2-core machine 1 in 4 runs lost the report.
# CPython's C handler does write each signal's number to the wakeup fd
# (`signal.set_wakeup_fd`) at once, from whichever thread takes it; `wake_on_signals` reads it
# in a helper thread and calls `wake` (for the engine core: put vLLM's own WAKEUP request on
# its input queue, as its handler does), so the main thread returns to the bytecode loop and
# runs the pending handler.

_signal_wakes: list[tuple[Callable[[], None], frozenset[int]]] = []
_wakeup_sockets: tuple | None = None  # (reader, writer): the writer is the process's wakeup fd


def wake_on_signals(wake: Callable[[], None], signals=None) -> bool:
    """Call ``wake()`` from a helper thread each time one of ``signals`` (default SIGTERM and
    SIGINT, which must have Python handlers) reaches this process, even while the main thread
    cannot run its handler (Note [lost SIGTERM]). Call it from the main thread; returns False
    (nothing installed) elsewhere, or when another wakeup fd (an asyncio loop's) is set."""
    global _wakeup_sockets
    import signal
    import socket

    wanted = frozenset(int(s) for s in (signals or (signal.SIGTERM, signal.SIGINT)))
    with _lock:
        if _wakeup_sockets is None:
            if threading.current_thread() is not threading.main_thread():
                return False
            reader, writer = socket.socketpair()
            writer.setblocking(False)  # the C handler must never block
            previous = signal.set_wakeup_fd(writer.fileno(), warn_on_full_buffer=False)
            if previous != -1:
                signal.set_wakeup_fd(previous)
                reader.close()
                writer.close()
                return False
            _wakeup_sockets = (reader, writer)  # kept open: the fd number must not be reused
            os.register_at_fork(after_in_child=_forget_wakeup_fd)
            threading.Thread(target=_relay_signals, args=(reader,), daemon=True,
                             name="graphtrace-signal-wake").start()
        _signal_wakes.append((wake, wanted))
    return True


def _relay_signals(reader) -> None:
    while True:
        try:
            data = reader.recv(512)
        except OSError:
            return
        if not data:
            return
        received = set(data)
        for wake, wanted in list(_signal_wakes):
            if received & wanted:
                try:
                    wake()
                except Exception:  # a helper thread: nowhere to raise to
                    logger.exception("graphtrace: waking on signal %s failed", sorted(received))


def _forget_wakeup_fd() -> None:
    """In a forked child: its signals must not wake the parent's engine through the shared
    socket (no lock taken: another thread may have held it at the fork)."""
    global _wakeup_sockets
    import signal

    _signal_wakes.clear()
    if _wakeup_sockets is None:
        return
    try:
        signal.set_wakeup_fd(-1)
    except ValueError:
        return  # not the main thread: leave the fd set (and open)
    for sock in _wakeup_sockets:
        sock.close()
    _wakeup_sockets = None


def worker_model(worker):
    """The model a vLLM worker runs (unwrapped), or None before it is loaded."""
    runner = getattr(worker, "model_runner", None)
    if runner is None:
        return None
    get = getattr(runner, "get_model", None)
    try:
        model = get() if get is not None else getattr(runner, "model", None)
    except Exception:
        model = getattr(runner, "model", None)
    return model


def worker_rank(worker) -> int:
    for attr in ("rank", "global_rank", "rpc_rank", "local_rank"):
        v = getattr(worker, attr, None)
        if isinstance(v, int):
            return v
    return 0
