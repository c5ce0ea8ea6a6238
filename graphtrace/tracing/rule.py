"""The recording rule: when a trace's provenance and lineage record, and module attribution
with them (Note [recording while serving])."""

from __future__ import annotations

import contextlib
import threading
import weakref
from typing import TYPE_CHECKING

import torch

from graphtrace.errors import GraphtraceError

if TYPE_CHECKING:
    from graphtrace.tracing.session import Trace

__all__ = ["RECORD", "RecordingRule"]

RECORD = ("auto", "always")  # when provenance and lineage record: Note [recording while serving]


# Note [recording while serving]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# Provenance and lineage (one dispatch mode on the tracing thread: Note [provenance]) cost a
# dispatch per op, which a model that serves while its trace stays open should not pay. So
# under `record="auto"` (the default of `graphtrace.trace`) they record while the model is
# built, loaded, processed and captured, and around weight updates, and pause while it
# serves. The rule, on the thread that opened the trace:
#
# - they PAUSE when a watched model's forward begins outside capture regions once the trace
#   has a graph (a forward pre-hook on each watched model; not inside compiled code, which
#   Dynamo inlines). Code between a capture and the model's next forward -- a reload right
#   after capturing, a guard built, a diff -- is still recorded;
# - they RESUME when an update begins: `load_state_dict` on a watched model (a pre-hook), or
#   a parameter or buffer registered on any module (torch's global registration hooks:
#   `register_parameter`, assigning an `nn.Parameter`, `register_buffer`: what vLLM-style
#   reloads do when they rebuild a layer's tensors), and record until the next forward;
# - `with t.updating(): ...` records inside the block whatever came before, and a forward
#   inside it does not pause them.
#
# An update that begins with none of these signals after the model served -- values written
# in place (`p.data.copy_(new)`, `p.copy_(new)`), `p.data = new`, `torch.utils.swap_tensors`,
# a plain tensor attribute set -- is not recorded: its new tensors read `not recorded`, and
# freshness falls back to version counters (Note [lineage]), which `.data` writes do not
# bump. Wrap such an update in `t.updating()`, or open the trace with `record="always"`
# (record whenever the trace is open, as before this rule). Steering by hand takes over:
# after `t.pause_provenance()` or `t.resume_provenance()` (and `t.provenance_paused()`, made
# of them) the rule no longer pauses or resumes anything in that trace. The vLLM adapter
# opens its trace with `record="always"` and steers by hand from vLLM's own warm-up and
# update hooks (`pause_provenance=True`). A CUDA graph's replay is not a signal (serving
# that only replays graphs runs no op through the mode; eager ops around the replays do,
# until a watched model's forward). Module attribution pauses with them, and the serve hooks
# come off meanwhile, so a serving forward passes no graphtrace code (Note [attribution while
# serving] in graphtrace/attribution.py). Cost: docs/performance.md, "A trace open while the
# model serves".


