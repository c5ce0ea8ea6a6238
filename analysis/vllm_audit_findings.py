"""The vLLM kernel audit's findings as data: the vLLM line behind each stale owner, read in the source.

`finding_source(row, owner path)` is what the harness (analysis/vllm_kernel_audit.py) cites in
the results' Findings; an edge with no entry here is reported as "unchecked", never as a vLLM
bug. Also the reload's own failures and the published fused-MoE bugs of issue #15, with what
the audit ran of each. How to add a finding: docs/audit.md.
"""

from __future__ import annotations

import re

# (kernel class, owner path) -> (vLLM source line that rebinds or holds the tensor, what it
# does). Filled by reading the installed vLLM 0.32 source for each stale edge the audit
# found; an edge missing here is reported as "unchecked", never as a vLLM bug.
FINDING_SOURCES: dict[tuple[str, str], tuple[str, str]] = {
    ("CPUInt8ScaledMMLinearKernel", "proj.scheme.kernel.dnnl_handler.handler_tensor"): (
        "vllm/model_executor/kernels/linear/scaled_mm/cpu.py:136",
        "the stale edge is the recorder's view, not a bug a user can hit: "
        "process_weights_after_loading rebinds `self.dnnl_handler = "
        "ops.create_onednn_scaled_mm(...)` (cpu.py:136) on every run, the reload's included, and "
        "the old handler's `__del__` releases its oneDNN primitive (vllm/_custom_ops.py:3726-3728), "
        "so a graph captured before the reload would hold a freed handle; but vLLM's CPU platform "
        "captures no graphs (`cudagraph_capture_sizes = []`, vllm/platforms/cpu.py:353), and the "
        "forward reads the kernel's current handler on every call (`ops.onednn_scaled_mm("
        "self.dnnl_handler, ...)`, cpu.py:208, which passes `dnnl_handler.handler_tensor`, "
        "vllm/_custom_ops.py:3837-3844). What the reload does break on this path: the handler "
        "is built from the layer's weight scale as it is during the reload's process step "
        "(`getattr(layer, w_s_name)`, cpu.py:138), which is the temporary the reload "
        "materialised for the layer (model_loader/reload/layerwise.py:354, process step :388); "
        "the reload then copies the values into the original parameter (:425) and re-registers "
        "the original (:444), and once the layer's reload state is reset (:400, "
        "model_loader/reload/types.py:36-39) nothing in Python keeps the temporary. The native "
        "handler "
        "does not copy the scales: `create_onednn_scaled_mm_handler` stores "
        "`b_scales.data_ptr()` and the handler wraps that pointer in its weight-scale "
        "dnnl::memory (csrc/cpu/dnnl_kernels.cpp and dnnl_helper.cpp, "
        "`init_runtime_memory_cache`, read in the vllm-project/vllm repository, not in this "
        "wheel), so every forward after a reload reads the scales through a pointer to freed "
        "memory (read in the code; this audit runs no value test of it). The prepacked weight lives only inside the primitive (the registered `weight` "
        "is set to None, cpu.py:146)"),
    ("CPUInt8ScaledMMLinearKernel",
     "proj.scheme.kernel.dnnl_handler.handler_tensor <- proj.weight_scale"): (
        "vllm/model_executor/kernels/linear/scaled_mm/cpu.py:136",
        "found by lineage (Note [audit dangling sources]): during the reload's process step "
        "`ops.create_onednn_scaled_mm(weight, getattr(layer, w_s_name), ...)` (cpu.py:136-138) "
        "makes the new handler from the reload's temporary `weight_scale` "
        "(`_C::create_onednn_scaled_mm_handler` returns the pointer held in `handler_tensor`, "
        "vllm/_custom_ops.py:3776); the reload copies the values into the original parameter, "
        "registers it again and drops the temporary, so the live handler's source is freed "
        "while the layer keeps that value in another storage; every forward after the reload "
        "reads the scales through that pointer (reproduced from vLLM alone: "
        "analysis/repro/cpu_int8_scale_after_reload.py). The weight it prepacked is released "
        "on purpose (cpu.py:146) and not listed"),
}
# The MXFP8 emulation experts (both methods that reach them): one cause for the four owners of
# their scales; {rebuild} is where each method rebuilds the experts
_MXFP8_STASHED = (
    "`Mxfp8TritonExpertsBase.__init__` stashes `self.w1_scale_val = "
    "self.quant_config.w1_scale` (and `w2_scale_val`, :41) and clears the quant config's "
    "scales (:42-43); the experts object is rebuilt by every process_weights_after_loading "
    "({rebuild}: `self.moe_kernel = make_fp8_moe_kernel(...)` from a fresh "
    "`get_fused_moe_quant_config`), so during vLLM's layerwise reload the new kernel stashes "
    "the *processed* scale tensor of that run, and `_copy_and_restore_kernel_tensors` "
    "(model_loader/reload/layerwise.py) then copies it into the layer's original "
    "`w13_weight_scale` / `w2_weight_scale` storage. The captured graph reads the layer "
    "parameter (refreshed, same values), eager reads the kernel's orphaned copy: diverged, "
    "the pattern of vLLM #41670 (`moe_quant_config._w1.scale` left pointing at the orphaned "
    "scale)")
FINDING_SOURCES.update({
    (method, path): ("vllm/model_executor/layers/fused_moe/experts/mxfp8_emulation_moe.py:40",
                     _MXFP8_STASHED.format(rebuild=rebuild))
    for method, rebuild in (("CompressedTensorsW8A8Mxfp8MoEMethod",
                             "compressed_tensors_moe_w8a8_mxfp8.py:134-137"),
                            ("Mxfp8OnlineMoEMethod", "quantization/online/mxfp8.py:201"))
    for path in ("moe.routed_experts.quant_method.moe_kernel.impl.fused_experts.w1_scale_val",
                 "moe.routed_experts.w13_weight_scale",
                 "moe.routed_experts.quant_method.moe_kernel.impl.fused_experts.w2_scale_val",
                 "moe.routed_experts.w2_weight_scale")})

