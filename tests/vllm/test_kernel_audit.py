"""The vLLM kernel audit (analysis/vllm_kernel_audit.py) reproduces its committed results.

One kernel class per family that ran (and the one with a finding) is audited again in a
subprocess (the audit registers op stand-ins and a process group: kept out of this process),
and its row must match analysis/results/vllm_kernel_audit.csv: ran, edges per verdict, stale
owners and the vLLM source line of each finding. A row whose path depends on the CPU (the AMX
question vLLM asks, or the ops its CPU build has: Note [audit CPU paths]) is compared with a
committed run whose CPU took the same path (the main results, else another kind's run in
analysis/results/audit-cpu/<kind>/); with none, it must still be a row (ran, or the reason, a
crash included). Each row runs in a process of its own: a forced os.abort() is that row's
result (Note [audit row isolation]). ~4 min.
"""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "analysis" / "vllm_kernel_audit.py"
COMMITTED = ROOT / "analysis" / "results" / "vllm_kernel_audit.csv"
COMMITTED_CPU = ROOT / "analysis" / "results" / "vllm_kernel_audit.cpu.json"
OTHER_KINDS = ROOT / "analysis" / "results" / "audit-cpu"  # runs on other kinds of CPU
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
                   "CompressedTensorsW4A4Nvfp4MoEMethod@emulation", "ModelOptFp8MoEMethod@triton",
                   # INT8 on Triton (a device question inside the scheme check), gpt-oss's
                   # clamped SwiGLU, Quark OCP MX (no accelerator to empty), MoeWNA16's GPTQ
                   # layout, and a method whose oracle finds no backend on this CPU
                   "CompressedTensorsW8A8Int8MoEMethod@triton", "GptOssMxfp4MoEMethod@marlin",
                   "QuarkOCP_MX_MoEMethod@marlin", "MoeWNA16Method@triton",
                   "CompressedTensorsW8A8Int8MoEMethod",
                   # vLLM's CPU experts offered without AMX (Note [audit CPU experts]): one
                   # that runs its native kernel, one whose vLLM code fails on that path
                   "CompressedTensorsW8A8Int8MoEMethod@cpu", "QuarkW8A8Int8MoEMethod@cpu",
                   # an AutoRound (INC) checkpoint config
                   "INCMxfp8MoEMethod",
                   # methods no checkpoint config builds: vLLM's LoRA wrapper (Note [audit MoE
                   # LoRA]), a ModelOpt MIXED_PRECISION block codec
                   "FusedMoEModularMethod", "ModelOptBlockQuantMoEMethod")


def _run(*args: str, timeout: int = 600, **env: str) -> subprocess.CompletedProcess:
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    env = dict(os.environ, PYTHONPATH=path, **env)
    return subprocess.run([sys.executable, str(SCRIPT), *args], cwd=ROOT, env=env, text=True,
                          capture_output=True, timeout=timeout)


def _rows(path: Path) -> dict[str, dict]:
    with open(path, newline="") as f:
        return {r["kernel"]: r for r in csv.DictReader(f)}


def _audit():
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        import vllm_kernel_audit as audit
    finally:
        sys.path.remove(str(SCRIPT.parent))
    return audit


@pytest.fixture(scope="module")
def rerun_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("audit")
    args = [a for k in REPRESENTATIVES for a in ("--kernel", k)]
    proc = _run(*args, "--out", str(out))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return out


@pytest.fixture(scope="module")
def rerun(rerun_dir):
    return _rows(rerun_dir / "vllm_kernel_audit.csv")


def _committed_sets() -> list[tuple[dict, dict]]:
    """(cpu, rows) of the main committed results, then of each other kind's run
    (analysis/results/audit-cpu/<kind>/: Note [audit CPU paths])."""
    sets = [(json.loads(COMMITTED_CPU.read_text()), _rows(COMMITTED))]
    for cpu_json in sorted(OTHER_KINDS.glob("*/vllm_kernel_audit.cpu.json")):
        sets.append((json.loads(cpu_json.read_text()),
                     _rows(cpu_json.with_name("vllm_kernel_audit.csv"))))
    return sets


