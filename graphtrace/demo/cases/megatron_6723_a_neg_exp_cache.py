"""Megatron-LM #6723: a cache derived from a parameter, filled once, read by the graphs.

`MambaMixer` keeps `self._A_neg_exp_cache = -torch.exp(self.A_log.float())`, computed on the
first forward and invalidated only by `train(True)`. An RL refit copies new weights into
the live parameters in place ("every parameter delivered correctly"), so every storage the
captured graphs read is still the one its owner holds: identity is fine. But the cache
still holds `-exp(old A_log)`, and the graphs (and the eager model) read it: a token
probability error of 1.59e12 in the report. Freshness (Note [freshness] in
graphtrace/verdict.py) finds it: lineage recorded that the cache was derived from `A_log`,
whose version counter advanced since, and nothing wrote the cache after.

Variants:

* `buggy`: the cache is filled once; the refit copies new weights in place: the cache's
  reads are `unrefreshed`, `derived_from` `layers.N.A_log`;
* `invalidate-only`: the refit then drops the cache (`train(True)`, Megatron's own
  invalidation) and the next eager forward builds a new one: the graphs still read the old
  one, whose owner moved: `stale` (identity);
* `fixed`: the refit recomputes the cache in place (`cache.copy_(-exp(A_log))`): clean;
* `graph-rewrites` (negative control): the forward writes the cache itself on every call
  (`torch.neg(torch.exp(A_log), out=cache)`), so every replay recomputes it from the live
  A_log: clean, and the graphs follow a change of A_log.

The graphs are captured after a warm-up forward inside the trace (as CUDA graphs are), so
the cache exists before the capture; the refit runs inside the trace.
"""

from __future__ import annotations

import torch
from torch import nn

from .harness import CaseModel, capture_reload_diff
from .spec import Case, Expect, Outcome, Variant

__all__ = ["D", "BATCH_SIZES", "MambaMixer", "MambaModel", "run", "CASE"]

D = 8
BATCH_SIZES = (1, 2)


class MambaMixer(nn.Module):
    def __init__(self, rewrite_in_forward: bool = False):
        super().__init__()
        self.in_proj = nn.Linear(D, D, bias=False)
        self.A_log = nn.Parameter(torch.zeros(D), requires_grad=False)
        self.D = nn.Parameter(torch.ones(D), requires_grad=False)
        self.rewrite_in_forward = rewrite_in_forward
        self._A_neg_exp_cache = torch.zeros(D) if rewrite_in_forward else None

    def train(self, mode: bool = True):
        if mode and not self.rewrite_in_forward:
            self._A_neg_exp_cache = None  # Megatron's only invalidation
        return super().train(mode)

    def a_neg_exp(self) -> torch.Tensor:
        if self.rewrite_in_forward:  # the graph itself rewrites it on every replay
            return torch.neg(torch.exp(self.A_log.float()), out=self._A_neg_exp_cache)
        if self._A_neg_exp_cache is None:  # filled once
            self._A_neg_exp_cache = -torch.exp(self.A_log.float())
        return self._A_neg_exp_cache

    def refresh(self) -> None:
        """The fix: recompute the derived cache in place, so its storage stays put."""
        with torch.no_grad():
            self._A_neg_exp_cache.copy_(-torch.exp(self.A_log.float()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.in_proj(x)) * self.a_neg_exp() + self.D


class MambaModel(CaseModel):
    def __init__(self, n_layers: int = 2, rewrite_in_forward: bool = False):
        super().__init__()
        self.layers = nn.ModuleList(MambaMixer(rewrite_in_forward) for _ in range(n_layers))

    def checkpoint(self, seed: int) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(seed)
        return {k: torch.randn(v.shape, generator=g) * 0.5 for k, v in self.state_dict().items()}

    def refit(self, checkpoint: dict[str, torch.Tensor]) -> None:
        """Copy every parameter in place (the RL refit: identity is kept)."""
        with torch.no_grad():
            for name, param in self.named_parameters():
                param.copy_(checkpoint[name])


def run(variant: str, backend: str = "auto") -> Outcome:
    model = MambaModel(rewrite_in_forward=variant == "graph-rewrites").eval()
    model.refit(model.checkpoint(0))
    g = torch.Generator().manual_seed(5)
    inputs = [(f"bs{b}", torch.randn(b, D, generator=g)) for b in BATCH_SIZES]

    def reload(m):
        m.refit(m.checkpoint(1))
        if variant == "fixed":
            for layer in m.layers:
                layer.refresh()
        elif variant == "invalidate-only":
            m.train(True)
            m.eval()
            with torch.no_grad():
                m(inputs[0][1])  # the next forward builds a new cache; the graphs keep the old
        return "in-place refit" + (" + in-place refresh" if variant == "fixed" else "")

    def perturb(m):
        with torch.no_grad():
            for layer in m.layers:
                layer.A_log.add_(1.0)
        return "A_log, changed in place"

    def warm_up(m):  # inside the trace: the cache is filled here
        with torch.no_grad():
            m(inputs[0][1])

    flips = CASE.variant(variant).flip is not None
    return capture_reload_diff(model, inputs, reload, perturb if flips else None,
                               setup=warm_up)


_CACHE = "layers.*._A_neg_exp_cache"

CASE = Case(
    name="megatron-6723-a-neg-exp-cache",
    reference="Megatron-LM #6723",
    source="megatron/core/ssm/mamba_mixer.py (MambaMixer._A_neg_exp_cache)",
    rebound="nothing: `_A_neg_exp_cache = -exp(A_log)`, a plain attribute filled on the "
            "first forward, keeps its storage while a refit copies new A_log in place",
    fix="recompute the derived cache in place after every weight update "
        "(cache.copy_(-exp(A_log))), or compute it inside the captured forward",
    reload="inplace-refit",
    variants=(
        Variant("buggy", "buggy", "cache filled once; the refit copies A_log in place",
                (Expect(_CACHE, "unrefreshed"), Expect("layers.*.in_proj.weight", "stable")),
                flip="frozen"),
        Variant("invalidate-only", "buggy",
                "the refit drops the cache (train(True)); the next forward builds a new one",
                (Expect(_CACHE, "stale"),), flip="frozen"),
        Variant("fixed", "fixed", "the refit recomputes the cache in place",
                (Expect(_CACHE, "stable"),)),
        Variant("graph-rewrites", "control",
                "the forward rewrites the cache from A_log on every call (and replay)",
                (Expect(_CACHE, "stable"),), flip="follows"),
    ),
    run=run,
    note="`unrefreshed` needs lineage (on with provenance, the default): the cache must be "
         "filled while the trace is open",
)
