"""Run by test_check_before_serve.py in a subprocess: a real vLLM (tiny fp32 Llama, engine
core in this process) guarded by ``trace_llm(guard="raise")`` or by the plugin
(``GRAPHTRACE_VLLM=guard``); every client path of serve_ext.SYNCS pushes a clean update, a
stale one and a correct one; prints one JSON line.

usage: python serve_run.py MODEL_DIR CHANGED_DIR MODE PATHS
  MODE: trace_llm, trace_llm_env (``trace_llm()`` under the plugin's guard environment),
  plugin (engine core in this process) or plugin_mp (multiprocessing on: the TRL path needs
  the worker in this process); PATHS: comma-separated keys of serve_ext.SYNCS
"""

from __future__ import annotations

import json
import sys


def main() -> None:
    model_dir, changed_dir, mode, paths = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4]
    from serve_ext import SYNCS, failure
    from vllm import LLM, SamplingParams

    import graphtrace.vllm as gv
    from graphtrace.vllm import tiny

    kw = tiny.engine_kwargs(model_dir, worker_extension_cls="serve_ext.ServeTestExtension")
    vt = None
    if mode == "trace_llm":
        vt = gv.trace_llm(guard="raise", strict=True).__enter__()
    elif mode == "trace_llm_env":  # the guard from the plugin's environment (GRAPHTRACE_VLLM=guard)
        vt = gv.trace_llm(strict=True).__enter__()
    llm = LLM(**kw)
    if vt is not None:
        vt.attach(llm)
    sp = SamplingParams(max_tokens=3, temperature=0.0, detokenize=False, ignore_eos=True)
    out: dict = {"mode": mode, "paths": {}}

    def gen():
        outs = llm.generate([{"prompt_token_ids": p} for p in tiny.PROMPTS], sp, use_tqdm=False)
        reasons = {o.outputs[0].finish_reason for o in outs}
        if "error" in reasons:  # a refused step the client did not raise (the old client side)
            raise RuntimeError(f"finish_reason error: {sorted(map(str, reasons))}")
        return [list(o.outputs[0].token_ids) for o in outs]

    def status():
        if vt is not None:
            if vt.serve_guard is None:  # no guard: nothing checked, ever
                return {"checks": 0, "dirty": False, "last": None, "updates": []}
            return vt.serve_guard.status()
        return llm.collective_rpc("graphtrace_guard_status")[0]

    def attempt(fn, *args):
        try:
            return {"ok": True, "value": fn(*args)}
        except Exception as exc:
            return failure(exc)

    def check():
        return vt.check() if vt is not None else llm.collective_rpc("graphtrace_check")[0]

    out["holder"] = llm.collective_rpc("graphtrace_test_inject")[0]
    if vt is not None:
        with vt.capture("decode", skip=1):
            out["baseline"] = gen()
    else:
        llm.collective_rpc("graphtrace_capture", kwargs={"label": "decode", "skip": 1})
        out["baseline"] = gen()
    for path in paths.split(","):
        sync = SYNCS[path]
        r: dict = {}
        steps = [("clean", "copy", changed_dir), ("stale", "rebind", model_dir),
                 ("fixed", "copy", changed_dir)]
        for step, kernel, folder in steps:
            llm.collective_rpc("graphtrace_test_mode", kwargs={"mode": kernel})
            before = status()["checks"]
            s = {"sync": attempt(sync, llm, folder)}
            s["after_sync"] = status()
            if step == "stale" and path == "openrlhf":  # the explicit end of the update
                s["explicit"] = attempt(check)
            s["generate"] = attempt(gen)
            s["after_generate"] = status()
            s["checks"] = s["after_generate"]["checks"] - before
            if step == "stale":  # still refused: dirty until a correct update passes
                s["generate_again"] = attempt(gen)
            s["holder_is_captured"] = llm.collective_rpc("graphtrace_test_holder_is_captured")[0]
            r[step] = s
        out["paths"][path] = r
    out["final"] = attempt(gen)
    print("GRAPHTRACE_RESULT " + json.dumps(out), flush=True)
    if vt is not None:
        vt.__exit__(None, None, None)
    engine_core = getattr(llm.llm_engine, "engine_core", None)
    if hasattr(engine_core, "shutdown"):
        engine_core.shutdown()


if __name__ == "__main__":
    main()
