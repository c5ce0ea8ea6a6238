"""The tiny float32 Llama with torch.compile ON (enforce_eager=False): tracing must not get in
the way of vLLM's compilation, and the report must say what compiled code hides.

vLLM compiles the model's forward with Dynamo + Inductor at startup, inside the trace. The
module attribution wrappers (graphtrace.attribution, "forward" by default) are installed on
every module while Dynamo traces, so this is where they would break compilation if they did.
Inductor's fused CPU kernels run without the dispatcher: the capture sees only extern kernels
and custom ops (``_C::onednn_mm``, ``vllm::unified_attention_with_output``, ...), and those
are enough to find the stale oneDNN handles, as in the eager run (test_llama_fp32.py).
"""

from __future__ import annotations

import types

import pytest

pytestmark = pytest.mark.vllm

LINEARS = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")


@pytest.fixture(scope="module")
def run(tiny_llama_dir):
    import graphtrace.vllm as gv
    from graphtrace.vllm import tiny
    from vllm import LLM

    ns = types.SimpleNamespace()
    with gv.trace_llm(strict=True) as vt:
        llm = LLM(**tiny.engine_kwargs(tiny_llama_dir, dtype="float32", enforce_eager=False))
        vt.attach(llm)
        ns.model = vt.model
        ns.before = vt.generate(max_tokens=4)
        with vt.capture("decode", skip=1):
            vt.generate(max_tokens=3)
        vt.reload(tiny.checkpoint_weights(tiny_llama_dir, tiny.perturbed(seed=1)))
        ns.after = vt.generate(max_tokens=4)
        ns.report = vt.diff()
        vt.reload()
        ns.restored = vt.generate(max_tokens=4)
    yield ns
    del llm


def test_the_engine_really_compiled_and_reload_still_works(run):
    engine = run.report.meta["vllm"]
    assert engine["enforce_eager"] is False
    assert engine["compilation_mode"] not in ("NONE", "0", ""), engine
    assert run.after != run.before, "reload_weights with perturbed weights must change outputs"
    assert run.restored == run.before, "reload from disk must restore the original outputs"


def test_the_modules_are_left_as_found(run):
    for name, module in run.model.named_modules():
        assert "forward" not in module.__dict__, name
        assert not module._forward_hooks and not module._forward_pre_hooks, name


def test_only_extern_kernels_and_custom_ops_are_seen_and_the_report_says_so(run):
    ops = set(run.report.edges["ops"].astype(str).str.split(";").explode())
    assert "_C::onednn_mm" in ops
    assert not any(op.startswith("aten::") for op in ops), ops   # fused by Inductor
    assert any(s.startswith("vllm/compiled:") for s in run.report.blind_spots)


def test_the_stale_onednn_handles_are_found_as_in_eager_mode(run):
    e = run.report.edges
    stale = set(e[e["verdict"].astype(str) == "stale"]["owners"].astype(str))
    expected = {f"model.layers.{i}.{lin}.cpu_linear.__closure__['handler'].handler_tensor"
                for i in range(2) for lin in LINEARS}
    assert stale == expected
