"""The vLLM kernel audit's rows as data (analysis/vllm_kernel_audit.py is the harness that runs them).

What a vLLM maintainer reviews, with no harness code in between: which selection list a linear
kernel class is read from and the scheme its family is driven with, the checkpoint config each
fused-MoE method is built from, the backends each method is requested on (the rows
`Class@backend`), and what is expected of the rows that do not run or whose flip test proves
nothing, each with the vLLM line read. The rows themselves are every kernel class vLLM 0.32
exports (discovered by the harness) plus MOE_FORCED_BACKENDS. How to add a row: docs/audit.md.
The findings (the vLLM line behind each stale owner) are analysis/vllm_audit_findings.py.
"""

from __future__ import annotations

import torch

# ---------------------------------------------------------------------------------------------
# Linear kernels: the selection lists a family is read from, the scheme each family drives

# selection list in kernels/linear/__init__.py -> family, in the order a kernel listed in
# several is assigned (Marlin FP8 is in the FP8, block and W8A16 lists: audit it as FP8)
SELECTION_LISTS = {
    "_POSSIBLE_KERNELS": "wNa16",
    "_POSSIBLE_INT8_KERNELS": "int8",
    "_POSSIBLE_FP8_KERNELS": "fp8",
    "_POSSIBLE_FP8_BLOCK_KERNELS": "fp8_block",
    "_POSSIBLE_WFP8A16_KERNELS": "fp8_w8a16",
    "_POSSIBLE_NVFP4_KERNELS": "nvfp4",
    "_POSSIBLE_MXFP4_KERNELS": "mxfp4",
    "_POSSIBLE_MXFP8_KERNELS": "mxfp8",
    "_POSSIBLE_MXFP6_KERNELS": "mxfp6",
}

# The linear drivers: the quant scheme that selects a kernel of each family in vLLM's own code.
# row -> (scheme class, positional arguments, keyword arguments); `linear_scheme_row` says which
# row a kernel class takes. The classes are compressed-tensors schemes
# (quantization/compressed_tensors/schemes) unless named `quark:` (quantization/quark/schemes,
# driven through QuarkLinearMethod); a dict argument is a compressed-tensors QuantizationArgs,
# a string `quant_utils:NAME` that constant of quantization/utils/quant_utils.py.
_FP8_W = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": False}
LINEAR_SCHEMES: dict[str, tuple[str, tuple, dict]] = {
    "wNa16": ("CompressedTensorsWNA16", ("group", 4, 128), {"symmetric": True}),
    "CutlassW4A8LinearKernel": ("CompressedTensorsW4A8Fp8", ("group", 4, 128), {}),
    "XPUW4A8IntLinearKernel": ("CompressedTensorsW4A8Int", ("group", 4, 128), {}),
    "int8": ("CompressedTensorsW8A8Int8", ("channel", False, True), {}),
    "fp8_block": ("CompressedTensorsW8A8Fp8",
                  (dict(_FP8_W, strategy="block", block_structure=[128, 128]), False), {}),
    # per-tensor kernels get per-tensor weights; activations are quantized dynamically
    # (this CPU build declares `_C::static_scaled_fp8_quant` with no arguments)
    "fp8": ("CompressedTensorsW8A8Fp8", (dict(_FP8_W, strategy="channel"), False), {}),
    "fp8/per-tensor": ("CompressedTensorsW8A8Fp8", (dict(_FP8_W, strategy="tensor"), False), {}),
    "fp8_w8a16": ("CompressedTensorsW8A16Fp8", (dict(_FP8_W, strategy="channel"), False), {}),
    "nvfp4": ("CompressedTensorsW4A4Fp4", (), {"use_a16": False}),
    "nvfp4/a16": ("CompressedTensorsW4A4Fp4", (), {"use_a16": True}),
    "mxfp4": ("CompressedTensorsW4A4Mxfp4", (), {}),
    "mxfp8": ("CompressedTensorsW8A8Mxfp8", (), {}),
    "mxfp6": ("quark:QuarkOCP_MX", ("quant_utils:kMxfp6E3M2Static", None), {}),
}
# the FP8 kernels given per-tensor weights: their names contain one of these
PER_TENSOR_FP8 = ("PerTensor", "B12xTensor", "FlashInferFP8", "CPUFp8PerTensor")
# the NVFP4 kernels with 16-bit activations
NVFP4_A16 = ("B12xNvFp4W4A16LinearKernel", "FlashInferCuteDslNvFp4W4A16LinearKernel",
             "MarlinNvFp4LinearKernel", "HummingNvFp4LinearKernel")


