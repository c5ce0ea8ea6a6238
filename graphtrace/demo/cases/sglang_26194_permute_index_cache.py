"""SGLang #26194: cached permutation indices, zeroed by the memory saver, reused after resume.

SGLang's `UnquantizedFusedMoEMethod` (BF16 experts on the FlashInfer TRT-LLM path) keeps a
dict `_cache_permute_indices` of permutation-index tensors on the device: computed from the
weights' *shapes* by FlashInfer's `_maybe_get_cached_w3_w1_permute_indices` /
`get_w2_permute_indices_with_cache`, and used by `process_weights_after_loading` to shuffle
each expert's rows into the kernel's layout. Colocated RL pauses the engine before a weight
update; the memory saver releases the weights region, whose memory comes back re-mapped
(zeroed) on resume with no torch op at all (no version counter moves). The dict still holds
the tensors, so the post-load processing after the update shuffles the *new* weights with
garbage indices: the weights the graphs read are wrong, at the right address. Identity and
freshness both pass it (every storage is where its owner points, and the weights were
rewritten after their sources); lineage names the read: a `carried-over state` finding
(Note [carried-over state] in graphtrace/lineage/steps.py) on
`layers.N.quant_method._cache_permute_indices[...]`, with the op that read it, its line, and
the weight it was combined with.

Variants:

* `buggy`: the cache is filled in the first post-load cycle and reused after the pause and
  resume: every read `stable`, the finding names the cache entries, and the weights are
  shuffled with zeroed indices;
* `fixed` (sgl-project/sglang PR #33016): the cache is cleared at the start of each post-load
  cycle, so the indices are rebuilt after the load: clean, and the weights are right.

The pause is emulated on CPU by zeroing the weights region's memory with `ctypes.memset`
(no torch op: lineage and the version counters see nothing, as with the real memory saver).
"""

from __future__ import annotations

import ctypes

import torch

from .harness import CaseModel, MethodLayer, capture_reload_diff, make_param
from .spec import Case, Expect, Finds, Outcome, Variant

__all__ = ["E", "H", "I", "BATCH_SIZES", "permute_indices", "UnquantizedFusedMoEMethod",
           "MoEModel", "pause_resume", "run", "CASE"]

E, H, I = 2, 8, 4   # experts, hidden size, intermediate size per partition
BATCH_SIZES = (1, 2)


def permute_indices(cache: dict, kind: str, weight: torch.Tensor) -> torch.Tensor:
    """The row permutation of one expert's weight in the kernel's layout, from its shape only,
    memoized in `cache` by (kind, shape), as FlashInfer's `*_permute_indices_with_cache`."""
    key = (kind, weight.shape)
    if key not in cache:
        rows = torch.arange(weight.shape[0])
        if kind == "w3_w1":  # gate and up rows interleaved (the gated activation's layout)
            cache[key] = rows.view(2, -1).t().reshape(-1)
        else:                # row pairs swapped (a stand-in for the tile shuffle)
            cache[key] = rows.view(-1, 2).flip(1).reshape(-1)
    return cache[key]


class UnquantizedFusedMoEMethod:
    """SGLang's BF16 MoE method on the FlashInfer TRT-LLM path (fp32 here, on CPU)."""

    def __init__(self, clear_each_cycle: bool = False):
        self.clear_each_cycle = clear_each_cycle
        self._cache_permute_indices: dict = {}

    def create_weights(self, layer):
        layer.w13_weight = make_param((E, 2 * I, H))
        layer.w2_weight = make_param((E, H, I))

    def process_weights_after_loading(self, layer):
        if self.clear_each_cycle:  # PR #33016: once at the start of each post-load cycle
            self._cache_permute_indices.clear()
        with torch.no_grad():
            for name, kind in (("w13_weight", "w3_w1"), ("w2_weight", "w2")):
                w = getattr(layer, name)
                for i in range(E):
                    idx = permute_indices(self._cache_permute_indices, kind, w.data[i])
                    w.data[i] = w.data[i].clone()[idx].contiguous()

    def apply(self, layer, x):
        """Every token through every expert, read in the shuffled layout."""
        out = torch.zeros_like(x)
        for i in range(E):
            w13 = layer.w13_weight[i]
            h = torch.nn.functional.silu(x @ w13[0::2].t()) * (x @ w13[1::2].t())
            w2 = layer.w2_weight[i].view(-1, 2, I).flip(1).reshape(H, I)
            out = out + h @ w2.t()
        return out


