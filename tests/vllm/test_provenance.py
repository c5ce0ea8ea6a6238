"""Provenance in a real vLLM engine: the oneDNN handles' creation sites are vLLM's CPU linear
code, at load and during the reload (see tests/vllm/test_llama_fp32.py for the edges)."""

from __future__ import annotations

import inspect
import types

import pytest

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def run(tiny_llama_dir):
    from vllm import LLM

    import graphtrace.vllm as gv
    from graphtrace.vllm import tiny

    ns = types.SimpleNamespace()
    with gv.trace_llm(strict=True) as vt:
        llm = LLM(**tiny.engine_kwargs(tiny_llama_dir, dtype="float32"))
        vt.attach(llm)
        vt.capture_dummy("dummy_decode", 4)
        vt.reload(tiny.checkpoint_weights(tiny_llama_dir, tiny.perturbed(seed=1)))
        ns.report = vt.diff()
    ns.vt, ns.llm = vt, llm
    yield ns
    del ns.vt, ns.llm


def _file_of(module_name: str) -> str:
    import importlib

    return inspect.getsourcefile(importlib.import_module(module_name))


def test_onednn_handle_sites_point_into_vllm_cpu_linear_code(run):
    import vllm._custom_ops as custom_ops
    from vllm.model_executor.layers import utils as layer_utils

    from graphtrace.sites import parse_site
    from graphtrace.vocab import FIXES

    e = run.report.edges
    handles = e[e["owners"].astype(str).str.endswith(".handler_tensor")]
    assert len(handles) == 8 and set(handles["verdict"].astype(str)) == {"stale"}
    ops_file = inspect.getsourcefile(custom_ops)
    utils_file = inspect.getsourcefile(layer_utils)
    create = inspect.getsourcelines(custom_ops.create_onednn_mm)
    create_lines = range(create[1], create[1] + len(create[0]))
    for row in handles.itertuples():
        for text in (row.created_at, row.live_created_at):
            site = parse_site(text)
            assert site is not None, text
            first = site.frames[0]
            # torch.tensor(handle pointer) in create_onednn_mm, called from the CPU linear
            # dispatch that process_weights_after_loading runs
            assert first.file == ops_file and first.function == "create_onednn_mm", text
            assert first.line in create_lines
            assert site.op == "aten::lift_fresh", text
            assert any(f.file == utils_file and f.function == "dispatch_cpu_unquantized_gemm"
                       for f in site.frames), text
        assert row.fix == FIXES["read-through-layer"]  # a closure cell holds the handle


def test_registered_weights_have_sites_in_vllm(run):
    e = run.report.edges
    owned = e[(e["n_owners"] > 0) & e["owner_kinds"].astype(str).isin(["parameter", "buffer"])]
    assert len(owned)
    for text in owned["created_at"].astype(str):
        assert "/vllm/" in text or text == "not recorded", text
    assert (owned["created_at"].astype(str) != "not recorded").any()
    assert set(owned["live_created_at"].astype(str)) == {""}  # stable: no replacement
