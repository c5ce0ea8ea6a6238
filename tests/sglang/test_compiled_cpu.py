"""SGLang's compiled CPU engine in the real engine (issue #41): graphtrace finds the bug of
analysis/repro/sglang_cpu_compile_keeps_old_weights.py, and not where it is absent.

With ``enable_torch_compile=True`` on CPU, SGLang 0.5.23's ``CPUGraphRunner`` compiles decode
with Inductor freezing, which prepacks every linear's weight into compiled-in constants; a
weight update writes the parameters in place and never re-captures on CPU, so decode keeps
the old weights. graphtrace records the compiled graph where SGLang captures it
(graphtrace/sglang/compiled.py), ties the frozen constants to the weights they were made from,
and makes ``end_weight_update`` answer ``success=False`` naming them; with freezing off (the
control) the same update serves correctly and passes.

Stand-ins, stated: the CPU graph runner needs SGLang's intel_amx attention backend, whose two
ops come from sgl-kernel's CPU build, which the registry lacks: the pure-torch stand-in
analysis/repro/sglang_cpu_standin/common_ops.py is loaded in SGLang's processes
(tests/sglang/cpu_compile_support.py), and SGLang's own ``override_platform(has_amx=True)``
keeps that backend during argument resolution (this CPU has no AMX). float32 linears take
SGLang's native path either way. Two engine starts, one compile each (decode batch size 1).
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from pathlib import Path

import pytest

import graphtrace as gt

PROMPT = [[1, 17, 45, 300, 12, 99, 7]]
NEW_TOKENS = 6
ENTRY = "graphtrace_test_cpu_compile = tests.sglang.cpu_compile_support:register\n"


@pytest.fixture(scope="module")
def models(work):
    """Checkpoint A (the tiny Llama) and the tensors of B (A perturbed); transformers' greedy
    tokens on each, the reference."""
    from graphtrace.vllm.tiny import checkpoint_weights, make_tiny_llama, perturbed

    a = work / "compiled-A"
    if not a.exists():
        make_tiny_llama(a)
    b = list(checkpoint_weights(a, perturbed(seed=1)))
    return a, b, _greedy(a, None), _greedy(a, b)


def _greedy(folder: Path, tensors) -> list[int]:
    import torch
    from transformers import LlamaForCausalLM

    m = LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    if tensors is not None:
        m.load_state_dict(dict(tensors), strict=False)
    ids = list(PROMPT[0])
    with torch.no_grad():
        for _ in range(NEW_TOKENS):
            ids.append(int(m(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(PROMPT[0]):]


@contextmanager
def _switches(**env):
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _support_entry_point(work: Path) -> None:
    """cpu_compile_support's entry point, seen by SGLang's spawned processes (the conftest
    put the repository root on their path)."""
    dist = work / "plugins" / "graphtrace_test_cpu_compile-0.dist-info"
    if not dist.exists():
        dist.mkdir(parents=True)
        (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: graphtrace-test-cpu-"
                                       "compile\nVersion: 0\n")
        (dist / "entry_points.txt").write_text(f"[sglang.srt.plugins]\n{ENTRY}")


def _run(work: Path, models, freezing: bool, guard: str = "raise") -> dict:
    """One compiled engine under graphtrace's guard (``guard``: its action): generate on A,
    update to B (begin / update_weights_from_tensor / end), generate again, report."""
    import sglang
    from sglang.srt.runtime_context import override_platform

    import graphtrace.sglang as gs

    a, b, _, _ = models
    _support_entry_point(work)
    tag = ("freezing" if freezing else "no-freezing") + ("" if guard == "raise" else f"-{guard}")
    out: dict = {}
    with _switches(GRAPHTRACE_TEST_CPU_OPS="1", GRAPHTRACE_TEST_FREEZING="1" if freezing else "0",
                   TORCHINDUCTOR_CACHE_DIR=str(work / f"inductor-{tag}")), \
            gs.trace_engine(work / f"graphtrace-{tag}", guard=guard) as st, \
            override_platform(has_amx=True):
        engine = sglang.Engine(model_path=str(a), device="cpu", attention_backend="intel_amx",
                               enable_torch_compile=True, cuda_graph_bs_decode=[1],
                               dtype="float32", max_total_tokens=1024,
                               mem_fraction_static=0.05, random_seed=0,
                               skip_tokenizer_init=True, skip_server_warmup=True,
                               log_level="error")
    sampling = dict(temperature=0, max_new_tokens=NEW_TOKENS, ignore_eos=True)
    try:
        out["before"] = engine.generate(input_ids=PROMPT, sampling_params=sampling)[0]
        out["begin"] = engine.begin_weight_update()
        out["update"] = engine.update_weights_from_tensor(named_tensors=b)
        out["end"] = engine.end_weight_update()
        try:  # a request the guard refuses is aborted: SGLang's Engine raises its message
            out["after"] = engine.generate(input_ids=PROMPT, sampling_params=sampling)[0]
        except ValueError as exc:
            out["after"] = exc
        out["report"] = gt.load_report(st.write_report(engine, "after_update"))
        out["checks"] = st.checks()
    finally:
        engine.shutdown()
    return out


@pytest.fixture(scope="module")
def frozen(work, models):
    return _run(work, models, freezing=True)


@pytest.fixture(scope="module")
def unfrozen(work, models):
    return _run(work, models, freezing=False)


@pytest.fixture(scope="module")
def frozen_recapture(work, models):
    return _run(work, models, freezing=True, guard="recapture")


def test_the_compiled_engine_serves_transformers_tokens_before_any_update(frozen, models):
    assert frozen["before"]["output_ids"] == models[2]  # the stand-in ops compute attention


def test_end_weight_update_refuses_naming_the_frozen_constants_weights(frozen):
    assert frozen["begin"][0] and frozen["update"][0]  # SGLang accepted both
    ok, message = frozen["end"][:2]
    assert ok is False, message
    assert "unrefreshed" in message and "decode_bs1" in message
    # every linear's frozen weight is named by the parameter it derives from (SGLang's names)
    for weight in ("model.layers.0.self_attn.qkv_proj.weight", "model.layers.1.mlp.down_proj"
                   ".weight", "lm_head.weight"):
        assert f"derived from {weight}" in message, message


def test_the_report_names_each_constant_and_its_source_weight(frozen):
    e = frozen["report"].edges
    bad = e[e["verdict"].astype(str) == "unrefreshed"]
    assert len(bad) and set(bad["graph"].astype(str)) == {"decode_bs1"}
    assert all(str(a).startswith("constant:") for a in bad["args"])  # Inductor's constants
    sources = set(bad["derived_from"].astype(str))
    assert "lm_head.weight" in sources and any("gate_up_proj" in s for s in sources)
    # the KV pool and the attention scratch are request state, not stale weights
    assert not bad["args"].astype(str).str.contains("k_cache|v_cache|attn_logits").any()


def test_the_refused_engine_does_not_serve_the_old_weights(frozen):
    refused = frozen["after"]
    assert isinstance(refused, ValueError) and "graphtrace guard" in str(refused)
    checks = frozen["checks"]
    assert checks and not any(c["ok"] for c in checks)
    assert checks[0]["trigger"] == "end_weight_update" and "unrefreshed" in checks[0]["verdicts"]


def test_with_freezing_off_the_same_update_serves_the_new_weights_and_passes(unfrozen, models):
    assert unfrozen["end"][0] is True, unfrozen["end"][1]
    assert not isinstance(unfrozen["after"], Exception), unfrozen["after"]
    assert unfrozen["after"]["output_ids"] == models[3]  # transformers on B
    e = unfrozen["report"].edges
    assert not (e["verdict"].astype(str).isin(gt.STALE_VERDICTS)).any()
    assert len(unfrozen["checks"]) == 1 and unfrozen["checks"][0]["ok"]


def test_recapture_is_refused_for_the_compiled_graphs_and_the_update_fails_closed(
        frozen_recapture):
    """GRAPHTRACE_GUARD=recapture cannot rebuild what CPUGraphRunner replays (its frozen
    constants): the update is refused as under raise, saying why, not re-recorded as passing
    (Note [recapture that cannot help] in graphtrace/serving.py)."""
    run = frozen_recapture
    assert run["begin"][0] and run["update"][0]
    ok, message = run["end"][:2]
    assert ok is False, message
    reason = message.splitlines()[0]
    assert "recapture is not possible: SGLang's CPUGraphRunner compiled decode_bs1" in reason
    assert "derived from lm_head.weight" in message and "unrefreshed" in message
    refused = run["after"]  # still refused at the next request, not re-captured away
    assert isinstance(refused, ValueError) and "recapture is not possible" in str(refused)
    checks = run["checks"]
    assert checks and not any(c["ok"] for c in checks)
    assert all(c["action"] == "recapture" and "CPUGraphRunner" in c["recapture_refused"]
               for c in checks)
    graphs = set(run["report"].edges["graph"].astype(str))
    assert graphs == {"decode_bs1"}  # no eager dummy decode was recorded in its place
