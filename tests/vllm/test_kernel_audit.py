"""The vLLM kernel audit (analysis/vllm_kernel_audit.py) reproduces its committed results.

One kernel class per family that ran (and the one with a finding) is audited again in a
subprocess (the audit registers op stand-ins and a process group: kept out of this process),
and its row must match analysis/results/vllm_kernel_audit.csv: ran, edges per verdict, stale
owners and the vLLM source line of each finding. ~1 min.
"""

from __future__ import annotations

import csv
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "analysis" / "vllm_kernel_audit.py"
COMMITTED = ROOT / "analysis" / "results" / "vllm_kernel_audit.csv"
COMPARED = ("kernel", "family", "scheme", "ran", "failed_at", "stable", "stale", "dangling",
            "diverged", "orphaned", "unowned", "stale_owners", "vllm_source", "flip",
            "standins", "reload_dropped")
# a representative per family that runs, plus the kernel with a finding
REPRESENTATIVES = ("CPUInt8ScaledMMLinearKernel", "CutlassInt8ScaledMMLinearKernel",
                   "MacheteLinearKernel", "MarlinLinearKernel", "CPUFp8BlockScaledMMKernel",
                   "MarlinFP8ScaledMMLinearKernel", "MarlinNvFp4LinearKernel",
                   "MarlinMxFp4LinearKernel", "EmulationMxfp8LinearKernel",
                   # stand-ins: routed fp8 quant + aten::_scaled_mm, XPU/ROCm/zentorch ops,
                   # vLLM's platform-only vllm:: ops, flashinfer/aiter packages, Triton launch
                   "PerTensorTorchFP8ScaledMMLinearKernel", "XPUFp8BlockScaledMMKernel",
                   "RDNA3W4A16LinearKernel", "ZentorchInt8ScaledMMLinearKernel",
                   "AiterPerTokenFp8ScaledMMLinearKernel", "FlashInferTrtllmNvFp4LinearKernel",
                   "AiterHipbMMPerTokenFp8ScaledMMLinearKernel", "TritonW4A16LinearKernel",
                   "CutlassFP8ScaledMMLinearKernel",
                   # fused MoE
                   "UnquantizedFusedMoEMethod", "CompressedTensorsW8A8Mxfp8MoEMethod",
                   "ModelOptMxFp8FusedMoE",
                   # a requested CUDA backend (Note [audit MoE backends])
                   "CompressedTensorsW8A8Fp8MoEMethod@cutlass", "Fp8MoEMethod@triton",
                   "Fp8MoEMethod@flashinfer_cutlass", "Fp8MoEMethod@aiter",
                   # Marlin MoE (`_moe_C::moe_wna16_marlin_gemm` stand-in), NVFP4 emulation
                   # (its Triton kernel), and a reload that drops loads
                   "AutoGPTQMoEMethod@marlin", "Mxfp4MoEMethod@marlin",
                   "CompressedTensorsW4A4Nvfp4MoEMethod@emulation", "ModelOptFp8MoEMethod@triton")


def _run(*args: str, timeout: int = 240) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, str(SCRIPT), *args], cwd=ROOT, env=env, text=True,
                          capture_output=True, timeout=timeout)


def _rows(path: Path) -> dict[str, dict]:
    with open(path, newline="") as f:
        return {r["kernel"]: r for r in csv.DictReader(f)}


@pytest.fixture(scope="module")
def rerun(tmp_path_factory):
    out = tmp_path_factory.mktemp("audit")
    args = [a for k in REPRESENTATIVES for a in ("--kernel", k)]
    proc = _run(*args, "--out", str(out))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return _rows(out / "vllm_kernel_audit.csv")


def test_rerun_matches_committed_results(rerun):
    committed = _rows(COMMITTED)
    assert set(rerun) == set(REPRESENTATIVES)
    for name, row in rerun.items():
        assert row["ran"] == "yes", f"{name}: {row['failed_at']}: {row['reason']}"
        assert {c: row[c] for c in COMPARED} == {c: committed[name][c] for c in COMPARED}, name


