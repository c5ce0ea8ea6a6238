"""What every case does around its model: capture, reload, diff, replay, flip.

Cases build a tiny model, then call `capture_reload_diff` (the steps are
`graphtrace.demo.scenario`'s, shared with the seed demo). The reloads here are the engines'
own steps:

* `reload_layerwise`: `graphtrace.demo.reload.reload` (vLLM's real layerwise reload when
  vLLM is installed and the model recorded its metadata for it, else the built-in one
  following the same steps);
* `reload_inplace`: `spec.RELOADS["vllm-inplace"]`, vLLM's before the layerwise reload (RL
  frameworks: NeMo-RL, verl);
* SGLang's and the memory saver's steps live in their case modules.
"""

from __future__ import annotations

from typing import Callable, Iterable

import torch

from .. import scenario
from ..kernels import replace_parameter, weight_loader  # noqa: F401  (re-exported for cases)
from ..model import CaseModel  # noqa: F401  (re-exported for cases)
from .spec import Outcome

__all__ = ["capture_reload_diff", "reload_layerwise", "reload_inplace", "make_param",
           "replace_parameter", "weight_loader", "CaseModel", "MethodLayer"]


def make_param(shape, dtype=torch.float32, loader: Callable = weight_loader) -> torch.nn.Parameter:
    """An empty checkpoint-format parameter with a `weight_loader`, as vLLM creates them."""
    p = torch.nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False)
    p.weight_loader = loader
    return p


class MethodLayer(torch.nn.Module):
    """A layer run by its quant method, as vLLM's linear and MoE layers are: the method creates
    the layer's weights, processes them after loading and is the forward (residual here, so
    a stack of layers keeps the input's shape)."""

    def __init__(self, quant_method):
        super().__init__()
        self.quant_method = quant_method
        quant_method.create_weights(self)

    def forward(self, x):
        return x + self.quant_method.apply(self, x)


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
                        emulate: bool = True, strict: bool = True,
                        setup: Callable[[torch.nn.Module], object] | None = None) -> Outcome:
    """Capture one graph per input, reload, diff; replay and flip when the graphs replay
    (`graphtrace.demo.scenario.run`, as a case's `Outcome`).

    `reload(model)` returns the name of the reload code that ran. `perturb(model)` changes,
    in place, the tensors the eager model reads after the reload, and names them. The
    reload runs inside the trace: the report says where the replacements were made (the
    model was built before the trace: its storages read "before trace"); so does
    `setup(model)`, before the captures (the engine's first load, a warm-up).
    """
    res = scenario.run(model, inputs, reload, perturb, emulate=emulate, strict=strict,
                       setup=setup)
    out = Outcome(report=res.report, backend=res.reloaded, rows=res.rows,
                  replay_eq_eager=res.replay_eq_eager)
    if res.flip is not None:
        out.flip_target, out.flip_changed = res.flip.target, res.flip.changed
    return out
