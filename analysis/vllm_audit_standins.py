"""Stand-ins for what vLLM's GPU kernels call and this CPU machine lacks, for
analysis/vllm_kernel_audit.py only (Note [audit stand-ins] there).

Four kinds, each installed by `install()` and undone by `uninstall()` (the audit runs in a
process of its own; nothing here is imported by graphtrace):

- `_C`-style ops of vLLM's CUDA, ROCm, XPU and zentorch extensions, registered under their
  real names and schemas (writes marked `Tensor!`/`Tensor(a!)`) where this build lacks them;
- ops this CPU build *declares* as `() -> ()` placeholders (`_C::static_scaled_fp8_quant`
  and its dynamic siblings): the name is taken, so the op with vLLM's real schema is
  registered under the harness-only namespace `_C_audit` and `torch.ops._C.<name>` (the
  attribute vLLM's `_custom_ops.py` wrappers look up at call time) is pointed at it;
- vLLM's own `vllm::` ops that vLLM registers only on ROCm or XPU (inside
  `if current_platform.is_rocm()` or aiter's `register_ops_once`): registered through
  vLLM's `direct_register_custom_op` with vLLM's own function signature (so the schema is
  the one vLLM infers) and `mutates_args`, and vLLM's own fake (meta) function for the
  output shapes;
- Python packages vLLM imports for a kernel and this machine lacks (flashinfer, aiter,
  deep_gemm, ...): a module injected into `sys.modules` exposing the functions vLLM calls.
  Each function allocates outputs with the real shapes and hands its tensor arguments to
  one op per function in the harness-only namespace `audit_lib` (`Tensor[] reads,
  Tensor(a!)[] writes`), so the recorder sees which storages the library call reads and
  writes, as it would see a real extension op.

A stand-in's values are a function of every tensor it reads (so a flip test can tell which
storage a replay reads), never the right numbers, except `aten::_scaled_mm`, which computes
the dequantized product on CPU.
"""

from __future__ import annotations

import ast
import functools
import importlib
import importlib.machinery
import inspect
import sys
import types
from dataclasses import dataclass
from pathlib import Path

import torch

__all__ = ["StandIn", "STANDINS", "install", "uninstall", "used", "reset_used", "describe"]


# ---------------------------------------------------------------------------------------------
# Values: a number depending on every tensor read, written into every output

def _reads_value(values) -> torch.Tensor:
    total = torch.zeros((), dtype=torch.float64)
    for t in values:
        if isinstance(t, torch.Tensor) and t.numel() and t.device.type != "meta":
            flat = t.detach().reshape(-1)[:4096]
            if flat.dtype.itemsize == 1 and not flat.dtype.is_floating_point:
                flat = flat.to(torch.int64)
            elif flat.dtype.is_floating_point and flat.dtype.itemsize == 1:
                flat = flat.view(torch.uint8).to(torch.int64)
            elif flat.dtype == getattr(torch, "float4_e2m1fn_x2", None):
                flat = flat.view(torch.uint8).to(torch.int64)
            # each tensor's sum folded to a bounded residue, so a change in a small tensor is
            # not lost in the rounding of a large one (Marlin's exponent-biased scales)
            part = flat.to(torch.float64).nan_to_num().sum().nan_to_num()
            total = total + torch.fmod(part, 65521.0)
    return total


def _fill(t: torch.Tensor, value: torch.Tensor) -> None:
    """Overwrite `t` in place (its storage) with a value derived from `value`."""
    if t.numel() == 0:
        return
    if t.dtype == torch.bool:
        t.fill_(bool(int(value.abs().item()) % 2))
    elif t.dtype.is_floating_point and t.dtype.itemsize >= 2:
        # 127 levels, each distinct in bf16: a changed read rarely collides downstream
        t.fill_((value % 127.0).item() / 127.0)
    elif t.dtype.itemsize == 1:           # int8/uint8, fp8, e8m0, packed fp4: the bytes
        t.view(torch.uint8).fill_(int(value.abs().item()) % 127)   # below every NaN code
    else:                                 # int32/int64: ids, offsets, sizes: kept small
        t.fill_(int(value.abs().item()) % 7)


def _flat(values):
    for v in values:
        if isinstance(v, (list, tuple)):
            yield from _flat(v)
        else:
            yield v


# ---------------------------------------------------------------------------------------------
# 1. Extension ops with explicit schemas

@dataclass
class StandIn:
    schema: str                      # the real op's schema, without the name
    out: object = None               # fn(**args) -> output tensor(s); None: returns nothing
    used: int = 0
    routed: str = ""                 # the harness-only name it was registered under, if any
    key: str = "CPU"                 # dispatch key (an op with no tensor argument has none)


def _mm_out(a_key, n_of, dtype_of=None):
    """Output [*a.shape[:-1], N] for a GEMM; N = n_of(args); dtype from `dtype_of(args)` or
    the activation's."""
    def out(**kw):
        a = kw[a_key]
        dt = dtype_of(kw) if dtype_of else None
        return torch.empty(*a.shape[:-1], n_of(kw), dtype=dt or _act_dtype(a))
    return out


