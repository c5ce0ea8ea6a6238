"""vLLM #40390 (NeMo-RL #2895): the MoE weight shuffle re-registers `w13_weight` / `w2_weight`
on every weight update.

Real code: `vllm/model_executor/layers/fused_moe/unquantized_fused_moe_method.py`,
`UnquantizedFusedMoEMethod._setup_kernel` shuffles the expert weights into the kernel's
layout (`convert_to_unquantized_kernel_format`; AITER's `shuffle_weight` on ROCm) and
registered the result with `replace_parameter(layer, "w13_weight", w13_new)`: a new
Parameter, a new storage. RL refits (NeMo-RL's `update_weights_via_ipc_zmq`, verl) load
new weights into the live parameters and run `process_weights_after_loading` again, so the
decode CUDA graphs kept reading the old weights ("decode-only garbage"; prefill runs eager
and looked fine). Fixed in vLLM 0.21 by `replace_parameter(..., prefer_copy=is_weight_update)`
with `is_weight_update = self.moe_kernel is not None`.

vLLM's layerwise reload (which copies processed values back into the kernel tensors) masks
this bug; the case uses the in-place refit the thread describes.
"""

from __future__ import annotations

import torch

from . import _moe
from ._moe import EXPERTS
from .harness import replace_parameter

__all__ = [
    "EXPERTS", "BLOCK", "shuffle_weight", "unshuffle_weight", "UnquantizedFusedMoEMethod",
    "run", "CASE"
]

BLOCK = 4  # the shuffle's block along the input dimension


def shuffle_weight(w: torch.Tensor) -> torch.Tensor:
    """A shape-preserving layout change (AITER's `shuffle_weight` keeps shape, moves bytes)."""
    *lead, k = w.shape
    return w.reshape(*lead, k // BLOCK, BLOCK).transpose(-1, -2).reshape(*lead, k).contiguous()


def unshuffle_weight(w: torch.Tensor) -> torch.Tensor:
    *lead, k = w.shape
    return w.reshape(*lead, BLOCK, k // BLOCK).transpose(-1, -2).reshape(*lead, k)


class UnquantizedFusedMoEMethod(_moe.UnquantizedMoEMethod):
    def __init__(self, prefer_copy_on_update: bool):
        self.prefer_copy_on_update = prefer_copy_on_update
        self.moe_kernel = None

    def process_weights_after_loading(self, layer):
        w13_new, w2_new = shuffle_weight(layer.w13_weight), shuffle_weight(layer.w2_weight)
        is_weight_update = self.moe_kernel is not None
        prefer_copy = is_weight_update and self.prefer_copy_on_update
        replace_parameter(layer, "w13_weight", w13_new, prefer_copy=prefer_copy)
        replace_parameter(layer, "w2_weight", w2_new, prefer_copy=prefer_copy)
        if not is_weight_update:
            self.moe_kernel = "rocm_aiter_fused_experts"  # set up once

    def apply(self, layer, x, topk_weights, topk_ids):  # the kernel reads the shuffled layout
        return _moe.dense_moe(x, unshuffle_weight(layer.w13_weight),
                              unshuffle_weight(layer.w2_weight), topk_weights, topk_ids,
                              _moe.silu_and_mul)


CASE = _moe.refit_case(
    UnquantizedFusedMoEMethod,
    name="vllm-40390-moe-shuffle",
    reference="vLLM #40390, NeMo-RL #2895",
    source="vllm/model_executor/layers/fused_moe/unquantized_fused_moe_method.py: "
           "UnquantizedFusedMoEMethod._setup_kernel",
    rebound="`w13_weight` / `w2_weight` re-registered by `replace_parameter` after the "
            "shuffle on every weight update",
    fix="`replace_parameter(..., prefer_copy=is_weight_update)`",
    buggy="replace_parameter without prefer_copy", fixed="prefer_copy=is_weight_update",
    note="on CUDA the replaced parameters are freed (dangling) unless something else holds them",
)
run = CASE.run