@pytest.fixture(scope="module")
def committed_row(rerun_dir):
    """name -> the committed row the rerun's row must equal here, or None when no committed
    run is comparable on this CPU (`comparable` in the audit: Note [audit CPU paths])."""
    rerun_cpu = json.loads((rerun_dir / "vllm_kernel_audit.cpu.json").read_text())
    sets = _committed_sets()
    comparable = _audit().comparable

    def row(name: str) -> dict | None:
        for cpu, rows in sets:
            if name in rows and comparable(name, rerun_cpu, cpu):
                return rows[name]
        return None
    return row


@pytest.fixture(scope="module")
def comparable(committed_row):
    return lambda name: committed_row(name) is not None


def _needs_same_cpu(comparable, *names):
    for name in names:
        if not comparable(name):
            pytest.skip(f"{name} takes a CPU-dependent path and no committed results were made "
                        "on a comparable CPU (Note [audit CPU paths])")


def test_rerun_matches_committed_results(rerun, committed_row):
    assert set(rerun) == set(REPRESENTATIVES)
    compared = 0
    for name, row in rerun.items():
        committed = committed_row(name)
        if committed is None:
            # no comparable committed run: the row must still be there, run or with its reason
            assert row["ran"] == "yes" or row["reason"], name
            continue
        compared += 1
        assert {c: row[c] for c in COMPARED} == {c: committed[c] for c in COMPARED}, \
            f"{name}: {row['failed_at']}: {row['reason']}"
    cpu_dependent = set(REPRESENTATIVES) & set(_audit().CPU_DEPENDENT)
    assert compared >= len(REPRESENTATIVES) - len(cpu_dependent)


def test_rows_are_compared_across_kinds_only_when_the_path_is_the_same():
    """The AMX answer and the build decide: an AVX2 and an AVX-512 run share the oneDNN int8
    row (neither has AMX) but not a row that needs the AVX-512 build's ops; an AMX answer of
    yes is compared only with another AMX run."""
    comparable = _audit().comparable
    avx2 = {"kind": "avx2", "amx_asked": {"CPUInt8ScaledMMLinearKernel": "False"}}
    avx512 = {"kind": "avx512", "amx_asked": {"CPUInt8ScaledMMLinearKernel": "False"}}
    amx = {"kind": "amx", "amx_asked": {"CPUInt8ScaledMMLinearKernel": "True"}}
    assert comparable("CPUInt8ScaledMMLinearKernel", avx2, avx512)
    assert not comparable("CPUInt8ScaledMMLinearKernel", avx512, amx)
    assert not comparable("CPUWNA16LinearKernel", avx2, avx512)
    assert comparable("CPUWNA16LinearKernel", avx512, {"kind": "amx", "amx_asked": {}})
    assert comparable("MacheteLinearKernel", avx2, amx)
    assert comparable("CPUWNA16LinearKernel", avx2, dict(avx2, amx_asked={}))


def test_committed_results_cover_every_class():
    """Every kernel class in the registry has a row: audited, or the exact reason it was not."""
    rows = _rows(COMMITTED)
    audit = _audit()
    assert {k.name for k in [*audit.discover(), *audit.discover_moe()]} == set(rows)
    assert all(r["ran"] == "yes" or r["reason"] for r in rows.values())


def test_finding_is_sourced_and_flagged(rerun, comparable):
    _needs_same_cpu(comparable, "CPUInt8ScaledMMLinearKernel")
    row = rerun["CPUInt8ScaledMMLinearKernel"]
    assert int(row["stale"]) == 1
    # the captured handle moved (stale), and the live handle the reload made points at the
    # reload's freed weight scale: lineage's dangling source (Note [audit dangling sources])
    assert row["stale_owners"] == (
        "dangling-source:proj.scheme.kernel.dnnl_handler.handler_tensor <- proj.weight_scale"
        " | stale:proj.scheme.kernel.dnnl_handler.handler_tensor")
    assert row["vllm_source"] == "vllm/model_executor/kernels/linear/scaled_mm/cpu.py:136"
    # a kernel whose reload keeps every captured storage has no stale edge
    assert int(rerun["MacheteLinearKernel"]["stale"]) == 0


def test_unknown_kernel_is_a_usage_error():
    proc = _run("--kernel", "NoSuchKernel", "--no-write", timeout=120)
    assert proc.returncode == 2
    assert "unknown kernel class(es): NoSuchKernel" in proc.stderr