def linear_scheme_row(kernel: str, family: str) -> str:
    """The LINEAR_SCHEMES row that drives linear kernel class `kernel` of `family`."""
    if kernel in LINEAR_SCHEMES:
        return kernel
    if family == "fp8" and any(p in kernel for p in PER_TENSOR_FP8):
        return "fp8/per-tensor"
    if family == "nvfp4" and kernel in NVFP4_A16:
        return "nvfp4/a16"
    return family


# activation dtype per family (the scheme's and the layer's): float16 for wNa16, else bfloat16
ACT_DTYPE = {"wNa16": torch.float16}


class _Default(dict):
    def __missing__(self, key):
        return torch.bfloat16


ACT_DTYPE = _Default(ACT_DTYPE)


# ---------------------------------------------------------------------------------------------
# Fused-MoE methods: the layer, the checkpoint config each method is built from (Note [audit
# MoE driver] in vllm_kernel_audit.py), and the methods no config builds

MOE_EXPERTS, MOE_HIDDEN, MOE_INTER, MOE_TOPK = 4, 128, 128, 2
MOE_PACKAGES = ("vllm.model_executor.layers.quantization", "vllm.model_executor.layers.fused_moe")
MOE_BASES = ("FusedMoEMethodBase", "CompressedTensorsMoEMethod", "QuarkMoEMethod",
             "OnlineMoEMethodBase", "_Fp8OnlineMoEBase", "Mxfp4MoEMethod")

def _ct_group(weights: dict, acts: dict | None = None, fmt: str = "float-quantized") -> dict:
    return {"quant_method": "compressed-tensors", "format": fmt,
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights,
                                          "input_activations": acts}},
            "ignore": []}


_FP8_T = {"num_bits": 8, "type": "float", "strategy": "tensor", "symmetric": True,
          "dynamic": False}
_FP8_CH = dict(_FP8_T, strategy="channel")
_FP8_DYN_TOK = {"num_bits": 8, "type": "float", "strategy": "token", "symmetric": True,
                "dynamic": True}
_INT8_CH = {"num_bits": 8, "type": "int", "strategy": "channel", "symmetric": True,
            "dynamic": False}
_INT8_DYN_TOK = {"num_bits": 8, "type": "int", "strategy": "token", "symmetric": True,
                 "dynamic": True}
_INT4_G = {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 128,
           "symmetric": True, "dynamic": False}
_FP4_G = {"num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": 16,
          "symmetric": True, "dynamic": False}
_FP4_DYN = dict(_FP4_G, dynamic="local")
_MXFP4 = {"num_bits": 4, "type": "float", "strategy": "group", "group_size": 32,
          "symmetric": True, "dynamic": False, "scale_dtype": "torch.uint8"}
_MXFP8 = {"num_bits": 8, "type": "float", "strategy": "group", "group_size": 32,
          "symmetric": True, "dynamic": False, "scale_dtype": "torch.uint8"}


def _quark(weight: dict, act: dict | None) -> dict:
    return {"quant_method": "quark", "export": {"kv_cache_group": [], "pack_method": "reorder"},
            "global_quant_config": {"weight": weight, "input_tensors": act, "output_tensors": None,
                                    "bias": None},
            "layer_quant_config": {}, "layer_type_quant_config": {}, "exclude": []}


_Q_FP8 = {"dtype": "fp8_e4m3", "qscheme": "per_tensor", "is_dynamic": False, "symmetric": True}
_Q_INT8_CH = {"dtype": "int8", "qscheme": "per_channel", "ch_axis": 0, "is_dynamic": False,
              "symmetric": True}
_Q_INT8_TOK = {"dtype": "int8", "qscheme": "per_channel", "ch_axis": 1, "is_dynamic": True,
               "symmetric": True}
_Q_INT4_G = {"dtype": "int4", "qscheme": "per_group", "group_size": 128, "ch_axis": 1,
             "is_dynamic": False, "symmetric": True}
_Q_INT4_CH = {"dtype": "int4", "qscheme": "per_channel", "ch_axis": 0, "is_dynamic": False,
              "symmetric": True}
_Q_MXFP4 = {"dtype": "fp4", "qscheme": "per_group", "group_size": 32, "ch_axis": -1,
            "is_dynamic": False, "scale_format": "e8m0"}
_Q_MXFP4_DYN = dict(_Q_MXFP4, is_dynamic=True)
_Q_NVFP4 = {"dtype": "fp4", "qscheme": "per_group", "group_size": 16, "ch_axis": -1,
            "is_dynamic": False, "scale_format": "float8_e4m3fn"}

