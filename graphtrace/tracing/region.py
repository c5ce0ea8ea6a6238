"""A capture region: one open capture on one thread (an emulated `gt.capture` or a CUDA graph
capture), the recording mode pushed for it, its records, maybe a replayable graph."""

from __future__ import annotations

from typing import TYPE_CHECKING

from graphtrace.recorder import RecordingMode
from graphtrace.tracing.emulated import EmulatedGraph

if TYPE_CHECKING:
    from graphtrace.tracing.session import Trace

__all__: list[str] = []


class _Region:
    __slots__ = ("trace", "capture", "mode", "graph", "first_storage", "paused", "seeded")

    def __init__(self, trace: "Trace", label: str | None, kind: str, emulate: bool):
        self.trace = trace
        self.first_storage = len(trace.recorder.storages)
        self.capture = trace.recorder.new_capture(label, kind)
        self.graph = EmulatedGraph(self.capture.label, trace.recorder.native) if emulate else None
        if self.graph is not None:
            self.graph.capture = self.capture
        self.mode = RecordingMode(trace.recorder, self.capture, self.graph)
        self.paused = None
        self.seeded: list[int] | None = None

    def open(self) -> None:
        self.seeded = self.trace._capture_opens()  # Note [attribution while serving]
        try:
            provenance = self.trace.provenance  # never runs under a capture: Note [provenance]
            self.paused = provenance.pause() if provenance is not None else None
            self.mode.__enter__()
        except BaseException:
            self.trace._capture_closes(self.seeded)
            self.seeded = None
            raise

    def close(self) -> None:
        self.mode.__exit__(None, None, None)
        if self.seeded is not None:
            self.trace._capture_closes(self.seeded)
            self.seeded = None
        if self.trace.provenance is not None:
            self.trace.provenance.resume(self.paused)
        self.mode.finish()
        if self.graph is not None:
            self.graph.seal()  # lets go of its intermediates: Note [Emulated graphs keep storages]
        self.trace.recorder.storages.sweep(self.first_storage)  # its dead intermediates
        try:
            self.trace._after_capture()
            if self.graph is not None:
                self.trace._note_scalars(self.capture.label, self.graph)
        finally:
            self.trace.recorder.unpin(self.capture)