def test_moe_finding_is_sourced_and_flagged(rerun, comparable):
    """The MXFP8 MoE experts' stashed scales diverge from the layer's after vLLM's reload."""
    row = rerun["CompressedTensorsW8A8Mxfp8MoEMethod"]
    assert int(row["diverged"]) == 2
    assert "fused_experts.w1_scale_val" in row["stale_owners"]
    assert row["vllm_source"].startswith(
        "vllm/model_executor/layers/fused_moe/experts/mxfp8_emulation_moe.py:40")
    assert "unchecked" not in row["vllm_source"]
    # the unquantized method copies into its parameters on an update: nothing stale
    _needs_same_cpu(comparable, "UnquantizedFusedMoEMethod")
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


# ---------------------------------------------------------------------------------------------
# Row isolation (Note [audit row isolation]) and vLLM's AMX paths, on any CPU

HOOKED = ("AiterInt8ScaledMMLinearKernel", "CPUInt8ScaledMMLinearKernel", "MacheteLinearKernel")


@pytest.fixture(scope="module")
def hooked(tmp_path_factory):
    """Three rows with both test hooks: the first calls os.abort() at its apply; vLLM is told
    the CPU has AMX (`torch.cpu._is_amx_tile_supported()` answers yes in every row)."""
    out = tmp_path_factory.mktemp("audit-hooked")
    args = [a for k in HOOKED for a in ("--kernel", k)]
    proc = _run(*args, "--out", str(out),
                GRAPHTRACE_AUDIT_TEST_ABORT="AiterInt8ScaledMMLinearKernel:apply",
                GRAPHTRACE_AUDIT_TEST_FAKE_AMX="1")
    return proc, _rows(out / "vllm_kernel_audit.csv"), \
        json.loads((out / "vllm_kernel_audit.cpu.json").read_text()), out


def test_native_abort_is_the_rows_result(hooked):
    """A row whose process aborts is reported as crashed at the stage it reached; the run goes
    on and the rows after it are audited as usual."""
    proc, rows, cpu, out = hooked
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "1 crashed their process" in proc.stdout
    row = rows["AiterInt8ScaledMMLinearKernel"]
    assert row["ran"] == "no" and row["failed_at"] == "apply"
    assert row["reason"] == ("crashed: SIGABRT: audit test hook (GRAPHTRACE_AUDIT_TEST_ABORT): "
                             "os.abort() in AiterInt8ScaledMMLinearKernel at apply")
    assert "crashed its process (SIGABRT)" in (out / "vllm_kernel_audit.md").read_text()
    # the next rows: the one that asks no AMX question matches the committed results
    machete = rows["MacheteLinearKernel"]
    committed = _rows(COMMITTED)["MacheteLinearKernel"]
    assert {c: machete[c] for c in COMPARED} == {c: committed[c] for c in COMPARED}
    assert "MacheteLinearKernel" not in cpu["amx_asked"]


def test_amx_path_is_taken_and_reported_as_a_row(hooked):
    """Told the CPU has AMX, vLLM picks its sgl-kernels int8 GEMM (scaled_mm/cpu.py:50-57 via
    check_cpu_sgl_kernel, layers/utils.py:439): the row asked, got yes, and either ran (a
    build with the sgl ops) or says why not (this build lacks them: `convert_weight_packed`,
    process_weights_for_sgl) or crashed; the process survived either way."""
    proc, rows, cpu, _ = hooked
    assert proc.returncode == 0
    assert cpu["faked_amx"] is True
    assert cpu["amx_asked"]["CPUInt8ScaledMMLinearKernel"] == "True"
    row = rows["CPUInt8ScaledMMLinearKernel"]
    if row["ran"] == "yes":
        # the sgl path keeps the packed weight as a parameter: no oneDNN handle to go stale
        assert "dnnl_handler" not in row["stale_owners"]
    else:
        assert row["reason"].startswith("crashed:") or \
            "convert_weight_packed" in row["reason"], row["reason"]


def test_crash_reason_reads_the_native_error():
    """The reason of a crashed row: the signal and the C++ error's what(), with where it was
    raised (the message SIGABRT leaves on stderr, here the one of issue 29)."""
    audit = _audit()
    log = ("some vLLM warning\n"
           "terminate called after throwing an instance of 'c10::Error'\n"
           "  what():  tinygemm_kernel_nn: scalar path not implemented!\n"
           "Exception raised from apply at /tmp/vllm/csrc/cpu/sgl-kernels/gemm_int8.cpp:81 "
           "(most recent call first):\n"
           "frame #0: c10::Error::Error(...) + 0x9a (0x7f in libc10.so)\n")
    assert audit.crash_reason(-6, log, 600) == (
        "crashed: SIGABRT: tinygemm_kernel_nn: scalar path not implemented! "
        "(raised in apply at csrc/cpu/sgl-kernels/gemm_int8.cpp:81)")
    assert audit.crash_reason(-11, "a\nlast words\n", 600) == "crashed: SIGSEGV: last words"
    assert audit.crash_reason(-14, "", 30) == "crashed: timed out after 30 s"
    assert audit.crash_reason(1, "", 600) == "crashed: exit 1: (no output)"


