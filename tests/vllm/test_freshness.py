"""Freshness in a real in-process vLLM (issue 24): a bare `model.load_weights(...)` with no
process step after it leaves what processing derived from the weight holding old values;
vLLM's own `reload_weights` re-processes.

Which layer: on CPU in float32, every plain linear layer's process step prepacks its weight
into a oneDNN handle and empties the registered weight (a bare `load_weights` into it fails
on the shape), so the one layer whose process step derives a tensor from a weight it keeps is
`lm_head` (`UnquantizedEmbeddingMethod.process_weights_after_loading` ->
`dispatch_cpu_unquantized_gemm(layer, remove_weight=False)`,
vllm/model_executor/layers/vocab_parallel_embedding.py:69-71): its `handler_tensor` is made by
`_C::create_onednn_mm_handler(weight.t(), ...)`, an op with a composite kernel that only
lineage's handle mode sees (Note [handle mode] in graphtrace/lineage/handles.py). `lm_head` runs in
`compute_logits`, outside the model's forward, so the test captures `compute_logits` itself
(`gt.capture`, an emulated graph on CPU).

Why the linears' handles show no `derived_from` (checked under `trace_llm`: all ten oneDNN
handles are seen, none names a source when made): lineage names a handle's registered
sources when the op makes it, from the watched models (Note [dangling sources] in
graphtrace/lineage/handles.py), but vLLM makes them inside `Worker.load_model`, before `trace_llm`
watches the model (its `after_load` listener); and `dispatch_cpu_unquantized_gemm(...,
remove_weight=True)` then replaces each linear's weight with an empty Parameter, freeing the
storage the handle was made from, so the walk after the capture has nothing left to name.
`lm_head` keeps its weight (`remove_weight=False`), so that walk names it. Naming earlier would
not help as such: the freed weight's path then reaches a live (empty) tensor, which the rule
reads as a `dangling source`, a false alarm for a handler that prepacked (copied) the weight;
it would need an empty placeholder read as `released` first.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.vllm

HANDLE = "lm_head.cpu_linear.__closure__['handler'].handler_tensor"


def _new_lm_head(model) -> torch.Tensor:
    g = torch.Generator().manual_seed(7)
    w = model.lm_head.weight
    return (torch.randn(w.shape, generator=g) * 0.05).to(w.dtype)


@pytest.fixture(scope="module")
def llm_model(tiny_llama_dir):
    from vllm import LLM

    import graphtrace as gt
    from graphtrace.vllm import tiny
    from graphtrace.vllm.adapter import find_model

    tiny.set_engine_env()
    with gt.trace(strict=False) as t:  # lineage records the engine's load and process step
        llm = LLM(**tiny.engine_kwargs(tiny_llama_dir, dtype="float32"))
        model = find_model(llm)
        t.watch(model)
        hidden = torch.randn(3, model.lm_head.weight.shape[1],
                             generator=torch.Generator().manual_seed(3))
        with torch.no_grad():
            with gt.capture("logits"):
                before = model.compute_logits(hidden).clone()
            # the RL client's sync: load_weights, and no process step after it
            model.load_weights([("lm_head.weight", _new_lm_head(model))])
            eager = model.compute_logits(hidden).clone()
    yield llm, model, t, hidden, before, eager
    del llm, model, t


def test_a_bare_load_weights_leaves_the_derived_handle_unrefreshed(llm_model):
    llm, model, t, hidden, before, eager = llm_model
    report = t.diff()
    e = report.edges.set_index(report.edges["owners"].astype(str))
    row = e.loc[HANDLE]
    assert row["verdict"] == "unrefreshed" and row["derived_from"] == "lm_head.weight"
    assert row["ops"] == "_C::onednn_mm"
    # the fix names the API of the vLLM release that runs (graphtrace.fixes, issue 36 item 4)
    import vllm

    from graphtrace.fixes import Stack, fix_text
    assert report.meta["stack"] == {"name": "vllm", "release": vllm.__version__,
                                    "source": "model classes"}
    assert row["fix"] == fix_text("recompute-in-place", Stack("vllm", vllm.__version__))
    assert "process_weights_after_loading" in row["fix"]
    # the eager model serves the old prepacked weight too: the logits did not move
    assert torch.equal(eager, before)
    problems = t.guard().check()
    assert list(problems["verdict"]) == ["unrefreshed"]
    assert list(problems["derived_from"]) == ["lm_head.weight"]
    # the first process step made the handle from the registered weight: derived, and the
    # lineage saw it (the handle mode), never a silent `stable`
    assert t.lineage.meta()["handles"] >= 1


def test_vllm_reload_weights_reprocesses(llm_model):
    import graphtrace as gt

    llm, model, t, hidden, before, eager = llm_model
    with gt.trace(model, strict=False) as t2, torch.no_grad():
        with gt.capture("logits") as graph:  # kept: the captured handle stays alive
            model.compute_logits(hidden)
        new = _new_lm_head(model)
        llm.collective_rpc("reload_weights",
                           kwargs={"weights_iterator": iter([("lm_head.weight", new)])})
        after = model.compute_logits(hidden)
    report = t2.diff()
    verdicts = set(report.edges["verdict"].astype(str))
    # the process step ran again: nothing the graph reads is unrefreshed; the handle it
    # captured was replaced by a new one (identity: stale, as for every oneDNN handle)
    assert "unrefreshed" not in verdicts
    e = report.edges.set_index(report.edges["owners"].astype(str))
    assert e.loc[HANDLE, "verdict"] == "stale"
    assert not torch.equal(after, before)  # the new weight is served
    del graph
