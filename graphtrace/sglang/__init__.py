"""graphtrace inside a real SGLang (0.5.23): the plugin in the scheduler process, and
`trace_engine()` for tests and notebooks.

The model lives in SGLang's scheduler process (``Engine`` spawns it), so graphtrace runs there
through SGLang's plugin entry point (``graphtrace.sglang.plugin:register``, on with
``GRAPHTRACE_SGLANG=1`` or ``guard``); `trace_engine()` sets those switches for the engines
started inside it and reads what their schedulers wrote::

    import graphtrace.sglang as gs
    with gs.trace_engine(folder) as st:
        engine = sglang.Engine(...)      # traced and guarded in its scheduler
        engine.begin_weight_update(); engine.update_weights_from_tensor(...)
        ok, message = engine.end_weight_update()   # success=False when graphs went stale
        st.write_report(engine, "after_update")    # graphtrace report <folder>/after_update/rank0

Importing this package does not import SGLang.
"""

from __future__ import annotations

from graphtrace._lazy import lazy_exports

_LAZY = {
    "trace_engine": "graphtrace.sglang.engine",
    "EngineTrace": "graphtrace.sglang.engine",
    "SglangSession": "graphtrace.sglang.session",
}

__all__ = sorted(_LAZY)

# the first read of a name in _LAZY imports its module
__getattr__, __dir__ = lazy_exports(__name__, globals(), _LAZY)
del lazy_exports
