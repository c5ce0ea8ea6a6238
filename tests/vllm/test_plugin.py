"""The vllm.general_plugins entry point in worker processes (multiprocessing on)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.vllm

HERE = Path(__file__).resolve().parent


def test_entry_point_is_declared():
    from importlib.metadata import entry_points

    eps = {ep.name: ep.value for ep in entry_points(group="vllm.general_plugins")}
    assert eps.get("graphtrace") == "graphtrace.vllm.plugin:register"


def test_register_is_a_no_op_unless_enabled(monkeypatch):
    from graphtrace.vllm import hooks, plugin

    monkeypatch.delenv("GRAPHTRACE_VLLM", raising=False)
    monkeypatch.setattr(plugin, "_registered", False)
    before = {k: list(v) for k, v in hooks._listeners.items()}
    plugin.register()
    assert {k: list(v) for k, v in hooks._listeners.items()} == before
    assert plugin.session() is None


ENGINE_LOOP_CHILD = """
import os, queue, signal, types
from vllm.v1.engine import EngineCoreRequestType
from vllm.v1.engine.core import EngineCoreProc
from graphtrace.vllm import plugin

plugin.register()
engine = types.SimpleNamespace(input_queue=queue.Queue())  # stands in for an EngineCoreProc
try:
    EngineCoreProc.run_busy_loop(engine)  # the plugin's listener runs, then vLLM's loop fails
except AttributeError:
    pass
signal.signal(signal.SIGTERM, lambda signum, frame: None)  # vLLM's handler sets its own
signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})  # another thread takes it
os.kill(os.getpid(), signal.SIGTERM)
print("GOT", engine.input_queue.get(timeout=30) == (EngineCoreRequestType.WAKEUP, None))
"""


def test_a_sigterm_wakes_the_engine_core_loop():
    """The plugin hooks the engine core's busy loop: a SIGTERM puts vLLM's WAKEUP on its
    input queue even when the main thread does not take it (Note [lost SIGTERM])."""
    env = dict(os.environ, GRAPHTRACE_VLLM="1", GRAPHTRACE_STRICT="1")
    proc = subprocess.run([sys.executable, "-c", ENGINE_LOOP_CHILD], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "GOT True" in proc.stdout, proc.stdout + proc.stderr[-3000:]


@pytest.fixture(scope="module")
def plugin_run(tiny_llama_dir, tmp_path_factory, run_result_script):
    from graphtrace.vllm import tiny

    changed = tiny.write_changed_checkpoint(tiny_llama_dir, tmp_path_factory.mktemp("changed"))
    out = tmp_path_factory.mktemp("plugin-out")
    env = dict(os.environ)
    env.update(tiny.engine_env(str(tmp_path_factory.mktemp("vllm-cache")), multiprocessing=True))
    env.update(GRAPHTRACE_VLLM="1", GRAPHTRACE_VLLM_DIR=str(out), GRAPHTRACE_STRICT="1")
    return run_result_script("plugin_run.py", tiny_llama_dir, changed, out, env=env,
                             timeout=420), out


def test_worker_process_traces_and_writes_reports(plugin_run):
    import graphtrace as gt

    result, out = plugin_run
    (status,) = result["status"]
    # the plugin runs in the worker process, not in the test's client process
    assert status["tracing"] and status["pid"] != result["main_pid"]
    assert status["models"] == ["", "runner"]
    assert result["changed"], "reload_weights(weights_path=changed) must change the output"
    (path,) = result["paths"]
    assert Path(path) == out / "after_reload" / "rank0"
    rep = gt.load_report(path)
    assert rep.meta["vllm"]["pid"] == status["pid"]
    assert [g["label"] for g in rep.meta["graphs"]] == ["decode", "dummy_decode"]
    assert rep.meta["vllm"]["trigger"] == "collective_rpc"
    # the same verdicts as in-process: oneDNN handles stale, registered tensors stable
    e = rep.edges
    handles = e[e["owners"].astype(str).str.endswith(".handler_tensor")]
    assert len(handles) == 16 and set(handles["verdict"].astype(str)) == {"stale"}
    params = e[e["owner_kinds"].astype(str).isin(["parameter", "buffer"])]
    assert len(params) and set(params["verdict"].astype(str)) == {"stable"}
    assert any("oneDNN" in b for b in rep.blind_spots)


def test_worker_writes_a_report_at_shutdown(plugin_run):
    import graphtrace as gt

    _, out = plugin_run
    rep = gt.load_report(out / "shutdown" / "rank0")
    assert rep.meta["vllm"]["tag"] == "shutdown"
    # written by the Worker.shutdown wrapper (the atexit hook is only a fallback)
    assert rep.meta["vllm"]["trigger"] == "Worker.shutdown"
    assert len(rep.stale) == 16


def test_merge_rank_folders(plugin_run, tmp_path):
    import graphtrace.vllm as gv

    _, out = plugin_run
    merged = gv.merge_reports(out / "after_reload", out=tmp_path / "merged")
    assert set(merged.edges["rank"]) == {0}
    assert set(merged.edges["graph"].astype(str)) == {"rank0/decode", "rank0/dummy_decode"}
    assert set(merged.owners["model"].astype(str)) <= {"rank0", "rank0.runner"}
    assert (tmp_path / "merged" / "manifest.json").is_file()
    assert merged.meta["ranks"][0]["rank"] == 0


def test_merge_two_ranks_offsets_ids(plugin_run, tmp_path):
    import shutil

    import graphtrace as gt
    import graphtrace.vllm as gv

    _, out = plugin_run
    for r in (0, 1):  # two copies of the same rank folder stand in for a TP=2 run
        shutil.copytree(out / "after_reload" / "rank0", tmp_path / f"rank{r}")
    one = gt.load_report(tmp_path / "rank0")
    merged = gv.merge_reports(tmp_path)
    assert len(merged.edges) == 2 * len(one.edges)
    n = len(one.storages)
    assert merged.storages["storage_id"].tolist() == list(range(2 * n))
    assert sorted(set(merged.edges["graph_id"])) == [0, 1, 2, 3]
    r1 = merged.edges[merged.edges["rank"] == 1]
    assert set(r1["graph"].astype(str)) == {"rank1/decode", "rank1/dummy_decode"}
    assert merged.meta["blind_spots"] == one.meta["blind_spots"]  # de-duplicated
    assert len(merged.stale) == 2 * len(one.stale)
