"""Freshness inside real per-tensor syncs (issue 39, item 3; Note [derived during updates] in
graphtrace/lineage/graph.py): a tensor the linear method of layer 0 keeps, derived from a weight by
that weight's loader in place during one update (fresh_ext.py), is not refreshed by a later
update that loads a new weight and leaves it alone. The graph reads the old value at the same
address (the worker compares it with what the weight now gives: `current`); the guard refuses
the next ``generate``, naming the holder, and ``t.diff()`` calls it ``unrefreshed`` with
``derived_from``. TRL 1.16.0's own ``sync_weights`` and OpenRLHF's per-tensor
``collective_rpc("update_weight")`` (serve_ext.py), under the plugin in guard mode with the
engine core in this process or in another, and under ``trace_llm()``. Each engine runs in a
subprocess (fresh_run.py).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

pytestmark = pytest.mark.vllm

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
HOLDER = "model.layers.0.self_attn.qkv_proj.quant_method.graphtrace_scale"
SOURCE = "model.layers.0.input_layernorm.weight"


@pytest.fixture(scope="module")
def changed_llama(tiny_llama_dir, tmp_path_factory):
    from graphtrace.vllm import tiny

    return tiny.write_changed_checkpoint(tiny_llama_dir, tmp_path_factory.mktemp("changed"))


def _run(run_result_script, model_dir, changed, tmp_path: Path, mode: str, paths: str,
         guard_env: bool) -> dict:
    from graphtrace.vllm import tiny

    env = dict(os.environ)
    env.update(tiny.engine_env(str(tmp_path / "cache"), multiprocessing=mode == "plugin_mp"))
    env.update(GRAPHTRACE_STRICT="1", GRAPHTRACE_VLLM_DIR=str(tmp_path / "out"),
               PYTHONPATH=os.pathsep.join([str(ROOT), str(HERE), env.get("PYTHONPATH", "")]))
    env.pop("GRAPHTRACE_GUARD", None)
    if guard_env:
        env["GRAPHTRACE_VLLM"] = "guard"
    else:
        env.pop("GRAPHTRACE_VLLM", None)
    return run_result_script("fresh_run.py", model_dir, changed, mode, paths, env=env,
                             timeout=600)


def _assert_path(r: dict, path: str, guarded: bool) -> None:
    refreshed, missed, fixed = r["refreshed"], r["missed"], r["fixed"]
    for step in (refreshed, missed, fixed):
        assert step["sync"]["ok"], (path, step["sync"])
    # the loader refreshed the holder in place: fresh, and derived from the weight now
    assert refreshed["current"] and refreshed["generate"]["ok"], (path, refreshed)
    assert refreshed["diff"] == [{"verdict": "stable", "derived_from": SOURCE}], refreshed["diff"]
    # a new weight, the holder left alone: the graph reads the old value (independent check)
    assert not missed["current"]
    assert missed["diff"] == [{"verdict": "unrefreshed", "derived_from": SOURCE}], missed["diff"]
    if guarded:  # refused before the next forward, naming the holder
        gen = missed["generate"]
        assert not gen["ok"] and gen["type"] == "StaleGraphError", (path, gen)
        assert gen["owners"] == [HOLDER] and "unrefreshed" in gen["message"], gen
        assert missed["checks"] >= 1
    else:
        assert missed["generate"]["ok"] and missed["checks"] == 0
    # refreshed again: it serves
    assert fixed["current"] and fixed["generate"]["ok"], (path, fixed)
    assert fixed["diff"] == [{"verdict": "stable", "derived_from": SOURCE}], fixed["diff"]


@pytest.mark.usefixtures("trl_installed")
def test_plugin_guard_in_trl_and_openrlhf_syncs(tiny_llama_dir, changed_llama, tmp_path,
                                               run_result_script):
    result = _run(run_result_script, tiny_llama_dir, changed_llama, tmp_path, "plugin",
                  "trl,openrlhf", guard_env=True)
    assert result["holder"] == HOLDER
    for path in ("trl", "openrlhf"):
        r = result["paths"][path]
        _assert_path(r, path, guarded=True)
        assert r["refreshed"]["checks"] == r["fixed"]["checks"] == 1
        assert r["missed"]["checks"] == 1
    assert result["unguarded"] == []


def test_plugin_guard_engine_core_in_another_process(tiny_llama_dir, changed_llama, tmp_path,
                                                     run_result_script):
    """OpenRLHF's sequence with the engine core (and the worker) in other processes: the
    client's ``llm.generate`` raises the workers' `StaleGraphError`. (TRL's colocate sync
    needs the worker in the client's process.)"""
    result = _run(run_result_script, tiny_llama_dir, changed_llama, tmp_path, "plugin_mp",
                  "openrlhf", guard_env=True)
    _assert_path(result["paths"]["openrlhf"], "openrlhf", guarded=True)


@pytest.mark.usefixtures("trl_installed")
def test_trace_llm_without_a_guard_says_so_once_and_its_diff_names_the_holder(
        tiny_llama_dir, changed_llama, tmp_path, run_result_script):
    """``trace_llm()`` with no guard (none asked, none in the environment): each sync serves,
    one warning in the log says nothing checks the updates (three syncs, one line), and
    ``vt.diff()`` still finds the holder unrefreshed (lineage records TRL's bare
    ``load_weights``: an update for the trace, guard or not)."""
    result = _run(run_result_script, tiny_llama_dir, changed_llama, tmp_path, "trace_llm",
                  "trl", guard_env=False)
    _assert_path(result["paths"]["trl"], "trl", guarded=False)
    assert len(result["unguarded"]) == 1, result["unguarded"]
    assert "load_weights" in result["unguarded"][0]
    assert "trace_llm(guard='raise')" in result["unguarded"][0]