# Note [audit diverged scales]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# Why a rebuilt quant config's scale diverges from the layer's after vLLM's layerwise reload,
# read in model_loader/reload/layerwise.py: `initialize_layerwise_reload` snapshots the layer's
# parameters and buffers (:109) and puts the layer on meta (:114); `_layerwise_process`
# materialises fresh temporaries (:354), loads them and runs process_weights_after_loading on
# them (:388), then copies the processed values into the snapshot's storage (:425) and
# re-registers the snapshot (:444). A quant config built during that process step holds the
# temporaries. `prefer_copy` on `replace_parameter` (model_executor/utils.py:71-99) is not the
# cause and would not help: it would copy into the temporary, which the quant config holds all
# the same. Right after a reload the two storages hold equal values (graphtrace: diverged; the
# flip test shows which one each side reads); they part when the parameters are written in
# place without processing: `reload_weights(is_checkpoint_format=False)` copies each tensor
# into the registered parameter (`param.copy_(loaded_weight)`, model_loader/reload/inplace.py:
# 104-108), which a captured graph sees and the eager path, reading the quant config's
# temporary, does not.
_SCALE_REBUILT = (
    "process_weights_after_loading replaces the scale parameter with the converted tensor "
    "({replace}) and builds a new `moe_quant_config` from it and a new experts object around "
    "that config ({rebuild}); during vLLM's layerwise reload this runs on the temporaries the "
    "reload materialised (model_loader/reload/layerwise.py:354, :388), so the new quant config "
    "(`moe_quant_config._w1.scale`, and the experts' `quant_config._w1.scale`) holds that run's "
    "temporary, while the reload copies the values into the original parameter (:425) and "
    "re-registers it (:444), the storage the graph read. `prefer_copy` is not the cause (it "
    "would copy into the temporary). Equal values after the reload; they part when the "
    "parameters are later written in place (`is_checkpoint_format=False`, "
    "model_loader/reload/inplace.py:104-108), which the eager path, reading the quant config's "
    "temporary, does not see (Note [audit diverged scales]): vLLM #41670 "
    "(`moe_quant_config._w1.scale` orphaned)")
_TENSORS_REBUILT = (
    "process_weights_after_loading replaces the {what} with converted tensors and builds a new "
    "`moe_quant_config` from them and a new experts object around that config ({rebuild}); "
    "during vLLM's layerwise reload this runs on the temporaries the reload materialised "
    "(model_loader/reload/layerwise.py:354, :388), so the new quant config "
    "(`moe_quant_config._w1.*`, and the experts' `quant_config`) holds that run's temporaries, "
    "while the reload copies their values into the original parameters (:425) and "
    "re-registers them (:444), the storage the graph read. `prefer_copy` is not the cause. "
    "Equal values after the reload; they part when the parameters are later written in place "
    "(`is_checkpoint_format=False`, model_loader/reload/inplace.py:104-108; Note [audit "
    "diverged scales]): the pattern of vLLM #41670 (`moe_quant_config._w1.scale` orphaned)")
_STRIDES_REBUILT = (
    "`CutlassExpertsFp8Base.__init__` allocates the CUTLASS stride tensors `ab_strides1` (= "
    "`c_strides2`), `ab_strides2`, `c_strides1` with `torch.full` and holds them as plain "
    "attributes (cutlass_moe.py:299-307); the experts object is rebuilt by every "
    "process_weights_after_loading (compressed_tensors_moe_w8a8_fp8.py:319-327 "
    "`self.moe_kernel = make_fp8_moe_kernel(...)`), so after vLLM's layerwise reload the live "
    "kernel holds new stride tensors and the captured graph reads the old kernel's (same "
    "values; freed with the old kernel): vLLM #41670 (kernel rebuilt with new ab_strides*/"
    "c_strides*)")

# (kernel row, owner-path regex) -> (vLLM line, what it does): the MoE findings, where one
# cause covers every path of an edge (the quant config is reachable from several owners)
# compressed-tensors FP8 MoE's scales, whatever backend its kernel is rebuilt for
_CT_FP8_SCALES = (
    r"(quant_config\._w[12]\.scale|w(13|2)_weight_scale)$",
    "vllm/model_executor/layers/quantization/compressed_tensors/compressed_tensors_moe/"
    "compressed_tensors_moe_w8a8_fp8.py:319",
    _SCALE_REBUILT.format(replace="compressed_tensors_moe_w8a8_fp8.py:313-314",
                          rebuild="compressed_tensors_moe_w8a8_fp8.py:319-327"))