# method class -> (quant config name for vLLM's registry, the checkpoint's config dict) or
# ("online", None): built as vLLM's online config builds it
MOE_CONFIGS: dict[str, tuple[str, dict | None]] = {
    "Fp8MoEMethod": ("fp8", {"quant_method": "fp8", "activation_scheme": "dynamic"}),
    "ModelOptFp8MoEMethod": ("modelopt", {"quantization": {"quant_algo": "FP8"}}),
    "ModelOptNvFp4FusedMoE": ("modelopt_fp4", {"quantization": {
        "quant_algo": "NVFP4", "group_size": 16, "exclude_modules": [],
        "kv_cache_quant_algo": None}}),
    # the fields modelopt.py:815 / :1243 require of an hf_quant_config.json
    "ModelOptMxFp8FusedMoE": ("modelopt_mxfp8", {"quantization": {
        "quant_algo": "MXFP8", "kv_cache_quant_algo": None, "exclude_modules": []}}),
    "Mxfp4MoEMethod": ("mxfp4", {}),
    "GptOssMxfp4MoEMethod": ("gpt_oss_mxfp4", {}),
    "AutoAWQMoEMethod": ("awq", {"quant_method": "awq", "bits": 4, "group_size": 128,
                                 "zero_point": True}),
    "AutoGPTQMoEMethod": ("gptq", {"quant_method": "gptq", "bits": 4, "group_size": 128,
                                   "desc_act": False, "sym": True}),
    "MoeWNA16Method": ("moe_wna16", {"quant_method": "gptq", "bits": 4, "group_size": 128,
                                     "desc_act": False, "sym": True}),
    "CompressedTensorsW8A8Fp8MoEMethod": ("compressed-tensors", _ct_group(_FP8_CH,
                                                                         _FP8_DYN_TOK)),
    "CompressedTensorsW8A8Int8MoEMethod": ("compressed-tensors", _ct_group(
        _INT8_CH, _INT8_DYN_TOK, "int-quantized")),
    "CompressedTensorsWNA16MoEMethod": ("compressed-tensors", _ct_group(
        _INT4_G, None, "pack-quantized")),
    "CompressedTensorsW4A4Nvfp4MoEMethod": ("compressed-tensors", _ct_group(
        _FP4_G, _FP4_DYN, "nvfp4-pack-quantized")),
    "CompressedTensorsW4A4Mxfp4MoEMethod": ("compressed-tensors", _ct_group(
        _MXFP4, None, "mxfp4-pack-quantized")),
    "CompressedTensorsW8A8Mxfp8MoEMethod": ("compressed-tensors", _ct_group(
        _MXFP8, dict(_MXFP8, dynamic=True), "mxfp8-quantized")),
    "CompressedTensorsW4A8Int8MoEMethod": ("compressed-tensors", _ct_group(
        dict(_INT4_G, strategy="group"), _INT8_DYN_TOK, "int-quantized")),
    "CompressedTensorsW4A8Fp8MoEMethod": ("compressed-tensors", _ct_group(
        _INT4_G, _FP8_DYN_TOK, "int-quantized")),
    "CompressedTensorsW4A8Mxfp4MoEMethod": ("compressed-tensors", _ct_group(
        _MXFP4, _FP8_DYN_TOK, "mxfp4-pack-quantized")),
    "QuarkW8A8Fp8MoEMethod": ("quark", _quark(_Q_FP8, _Q_FP8)),
    "QuarkW8A8Int8MoEMethod": ("quark", _quark(_Q_INT8_CH, _Q_INT8_TOK)),
    "QuarkW4A16Int4MoEMethod": ("quark", _quark(_Q_INT4_G, None)),
    "QuarkOCP_MX_MoEMethod": ("quark", _quark(_Q_MXFP4, _Q_MXFP4_DYN)),
    # two-element weight/input lists: what quark_moe.py:185-197 (`_is_fp8_w4a8`, `_is_nvfp4`,
    # quark.py:366, :602) match; a single dict is read as another scheme
    "QuarkNvfp4MoEMethod": ("quark", _quark([_Q_NVFP4, _Q_FP8], [dict(_Q_NVFP4, is_dynamic=True),
                                                                  _Q_FP8])),
    "QuarkW4A8Fp8MoEMethod": ("quark", _quark([_Q_FP8, _Q_INT4_CH], _Q_FP8)),
    # FlashInferExperts takes FP8 with static per-tensor activation scales
    # (experts/flashinfer_cutlass_moe.py:_supports_quant_scheme)
    "Fp8MoEMethod@flashinfer_cutlass": ("fp8", {"quant_method": "fp8",
                                                "activation_scheme": "static"}),
    # AutoRound (Intel Neural Compressor) MX exports: the fields INCConfig.from_config and
    # `_validate_raw_config` read (quantization/inc/inc.py:223-256, :274-309)
    "INCMxfp8MoEMethod": ("inc", {"quant_method": "auto-round", "bits": 8, "group_size": 32,
                                  "data_type": "mx_fp", "sym": True, "act_bits": 8,
                                  "act_data_type": "mx_fp", "act_group_size": 32,
                                  "act_sym": True, "act_dynamic": True}),
    "INCMxfp4MoEMethod": ("inc", {"quant_method": "auto-round", "bits": 4, "group_size": 32,
                                  "data_type": "mx_fp", "sym": True, "act_bits": 4,
                                  "act_data_type": "mx_fp", "act_group_size": 32,
                                  "act_sym": True, "act_dynamic": True}),
    # a ModelOpt MIXED_PRECISION export whose experts use a GGUF-style block codec: the
    # per-layer recipe fields ModelOptMixedPrecisionConfig checks (modelopt.py:1563-1575), the
    # expert projections listed per expert, as a model's config.json lists them
    "ModelOptBlockQuantMoEMethod": ("modelopt_mixed", {"quantization": {
        "quant_algo": "MIXED_PRECISION", "kv_cache_quant_algo": None, "exclude_modules": [],
        "quantized_layers": {
            f"moe.experts.{e}.{proj}": {"quant_algo": "IQ2_XS", "group_size": 256,
                                        "block_payload_bytes": 74, "packing": "ggml"}
            for e in range(MOE_EXPERTS) for proj in ("gate_proj", "up_proj", "down_proj")}}}),
    "Fp8PerTensorOnlineMoEMethod": ("online", None),
    "Fp8PerBlockOnlineMoEMethod": ("online", None),
    "Fp8PtpcOnlineMoEMethod": ("online", None),
    "Int8OnlineMoEMethod": ("online", None),
    "Mxfp4OnlineMoEMethod": ("online", None),
    "Mxfp8OnlineMoEMethod": ("online", None),
    "Nvfp4OnlineMoEMethod": ("online", None),
}

