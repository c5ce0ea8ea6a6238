"""What every case does around its model: capture, reload, diff, replay, flip.

Cases build a tiny model, then call `capture_reload_diff` with the inputs to capture (one
graph each, emulated on CPU: `gt.capture` replays on the captured storages, as a CUDA graph
does), the reload to run, and the flip test's perturbation (in place, on the tensors the
eager model reads after the reload). The reloads here are the engines' own steps:

* `reload_layerwise`: `graphtrace.demo.reload.reload` (vLLM's real layerwise reload when
  vLLM is installed and the model recorded its metadata for it, else the built-in one
  following the same steps);
* `reload_inplace`: `load_weights` into the live parameters, then every layer's
  `quant_method.process_weights_after_loading` again: vLLM's `DefaultModelLoader.load_weights`
  before the layerwise reload, and what RL frameworks (NeMo-RL, verl) run on a refit;
* SGLang's and the memory saver's steps live in their case modules.
"""

from __future__ import annotations

from typing import Callable, Iterable

import torch

import graphtrace as gt

from ..kernels import replace_parameter, weight_loader  # noqa: F401  (re-exported for cases)
from .spec import Outcome

__all__ = ["capture_reload_diff", "reload_layerwise", "reload_inplace", "make_param",
           "replace_parameter", "weight_loader", "CaseModel"]


def make_param(shape, dtype=torch.float32, loader: Callable = weight_loader) -> torch.nn.Parameter:
    """An empty checkpoint-format parameter with a `weight_loader`, as vLLM creates them."""
    p = torch.nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False)
    p.weight_loader = loader
    return p


class CaseModel(torch.nn.Module):
    """A root module whose `load_weights` fills parameters through their weight loaders."""

    def load_weights(self, checkpoint: dict[str, torch.Tensor]) -> set[str]:
        params = dict(self.named_parameters())
        for name, tensor in checkpoint.items():
            if name not in params:
                raise KeyError(f"checkpoint tensor {name!r} has no parameter in the model")
            param = params[name]
            getattr(param, "weight_loader", weight_loader)(param, tensor)
        return set(checkpoint)

    def process_weights_after_loading(self) -> None:
        for m in self.modules():
            qm = getattr(m, "quant_method", None)
            if qm is not None and hasattr(qm, "process_weights_after_loading"):
                qm.process_weights_after_loading(m)

    def load(self, checkpoint: dict[str, torch.Tensor]) -> None:
        """The engine's first load: load_weights, then process."""
        self.load_weights(checkpoint)
        self.process_weights_after_loading()


def reload_layerwise(model: torch.nn.Module, checkpoint, backend: str = "auto") -> str:
    from ..reload import reload

    return reload(model, checkpoint, backend=backend)


def reload_inplace(model: CaseModel, checkpoint) -> str:
    with torch.no_grad():
        model.load_weights(checkpoint)
        model.process_weights_after_loading()
    return "inplace"


def capture_reload_diff(model: torch.nn.Module, inputs: Iterable[tuple[str, torch.Tensor]],
                        reload: Callable[[torch.nn.Module], str],
                        perturb: Callable[[torch.nn.Module], str] | None = None, *,
                        emulate: bool = True, strict: bool = True) -> Outcome:
    """Capture one graph per input, reload, diff; replay and flip when the graphs replay.

    `reload(model)` returns the name of the reload code that ran. `perturb(model)` changes,
    in place, the tensors the eager model reads after the reload, and names them.
    """
    with torch.no_grad(), gt.trace(model, strict=strict) as tr:
        captured = []
        for label, x in inputs:
            with gt.capture(label, emulate=emulate) as graph:
                y = model(x)
            captured.append((x, y, graph if emulate else None))
        # the reload inside the trace: the report says where the replacements were made
        # (the model was built before the trace: its storages read "before trace")
        with torch.enable_grad():
            backend = reload(model)
        report = tr.diff()
    out = Outcome(report=report, backend=backend)
    if not emulate:
        return out
    with torch.no_grad():
        after = [_replay(g, y) for _, y, g in captured]
        eager = [model(x) for x, _, _ in captured]
        out.rows = sum(a.shape[0] for a in after)
        out.replay_eq_eager = sum(_same_rows(a, e) for a, e in zip(after, eager))
        if perturb is not None:
            out.flip_target = perturb(model)
            flipped = [_replay(g, y) for _, y, g in captured]
            out.flip_changed = sum(a.shape[0] - _same_rows(a, f) for a, f in zip(after, flipped))
    return out


def _replay(graph, y: torch.Tensor) -> torch.Tensor:
    graph.replay()
    return y.detach().reshape(y.shape[0], -1).clone()


def _same_rows(a: torch.Tensor, b: torch.Tensor) -> int:
    return int((a.reshape(a.shape[0], -1) == b.reshape(b.shape[0], -1)).all(dim=-1).sum())