FINDING_PATTERNS: list[tuple[str, str, str, str]] = [
    ("CompressedTensorsW8A8Fp8MoEMethod@cutlass", r"(ab|c)_strides[12]$",
     "vllm/model_executor/layers/fused_moe/experts/cutlass_moe.py:299", _STRIDES_REBUILT),
    ("CompressedTensorsW8A8Fp8MoEMethod@cutlass", *_CT_FP8_SCALES),
    ("Fp8MoEMethod@aiter", r"(quant_config\._w[12]\.scale|w(13|2)_weight_scale)$",
     "vllm/model_executor/layers/quantization/fp8.py:697",
     _SCALE_REBUILT.format(replace="fp8.py:690-691, after the AITER shuffle of "
                           "convert_to_fp8_moe_kernel_format, oracle/fp8.py:599", rebuild="fp8.py:693-700 "
                           "`_init_moe_kernel`")),
    ("Fp8MoEMethod@flashinfer_cutlass", r"gemm1_clamp_limit$",
     "vllm/model_executor/layers/fused_moe/experts/flashinfer_cutlass_moe.py:109",
     "`FlashInferExperts.__init__` turns the quant config's `gemm1_clamp_limit` float (the "
     "layer's `swiglu_limit`, fp8.py:777 -> oracle/fp8.py:801) into a per-expert tensor with "
     "`torch.full` (`_per_expert`, flashinfer_cutlass_moe.py:99-106) held as a plain attribute "
     "(:109, likewise `gemm1_alpha`/`gemm1_beta`, :110-111) and handed to "
     "`cutlass_fused_moe(swiglu_limit=...)` (:375); the experts object is rebuilt by every "
     "process_weights_after_loading (fp8.py:700 `make_fp8_moe_kernel`), so after vLLM's "
     "layerwise reload the captured graph reads the old kernel's tensor (same value; freed "
     "with the old kernel): vLLM #50521"),
    ("Fp8MoEMethod@flashinfer_cutlass", r"(g[12]_alphas|_w[12]\.alpha_or_gscale)$",
     "vllm/model_executor/layers/fused_moe/oracle/fp8.py:782",
     "for FlashInfer CUTLASS per-tensor FP8, `make_fp8_moe_quant_config` computes "
     "`g1_alphas = w1_scale * a1_scale` (oracle/fp8.py:779), registers it on the layer as a "
     "new `nn.Parameter` (`layer.register_parameter(\"g1_alphas\", ...)`, :782-783; "
     "`g2_alphas` :785-786) and hands the layer's parameter to the quant config (:788-789) on "
     "every process_weights_after_loading (fp8.py:697 via `get_fused_moe_quant_config`). The "
     "first run's `g1_alphas`/`g2_alphas` exist when `initialize_layerwise_reload` snapshots "
     "the layer (model_loader/reload/layerwise.py:109), so the reload copies the new values "
     "into them (:425) and re-registers them (:444): the graph reads refreshed values. The "
     "quant config built during the reload holds the parameter registered in that run (the "
     "reload's temporary): diverged, equal values after the reload, as for vLLM #41670 "
     "(Note [audit diverged scales]). The FP8 per-tensor path hands `g1_alphas`, "
     "`a2_gscale`, `g2_alphas` to the kernel (experts/flashinfer_cutlass_moe.py:288-292)"),
    ("Fp8MoEMethod@flashinfer_cutlass", r"_a2\.alpha_or_gscale$",
     "vllm/model_executor/layers/fused_moe/oracle/fp8.py:798",
     "`a2_gscale=(1.0 / a2_scale)` (oracle/fp8.py:798) is a fresh tensor held only by the "
     "quant config, rebuilt with the kernel by every process_weights_after_loading "
     "(fp8.py:697-700), and the FP8 per-tensor path hands it to the kernel "
     "(experts/flashinfer_cutlass_moe.py:290): after the reload the graph reads the old quant "
     "config's tensor (freed with it). `a1_gscale` (oracle/fp8.py:797) is built the same way "
     "but read only on the NVFP4 path (flashinfer_cutlass_moe.py:306), so it is no edge here"),
    ("Fp8MoEMethod@flashinfer_cutlass", r"(_a1\.scale|w13_input_scale)$",
     "vllm/model_executor/layers/quantization/fp8.py:744",
     "per-tensor kernels take one activation scale: process_weights_after_loading reduces the "
     "per-expert input scales to their max (`process_fp8_input_tensor_strategy_moe`, "
     "fp8.py:739) and replaces the parameters (`replace_parameter(layer, "
     "\"w13_input_scale\", ...)`, :744-745); during the reload this runs on the reload's "
     "temporaries (model_loader/reload/layerwise.py:354, :388), so the new `moe_quant_config` "
     "(fp8.py:697) holds that run's temporary as `_a1.scale` while the reload copies the "
     "values into the original parameter (:425, :444): diverged, equal values after the "
     "reload, the #41670 pattern for the activation scale (Note [audit diverged scales])"),
    ("Fp8MoEMethod@triton", r"(quant_config\._w[12]\.scale|w(13|2)_weight_scale)$",
     "vllm/model_executor/layers/quantization/fp8.py:697",
     _SCALE_REBUILT.format(replace="fp8.py:690-691", rebuild="fp8.py:693-700 "
                           "`_init_moe_kernel`")),
    ("Fp8MoEMethod@marlin", r"(quant_config\._w[12]\.scale|w(13|2)_weight_scale)$",
     "vllm/model_executor/layers/quantization/fp8.py:697",
     _SCALE_REBUILT.format(replace="fp8.py:690-691, after the Marlin repack of "
                           "convert_to_fp8_moe_kernel_format", rebuild="fp8.py:693-700 "
                           "`_init_moe_kernel`")),
    ("CompressedTensorsW8A8Fp8MoEMethod@triton", *_CT_FP8_SCALES),
    ("ModelOptFp8MoEMethod@triton", r"(quant_config\._[wa][12]\.scale|w(13|2)_(weight|input)_scale)$",
     "vllm/model_executor/layers/quantization/modelopt.py:611",
     _TENSORS_REBUILT.format(
         what="weight scales (modelopt.py:607-608) and the per-tensor input scales reduced "
              "to their max (:635-636)", rebuild="modelopt.py:611 `get_fused_moe_quant_config`, "
              ":613 `make_fp8_moe_kernel`")),
    ("QuarkW8A8Fp8MoEMethod@triton", r"(quant_config\._[wa][12]\.scale|w(13|2)_(weight|input)_scale)$",
     "vllm/model_executor/layers/quantization/quark/quark_moe.py:945",
     _TENSORS_REBUILT.format(
         what="weight scales (quark_moe.py:942-943) and rebinds the input scales to new "
              "`nn.Parameter`s of their max (:841-845)",
         rebuild="quark_moe.py:945 `get_fused_moe_quant_config`, :948 `make_fp8_moe_kernel`")),
    ("AutoGPTQMoEMethod@marlin", r"(quant_config\._w[12]\.(scale|bias)|w(13|2)_(scales|bias))$",
     "vllm/model_executor/layers/quantization/auto_gptq.py:693",
     _TENSORS_REBUILT.format(
         what="scales (auto_gptq.py:676-677) and biases (`replace_or_register`, :680-681)",
         rebuild="auto_gptq.py:693 `get_fused_moe_quant_config`, :694 "
                 "`make_wna16_moe_kernel`")),
    ("AutoAWQMoEMethod@marlin", r"(quant_config\._w[12]\.(scale|zp)|w(13|2)_(scales|qzeros))$",
     "vllm/model_executor/layers/quantization/auto_awq.py:705",
     _TENSORS_REBUILT.format(
         what="scales (auto_awq.py:688-689) and zero points (`_replace_or_register_parameter`, "
              ":690-691)",
         rebuild="auto_awq.py:705 `get_fused_moe_quant_config`, :706 `make_wna16_moe_kernel`")),
    ("CompressedTensorsWNA16MoEMethod@marlin", r"(quant_config\._w[12]\.scale|w(13|2)_weight_scale)$",
     "vllm/model_executor/layers/quantization/compressed_tensors/compressed_tensors_moe/"
     "compressed_tensors_moe_wna16.py:363",
     _TENSORS_REBUILT.format(
         what="weight scales (compressed_tensors_moe_wna16.py:445-446)",
         rebuild="compressed_tensors_moe_wna16.py:481 -> :363 `get_fused_moe_quant_config`, "
                 ":366 `make_wna16_moe_kernel`")),
    ("Mxfp4MoEMethod@marlin", r"(quant_config\._w[12]\.scale|w(13|2)_weight_scale)$",
     "vllm/model_executor/layers/quantization/mxfp4.py:866",
     _TENSORS_REBUILT.format(
         what="weight scales (mxfp4.py:849-850)",
         rebuild="mxfp4.py:862 `_build_moe_kernel` -> :866 `get_fused_moe_quant_config`, :868 "
                 "`make_mxfp4_moe_kernel`")),
]
# NVFP4: the three checkpoint formats share make_nvfp4_moe_kernel; where each replaces its
# tensors and rebuilds the kernel, read per method
_NVFP4_REBUILD = {
    "ModelOptNvFp4FusedMoE": (
        "vllm/model_executor/layers/quantization/modelopt.py:1075",
        "weight scales, global scales and input scales (modelopt.py:1063-1065, :1067-1069)",
        "modelopt.py:1071 `_build_moe_kernel` -> :1075 `get_fused_moe_quant_config`, :1077 "
        "`make_nvfp4_moe_kernel`"),
    "CompressedTensorsW4A4Nvfp4MoEMethod": (
        "vllm/model_executor/layers/quantization/compressed_tensors/compressed_tensors_moe/"
        "compressed_tensors_moe_w4a4_nvfp4.py:249",
        "weight scales and global scales (compressed_tensors_moe_w4a4_nvfp4.py:240, :242-244)",
        "compressed_tensors_moe_w4a4_nvfp4.py:249 `get_fused_moe_quant_config`, :251 "
        "`make_nvfp4_moe_kernel`"),
    "QuarkNvfp4MoEMethod": (
        "vllm/model_executor/layers/quantization/quark/quark_moe.py:2162",
        "weight scales, global scales and input scales (quark_moe.py:2152-2154, :2157-2159)",
        "quark_moe.py:2162 `get_fused_moe_quant_config`, :2165 `make_nvfp4_moe_kernel`"),
}
for _method, (_src, _what, _rebuild) in _NVFP4_REBUILD.items():
    for _backend in ("emulation", "marlin"):
        FINDING_PATTERNS.append((
            f"{_method}@{_backend}",
            r"(quant_config\._[wa][12]\.(scale|alpha_or_gscale)|"
            r"w(13|2)_(weight_scale|weight_scale_2|input_scale|input_scale_2))$",
            _src, _TENSORS_REBUILT.format(what=_what, rebuild=_rebuild)))
    FINDING_PATTERNS.insert(0, (
        f"{_method}@emulation", r"fused_experts\.w[12]_scale_val$",
        "vllm/model_executor/layers/fused_moe/experts/nvfp4_emulation_moe.py:356",
        "`Nvfp4QuantizationEmulationTritonExperts.__init__` stashes `self.w1_scale_val = "
        "self.quant_config.w1_scale` (and `w2_scale_val`, :357) and clears the quant config's "
        "scales (:359-360); the experts object is rebuilt by every "
        f"process_weights_after_loading ({_rebuild}), so during vLLM's layerwise reload the "
        "new kernel stashes that run's processed block-scale tensor while "
        "`_copy_and_restore_kernel_tensors` (model_loader/reload/layerwise.py) copies its "
        "values into the layer's original `w13_weight_scale` / `w2_weight_scale` storage, "
        "which the graph read: diverged, as for the MXFP8 emulation experts "
        "(mxfp8_emulation_moe.py:40)"))