def test_forced_moe_rows_run_through_vllms_scheme_checks(rerun):
    """INT8 MoE on the Triton experts: TritonExperts' scheme check asks `is_cuda()` and the
    device capability (experts/triton_moe.py:137-144), which the forced device answers; the
    per-token INT8 quantizer is a Triton launch. gpt-oss MXFP4 on Marlin needs the clamped
    SwiGLU (`_C::silu_and_mul_with_clamp`), Quark OCP MX calls `torch.accelerator.
    empty_cache()`, MoeWNA16 loads GPTQ-packed checkpoints: each row runs, sourced."""
    int8 = rerun["CompressedTensorsW8A8Int8MoEMethod@triton"]
    assert int8["ran"] == "yes" and int8["scheme"].endswith("-> TritonExperts")
    assert "audit_lib::triton___per_token_quant_int8" in int8["standins"]
    assert int8["vllm_source"].endswith("compressed_tensors_moe_w8a8_int8.py:223")
    gpt_oss = rerun["GptOssMxfp4MoEMethod@marlin"]
    assert gpt_oss["ran"] == "yes" and "_C::silu_and_mul_with_clamp" in gpt_oss["standins"]
    assert gpt_oss["vllm_source"] == "vllm/model_executor/layers/quantization/mxfp4.py:379"
    assert rerun["QuarkOCP_MX_MoEMethod@marlin"]["ran"] == "yes"
    moe_wna16 = rerun["MoeWNA16Method@triton"]
    assert moe_wna16["ran"] == "yes" and moe_wna16["scheme"].endswith("-> TritonWNA16Experts")
    for name in ("CompressedTensorsW8A8Int8MoEMethod@triton", "GptOssMxfp4MoEMethod@marlin",
                 "QuarkOCP_MX_MoEMethod@marlin", "MoeWNA16Method@triton"):
        assert "unchecked" not in rerun[name]["vllm_source"], name


def test_lora_and_block_codec_moe_rows_stop_where_vllm_does(rerun):
    """FusedMoEModularMethod is built the way vLLM's LoRA model manager builds it: the LoRA
    branch of the unquantized oracle picks TritonExperts, FusedMoEWithLoRA swaps the method,
    and the apply stops in the CPU punica wrapper, which has no MoE LoRA. The ModelOpt block
    codec method is built from a MIXED_PRECISION config and stops in its constructor, which
    asks for b12x on an SM 12.x GPU."""
    lora = rerun["FusedMoEModularMethod"]
    assert (lora["ran"], lora["failed_at"]) == ("no", "apply")
    assert lora["scheme"] == "unquantized -> TritonExperts + LoRA"
    assert "vllm/lora/punica_wrapper/punica_base.py:" in lora["reason"]
    block = rerun["ModelOptBlockQuantMoEMethod"]
    assert (block["ran"], block["failed_at"]) == ("no", "create_weights")
    assert "require b12x on SM12x at vllm/model_executor/layers/quantization/" \
           "modelopt_block_quant.py:" in block["reason"]


def test_mx_fp6_emulation_runs_with_amd_quark(tmp_path):
    """vLLM's MX-FP6 emulation dequantizes with amd-quark (quantization/utils/mxfp6_utils.py),
    which the Makefile installs: with it the kernel runs the whole pipeline on CPU, as
    committed."""
    import importlib.util

    if importlib.util.find_spec("quark") is None:
        msg = ("amd-quark is not installed (the Makefile's vLLM environment installs it: "
               "pip install -c requirements/vllm-constraints.txt amd-quark==0.13)")
        if os.environ.get("GRAPHTRACE_REQUIRE_VLLM") == "1":
            pytest.fail(msg)
        pytest.skip(msg)
    proc = _run("--kernel", "EmulationMxfp6LinearKernel", "--out", str(tmp_path))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    row = _rows(tmp_path / "vllm_kernel_audit.csv")["EmulationMxfp6LinearKernel"]
    assert row["ran"] == "yes", row["reason"]
    committed = _rows(COMMITTED)["EmulationMxfp6LinearKernel"]
    assert {c: row[c] for c in COMPARED} == {c: committed[c] for c in COMPARED}
    assert "amd-quark 0.13" in (tmp_path / "vllm_kernel_audit.md").read_text()