# methods with no checkpoint config the harness can build, and why (read in the source)
MOE_NOT_DRIVEN: dict[str, str] = {
    "HummingMoEMethod": "needs the `humming` package (quantization/humming.py)",
    "CompressedTensorsW4A16FlydslMoEMethod": (
        "vLLM builds it only on ROCm: the compressed-tensors MoE selection returns it when "
        "`current_platform.is_rocm()`, the GPU is a gfx950, LoRA is off and moe_backend is "
        "\"flydsl\" (compressed_tensors_moe.py:105-126); its apply runs aiter's FlyDSL MoE "
        "kernels (`aiter.ops.flydsl.kernels.moe_2stage_a16wmix` and aiter's `moe_sorting`, "
        "fused_moe/fused_flydsl_moe.py:81, :188), so a ROCm gfx950 GPU with aiter would run it"),
}


# ---------------------------------------------------------------------------------------------
# Requested backends: the rows `Class@backend`, and why some still do not run

# Note [audit MoE backends]
# ~~~~~~~~~~~~~~~~~~~~~~~~~
# On this CPU vLLM's oracles pick no backend for most quantized methods (the CPU experts need
# AMX, experts/cpu_moe.py; what an AMX CPU would pick: Note [audit AMX probe]). The published
# MoE bugs live in the CUDA/ROCm backends, so a method also runs once per backend listed in
# MOE_FORCED_BACKENDS, as a row `Class@backend`: the backend is requested the way a user does
# (`kernel_config.moe_backend`, which the oracle's "explicit moe_backend from user" branch
# honours, e.g. oracle/fp8.py select_fp8_moe_backend), and inside `forced_moe_device()` the
# platform is a Hopper (SM 9.0) and every experts class answers yes to
# `_supports_current_device()`. Its quant-scheme, activation and shape checks still run as
# shipped; a device question asked inside a scheme check (TritonExperts' INT8 needs
# `is_cuda()` and SM 7.5, experts/triton_moe.py:137-144) gets the forced device's answer
# (`_as_cuda`). `torch.accelerator.empty_cache()`, which raises with no accelerator
# (quark_moe.py:1844), does nothing there. The backend's CUDA ops, Triton kernels and library
# calls are stand-ins (Note [audit stand-ins]). vLLM's real CPU ops are never reached this
# way (their AMX paths would SIGILL). A row that still cannot run says why
# (MOE_FORCED_WHY_NOT); a method's row without a forced backend names the forced rows of the
# method that ran (note_forced_rows).
# CPU experts class (fused_moe/experts/cpu_moe.py) -> the methods whose oracle picks it on a CPU
# with AMX (Note [audit AMX probe]); each also runs as a row `Class@cpu` (Note [audit CPU experts])
MOE_CPU_EXPERTS: dict[str, tuple[str, ...]] = {
    "CPUExpertsInt4": ("AutoAWQMoEMethod", "AutoGPTQMoEMethod", "MoeWNA16Method",
                       "CompressedTensorsWNA16MoEMethod", "QuarkW4A16Int4MoEMethod"),
    "CPUExpertsInt8": ("CompressedTensorsW8A8Int8MoEMethod", "QuarkW8A8Int8MoEMethod",
                       "Int8OnlineMoEMethod"),
    "CPUExpertsMxfp4": ("Mxfp4MoEMethod", "GptOssMxfp4MoEMethod", "Mxfp4OnlineMoEMethod",
                        "CompressedTensorsW4A8Mxfp4MoEMethod", "QuarkOCP_MX_MoEMethod"),
    "CPUExpertsFp8": ("Fp8PerBlockOnlineMoEMethod",),
}