# compressed-tensors NVFP4 keeps its activation scales as plain attributes: stale, not diverged
FINDING_PATTERNS.insert(0, (
    "CompressedTensorsW4A4Nvfp4MoEMethod@emulation",
    r"(quant_config\._a[12]\.alpha_or_gscale|w(13|2)_input_scale)$",
    "vllm/model_executor/layers/quantization/compressed_tensors/compressed_tensors_moe/"
    "compressed_tensors_moe_w4a4_nvfp4.py:245",
    "process_weights_after_loading computes the activation scales as new tensors "
    "(`a13_scale=(1.0 / layer.w13_input_global_scale)`, compressed_tensors_moe_w4a4_nvfp4.py:"
    "230, `a2_scale`, :234) and binds them as plain attributes (`layer.w13_input_scale = "
    "a13_scale`, :245, `w2_input_scale`, :246), not parameters, so vLLM's layerwise reload "
    "has no original storage to copy them back into; the new quant config (:249) holds the "
    "new tensors and the captured graph keeps reading the old ones (freed with the old "
    "kernel): stale"))

# The same method on another requested backend: its process_weights_after_loading replaces
# the converted tensors and rebuilds the quant config and kernel on the same lines whatever
# the backend (the backend changes only the conversion before them: convert_to_fp8_moe_
# kernel_format at modelopt.py:592, compressed_tensors_moe_w8a8_fp8.py:300, quark_moe.py:929-
# 943; the WNA16 conversion before compressed_tensors_moe_wna16.py:445 and auto_gptq.py:676)
for _row, _base in (("ModelOptFp8MoEMethod@marlin", "ModelOptFp8MoEMethod@triton"),
                    ("ModelOptFp8MoEMethod@aiter", "ModelOptFp8MoEMethod@triton"),
                    ("QuarkW8A8Fp8MoEMethod@marlin", "QuarkW8A8Fp8MoEMethod@triton"),
                    ("QuarkW8A8Fp8MoEMethod@aiter", "QuarkW8A8Fp8MoEMethod@triton"),
                    ("CompressedTensorsW8A8Fp8MoEMethod@marlin",
                     "CompressedTensorsW8A8Fp8MoEMethod@triton"),
                    ("CompressedTensorsW8A8Fp8MoEMethod@aiter",
                     "CompressedTensorsW8A8Fp8MoEMethod@triton"),
                    ("CompressedTensorsWNA16MoEMethod@triton",
                     "CompressedTensorsWNA16MoEMethod@marlin"),
                    ("AutoGPTQMoEMethod@emulation", "AutoGPTQMoEMethod@marlin"),
                    ("AutoAWQMoEMethod@emulation", "AutoAWQMoEMethod@marlin"),
                    ("CompressedTensorsWNA16MoEMethod@emulation",
                     "CompressedTensorsWNA16MoEMethod@marlin"),
                    # inherits Mxfp4MoEMethod.process_weights_after_loading
                    # (compressed_tensors_moe_w4a8_mxfp4.py:10, :34)
                    ("CompressedTensorsW4A8Mxfp4MoEMethod@marlin", "Mxfp4MoEMethod@marlin")):
    FINDING_PATTERNS += [(_row, pat, src, what) for name, pat, src, what in FINDING_PATTERNS
                         if name == _base]
