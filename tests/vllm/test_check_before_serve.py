"""Check before serve (Note [check before serve] in graphtrace/vllm/serve.py) with a real vLLM:
each RL client path (serve_ext.py: TRL 1.16.0's own colocate sync, ``VLLMGeneration.sync_weights``
of trl/generation/vllm_generation.py; OpenRLHF's worker extension and verl's bucketed update,
replayed; vLLM's reload_weights) pushes a clean update, a stale one (the layer's weight
processing rebinds a derived holder the captured graph reads) and a correct one, guarded by
``trace_llm(guard="raise")`` or by the plugin (``GRAPHTRACE_VLLM=guard``), with an ``LLM``
client (serve_run.py) or vLLM's ``AsyncLLM`` (async_run.py). The tiny fp32 Llama runs on every
CPU kind. Each engine runs in a subprocess.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

pytestmark = pytest.mark.vllm

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
HOLDER = "model.layers.0.self_attn.qkv_proj.injected_scale"
HANDLE = "model.layers.0.self_attn.qkv_proj.cpu_linear.__closure__['handler'].handler_tensor"
CLIENT_PATHS = ("trl", "openrlhf", "verl", "inplace")


@pytest.fixture(scope="module")
def changed_llama(tiny_llama_dir, tmp_path_factory):
    from graphtrace.vllm import tiny

    return tiny.write_changed_checkpoint(tiny_llama_dir, tmp_path_factory.mktemp("changed"))


def _run(run_result_script, model_dir, changed, tmp_path: Path, mode: str, paths: str,
         timeout: int = 600, script: str = "serve_run.py", extra: tuple = (),
         multiprocessing: bool | None = None):
    from graphtrace.vllm import tiny

    env = dict(os.environ)
    if multiprocessing is None:
        multiprocessing = mode == "plugin_mp"
    env.update(tiny.engine_env(str(tmp_path / "cache"), multiprocessing=multiprocessing))
    env.update(GRAPHTRACE_STRICT="1", GRAPHTRACE_VLLM_DIR=str(tmp_path / "out"),
               PYTHONPATH=os.pathsep.join([str(ROOT), str(HERE), env.get("PYTHONPATH", "")]))
    env.pop("GRAPHTRACE_GUARD", None)  # the default: raise
    if mode.startswith("plugin") or mode == "trace_llm_env":
        env["GRAPHTRACE_VLLM"] = "guard"
    else:
        env.pop("GRAPHTRACE_VLLM", None)
    args = (mode, paths) if script == "serve_run.py" else (paths,) if paths else ()
    return run_result_script(script, model_dir, changed, *args, *extra, env=env,
                             timeout=timeout)


def _assert_client_path(r: dict, path: str, in_process: bool) -> None:
    clean, stale, fixed = r["clean"], r["stale"], r["fixed"]
    # a clean update: every tensor loaded, ONE check (before the next forward), it serves
    assert clean["sync"]["ok"], clean["sync"]
    assert clean["generate"]["ok"], clean["generate"]
    assert clean["checks"] == 1, (path, clean["after_generate"])
    last = clean["after_generate"]["last"]
    assert last["ok"] and last["trigger"] == "before_forward"
    assert not clean["after_generate"]["dirty"]
    if path == "inplace":  # no hooked entry point ran: the version counters mark it, at the step
        assert not clean["after_sync"]["dirty"] and last["updates"] == ["in-place write"], last
    # the stale update completes (graphtrace raises nothing inside the client's loop)
    assert stale["sync"] == {"ok": True, "value": clean["sync"]["value"]}, stale["sync"]
    assert stale["after_sync"]["dirty"] == (path != "inplace"), stale["after_sync"]
    # nothing checked during the sync
    assert stale["after_sync"]["checks"] == clean["after_generate"]["checks"]
    if path == "verl":  # the rebinding happened in the final process_weights_after_loading
        assert stale["after_sync"]["updates"] == ["load_weights", "process_weights_after_loading"]
    # ... the next forward is refused, naming the holder
    # the client gets StaleGraphError itself, hiding nothing and hidden by nothing, with the
    # problems; with the engine core in another process too (asked of the workers by RPC)
    gen = stale["generate"]
    assert not gen["ok"]
    assert gen["type"] == "StaleGraphError" and gen["context"] is None, gen
    assert HOLDER in gen["message"] and "stale" in gen["message"]
    assert gen["owners"] == [HOLDER], gen
    last = stale["after_generate"]["last"]
    assert not last["ok"] and last["owners"] == [HOLDER] and last["verdicts"] == ["stale"]
    assert stale["after_generate"]["dirty"]  # refused until a correct update passes
    expected = 2 if path == "openrlhf" else 1  # openrlhf: + the explicit graphtrace_check
    if in_process:
        assert stale["checks"] == expected, (path, stale["after_generate"])
    else:  # the requests may reach the engine core one by one: each refused step checks
        # again, but not a step that only flushes the refused ones (no check in a loop)
        from graphtrace.vllm import tiny

        assert expected <= stale["checks"] <= expected + len(tiny.PROMPTS) - 1, (
            path, stale["after_generate"])
    if path == "openrlhf":
        assert not stale["explicit"]["ok"] and HOLDER in stale["explicit"]["message"]
        if in_process:
            assert stale["explicit"]["type"] == "StaleGraphError"
    assert stale["generate_again"]["type"] == "StaleGraphError", stale["generate_again"]
    assert not stale["holder_is_captured"]
    # a correct update: it serves again, the outputs of the clean update's weights
    assert fixed["sync"]["ok"] and fixed["generate"]["ok"], fixed
    assert fixed["generate"]["value"] == clean["generate"]["value"]
    assert fixed["holder_is_captured"] and not fixed["after_generate"]["dirty"]
    assert fixed["after_generate"]["last"]["ok"]


@pytest.mark.usefixtures("trl_installed")
@pytest.mark.parametrize("mode", ["trace_llm", "plugin"])
def test_client_paths_in_one_process(tiny_llama_dir, changed_llama, tmp_path, mode,
                                     run_result_script):
    result = _run(run_result_script, tiny_llama_dir, changed_llama, tmp_path, mode,
                  ",".join(CLIENT_PATHS) + ",reload")
    assert result["holder"] == HOLDER
    for path in CLIENT_PATHS:
        _assert_client_path(result["paths"][path], path, in_process=True)
    # vLLM's reload_weights is a whole update: checked when it returns, and its caller gets
    # the error. On CPU it also rebuilds every linear layer's oneDNN handle
    # (dispatch_cpu_unquantized_gemm in process_weights_after_loading): the captured graph's
    # handles are stale whatever the kernel does (tests/vllm/test_llama_fp32.py)
    reload = result["paths"]["reload"]
    for step in ("clean", "stale", "fixed"):
        r = reload[step]
        assert r["sync"]["type"] == "StaleGraphError" and HANDLE in r["sync"]["message"], r
        assert r["generate"]["type"] == "StaleGraphError"  # still refused, the engine alive
        assert r["after_generate"]["last"]["updates"] == ["reload_weights"]
    assert HOLDER in reload["stale"]["sync"]["message"]
    assert HOLDER not in reload["fixed"]["sync"]["message"]
    assert result["final"]["type"] == "StaleGraphError"
    if mode == "plugin":  # the plugin's record of each check
        lines = (tmp_path / "out" / "guard" / "rank0" / "checks.jsonl").read_text().splitlines()
        checks = [json.loads(ln) for ln in lines]
        assert checks[0]["trigger"] == "before_forward" and checks[0]["updates"] == ["load_weights"]
        assert any(c["trigger"] == "graphtrace_check" for c in checks)


@pytest.mark.usefixtures("trl_installed")
def test_trace_llm_takes_the_guard_from_the_plugins_environment(tiny_llama_dir, changed_llama,
                                                                  tmp_path, run_result_script):
    """Note [one guard switch] in graphtrace/vllm/adapter.py: ``trace_llm()`` with no
    ``guard=``, in a process whose environment says ``GRAPHTRACE_VLLM=guard``, guards as the
    plugin does: each clean update checked once, the stale one refused at the next
    ``generate`` with `StaleGraphError` naming the holder, served again after a correct one;
    its checks written where the plugin writes them."""
    result = _run(run_result_script, tiny_llama_dir, changed_llama, tmp_path, "trace_llm_env",
                  "trl,openrlhf")
    assert result["holder"] == HOLDER
    for path in ("trl", "openrlhf"):
        _assert_client_path(result["paths"][path], path, in_process=True)
    assert result["final"]["ok"]
    lines = (tmp_path / "out" / "guard" / "rank0" / "checks.jsonl").read_text().splitlines()
    checks = [json.loads(ln) for ln in lines]
    assert checks[0]["trigger"] == "before_forward" and checks[0]["action"] == "raise"
    assert sum(not c["ok"] for c in checks) >= 2  # a stale update refused on each path


def test_client_paths_engine_core_in_another_process(tiny_llama_dir, changed_llama, tmp_path,
                                                     run_result_script):
    """Multiprocessing on (the TRL and in-place paths need the worker in the client's
    process): a refused step's requests finish with an error in the engine core, and the
    client's ``llm.generate`` raises the workers' `StaleGraphError`, naming the holder."""
    result = _run(run_result_script, tiny_llama_dir, changed_llama, tmp_path, "plugin_mp",
                  "openrlhf,verl")
    for path in ("openrlhf", "verl"):
        r = result["paths"][path]
        _assert_client_path(r, path, in_process=False)
    assert result["final"]["ok"]


@pytest.mark.parametrize("backend", ["default", "uni"])
def test_async_llm_client_gets_stale_graph_error(tiny_llama_dir, changed_llama, tmp_path,
                                                 backend, run_result_script):
    """vLLM's ``AsyncLLM`` (``vllm serve``, async RL rollouts; its engine core always in a
    process of its own; the worker in another process (``default``: vLLM's multiprocessing
    executor on CPU) or in the engine core's (``uni``: on CPU only with
    ``VLLM_ENABLE_V1_MULTIPROCESSING=0``, which AsyncLLM itself ignores)): three requests at once after each
    update. A stale update: every ``async for out in engine.generate(...)`` raises
    `StaleGraphError` itself, with the problems naming the holder; the engine stays alive,
    is checked once per refused step (not in a loop while idle), and serves again after a
    correct update."""
    from graphtrace.vllm import tiny

    result = _run(run_result_script, tiny_llama_dir, changed_llama, tmp_path, "plugin_async",
                  "verl,openrlhf", script="async_run.py", extra=(backend,),
                  multiprocessing=backend == "default")
    assert result["executor"] == ("mp" if backend == "default" else "uni"), result["executor"]
    assert result["client_pid"] not in result["worker_pids"]
    assert result["holder"] == HOLDER
    n = len(tiny.PROMPTS)
    assert all(g["ok"] for g in result["baseline"])
    for path, r in result["paths"].items():
        clean, stale, fixed = r["clean"], r["stale"], r["fixed"]
        for step in (clean, fixed):  # one check, before the first forward; it serves
            assert step["sync"]["ok"] and all(g["ok"] for g in step["generate"]), (path, step)
            assert step["checks"] == 1, (path, step["after_generate"])
            assert step["after_generate"]["last"]["ok"] and not step["after_generate"]["dirty"]
        assert fixed["generate"] == clean["generate"] and fixed["holder_is_captured"]
        assert stale["sync"]["ok"] and stale["after_sync"]["dirty"]  # nothing raised in the sync
        for gen in stale["generate"] + stale["generate_again"]:  # each request: the error itself
            assert not gen["ok"]
            assert gen["type"] == "StaleGraphError", (path, gen)
            assert gen["context"] is None and gen["cause"] is None, gen
            assert gen["owners"] == [HOLDER], gen
            assert "StaleGraphError" in gen["message"] and HOLDER in gen["message"], gen
        # a refused step checks once; the requests may reach the engine core in up to n steps
        assert 1 <= stale["checks"] <= n, (path, stale["checks"])
        last = stale["after_generate"]["last"]
        assert not last["ok"] and last["owners"] == [HOLDER] and last["verdicts"] == ["stale"]
        assert stale["after_generate"]["dirty"] and not stale["holder_is_captured"]
        assert not (clean["errored"] or stale["errored"] or fixed["errored"])  # alive throughout
    assert all(g["ok"] for g in result["final"]) and not result["errored"]


@pytest.fixture(scope="module")
def tiny_tok_llama(tmp_path_factory):
    """The tiny Llama with a tokenizer (an ``LLM`` of a pooling model builds its pooling IO
    processors with one), and its changed checkpoint."""
    from graphtrace.vllm import tiny

    model = tiny.make_tiny_llama(tmp_path_factory.mktemp("tiny-pool"), seed=0, tokenizer=True)
    return model, tiny.write_changed_checkpoint(model, tmp_path_factory.mktemp("tiny-pool-changed"))


@pytest.mark.parametrize("client", ["async", "llm", "llm_mp"])
def test_pooling_client_gets_stale_graph_error(tiny_tok_llama, tmp_path, client,
                                               run_result_script):
    """A pooling engine (the tiny Llama run as an embedding model: ``runner="pooling",
    convert="embed"``; pool_run.py), verl's update: ``async for out in
    engine.encode(...)`` of ``AsyncLLM`` (``async``) and ``llm.embed`` / ``llm.encode``
    (``llm``: engine core in this process; ``llm_mp``: in its own) get `StaleGraphError`
    itself after a stale update, naming the holder; one check per clean update; the engine
    stays alive and serves again after a correct update. Before the pooling fix of `_refuse`
    (graphtrace/vllm/serve.py) the refused requests' outputs, with no pooling output, tripped
    ``assert req_state.detokenizer is not None`` in vLLM's output processor: ``llm.embed``
    raised AssertionError (and the next, correct call the stale refusal), ``AsyncLLM.encode``
    EngineGenerateError, and the engine was dead (EngineDeadError) from then on."""
    from graphtrace.vllm import tiny

    model, changed = tiny_tok_llama
    r = _run(run_result_script, model, changed, tmp_path, "plugin_pool", "", script="pool_run.py",
             extra=(client,), multiprocessing=client != "llm")
    assert r["runner"] == "pooling" and r["holder"] == HOLDER
    assert (r["client_pid"] == r["worker_pid"]) == (client == "llm")
    n = len(tiny.PROMPTS)
    calls = ("embed",) if client == "async" else ("embed", "encode")

    def results(step: dict, call: str) -> list[dict]:
        v = step[call]
        return v if isinstance(v, list) else [v]  # async: one result per request

    for name in ("clean", "fixed"):  # one check, before the first forward; it serves
        step = r[name]
        assert step["sync"]["ok"], step["sync"]
        for call in calls:
            assert all(g["ok"] for g in results(step, call)), (name, call, step[call])
        assert step["checks"] == 1, (name, step["after_embed"])
        assert step["after_embed"]["last"]["ok"] and not step["after_embed"]["dirty"]
    assert r["fixed"]["embed"] == r["clean"]["embed"] and r["fixed"]["holder_is_captured"]
    assert r["clean"]["embed"] != r["baseline"]  # the update changed the embeddings
    stale = r["stale"]
    assert stale["sync"]["ok"] and stale["after_sync"]["dirty"]  # nothing raised in the sync
    for call in calls:
        for gen in results(stale, call):  # the error itself, hiding nothing, naming the holder
            assert not gen["ok"]
            assert gen["type"] == "StaleGraphError", (call, gen)
            assert gen["context"] is None and gen["cause"] is None, gen
            assert gen["owners"] == [HOLDER] and HOLDER in gen["message"], gen
    # one check per refused call (in another process: the requests may reach it in n steps)
    if client == "llm":
        assert stale["checks"] == len(calls), stale["after_embed"]
    else:
        assert len(calls) <= stale["checks"] <= len(calls) * n, stale["after_embed"]
    last = stale["after_embed"]["last"]
    assert not last["ok"] and last["owners"] == [HOLDER] and last["verdicts"] == ["stale"]
    assert stale["after_embed"]["dirty"] and not stale["holder_is_captured"]
    if client == "async":
        assert not (r["clean"]["errored"] or stale["errored"] or r["fixed"]["errored"])


def test_vllm_serve_http_client_sees_the_refusal(tmp_path_factory, tmp_path, run_result_script):
    """``vllm serve`` (the OpenAI server's ``AsyncLLM`` in the API server process, the plugin
    loaded there too): verl's update through the dev-mode ``POST /collective_rpc``. The
    exception type cannot cross HTTP; the client reads the text: a stale update's
    ``/v1/completions`` answers HTTP 500 ``InternalServerError`` (vLLM's generic handler for a
    non-vLLM exception) whose message says ``StaleGraphError`` and names the holder; streamed,
    HTTP 200 and then one ``data: {"error": ...}`` event (code 500) before ``[DONE]``. It
    serves again after a correct update."""
    from graphtrace.vllm import tiny

    model = tiny.make_tiny_llama(tmp_path_factory.mktemp("tiny-tok"), seed=0, tokenizer=True)
    changed = tiny.write_changed_checkpoint(model, tmp_path_factory.mktemp("tiny-tok-changed"))
    r = _run(run_result_script, model, changed, tmp_path, "plugin_http", "",
             script="http_run.py", extra=(tmp_path / "server.log",), multiprocessing=True)
    assert r["inject"]["body"]["results"] == [HOLDER]
    assert r["baseline"]["status"] == 200
    for step in ("clean", "fixed"):
        assert r[step]["sync"]["status"] == 200
        assert r[step]["plain"]["status"] == 200, r[step]["plain"]
        assert r[step]["plain"]["body"]["choices"][0]["finish_reason"] == "length"
        assert r[step]["stream"]["events"][-2]["choices"][0]["finish_reason"] == "length"
        assert not r[step]["status"]["dirty"]
    assert r["fixed"]["plain"]["body"]["choices"] == r["clean"]["plain"]["body"]["choices"]
    stale = r["stale"]
    assert stale["sync"]["status"] == 200  # the update itself completes
    error = stale["plain"]["body"]["error"]
    assert stale["plain"]["status"] == 500 and error["type"] == "InternalServerError", error
    assert error["message"].startswith("StaleGraphError: ") and HOLDER in error["message"]
    events = stale["stream"]["events"]
    assert stale["stream"]["status"] == 200 and events[-1] == "[DONE]" and len(events) == 2
    assert events[0]["error"]["code"] == 500 and HOLDER in events[0]["error"]["message"]
    assert "StaleGraphError" in events[0]["error"]["message"]
    assert stale["status"]["dirty"] and not stale["status"]["last"]["ok"]


@pytest.mark.parametrize("engine_core", ["in_process", "own_process"])
def test_weight_transfer_session(tiny_llama_dir, changed_llama, tmp_path, engine_core,
                                 run_result_script):
    """vLLM 0.32's weight-transfer session (``LLM.init_weight_transfer_engine``,
    ``start_weight_update`` .. chunks .. ``finish_weight_update``: the real ``Worker`` methods
    through ``collective_rpc``; xfer_run.py), plugin guard, the engine core in the client's
    process or in its own (then vLLM hands the client an ``Exception`` carrying a failed
    RPC's text, and ``llm.generate`` raises the workers' `StaleGraphError`).

    No backend vLLM 0.32 registers (vllm/distributed/weight_transfer/factory.py) moves
    tensors on CPU: ``nccl`` and ``sparse_nccl`` receive by NCCL broadcast on a
    ``PyNcclCommunicator`` (nccl_common.py:145-176, nccl_engine.py:225,
    sparse_nccl_engine.py:162: CUDA streams); ``nccl_m2n`` needs NVIDIA's nccl-extensions
    (m2n_common.py:70-86); ``sharded_rdt`` needs the Ray executor and NIXL
    (sharded_rdt_engine.py:315); ``modelexpress`` is an outside package; ``ipc`` rebuilds the
    trainer's tensors from CUDA IPC handles: ``receive_weights`` calls
    ``torch.cuda.get_device_properties`` (ipc_engine.py:222) and ``rebuild_cuda_tensor``
    (:237; packed: packed_tensor.py:426, 471), and ``WeightTransferEngine.update_weights``
    then ``torch.accelerator.synchronize()`` (base.py:502). So the engine is built with the
    real ``IPCWeightTransferEngine``, and on CPU everything of the session runs but that
    transport: ``init_weight_transfer_engine``, ``start_weight_update``
    (``initialize_layerwise_reload``), each chunk's ``model.load_weights(weights)`` as
    ``receive_weights`` calls it (ipc_engine.py:240-245; tensors read from the checkpoint,
    serve_ext `graphtrace_test_receive`) and ``finish_weight_update``
    (``finalize_layerwise_reload``). The chunks carry the tensors a CPU engine takes
    (serve_ext); the stale holder is rebound at the session's end.

    A clean session: no check inside (the guard dirty from the start), one check when it
    finishes, it serves. A stale one: ``finish_weight_update`` raises `StaleGraphError`
    naming the holder, and every forward is refused until a correct session passes. Then
    vLLM's own ``update_weights``: on CPU it fails at ipc_engine.py:222 ("Torch not
    compiled with CUDA enabled"); vLLM ends its session (gpu_worker.py:1581-1585), so a
    later ``load_weights`` is an update of its own (before the fix of graphtrace/vllm/
    hooks.py it stayed a silent part of a session no ``finish`` would close), and the
    next forward is refused: the failed chunk left the layers that ``initialize_layerwise_
    reload`` restored on meta tensors (nothing undoes it), so their captured storages moved."""
    from graphtrace.vllm import tiny

    one = engine_core == "in_process"
    r = _run(run_result_script, tiny_llama_dir, changed_llama, tmp_path, "plugin_xfer", "",
             script="xfer_run.py", multiprocessing=not one)
    n = len(tiny.PROMPTS)
    assert r["transfer"] == {"engine": "IPCWeightTransferEngine", "active": False}
    assert r["holder"] == HOLDER and r["init"]["ok"]
    for name in ("clean", "stale", "fixed"):
        s = r[name]
        assert s["start"]["ok"], s["start"]
        assert len(s["inside"]) == 2 and all(  # no check inside the session
            c["checks"] == 0 and c["dirty"] and c["active"] for c in s["inside"]), s["inside"]
    for name in ("clean", "fixed"):  # one check, at the session's end; it serves
        s = r[name]
        assert s["finish"]["ok"] and s["generate"]["ok"], s
        assert s["checks"] == 1 and s["holder_is_captured"]
        last = s["after_generate"]["last"]
        assert last["ok"] and last["trigger"] == "finish_weight_update"
        assert last["updates"] == ["start_weight_update"] and not s["after_generate"]["dirty"]
    assert r["fixed"]["generate"]["value"] == r["clean"]["generate"]["value"]
    assert r["clean"]["generate"]["value"] != r["baseline"]  # the session changed the weights
    stale = r["stale"]
    # the error itself, naming the holder (the finish RPC's, from another process: its text)
    for call in ("finish", "generate", "generate_again") if one else ("generate", "generate_again"):
        e = stale[call]
        assert e["type"] == "StaleGraphError" and e["context"] is None, (call, e)
        assert e["owners"] == [HOLDER] and HOLDER in e["message"], (call, e)
    if not one:
        assert stale["finish"]["type"] == "Exception" and HOLDER in stale["finish"]["message"]
        assert "graphtrace guard" in stale["finish"]["message"]
    assert stale["after_finish"]["last"]["trigger"] == "finish_weight_update"
    # at the end of the session, then before the refused forward (from another process the
    # requests may reach the engine core in up to n steps, each refused and checked)
    assert 2 <= stale["checks"] <= (2 if one else 1 + n), stale["after_generate"]
    assert stale["after_generate"]["dirty"] and not stale["holder_is_captured"]
    # vLLM's own chunk call on CPU
    a = r["aborted"]
    assert a["start"]["ok"]
    assert "Torch not compiled with CUDA enabled" in a["update"]["message"], a["update"]
    if one:
        assert a["update"]["type"] == "AssertionError", a["update"]
        assert "ipc_engine.py" in a["update"]["traceback"]
        assert "get_device_properties" in a["update"]["traceback"]
    assert a["transfer"]["active"] is False  # vLLM ended its session
    assert "without a matching start_weight_update" in a["finish"]["message"]
    assert a["load"]["ok"]
    assert a["after_load"]["updates"] == ["start_weight_update", "load_weights"], a["after_load"]
    gen = a["generate"]
    assert gen["type"] == "StaleGraphError" and "model.layers.0.input_layernorm.weight" in gen["owners"]
    assert 1 <= a["checks"] <= (1 if one else n) and a["after_generate"]["dirty"]
