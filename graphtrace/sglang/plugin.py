"""graphtrace as an SGLang general plugin: tracing in the process that holds the model.

Declared in pyproject.toml::

    [project.entry-points."sglang.srt.plugins"]
    graphtrace = "graphtrace.sglang.plugin:register"

SGLang (0.5.23) calls ``load_plugins()`` first thing in every process it starts: ``Engine``
(the client), each scheduler (``run_scheduler_process``: it holds the model runner), the
detokenizer, the data-parallel controller; then ``HookRegistry.apply_hooks()`` patches the
registered targets. ``register()`` does nothing unless ``GRAPHTRACE_SGLANG`` is ``1`` or
``guard`` (graphtrace/sglang/env.py); when on it registers SGLang hooks (its own plugin
mechanism, `sglang.srt.plugins.hook_registry`), which act only in the process that loads a
model:

1. around ``ModelRunner.load_model``: an `SglangSession` (graphtrace/sglang/session.py) opens
   its trace before the load and watches the model after it;
2. after ``ModelRunner.init_cuda_graphs``: the graphs SGLang captured are in the trace; where
   it captured none (CPU), the emulated decode graphs are recorded
   (``GRAPHTRACE_SGLANG_EMULATE``);
3. guard mode (``GRAPHTRACE_SGLANG=guard``): SGLang's weight-update entry points
   (``SchedulerWeightUpdaterManager``: begin/end of a session, tensor, distributed, IPC and disk
   updates, memory release/resume) begin and end updates in the serving core; one check per
   update, when ``end_weight_update``, ``update_weights_from_disk`` or
   ``resume_memory_occupation`` return, else before the next request is served. A stale update
   answers as SGLang does: ``success=False`` with the `StaleGraphError` text (Note [fail
   closed, SGLang's way]);
4. ``engine.collective_rpc("graphtrace_write_report", tag=...)`` writes the scheduler's diff
   to ``$GRAPHTRACE_SGLANG_DIR/<tag>/rank<R>/`` (``graphtrace report`` reads it).

``GRAPHTRACE_GUARD`` gives the guard's action (``raise``, ``warn``, ``recapture``); checks go
to ``$GRAPHTRACE_SGLANG_DIR/guard/rank<R>/checks.jsonl``. ``GRAPHTRACE_STRICT=1`` raises
internal errors instead of failing open.
"""

from __future__ import annotations

import logging
import os
import threading

from graphtrace.serving import strict
from graphtrace.sglang import env
from graphtrace.sglang.session import COMPLETE_UPDATES, UPDATE_BEGINS, SglangSession, tp_rank

logger = logging.getLogger("graphtrace.sglang")

__all__ = ["register", "session", "write_report", "SCHEDULER_METHODS"]

RUNNER = "sglang.srt.model_executor.model_runner.ModelRunner"
UPDATER = "sglang.srt.managers.scheduler_components.weight_updater.SchedulerWeightUpdaterManager"
SCHEDULER = "sglang.srt.managers.scheduler.Scheduler"

_session: SglangSession | None = None
_lock = threading.RLock()
_registered = False

# Note [fail closed, SGLang's way]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# SGLang's RL clients (slime, AReaL, verl, OpenRLHF) read an update's answer: `success` and
# `message` of EndWeightUpdateReqOutput / UpdateWeightFromDiskReqOutput. So a check that finds
# stale graphs when such an entry point returns turns its answer into success=False with the
# StaleGraphError's text (under GRAPHTRACE_GUARD=raise). Until a correct update passes, every
# request entering the scheduler's queue is finished at once with SGLang's own abort
# (`Req.set_finish_with_abort`: the client gets finish_reason "abort" with the same text; the
# request runs no decode step). resume_memory_occupation has no success field: its refusal
# shows at the next request.


def session() -> SglangSession | None:
    """This process's session (None where no model was loaded under the plugin)."""
    return _session


