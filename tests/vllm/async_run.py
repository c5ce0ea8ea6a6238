"""Run by test_check_before_serve.py in a subprocess: vLLM's ``AsyncLLM`` (what ``vllm serve``
and async RL rollouts use; its engine core always runs in a process of its own) on the tiny
fp32 Llama, guarded by the plugin (``GRAPHTRACE_VLLM=guard``). Each client path of
serve_ext.ASYNC_SYNCS pushes a clean update, a stale one and a correct one through
``await engine.collective_rpc(...)``; after each, several requests are generated
concurrently (``async for out in engine.generate(...)``). Prints one JSON line.

usage: python async_run.py MODEL_DIR CHANGED_DIR PATHS BACKEND
  BACKEND: default (vLLM's choice on CPU: the multiprocessing executor, the worker in a
  process of its own) or uni (the worker in the engine core's process)
"""

from __future__ import annotations

import asyncio
import json
import os
import sys


async def run(model_dir: str, changed_dir: str, paths: str, backend: str) -> dict:
    from serve_ext import ASYNC_SYNCS, failure
    from vllm import SamplingParams
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    from graphtrace.vllm import tiny

    kw = tiny.engine_kwargs(model_dir, worker_extension_cls="serve_ext.ServeTestExtension")
    if backend != "default":
        kw["distributed_executor_backend"] = backend
    engine = AsyncLLM.from_engine_args(AsyncEngineArgs(**kw))
    sp = SamplingParams(max_tokens=3, temperature=0.0, detokenize=False, ignore_eos=True)
    counter = iter(range(10**6))
    out: dict = {"paths": {}, "executor": None}

    async def one(prompt):
        tokens, reasons = [], []
        async for o in engine.generate({"prompt_token_ids": prompt}, sp, f"r{next(counter)}"):
            tokens = list(o.outputs[0].token_ids)
            reasons.append(o.outputs[0].finish_reason)
        if "error" in reasons:  # a refused step the client did not raise (the old client side)
            raise RuntimeError(f"finish_reason error: {reasons}")
        return tokens

    async def gen() -> list[dict]:
        """One request per prompt, all at once: each one's own result."""
        results = await asyncio.gather(*(one(p) for p in tiny.PROMPTS), return_exceptions=True)
        return [{"ok": True, "value": r} if not isinstance(r, BaseException) else failure(r)
                for r in results]

    async def attempt(fn, *args):
        try:
            return {"ok": True, "value": await fn(*args)}
        except Exception as exc:
            return failure(exc)

    async def status():
        return (await engine.collective_rpc("graphtrace_guard_status"))[0]

    out["executor"] = str(engine.vllm_config.parallel_config.distributed_executor_backend)
    out["client_pid"] = os.getpid()
    out["worker_pids"] = await engine.collective_rpc("graphtrace_test_pid")
    out["holder"] = (await engine.collective_rpc("graphtrace_test_inject"))[0]
    await engine.collective_rpc("graphtrace_capture", kwargs={"label": "decode", "skip": 1})
    out["baseline"] = await gen()
    for path in paths.split(","):
        sync = ASYNC_SYNCS[path]
        r: dict = {}
        steps = [("clean", "copy", changed_dir), ("stale", "rebind", model_dir),
                 ("fixed", "copy", changed_dir)]
        for step, kernel, folder in steps:
            await engine.collective_rpc("graphtrace_test_mode", kwargs={"mode": kernel})
            before = (await status())["checks"]
            s = {"sync": await attempt(sync, engine, folder)}
            s["after_sync"] = await status()
            s["generate"] = await gen()
            s["after_generate"] = await status()
            s["checks"] = s["after_generate"]["checks"] - before
            s["errored"] = engine.errored  # the engine is alive
            if step == "stale":  # still refused: dirty until a correct update passes
                s["generate_again"] = await gen()
            s["holder_is_captured"] = (
                await engine.collective_rpc("graphtrace_test_holder_is_captured"))[0]
            r[step] = s
        out["paths"][path] = r
    out["final"] = await gen()
    out["errored"] = engine.errored
    engine.shutdown()
    return out


def main() -> None:
    out = asyncio.run(run(*sys.argv[1:5]))
    print("GRAPHTRACE_RESULT " + json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
