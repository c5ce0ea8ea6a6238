"""An RL weight sync that calls `model.load_weights(...)` and never processes again.

An RL client pushes new weights into a running engine with `model.load_weights(...)` and does
not run `process_weights_after_loading` again (TRL's colocate sync does exactly this). Every
tensor processing derived from the weights keeps its old value at its old address: here a
per-channel int8 scale (`weight_scale_derived = amax(|weight|) / 127`) and a packed copy
(`weight_packed`: the weight quantised with it, transposed), both plain attributes the
forward reads. A fixed, in-place kernel then serves stale values with no rebinding at all,
so identity is fine; freshness (Note [freshness] in graphtrace/verdict.py) finds them:
lineage saw both made from `layers.N.weight` during the process step inside the trace, and
the weight was written since while they were not.

Variants:

* `buggy`: the sync is `load_weights` only: the packed copy and the scale are
  `unrefreshed`, `derived_from` `layers.N.weight`;
* `reprocess-rebind`: the sync processes again, binding new tensors: the graphs read the
  old ones, whose owners moved: `stale` (identity);
* `fixed`: the sync processes again into the same storages (`copy_`): clean (a derived
  tensor recomputed in place by every update: a negative control of freshness).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .harness import CaseModel, MethodLayer, capture_reload_diff, make_param
from .spec import Case, Expect, Variant

__all__ = ["K", "N", "BATCH_SIZES", "Int8PackMethod", "RLModel", "run", "CASE"]

K = N = 8
BATCH_SIZES = (1, 2)


@dataclass(eq=False)  # compared and hashed by identity, as the plain class it stands for
class Int8PackMethod:
    """A per-channel int8 linear method: processing derives the scale and a packed copy
    (`in_place`: into the storages of the last processing, the fix)."""

    in_place: bool = False

    def create_weights(self, layer):
        layer.weight = make_param((N, K))
        layer.weight_packed = layer.weight_scale_derived = None  # made by processing

    def process_weights_after_loading(self, layer):
        with torch.no_grad():
            w = layer.weight
            scale = w.abs().amax(dim=1) / 127
            packed = torch.round(w / scale[:, None]).to(torch.int8).t().contiguous()
            if self.in_place and getattr(layer, "weight_packed", None) is not None:
                layer.weight_scale_derived.copy_(scale)   # the same storages, new values
                layer.weight_packed.copy_(packed)
            else:
                layer.weight_scale_derived = scale
                layer.weight_packed = packed

    def apply(self, layer, x):
        return (x @ layer.weight_packed.to(x.dtype)) * layer.weight_scale_derived


class RLModel(CaseModel):
    def __init__(self, n_layers: int = 2, in_place: bool = False):
        super().__init__()
        self.layers = torch.nn.ModuleList(
            MethodLayer(Int8PackMethod(in_place)) for _ in range(n_layers))

    def checkpoint(self, seed: int) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(seed)
        return {f"layers.{i}.weight": torch.randn(N, K, generator=g) / K ** 0.5
                for i in range(len(self.layers))}


def run(variant: str, backend: str = "auto"):
    model = RLModel(in_place=variant == "fixed").eval()
    g = torch.Generator().manual_seed(5)
    inputs = [(f"bs{b}", torch.randn(b, K, generator=g)) for b in BATCH_SIZES]

    def sync(m):
        with torch.no_grad():
            m.load_weights(m.checkpoint(1))             # new weights into the live parameters
            if variant != "buggy":
                m.process_weights_after_loading()
        return "load_weights" + ("" if variant == "buggy" else " + process")

    def perturb(m):
        with torch.no_grad():
            for layer in m.layers:
                layer.weight_packed.neg_()
        return "the live packed copy, negated in place"

    flips = CASE.variant(variant).flip is not None
    return capture_reload_diff(model, inputs, sync, perturb if flips else None,
                               setup=lambda m: m.load(m.checkpoint(0)))  # first load, in trace


_DERIVED = ("layers.*.weight_packed", "layers.*.weight_scale_derived")

CASE = Case(
    name="rl-load-weights-no-process",
    reference="RL weight sync (TRL colocate)",
    source="model.load_weights(...) with no process_weights_after_loading after it",
    rebound="nothing: a derived scale and a packed copy, plain attributes made by the process "
            "step, keep their old values while load_weights copies new weights in place",
    fix="run process_weights_after_loading after every load_weights, recomputing the derived "
        "tensors into their own storages (copy_)",
    reload="load-weights-only",
    variants=(
        Variant("buggy", "buggy", "load_weights only: nothing derived is recomputed",
                tuple(Expect(p, "unrefreshed") for p in _DERIVED)),
        Variant("reprocess-rebind", "buggy",
                "load_weights, then process again, binding new tensors",
                tuple(Expect(p, "stale") for p in _DERIVED), flip="frozen"),
        Variant("fixed", "fixed", "load_weights, then process again into the same storages",
                tuple(Expect(p, "stable") for p in _DERIVED), flip="follows"),
    ),
    run=run,
    note="`unrefreshed` needs lineage (on with provenance, the default): the process step "
         "must run while the trace is open",
)
