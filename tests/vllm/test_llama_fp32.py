"""A tiny float32 Llama in a real in-process vLLM: trace, reload with changed weights, diff.

What vLLM 0.32 does on CPU that decides the verdicts below:

* PWAL of every plain linear layer (``dispatch_cpu_unquantized_gemm``) prepacks the weight
  into a oneDNN handle and replaces the registered ``weight`` with an empty tensor; the
  forward calls ``_C::onednn_mm(out, x, bias, handler_tensor)``, where ``handler_tensor`` (a
  0-d int64 pointer) lives in the closure of ``layer.cpu_linear``.
* ``reload_weights`` runs the layerwise reload: it copies new values into the storages of
  the parameters/buffers registered before the reload (so those stay put), and PWAL runs
  again, building a *new* handle in a *new* ``cpu_linear`` lambda; the old handle is
  released when the old lambda dies.
"""

from __future__ import annotations

import gc
import types

import pytest
import torch

pytestmark = pytest.mark.vllm

LINEARS = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")


def _edges_by_owner(report):
    e = report.edges
    return {o: row for o, row in zip(e["owners"].astype(str), e.itertuples()) if o}


@pytest.fixture(scope="module")
def run(tiny_llama_dir):
    from vllm import LLM

    import graphtrace.vllm as gv
    from graphtrace.vllm import tiny

    ns = types.SimpleNamespace()
    with gv.trace_llm(strict=True) as vt:
        llm = LLM(**tiny.engine_kwargs(tiny_llama_dir, dtype="float32"))
        ns.watched_at_load = vt.model is not None          # found by the load_model hook
        vt.attach(llm)
        ns.model = vt.model
        ns.before = vt.generate(max_tokens=4)
        from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

        from graphtrace.provenance import ProvenanceMode
        ns.provenance_in_forward = []
        spy = vt.model.register_forward_pre_hook(lambda m, a: ns.provenance_in_forward.append(
            any(isinstance(x, ProvenanceMode) for x in _get_current_dispatch_mode_stack())))
        vt.generate(max_tokens=2)  # after warm-up: provenance paused
        spy.remove()
        ns.recording_after_warmup = vt.trace.provenance_recording
        # Forward 0 of a generate is the prefill of all prompts, forward 1 the first decode
        # step: that is what vLLM would capture as a decode CUDA graph on GPU.
        with vt.capture("decode", skip=1) as cap:
            vt.generate(max_tokens=3)
        ns.decode_graphs = list(cap.graphs)
        ns.dummy = vt.capture_dummy("dummy_decode", 4)  # vLLM's own dummy run (capture_model's)
        vt.reload(tiny.checkpoint_weights(tiny_llama_dir, tiny.perturbed(seed=1)))
        ns.after = vt.generate(max_tokens=4)
        ns.report = vt.diff()
        # Reload the original checkpoint from disk: outputs come back, handles move again.
        vt.reload()
        ns.restored = vt.generate(max_tokens=4)
        ns.report_restored = vt.diff()
    # Drop the emulated graphs (the "capture artifacts"): the old handles die with them.
    vt.graphs.clear()
    cap.graphs.clear()
    ns.decode_graphs = ns.dummy = None
    gc.collect()
    ns.report_no_graphs = vt.diff()
    # A reload that refreshes lm_head's registered weight but does not rebuild its oneDNN
    # copy (what a failed tied lm_head load leaves): the packed copy is not rebuilt.
    with torch.no_grad():
        ns.model.lm_head.weight.add_(0.5)
    ns.report_forgot = vt.diff()
    ns.vt = vt
    ns.llm = llm
    yield ns
    del ns.llm, ns.vt
    gc.collect()


def test_model_found_in_process_and_reload_really_changes_outputs(run):
    assert run.watched_at_load, "the Worker.load_model hook should watch the model during LLM()"
    assert type(run.model).__name__ == "LlamaForCausalLM"
    assert run.after != run.before, "reload_weights with perturbed weights must change outputs"
    assert run.restored == run.before, "reload from disk must restore the original outputs"