MOE_FORCED_BACKENDS: list[tuple[str, str]] = [
    ("CompressedTensorsW8A8Fp8MoEMethod", "cutlass"),        # vLLM #41670
    ("Fp8MoEMethod", "flashinfer_cutlass"),                  # vLLM #50521
    ("Fp8MoEMethod", "aiter"),                               # vLLM #40390
    ("Fp8MoEMethod", "triton"),
    # the FP8 checkpoint formats on the Triton experts (oracle/fp8.py map_fp8_backend)
    ("ModelOptFp8MoEMethod", "triton"),
    ("QuarkW8A8Fp8MoEMethod", "triton"),
    ("CompressedTensorsW8A8Fp8MoEMethod", "triton"),
    # weight-only FP8 through Marlin MoE (oracle/fp8.py: "marlin" -> MarlinExperts)
    ("Fp8MoEMethod", "marlin"),
    # WNA16 through Marlin MoE (oracle/int_wna16.py map_wna16_backend: "marlin")
    ("AutoGPTQMoEMethod", "marlin"),
    ("AutoAWQMoEMethod", "marlin"),
    ("CompressedTensorsWNA16MoEMethod", "marlin"),
    ("MoeWNA16Method", "marlin"),
    ("QuarkW4A16Int4MoEMethod", "marlin"),
    # Int8 on the Triton experts (oracle/int8.py map_int8_backend: "triton")
    ("CompressedTensorsW8A8Int8MoEMethod", "triton"),
    ("QuarkW8A8Int8MoEMethod", "triton"),
    ("Int8OnlineMoEMethod", "triton"),
    # MXFP4 (oracle/mxfp4.py map_mxfp4_backend: "marlin", "emulation")
    ("Mxfp4MoEMethod", "marlin"),
    ("GptOssMxfp4MoEMethod", "marlin"),
    ("QuarkOCP_MX_MoEMethod", "marlin"),
    # compressed-tensors W4A4 MXFP4 does not read moe_backend: it takes CutlassExpertsMxfp4
    # wherever that class supports the device (compressed_tensors_moe_w4a4_mxfp4.py:63-79),
    # so under the forced device this row runs the CUTLASS MXFP4 experts (its scheme column)
    ("CompressedTensorsW4A4Mxfp4MoEMethod", "marlin"),
    # AutoRound (INC) W4A4 MXFP4 picks likewise (quantization/inc/schemes/inc_mxfp4_moe.py:69:
    # CUTLASS W4A4 where CutlassExpertsMxfp4 supports the device, else Marlin W4A16)
    ("INCMxfp4MoEMethod", "marlin"),
    ("Mxfp4MoEMethod", "emulation"),
    # NVFP4 (oracle/nvfp4.py map_nvfp4_backend: "emulation", "marlin")
    ("ModelOptNvFp4FusedMoE", "emulation"),
    ("ModelOptNvFp4FusedMoE", "marlin"),
    ("CompressedTensorsW4A4Nvfp4MoEMethod", "emulation"),
    ("CompressedTensorsW4A4Nvfp4MoEMethod", "marlin"),
    ("QuarkNvfp4MoEMethod", "emulation"),
    ("QuarkNvfp4MoEMethod", "marlin"),
    # the FP8 online methods on the Triton experts and Marlin (oracle/fp8.py map_fp8_backend)
    ("Fp8PerTensorOnlineMoEMethod", "triton"),
    ("Fp8PerBlockOnlineMoEMethod", "triton"),
    ("Fp8PtpcOnlineMoEMethod", "triton"),
    ("Fp8PerTensorOnlineMoEMethod", "marlin"),
    # the other FP8 checkpoint formats on Marlin and AITER
    ("ModelOptFp8MoEMethod", "marlin"),
    ("QuarkW8A8Fp8MoEMethod", "marlin"),
    ("CompressedTensorsW8A8Fp8MoEMethod", "marlin"),
    ("ModelOptFp8MoEMethod", "aiter"),
    ("QuarkW8A8Fp8MoEMethod", "aiter"),
    ("CompressedTensorsW8A8Fp8MoEMethod", "aiter"),
    # MXFP8 weights requested on Marlin
    ("ModelOptMxFp8FusedMoE", "marlin"),
    # WNA16 on the Triton experts (AutoAWQ's layout and GPTQ's bias are refused there,
    # oracle/int_wna16.py:194-198) and on the INT4 emulation experts
    ("CompressedTensorsWNA16MoEMethod", "triton"),
    ("QuarkW4A16Int4MoEMethod", "triton"),
    ("MoeWNA16Method", "triton"),
    ("AutoAWQMoEMethod", "emulation"),
    ("AutoGPTQMoEMethod", "emulation"),
    # unquantized experts (oracle/unquantized.py map_unquantized_backend)
    ("UnquantizedFusedMoEMethod", "triton"),
    ("UnquantizedFusedMoEMethod", "aiter"),
    ("UnquantizedFusedMoEMethod", "flashinfer_cutlass"),
    # more methods on Marlin, and WNA16 on the INT4 emulation experts
    ("Fp8PerBlockOnlineMoEMethod", "marlin"),
    ("Mxfp4OnlineMoEMethod", "marlin"),
    ("CompressedTensorsW4A8Mxfp4MoEMethod", "marlin"),
    ("CompressedTensorsWNA16MoEMethod", "emulation"),
    # vLLM's CPU experts without their AMX condition (Note [audit CPU experts])
    *((name, "cpu") for names in MOE_CPU_EXPERTS.values() for name in names),
]

