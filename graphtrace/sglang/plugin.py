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

from graphtrace.errors import GraphtraceError
from graphtrace.serving import strict
from graphtrace.sglang import contract, env, releases
from graphtrace.sglang.session import SglangSession, tp_rank

logger = logging.getLogger("graphtrace.sglang")

__all__ = ["register", "session", "write_report", "SCHEDULER_METHODS", "unguarded",
           "hook_targets", "unguarded_targets", "add_unguarded"]

_session: SglangSession | None = None
_lock = threading.RLock()
_registered = False
_release: releases.Release | None = None
_unguarded: list[str] = []  # what register() could not hook (Note [a target gone at plugin load])

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
    global _registered, _release
    if not env.enabled():
        return
    with _lock:
        if _registered:
            return
        _registered = True
        _release, note = releases.running()
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    hooks = hook_targets(_release, guard=env.guard_mode())
    missing = unguarded_targets(_release, hooks, note)
    if missing and strict():
        raise GraphtraceError("graphtrace cannot hook SGLang (GRAPHTRACE_STRICT=1):\n  "
                              + "\n  ".join(missing))
    for line in missing:
        logger.error("graphtrace: %s", line)
    for role, (target, hook) in hooks.items():
        if target is None or any(f"[{role}]" in line for line in missing):
            continue  # SGLang's apply_hooks would only log a traceback for it
        kind = HookType.BEFORE if target.hook == "before" else HookType.AROUND
        HookRegistry.register(target.dotted, hook, kind)
    logger.info("graphtrace: SGLang plugin registered in pid %d (SGLang %s row)", os.getpid(),
                _release.version)


def hook_targets(rel: releases.Release, guard: bool) -> dict:
    """role -> (target, graphtrace's hook) that ``register`` installs for ``rel``."""
    out = {"load_model": (rel.target("load_model"), _around_load),
           "init_cuda_graphs": (rel.target("init_cuda_graphs"), _around_graphs)}
    if guard:
        for name in dict.fromkeys(rel.update_begins + rel.complete_updates):
            out[f"update:{name}"] = (rel.target(f"update:{name}"), _update_hook(name))
        out["enqueue"] = (rel.target("enqueue"), _before_enqueue)
    return out


def unguarded_targets(rel: releases.Release, hooks: dict, note: str | None = None) -> list[str]:
    """What ``register`` will not hook, one line each naming the SGLang target (module, class,
    attribute) and the release; the note of a release not in the table first. Kept for the
    session's blind spots (`unguarded`)."""
    lines = [f"SGLang {rel.version} has no hook target for {role}"
             for role, (target, _hook) in hooks.items() if target is None]
    wanted = {r: t for r, (t, _h) in hooks.items() if t is not None}
    lines += [f"{problem}: not hooked" for problem in contract.check_targets(wanted)]
    lines = ([note] if note else []) + lines
    _unguarded.extend(line for line in lines if line not in _unguarded)
    return lines


def add_unguarded(line: str) -> None:
    """Another entry point's target that was not hooked (graphtrace/sglang/compiled.py)."""
    if line not in _unguarded:
        _unguarded.append(line)
    if _session is not None:
        _session.trace.add_blind_spot(f"graphtrace cannot guard: {line}")


def unguarded() -> list[str]:
    """What this process's plugin could not hook (empty: every target of the row)."""
    return list(_unguarded)


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
                                 batch_sizes=env.emulated_batch_sizes(), release=_release)
        for line in _unguarded:  # fail open, said in the report (releases.py's Note)
            _session.trace.add_blind_spot(f"graphtrace cannot guard: {line}")
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
        if _session is not None and name in _session.release.update_begins:
            _guarded(f"beginning {name}", _session.update_begin, name)
        out = original(manager, *args, **kwargs)
        if _session is not None and name in _session.release.complete_updates:
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
        req.set_finish_with_abort(refused, **_session.release.abort_kwargs)
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

    target = (_release or releases.running()[0]).target("scheduler")
    module = sys.modules.get(target.module)
    cls = getattr(module, target.qualname, None) if module is not None else None
    if cls is None:
        return
    for name, fn in SCHEDULER_METHODS.items():
        if not hasattr(cls, name):
            setattr(cls, name, fn)