_CONFIG_REBUILT = (
    "process_weights_after_loading builds a new `moe_quant_config` from the layer's scale "
    "parameters and a new experts object around that config ({rebuild}){replaced}; during "
    "vLLM's layerwise reload this runs on the temporaries the reload materialised "
    "(model_loader/reload/layerwise.py:354, :388), so the new quant config "
    "(`moe_quant_config._w1.scale`, and the experts' `quant_config`) holds that run's "
    "temporary, while the reload copies the values into the original parameter (:425) and "
    "re-registers it (:444), the storage the graph read. `prefer_copy` is not the cause. "
    "Equal values after the reload; they part when the parameters are later written in place "
    "(`is_checkpoint_format=False`, model_loader/reload/inplace.py:104-108; Note [audit "
    "diverged scales]): the pattern of vLLM #41670 (`moe_quant_config._w1.scale` orphaned)")
_SCALES = r"(quant_config\._w[12]\.scale|w(13|2)_weight_scale)$"


def _rebuilt(row: str, pattern: str, source: str, rebuild: str, replaced: str):
    """A finding of a quant config rebuilt on reload (_CONFIG_REBUILT) at `rebuild`."""
    return row, pattern, source, _CONFIG_REBUILT.format(rebuild=rebuild, replaced=replaced)


def _fp8_online(row: str, pattern: str, replaced: str) -> tuple[str, str, str, str]:
    """A finding of the FP8 online methods: their kernel setup (online/fp8.py) after `replaced`."""
    return (row, pattern, "vllm/model_executor/layers/quantization/online/fp8.py:567",
            _CONFIG_REBUILT.format(rebuild="`_setup_kernel`, online/fp8.py:567 "
                                   "`get_fused_moe_quant_config`, :570 `make_fp8_moe_kernel`",
                                   replaced=replaced))


_FP8_ONLINE_MARLIN = ", after replacing the Marlin-converted weights and scales (:562-565)"
_CT = "vllm/model_executor/layers/quantization/compressed_tensors/compressed_tensors_moe/"
_Q = "vllm/model_executor/layers/quantization/quark/quark_moe.py"
FINDING_PATTERNS += [
    _fp8_online(f"{_m}@triton", r"(quant_config\._w[12]\.scale|w(13|2)_weight_scale(_inv)?)$",
                ", after replacing the quantized weights and scales (:562-565)")
    for _m in ("Fp8PerTensorOnlineMoEMethod", "Fp8PerBlockOnlineMoEMethod",
               "Fp8PtpcOnlineMoEMethod")]