# forced-backend rows that still do not run, and why, read in vLLM's source (appended to the
# row's reason)
MOE_FORCED_WHY_NOT: dict[str, str] = {
    "QuarkW4A16Int4MoEMethod@marlin": (
        "on any device: Marlin MoE takes only AutoAWQ, AutoGPTQ and compressed-tensors "
        "configs, a Quark config gets \"Marlin not supported for this layer\" "
        "(fused_moe/oracle/int_wna16.py:208-221); the row QuarkW4A16Int4MoEMethod@triton runs"),
    "MoeWNA16Method@marlin": (
        "on any device: Marlin MoE (and the emulation experts) refuse the MoeWNA16 checkpoint "
        "layout (`allow_marlin = not isinstance(quant_config, MoeWNA16Config)`, fused_moe/"
        "oracle/int_wna16.py:208, :228-233); the row MoeWNA16Method@triton runs"),
    "Mxfp4MoEMethod@emulation": (
        "the OCP MX emulation experts (experts/ocp_mx_emulation_moe.py:131: amd-quark, which "
        "the Makefile installs) dequantize MXFP4 with amd-quark's `mx.dq_mxfp4` at apply "
        "(quantization/utils/mxfp4_utils.py:150-158), whose C++ kernel is CUDA/HIP only "
        "(quark/torch/kernel/hw_emulation/csrc/python_function_export.cpp:75): a GPU with "
        "amd-quark would run it"),
}

# the @cpu rows that do not run: vLLM's own code fails on the path an AMX CPU takes (Note
# [audit CPU experts]); read in the source, the same with AMX
_INT4_CPU_TYPE = (
    "a bug on CPUs with AMX: the WNA16 oracle offers CPUExpertsInt4 to every int4 config "
    "(its scheme check is only `kInt4Static`, fused_moe/experts/cpu_moe.py), so the AMX "
    "probe's construction picks it, but the CPU weight processing accepts only AutoAWQ, "
    "AutoGPTQ and compressed-tensors configs (`_process_weights_cpu`, fused_moe/oracle/"
    "int_wna16.py:1005-1028) and raises TypeError when the weights are processed; the row {row} runs")
