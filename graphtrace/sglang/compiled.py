"""SGLang's compiled CPU decode graphs (``CPUGraphRunner``), recorded where SGLang captures them.

With ``enable_torch_compile=True`` on CPU, SGLang (0.5.23) builds a ``CPUGraphRunner``
(sglang/srt/model_executor/cpu_graph_runner.py): it sets ``torch._inductor.config.freezing =
True`` (``set_torch_compile_config``), and for each decode batch size
``capture_one_batch_size(bs, forward)`` runs ``forward = torch.compile(model.forward)`` twice
over its static decode buffers; the first call compiles. ``forward`` is then what the runner
replays for every decode step of that size: SGLang's CPU graph.

This module hooks ``capture_one_batch_size`` (SGLang's own plugin hooks, registered by
`register`, the entry point ``graphtrace_compiled``): while the scheduler's trace is open
(`graphtrace.sglang.plugin`), the runner's second call of ``forward`` (the compiled code
running, as every later decode step runs it) is recorded as the emulated graph
``decode_bs<bs>``. The compile itself happened inside the trace, so what Inductor's freezing
folded into the graph (prepacked weights, transposed copies) is tied by lineage to the
parameters it was made from (Note [frozen constants] in graphtrace/compiled.py): after an
update writes those parameters, the graph's constants are ``unrefreshed`` and the guard refuses
the update, naming each constant and the weights it derives from (Note [compiled CPU graphs]).
"""

from __future__ import annotations

import logging
from typing import Any, Callable

import torch

import graphtrace as gt
from graphtrace.errors import GraphtraceError
from graphtrace.serving import strict
from graphtrace.sglang import contract, env, plugin, releases

logger = logging.getLogger("graphtrace.sglang")

__all__ = ["register", "attention_state", "LABEL"]

LABEL = "decode_bs{bs}"

# Note [compiled CPU graphs]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~
# SGLang's CPU "graph" is a compiled function, not a captured one: each decode step calls the
# same Inductor code again. What makes it a graph in graphtrace's sense is what Inductor froze
# into it at compile time (freezing=True): every linear's weight, prepacked for MKL/oneDNN into
# new buffers no watched model owns. SGLang's weight updates write the parameters in place
# (``param.data.copy_``), and re-capture only on CUDA/MUSA after ``update_weights_from_disk``
# (``recapture_cuda_graph=True``), never on CPU, so the decode steps keep computing with the
# old weights (analysis/repro/sglang_cpu_compile_keeps_old_weights.py). Recording one call of
# the compiled code per batch size is enough: its region's arguments are the graph's inputs and
# its compiled-in constants, and the constants' sources were noted when Inductor made them.
# The first call is left out (it compiles, and runs once before the graph is SGLang's); the
# second is the compiled code as SGLang keeps it. The emulated graph keeps what it read alive,
# as the runner's compiled code does.
#
# The KV pool and the attention backend's scratch buffers are read by the graph's attention
# op, which also writes them (``decode_attention_cpu`` takes them as ``Tensor(a!)``: read
# first, as graphtrace records a mutable argument), and the warm-up forwards wrote them from
# the weights: by lineage alone they would be `unrefreshed` after every update. They are
# request state (every request writes the slots it reads; SGLang flushes the cache after an
# update), so they are declared so before the capture (`Trace.declare_state`, Note [engine
# state] in graphtrace/lineage/graph.py); what Inductor froze into the graph is not among them.


def register() -> None:
    """The ``sglang.srt.plugins`` entry point ``graphtrace_compiled``: off unless
    ``GRAPHTRACE_SGLANG`` is on (graphtrace/sglang/env.py)."""
    if not env.enabled():
        return
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    rel, _note = releases.running()  # the plugin's log says a release not in the table
    target = rel.target("cpu_graph_capture")
    problems = contract.check_targets({"cpu_graph_capture": target})
    if problems:  # fail open: said in the log and, once a session opens, in its blind spots
        if strict():
            raise GraphtraceError(f"graphtrace cannot hook SGLang: {problems[0]}")
        logger.error("graphtrace: %s: not hooked", problems[0])
        plugin.add_unguarded(f"{problems[0]}: not hooked")
        return
    HookRegistry.register(target.dotted, _around_capture, HookType.AROUND)


def _around_capture(original, runner, bs, forward, *args, **kwargs):
    """SGLang's capture of one batch size, with the compiled forward's second call recorded."""
    recording = _recording(runner, bs, forward)
    if recording is None:
        return original(runner, bs, forward, *args, **kwargs)
    graph, out = original(runner, bs, recording, *args, **kwargs)
    recording.done()
    return (forward if graph is recording else graph), out  # SGLang keeps its own forward


def attention_state(model_runner) -> list:
    """The tensors of SGLang's KV pool (``token_to_kv_pool``: ``k_buffer`` / ``v_buffer``
    per layer) and of its attention backend (e.g. intel_amx's ``_attn_logits_buffers``):
    request state, one attribute level deep (Note [compiled CPU graphs])."""
    found: list = []
    for owner in (getattr(model_runner, "token_to_kv_pool", None),
                  getattr(model_runner, "attn_backend", None)):
        for value in (vars(owner).values() if hasattr(owner, "__dict__") else ()):
            items = value.values() if isinstance(value, dict) else \
                value if isinstance(value, (list, tuple)) else (value,)
            found.extend(t for t in items if isinstance(t, torch.Tensor))
    return found


def _recording(runner, bs: int, forward: Callable) -> "_SecondCall | None":
    session = plugin.session()
    if session is None or getattr(runner, "model_runner", None) is not session.runner:
        return None
    return _SecondCall(session, runner, forward, LABEL.format(bs=bs), bs)


class _SecondCall:
    """``forward`` for SGLang's capture loop: its second call runs inside ``gt.capture``."""

    def __init__(self, session, runner, forward: Callable, label: str, bs: int):
        self.session, self.runner, self.forward = session, runner, forward
        self.label, self.bs = label, bs
        self.calls = 0
        self.graph = None

    def __call__(self, *args, **kwargs) -> Any:
        self.calls += 1
        if self.calls != 2:
            return self.forward(*args, **kwargs)
        self.session.trace.declare_state(attention_state(self.runner.model_runner))
        with gt.capture(self.label) as graph:
            out = self.forward(*args, **kwargs)
        graph.capture.info.update(batch_size=self.bs, sglang_cpu_graph=True)
        self.graph = graph
        self.session.graphs.append(graph)  # kept alive like the runner's compiled code
        return out

    def done(self) -> None:
        if self.graph is not None:
            return
        error = RuntimeError(f"SGLang's CPU graph capture (bs={self.bs}) called the compiled "
                             f"forward {self.calls} time(s); graphtrace records the second")
        if strict():
            raise error
        self.session.trace.record_error(f"sglang CPU graph capture (bs={self.bs})", error)
