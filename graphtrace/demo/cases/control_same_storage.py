"""Negative controls: weight-update bugs whose values or layout go wrong in the SAME storage.

graphtrace answers one question: do the captured graphs still read the storages the model's
owners hold? These bugs corrupt values while every storage stays put, so the graphs and the
eager model read the same (wrong) bytes; a stale-read tool must stay silent on them, since a
false alarm costs as much trust as a miss. graphtrace is not meant to catch them (a weight
checksum or an output comparison against a reference is).

* `nonidempotent-pwal`: process-weights folds the input scale into the weight scale in
  place (`weight_scale.mul_(input_scale)`); a refit that ships only the weights (the
  in-place reload: load into the live parameters, process again) folds it a second time:
  the scale drifts, in the same storage (pattern of the RFC #48312 idempotence checks);
* `wrong-layout`: the update writes the new weight transposed into the live parameter's
  storage (`weight.copy_(new.t().reshape(weight.shape))`): wrong bytes, same storage.

Expected: no stale-like edge; the weights' reads `stable`; the flip test follows (the graphs
read what the eager model reads, wrong or not). Lineage does see the first: the process
step's in-place `mul_` on a registered scale is a `non-idempotent step` finding (Note
[non-idempotent steps] in graphtrace/lineage/steps.py), which names the storage, op and line.
"""

from __future__ import annotations

import dataclasses

import torch

from .harness import CaseModel, MethodLayer, make_param
from .spec import Case, Finds, control

__all__ = [
    "K", "N", "BATCH_SIZES", "ScaledLinearMethod", "ControlModel", "run",
    "CASE"
]

K = N = 8
BATCH_SIZES = (1, 2)


class ScaledLinearMethod:
    def create_weights(self, layer):
        layer.weight = make_param((N, K))
        layer.weight_scale = make_param((N,))
        layer.input_scale = make_param((1,))

    def process_weights_after_loading(self, layer):
        layer.weight_scale.mul_(layer.input_scale)  # in place, and not idempotent

    def apply(self, layer, x):
        return (x @ layer.weight.T) * layer.weight_scale


class ControlModel(CaseModel):
    def __init__(self, n_layers: int = 2):
        super().__init__()
        self.layers = torch.nn.ModuleList(
            MethodLayer(ScaledLinearMethod()) for _ in range(n_layers))

    def checkpoint(self, seed, only=None):
        g = torch.Generator().manual_seed(seed)
        ckpt = {}
        for i in range(len(self.layers)):
            ckpt[f"layers.{i}.weight"] = torch.randn(N, K, generator=g) / K ** 0.5
            ckpt[f"layers.{i}.weight_scale"] = 0.5 + torch.rand(N, generator=g)
            ckpt[f"layers.{i}.input_scale"] = torch.tensor([1.5])
        return {k: v for k, v in ckpt.items() if only is None or k.endswith(only)}


def run(variant: str, backend: str = "auto"):
    from .harness import capture_reload_diff, reload_inplace

    model = ControlModel()
    model.load(model.checkpoint(0))
    g = torch.Generator().manual_seed(5)
    inputs = [(f"bs{b}", torch.randn(b, K, generator=g)) for b in BATCH_SIZES]

    if variant == "nonidempotent-pwal":
        def reload(m):  # a refit that ships only the weights, then processes again
            return reload_inplace(m, m.checkpoint(1, only=".weight"))
    else:
        def reload(m):  # the new weight written transposed into the live storage
            with torch.no_grad():
                for name, new in m.checkpoint(1, only=".weight").items():
                    w = m.get_parameter(name)
                    w.copy_(new.t().reshape(w.shape))
            return "in-place copy (wrong layout)"

    def perturb(m):
        for layer in m.layers:
            layer.weight.neg_()
        return "the live weight, negated in place"

    return capture_reload_diff(model, inputs, reload, perturb)


CASE = Case(
    name="control-same-storage",
    reference="negative controls (RFC #48312 idempotence checks)",
    source="any process_weights_after_loading / weight update that writes in place",
    rebound="nothing: values (a scale folded twice) or layout (transposed bytes) go wrong "
            "in the same storage",
    fix="not a stale read: graphtrace must report it clean",
    reload="vllm-inplace",
    variants=(
        dataclasses.replace(
            control("nonidempotent-pwal", "weight_scale.mul_(input_scale) run again",
                    ["layers.*.weight_scale", "layers.*.weight"]),
            finds=(Finds("non-idempotent step", "layers.*.weight_scale"),)),
        control("wrong-layout", "new weight copied transposed into the storage",
                ["layers.*.weight"]),
    ),
    run=run,
)
