"""Custom ops with vLLM's real schemas, registered under this project's namespace.

`permute_cols` and `machete_mm` mirror `_C::permute_cols` and `_C::machete_mm`; the bodies
are small CPU/CUDA reference computations (a column gather and a dequantised matmul), enough
to make outputs depend on every tensor the real kernels read.
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


for _key in ("CPU", "CUDA"):
    _lib.impl("permute_cols", _permute_cols, _key)
    _lib.impl("machete_mm", _machete_mm, _key)


def _permute_cols_meta(A, perm):
    return A.new_empty(A.shape)


def _machete_mm_meta(A, B, b_type, out_type, *rest):
    return A.new_empty((A.shape[0], B.shape[1]), dtype=out_type or A.dtype)


_lib.impl("permute_cols", _permute_cols_meta, "Meta")
_lib.impl("machete_mm", _machete_mm_meta, "Meta")

permute_cols = torch.ops.graphtrace.permute_cols
machete_mm = torch.ops.graphtrace.machete_mm
