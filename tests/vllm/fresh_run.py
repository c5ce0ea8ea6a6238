"""Run by test_sync_freshness.py in a subprocess: a real vLLM (tiny fp32 Llama) guarded by the
plugin (``GRAPHTRACE_VLLM=guard``; the engine core in this process, or in another with
``plugin_mp``) or by ``trace_llm()`` (guarded when the environment says so); each client path of serve_ext.SYNCS pushes three updates
through the loader of fresh_ext.py: one that refreshes the derived holder in place, one that
loads a new weight and leaves it alone, one that refreshes it again. Prints one JSON line,
with the warnings graphtrace logged in this process about a trace with no guard.

usage: python fresh_run.py MODEL_DIR CHANGED_DIR MODE PATHS
  MODE: plugin, plugin_mp or trace_llm; PATHS: comma-separated keys of serve_ext.SYNCS
"""

from __future__ import annotations

import json
import sys


def main() -> None:
    model_dir, changed_dir, mode, paths = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4]
    import logging

    from serve_ext import SYNCS, failure
    from vllm import LLM, SamplingParams

    import graphtrace.vllm as gv
    from graphtrace.vllm import tiny

    said: list[str] = []  # what graphtrace logs about an unguarded trace (Note [one guard switch])

    class _Said(logging.Handler):
        def emit(self, record):
            if "no guard" in record.getMessage():
                said.append(record.getMessage())

    logging.getLogger("graphtrace.vllm").addHandler(_Said(logging.WARNING))
    kw = tiny.engine_kwargs(model_dir, worker_extension_cls="fresh_ext.FreshTestExtension")
    vt = gv.trace_llm(strict=True).__enter__() if mode == "trace_llm" else None
    llm = LLM(**kw)
    if vt is not None:
        vt.attach(llm)
    sp = SamplingParams(max_tokens=3, temperature=0.0, detokenize=False, ignore_eos=True)
    out: dict = {"mode": mode, "paths": {}}

    def rpc(method, **kwargs):
        return llm.collective_rpc(method, kwargs=kwargs)[0]

    def gen():
        outs = llm.generate([{"prompt_token_ids": p} for p in tiny.PROMPTS], sp, use_tqdm=False)
        reasons = {o.outputs[0].finish_reason for o in outs}
        if "error" in reasons:
            raise RuntimeError(f"finish_reason error: {sorted(map(str, reasons))}")
        return [list(o.outputs[0].token_ids) for o in outs]

    def checks():
        if vt is not None:
            return vt.serve_guard.checks if vt.serve_guard is not None else 0
        return rpc("graphtrace_guard_status")["checks"]

    def attempt(fn, *args):
        try:
            return {"ok": True, "value": fn(*args)}
        except Exception as exc:
            return failure(exc)

    out["holder"] = rpc("graphtrace_fresh_inject")
    if vt is not None:
        with vt.capture("decode", skip=1):
            out["baseline"] = gen()
    else:
        rpc("graphtrace_capture", label="decode", skip=1)
        out["baseline"] = gen()
    for path in paths.split(","):
        r: dict = {}
        steps = [("refreshed", True, changed_dir), ("missed", False, model_dir),
                 ("fixed", True, changed_dir)]
        for step, refresh, folder in steps:
            rpc("graphtrace_fresh_mode", refresh=refresh)
            before = checks()
            s = {"sync": attempt(SYNCS[path], llm, folder)}
            s["generate"] = attempt(gen)  # the guard's check first: nothing else matched before it
            s["checks"] = checks() - before
            s["current"] = rpc("graphtrace_fresh_current")
            s["diff"] = rpc("graphtrace_fresh_diff")
            r[step] = s
        out["paths"][path] = r
    out["unguarded"] = said
    print("GRAPHTRACE_RESULT " + json.dumps(out), flush=True)
    if vt is not None:
        vt.__exit__(None, None, None)
    engine_core = getattr(llm.llm_engine, "engine_core", None)
    if hasattr(engine_core, "shutdown"):
        engine_core.shutdown()


if __name__ == "__main__":
    main()
