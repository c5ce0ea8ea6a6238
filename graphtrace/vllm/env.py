"""The environment switches the worker plugin and ``trace_llm()`` share (Note [one guard
switch] in graphtrace/vllm/adapter.py): ``GRAPHTRACE_VLLM`` (on, or ``guard``),
``GRAPHTRACE_GUARD`` (the guard's action) and ``GRAPHTRACE_VLLM_DIR`` (where reports and guard
checks go). Read here once, so that neither the plugin nor the adapter imports the other."""

from __future__ import annotations

import logging
import os
from pathlib import Path

from graphtrace.serving import ACTIONS

logger = logging.getLogger("graphtrace.vllm")

__all__ = ["ENV_ON", "ENV_DIR", "ENV_GUARD", "DEFAULT_DIR", "GUARD_ACTIONS", "enabled",
           "guard_mode", "guard_setting", "guard_action", "out_dir", "guard_folder"]

ENV_ON = "GRAPHTRACE_VLLM"
ENV_DIR = "GRAPHTRACE_VLLM_DIR"
ENV_GUARD = "GRAPHTRACE_GUARD"
DEFAULT_DIR = "graphtrace-vllm"
GUARD_ACTIONS = ACTIONS


def enabled() -> bool:
    return os.environ.get(ENV_ON, "") in ("1", "guard")


def guard_mode() -> bool:
    """``GRAPHTRACE_VLLM=guard``: check every weight update (graphtrace/vllm/plugin.py)."""
    return os.environ.get(ENV_ON, "") == "guard"


def guard_setting() -> str:
    """``GRAPHTRACE_GUARD`` as set, lower case ("" when unset)."""
    return os.environ.get(ENV_GUARD, "").strip().lower()


def guard_action() -> str:
    """``GRAPHTRACE_GUARD``: raise (default), warn or recapture."""
    value = guard_setting() or "raise"
    if value not in GUARD_ACTIONS:
        logger.warning("graphtrace: %s=%r is not one of %s; using 'raise'", ENV_GUARD, value,
                       ", ".join(GUARD_ACTIONS))
        return "raise"
    return value


def out_dir(override: str | os.PathLike | None = None) -> Path:
    return Path(override or os.environ.get(ENV_DIR) or DEFAULT_DIR)


def guard_folder(worker=None) -> Path:
    """``$GRAPHTRACE_VLLM_DIR/guard/rank<R>``: where a worker's guard writes its checks (the
    plugin's, and ``trace_llm()``'s when the environment turned its guard on)."""
    from graphtrace.vllm import hooks

    rank = hooks.worker_rank(worker) if worker is not None else 0
    return out_dir() / "guard" / f"rank{rank}"