def test_row_without_a_backend_says_what_amx_would_pick(rerun, comparable):
    """On a CPU without AMX the INT8 oracle finds no backend; the row says so with vLLM's
    line and what the oracle picks when told the CPU has AMX (Note [audit AMX probe]), and
    that the method runs on a requested GPU backend is listed in a full run only."""
    _needs_same_cpu(comparable, "CompressedTensorsW8A8Int8MoEMethod")
    row = rerun["CompressedTensorsW8A8Int8MoEMethod"]
    assert row["ran"] == "no" and row["failed_at"] == "create_weights"
    assert "fused_moe/oracle/int8.py:171" in row["reason"]
    assert "AMX probe: on a CPU with AMX vLLM's oracle picks CPUExpertsInt8" in row["reason"]
    committed = _rows(COMMITTED)["CompressedTensorsW8A8Int8MoEMethod"]
    assert "on a GPU backend it runs: CompressedTensorsW8A8Int8MoEMethod@triton" in \
        committed["reason"]


def test_cpu_experts_rows_run_vllms_native_moe_kernels(rerun, comparable):
    """Offered without AMX (Note [audit CPU experts]), the INT8 oracle picks CPUExpertsInt8 and
    the row runs vLLM's real `fused_experts_cpu` (no stand-in): its rebuilt quant config's
    scales diverge (the #41670 pattern), sourced and flip-tested. Quark's INT8 method takes
    the same experts but never VNNI-packs the weights (quark_moe.py:1309-1317 builds the
    kernel without the experts' process_weights_after_loading), so vLLM's own kernel rejects
    them at the first forward: that row says so."""
    _needs_same_cpu(comparable, "CompressedTensorsW8A8Int8MoEMethod@cpu",
                    "QuarkW8A8Int8MoEMethod@cpu")
    row = rerun["CompressedTensorsW8A8Int8MoEMethod@cpu"]
    assert row["ran"] == "yes" and row["scheme"].endswith("-> CPUExpertsInt8")
    assert row["standins"] == ""
    assert int(row["diverged"]) == 2
    assert "diverged:moe.routed_experts.quant_method.moe_quant_config._w1.scale" in \
        row["stale_owners"]
    assert row["vllm_source"].endswith("compressed_tensors_moe_w8a8_int8.py:223")
    assert "moe_quant_config._w1.scale: stale read confirmed" in row["flip"]
    quark = rerun["QuarkW8A8Int8MoEMethod@cpu"]
    assert quark["ran"] == "no" and quark["failed_at"] == "apply"
    assert quark["scheme"].endswith("-> CPUExpertsInt8")
    assert "CHECK_EQ(packed_w1.size(2)" in quark["reason"]
    assert "quark/quark_moe.py:1309" in quark["reason"]


def test_cpu_experts_widening_is_scoped_and_restored():
    """The widened device check answers yes on this x86 CPU inside the context only; the
    AMX-code classes are not widened; the shipped checks are back after it."""
    pytest.importorskip("vllm")
    import torch
    from vllm.model_executor.layers.fused_moe.experts import cpu_moe
    from vllm.platforms import CpuArchEnum, current_platform

    if current_platform.get_cpu_architecture() != CpuArchEnum.X86:
        pytest.skip("the CPU experts are x86 classes")

    audit = _audit()
    before = {n: getattr(cpu_moe, n).__dict__["_supports_current_device"]
              for n in audit.CPU_EXPERTS_WIDENED}
    with audit.cpu_experts_without_amx():
        for name in audit.CPU_EXPERTS_WIDENED:
            assert getattr(cpu_moe, name)._supports_current_device() is True
        assert cpu_moe.X86CPUUnquantizedExperts._supports_current_device() is bool(
            torch.cpu._is_amx_tile_supported())
    assert {n: getattr(cpu_moe, n).__dict__["_supports_current_device"]
            for n in audit.CPU_EXPERTS_WIDENED} == before