MOE_FORCED_WHY_NOT.update({
    "MoeWNA16Method@cpu": _INT4_CPU_TYPE.format(row="MoeWNA16Method@triton"),
    "QuarkW4A16Int4MoEMethod@cpu": _INT4_CPU_TYPE.format(row="QuarkW4A16Int4MoEMethod@triton"),
    "QuarkW8A8Int8MoEMethod@cpu": (
        "a bug on CPUs with AMX: process_weights_after_loading builds the int8 kernel "
        "(quark/quark_moe.py:1309 `get_fused_moe_quant_config`, :1315 `make_int8_moe_kernel`) "
        "but never calls the experts' `process_weights_after_loading`, which for CPUExpertsInt8 "
        "VNNI-packs the weights (`convert_weight_packed`, fused_moe/experts/cpu_moe.py:"
        "1080-1085); compressed-tensors and online int8 call it (compressed_tensors_moe_w8a8_"
        "int8.py:232, online/int8.py:122, and those rows run here). The unpacked weight "
        "reaches `fused_experts_cpu` (_custom_ops.py:3371), which rejects it at the first "
        "forward (K 128 where the packed layout has 132: 128 plus the int32 compensation)"),
    "QuarkOCP_MX_MoEMethod@cpu": (
        "a bug on vLLM's CPU platform: process_weights_after_loading calls "
        "`torch.accelerator.empty_cache()` (quark/quark_moe.py:1844), which raises with no "
        "accelerator (the forced-device row QuarkOCP_MX_MoEMethod@marlin runs because the "
        "harness makes that call do nothing there, Note [audit MoE backends])"),
})

# methods with no row that runs, neither here nor on a forced backend, and what would change
# that, read in vLLM's source (appended to the reason of the method's row)
MOE_BASE_WHY_NOT: dict[str, str] = {
    "CompressedTensorsW4A8Int8MoEMethod": (
        "vLLM lists one W4A8 INT8 backend, on CPU only (fused_moe/oracle/w4a8_int8.py:39-41), "
        "and its experts take only an Arm CPU (experts/cpu_int4_moe.py:60-64): an Arm CPU "
        "would change it, not AMX or a GPU; their native op says so too (tried while "
        "writing the @cpu rows, with that check answered Arm: `_C::dynamic_4bit_int_moe` "
        "raised \"dynamic 4-bit int MoE path requires AArch64\" at apply, cpu_int4_moe.py:260)"),
    "CompressedTensorsW4A8Fp8MoEMethod": (
        "its experts are CUTLASS and Humming (fused_moe/oracle/w4a8.py), so it needs a GPU "
        "(Humming also the `humming` package), and the method asserts hidden and intermediate "
        "sizes divisible by 256 for CUTLASS's reorder "
        "(compressed_tensors_moe_w4a8_fp8.py:69-72), twice the audit's MoE layer"),
    "Nvfp4OnlineMoEMethod": (
        "its constructor requires a Blackwell GPU "
        "(`is_device_capability_family(100)`, quantization/online/nvfp4.py:100-102)"),
    "FusedMoEModularMethod": (
        "built by vLLM's LoRA wrapper (Note [audit MoE LoRA]), its apply reaches the LoRA "
        "delta of the CPU platform's punica wrapper, PunicaWrapperCPU, which implements "
        "embedding, linear and logits LoRA only (lora/punica_wrapper/punica_cpu.py) and "
        "inherits `add_lora_w13`, which raises (punica_base.py:485-523): vLLM has no MoE LoRA "
        "on CPU; a GPU's punica wrapper has it (punica_gpu.py:527)"),
    "ModelOptBlockQuantMoEMethod": (
        "its constructor requires B12xExperts on the current device "
        "(modelopt_block_quant.py:72-73), which takes only a CUDA GPU of the SM 12.x family "
        "with the `b12x` package (fused_moe/b12x.py:491-497); past that check, its "
        "`maybe_roundup_sizes` requires hidden and intermediate sizes aligned to the "
        "codec's 256-value blocks (modelopt_block_quant.py:108-112), twice the audit's MoE "
        "layer"),
    "QuarkW4A8Fp8MoEMethod": (
        "its constructor asserts ROCm AITER fused MoE (quark/quark_moe.py:1404-1405): a ROCm "
        "GPU with aiter would change it"),
}