def _marlin_repack_out(b_q_weight, size_k, size_n, num_bits, **_):
    return torch.empty(size_k // 16, size_n * 16 // (32 // num_bits), dtype=torch.int32)


def _act_dtype(a: torch.Tensor, *others) -> torch.dtype:
    for t in (a, *others):
        if isinstance(t, torch.Tensor) and t.dtype in (torch.float16, torch.bfloat16):
            return t.dtype
    return torch.bfloat16


# Schemas of vLLM's own extensions as in vLLM's csrc (torch_bindings.cpp) for the `_C` ops;
# for the ROCm, XPU and zentorch extensions, whose sources are not installed, as the
# installed vLLM 0.32 calls them (arguments in call order; no argument written unless vLLM
# passes an output buffer).
STANDINS: dict[str, StandIn] = {
    "_C::gptq_gemm": StandIn(
        "(Tensor a, Tensor b_q_weight, Tensor b_gptq_qzeros, Tensor b_gptq_scales, "
        "bool use_exllama, bool use_v2_format, int bit) -> Tensor",
        lambda a, b_q_weight, **_: torch.empty(a.size(0), b_q_weight.size(1), dtype=a.dtype)),
    "_C::gptq_shuffle": StandIn("(Tensor! q_weight, int bit) -> ()"),
    "_C::gptq_marlin_repack": StandIn(
        "(Tensor b_q_weight, SymInt size_k, SymInt size_n, int num_bits, bool is_a_8bit) "
        "-> Tensor", _marlin_repack_out),
    "_C::awq_marlin_repack": StandIn(
        "(Tensor b_q_weight, SymInt size_k, SymInt size_n, int num_bits, bool is_a_8bit) "
        "-> Tensor", _marlin_repack_out),
    "_C::marlin_gemm": StandIn(
        "(Tensor a, Tensor? c_or_none, Tensor b_q_weight, Tensor? b_bias_or_none, "
        "Tensor b_scales, Tensor? a_scales, Tensor? global_scale, Tensor? b_zeros_or_none, "
        "Tensor workspace, int b_type_id, SymInt size_m, SymInt size_n, SymInt size_k, "
        "bool use_atomic_add, bool use_fp32_reduce, bool is_zp_float) -> Tensor",
        lambda a, b_scales, size_m, size_n, **_: torch.empty(
            size_m, size_n, dtype=_act_dtype(a, b_scales))),
    "_C::machete_prepack_B": StandIn(
        "(Tensor B, ScalarType a_type, int b_type, ScalarType? group_scales_type) -> Tensor",
        lambda B, **_: torch.empty_like(B, memory_format=torch.contiguous_format)),
    "_C::machete_mm": StandIn(
        "(Tensor A, Tensor B, int b_type, ScalarType? out_type, Tensor? group_scales, "
        "Tensor? group_zeros, int? group_size, Tensor? channel_scales, Tensor? token_scales, "
        "str? schedule) -> Tensor",
        lambda A, B, out_type=None, **_: torch.empty(
            A.shape[0], B.shape[1], dtype=out_type or _act_dtype(A))),
    "_C::cutlass_scaled_mm": StandIn(
        "(Tensor! out, Tensor a, Tensor b, Tensor a_scales, Tensor b_scales, Tensor? bias) "
        "-> ()"),
    "_C::cutlass_scaled_mm_azp": StandIn(
        "(Tensor! out, Tensor a, Tensor b, Tensor a_scales, Tensor b_scales, Tensor azp_adj, "
        "Tensor? azp, Tensor? bias) -> ()"),
    "_C::cutlass_scaled_fp4_mm": StandIn(
        "(Tensor! out, Tensor a, Tensor b, Tensor block_scale_a, Tensor block_scale_b, "
        "Tensor alpha) -> ()"),
    "_C::scaled_fp4_quant.out": StandIn(
        "(Tensor input, Tensor input_scale, bool is_sf_swizzled_layout, *, "
        "Tensor(a!) output, Tensor(b!) output_scale) -> ()"),
    # declared `() -> ()` by this CPU build: routed (see the module docstring)
    "_C::static_scaled_fp8_quant": StandIn(
        "(Tensor! result, Tensor input, Tensor scale, int[]? group_shape=None) -> ()"),
    "_C::dynamic_scaled_fp8_quant": StandIn(
        "(Tensor! result, Tensor input, Tensor! scale) -> ()"),
    "_C::dynamic_per_token_scaled_fp8_quant": StandIn(
        "(Tensor! result, Tensor input, Tensor! scale, Tensor? scale_ub) -> ()"),
    # ROCm extension (_rocm_C), from vllm/_custom_ops.py's wrappers
    "_rocm_C::gptq_gemm_rdna3": StandIn(
        "(Tensor a, Tensor b_q_weight, Tensor b_qzeros, Tensor b_scales, bool use_v2_format) "
        "-> Tensor",
        lambda a, b_q_weight, **_: torch.empty(*a.shape[:-1], b_q_weight.size(1),
                                               dtype=a.dtype)),
    "_rocm_C::wvSplitK_int4_g": StandIn(
        "(Tensor weight, Tensor activation, Tensor scale, Tensor? zero_points, Tensor? bias, "
        "int cu_count, int group_size) -> Tensor",
        lambda weight, activation, **_: torch.empty(*activation.shape[:-1], weight.size(0),
                                                    dtype=activation.dtype)),
    "_rocm_C::wvSplitKQ": StandIn(
        "(Tensor a, Tensor b, ScalarType out_dtype, Tensor scale_a, Tensor scale_b, "
        "int cu_count, Tensor? bias) -> Tensor",
        lambda a, b, out_dtype, **_: torch.empty(b.size(0), a.size(0), dtype=out_dtype)),
    # XPU extension (_xpu_C): argument names and outputs as vLLM's own fakes for them
    # (vllm/_xpu_ops.py `@register_fake("_xpu_C::fp8_gemm")`, `...fp8_gemm_w8a16`)
    "_xpu_C::fp8_gemm": StandIn(
        "(Tensor q_input, Tensor q_weight, ScalarType out_dtype, Tensor input_scales, "
        "Tensor weight_scale, Tensor? bias=None) -> Tensor",
        lambda q_input, q_weight, out_dtype, **_: torch.empty(
            q_input.reshape(-1, q_input.shape[-1]).shape[0], q_weight.shape[1],
            dtype=out_dtype)),
    "_xpu_C::fp8_gemm_w8a16": StandIn(
        "(Tensor input, Tensor q_weight, Tensor weight_scale, Tensor? bias=None) -> Tensor",
        lambda input, q_weight, **_: torch.empty(
            input.reshape(-1, input.shape[-1]).shape[0], q_weight.shape[1],
            dtype=input.dtype)),
    # zentorch (AMD ZenDNN plugin), from kernels/linear/*/zentorch.py
    "zentorch::zentorch_dynamic_qlinear": StandIn(
        "(Tensor input, Tensor weight, Tensor weight_scales, Tensor? bias, *, "
        "str zentorch_op_name=\"\") -> Tensor",
        lambda input, weight, **_: torch.empty(*input.shape[:-1], weight.shape[0],
                                               dtype=_act_dtype(input))),
    "zentorch::zentorch_woq_repack_weight": StandIn(
        # packs 8 int4 values (one per int8) into each int32 (kernels/.../zentorch.py)
        "(Tensor weight) -> Tensor",
        lambda weight: torch.empty(weight.shape[0], weight.shape[1] // 8, dtype=torch.int32)),
    "zentorch::zentorch_woq_linear": StandIn(
        "(Tensor input, Tensor qweight, Tensor weight_scales, Tensor? weight_zero_point, "
        "Tensor? bias) -> Tensor",
        lambda input, qweight, **_: torch.empty(*input.shape[:-1], qweight.shape[0],
                                                dtype=input.dtype)),
    # `_C` quantizers of vLLM's GPU build that vllm/_xpu_ops.py calls (csrc/torch_bindings.cpp)
    "_C::per_token_group_fp8_quant": StandIn(
        "(Tensor input, Tensor(a!) output_q, Tensor(b!) output_s, int group_size, float eps, "
        "float fp8_min, float fp8_max, bool scale_ue8m0, bool dummy_is_scale_transposed, "
        "bool dummy_is_tma_aligned) -> ()"),
    "_C::per_token_group_quant_mxfp4": StandIn(
        "(Tensor input, Tensor(a!) output_q, Tensor(b!) output_s, int group_size, float eps) "
        "-> ()"),
    "_xpu_C::fp4_gemm": StandIn(
        # weight is [K/2, N] after process_weights (kernels/linear/mxfp4/xpu.py:37)
        "(Tensor input, Tensor weight, Tensor input_scale, Tensor weight_scale, "
        "ScalarType out_dtype, Tensor? bias) -> Tensor",
        lambda input, weight, out_dtype, **_: torch.empty(*input.shape[:-1], weight.shape[-1],
                                                          dtype=out_dtype)),
    # vLLM's MoE extension (_moe_C), csrc/moe/torch_bindings.cpp, as vllm/_custom_ops.py
    # (moe_align_block_size) calls it: writes the three output buffers it is handed
    "_moe_C::moe_align_block_size": StandIn(
        "(Tensor topk_ids, int num_experts, int block_size, Tensor! sorted_token_ids, "
        "Tensor! experts_ids, Tensor! num_tokens_post_pad, Tensor? maybe_expert_map, "
        "Tensor!? maybe_scatter_idx) -> ()"),
    "_moe_C::moe_sum": StandIn(
        "(Tensor input, Tensor! output, Tensor? topk_ids, Tensor? expert_map) -> ()"),
    # the CUTLASS FP8 MoE path (experts/cutlass_moe.py run_cutlass_moe_fp8), schemas as
    # csrc/torch_bindings.cpp and csrc/moe/torch_bindings.cpp. `moe_permute_unpermute_
    # supported` answers False, so moe_permute allocates its own buffers (no scratch).
    "_moe_C::moe_permute_unpermute_supported": StandIn(
        "() -> bool", lambda **_: False, key="CompositeExplicitAutograd"),
    "_moe_C::moe_permute": StandIn(
        "(Tensor input, Tensor topk_ids, Tensor token_expert_indices, Tensor? expert_map, "
        "int n_expert, int n_local_expert, int topk, Tensor! permuted_input, "
        "Tensor! expert_first_token_offset, Tensor! inv_permuted_idx, Tensor! permuted_idx) "
        "-> ()"),
    "_moe_C::moe_unpermute": StandIn(
        "(Tensor permuted_hidden_states, Tensor topk_weights, Tensor inv_permuted_idx, "
        "Tensor? expert_first_token_offset, int topk, Tensor! hidden_states) -> ()"),
    "_C::get_cutlass_moe_mm_problem_sizes_from_expert_offsets": StandIn(
        "(Tensor expert_first_token_offset, Tensor! problem_sizes1, Tensor! problem_sizes2, "
        "int n, int k, bool swap_ab) -> ()"),
    "_C::cutlass_moe_mm": StandIn(
        "(Tensor! out_tensors, Tensor a_tensors, Tensor b_tensors, Tensor a_scales, "
        "Tensor b_scales, Tensor expert_offsets, Tensor problem_sizes, Tensor a_strides, "
        "Tensor b_strides, Tensor c_strides, bool per_act_token, bool per_out_ch) -> ()"),
    # Marlin MoE (experts/marlin_moe.py fused_marlin_moe), arguments as vllm/_custom_ops.py's
    # `moe_wna16_marlin_gemm` wrapper of 0.32 passes them (csrc's schema of this release drops
    # g_idx/perm/is_full_k). csrc declares a, b_q_weight, b_scales, expert_ids, ... `Tensor!`
    # though the kernel only reads them; the stand-in declares the buffers it is handed to
    # write (`c_or_none`, the `workspace` locks) and reads the rest, so its fill never
    # overwrites a weight. Output: [size_m * top_k, size_n], as vLLM's fake (_custom_ops.py).
    "_moe_C::moe_wna16_marlin_gemm": StandIn(
        "(Tensor a, Tensor(a!)? c_or_none, Tensor b_q_weight, Tensor? b_bias_or_none, "
        "Tensor b_scales, Tensor? a_scales, Tensor? global_scale, Tensor? b_zeros_or_none, "
        "Tensor(b!) workspace, Tensor sorted_token_ids, Tensor expert_ids, "
        "Tensor num_tokens_past_padded, Tensor topk_weights, int moe_block_size, int top_k, "
        "bool mul_topk_weights, int b_type_id, int size_m, int size_n, int size_k, "
        "bool use_atomic_add, bool use_fp32_reduce, bool is_zp_float, int thread_k, "
        "int thread_n, int blocks_per_sm) -> Tensor",
        lambda a, b_scales, size_m, size_n, top_k, **_: torch.empty(
            size_m * top_k, size_n, dtype=_act_dtype(a, b_scales))),
    # activations and MoE data of vLLM's CUDA build (csrc/torch_bindings.cpp), as 0.32's
    # callers pass them: the clamped SwiGLU of gpt-oss-style experts (fused_moe/
    # activation.py:311), the fused SiLU-and-mul with per-block quantization
    # (_custom_ops.py:539), and the CUTLASS MoE data preparation (_custom_ops.py:898)
    "_C::silu_and_mul_with_clamp": StandIn(
        "(Tensor! result, Tensor input, float limit, float alpha=1.0, float beta=0.0) -> ()"),
    "_C::silu_and_mul_per_block_quant": StandIn(
        "(Tensor! out, Tensor input, Tensor! scales, int group_size, Tensor? scale_ub=None, "
        "bool is_scale_transposed=False) -> ()"),
    "_C::get_cutlass_moe_mm_data": StandIn(
        "(Tensor topk_ids, Tensor! expert_offsets, Tensor! problem_sizes1, "
        "Tensor! problem_sizes2, Tensor! input_permutation, Tensor! output_permutation, "
        "int num_experts, int n, int k, Tensor? blockscale_offsets, bool is_gated) -> ()"),
    # the CUTLASS MXFP4 MoE path (experts/cutlass_moe.py:898-964)
    "_C::mxfp4_experts_quant": StandIn(
        "(Tensor! output, Tensor! output_scale, Tensor input, Tensor input_offset_by_experts, "
        "Tensor output_scale_offset_by_experts, int n_experts) -> ()"),
    "_C::silu_and_mul_mxfp4_experts_quant": StandIn(
        "(Tensor! output, Tensor! output_scale, Tensor input, Tensor input_offset_by_experts, "
        "Tensor output_scale_offset_by_experts, int n_experts) -> ()"),
    "_C::cutlass_mxfp4_group_mm": StandIn(
        "(Tensor! out, Tensor a, Tensor b, Tensor a_blockscale, Tensor b_blockscales, "
        "Tensor problem_sizes, Tensor expert_offsets, Tensor sf_offsets) -> ()"),
    "_moe_C::shuffle_rows": StandIn(
        "(Tensor input_tensor, Tensor dst2src_map, Tensor! output_tensor) -> ()"),
    "_xpu_C::int4_gemm_w4a8": StandIn(
        # float16 output (the kernel's own warning, kernels/.../mixed_precision/xpu.py:152)
        "(Tensor input, Tensor input_scale, Tensor input_zero, Tensor weight, "
        "Tensor weight_scale, Tensor weight_zero_point, int group_size, Tensor? g_idx, "
        "Tensor? bias) -> Tensor",
        lambda input, weight, **_: torch.empty(input.shape[0], weight.shape[1],
                                               dtype=torch.float16)),
}


_LIBS: dict[str, torch.library.Library] = {}
_ROUTED: dict[str, object] = {}          # "_C::name" -> the placeholder packet it replaced


def _lib(ns: str) -> torch.library.Library:
    if ns not in _LIBS:
        _LIBS[ns] = torch.library.Library(ns, "FRAGMENT")
    return _LIBS[ns]


def _existing_schema(ns: str, op: str):
    """The schemas this build registers for `ns::op` (overload -> schema), or None."""
    try:
        packet = getattr(getattr(torch.ops, ns), op)
    except (AttributeError, RuntimeError):
        return None
    return {o: getattr(packet, o)._schema for o in packet.overloads()}


def _make_impl(name: str, spec: StandIn, schema):
    arg_names = [a.name for a in schema.arguments]
    written = [a.name for a in schema.arguments
               if a.alias_info is not None and a.alias_info.is_write]

    def impl(*args, **kwargs):
        spec.used += 1
        bound = dict(zip(arg_names, args))
        bound.update(kwargs)
        value = _reads_value(_flat(v for k, v in bound.items() if k not in written))
        for k in written:
            for t in _flat([bound.get(k)]):
                if isinstance(t, torch.Tensor):
                    _fill(t, value)
        if spec.out is None:
            return None
        out = spec.out(**bound)
        for t in _flat([out]):
            if isinstance(t, torch.Tensor):
                _fill(t, value)
        return out
    return impl


def _install_ops() -> list[str]:
    registered = []
    for name, spec in STANDINS.items():
        ns, op = name.split("::")
        op, _, overload = op.partition(".")
        existing = _existing_schema(ns, op)
        key = overload or "default"
        if existing is not None and key in existing and existing[key].arguments:
            continue                      # the build has the real op: never replaced
        full = f"{op}.{overload}" if overload else op
        if existing is not None and key in existing:
            # a `() -> ()` placeholder holds the name: register under `_C_audit`, route
            target_ns = f"{ns}_audit"
            spec.routed = f"{target_ns}::{full}"
        else:
            target_ns = ns
        schema = torch._C.parse_schema(f"{target_ns}::{full}{spec.schema}")
        _lib(target_ns).define(f"{full}{spec.schema}")
        _lib(target_ns).impl(full, _make_impl(name, spec, schema), spec.key)
        if spec.routed:
            namespace = getattr(torch.ops, ns)
            _ROUTED[f"{ns}::{op}"] = namespace.__dict__.get(op)
            setattr(namespace, op, getattr(getattr(torch.ops, target_ns), op))
        registered.append(name)
    return registered


# ---------------------------------------------------------------------------------------------
# 2. vLLM's own `vllm::` ops that vLLM registers only on ROCm / XPU

# modules whose `direct_register_custom_op(...)` calls sit behind a platform check
PLATFORM_OP_MODULES = (
    "vllm._aiter_ops",
    "vllm._xpu_ops",
    "vllm.model_executor.kernels.linear.scaled_mm.rocm",
    "vllm.model_executor.kernels.linear.mxfp4.aiter",
    "vllm.utils.flashinfer",
)


@dataclass
class VllmOpStandIn:
    module: str
    impl: object          # vLLM's own function (signature -> schema)
    fake: object          # vLLM's own fake function (output shapes), or None
    mutates: list
    used: int = 0


VLLM_OPS: dict[str, VllmOpStandIn] = {}


def _function_defs(tree: ast.AST) -> dict[str, ast.FunctionDef]:
    return {n.name: n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}


def _compile_def(node: ast.FunctionDef, module, path: str):
    """vLLM's function from its source, compiled in its module's globals (functions that
    vLLM defines only inside a platform branch)."""
    node = ast.fix_missing_locations(ast.Module(body=[_dedent(node)], type_ignores=[]))
    env = dict(vars(module))
    exec(compile(node, path, "exec"), env)   # noqa: S102 (vLLM's own source, unchanged)
    return env[node.body[0].name]


def _dedent(node):
    node = ast.parse(ast.unparse(node)).body[0]
    node.decorator_list = []
    return node


def _install_vllm_ops() -> list[str]:
    from vllm.utils.torch_utils import direct_register_custom_op

    registered = []
    for modname in PLATFORM_OP_MODULES:
        module = importlib.import_module(modname)
        path = inspect.getsourcefile(module)
        tree = ast.parse(Path(path).read_text())
        defs = _function_defs(tree)
        for call in ast.walk(tree):
            if not (isinstance(call, ast.Call) and getattr(call.func, "id", "")
                    == "direct_register_custom_op"):
                continue
            kw = {k.arg: k.value for k in call.keywords}
            if "op_name" not in kw or not isinstance(kw["op_name"], ast.Constant):
                continue
            op_name = kw["op_name"].value
            if _existing_schema("vllm", op_name) is not None or op_name in VLLM_OPS:
                continue
            if "target_lib" in kw:
                continue
            impl_name = getattr(kw.get("op_func"), "id", None)
            fake_name = getattr(kw.get("fake_impl"), "id", None)
            if impl_name not in defs:
                continue
            try:
                impl = getattr(module, impl_name, None) or _compile_def(defs[impl_name],
                                                                        module, path)
                fake = None
                if fake_name in defs:
                    fake = getattr(module, fake_name, None) or _compile_def(
                        defs[fake_name], module, path)
                mutates = ast.literal_eval(kw["mutates_args"]) if "mutates_args" in kw else []
            except Exception:      # a definition that needs the platform: left unregistered
                continue
            spec = VllmOpStandIn(modname, impl, fake, list(mutates))
            try:
                direct_register_custom_op(op_name=op_name, op_func=_vllm_op_impl(spec),
                                          mutates_args=list(mutates), dispatch_key="CPU")
            except Exception:
                continue
            VLLM_OPS[op_name] = spec
            registered.append(f"vllm::{op_name}")
        registered += _install_decorated_ops(module, path, tree)
    return registered


def _decorator_op(node: ast.FunctionDef, suffix: str):
    """("vllm::name", decorator call) when `node` is decorated `@...<suffix>("vllm::name")`."""
    for dec in node.decorator_list:
        if (isinstance(dec, ast.Call) and isinstance(dec.func, ast.Attribute)
                and dec.func.attr == suffix and dec.args
                and isinstance(dec.args[0], ast.Constant)
                and str(dec.args[0].value).startswith("vllm::")):
            return dec.args[0].value, dec
    return None, None


def _install_decorated_ops(module, path: str, tree) -> list[str]:
    """`@torch.library.custom_op("vllm::x", ...)` definitions inside a platform branch
    (`if has_flashinfer():`): registered with vLLM's signature and `mutates_args`, vLLM's
    `@register_fake` function for the outputs; the module name vLLM binds (the decorated
    function) is set to the op, as the branch would have done."""
    fakes = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef):
            name, _ = _decorator_op(node, "register_fake")
            if name:
                fakes[name] = node
    registered = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.FunctionDef):
            continue
        qual, dec = _decorator_op(node, "custom_op")
        if not qual:
            continue
        op_name = qual.split("::")[1]
        if _existing_schema("vllm", op_name) is not None:
            continue
        kw = {k.arg: k.value for k in dec.keywords}
        try:
            impl = _compile_def(node, module, path)
            fake = _compile_def(fakes[qual], module, path) if qual in fakes else None
            mutates = ast.literal_eval(kw["mutates_args"]) if "mutates_args" in kw else []
            spec = VllmOpStandIn(module.__name__, impl, fake, list(mutates))
            from vllm.utils.torch_utils import direct_register_custom_op

            direct_register_custom_op(op_name=op_name, op_func=_vllm_op_impl(spec),
                                      mutates_args=list(mutates), dispatch_key="CPU")
        except Exception:
            continue
        VLLM_OPS[op_name] = spec
        _SET_ATTRS.append((module, node.name, getattr(module, node.name, _ABSENT)))
        setattr(module, node.name, getattr(torch.ops.vllm, op_name))
        registered.append(qual)
    return registered


_SET_ATTRS: list = []
_ABSENT = object()


def _vllm_op_impl(spec: VllmOpStandIn):
    sig = inspect.signature(spec.impl)

    @functools.wraps(spec.impl)
    def impl(*args, **kwargs):
        spec.used += 1
        bound = sig.bind(*args, **kwargs)
        bound.apply_defaults()
        named = dict(bound.arguments)
        value = _reads_value(_flat(v for k, v in named.items() if k not in spec.mutates))
        for k in spec.mutates:
            for t in _flat([named.get(k)]):
                if isinstance(t, torch.Tensor):
                    _fill(t, value)
        if spec.fake is None:
            return None
        out = spec.fake(*bound.args, **bound.kwargs)
        for t in _flat([out]):
            if isinstance(t, torch.Tensor):
                _fill(t, value)
        return out
    return impl


# ---------------------------------------------------------------------------------------------
# 3. aten::_scaled_mm on CPU: the dequantized product

_SCALED_MM = {"used": 0}


def _expand_scale(scale: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    s = scale.float()
    if s.numel() == 1:
        return s.reshape(1, 1)
    if s.dim() == 1:
        s = s.reshape(-1, 1) if s.numel() == rows else s.reshape(1, -1)
    if s.shape[0] not in (1, rows):
        s = s.repeat_interleave(-(-rows // s.shape[0]), 0)[:rows]
    if s.shape[1] not in (1, cols):
        s = s.repeat_interleave(-(-cols // s.shape[1]), 1)[:, :cols]
    return s


def _scaled_mm(self, mat2, scale_a, scale_b, bias=None, scale_result=None, out_dtype=None,
               use_fast_accum=False):
    _SCALED_MM["used"] += 1
    a = self.float() * _expand_scale(scale_a, self.shape[0], self.shape[1])
    b = mat2.float() * _expand_scale(scale_b, mat2.shape[0], mat2.shape[1])
    out = a @ b
    if bias is not None:
        out = out + bias.float()
    return out.to(out_dtype or self.dtype)


def _install_scaled_mm() -> None:
    lib = torch.library.Library("aten", "IMPL")
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        lib.impl("_scaled_mm", _scaled_mm, "CPU")
    _LIBS["aten(IMPL)"] = lib


# ---------------------------------------------------------------------------------------------
# 4. Python packages vLLM imports and this machine lacks

_LIB_OPS: dict[str, int] = {}


def lib_call(qualname: str, reads, writes) -> None:
    """Record a library call as an op `audit_lib::<qualname>` reading `reads` and writing
    `writes` (filled with a value of everything read)."""
    op = qualname.replace(".", "__")
    if op not in _LIB_OPS:
        _lib("audit_lib").define(f"{op}(Tensor[] reads, Tensor(a!)[] writes) -> ()")

        def impl(reads, writes, _op=op):
            _LIB_OPS[_op] += 1
            value = _reads_value(reads)
            for t in writes:
                _fill(t, value)
        _lib("audit_lib").impl(op, impl, "CPU")
        _LIB_OPS[op] = 0
    tensors = [t for t in _flat([reads]) if isinstance(t, torch.Tensor)]
    outs = [t for t in _flat([writes]) if isinstance(t, torch.Tensor)]
    getattr(torch.ops.audit_lib, op)(tensors, outs)


def returning(qualname: str, make_out):
    """A library function: `make_out(*args, **kwargs)` gives the outputs with the real
    shapes; every tensor argument is read."""
    def fn(*args, **kwargs):
        out = make_out(*args, **kwargs)
        lib_call(qualname, [*args, *kwargs.values()], [out])
        return out
    fn.__name__ = qualname.rsplit(".", 1)[-1]
    fn.__qualname__ = qualname
    return fn


def writing(qualname: str, written: tuple, result=None):
    """A library function that writes into the arguments named (or positions) `written`."""
    def fn(*args, **kwargs):
        outs = [args[w] if isinstance(w, int) and w < len(args) else kwargs.get(w)
                for w in written]
        reads = [a for i, a in enumerate(args) if i not in written]
        reads += [v for k, v in kwargs.items() if k not in written]
        lib_call(qualname, reads, outs)
        return result(*args, **kwargs) if result else None
    fn.__name__ = qualname.rsplit(".", 1)[-1]
    return fn


FAKE_MODULES: dict[str, types.ModuleType] = {}
_SAVED_MODULES: dict[str, object] = {}


def fake_module(name: str, **attrs) -> types.ModuleType:
    """A module `name` (and its parents) in sys.modules with `attrs`."""
    parts = name.split(".")
    for i in range(1, len(parts) + 1):
        sub = ".".join(parts[:i])
        if sub not in FAKE_MODULES:
            mod = types.ModuleType(sub)
            mod.__file__ = f"<audit stand-in {sub}>"
            mod.__path__ = []
            mod.__audit_standin__ = True
            mod.__spec__ = importlib.machinery.ModuleSpec(sub, None, is_package=True)
            FAKE_MODULES[sub] = mod
            _SAVED_MODULES.setdefault(sub, sys.modules.get(sub))
            sys.modules[sub] = mod
            if i > 1:
                setattr(FAKE_MODULES[".".join(parts[:i - 1])], parts[i - 1], mod)
    mod = FAKE_MODULES[name]
    for k, v in attrs.items():
        setattr(mod, k, v)
    return mod


def _install_fake_packages() -> None:
    """The packages vLLM imports for its ROCm/XPU/NVIDIA kernels, as far as vLLM calls them."""
    # vllm/_xpu_ops.py imports these at module level; the audited kernels call neither
    def _unused(name):
        def fn(*a, **k):
            raise NotImplementedError(f"audit stand-in: {name} is not stood in")
        fn.__name__ = name.rsplit(".", 1)[-1]
        return fn
    fake_module("vllm_xpu_kernels.flash_attn_interface",
                flash_attn_varlen_func=_unused("flash_attn_varlen_func"))
    fake_module("vllm_xpu_kernels.rotary", apply_rotary_emb=_unused("apply_rotary_emb"))

    # flashinfer: found by vLLM's has_flashinfer() (find_spec + flashinfer_cubin); vLLM's own
    # `if has_flashinfer():` ops in vllm/utils/flashinfer.py are then registered with their
    # fakes (_install_decorated_ops); the functions vLLM's kernels import directly:
    same = lambda name: returning(name, lambda x, *a, **k: torch.empty_like(x))  # noqa: E731
    fake_module("flashinfer_cubin")
    fake_module("flashinfer",
                shuffle_matrix_a=same("flashinfer.shuffle_matrix_a"),
                shuffle_matrix_sf_a=same("flashinfer.shuffle_matrix_sf_a"))
    fake_module("flashinfer.gemm", prepare_bf16_fp4_weights=returning(
        # the real layout is flashinfer's; the stand-in keeps each input's shape
        "flashinfer.gemm.prepare_bf16_fp4_weights",
        lambda w, s, g, **_: (torch.empty_like(w), torch.empty_like(s), torch.empty_like(g))),
                fp8_blockscale_gemm_sm90=returning(
        "flashinfer.gemm.fp8_blockscale_gemm_sm90",
        lambda input, weight, weight_scale=None, out_dtype=torch.bfloat16, **_: torch.empty(
            *input.shape[:-1], weight.shape[0], dtype=out_dtype)))
    # flashinfer.fused_moe: the CUTLASS fused MoE FlashInferExperts.apply calls
    # (experts/flashinfer_cutlass_moe.py, through vllm/utils/flashinfer.py's lazy
    # `flashinfer_cutlass_fused_moe`), and the ActivationType enum vLLM maps its activations
    # to (quantization/utils/flashinfer_utils.py:32; values as flashinfer's fused_moe/core.py).
    # flashinfer's `cutlass_fused_moe` writes `output` when handed one, else allocates
    # [tokens, hidden] in `output_dtype`, and returns a one-element list.
    import enum

    def _cutlass_fused_moe(input, token_selected_experts, token_final_scales,
                           fc1_expert_weights, fc2_expert_weights, output_dtype, quant_scales,
                           output=None, **kwargs):
        if output is None:
            output = torch.empty(input.shape[0], fc2_expert_weights.shape[1],
                                 dtype=output_dtype)
        lib_call("flashinfer.fused_moe.cutlass_fused_moe",
                 [input, token_selected_experts, token_final_scales, fc1_expert_weights,
                  fc2_expert_weights, quant_scales, *kwargs.values()], [output])
        return [output]
    fake_module("flashinfer.fused_moe", cutlass_fused_moe=_cutlass_fused_moe)
    fake_module("flashinfer.fused_moe.core", ActivationType=enum.IntEnum("ActivationType", [
        ("Gelu", 0), ("Relu", 1), ("Silu", 2), ("Swiglu", 3), ("Geglu", 4),
        ("SwigluBias", 5), ("Relu2", 6), ("Identity", 7), ("InvalidType", 8)]))
    # aiter (ROCm): the weight shuffles vLLM's aiter kernels call in process_weights
    # (vllm/_aiter_ops.py `rocm_aiter_ops.shuffle_weight`: same shape, another layout)
    fake_module("aiter")
    fake_module("aiter.ops")
    # the stage-1 gate layout AiterExperts.apply names (experts/rocm_aiter_moe.py:381;
    # values as aiter's ops/flydsl/moe_common.py); the MoE itself is vLLM's own
    # `vllm::rocm_aiter_fused_moe` op, stood in with vLLM's fake (_install_vllm_ops)
    fake_module("aiter.ops.flydsl.moe_common", GateMode=enum.Enum("GateMode", [
        ("SEPARATED", "separated"), ("MOCK_GATE_ONLY", "mock_gate_only"),
        ("GATE_ONLY", "gate_only"), ("INTERLEAVE", "interleave")]))
    fake_module("aiter.ops.shuffle", shuffle_weight=returning(
        "aiter.ops.shuffle.shuffle_weight", lambda x, layout=(16, 16), **_: torch.empty_like(x)))
    import vllm.utils.flashinfer as vfi

    vfi.has_flashinfer.cache_clear()


# ---------------------------------------------------------------------------------------------
# 5. Triton kernels: vLLM's launcher runs as shipped; only `kernel[grid](...)` is stood in

# (module, kernel function name): the @triton.jit kernels the audited launchers launch
TRITON_KERNELS = (
    ("vllm.model_executor.layers.quantization.compressed_tensors.triton_scaled_mm",
     "scaled_mm_kernel"),
    ("vllm.model_executor.layers.quantization.utils.fp8_utils",
     "_w8a8_triton_block_scaled_mm"),
    ("vllm.model_executor.kernels.linear.mxfp8.rocm_native", "_mxfp8_linear_kernel"),
    ("vllm.model_executor.kernels.linear.mixed_precision.triton_w4a16",
     "triton_w4a16_gemm_kernel"),
    ("vllm.model_executor.layers.fused_moe.fused_moe", "fused_moe_kernel"),
    ("vllm.model_executor.layers.fused_moe.fused_moe", "fused_moe_kernel_gptq_awq"),
    ("vllm.model_executor.layers.fused_moe.experts.nvfp4_emulation_moe",
     "fused_moe_nvfp4_emulation_kernel"),
    # the activation quantizers the Triton MoE experts call for INT8 per-token and FP8
    # per-token-group activations (fused_moe/utils.py _int8_quantize, _fp8_quantize)
    ("vllm.model_executor.layers.quantization.utils.int8_utils", "_per_token_quant_int8"),
    ("vllm.model_executor.layers.quantization.utils.fp8_utils", "_per_token_group_quant_fp8"),
    ("vllm.model_executor.layers.quantization.utils.fp8_utils",
     "_per_token_group_quant_fp8_colmajor"),
    # the MXFP4 quantizer of the online MXFP4 method (quantization/utils/mxfp4_utils.py:491)
    ("vllm.model_executor.layers.quantization.utils.mxfp4_utils", "_downcast_to_mxfp"),
)


def stored_params(fn) -> list[str]:
    """The parameters of a Triton kernel that its `tl.store` calls write through: every name
    a store's pointer expression derives from, followed back through assignments."""
    tree = ast.parse(inspect.cleandoc("\n" + inspect.getsource(fn)) if False else
                     _dedent_source(inspect.getsource(fn)))
    fdef = tree.body[0]
    params = [a.arg for a in fdef.args.args]
    derives: dict[str, set] = {p: {p} for p in params}
    changed = True
    while changed:
        changed = False
        for node in ast.walk(fdef):
            if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                if node.value is None:
                    continue
                src = set().union(*[derives.get(n.id, set()) for n in ast.walk(node.value)
                                    if isinstance(n, ast.Name)] or [set()])
                if isinstance(node, ast.AugAssign):
                    src |= derives.get(getattr(node.target, "id", ""), set())
                for t in targets:
                    for n in ast.walk(t):
                        if isinstance(n, ast.Name) and not src <= derives.get(n.id, set()):
                            derives[n.id] = derives.get(n.id, set()) | src
                            changed = True
    written: set = set()
    for node in ast.walk(fdef):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and node.func.attr in ("store", "atomic_add") and node.args):
            for n in ast.walk(node.args[0]):
                if isinstance(n, ast.Name):
                    written |= derives.get(n.id, set())
    return [p for p in params if p in written]


def _dedent_source(src: str) -> str:
    import textwrap

    return textwrap.dedent(src)


class TritonLaunch:
    """`kernel[grid](*args)`: records one op `audit_lib::triton__<kernel>` reading every
    tensor argument and writing the ones the kernel stores through."""

    def __init__(self, fn):
        self.fn = fn
        self.sig = inspect.signature(fn)
        self.writes = stored_params(fn)
        self.__name__ = fn.__name__

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            bound = self.sig.bind_partial(*args, **{k: v for k, v in kwargs.items()
                                                    if k in self.sig.parameters})
            named = bound.arguments
            writes = [named[w] for w in self.writes if isinstance(named.get(w), torch.Tensor)]
            reads = [v for k, v in named.items()
                     if isinstance(v, torch.Tensor) and k not in self.writes]
            lib_call(f"triton.{self.fn.__name__}", reads, writes)
        return launch

    def __call__(self, *args, **kwargs):
        return self.fn(*args, **kwargs)


def _install_triton() -> None:
    from vllm.triton_utils import triton

    if not hasattr(triton, "next_power_of_2"):     # the placeholder vLLM uses without Triton
        _SET_ATTRS.append((triton, "next_power_of_2", _ABSENT))
        triton.next_power_of_2 = lambda n: 1 << (int(n) - 1).bit_length()
    from vllm.triton_utils import tl

    for dtype in ("float32", "int32", "float16", "bfloat16"):   # launch-time arguments
        if not hasattr(tl, dtype):
            _SET_ATTRS.append((tl, dtype, _ABSENT))
            setattr(tl, dtype, f"tl.{dtype}")
    for modname, name in TRITON_KERNELS:
        module = importlib.import_module(modname)
        fn = getattr(module, name)
        _SET_ATTRS.append((module, name, fn))
        setattr(module, name, TritonLaunch(fn))


# ---------------------------------------------------------------------------------------------

def install() -> list[str]:
    """Install every stand-in; returns the op names registered."""
    import vllm._custom_ops  # noqa: F401  (loads _C)

    registered = _install_ops()
    _install_fake_packages()
    registered += _install_vllm_ops()
    _install_scaled_mm()
    _install_triton()
    registered.append("aten::_scaled_mm (CPU kernel)")
    return registered


def uninstall() -> None:
    for module, name, old in reversed(_SET_ATTRS):
        if old is _ABSENT:
            delattr(module, name)
        else:
            setattr(module, name, old)
    _SET_ATTRS.clear()
    for key, packet in _ROUTED.items():
        ns, op = key.split("::")
        setattr(getattr(torch.ops, ns), op, packet)
    _ROUTED.clear()
    for name, saved in _SAVED_MODULES.items():
        if saved is None:
            sys.modules.pop(name, None)
        else:
            sys.modules[name] = saved
    _SAVED_MODULES.clear()
    FAKE_MODULES.clear()
    _LIBS.clear()


def reset_used() -> None:
    for spec in STANDINS.values():
        spec.used = 0
    for spec in VLLM_OPS.values():
        spec.used = 0
    for k in _LIB_OPS:
        _LIB_OPS[k] = 0
    _SCALED_MM["used"] = 0


def used() -> list[str]:
    """The stand-ins used since the last reset_used(), by name."""
    names = [n + (f" (as {s.routed})" if s.routed else "") for n, s in STANDINS.items()
             if s.used]
    names += [f"vllm::{n}" for n, s in VLLM_OPS.items() if s.used]
    names += [f"audit_lib::{n}" for n, c in _LIB_OPS.items() if c]
    if _SCALED_MM["used"]:
        names.append("aten::_scaled_mm")
    return sorted(names)


def describe() -> str:
    return ""