def test_committed_results_cover_every_class():
    """Every kernel class in the registry has a row: audited, or the exact reason it was not."""
    rows = _rows(COMMITTED)
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        import vllm_kernel_audit as audit
    finally:
        sys.path.remove(str(SCRIPT.parent))
    assert {k.name for k in [*audit.discover(), *audit.discover_moe()]} == set(rows)
    assert all(r["ran"] == "yes" or r["reason"] for r in rows.values())


def test_finding_is_sourced_and_flagged(rerun):
    row = rerun["CPUInt8ScaledMMLinearKernel"]
    assert int(row["stale"]) == 1
    assert row["stale_owners"] == "stale:proj.scheme.kernel.dnnl_handler.handler_tensor"
    assert row["vllm_source"] == "vllm/model_executor/kernels/linear/scaled_mm/cpu.py:136"
    # a kernel whose reload keeps every captured storage has no stale edge
    assert int(rerun["MacheteLinearKernel"]["stale"]) == 0


def test_unknown_kernel_is_a_usage_error():
    proc = _run("--kernel", "NoSuchKernel", "--no-write", timeout=120)
    assert proc.returncode == 2
    assert "unknown kernel class(es): NoSuchKernel" in proc.stderr


def test_moe_finding_is_sourced_and_flagged(rerun):
    """The MXFP8 MoE experts' stashed scales diverge from the layer's after vLLM's reload."""
    row = rerun["CompressedTensorsW8A8Mxfp8MoEMethod"]
    assert int(row["diverged"]) == 2
    assert "fused_experts.w1_scale_val" in row["stale_owners"]
    assert row["vllm_source"].startswith(
        "vllm/model_executor/layers/fused_moe/experts/mxfp8_emulation_moe.py:40")
    assert "unchecked" not in row["vllm_source"]
    # the unquantized method copies into its parameters on an update: nothing stale
    assert int(rerun["UnquantizedFusedMoEMethod"]["stale"]) == 0


def test_moe_discovery_finds_modules_nothing_imports():
    """Compressed-tensors and online MoE methods live in modules imported only on demand."""
    rows = _rows(COMMITTED)
    for name in ("CompressedTensorsW8A8Fp8MoEMethod", "Fp8PerTensorOnlineMoEMethod",
                 "QuarkW8A8Fp8MoEMethod", "FusedMoEModularMethod"):
        assert rows[name]["family"] == "moe"


def test_cutlass_moe_reproduces_vllm_41670(rerun):
    """CUTLASS FP8 MoE, requested through vLLM's own moe_backend: the rebuilt kernel's new
    stride tensors (stale) and the new quant config's scales (diverged), each sourced."""
    row = rerun["CompressedTensorsW8A8Fp8MoEMethod@cutlass"]
    assert row["ran"] == "yes"
    assert row["scheme"].endswith("-> TritonOrCutlassExperts")
    assert int(row["stale"]) == 3 and int(row["diverged"]) == 2
    assert "stale:" in row["stale_owners"] and "experts.ab_strides1" in row["stale_owners"]
    assert "diverged:moe.routed_experts.quant_method.moe_quant_config._w1.scale" in \
        row["stale_owners"]
    assert "fused_moe/experts/cutlass_moe.py:299" in row["vllm_source"]
    assert "unchecked" not in row["vllm_source"]
    assert "_C::cutlass_moe_mm" in row["standins"]
    assert "stale read confirmed" in row["flip"]
    triton = rerun["Fp8MoEMethod@triton"]
    assert int(triton["diverged"]) == 2 and "unchecked" not in triton["vllm_source"]


