"""A Marlin-style act-order GEMM, registered with vLLM's `gptq_marlin_gemm` schema.

Like `ops.py`, the op lives under this project's namespace (`graphtrace::gptq_marlin_gemm`)
and its body is a small reference computation. What matters to graphtrace is the schema:
every tensor argument the real kernel takes (`workspace`, `g_idx_or_none`, `perm_or_none`,
...) is an argument here too, so the recorder sees the op read all of them.

Reference semantics (act-order, symmetric `uint4b8` weights stored one value per int8):
the op permutes the activation columns by `perm` itself (Marlin does this inside the
kernel), then multiplies by the row-permuted weight, each (sorted) row scaled by the
scales of the group `g_idx` assigns it. The workspace is Marlin's zeroed lock buffer; the
reference body only checks its size, as the values never reach the output.
"""

from __future__ import annotations

import torch

from .ops import NAMESPACE

__all__ = []

_lib = torch.library.Library(NAMESPACE, "FRAGMENT")
_lib.define(
    "gptq_marlin_gemm(Tensor a, Tensor? c_or_none, Tensor b_q_weight, Tensor? b_bias_or_none, "
    "Tensor b_scales, Tensor? global_scale, Tensor? b_zeros_or_none, Tensor? g_idx_or_none, "
    "Tensor? perm_or_none, Tensor workspace, int b_q_type, SymInt size_m, SymInt size_n, "
    "SymInt size_k, bool is_k_full, bool use_atomic_add, bool use_fp32_reduce, "
    "bool is_zp_float) -> Tensor"
)


def _gptq_marlin_gemm(a, c_or_none, b_q_weight, b_bias_or_none, b_scales, global_scale,
                      b_zeros_or_none, g_idx_or_none, perm_or_none, workspace, b_q_type,
                      size_m, size_n, size_k, is_k_full, use_atomic_add, use_fp32_reduce,
                      is_zp_float):
    if workspace.numel() == 0:
        raise RuntimeError("gptq_marlin_gemm: empty workspace")
    if perm_or_none is not None and perm_or_none.numel() > 0:
        a = a.index_select(1, perm_or_none.long())
    w = b_q_weight.to(a.dtype)
    if b_zeros_or_none is not None and b_zeros_or_none.numel() > 0:
        raise NotImplementedError("reference gptq_marlin_gemm: zero points not modelled")
    if g_idx_or_none is not None and g_idx_or_none.numel() > 0:
        rows = b_scales.to(a.dtype).index_select(0, g_idx_or_none.long())
    else:
        group = size_k // b_scales.shape[0]
        rows = b_scales.to(a.dtype).repeat_interleave(group, dim=0)
    out = a @ (w * rows)
    if global_scale is not None:
        out = out * global_scale
    if b_bias_or_none is not None:
        out = out + b_bias_or_none
    return out


def _gptq_marlin_gemm_meta(a, c_or_none, b_q_weight, b_bias_or_none, b_scales, *rest):
    size_n = rest[7]
    return a.new_empty((a.shape[0], size_n))


for _key in ("CPU", "CUDA"):
    _lib.impl("gptq_marlin_gemm", _gptq_marlin_gemm, _key)
_lib.impl("gptq_marlin_gemm", _gptq_marlin_gemm_meta, "Meta")

gptq_marlin_gemm = torch.ops.graphtrace.gptq_marlin_gemm
