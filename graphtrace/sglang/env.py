"""The environment switches of graphtrace inside SGLang, read by the plugin in the scheduler
process and set by `graphtrace.sglang.trace_engine` in the client: ``GRAPHTRACE_SGLANG`` (``1``:
trace; ``guard``: trace and check every weight update), ``GRAPHTRACE_GUARD`` (the guard's
action, shared with vLLM's adapter: `graphtrace.vllm.env.guard_action`),
``GRAPHTRACE_SGLANG_DIR`` (where reports and guard checks go) and
``GRAPHTRACE_SGLANG_EMULATE`` (the decode batch sizes recorded as emulated graphs where SGLang
captures no graph: on CPU; ``0``: none)."""

from __future__ import annotations

import os
from pathlib import Path

from graphtrace.vllm.env import ENV_GUARD, GUARD_ACTIONS, guard_action  # engine-neutral

__all__ = ["ENV_ON", "ENV_DIR", "ENV_GUARD", "ENV_EMULATE", "DEFAULT_DIR", "DEFAULT_EMULATE",
           "GUARD_ACTIONS", "enabled", "guard_mode", "guard_action", "out_dir", "guard_folder",
           "emulated_batch_sizes"]

ENV_ON = "GRAPHTRACE_SGLANG"
ENV_DIR = "GRAPHTRACE_SGLANG_DIR"
ENV_EMULATE = "GRAPHTRACE_SGLANG_EMULATE"
DEFAULT_DIR = "graphtrace-sglang"
DEFAULT_EMULATE = (1, 2)


def enabled() -> bool:
    return os.environ.get(ENV_ON, "") in ("1", "guard")


def guard_mode() -> bool:
    """``GRAPHTRACE_SGLANG=guard``: check every weight update before the engine serves."""
    return os.environ.get(ENV_ON, "") == "guard"


def out_dir() -> Path:
    return Path(os.environ.get(ENV_DIR) or DEFAULT_DIR)


def guard_folder(rank: int = 0) -> Path:
    """``$GRAPHTRACE_SGLANG_DIR/guard/rank<R>``: where a scheduler's guard writes its checks."""
    return out_dir() / "guard" / f"rank{rank}"


def emulated_batch_sizes() -> tuple[int, ...]:
    """``GRAPHTRACE_SGLANG_EMULATE``: comma-separated decode batch sizes (default 1,2; ``0``:
    none)."""
    value = os.environ.get(ENV_EMULATE, "").strip()
    if not value:
        return DEFAULT_EMULATE
    sizes = tuple(int(v) for v in value.replace(" ", "").split(",") if v)
    return tuple(s for s in sizes if s > 0)