class MoEModel(CaseModel):
    def __init__(self, n_layers: int = 2, clear_each_cycle: bool = False):
        super().__init__()
        self.layers = torch.nn.ModuleList(
            MethodLayer(UnquantizedFusedMoEMethod(clear_each_cycle)) for _ in range(n_layers))

    def checkpoint(self, seed: int) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(seed)
        return {k: torch.randn(v.shape, generator=g) / H ** 0.5
                for k, v in self.named_parameters()}

    def expected(self, checkpoint: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The processed weights a correct post-load cycle makes from `checkpoint`."""
        out = {}
        for name, w in checkpoint.items():
            kind = "w3_w1" if name.endswith("w13_weight") else "w2"
            out[name] = torch.stack([w[i][permute_indices({}, kind, w[i])] for i in range(E)])
        return out


def pause_resume(model: MoEModel) -> None:
    """The memory saver's pause and resume of the weights region, emulated: its memory (the
    parameters and the method's cached indices) comes back zeroed, written by no torch op."""
    tensors = list(model.parameters())
    for layer in model.layers:
        tensors += list(layer.quant_method._cache_permute_indices.values())
    for t in tensors:
        storage = t.untyped_storage()
        ctypes.memset(storage.data_ptr(), 0, storage.nbytes())


def run(variant: str, backend: str = "auto") -> Outcome:
    model = MoEModel(clear_each_cycle=variant == "fixed").eval()
    g = torch.Generator().manual_seed(5)
    inputs = [(f"bs{b}", torch.randn(b, H, generator=g)) for b in BATCH_SIZES]
    new = model.checkpoint(1)

    def update(m):
        pause_resume(m)
        with torch.no_grad():
            m.load_weights(new)
            m.process_weights_after_loading()
        return "pause/resume (memory saver), load_weights, process_weights_after_loading"

    return capture_reload_diff(model, inputs, update,  # the first post-load cycle in trace
                               setup=lambda m: m.load(m.checkpoint(0)))


_READ = ("layers.*.w13_weight", "layers.*.w2_weight")

CASE = Case(
    name="sglang-26194-permute-index-cache",
    reference="SGLang #26194 (PRs #33016, #39468)",
    source="python/sglang/srt/layers/quantization/unquant.py "
           "(UnquantizedFusedMoEMethod._cache_permute_indices, process_weights_after_loading)",
    rebound="nothing: the method's cached permutation indices (a dict of device tensors, no "
            "parameter or buffer) are zeroed by the memory saver's pause and reused by the "
            "next post-load cycle to shuffle the new weights",
    fix="clear the permutation-index cache at the start of each post-load cycle (PR #33016), "
        "or keep it where the memory saver does not release it (host memory: PR #39468)",
    reload="memory-saver-update",
    variants=(
        Variant("buggy", "buggy", "the cache filled in the first cycle is reused after resume",
                tuple(Expect(p, "stable") for p in _READ),
                finds=(Finds("carried-over state",
                             "layers.*.quant_method._cache_permute_indices[*]"),)),
        Variant("fixed", "fixed", "the cache is cleared at the start of each post-load cycle",
                tuple(Expect(p, "stable") for p in _READ)),
    ),
    run=run,
    note="the finding needs lineage (on with provenance, the default): both post-load cycles "
         "must run while the trace is open",
)
