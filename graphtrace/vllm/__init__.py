"""graphtrace inside a real vLLM (0.32): in-process adapter, worker plugin, tiny models.

In-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``): ``trace_llm``, :mod:`graphtrace.vllm.adapter`.
Worker processes: the ``vllm.general_plugins`` entry point ``graphtrace.vllm.plugin:register``
(on with ``GRAPHTRACE_VLLM=1``); see :mod:`graphtrace.vllm.plugin`.
Importing this package does not import vLLM.
"""

from __future__ import annotations

from graphtrace._lazy import lazy_exports

_LAZY = {
    "VllmTrace": "graphtrace.vllm.adapter",
    "trace_llm": "graphtrace.vllm.adapter",
    "find_worker": "graphtrace.vllm.adapter",
    "find_model": "graphtrace.vllm.adapter",
    "RunnerView": "graphtrace.vllm.adapter",
    "find_blind_spots": "graphtrace.vllm.blind",
    "merge_reports": "graphtrace.vllm.merge",
    "rank_folders": "graphtrace.vllm.merge",
}

__all__ = sorted(_LAZY)


# the first read of a name in _LAZY imports its module
__getattr__, __dir__ = lazy_exports(__name__, globals(), _LAZY)
del lazy_exports
