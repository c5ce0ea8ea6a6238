"""Check before serve in vLLM: the adapter of the serving core (graphtrace.serving).

One implementation for the worker plugin (``GRAPHTRACE_VLLM=guard``) and the in-process
``graphtrace.vllm.trace_llm(guard="raise")``: a :class:`ServeGuard` (a
`graphtrace.serving.ServingCore`) belongs to one `VllmTrace`. This module supplies what is
vLLM's: the whole updates, the world group, and how a refusal reaches vLLM's clients (Note
[check before serve]).

Note [check before serve]
~~~~~~~~~~~~~~~~~~~~~~~~~
RL clients push weights through many doors (Note [weight updates] in graphtrace.vllm.hooks),
the model's ``load_weights`` once per tensor (TRL colocate; OpenRLHF's
``collective_rpc("update_weight")``) or per bucket (verl). A check after each call would run
inside the client's receive loop (a thousand checks per sync) and a raise there would leave the
model half-updated (and, in verl, be hidden as the ``__context__`` of its cleanup's error); the
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

In-place writes (a client's own ``p.copy_(new)``, no hooked entry point) are seen by the
parameters' version counters (Note [in-place writes] in graphtrace/serving.py) in the engine
core's pre-step test when the worker shares its process (one process; the default
single-worker executor with the engine core in its own process); workers in processes of
their own (tensor parallelism) rely on a ``collective_rpc`` marking the update pending.

When the dirty flag is cleared, and failing open: the graphtrace.serving module docstring.
"""

from __future__ import annotations

import logging
import weakref

from graphtrace import serving
from graphtrace.serving import ACTIONS, Ranks, ServingCore, strict
from graphtrace.vllm import hooks
from graphtrace.vllm.hooks import DRAIN

logger = logging.getLogger("graphtrace.vllm")

__all__ = ["ServeGuard", "VllmEngine", "ACTIONS", "GUARD_ACCEPT", "COMPLETE_UPDATES",
           "before_step", "drain_step", "DRAIN", "after_client_step", "client_step_failed",
           "client_stream", "mark_remote_update", "world_ranks", "REFUSED"]

# Blind-spot kinds the engine's guard accepts (Note [blind spots in the guard], graphtrace/guard/blind.py;
# the kinds: graphtrace/vllm/blind.py): "forward context": a weight update never touches the
# KV cache, and no holder can be checked, so it would fail every update. "opaque handle" and
# "packed copy": the handle's identity is guarded like any tensor (a rebuilt handle is a
# stale edge of the graph that read the old one), only the packed weights behind it are
# unseen, and process_weights_after_loading rebuilds every handle (the holder moves on each
# such update); "packed copy not rebuilt" is the check of those same copies, accepted with
# them. docs/vllm.md.
GUARD_ACCEPT = ("forward context", "opaque handle", "packed copy", "packed copy not rebuilt")
# Entry points that are a whole update by themselves: checked when they return.
COMPLETE_UPDATES = frozenset({"reload_weights", "finish_weight_update"})


class VllmEngine:
    """What the serving core asks of a `VllmTrace` (`graphtrace.serving.ServedEngine`),
    held weakly: its trace, the worker's rank, re-capturing its graphs (``vt.recapture``)."""

    def __init__(self, vt):
        self._vt = weakref.ref(vt)

    @property
    def trace(self):
        vt = self._vt()
        return vt.trace if vt is not None else None

    def rank(self) -> int:
        vt = self._vt()
        worker = vt.worker if vt is not None else None
        return hooks.worker_rank(worker) if worker is not None else 0

    def recapture(self, captures: list) -> bool:
        return self._vt().recapture(captures)


class ServeGuard(ServingCore):
    """The serving core (graphtrace.serving) of one guarded `VllmTrace`: its weight-update
    hooks (graphtrace.vllm.hooks) fire ``before_update`` / ``after_update`` into it; the whole
    updates are `COMPLETE_UPDATES`; the ranks agree over vLLM's world group (`world_ranks`).
    ``action`` and ``folder``: as `ServingCore`'s (the plugin reads ``GRAPHTRACE_GUARD`` at
    each check).
    """

    def __init__(self, vt, action="raise", folder=None):
        super().__init__(VllmEngine(vt), action, folder, accept=GUARD_ACCEPT,
                         complete=COMPLETE_UPDATES, collective=world_ranks, log=logger)


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
    local = serving.pending()
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
            if strict():
                raise
            logger.exception("graphtrace: checking the workers before a step failed (fail open)")
            core.__dict__["_graphtrace_pending"] = False
            return None
        refused = exc
    logger.error("graphtrace: refusing to serve until a correct weight update: %s", refused)
    outputs = _refuse(core, refused)
    core.__dict__["_graphtrace_refused"] = refused
    return outputs, False


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
        # an empty pooling output, as vLLM's abort does (v1/engine/output_processor.py,
        # abort_requests; why: Note [check before serve], 5.)
        pooled = torch.empty(0) if getattr(request, "pooling_params", None) is not None else None
        by_client[getattr(request, "client_index", 0)].append(EngineCoreOutput(
            request.request_id, [], finish_reason=FinishReason.ERROR, pooling_output=pooled,
            **error))
    return {client: EngineCoreOutputs(finished_requests={o.request_id for o in outs},
                                      outputs=outs)
            for client, outs in by_client.items()}


def after_client_step(llm_engine, outputs) -> None:
    """The client's ``LLMEngine.step``, after it processed the step's ``outputs``: raise the
    refusal of the step, the engine core's in process, else the workers' (Note [check before
    serve], 3. and 4.)."""
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
        if strict():
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
    caller iterates it (Note [check before serve], 5.)."""
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
    """`_ask_refusal` for an ``AsyncLLM``: one query for all the requests a step refused
    (Note [check before serve], 5.)."""
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
        if strict():
            raise
        logger.exception("graphtrace: asking the workers why a request failed (ignored)")
        return None
    return _refusal(answers)


# -- several ranks (Note [one rank raises] in graphtrace/vllm/plugin.py) -----------------------

def world_ranks() -> Ranks | None:
    """The serving core's collective in vLLM: the world group's ranks, agreeing through an
    all_gather_object over its CPU group; None with one rank (or no distributed state)."""
    group = _world_group()
    if group is None:
        return None

    def gather(value) -> list:
        import torch.distributed as dist

        gathered: list = [None] * group.world_size
        dist.all_gather_object(gathered, value, group=group.cpu_group)
        return gathered

    return Ranks(group.rank_in_group, group.world_size, gather)


def _world_group():
    try:
        from vllm.distributed.parallel_state import get_world_group

        group = get_world_group()
    except Exception:  # no distributed state (tests, a bare worker)
        return None
    return group if getattr(group, "world_size", 1) > 1 else None


hooks.serve_through(before_step=before_step, drain_step=drain_step,
                    mark_remote_update=mark_remote_update, after_client_step=after_client_step,
                    client_step_failed=client_step_failed, client_stream=client_stream)
