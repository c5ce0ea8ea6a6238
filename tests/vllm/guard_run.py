"""Run by test_guard_plugin.py in a subprocess: a real vLLM with the graphtrace plugin in guard
mode (GRAPHTRACE_VLLM=guard), on the tiny GPTQ model; prints one JSON line.

usage: python guard_run.py MODEL_DIR CHANGED_DIR TP BACKEND
  BACKEND: mp (multiprocessing executor) or ray; with VLLM_ENABLE_V1_MULTIPROCESSING=0 and TP 1
  everything runs in this one process.

Steps: inject a holder that PWAL keeps (tests/vllm/guard_ext.py); capture a decode graph; a bare
model.load_weights and a clean reload (must pass: one check, at the reload's end); make PWAL
rebind the holder; a reload (must fail in every rank); the guard status and a report per rank;
generate (refused); a correct reload (passes) and generate (serves again).
"""

from __future__ import annotations

import json
import os
import sys
import traceback


def main() -> None:
    model_dir, changed_dir, tp, backend = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
    from vllm import LLM, SamplingParams

    from graphtrace.vllm import tiny

    kw = tiny.engine_kwargs(model_dir, dtype="float16", tensor_parallel_size=tp,
                            worker_extension_cls="guard_ext.GuardTestExtension")
    if backend != "default":
        kw["distributed_executor_backend"] = backend
    if backend == "ray":  # a local cluster of our own, stopped at the end
        import ray

        ray.init(num_cpus=max(tp, os.cpu_count() or 1), include_dashboard=False,
                 log_to_driver=True, runtime_env={"env_vars": {
                     k: v for k, v in os.environ.items()
                     if k.startswith(("GRAPHTRACE_", "VLLM_", "HF_", "TRANSFORMERS_"))
                     or k == "PYTHONPATH"}})
    llm = LLM(**kw)
    sp = SamplingParams(max_tokens=3, temperature=0.0, detokenize=False, ignore_eos=True)
    out: dict = {"main_pid": os.getpid()}

    def gen():
        outs = llm.generate([{"prompt_token_ids": p} for p in tiny.PROMPTS], sp, use_tqdm=False)
        if any(o.outputs[0].finish_reason == "error" for o in outs):  # refused, client elsewhere
            raise RuntimeError("finish_reason error")
        return [list(o.outputs[0].token_ids) for o in outs]

    def attempt(name, method, **kwargs):
        try:
            llm.collective_rpc(method, kwargs=kwargs)
            out[name] = {"ok": True}
        except Exception as exc:
            out[name] = {"ok": False, "type": type(exc).__name__, "message": str(exc),
                         "traceback": traceback.format_exc()[-3000:]}

    out["injected"] = llm.collective_rpc("graphtrace_test_inject")
    llm.collective_rpc("graphtrace_capture", kwargs={"label": "decode", "skip": 1})
    out["before"] = gen()
    attempt("load_weights", "graphtrace_test_load_norm")
    attempt("clean_reload", "reload_weights", weights_path=changed_dir)
    out["after_clean"] = gen()
    out["status_clean"] = llm.collective_rpc("graphtrace_guard_status")
    llm.collective_rpc("graphtrace_test_rebind")
    attempt("bad_reload", "reload_weights", weights_path=model_dir)
    out["status_bad"] = llm.collective_rpc("graphtrace_guard_status")
    out["reports"] = llm.collective_rpc("graphtrace_write_report", kwargs={"tag": "after_bad"})
    try:  # refused until a correct update passes (Note [check before serve])
        out["after_bad"] = {"ok": True, "value": gen()}
    except Exception as exc:
        out["after_bad"] = {"ok": False, "type": type(exc).__name__, "message": str(exc)}
    llm.collective_rpc("graphtrace_test_rebind", kwargs={"on": False})
    attempt("fixed_reload", "reload_weights", weights_path=model_dir)
    out["after_fixed"] = gen()  # serves again
    llm.collective_rpc("graphtrace_test_rebind")
    if os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "0":
        # one process: the worker reads GRAPHTRACE_GUARD from this very environment
        os.environ["GRAPHTRACE_GUARD"] = "warn"
        attempt("warn_reload", "reload_weights", weights_path=changed_dir)
        out["status_warn"] = llm.collective_rpc("graphtrace_guard_status")
        os.environ["GRAPHTRACE_GUARD"] = "recapture"
        llm.collective_rpc("graphtrace_capture_dummy", kwargs={"label": "dummy_decode"})
        attempt("recapture_reload", "reload_weights", weights_path=model_dir)
        out["status_recapture"] = llm.collective_rpc("graphtrace_guard_status")
        attempt("after_recapture_reload", "reload_weights", weights_path=changed_dir)
        out["status_after_recapture"] = llm.collective_rpc("graphtrace_guard_status")
        out["rpc_status"] = llm.collective_rpc("graphtrace_status")
    print("GRAPHTRACE_RESULT " + json.dumps(out), flush=True)
    engine_core = getattr(llm.llm_engine, "engine_core", None)
    if hasattr(engine_core, "shutdown"):
        engine_core.shutdown()
    if backend == "ray":
        import ray

        ray.shutdown()


if __name__ == "__main__":
    main()