FINDING_PATTERNS += [
    _fp8_online("Fp8PerBlockOnlineMoEMethod@marlin",
                r"(quant_config\._w[12]\.scale|w(13|2)_weight_scale_inv)$", _FP8_ONLINE_MARLIN),
    ("Mxfp4OnlineMoEMethod@marlin", r"(quant_config\._w[12]\.scale|w(13|2)_weight_scale)$",
     "vllm/model_executor/layers/quantization/online/mxfp4.py:252",
     _CONFIG_REBUILT.format(rebuild="`_setup_kernel`, online/mxfp4.py:252 "
                            "`get_fused_moe_quant_config`, :254 `make_mxfp4_moe_kernel`",
                            replaced=", after replacing the converted weights and scales "
                            "(:243-246)")),
]
FINDING_PATTERNS += [
    _fp8_online("Fp8PerTensorOnlineMoEMethod@marlin", _SCALES, _FP8_ONLINE_MARLIN),
    _rebuilt("Int8OnlineMoEMethod@triton", r"(quant_config\._w[12]\.scale|w(13|2)_scale)$",
             "vllm/model_executor/layers/quantization/online/int8.py:112",
             "`_setup_kernel`, online/int8.py:112 "
             "`get_fused_moe_quant_config`, :115 `make_int8_moe_kernel`",
             ", after `_quantize_weights` replaced the scales "
             "(:98-99)"),
    _rebuilt("CompressedTensorsW8A8Int8MoEMethod@triton", _SCALES,
             _CT + "compressed_tensors_moe_w8a8_int8.py:223",
             "compressed_tensors_moe_w8a8_int8.py:223 "
             "`get_fused_moe_quant_config`, :225 `make_int8_moe_kernel`",
             ""),
    _rebuilt("QuarkW8A8Int8MoEMethod@triton", _SCALES, f"{_Q}:1309",
             "quark_moe.py:1309 `get_fused_moe_quant_config`, :1315 "
             "`make_int8_moe_kernel`",
             ""),
    _rebuilt("QuarkW4A16Int4MoEMethod@triton", _SCALES, f"{_Q}:459",
             "`_setup_kernel`, quark_moe.py:459 "
             "`get_fused_moe_quant_config`, :461 `make_wna16_moe_kernel`",
             ", after replacing the converted scales (:452-453)"),
    _rebuilt("QuarkOCP_MX_MoEMethod@marlin", _SCALES, f"{_Q}:1847",
             "`_setup_kernel`, quark_moe.py:1847 "
             "`get_fused_moe_quant_config`, :1849 `make_mxfp4_moe_kernel`",
             ", after replacing the converted scales (:1837-1838)"),
    _rebuilt("GptOssMxfp4MoEMethod@marlin", _SCALES,
             "vllm/model_executor/layers/quantization/mxfp4.py:379",
             "`_setup_kernel`, mxfp4.py:379 "
             "`get_fused_moe_quant_config`, :383 `make_mxfp4_moe_kernel`",
             ", after replacing the converted scales (:366-367)"),
    _rebuilt("CompressedTensorsW4A4Mxfp4MoEMethod@marlin", _SCALES,
             _CT + "compressed_tensors_moe_w4a4_mxfp4.py:238",
             "compressed_tensors_moe_w4a4_mxfp4.py:238 "
             "`get_fused_moe_quant_config`, :241 `make_mxfp4_moe_kernel`",
             ", after rebinding the swizzled CUTLASS scales as new "
             "`nn.Parameter`s (:206-211)"),
    _rebuilt("MoeWNA16Method@triton", r"(quant_config\._w[12]\.scale|w(13|2)_scales)$",
             "vllm/model_executor/layers/quantization/moe_wna16.py:415",
             "`_setup_kernel`, moe_wna16.py:415 "
             "`get_fused_moe_quant_config` (the layer's `w13_scales`/"
             "`w2_scales`, :404-406), :417 `make_wna16_moe_kernel`",
             ""),
    _rebuilt("ModelOptMxFp8FusedMoE@marlin", _SCALES,
             "vllm/model_executor/layers/quantization/modelopt.py:1449",
             "modelopt.py:1449 `get_fused_moe_quant_config`, :1452 "
             "`make_fp8_moe_kernel`",
             ", after replacing the converted scales (:1446-1447)"),
]

# The @cpu rows (Note [audit CPU experts]): the same process_weights_after_loading lines as
# the method's other rows (the CPU experts change only the conversion before them:
# convert_to_wna16_moe_kernel_format -> int_wna16.py `_process_weights_cpu`, the int8 and
# FP8 conversions, oracle/mxfp4.py for MXFP4); the INT4 rows also replace their zero points
for _row, _base in (("AutoAWQMoEMethod@cpu", "AutoAWQMoEMethod@marlin"),
                    ("CompressedTensorsW8A8Int8MoEMethod@cpu",
                     "CompressedTensorsW8A8Int8MoEMethod@triton"),
                    ("Int8OnlineMoEMethod@cpu", "Int8OnlineMoEMethod@triton"),
                    ("Mxfp4MoEMethod@cpu", "Mxfp4MoEMethod@marlin"),
                    ("CompressedTensorsW4A8Mxfp4MoEMethod@cpu", "Mxfp4MoEMethod@marlin"),
                    ("GptOssMxfp4MoEMethod@cpu", "GptOssMxfp4MoEMethod@marlin"),
                    ("Mxfp4OnlineMoEMethod@cpu", "Mxfp4OnlineMoEMethod@marlin"),
                    ("Fp8PerBlockOnlineMoEMethod@cpu", "Fp8PerBlockOnlineMoEMethod@marlin")):
    FINDING_PATTERNS += [(_row, pat, src, what) for name, pat, src, what in FINDING_PATTERNS
                         if name == _base]
FINDING_PATTERNS += [
    ("AutoGPTQMoEMethod@cpu", r"(quant_config\._w[12]\.(scale|zp)|w(13|2)_(scales|qzeros))$",
     "vllm/model_executor/layers/quantization/auto_gptq.py:693",
     _TENSORS_REBUILT.format(
         what="scales (auto_gptq.py:676-677) and zero points (`replace_or_register`, "
              ":682-683; `_process_weights_cpu` makes them for a symmetric checkpoint, "
              "fused_moe/oracle/int_wna16.py:1053 -> experts/cpu_moe.py "
              "`prepare_int4_moe_layer_for_cpu`)",
         rebuild="auto_gptq.py:693 `get_fused_moe_quant_config`, :694 "
                 "`make_wna16_moe_kernel`")),
    ("CompressedTensorsWNA16MoEMethod@cpu",
     r"(quant_config\._w[12]\.(scale|zp)|w(13|2)_weight_(scale|zero_point))$",
     "vllm/model_executor/layers/quantization/compressed_tensors/compressed_tensors_moe/"
     "compressed_tensors_moe_wna16.py:363",
     _TENSORS_REBUILT.format(
         what="weight scales (compressed_tensors_moe_wna16.py:445-446) and zero points "
              "(:461-462; made by `_process_weights_cpu` for a symmetric checkpoint, "
              "fused_moe/oracle/int_wna16.py:1053)",
         rebuild="compressed_tensors_moe_wna16.py:481 -> :363 `get_fused_moe_quant_config`, "
                 ":366 `make_wna16_moe_kernel`")),
]