def test_flashinfer_cutlass_moe_reproduces_vllm_50521(rerun):
    """FlashInfer CUTLASS MoE with a SwiGLU limit: the rebuilt experts' per-expert
    `gemm1_clamp_limit` tensor is a stale edge, sourced to vLLM's line."""
    row = rerun["Fp8MoEMethod@flashinfer_cutlass"]
    assert row["ran"] == "yes" and row["scheme"].endswith("-> FlashInferExperts")
    assert "stale:moe.routed_experts.quant_method.moe_kernel.impl.fused_experts." \
        "gemm1_clamp_limit" in row["stale_owners"]
    assert "fused_moe/experts/flashinfer_cutlass_moe.py:109" in row["vllm_source"]
    assert "unchecked" not in row["vllm_source"]
    assert "audit_lib::flashinfer__fused_moe__cutlass_fused_moe" in row["standins"]


def test_aiter_moe_shuffle_path_runs(rerun):
    """AITER FP8 MoE (shuffle + replace_parameter without prefer_copy, vLLM #40390's path):
    the weights come back through the copy-back, the scales are diverged (#41670)."""
    row = rerun["Fp8MoEMethod@aiter"]
    assert row["ran"] == "yes" and "aiter__ops__shuffle__shuffle_weight" in row["standins"]
    assert int(row["stale"]) == 0 and int(row["diverged"]) == 2
    assert "w13_weight:" not in row["stale_owners"]
    assert "unchecked" not in row["vllm_source"] and "stale read confirmed" in row["flip"]


def test_marlin_moe_rows_run_and_are_sourced(rerun):
    """WNA16 and MXFP4 through Marlin MoE, requested as `moe_backend="marlin"`: the rebuilt
    quant config's scales (and GPTQ's biases) diverge from the refreshed parameters; each
    edge is sourced to the method's line and the flip test confirms the eager side."""
    gptq = rerun["AutoGPTQMoEMethod@marlin"]
    assert gptq["scheme"].endswith("-> MarlinExperts")
    assert "_moe_C::moe_wna16_marlin_gemm" in gptq["standins"]
    assert "diverged:moe.routed_experts.quant_method.moe_quant_config._w1.bias" in \
        gptq["stale_owners"]
    assert gptq["vllm_source"] == "vllm/model_executor/layers/quantization/auto_gptq.py:693"
    assert "moe_quant_config._w1.scale: stale read confirmed" in gptq["flip"]
    mxfp4 = rerun["Mxfp4MoEMethod@marlin"]
    assert int(mxfp4["diverged"]) == 2 and "unchecked" not in mxfp4["vllm_source"]


def test_nvfp4_emulation_plain_attribute_scales_are_stale(rerun):
    """compressed-tensors NVFP4 binds its activation scales as plain attributes: after the
    reload the graph reads the old tensors (stale, not diverged), confirmed by the flip."""
    row = rerun["CompressedTensorsW4A4Nvfp4MoEMethod@emulation"]
    assert int(row["stale"]) == 2
    assert "stale:moe.routed_experts.quant_method.moe_quant_config._a2.alpha_or_gscale" in \
        row["stale_owners"]
    assert "compressed_tensors_moe_w4a4_nvfp4.py:245" in row["vllm_source"]
    assert "experts/nvfp4_emulation_moe.py:356" in row["vllm_source"]
    assert "audit_lib::triton__fused_moe_nvfp4_emulation_kernel" in row["standins"]
    assert "moe.routed_experts.w2_input_scale: stale read confirmed" in row["flip"]


def test_reload_dropped_loads_are_reported(rerun):
    """ModelOpt FP8 loads each expert's input scale for w1 and for w3 into one element; vLLM's
    layerwise reload counts both and processes the layer early, dropping the last loads."""
    row = rerun["ModelOptFp8MoEMethod@triton"]
    assert row["reload_dropped"] == ("w2_input_scale[0].w2 w2_input_scale[1].w2 "
                                     "w2_input_scale[2].w2 w2_input_scale[3].w2")
    assert row["flip"].startswith("not run: vLLM's reload dropped loads")
    # a method without per-expert input scales loses nothing
    assert rerun["AutoGPTQMoEMethod@marlin"]["reload_dropped"] == ""
