"""The tiny float32 Llama with torch.compile ON (enforce_eager=False): tracing must not get in
the way of vLLM's compilation, and compiled code must be no blind spot (issue 14).

vLLM compiles the model's forward with Dynamo + Inductor at startup, inside the trace. The
module attribution wrappers (graphtrace.attribution, "forward" by default) are installed on
every module while Dynamo traces, so this is where they would break compilation if they did.
Inductor's fused CPU kernels run without the dispatcher; graphtrace records each compiled
region's call as one ``compiled::`` op with its inputs (graphtrace/compiled.py), so the
embedding, the norms and the rotary cache appear as edges, next to the extern kernels and
custom ops (``_C::onednn_mm``, ...) that find the stale oneDNN handles as in the eager run
(test_llama_fp32.py). A rebinding injected after the capture is found through the compiled
region's reads.
"""

from __future__ import annotations

import types

import pytest
import torch

pytestmark = pytest.mark.vllm

LINEARS = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")


@pytest.fixture(scope="module")
def run(tiny_llama_dir):
    from vllm import LLM

    import graphtrace.vllm as gv
    from graphtrace.vllm import tiny

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
        # an injected holder that rebinds: the final norm's weight replaced by a copy, as a
        # process_weights_after_loading that reallocates would do
        norm = ns.model.model.norm
        original = norm.weight
        norm.weight = torch.nn.Parameter(original.detach().clone(), requires_grad=False)
        ns.injected = vt.diff()
        norm.weight = original
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


def test_compiled_regions_are_recorded_and_no_compiled_blind_spot_is_left(run):
    ops = set(run.report.edges["ops"].astype(str).str.split(";").explode())
    assert "_C::onednn_mm" in ops
    assert not any(op.startswith("aten::") for op in ops), ops   # fused by Inductor
    regions = run.report.meta["compiled"]
    assert regions and all(r["region"].startswith("compiled::") for r in regions)
    assert all(r["owned_inputs"] == r["tensor_inputs"] > 0 for r in regions), regions
    assert not any(s.startswith(("vllm/compiled:", "compiled:")) for s in run.report.blind_spots)


def test_what_fused_kernels_read_appears_as_stable_edges(run):
    e = run.report.edges
    compiled = e[e["ops"].astype(str).str.contains("compiled::", regex=False)]
    verdict = dict(zip(compiled["owners"].astype(str), compiled["verdict"].astype(str)))
    expected = {"model.embed_tokens.weight", "model.norm.weight"} | {
        f"model.layers.{i}.{norm}.weight" for i in range(2)
        for norm in ("input_layernorm", "post_attention_layernorm")}
    assert {o: verdict.get(o) for o in expected} == dict.fromkeys(expected, "stable")
    rotary = [o for o in verdict if "rotary_emb.cos_sin_cache" in o]
    assert rotary and all(verdict[o] == "stable" for o in rotary)


def test_an_injected_rebinding_is_found_through_the_compiled_region(run):
    stale = run.injected.stale
    rows = stale[stale["owners"].astype(str) == "model.norm.weight"]
    assert len(rows) == 1 and rows["verdict"].astype(str).iloc[0] == "stale"
    assert "compiled::" in rows["ops"].astype(str).iloc[0]


def test_the_stale_onednn_handles_are_found_as_in_eager_mode(run):
    e = run.report.edges
    stale = set(e[e["verdict"].astype(str) == "stale"]["owners"].astype(str))
    expected = {f"model.layers.{i}.{lin}.cpu_linear.__closure__['handler'].handler_tensor"
                for i in range(2) for lin in LINEARS}
    assert stale == expected
