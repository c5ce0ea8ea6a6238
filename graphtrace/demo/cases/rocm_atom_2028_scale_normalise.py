"""ROCm ATOM #2028: a process step normalises a scale in place on every sync (2^N after N).

On ROCm, an fp8 checkpoint in e4m3fn is run as e4m3fnuz, whose values are half as large for
the same bits, so the process step doubles the weight scale. Done in place on the loaded
parameter (`weight_scale.mul_(2)`), it is not idempotent: a weight sync that ships only the
weights and processes again doubles the scale again, 2^N after N syncs. Every storage stays
put and a same-weights reload run once looks right, so identity and freshness both pass it;
lineage names the step (Note [non-idempotent steps] in graphtrace/lineage/steps.py): a
`non-idempotent step` finding on `layers.N.weight_scale`, with the op, the line and the
number of syncs.

Variants:

* `buggy`: three syncs (load the weights, process again): the scale is 8x, the graphs read
  it (the same storage: `stable`), and the finding names `layers.N.weight_scale`;
* `fixed`: the process step writes the runtime scale from the checkpoint's
  (`torch.mul(weight_scale_ckpt, 2, out=weight_scale)`): idempotent, no finding;
* `optimizer-step` (negative control, on the fixed model): the update is an optimizer step
  (SGD), an in-place update of every parameter from its own value that is training, not a
  process step: no finding, every read `stable`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .harness import CaseModel, MethodLayer, capture_reload_diff, make_param
from .spec import Case, Expect, Finds, Variant

__all__ = ["K", "N", "SYNCS", "BATCH_SIZES", "Fp8FnuzMethod", "AtomModel",
           "run", "CASE"]

K = N = 8
SYNCS = 3
BATCH_SIZES = (1, 2)


@dataclass(eq=False)  # compared and hashed by identity, as the plain class it stands for
class Fp8FnuzMethod:
    """The e4m3fn -> e4m3fnuz process step: the scale doubles (`fixed`: from the
    checkpoint's scale, kept apart, instead of in place)."""

    fixed: bool = False

    def create_weights(self, layer):
        layer.weight = make_param((N, K))
        layer.weight_scale = make_param((N,))
        if self.fixed:  # the checkpoint's scale, kept apart from the runtime one
            layer.weight_scale_ckpt = make_param((N,))

    def process_weights_after_loading(self, layer):
        with torch.no_grad():
            if self.fixed:
                torch.mul(layer.weight_scale_ckpt, 2.0, out=layer.weight_scale)
            else:
                layer.weight_scale.mul_(2.0)  # in place, from its own value

    def apply(self, layer, x):
        return (x @ layer.weight.t()) * layer.weight_scale


class AtomModel(CaseModel):
    def __init__(self, n_layers: int = 2, fixed: bool = False):
        super().__init__()
        self.fixed = fixed
        self.layers = torch.nn.ModuleList(
            MethodLayer(Fp8FnuzMethod(fixed)) for _ in range(n_layers))

    def checkpoint(self, seed: int, weights_only: bool = False) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(seed)
        out = {}
        for i in range(len(self.layers)):
            out[f"layers.{i}.weight"] = torch.randn(N, K, generator=g) / K ** 0.5
            if not weights_only:
                scale = 0.5 + torch.rand(N, generator=g)
                out[f"layers.{i}.weight_scale"] = scale
                if self.fixed:
                    out[f"layers.{i}.weight_scale_ckpt"] = scale
        return out


def run(variant: str, backend: str = "auto"):
    model = AtomModel(fixed=variant in ("fixed", "optimizer-step")).eval()
    g = torch.Generator().manual_seed(5)
    inputs = [(f"bs{b}", torch.randn(b, K, generator=g)) for b in BATCH_SIZES]

    def sync(m):
        if variant == "optimizer-step":
            for p in m.parameters():
                p.requires_grad_(True)
            opt = torch.optim.SGD(m.parameters(), lr=0.01)
            with torch.enable_grad():
                m(inputs[1][1]).square().sum().backward()
            opt.step()
            for p in m.parameters():
                p.requires_grad_(False)
            return "an optimizer step (SGD)"
        with torch.no_grad():
            for _ in range(SYNCS):  # weights only, then the process step again
                m.load_weights(m.checkpoint(1, weights_only=True))
                m.process_weights_after_loading()
        return f"{SYNCS} syncs: load the weights, process again"

    out = capture_reload_diff(model, inputs, sync,
                              setup=lambda m: m.load(m.checkpoint(0)))  # first load, in trace
    out.scale = [layer.weight_scale.detach().clone() for layer in model.layers]
    return out


_READ = ("layers.*.weight", "layers.*.weight_scale")

CASE = Case(
    name="rocm-atom-2028-scale-normalise",
    reference="ROCm ATOM #2028",
    source="the fp8 e4m3fn -> e4m3fnuz process step (weight_scale * 2)",
    rebound="nothing: the process step doubles the loaded weight scale in place, so every "
            "sync that processes again doubles it again (2^N after N syncs)",
    fix="derive the runtime scale from the checkpoint's into its own storage (out= or copy_), "
        "never in place from its own value",
    reload="sync-process",
    variants=(
        Variant("buggy", "buggy", f"{SYNCS} syncs, each doubling the scale in place",
                tuple(Expect(p, "stable") for p in _READ),
                finds=(Finds("non-idempotent step", "layers.*.weight_scale"),)),
        Variant("fixed", "fixed", "the runtime scale written from the checkpoint's",
                tuple(Expect(p, "stable") for p in _READ)),
        Variant("optimizer-step", "control", "an SGD step updates every parameter in place",
                tuple(Expect(p, "stable") for p in _READ)),
    ),
    run=run,
    note="the finding needs lineage (on with provenance, the default): the syncs must run "
         "while the trace is open",
)
