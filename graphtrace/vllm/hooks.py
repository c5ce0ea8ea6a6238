"""Where graphtrace hooks into a vLLM worker (vLLM 0.32).

vLLM builds the model in ``Worker.load_model`` (``vllm.v1.worker.gpu_worker.Worker``; the
CPU worker inherits it), captures CUDA graphs in ``compile_or_warm_up_model`` and releases
everything in ``shutdown``. This module wraps those three methods once per process, lazily:
the wrapping happens when ``vllm.v1.worker.gpu_worker`` (and ``cpu_worker``) are imported,
so a process that never hosts a worker (the API server, process 0 with multiprocessing on)
never imports the worker modules because of us.

Listeners are plain callables ``fn(worker)``:

* ``before_load``: before the model is built (open the trace here so that every capture,
  even one during loading, is recorded);
* ``after_load``: the model exists (``worker.model_runner.get_model()``): watch it;
* ``after_warmup``: after ``compile_or_warm_up_model`` (CUDA graphs captured; on CPU the
  place for an emulated capture, the KV cache exists);
* ``shutdown``: before ``Worker.shutdown`` runs.

A listener's exception is logged and swallowed (fail open): tracing never breaks the engine,
unless ``GRAPHTRACE_STRICT=1``.
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

__all__ = [
    "EVENTS", "add_listener", "remove_listener", "install", "uninstall", "worker_model",
    "worker_rank"
]

logger = logging.getLogger("graphtrace.vllm")

EVENTS = ("before_load", "after_load", "after_warmup", "shutdown")
_listeners: dict[str, list[Callable]] = {e: [] for e in EVENTS}
_lock = threading.RLock()
_patched: set[str] = set()

# module -> (class name, method name, events before, events after)
_TARGETS = {
    "vllm.v1.worker.gpu_worker": [
        ("Worker", "load_model", "before_load", "after_load"),
        ("Worker", "compile_or_warm_up_model", None, "after_warmup"),
        ("Worker", "shutdown", "shutdown", None),
    ],
    "vllm.v1.worker.cpu_worker": [
        # CPUWorker overrides compile_or_warm_up_model (and not the other two)
        ("CPUWorker", "compile_or_warm_up_model", None, "after_warmup"),
    ],
}


def add_listener(event: str, fn: Callable) -> None:
    if event not in _listeners:
        raise ValueError(f"unknown event {event!r}; events: {', '.join(EVENTS)}")
    with _lock:
        if fn not in _listeners[event]:
            _listeners[event].append(fn)
    install()


def remove_listener(event: str, fn: Callable) -> None:
    with _lock:
        if fn in _listeners[event]:
            _listeners[event].remove(fn)


def _strict() -> bool:
    return os.environ.get("GRAPHTRACE_STRICT") == "1"


def _fire(event: str, worker) -> None:
    for fn in list(_listeners[event]):
        try:
            fn(worker)
        except Exception:
            if _strict():
                raise
            logger.exception("graphtrace: %s listener %r failed (ignored)", event, fn)


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
        try:
            if outer and before:
                _fire(before, self)
            result = original(self, *args, **kwargs)
            if outer and after:
                _fire(after, self)
            return result
        finally:
            if outer:
                self.__dict__.pop(key, None)

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
            cls = getattr(module, cls_name, None)
            if cls is not None:
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
                cls = getattr(module, cls_name, None)
                fn = cls.__dict__.get(method) if cls is not None else None
                if fn is not None and getattr(fn, "__graphtrace_wrapped__", False):
                    setattr(cls, method, fn.__graphtrace_original__)
            _patched.discard(name)
        if _finder is not None and _finder in sys.meta_path:
            sys.meta_path.remove(_finder)
        _finder = None
        for lst in _listeners.values():
            lst.clear()


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
