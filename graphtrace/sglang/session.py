"""graphtrace in the SGLang process that holds the model (the scheduler), on the serving core.

One `SglangSession` per scheduler process (graphtrace/sglang/plugin.py makes it): its trace
opens before ``ModelRunner.load_model`` (so loading and SGLang's weight processing are
recorded: provenance and lineage), the model is watched right after it under SGLang's own
parameter names, and graphs are recorded where SGLang captures them: its CUDA graph runners on
GPU (the trace records every CUDA graph captured while it is open), and on CPU, where SGLang
captures none with ``disable_cuda_graph``, one emulated graph per decode batch size of
SGLang's own dummy decode run (``BaseRunner._dummy_run``: what the decode graph runner runs
under each capture), right after ``init_cuda_graphs`` (Note [emulated decode graphs]).

With a guard (``GRAPHTRACE_SGLANG=guard``) the session is the serving core's engine
(`graphtrace.serving.ServedEngine`) and the plugin's hooks fire the core's events: SGLang's
update entry points begin and end updates (`update_begin`, `update_end`), and a request
entering the scheduler's queue runs the pending check first (`refusal`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from pathlib import Path
from typing import Callable

import graphtrace as gt
from graphtrace.serving import Ranks, ServingCore, pending, strict
from graphtrace.sglang import releases

logger = logging.getLogger("graphtrace.sglang")

__all__ = ["SglangSession", "tp_ranks", "tp_rank", "sglang_object"]

# The SGLang names used here (the dummy decode run, the TP group, the runtime context) and the
# update entry points that begin and end an update are the release's row:
# graphtrace/sglang/releases.py.


# Note [emulated decode graphs]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# On GPU SGLang's DecodeCudaGraphRunner captures, per decode batch size, the model's forward
# over its static buffers (its attention metadata is set up outside the graph). On CPU with
# disable_cuda_graph nothing is captured; graphtrace records instead, at the same point (after
# ModelRunner.init_cuda_graphs), SGLang's own dummy decode run for each batch size
# (`_dummy_run` of the eager runner over its decode-shaped dummy buffers, the warm-up forward
# SGLang runs on GPU), with only the model's forward inside the capture region, as a graph
# would hold it. The emulated graphs keep the storages they read alive, as a CUDA graph's
# capture artifacts do, so an owner rebound by an update reads `stale`, not `dangling`.


class SglangSession:
    """A trace of one SGLang model runner, and its serving core when guarded (module doc).

    ``guard``: None (trace only) or the core's action (a string or a callable returning one).
    ``folder``: a callable giving the guard's folder. ``batch_sizes``: the decode batch sizes
    emulated where SGLang captures no graph. ``release``: the SGLang row (None: the installed
    release's, or the newest row for one not in the table).
    """

    def __init__(self, *, guard: str | Callable[[], str] | None = None,
                 folder: Callable[[], Path | None] | None = None,
                 batch_sizes: tuple[int, ...] = (1, 2), modules: str = "forward",
                 release: releases.Release | None = None):
        self.release = release or releases.running()[0]
        self._trace = gt.trace(strict=strict(), modules=modules, record="always")
        self._trace.__enter__()
        self._thread = threading.get_ident()
        self.runner = None
        self.model = None
        self.graphs: list = []         # the emulated graphs, kept like capture artifacts
        self.batch_sizes = tuple(batch_sizes)
        self._rank = 0
        self.core = ServingCore(self, guard, folder, complete=self.release.complete_updates,
                                collective=tp_ranks, every_rank_raises=True, log=logger) \
            if guard is not None else None

    # -- the serving core's engine (graphtrace.serving.ServedEngine) -------------------------
    @property
    def trace(self):
        return self._trace

    def rank(self) -> int:
        return self._rank

    def cannot_recapture(self, captures: list) -> str | None:
        """Only the emulated graphs of SGLang's eager dummy decode run (CPU, no graph runner)
        can be recorded again as the engine runs them; for any other capture, why not (Note
        [recapture that cannot help] in graphtrace/serving.py)."""
        compiled = [c.label for c in captures if c.info.get("sglang_cpu_graph")]
        if compiled:
            return (f"SGLang's CPUGraphRunner compiled {', '.join(compiled)} with Inductor "
                    "freezing (the weights are constants inside its compiled code) and SGLang "
                    "0.5.23 never re-captures on CPU; re-recording SGLang's eager dummy decode "
                    "would not rebuild what the runner replays")
        cuda = [c.label for c in captures if c.kind == "cuda"]
        if cuda:
            return (f"SGLang's CUDA graph runners captured {', '.join(cuda)} and re-capture "
                    "them only inside update_weights_from_disk(recapture_cuda_graph=True); "
                    "graphtrace cannot re-capture them")
        other = [c.label for c in captures if not c.info.get("dummy_run")]
        if other:
            return (f"{', '.join(other)} were not recorded from SGLang's eager dummy decode "
                    "run, the only graphs graphtrace can record again")
        if self.runner is None:
            return "no SGLang model runner is watched"
        return None

    def recapture(self, captures: list) -> bool:
        """``GRAPHTRACE_GUARD=recapture``: the emulated decode graphs are recorded again on
        the updated model (only those: `cannot_recapture`)."""
        if self.cannot_recapture(captures) is not None:
            return False
        sizes = [c.info["batch_size"] for c in captures if "batch_size" in c.info]
        self.graphs.clear()
        for bs in dict.fromkeys(sizes):
            self.capture_decode(bs)
        return True

    # -- the model and its graphs --------------------------------------------------------------
    def model_loaded(self, runner) -> None:
        """After ``ModelRunner.load_model``: watch its model (SGLang's parameter names)."""
        if self.runner is not None:  # a draft runner in the same process: watched beside it
            self._trace.watch(runner.model, name=f"runner{id(runner):x}")
            return
        self.runner, self.model = runner, runner.model
        self._rank = tp_rank(runner)
        self._trace.watch(runner.model, name="")
        if self.core is not None:
            self.core.watch_versions()  # Note [in-place writes] (graphtrace/serving.py)

    def graphs_captured(self, runner) -> None:
        """After ``ModelRunner.init_cuda_graphs``: where SGLang captured no decode graph,
        record the emulated ones (Note [emulated decode graphs]); then serving begins:
        provenance pauses until an update."""
        if runner is not self.runner:
            return
        decode = getattr(runner, "decode_cuda_graph_runner", None)
        if decode is None or decode is getattr(runner, "eager_runner", None):
            for bs in self.batch_sizes:
                try:
                    self.capture_decode(bs)
                except Exception as exc:
                    if strict():
                        raise
                    self._trace.record_error(f"sglang emulated decode capture (bs={bs})", exc)
        self._steer(self._trace.pause_provenance)

    def capture_decode(self, batch_size: int):
        """Record SGLang's dummy decode forward at ``batch_size`` as one emulated graph."""
        runner = self.runner
        eager = runner.eager_runner
        buffers, max_bs = _dummy_buffers(runner, self._method("autotune_buffers", eager))
        if batch_size > max_bs:
            raise ValueError(f"decode batch size {batch_size} > the eager runner's {max_bs}")
        model = runner.model
        forward = model.forward
        label = f"decode_bs{batch_size}"
        graphs: list = []

        def captured(*args, **kwargs):
            with gt.capture(label) as graph:
                out = forward(*args, **kwargs)
            graphs.append(graph)
            return out

        dummy_run = self._method("dummy_run", eager)
        context = self._method("model_context", eager)  # 0.5.23 on
        model.forward = captured  # the instance's: only this dummy run goes through it
        try:
            with context() if context is not None else contextlib.nullcontext():
                dummy_run(batch_size, buffers=buffers)
        finally:
            del model.forward
        if not graphs:
            raise RuntimeError("SGLang's dummy run did not call the model's forward")
        graphs[0].capture.info.update(batch_size=batch_size, dummy_run=True)
        self.graphs.extend(graphs)
        return graphs[0]

    def _method(self, role: str, instance):
        """``instance``'s method named by the row's ``role`` (None where the row has none);
        ``LookupError`` naming the target where SGLang lacks it."""
        if sglang_object(self.release, role) is None:
            return None
        return getattr(instance, self.release.target(role).qualname.rsplit(".", 1)[-1])

    # -- updates (the plugin's hooks call these) -----------------------------------------------
    def update_begin(self, method: str) -> None:
        """An SGLang update entry point starts: lineage records its writes (SGLang writes with
        ``param.data.copy_``, which moves no version counter), the core marks it."""
        self._steer(self._trace.resume_provenance)
        if self.core is not None:
            self.core.update_begin(method)

    def update_end(self, method: str) -> str | None:
        """An update entry point returned successfully: checked now when it ends an update.
        Returns the `StaleGraphError` text when the check refused it, else None."""
        try:
            if self.core is not None:
                self.core.update_end(method)
        except gt.StaleGraphError as exc:
            return str(exc)
        finally:
            if method in self.release.complete_updates:
                self._steer(self._trace.pause_provenance)
        return None

    def refusal(self) -> str | None:
        """Before a request is served: the pending check runs (once per update), and the
        standing refusal's text is returned (None: serve)."""
        core = self.core
        if core is None:
            return None
        try:
            if core in pending():
                core.check("before_forward")
        except gt.StaleGraphError:
            pass
        info = core.refusal_info()
        return info["message"] if info is not None else None

    def _steer(self, step) -> None:
        if threading.get_ident() != self._thread:
            return  # provenance belongs to the thread that opened the trace
        try:
            step()
        except gt.GraphtraceError:
            logger.debug("graphtrace: provenance not steered")

    # -- reports -------------------------------------------------------------------------------
    def diff(self):
        report = self._trace.diff()
        report.meta["sglang"] = {"pid": os.getpid(), "rank": self._rank,
                                 "graphs": [c.label for c in self._trace.captures],
                                 "guard": self.core.status() if self.core is not None else None}
        return report

    def write_report(self, folder: Path) -> Path:
        folder = Path(folder)
        self.diff().to_csv(folder)
        logger.info("graphtrace: wrote %s", folder)
        return folder

    def close(self) -> None:
        if self.core is not None:
            self.core.close()
        self._trace.__exit__(None, None, None)


def sglang_object(release: releases.Release, role: str):
    """The SGLang object the row names for ``role`` (None where the row has none). Raises
    ``LookupError`` naming the target where the running SGLang lacks it."""
    from graphtrace import targets

    target = release.target(role)
    if target is None:
        return None
    obj, problem = targets.resolve(target.module, target.qualname)
    if problem:
        raise LookupError(f"graphtrace: SGLang {release.version}'s {role}: {problem}")
    return obj


def tp_rank(runner=None) -> int:
    """This scheduler's tensor-parallel rank: SGLang 0.5.23 keeps it in its runtime context
    (``get_parallel().tp_rank``, the row's ``parallel``); older releases on the model
    runner."""
    try:
        return int(sglang_object(releases.running()[0], "parallel")().tp_rank or 0)
    except Exception:
        return int(getattr(runner, "tp_rank", 0) or 0)


def tp_ranks() -> Ranks | None:
    """The serving core's collective in SGLang: this scheduler's tensor-parallel group (its
    `GroupCoordinator`, the row's ``tp_group``: ``get_tp_group()``), agreeing through
    ``all_gather_object`` on the group's CPU (gloo) group; None with one rank or no
    distributed state. Every rank raises the agreed refusal (``every_rank_raises``): SGLang
    answers a client with rank 0's result, and every rank must abort the same requests, or
    their batches (and collectives) diverge."""
    try:
        group = sglang_object(releases.running()[0], "tp_group")()
    except Exception:  # no distributed state (a bare session, tests)
        return None
    if group is None or getattr(group, "world_size", 1) <= 1:
        return None
    return Ranks(group.rank_in_group, group.world_size, group.all_gather_object)


def _dummy_buffers(runner, autotune):
    """The eager runner's decode-shaped dummy buffers. An attention backend without CUDA-graph
    support (``torch_native``: CPU) has no seq-len fill value for them; a dummy decode's
    sequences are then one token long, the value SGLang's graph-capable backends use."""
    try:
        return autotune()
    except NotImplementedError:
        backend = runner.attn_backend
        backend.get_cuda_graph_seq_len_fill_value = lambda: 1
        try:
            return autotune()
        finally:
            del backend.get_cuda_graph_seq_len_fill_value
