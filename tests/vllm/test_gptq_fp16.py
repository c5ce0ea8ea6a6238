"""A tiny 4-bit GPTQ Llama (float16) in a real in-process vLLM, run by CPUWNA16LinearKernel.

vLLM 0.32 on CPU: ``AutoGPTQLinearMethod`` picks ``CPUWNA16LinearKernel``, whose PWAL
repacks ``qweight`` and swaps it in with ``param.data = ...`` (same Parameter object), keeps
``scales`` and sets ``qzeros`` to None (symmetric quantization: no zero points). The forward
calls ``_C::cpu_gemm_wna16(input, q_weight, output, scales, zeros, bias, ...)`` with the
registered tensors themselves. The layerwise reload copies the re-processed values back into
the storages registered before it, so this kernel is reload-safe: a negative control.
"""

from __future__ import annotations

import gc
import types

import pytest

pytestmark = pytest.mark.vllm

LINEARS = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")


@pytest.fixture(scope="module")
def run(tiny_gptq_dir):
    from vllm import LLM

    import graphtrace.vllm as gv
    from graphtrace.vllm import tiny

    ns = types.SimpleNamespace()
    with gv.trace_llm(strict=True) as vt:
        vt.attach(LLM(**tiny.engine_kwargs(tiny_gptq_dir, dtype="float16")))
        ns.model = vt.model
        ns.kernel = type(vt.model.model.layers[0].self_attn.qkv_proj.quant_method.kernel).__name__
        ns.before = vt.generate(max_tokens=4)
        with vt.capture("decode", skip=1):
            vt.generate(max_tokens=2)
        vt.reload(tiny.checkpoint_weights(tiny_gptq_dir, tiny.perturbed(seed=1)))
        ns.after = vt.generate(max_tokens=4)
        ns.report = vt.diff()
        ns.qzeros_after = vt.model.model.layers[0].self_attn.qkv_proj.qzeros
    ns.vt = vt
    yield ns
    del ns.vt
    gc.collect()


def test_cpu_wna16_kernel_and_changed_outputs(run):
    assert run.kernel == "CPUWNA16LinearKernel"
    assert run.report.meta["vllm"]["dtype"] == "float16"
    assert run.report.meta["vllm"]["quantization"] in ("gptq", "auto_gptq")
    assert run.after != run.before, "new GPTQ weights must change the output"


def test_quantized_tensors_read_by_the_gemm_are_stable(run):
    e = run.report.edges
    by_owner = {o: row for o, row in zip(e["owners"].astype(str), e.itertuples()) if o}
    for layer in range(2):
        for lin in LINEARS:
            for name, arg in (("qweight", "q_weight"), ("scales", "scales")):
                path = f"model.layers.{layer}.{lin}.{name}"
                row = by_owner[path]
                # read by the WNA16 GEMM straight from the registered parameter; the reload
                # copied the re-packed values into this very storage
                assert row.verdict == "stable", path
                assert row.ops == "_C::cpu_gemm_wna16" and row.args == arg, path
                assert row.owner_kinds == "parameter"
    # qzeros is gone (None after PWAL, symmetric) and g_idx is never registered in 0.32
    assert run.qzeros_after is None
    owners = set(run.report.owners["path"].astype(str))
    assert not any(p.endswith((".qzeros", ".g_idx")) for p in owners)


def test_no_stale_edges_at_all(run):
    # the negative control: vLLM's reload is correct for this kernel, graphtrace agrees
    assert run.report.stale.empty
    verdicts = set(run.report.edges["verdict"].astype(str))
    assert verdicts <= {"stable", "unowned"}
    e = run.report.edges
    assert set(e[e["verdict"].astype(str) == "unowned"]["origin"].astype(str)) == {"internal"}


def test_blind_spots_for_gptq(run):
    structured = run.report.meta["vllm"]["blind_spots"]
    # GPTQ layers keep real tensors: none of them is an empty/prepacked blind spot
    assert not any(s["kind"] in ("onednn", "empty_parameter") and ".layers." in s["path"]
                   for s in structured)
    # the KV cache is still only reachable through the forward context
    assert any(s["kind"] == "forward_context" for s in structured)
    # a float16 lm_head/embedding goes to oneDNN only where this CPU's oneDNN builds an fp16
    # matmul; whatever was found must be backed by a real handle on the model
    for s in structured:
        if s["kind"] == "packed_copy":
            assert s["holder"].endswith(".handler_tensor")