def register() -> None:
    """The ``sglang.srt.plugins`` entry point. Cheap and idempotent; off by default."""
    global _registered
    if not env.enabled():
        return
    with _lock:
        if _registered:
            return
        _registered = True
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(f"{RUNNER}.load_model", _around_load, HookType.AROUND)
    HookRegistry.register(f"{RUNNER}.init_cuda_graphs", _around_graphs, HookType.AROUND)
    if env.guard_mode():
        for name in dict.fromkeys(UPDATE_BEGINS + COMPLETE_UPDATES):
            HookRegistry.register(f"{UPDATER}.{name}", _update_hook(name), HookType.AROUND)
        HookRegistry.register(f"{SCHEDULER}._add_request_to_queue", _before_enqueue,
                              HookType.BEFORE)
    logger.info("graphtrace: SGLang plugin registered in pid %d", os.getpid())


def _guarded(where: str, fn, *args):
    """Fail open: an internal error is recorded and logged, unless strict."""
    try:
        return fn(*args)
    except Exception:
        if strict():
            raise
        logger.exception("graphtrace: %s failed (fail open)", where)
        return None


def _open(runner) -> None:
    global _session
    with _lock:
        if _session is not None:
            return
        guard = env.guard_action if env.guard_mode() else None
        rank = tp_rank(runner)
        _session = SglangSession(guard=guard, folder=lambda: env.guard_folder(rank),
                                 batch_sizes=env.emulated_batch_sizes())
        _add_scheduler_methods()


def _around_load(original, runner, *args, **kwargs):
    _guarded("opening the trace", _open, runner)
    out = original(runner, *args, **kwargs)
    if _session is not None:
        _guarded("watching the model", _session.model_loaded, runner)
    return out


def _around_graphs(original, runner, *args, **kwargs):
    out = original(runner, *args, **kwargs)
    if _session is not None:
        _guarded("recording the graphs", _session.graphs_captured, runner)
    return out


def _update_hook(name: str):
    def around(original, manager, *args, **kwargs):
        if _session is not None and name in UPDATE_BEGINS:
            _guarded(f"beginning {name}", _session.update_begin, name)
        out = original(manager, *args, **kwargs)
        if _session is not None and name in COMPLETE_UPDATES:
            refused = _guarded(f"checking {name}", _session.update_end, name)
            if refused and getattr(out, "success", False):
                out = _failed(out, refused)
        return out
    around.__name__ = f"graphtrace_{name}"
    return around


def _failed(answer, message: str):
    """SGLang's answer with success=False and the refusal's text."""
    import msgspec

    return msgspec.structs.replace(answer, success=False, message=message)


def _before_enqueue(scheduler, req, *args, **kwargs):
    if _session is None:
        return None
    refused = _guarded("checking before serving", _session.refusal)
    if refused:
        req.set_finish_with_abort(refused, err_type="StaleGraphError")
    return None


# -- reports: engine.collective_rpc("graphtrace_write_report", tag=...) -------------------------

def write_report(scheduler=None, tag: str = "report") -> str:
    """Diff this process's trace against the live model into
    ``$GRAPHTRACE_SGLANG_DIR/<tag>/rank<R>/``; returns the folder."""
    if _session is None:
        raise RuntimeError("graphtrace: the SGLang plugin is not tracing this process "
                           f"(set {env.ENV_ON}=1 before the engine starts)")
    folder = env.out_dir() / tag / f"rank{_session.rank()}"
    return str(_session.write_report(folder))


def _rpc_write_report(self, tag: str = "report") -> None:
    write_report(self, tag)


SCHEDULER_METHODS = {"graphtrace_write_report": _rpc_write_report}


def _add_scheduler_methods() -> None:
    """``engine.collective_rpc(name, ...)`` calls ``getattr(scheduler, name)``."""
    import sys

    module = sys.modules.get(SCHEDULER.rsplit(".", 1)[0])
    cls = getattr(module, "Scheduler", None) if module is not None else None
    if cls is None:
        return
    for name, fn in SCHEDULER_METHODS.items():
        if not hasattr(cls, name):
            setattr(cls, name, fn)