class RecordingRule:
    """The recording rule of a `Trace` (a part of it): Note [recording while serving]."""

    def _rule_on(self) -> bool:
        return self.provenance is not None and self.record == "auto"

    def _install_update_hooks(self) -> None:
        """The signals of Note [recording while serving]; removed at exit."""
        if not self._rule_on():
            return
        from torch.nn.modules.module import (
            register_module_buffer_registration_hook,
            register_module_parameter_registration_hook,
        )

        registered = _RuleHook(self, "update")
        self._global_hooks = [register_module_parameter_registration_hook(registered),
                              register_module_buffer_registration_hook(registered)]
        for name, model in self.models.items():
            self._hook_model(name, model)

    def _hook_model(self, name: str, model: torch.nn.Module) -> None:
        if not self._rule_on():
            return
        for handle in self._model_hooks.pop(name, ()):
            handle.remove()
        self._model_hooks[name] = [
            model.register_load_state_dict_pre_hook(_RuleHook(self, "update"))]
        old = self._serve_hooks.pop(name, None)
        if old is not None:
            old.remove()
        if not self._auto_paused:
            self._serve_hooks[name] = model.register_forward_pre_hook(
                _RuleHook(self, "serve"), prepend=True)

    def _hook_serving(self, on: bool) -> None:
        """The forward pre-hooks that pause the rule: on while it records, off while paused,
        so that a serving forward passes no hook (Note [attribution while serving])."""
        if not on:
            for handle in self._serve_hooks.values():
                handle.remove()
            self._serve_hooks.clear()
            return
        for name, model in self.models.items():
            if name not in self._serve_hooks:
                self._serve_hooks[name] = model.register_forward_pre_hook(
                    _RuleHook(self, "serve"), prepend=True)

    def _remove_update_hooks(self) -> None:
        for handle in self._global_hooks:
            handle.remove()
        self._global_hooks = []
        for handles in self._model_hooks.values():
            for handle in handles:
                handle.remove()
        self._model_hooks.clear()
        self._hook_serving(False)
        self._auto_paused = False

    def _attribution_on(self) -> None:
        """Module attribution back on (an update began, the rule was taken over by hand)."""
        try:
            self._attribution.resume()
        except Exception as exc:  # fail open: attribution off costs names, never the engine
            self.recorder.fail("module attribution resume", exc)

    def _attribution_off(self) -> None:
        """The rule paused: module attribution off too, unless a capture is open (on any
        thread); the last one to close turns it off then (Note [attribution while serving])."""
        with self._capturing_lock:
            if self._capturing or not self._auto_paused:
                return
            try:
                self._attribution.pause()
            except Exception as exc:
                self.recorder.fail("module attribution pause", exc)

    def _capture_opens(self) -> list[int]:
        """A capture region opens on this thread: attribution on for it, and the watched
        modules already running put on this thread's module stack (what `seed` found)."""
        with self._capturing_lock:
            self._capturing += 1
            if self._attribution.paused:
                self._attribution_on()
        try:
            return self._attribution.seed()
        except Exception as exc:
            self.recorder.fail("module attribution seed", exc)
            return []

    def _capture_closes(self, seeded: list[int]) -> None:
        self._attribution.unseed(seeded)
        with self._capturing_lock:
            self._capturing -= 1
        self._attribution_off()

    def _serving(self) -> None:
        """A watched model's forward began: the rule's pause (Note [recording while serving])."""
        p = self.provenance
        if (p is None or self.record != "auto" or self._manual or not self._open
                or self._updating
                or p.suspended or not self.recorder.captures
                or p.thread != threading.get_ident() or self._open_region() is not None
                or self._cuda_regions):
            return
        try:
            p.suspend()
            self._auto_paused = p.suspended
        except Exception as exc:  # fail open: recording on costs time, never the engine
            self.recorder.fail("provenance pause", exc)
        if self._auto_paused:  # Note [attribution while serving]
            self._hook_serving(False)
            self._attribution_off()

    def _update_begins(self) -> None:
        """An update began (Note [recording while serving]): undo the rule's pause."""
        p = self.provenance
        if (p is None or not self._auto_paused or self._manual
                or p.thread != threading.get_ident()):
            return
        try:
            p.unsuspend()
            self._auto_paused = False
        except Exception as exc:
            self.recorder.fail("provenance resume", exc)
        self._rule_records()

    def _rule_records(self) -> None:
        """The rule's pause is over: attribution and the serve hooks back on."""
        self._attribution_on()
        self._hook_serving(self._rule_on() and not self._manual)

    @contextlib.contextmanager
    def updating(self):
        """``with t.updating(): update(model)``: provenance and lineage record inside the
        block, paused or not before it, and a watched model's forward inside it does not
        pause them. After it, a pause made by `pause_provenance()` is restored; otherwise
        they record until the model serves again. For an update graphtrace cannot see begin
        (Note [recording while serving]). Call on the thread that opened the trace."""
        if not self._open:
            raise GraphtraceError("t.updating() needs the trace open: use it inside "
                                  "`with graphtrace.trace(...) as t:`")
        p = self.provenance
        if p is not None:
            self._check_thread("updating")
        user_paused = p is not None and p.suspended and self._manual
        self._updating += 1
        if p is not None and p.suspended:
            self._auto_paused = False
            p.unsuspend()
            self._rule_records()
        try:
            yield self
        finally:
            self._updating -= 1
            if not self._updating and p is not None and self._open and user_paused:
                p.suspend()

    @property
    def provenance_recording(self) -> bool:
        """Is provenance on and not paused (its dispatch mode on the opening thread)?"""
        p = self.provenance
        return p is not None and self._open and not p.suspended

    def pause_provenance(self) -> None:
        """Stop noting creation sites (an engine's steady state: its eager forwards then run
        without provenance's dispatch mode); idempotent. Storages made meanwhile read
        ``not recorded``. From then on provenance is steered by hand (the rule of Note
        [recording while serving] stops). Call on the thread that opened the trace."""
        if self.provenance is not None and self._open:
            self._check_thread("pause_provenance")
            self.provenance.suspend()
            self._auto_paused = False
            self._manual = True  # steered by hand from now on: Note [recording while serving]
            self._attribution_on()

    def resume_provenance(self) -> None:
        """Note creation sites again after `pause_provenance` (around a weight update); steered
        by hand from then on, as after `pause_provenance`."""
        if self.provenance is not None and self._open:
            self._check_thread("resume_provenance")
            self.provenance.unsuspend()
            self._auto_paused = False
            self._manual = True
            self._attribution_on()

    @contextlib.contextmanager
    def provenance_paused(self):
        """``with t.provenance_paused(): ...``: no creation sites noted inside the block."""
        was = self.provenance_recording
        self.pause_provenance()
        try:
            yield self
        finally:
            if was:
                self.resume_provenance()

    def _check_thread(self, what: str) -> None:
        if self.provenance.thread not in (None, threading.get_ident()):
            raise GraphtraceError(f"{what}() must run on the thread that opened the trace "
                                  "(provenance's dispatch mode lives on that thread's stack)")


class _RuleHook:
    """A hook of Note [recording while serving]: "update" (an update begins) or "serve" (a
    forward begins). Holds its trace weakly; pickled or copied with a model, it becomes
    `_no_hook` (a copy of a watched model is not watched)."""

    __slots__ = ("trace", "kind")

    def __init__(self, trace: "Trace", kind: str):
        self.trace = weakref.ref(trace)
        self.kind = kind

    def __call__(self, *args):
        trace = self.trace()
        if trace is None:
            return None
        if self.kind == "update":
            if trace._auto_paused:
                trace._update_begins()
        elif not trace._auto_paused and not torch.compiler.is_compiling():
            trace._serving()  # not under Dynamo, which inlines hooks
        return None

    def __reduce__(self):
        return (_inert_hook, ())


def _no_hook(*args) -> None:
    return None


def _inert_hook():
    return _no_hook