def test_two_graphs_recorded_with_the_model_forward_only(run):
    graphs = run.report.meta["graphs"]
    assert [g["label"] for g in graphs] == ["decode", "dummy_decode"]
    ops = set(run.report.accesses["op"].astype(str))
    # what the CPU forward dispatches: oneDNN GEMMs, vLLM attention, rotary embedding
    assert {"_C::onednn_mm", "vllm::unified_attention_with_output", "_C::rotary_embedding",
            "aten::embedding"} <= ops
    # compute_logits and sampling run outside model.forward (outside a CUDA graph too)
    assert "_C::greedy_argmax" not in ops


def test_registered_parameters_read_by_the_graph_are_stable(run):
    by_owner = _edges_by_owner(run.report)
    # The reload copies new values into the storages registered before it: graphs keep
    # reading the right memory. Names are vLLM's FQNs (fused qkv_proj/gate_up_proj).
    for name in ["model.embed_tokens.weight", "model.norm.weight",
                 "model.layers.0.input_layernorm.weight",
                 "model.layers.1.post_attention_layernorm.weight"]:
        assert by_owner[name].verdict == "stable", name
    # One rotary cache shared by every layer (vLLM caches get_rope): one storage, two owners.
    rope = [o for o in by_owner if "rotary_emb.cos_sin_cache" in o]
    assert rope == ["model.layers.0.self_attn.rotary_emb.cos_sin_cache; "
                    "model.layers.1.self_attn.rotary_emb.cos_sin_cache"]
    assert by_owner[rope[0]].verdict == "stable"
    # The runner's persistent input buffers are what a graph reads as inputs: owned, stable.
    assert by_owner["runner.positions"].verdict == "stable"
    ids = [o for o in by_owner if o.startswith("runner.input_ids")]
    assert ids and all(by_owner[o].verdict == "stable" for o in ids), ids
    # read by the int32 -> int64 copy in the embedding (aten::to.dtype under inference_mode)
    assert all("aten::to.dtype" in by_owner[o].ops for o in ids)


def test_onednn_handles_are_stale_after_a_reload(run):
    by_owner = _edges_by_owner(run.report)
    for layer in range(2):
        for lin in LINEARS:
            path = (f"model.layers.{layer}.{lin}.cpu_linear.__closure__['handler']"
                    ".handler_tensor")
            row = by_owner[path]
            # PWAL built a new handle in a new lambda; the captured graph still holds the old
            # handle tensor (kept alive by the emulated graph, as capture artifacts would):
            # stale, and "manifest" because the pointer value differs. Replaying it would
            # call oneDNN with a released handle.
            assert row.verdict == "stale", path
            assert row.impact == "manifest", path
            assert row.ops == "_C::onednn_mm" and row.args == "handler_tensor"
            assert row.owner_kinds == "attribute"
    # exactly those 8 handles per graph are stale; nothing is dangling/diverged/orphaned
    stale = run.report.stale
    assert len(stale) == 2 * 2 * len(LINEARS)
    assert set(stale["verdict"].astype(str)) == {"stale"}
    assert not set(run.report.edges["verdict"].astype(str)) & {"dangling", "diverged", "orphaned"}


def test_unowned_edges_are_graph_internal(run):
    e = run.report.edges
    unowned = e[e["verdict"].astype(str) == "unowned"]
    # intermediates written first inside the captured forward; no external input is left
    # unowned because the runner's buffers are watched ("runner" model)
    assert set(unowned["origin"].astype(str)) == {"internal"}


def test_provenance_paused_after_warmup_and_recorded_around_reloads(run):
    assert run.provenance_in_forward and not any(run.provenance_in_forward)
    assert not run.recording_after_warmup
    handles = run.report.stale[run.report.stale["owners"].astype(str).str.endswith(
        ".handler_tensor")]
    # the handles the reload made were made while provenance was resumed for it
    assert len(handles) and "not recorded" not in set(handles["live_created_at"].astype(str))
    assert run.report.meta["provenance"]["suspends"] >= 2