FINDING_PATTERNS.append((
    "INCMxfp4MoEMethod@marlin", _SCALES, "vllm/model_executor/layers/quantization/inc/schemes/"
    "inc_mxfp4_moe.py:218",
    _CONFIG_REBUILT.format(rebuild="inc_mxfp4_moe.py:218 `get_fused_moe_quant_config`, :221 "
                           "`make_mxfp4_moe_kernel`",
                           replaced=", after rebinding the swizzled CUTLASS scales as new "
                           "`nn.Parameter`s (:202-207)")))
FINDING_PATTERNS.append((
    "INCMxfp8MoEMethod", r"(fused_experts\.w[12]_scale_val|w(13|2)_weight_scale)$",
    "vllm/model_executor/layers/fused_moe/experts/mxfp8_emulation_moe.py:40",
    "`Mxfp8TritonExpertsBase.__init__` stashes `self.w1_scale_val = self.quant_config.w1_scale` "
    "(and `w2_scale_val`, :41) and clears the quant config's scales (:42-43); the experts "
    "object is rebuilt by every process_weights_after_loading (quantization/inc/schemes/"
    "inc_mxfp8_moe.py:144-147 replace the weights and scales, :149 a fresh "
    "`get_fused_moe_quant_config`, :151 `self.moe_kernel = make_fp8_moe_kernel(...)`), so "
    "during vLLM's layerwise reload the new kernel stashes the *processed* scale tensor of "
    "that run, and `_copy_and_restore_kernel_tensors` (model_loader/reload/layerwise.py) then "
    "copies it into the layer's original `w13_weight_scale` / `w2_weight_scale` storage. The "
    "captured graph reads the layer parameter (refreshed, same values), eager reads the "
    "kernel's orphaned copy: diverged, as for compressed-tensors MXFP8 (the pattern of vLLM "
    "#41670)"))


def finding_source(kernel: str, path: str) -> tuple[str, str] | None:
    """The vLLM line read for a finding's owner path, or None (unchecked)."""
    if (kernel, path) in FINDING_SOURCES:
        return FINDING_SOURCES[(kernel, path)]
    for name, pattern, src, what in FINDING_PATTERNS:
        if name == kernel and re.search(pattern, path):
            return src, what
    return None


# Note [audit reload drops]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~
# vLLM's layerwise reload counts the elements each weight-loader call copies and processes a
# layer as soon as the count reaches the layer's size (`if info.load_numel >=
# info.load_numel_total: _layerwise_process(...)`, model_loader/reload/layerwise.py:217);
# every later call for that layer is dropped (`if not info.can_load(): ... return`, :156-171,
# "Excessive loading"). The count is capped per call (model_loader/reload/meta.py:206-209,
# the fix of vLLM #44814) but not across calls, and FusedMoE loads a per-expert per-tensor
# `input_scale` (and compressed-tensors' `weight_shape`) once for w1 and once for w3 into the
# same element (`_load_single_value`: `param_data[expert_id] = loaded_weight`,
# fused_moe/routed_experts.py:633, reached from :804-839 for input_scale, :960-965 for
# weight_shape). A checkpoint has both (`gate_proj.input_scale`,
# `up_proj.input_scale`), so the count reaches the total one element per expert early and
# the layer's last loads are dropped: what they would have filled stays as the reload
# materialized it (uninitialized). The harness loads in a fixed order (parameter by
# parameter, experts in order, w1 before w3) and records, during the reload, each load that
# vLLM's own `can_load()` says will be dropped (column reload_dropped). Which tensors lose
# their values depends on the order a trainer sends weights in. The stand-ins then read
# uninitialized memory, so the flip test is not run for such a row. A load into a parameter
# with no elements loses nothing and is not listed (MoeWNA16Method's zero-point placeholders,
# load_moe).
# What a real model does instead (analysis/repro/moe_reload_drops_loads.py, vLLM's own loader
# and `reload_weights` from a sorted safetensors checkpoint): `RoutedExperts.load_weights`
# looks the parameter up by name at call time (`getattr(self, param_name)`), which after the
# early processing is the processed parameter, so a late load is not dropped at `can_load()`:
# it lands on that parameter and raises (ValueError at fused_moe/routed_experts.py:955). The
# first MoE layer's last expert has then been requantized with an uninitialized w3 scale and
# every later layer is left on the meta device. The harness calls the loaders it collected
# before the reload, which is why it sees the drop.
RELOAD_DROP_SOURCE = (
    "vllm/model_executor/model_loader/reload/layerwise.py:217",
    "vLLM's layerwise reload processed the layer before these loads and dropped them "
    "(Note [audit reload drops]): the per-expert input scale (or `weight_shape`) is loaded "
    "twice per expert, for w1 and w3, into one element (fused_moe/routed_experts.py:804-839 "
    "and :960-965, `_load_single_value` :633), and each copy is counted toward `load_numel_total` "
    "(layerwise.py:186-187; the per-call cap of model_loader/reload/meta.py:206-209 does not "
    "see across calls), so `load_numel >= load_numel_total` (:217) fires one element per "
    "expert early; later calls return at `if not info.can_load()` (:156). The dropped "
    "tensors keep the uninitialized memory the reload materialized")

