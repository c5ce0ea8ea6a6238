"""vLLM #41670: CUTLASS FP8 MoE rebuilds its kernel object (new stride tensors) on every
process-weights run, and its quant config keeps the scale of the process-time layer.

Real code: `vllm/model_executor/layers/fused_moe/oracle/fp8.py: make_fp8_moe_kernel` builds
`FusedMoEModularKernel(..., CutlassExpertsFp8(...))`; `CutlassExpertsFp8.__init__`
(`vllm/model_executor/layers/fused_moe/experts/cutlass_moe.py`) allocates `ab_strides1`
(the same tensor as `c_strides2`), `c_strides1` and `ab_strides2` with `torch.full`, and
`apply` passes them to `run_cutlass_moe_fp8`. The quant method stores
`self.moe_quant_config` (a `FusedMoEQuantConfig` whose `_w1.scale` / `_w2.scale` are the
layer's `w13_weight_scale` / `w2_weight_scale` at process time) and `self.moe_kernel`, both
rebuilt by every process-weights run.

Under vLLM's layerwise reload PWAL runs on the restored, transient layer: the new kernel's
strides are new tensors (`stale`: the graph reads the old ones, kept alive here by the
emulated graph; on CUDA the old kernel object is freed with them, `dangling`), and the new
quant config holds the transient scale while the registered `w13_weight_scale` keeps the
captured storage (`diverged`, as the seed's rejected fix).

No fix upstream. `fixed` is the pattern #40390 applied to the unquantized method: build the
quant config and kernel once (`if self.moe_kernel is None`), so reloads only refresh the
registered tensors in place.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import _moe
from ._moe import EXPERTS
from .harness import make_param
from .spec import Case, buggy_and_fixed

__all__ = [
    "EXPERTS", "FusedMoEQuantDesc", "FusedMoEQuantConfig", "CutlassExpertsFp8",
    "FusedMoEModularKernel", "Fp8MoEMethod", "run", "CASE"
]



@dataclass
class FusedMoEQuantDesc:
    scale: torch.Tensor | None = None


@dataclass
class FusedMoEQuantConfig:
    _w1: FusedMoEQuantDesc
    _w2: FusedMoEQuantDesc


class CutlassExpertsFp8:
    def __init__(self, quant_config: FusedMoEQuantConfig):
        self.quant_config = quant_config
        ab_strides1_c_strides2 = torch.full((_moe.E,), _moe.H, dtype=torch.int64)
        self.ab_strides1 = ab_strides1_c_strides2
        self.c_strides2 = ab_strides1_c_strides2
        self.c_strides1 = torch.full((_moe.E,), 2 * _moe.I, dtype=torch.int64)
        self.ab_strides2 = torch.full((_moe.E,), _moe.I, dtype=torch.int64)

    def apply(self, x, w1, w2, topk_weights, topk_ids):
        qc = self.quant_config
        return _moe.cutlass_moe_fp8(x, w1, w2, qc._w1.scale, qc._w2.scale, topk_weights,
                                    topk_ids, self.ab_strides1, self.ab_strides2,
                                    self.c_strides1, self.c_strides2)


class FusedMoEModularKernel:
    def __init__(self, fused_experts):
        self.fused_experts = fused_experts

    def apply(self, *args):
        return self.fused_experts.apply(*args)


class Fp8MoEMethod(_moe.FusedMoEMethodBase):
    """The FP8 MoE quant method with the CUTLASS backend."""

    weight_dtype = torch.float8_e4m3fn

    def __init__(self, build_once: bool):
        self.build_once = build_once
        self.moe_kernel = None
        self.moe_quant_config = None

    def create_weights(self, layer):
        super().create_weights(layer)
        layer.w13_weight_scale = make_param((_moe.E,))
        layer.w2_weight_scale = make_param((_moe.E,))

    def process_weights_after_loading(self, layer):
        if self.build_once and self.moe_kernel is not None:
            return  # a weight update: the registered tensors were refreshed in place
        self.moe_quant_config = FusedMoEQuantConfig(
            _w1=FusedMoEQuantDesc(layer.w13_weight_scale),
            _w2=FusedMoEQuantDesc(layer.w2_weight_scale))
        # make_fp8_moe_kernel(...)
        self.moe_kernel = FusedMoEModularKernel(CutlassExpertsFp8(self.moe_quant_config))

    def apply(self, layer, x, topk_weights, topk_ids):
        return self.moe_kernel.apply(x, layer.w13_weight, layer.w2_weight, topk_weights,
                                     topk_ids)


def run(variant: str, backend: str = "auto"):
    def perturb(m):
        for experts in m.experts():
            experts.quant_method.moe_quant_config._w1.scale.mul_(2.0)
        return "the live quant config's _w1.scale, doubled in place"

    return _moe.run_case(lambda fixed: Fp8MoEMethod(build_once=fixed), variant, CASE.reload,
                         perturb, backend)


_KERNEL = f"{EXPERTS}.quant_method.moe_kernel.fused_experts"
_CONFIG = f"{EXPERTS}.quant_method.moe_quant_config"
CASE = Case(
    name="vllm-41670-cutlass-fp8-moe",
    reference="vLLM #41670",
    source="vllm/model_executor/layers/fused_moe/oracle/fp8.py: make_fp8_moe_kernel; "
           "fused_moe/experts/cutlass_moe.py: CutlassExpertsFp8",
    rebound="the MoE kernel object, rebuilt with new `ab_strides*` / `c_strides*`; "
            "`moe_quant_config._w1.scale` left holding the process-time scale",
    fix="none upstream; here: build quant config and kernel once (as #40390)",
    reload="vllm-layerwise",
    variants=buggy_and_fixed(
        "kernel and quant config rebuilt by every PWAL", "kernel and quant config built once",
        {f"{_KERNEL}.ab_strides1": "stale",
         f"{_KERNEL}.c_strides1": "stale",
         f"{_KERNEL}.ab_strides2": "stale",
         f"{_CONFIG}._w1.scale": "diverged",
         f"{_CONFIG}._w2.scale": "diverged",
         f"{EXPERTS}.w13_weight": "stable"},
        [f"{_KERNEL}.ab_strides1", f"{_CONFIG}._w1.scale", f"{EXPERTS}.w13_weight"]),
    run=run,
    note="on CUDA the rebuilt kernel frees the old strides: dangling there, stale here "
         "(the emulated graph keeps captured storages alive, as capture artifacts can)",
)