def test_blind_spots_are_records_matched_to_edges(run):
    frame = run.report.blind_spots_frame
    onednn = frame[frame["kind"] == "opaque handle"]
    assert len(onednn) == 2 * len(LINEARS) and (onednn["n_edges"] == 2).all()  # decode, dummy
    assert onednn["text"].str.contains("compares pointers, not weights").all()
    edges = run.report.blind_spot_edges(int(onednn.index[0]))
    assert edges["owners"].astype(str).str.endswith(".handler_tensor").all()
    lm = frame[frame["kind"] == "packed copy"]
    assert "lm_head.cpu_linear.__closure__['handler'].handler_tensor" in lm["holder"].tolist()
    assert set(frame["kind"]) >= {"opaque handle", "packed copy", "forward context"}


def test_packed_copy_not_rebuilt_is_its_own_finding(run):
    for r in (run.report, run.report_restored):  # vLLM's reload rebuilds the copy: silent
        assert "packed copy not rebuilt" not in {b.kind for b in r.blind_spot_records}
    (spot,) = [b for b in run.report_forgot.blind_spot_records
               if b.kind == "packed copy not rebuilt"]
    assert "lm_head.weight" in spot.text and spot.holder.startswith("lm_head.cpu_linear")
    assert "values changed" in spot.text


def test_empty_prepacked_weights_are_blind_spots_not_hidden(run):
    spots = run.report.blind_spots
    structured = run.report.meta["vllm"]["blind_spots"]
    onednn = {s["path"] for s in structured if s["kind"] == "onednn"}
    expected = {f"model.layers.{i}.{lin}.weight" for i in range(2) for lin in LINEARS}
    assert onednn == expected
    for path in expected:
        # the registered weight is an empty tensor: no graph reads it, the report says why
        assert any(path in text and "oneDNN" in text for text in spots), path
        assert path not in set(run.report.owners["path"].astype(str))
    # lm_head keeps its full weight but its GEMM reads the packed copy behind a handle
    assert any(s["kind"] == "packed_copy" and s["path"] == "lm_head.weight" for s in structured)
    # KV cache reads/writes happen inside the attention op, fetched by layer name
    fc = [s for s in structured if s["kind"] == "forward_context"]
    assert len(fc) == 1 and "model.layers.0.self_attn.attn.kv_cache" in fc[0]["path"]


def test_reload_from_disk_restores_outputs_but_handles_stay_stale(run):
    r = run.report_restored
    handles = r.edges[r.edges["owners"].astype(str).str.endswith(".handler_tensor")]
    # Values are back, yet every reload builds new handles: a graph captured before any
    # reload would still use the first, released handles.
    assert len(handles) == 16 and set(handles["verdict"].astype(str)) == {"stale"}
    stable = r.edges[r.edges["owner_kinds"].astype(str).isin(["parameter", "buffer"])]
    assert set(stable["verdict"].astype(str)) == {"stable"}


def test_without_capture_artifacts_the_old_handles_dangle(run):
    r = run.report_no_graphs
    handles = r.edges[r.edges["owners"].astype(str).str.endswith(".handler_tensor")]
    # Nothing keeps the captured handle tensors alive once the graphs are gone: freed.
    assert set(handles["verdict"].astype(str)) == {"dangling"}
    assert set(handles["impact"].astype(str)) == {"unknown"}


def test_report_folder_round_trip_keeps_vllm_meta(run, tmp_path):
    import graphtrace as gt

    run.report.to_csv(tmp_path / "r")
    back = gt.load_report(tmp_path / "r")
    assert back.blind_spots == run.report.blind_spots
    assert back.meta["vllm"]["model_class"] == "LlamaForCausalLM"
    assert back.meta["vllm"]["worker"] == "CPUWorker"
    assert (back.edges["verdict"].astype(str).tolist()
            == run.report.edges["verdict"].astype(str).tolist())
