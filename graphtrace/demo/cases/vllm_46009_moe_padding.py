"""vLLM #46009: the ROCm MoE weight padding assigned through `.data =` on every process run.

Real code: `vllm/model_executor/layers/fused_moe/unquantized_fused_moe_method.py`,
`_maybe_pad_weight` (with `VLLM_ROCM_MOE_PADDING`) returns
`F.pad(weight, (0, num_pad))[..., :-num_pad]`: a view of a new, padded storage; the method
assigned it with `layer.w13_weight.data = self._maybe_pad_weight(layer.w13_weight.data)`.
The Parameter object stays, its storage is swapped: on a weight update (new values loaded
into the live parameters, then process-weights again) the graphs keep reading the
capture-time storage. The fix copies into the existing (already padded) storage instead.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import _moe
from ._moe import EXPERTS

__all__ = [
    "EXPERTS", "NUM_PAD", "maybe_pad_weight", "is_padded", "PaddedMoEMethod", "run", "CASE"
]

NUM_PAD = 4


def maybe_pad_weight(weight: torch.Tensor) -> torch.Tensor:
    return F.pad(weight, (0, NUM_PAD), "constant", 0)[..., :-NUM_PAD]


def is_padded(weight: torch.Tensor) -> bool:
    return weight.stride(-2) == weight.shape[-1] + NUM_PAD


class PaddedMoEMethod(_moe.UnquantizedMoEMethod):
    def __init__(self, copy_on_update: bool):
        self.copy_on_update = copy_on_update

    def process_weights_after_loading(self, layer):
        for name in ("w13_weight", "w2_weight"):
            param = getattr(layer, name)
            padded = maybe_pad_weight(param.data)
            if self.copy_on_update and is_padded(param.data):
                param.data.copy_(padded)  # the fix: same (padded) storage
            else:
                param.data = padded  # the bug: a new storage on every run


CASE = _moe.refit_case(
    PaddedMoEMethod,
    name="vllm-46009-moe-padding",
    reference="vLLM #46009",
    source="vllm/model_executor/layers/fused_moe/unquantized_fused_moe_method.py: "
           "_maybe_pad_weight",
    rebound="`w13_weight` / `w2_weight` storage swapped by `param.data = padded` (same "
            "Parameter object, new storage)",
    fix="`copy_` into the existing padded storage",
    buggy="param.data = F.pad(...)[..., :-pad] on every run",
    fixed="copy_ into the padded storage on updates",
)
run = CASE.run
