"""One reload scenario, end to end: capture -> reload -> diff -> replay -> flip.

The one copy of these steps, shared by the seed demo (`graphtrace demo`), the case library
(`graphtrace demo --case`) and the kernel audit (`analysis/vllm_kernel_audit.py`).

A `Scenario` is a trace session around one model::

    with Scenario(model, strict=True) as sc:          # gt.trace(model) is open inside
        sc.capture([("bs1", x1), ("bs2", x2)])        # one graph per input
        sc.reload(lambda m: reload_weights(m, ckpt))  # the reload runs inside the trace
        report = sc.diff()
    after = sc.replay()                               # every graph's output, replayed
    eager = sc.eager()                                # the live model on the same inputs
    same_rows(after[0], eager[0])
    flip = sc.flip(perturb)                           # perturb the live tensors, replay again

A graph is an emulated one, or on CUDA a real CUDA graph (`capture`).

The flip test is how a graph proves what it reads: change, in place, the tensor the eager
model reads now and replay. Graphs reading that storage change their output ("follows");
graphs reading a storage the engine no longer updates do not ("frozen"). `run` does the
whole sequence in one call, for callers that need no step in between.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

import torch

import graphtrace as gt

__all__ = ["ScenarioError", "Graph", "Flip", "Outcome", "Scenario", "capture", "same_rows",
           "changed_rows", "run"]


class ScenarioError(ValueError):
    """A scenario was given something it cannot run: bad inputs, a device without CUDA,
    a replay of graphs that were recorded but not made replayable, steps out of order."""


@dataclass(eq=False)
class Graph:
    """One captured graph: its label, the model's arguments, the output tensor its replay
    writes, and how to replay it (None for a graph recorded with `emulate=False`)."""

    label: str
    inputs: tuple
    output: torch.Tensor
    replay_fn: Callable[[], Any] | None = field(default=None, repr=False)
    # tensors kept alive beside a real CUDA graph, as an engine's capture artifacts keep them
    keepalive: list = field(default_factory=list, repr=False)

    @property
    def rows(self) -> int:
        """Output rows (the batch size)."""
        return int(self.output.shape[0]) if self.output.dim() else 1

    @property
    def replayable(self) -> bool:
        return self.replay_fn is not None

    def replay(self) -> torch.Tensor:
        """Replay the graph; a copy of what it wrote into its output."""
        if self.replay_fn is None:
            raise ScenarioError(f"graph {self.label!r} was recorded with emulate=False: it "
                                "has no replay (capture with emulate=True to replay it)")
        self.replay_fn()
        return self.output.detach().clone()

    def eager(self, model: Callable) -> torch.Tensor:
        """The model run eagerly on this graph's inputs (no grad); a copy of its output (an
        engine may return a buffer the next call overwrites)."""
        with torch.no_grad():
            return model(*self.inputs).detach().clone()


@dataclass
class Flip:
    """A flip test: `changed` of `rows` replayed rows changed after `target` was perturbed
    in place (0: the graphs do not read it; `rows`: every output follows it). With
    `eager=True`, `eager_changed` counts the eager rows that changed (else None)."""

    target: str
    rows: int
    changed: int
    eager_changed: int | None = None

    @property
    def frozen(self) -> bool:
        return self.changed == 0

    @property
    def follows(self) -> bool:
        return self.rows > 0 and self.changed == self.rows


@dataclass
class Outcome:
    """What `run` produced: the report, what the reload returned, and the graphs' checks
    (rows 0, `replay_eq_eager` and `flip` None when the graphs are not replayable)."""

    report: Any
    reloaded: Any = None
    rows: int = 0
    replay_eq_eager: int | None = None
    flip: Flip | None = None


# --------------------------------------------------------------------------------------
# comparing outputs
# --------------------------------------------------------------------------------------

def _as_rows(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(t.shape[0], -1) if t.dim() else t.reshape(1, 1)


def same_rows(a: torch.Tensor, b: torch.Tensor) -> int:
    """How many rows (first dimension) of `a` and `b` are exactly equal."""
    if tuple(a.shape) != tuple(b.shape):
        raise ScenarioError(f"cannot compare outputs of shapes {tuple(a.shape)} and "
                            f"{tuple(b.shape)} row by row")
    return int((_as_rows(a) == _as_rows(b)).all(dim=-1).sum())


def changed_rows(a: torch.Tensor, b: torch.Tensor) -> int:
    """How many rows of `a` and `b` differ."""
    return _as_rows(a).shape[0] - same_rows(a, b)


# --------------------------------------------------------------------------------------
# capture
# --------------------------------------------------------------------------------------

def _checked_inputs(inputs) -> list[tuple[str, tuple]]:
    if isinstance(inputs, (torch.Tensor, str)) or not isinstance(inputs, Iterable):
        raise ScenarioError("inputs must be (label, tensor or tuple of tensors) pairs, got "
                            f"{type(inputs).__name__}")
    out: list[tuple[str, tuple]] = []
    for i, item in enumerate(inputs):
        if not (isinstance(item, tuple) and len(item) == 2):
            raise ScenarioError(f"inputs[{i}] must be a (label, tensor or tuple of tensors) "
                                f"pair, got {type(item).__name__}")
        label, args = item
        if not isinstance(label, str) or not label:
            raise ScenarioError(f"inputs[{i}]: the label must be a non-empty str, got {label!r}")
        args = args if isinstance(args, tuple) else (args,)
        if not args or not isinstance(args[0], torch.Tensor):
            raise ScenarioError(f"inputs[{i}] ({label!r}): the model's first argument must "
                                f"be a tensor, got {type(args[0]).__name__ if args else 'nothing'}")
        if any(label == seen for seen, _ in out):
            raise ScenarioError(f"inputs: the label {label!r} is used twice (one graph each)")
        out.append((label, args))
    if not out:
        raise ScenarioError("inputs is empty: give at least one (label, tensor) to capture")
    return out


def _checked_device(device) -> torch.device:
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ScenarioError(f"device {device!r} is not a torch device: {e}") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ScenarioError("device is cuda but CUDA is not available; capture emulated "
                            "graphs with device='cpu'")
    return device


def capture(model: Callable, inputs: Iterable[tuple[str, Any]], *, device="cpu",
            emulate: bool = True, warmup: int = 2,
            keepalive: Callable[[], list] | None = None) -> list[Graph]:
    """Capture `model(*args)` once per `(label, args)` of `inputs` (a tensor or a tuple of
    tensors), under no grad; record them in the open trace, if any.

    `device` "cuda": a real CUDA graph each (`gt.capture_cuda_graph`, `warmup` calls first),
    kept with the tensors `keepalive()` returns. Any other device: an emulated graph
    (`gt.capture`), replayable unless `emulate=False` (recorded only).
    """
    items = _checked_inputs(inputs)
    device = _checked_device(device)
    graphs = []
    with torch.no_grad():
        for label, args in items:
            if device.type == "cuda":
                graph, y = gt.capture_cuda_graph(lambda args=args: model(*args), label,
                                                 warmup=warmup)

                def replay(graph=graph):
                    graph.replay()
                    torch.cuda.synchronize()

                graphs.append(Graph(label, args, y, replay,
                                    list(keepalive()) if keepalive is not None else []))
            else:
                with gt.capture(label, emulate=emulate) as graph:
                    y = model(*args)
                graphs.append(Graph(label, args, y, graph.replay if emulate else None))
    return graphs


# --------------------------------------------------------------------------------------
# the session
# --------------------------------------------------------------------------------------

class Scenario:
    """A trace session around one model: capture, reload, diff, then replay and flip.

    `with Scenario(model) as sc:` opens `gt.trace(model, strict=strict)`; a model built
    inside the trace (so the report says where its tensors were made) is given later with
    `sc.watch(model)`. `reload` and `diff` may run inside the block or after it (the
    reload is then not traced); replay, eager and flip run any time after capture.
    """

    def __init__(self, model: torch.nn.Module | None = None, *, strict: bool = True):
        self.model = model
        self.strict = strict
        self.trace = None
        self.graphs: list[Graph] = []
        self._open = False

    # -- the trace ---------------------------------------------------------------------
    def __enter__(self) -> "Scenario":
        if self.trace is not None:
            raise ScenarioError("a Scenario is entered once")
        self.trace = gt.trace(self.model, strict=self.strict)
        self.trace.__enter__()
        self._open = True
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Close the trace (what leaving the `with` block does); once."""
        if self._open:
            self._open = False
            self.trace.__exit__(None, None, None)

    def watch(self, model: torch.nn.Module) -> None:
        """The model, when it is built after the trace opened."""
        self._need_trace("watch a model")
        self.trace.watch(model)
        self.model = model

    def _need_trace(self, what: str) -> None:
        if self.trace is None:
            raise ScenarioError(f"cannot {what} before the trace is open: use "
                                "`with Scenario(model) as sc:`")

    def _need_model(self, what: str) -> torch.nn.Module:
        if self.model is None:
            raise ScenarioError(f"cannot {what}: no model (give it to Scenario(model) or "
                                "sc.watch(model))")
        return self.model

    # -- capture, reload, diff ----------------------------------------------------------
    def capture(self, inputs: Iterable[tuple[str, Any]], *, device="cpu",
                emulate: bool = True, warmup: int = 2,
                keepalive: Callable[[], list] | None = None) -> list[Graph]:
        """One graph per input, recorded in the trace (see `capture`); added to `graphs`."""
        if not self._open:
            raise ScenarioError("capture inside the open trace (`with Scenario(model) as "
                                "sc: sc.capture(...)`): a capture outside it is not recorded")
        model = self._need_model("capture")
        graphs = capture(model, inputs, device=device, emulate=emulate, warmup=warmup,
                         keepalive=keepalive)
        self.graphs += graphs
        return graphs

    def reload(self, fn: Callable[[torch.nn.Module], Any]) -> Any:
        """Run the reload `fn(model)` (grad enabled, as an engine runs it); its result."""
        if not self.graphs:
            raise ScenarioError("reload before any capture: capture the graphs first")
        with torch.enable_grad():
            return fn(self._need_model("reload"))

    def diff(self):
        """`trace.diff()`: the report of what the captured graphs read now."""
        self._need_trace("diff")
        return self.trace.diff()

    # -- after the reload -----------------------------------------------------------------
    @property
    def rows(self) -> int:
        return sum(g.rows for g in self.graphs)

    @property
    def replayable(self) -> bool:
        return bool(self.graphs) and all(g.replayable for g in self.graphs)

    def replay(self) -> list[torch.Tensor]:
        """Every graph replayed (no grad): copies of their outputs."""
        if not self.graphs:
            raise ScenarioError("nothing to replay: no graph was captured")
        with torch.no_grad():
            return [g.replay() for g in self.graphs]

    def eager(self) -> list[torch.Tensor]:
        """The live model run eagerly on every graph's inputs (no grad)."""
        model = self._need_model("run the model eagerly")
        return [g.eager(model) for g in self.graphs]

    def flip(self, perturb: Callable[[torch.nn.Module], Any], *,
             restore: Callable[[torch.nn.Module], Any] | None = None,
             baseline: list[torch.Tensor] | None = None, eager: bool = False) -> Flip:
        """The flip test: `perturb(model)` changes in place what the eager model reads (its
        return value, when a str, names the target), the graphs are replayed and their rows
        compared with `baseline` (default: a replay just before the perturbation).
        `restore(model)` then undoes the perturbation. `eager=True` also counts eager rows
        that changed."""
        model = self._need_model("run a flip test")
        with torch.no_grad():
            before = self.replay() if baseline is None else list(baseline)
            if len(before) != len(self.graphs):
                raise ScenarioError(f"baseline has {len(before)} outputs for "
                                    f"{len(self.graphs)} graphs")
            eager_before = self.eager() if eager else None
            target = perturb(model)
            try:
                flipped = self.replay()
                eager_after = self.eager() if eager else None
            finally:
                if restore is not None:
                    restore(model)
        changed = sum(changed_rows(b, f) for b, f in zip(before, flipped))
        eager_changed = None if eager_before is None else sum(
            changed_rows(b, a) for b, a in zip(eager_before, eager_after))
        return Flip(target if isinstance(target, str) else "", self.rows, changed,
                    eager_changed)


def run(model: torch.nn.Module, inputs: Iterable[tuple[str, Any]],
        reload: Callable[[torch.nn.Module], Any],
        perturb: Callable[[torch.nn.Module], Any] | None = None, *, device="cpu",
        emulate: bool = True, strict: bool = True,
        setup: Callable[[torch.nn.Module], Any] | None = None) -> Outcome:
    """The whole scenario in one call: capture one graph per input inside `gt.trace(model)`
    (after `setup(model)`, if given: what the engine runs in the trace before its captures,
    such as its first load or a warm-up), run `reload(model)` inside the trace, diff; then,
    when the graphs replay, compare each replay with the eager model and run the flip test
    with `perturb` (if given)."""
    with Scenario(model, strict=strict) as sc:
        if setup is not None:
            setup(model)
        sc.capture(inputs, device=device, emulate=emulate)
        reloaded = sc.reload(reload)
        report = sc.diff()
    out = Outcome(report, reloaded)
    if not sc.replayable:
        return out
    after = sc.replay()
    eager = sc.eager()
    out.rows = sc.rows
    out.replay_eq_eager = sum(same_rows(a, e) for a, e in zip(after, eager))
    if perturb is not None:
        out.flip = sc.flip(perturb, baseline=after)
    return out