# extra FusedMoE arguments for a row, as a model's MoE block passes them (layer.py
# FusedMoEFactory): a SwiGLU clamp limit, as gpt-oss-style models set, is what FlashInfer
# CUTLASS turns into the per-expert `gemm1_clamp_limit` tensor of vLLM #50521 (fp8.py:777
# -> oracle/fp8.py:801 -> experts/flashinfer_cutlass_moe.py:109)
MOE_LAYER_ARGS: dict[str, dict] = {
    "Fp8MoEMethod@flashinfer_cutlass": {"swiglu_limit": 7.0},
}


# ---------------------------------------------------------------------------------------------
# Expectations the harness checks against: flip tests that prove nothing, rows whose outcome
# depends on the CPU (Note [audit CPU paths] in vllm_kernel_audit.py)

# Rows whose flip test says nothing reproducible: their stand-in's output is a hash of every
# tensor it reads, uninitialized workspaces included (seen: the committed and a CI rerun of the
# same code disagreed), so whether eager output follows a flipped value is luck.
NO_FLIP = {
    "Fp8MoEMethod@flashinfer_cutlass": "not run: the flashinfer cutlass_fused_moe stand-in's "
                                       "output hashes uninitialized workspaces too, so a flip "
                                       "proves nothing here",
    "CompressedTensorsW4A4Mxfp4MoEMethod@marlin": (
        "not run: vLLM hands `_C::get_cutlass_moe_mm_data` a fresh `torch.empty` "
        "`blockscale_offsets` (experts/cutlass_moe.py:885) that the CUDA kernel fills, though "
        "the op's schema declares it read-only (`Tensor? blockscale_offsets`); the stand-in "
        "follows the schema, so the stand-ins after it hash uninitialized memory (seen: every "
        "perturbation changed both eager and replay) and a flip proves nothing here"),
}
NO_FLIP["INCMxfp4MoEMethod@marlin"] = NO_FLIP["CompressedTensorsW4A4Mxfp4MoEMethod@marlin"]


# row -> why its outcome depends on the CPU (Note [audit CPU paths])
CPU_DEPENDENT: dict[str, str] = {
    "CPUInt8ScaledMMLinearKernel": "sgl-kernels int8 GEMM with AMX, oneDNN without "
                                   "(scaled_mm/cpu.py:50-57)",
    "CPUWNA16LinearKernel": "`cpu_gemm_wna16` is not in the AVX2 build; ISA hint by AMX "
                            "(mixed_precision/cpu.py:211-213)",
    "CPUFp8BlockScaledMMKernel": "`convert_weight_packed` (sgl-kernels) is not in the AVX2 "
                                 "build (scaled_mm/cpu.py:278)",
    "CPUFp8PerTensorScaledMMLinearKernel": "CPU FP8 ops of the AVX-512 builds",
    "CPUFP8W8A8ScaledMMLinearKernel": "CPU FP8 ops of the AVX-512 builds",
    "CPUFp8W8A8BlockScaledMMKernel": "CPU FP8 ops of the AVX-512 builds",
    "UnquantizedFusedMoEMethod": "CPU experts: AMX kernels with AMX "
                                 "(fused_moe/experts/cpu_moe.py:318-330)",
}
# the methods whose MoE oracle offers a CPU experts class only with AMX (cpu_moe.py, Note
# [audit AMX probe]): on an AMX CPU the row takes it, here it finds no backend
CPU_DEPENDENT.update({name: f"with AMX the oracle picks {experts} (fused_moe/experts/cpu_moe.py)"
                      for experts, names in MOE_CPU_EXPERTS.items() for name in names})
# the @cpu rows (Note [audit CPU experts]): the sgl-kernels MoE ops of the AVX-512 build, whose
# inner GEMM is AMX brgemm or AVX-512 by the CPU and the rows per block
CPU_DEPENDENT.update({f"{name}@cpu": f"{experts} (sgl-kernels `fused_experts_cpu`): AMX or "
                      "AVX-512 GEMMs by the CPU; not in the AVX2 build"
                      for experts, names in MOE_CPU_EXPERTS.items() for name in names})
# the rows of CPU_DEPENDENT whose outcome depends on the ops vLLM's build has: the AVX2 build
# lacks them, the AVX-512 build (which AMX CPUs load too) has them
BUILD_DEPENDENT = frozenset({"CPUWNA16LinearKernel", "CPUFp8BlockScaledMMKernel",
                             "CPUFp8PerTensorScaledMMLinearKernel",
                             "CPUFP8W8A8ScaledMMLinearKernel", "CPUFp8W8A8BlockScaledMMKernel",
                             *(f"{name}@cpu" for names in MOE_CPU_EXPERTS.values()
                               for name in names)})
