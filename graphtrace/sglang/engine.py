"""`trace_engine()`: graphtrace on SGLang engines started in this (client) process.

SGLang's ``Engine`` runs the model in a scheduler process it spawns, which inherits this
process's environment and loads the plugins installed in it: `trace_engine` sets the
plugin's switches (graphtrace/sglang/env.py) for the engines started inside its block,
restores them after, and reads what the schedulers wrote under its folder: the guard's
checks (``guard/rank<R>/checks.jsonl``) and the reports it asks for
(``engine.collective_rpc("graphtrace_write_report")``: ``<tag>/rank<R>/``, a folder
``graphtrace report`` reads).
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

from graphtrace.errors import GraphtraceError
from graphtrace.serving import ACTIONS
from graphtrace.sglang import env

__all__ = ["EngineTrace", "trace_engine", "plugin_installed"]

ENTRY_GROUP = "sglang.srt.plugins"
ENTRY_NAME = "graphtrace"


def plugin_installed() -> bool:
    """Is graphtrace's entry point visible to SGLang's ``load_plugins`` (graphtrace installed
    in the environment, e.g. ``pip install --no-deps -e .``)?"""
    from importlib.metadata import entry_points

    return any(ep.name == ENTRY_NAME and ep.value.startswith("graphtrace.sglang")
               for ep in entry_points(group=ENTRY_GROUP))


class EngineTrace:
    """The switches of the SGLang plugin for the engines started inside the block, and the
    folder their schedulers write to. ``guard``: the guard's action (``raise``, ``warn``,
    ``recapture``) or None (trace only). ``batch_sizes``: the emulated decode graphs where
    SGLang captures none (CPU)."""

    def __init__(self, folder: str | os.PathLike | None = None, *, guard: str | None = "raise",
                 batch_sizes: tuple[int, ...] | None = None):
        if guard is not None and guard not in ACTIONS:
            raise ValueError(f"guard {guard!r} is not one of {', '.join(ACTIONS)}")
        self.folder = Path(folder) if folder is not None else \
            Path(tempfile.mkdtemp(prefix="graphtrace-sglang-"))
        self.guard = guard
        self.batch_sizes = batch_sizes
        self._saved: dict[str, str | None] = {}

    def _switches(self) -> dict[str, str]:
        out = {env.ENV_ON: "guard" if self.guard is not None else "1",
               env.ENV_DIR: str(self.folder.resolve())}
        if self.guard is not None:
            out[env.ENV_GUARD] = self.guard
        if self.batch_sizes is not None:
            out[env.ENV_EMULATE] = ",".join(map(str, self.batch_sizes)) or "0"
        return out

    def __enter__(self) -> "EngineTrace":
        if not plugin_installed():
            raise GraphtraceError(
                "graphtrace's SGLang plugin is not installed in this environment (entry point "
                f"group {ENTRY_GROUP!r}): install graphtrace into it (`pip install --no-deps "
                "-e .`), so that SGLang's scheduler process loads it")
        for key, value in self._switches().items():
            self._saved[key] = os.environ.get(key)
            os.environ[key] = value
        return self

    def __exit__(self, *exc) -> None:
        for key, value in self._saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        self._saved.clear()

    # -- what the schedulers wrote -------------------------------------------------------------
    def checks(self, rank: int = 0) -> list[dict]:
        """The guard's checks of one scheduler, oldest first (``checks.jsonl``)."""
        path = self.folder / "guard" / f"rank{rank}" / "checks.jsonl"
        if not path.exists():
            return []
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]

    def write_report(self, engine, tag: str = "report", rank: int = 0) -> Path:
        """Ask the engine's schedulers for their diff now; the folder of ``rank``."""
        engine.collective_rpc("graphtrace_write_report", tag=tag)
        return self.folder / tag / f"rank{rank}"


def trace_engine(folder: str | os.PathLike | None = None, *, guard: str | None = "raise",
                 batch_sizes: tuple[int, ...] | None = None) -> EngineTrace:
    """``with trace_engine(folder) as st: engine = sglang.Engine(...)``: see `EngineTrace`."""
    return EngineTrace(folder, guard=guard, batch_sizes=batch_sizes)
