"""vLLM #50521: FlashInfer CUTLASS MoE keeps its SwiGLU constants on the experts object,
which every process-weights run rebuilds.

Real code: `vllm/model_executor/layers/fused_moe/experts/flashinfer_cutlass_moe.py`,
`FlashInferExperts.__init__` allocates per-expert `gemm1_alpha`, `gemm1_beta` and
`gemm1_clamp_limit` (gpt-oss: 1.702, 1.0, 7.0) and `apply` passes them to
`flashinfer_cutlass_fused_moe` (`swiglu_alpha`, `swiglu_beta`, `swiglu_limit`) on every
forward. The quant methods (e.g. `Mxfp4MoEMethod`) rebuild the modular kernel, experts
object included, in `process_weights_after_loading`, so after a reload the constants are new
tensors while captured graphs read the old ones. The PR measured 72/72 graph-visible
tensors moved and every capture-time storage expired (dangling on CUDA); here the emulated
graph keeps them alive, so the verdict is `stale` (impact `latent`: the values are
config-derived, the same after every reload). The fix (#50521) registers them on the layer
with `replace_parameter(prefer_copy=True)` and the experts read them through the layer.
"""

from __future__ import annotations

import torch

from . import _moe
from .harness import replace_parameter
from .spec import Case, buggy_and_fixed

__all__ = [
    "EXPERTS", "CONSTANTS", "FlashInferExperts", "FlashInferMoEMethod",
    "FusedMoEModularKernel", "run", "CASE"
]

EXPERTS = "layers.*.mlp.experts"
CONSTANTS = {"gemm1_alpha": 1.702, "gemm1_beta": 1.0, "gemm1_clamp_limit": 7.0}


class FlashInferExperts:
    def __init__(self, layer=None):
        self.layer = layer  # the fix threads the layer in
        for name, value in CONSTANTS.items():
            t = torch.full((_moe.E,), value, dtype=torch.float32)
            if layer is None:
                setattr(self, name, t)  # the bug: unregistered, remade with the object
            else:
                replace_parameter(layer, name, t, prefer_copy=True)

    def constant(self, name):
        return getattr(self.layer, name) if self.layer is not None else getattr(self, name)

    def apply(self, x, w13, w2, topk_weights, topk_ids):
        return _moe.flashinfer_cutlass_fused_moe(
            x, topk_ids, topk_weights, w13, w2, self.constant("gemm1_alpha"),
            self.constant("gemm1_beta"), self.constant("gemm1_clamp_limit"))


class FlashInferMoEMethod(_moe.FusedMoEMethodBase):
    def __init__(self, register_constants: bool):
        self.register_constants = register_constants
        self.moe_kernel = None

    def process_weights_after_loading(self, layer):
        # the modular kernel, experts object included, is rebuilt on every run
        self.moe_kernel = FusedMoEModularKernel(FlashInferExperts(layer if self.register_constants
                                                        else None))

    def apply(self, layer, x, topk_weights, topk_ids):
        return self.moe_kernel.fused_experts.apply(x, layer.w13_weight, layer.w2_weight,
                                                   topk_weights, topk_ids)


class FusedMoEModularKernel:  # reduced to what holds the experts
    def __init__(self, fused_experts):
        self.fused_experts = fused_experts


def run(variant: str, backend: str = "auto"):
    def perturb(m):
        for experts in m.experts():
            experts.quant_method.moe_kernel.fused_experts.constant("gemm1_alpha").add_(1.0)
        return "the live gemm1_alpha, +1 in place"

    return _moe.run_case(FlashInferMoEMethod, variant, CASE.reload, perturb, backend)


_HELD = f"{EXPERTS}.quant_method.moe_kernel.fused_experts"
CASE = Case(
    name="vllm-50521-flashinfer-swiglu",
    reference="vLLM #50521",
    source="vllm/model_executor/layers/fused_moe/experts/flashinfer_cutlass_moe.py: "
           "FlashInferExperts",
    rebound="SwiGLU constants `gemm1_alpha`, `gemm1_beta`, `gemm1_clamp_limit`, unregistered "
            "attributes of the experts object the quant method rebuilds",
    fix="register them on the layer (`replace_parameter(prefer_copy=True)`), read through it",
    reload="vllm-layerwise",
    variants=buggy_and_fixed(
        "constants on the rebuilt experts object", "constants registered on the layer",
        {f"{_HELD}.{n}": "stale" for n in CONSTANTS}, [f"{EXPERTS}.{n}" for n in CONSTANTS]),
    run=run,
    note="on CUDA the old experts object frees the constants: dangling there (as the PR "
         "measured), stale here",
)
