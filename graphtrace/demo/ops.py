"""Custom ops with vLLM's real schemas, registered under this project's namespace.

`permute_cols`, `machete_mm` and `gptq_marlin_gemm` mirror `_C::permute_cols`,
`_C::machete_mm` and vLLM's Marlin act-order GEMM; the bodies are small CPU/CUDA reference
computations (a column gather, dequantised matmuls), enough to make outputs depend on every
tensor the real kernels read. What matters to graphtrace is the schema: every tensor argument
the real kernel takes (`workspace`, `g_idx_or_none`, `perm_or_none`, ...) is an argument here
too, so the recorder sees the op read all of them.
"""

from __future__ import annotations

import torch

__all__ = ["NAMESPACE"]

NAMESPACE = "graphtrace"

_lib = torch.library.Library(NAMESPACE, "DEF")
_lib.define("permute_cols(Tensor A, Tensor perm) -> Tensor")
_lib.define(
    "machete_mm(Tensor A, Tensor B, int b_type, ScalarType? out_type, Tensor? group_scales, "
    "Tensor? group_zeros, int? group_size, Tensor? channel_scales, Tensor? token_scales, "
    "str? schedule) -> Tensor"
)
_lib.define(
    "gptq_marlin_gemm(Tensor a, Tensor? c_or_none, Tensor b_q_weight, Tensor? b_bias_or_none, "
    "Tensor b_scales, Tensor? global_scale, Tensor? b_zeros_or_none, Tensor? g_idx_or_none, "
    "Tensor? perm_or_none, Tensor workspace, int b_q_type, SymInt size_m, SymInt size_n, "
    "SymInt size_k, bool is_k_full, bool use_atomic_add, bool use_fp32_reduce, "
    "bool is_zp_float) -> Tensor"
)


def _permute_cols(A: torch.Tensor, perm: torch.Tensor) -> torch.Tensor:
    return A.index_select(1, perm.long())


def _machete_mm(A, B, b_type, out_type, group_scales, group_zeros, group_size,
                channel_scales, token_scales, schedule):
    # B holds int4 values stored one per int8, shape (K, N); group_scales (K // group_size, N).
    w = B.to(A.dtype)
    if group_zeros is not None:
        w = w - group_zeros.to(A.dtype).repeat_interleave(group_size, dim=0)
    if group_scales is not None:
        w = w * group_scales.to(A.dtype).repeat_interleave(group_size, dim=0)
    out = A @ w
    if channel_scales is not None:
        out = out * channel_scales
    if token_scales is not None:
        out = out * token_scales
    return out.to(out_type) if out_type is not None else out


def _permute_cols_meta(A, perm):
    return A.new_empty(A.shape)


def _machete_mm_meta(A, B, b_type, out_type, *rest):
    return A.new_empty((A.shape[0], B.shape[1]), dtype=out_type or A.dtype)





def _gptq_marlin_gemm(a, c_or_none, b_q_weight, b_bias_or_none, b_scales, global_scale,
                      b_zeros_or_none, g_idx_or_none, perm_or_none, workspace, b_q_type,
                      size_m, size_n, size_k, is_k_full, use_atomic_add, use_fp32_reduce,
                      is_zp_float):
    """Marlin act-order, symmetric `uint4b8` weights stored one value per int8: permute the
    activation columns by `perm` (Marlin does it inside the kernel), then multiply by the
    row-permuted weight, each (sorted) row scaled by the scales of the group `g_idx` assigns
    it. The workspace is Marlin's zeroed lock buffer: only its size is checked, as its values
    never reach the output."""
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


for _name, _impl, _meta in (("permute_cols", _permute_cols, _permute_cols_meta),
                             ("machete_mm", _machete_mm, _machete_mm_meta),
                             ("gptq_marlin_gemm", _gptq_marlin_gemm, _gptq_marlin_gemm_meta)):
    for _key in ("CPU", "CUDA"):
        _lib.impl(_name, _impl, _key)
    _lib.impl(_name, _meta, "Meta")

permute_cols = torch.ops.graphtrace.permute_cols
machete_mm = torch.ops.graphtrace.machete_mm
gptq_marlin_gemm = torch.ops.graphtrace.gptq_marlin_gemm