# kernels whose run vLLM's own reload breaks, with the lines read that cause it
RELOAD_FAILURES: dict[str, tuple[str, str]] = {
    "ZentorchWNA16LinearKernel": (
        "vllm/model_executor/kernels/linear/mixed_precision/zentorch.py:193",
        "process_weights_after_loading returns at once when the plain layer attribute "
        "`_zentorch_processed_weights` is set (zentorch.py:193-194, set at :268); that "
        "attribute survives the reload, so the reload's process step repacks nothing, while "
        "the first run emptied the registered parameters (`param.data = torch.empty(0)`, "
        ":265). vLLM's `_copy_and_restore_kernel_tensors` "
        "(model_executor/model_loader/reload/layerwise.py:425) then copies the new, "
        "unprocessed weight into the emptied kernel tensor and raises; had it not, the "
        "forward would keep reading `layer._zentorch_woq_packed` / `_zentorch_woq_scale` "
        "(plain attributes, :254-256) of the old weights"),
}

# the published fused-MoE bugs of issue #15: (status in 0.32, the line read, what the audit
# ran of it). Upstream states from the vLLM issue threads (search corpus "issues").
PUBLISHED_MOE_BUGS: dict[str, tuple[str, str, str]] = {
    "vLLM #41670 (CUTLASS FP8 MoE kernel rebuilt on reload; `moe_quant_config._w1.scale` "
    "orphaned)": (
        "still present in 0.32: every process_weights_after_loading rebuilds the kernel "
        "(fp8.py:693 `_init_moe_kernel`, :697 new `moe_quant_config`, :700 "
        "`make_fp8_moe_kernel`), and `CutlassExpertsFp8Base.__init__` allocates new stride "
        "tensors each time",
        "vllm/model_executor/layers/fused_moe/experts/cutlass_moe.py:299-307",
        "found: CompressedTensorsW8A8Fp8MoEMethod@cutlass (the CUTLASS backend requested, "
        "Note [audit MoE backends]) has stale `ab_strides1`/`ab_strides2`/`c_strides1` edges "
        "(the old kernel's strides) and diverged `moe_quant_config._w1.scale`/`_w2.scale` "
        "(the reload's temporaries, equal in value to the refreshed parameters until those "
        "are written in place; `prefer_copy` is not the cause: Note [audit diverged scales]); "
        "Fp8MoEMethod@triton has the same diverged scales (fp8.py:697); the MXFP8 emulation "
        "experts show the pattern too (Findings). Upstream: issue closed (stale label), no "
        "fix cited in the thread"),
    "vLLM #40390 (`replace_parameter` reallocating `w13_weight`/`w2_weight` after a "
    "shuffle)": (
        "fixed in 0.32 for the unquantized method: `replace_parameter(layer, \"w13_weight\", "
        "w13_new, prefer_copy=is_weight_update)` (and w2, :189), `prefer_copy` copying into "
        "the existing storage (model_executor/utils.py:120-125); the quantized methods "
        "still call `replace_parameter` without it (fp8.py:688-691) and rely on the "
        "layerwise reload's copy-back",
        "vllm/model_executor/layers/fused_moe/unquantized_fused_moe_method.py:188",
        "UnquantizedFusedMoEMethod ran (CPUUnquantizedExperts): no stale edge; the quantized "
        "path without `prefer_copy` (fp8.py:688-691) ran as Fp8MoEMethod@triton and "
        "CompressedTensorsW8A8Fp8MoEMethod@cutlass: the weights themselves come back through "
        "the layerwise reload's copy-back (no stale weight edge), the scales do not (diverged, "
        "#41670 above); the AITER shuffle path ran as Fp8MoEMethod@aiter (`rocm_aiter_ops."
        "shuffle_weights`, oracle/fp8.py:599, then fp8.py:688-691): the shuffled weights come "
        "back through the copy-back too (no stale weight edge); the scales are diverged as "
        "for Triton (flip: eager reads the orphaned quant-config scale, the graph the "
        "refreshed parameter)"),
    "vLLM #46009 (MoE padding through `.data =`)": (
        "`.data =` rebinding remains in 0.32's MoE weight conversions (e.g. "
        "oracle/mxfp4.py:1207-1220, 1256-1275; unquantized_fused_moe_method.py:245-246; "
        "quantization/utils/flashinfer_utils.py:115-118); whether each runs on a reload "
        "path that a graph captured is not established here",
        "vllm/model_executor/layers/fused_moe/oracle/mxfp4.py:1207",
        "not exercised: the MXFP4 backends that pad/shuffle (AITER, FlashInfer, Triton "
        "kernels) are not selected on this CPU (Mxfp4MoEMethod row)"),
    "vLLM #50521 (FlashInfer CUTLASS MoE SwiGLU constants unregistered)": (
        "still present in 0.32: `FlashInferExperts.__init__` turns the config's floats "
        "(fused_moe/config.py:256-258) into per-expert device tensors held as plain "
        "attributes (`self.gemm1_alpha = _per_expert(...)`, :109-111, `torch.full`, :99-106), "
        "unregistered, and the experts object is rebuilt by every process_weights_after_loading "
        "(e.g. fp8.py:700), so a captured graph keeps the old kernel's tensors (same values; "
        "freed with the old kernel)",
        "vllm/model_executor/layers/fused_moe/experts/flashinfer_cutlass_moe.py:110",
        "found: Fp8MoEMethod@flashinfer_cutlass (backend requested, layer built with "
        "`swiglu_limit=7.0`) has a stale `fused_experts.gemm1_clamp_limit` edge (the old "
        "kernel's tensor), plus diverged `g1_alphas`/`g2_alphas` (registered anew by every "
        "run, oracle/fp8.py:782-786; the reload refreshes the first run's parameters, "
        "layerwise.py:109, :425, and the rebuilt quant config holds the reload's temporaries: "
        "equal values), stale `_a2.alpha_or_gscale` (`a2_gscale`, oracle/fp8.py:798; "
        "`a1_gscale`, :797, is not read on the FP8 per-tensor path, flashinfer_cutlass_moe.py:"
        "288-292) and diverged `w13_input_scale` (fp8.py:744); `cutlass_fused_moe` ran as a "
        "stand-in. Flip test: not "
        "run, the reload dropped this row's `w2_input_scale` loads (Note [audit reload drops])"),
}
