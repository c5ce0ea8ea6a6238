"""Run by test_check_before_serve.py in a subprocess: the tiny fp32 Llama as a *pooling*
(embedding) model (``runner="pooling", convert="embed"``: vLLM 0.32 adapts the decoder with
``as_embedding_model``), guarded by the plugin (``GRAPHTRACE_VLLM=guard``). verl's update
(serve_ext) pushes a clean, a stale and a correct update; after each the prompts are embedded:
``async for out in engine.encode(...)`` of an ``AsyncLLM`` (CLIENT ``async``), or
``llm.embed(...)`` / ``llm.encode(...)`` of an ``LLM`` (``llm``: engine core in this process;
``llm_mp``: in a process of its own). Prints one JSON line.

usage: python pool_run.py MODEL_DIR CHANGED_DIR CLIENT   (CLIENT: async, llm; the test sets
  VLLM_ENABLE_V1_MULTIPROCESSING=1 for llm_mp)
"""

from __future__ import annotations

import asyncio
import json
import os
import sys

STEPS = [("clean", "copy", 1), ("stale", "rebind", 0), ("fixed", "copy", 1)]  # folder index


def summary(data) -> list[float]:
    """An embedding, compared across updates: its first values, rounded."""
    return [round(float(x), 4) for x in data.flatten()[:4]]


def kwargs(model_dir: str) -> dict:
    from graphtrace.vllm import tiny

    return tiny.engine_kwargs(model_dir, worker_extension_cls="serve_ext.ServeTestExtension",
                              tokenizer=True,  # LLM's pooling IO processors need one
                              runner="pooling", convert="embed")


async def run_async(model_dir: str, folders: list[str]) -> dict:
    from serve_ext import ASYNC_SYNCS, failure
    from vllm import PoolingParams
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    from graphtrace.vllm import tiny

    engine = AsyncLLM.from_engine_args(AsyncEngineArgs(**kwargs(model_dir)))
    counter = iter(range(10**6))

    async def one(prompt):
        data = None
        async for o in engine.encode({"prompt_token_ids": prompt}, PoolingParams(task="embed"),
                                     f"p{next(counter)}"):
            data = o.outputs.data
        if data is None or data.numel() == 0:  # a refused step the client did not raise
            raise RuntimeError(f"empty pooling output: {data!r}")
        return summary(data)

    async def embed() -> list[dict]:
        results = await asyncio.gather(*(one(p) for p in tiny.PROMPTS), return_exceptions=True)
        return [{"ok": True, "value": r} if not isinstance(r, BaseException) else failure(r)
                for r in results]

    async def rpc(method, **kw):
        return (await engine.collective_rpc(method, kwargs=kw or None))[0]

    out: dict = {"runner": engine.vllm_config.model_config.runner_type, "client_pid": os.getpid(),
                 "worker_pid": await rpc("graphtrace_test_pid")}
    out["holder"] = await rpc("graphtrace_test_inject")
    await rpc("graphtrace_capture", label="prefill")
    out["baseline"] = await embed()
    for step, kernel, i in STEPS:
        await rpc("graphtrace_test_mode", mode=kernel)
        before = (await rpc("graphtrace_guard_status"))["checks"]
        s: dict = {}
        try:
            s["sync"] = {"ok": True, "value": await ASYNC_SYNCS["verl"](engine, folders[i])}
        except Exception as exc:
            s["sync"] = failure(exc)
        s["after_sync"] = await rpc("graphtrace_guard_status")
        s["embed"] = await embed()
        s["after_embed"] = await rpc("graphtrace_guard_status")
        s["checks"] = s["after_embed"]["checks"] - before
        s["errored"] = engine.errored
        s["holder_is_captured"] = await rpc("graphtrace_test_holder_is_captured")
        out[step] = s
    out["errored"] = engine.errored
    engine.shutdown()
    return out


def run_llm(model_dir: str, folders: list[str]) -> dict:
    from serve_ext import SYNCS, failure
    from vllm import LLM, PoolingParams

    from graphtrace.vllm import tiny

    llm = LLM(**kwargs(model_dir))
    prompts = [{"prompt_token_ids": p} for p in tiny.PROMPTS]

    def embed():
        return [[round(x, 4) for x in o.outputs.embedding[:4]]
                for o in llm.embed(prompts, use_tqdm=False)]

    def encode():
        return [summary(o.outputs.data) for o in
                llm.encode(prompts, pooling_task="embed", use_tqdm=False,
                           pooling_params=PoolingParams())]

    def attempt(fn, *args):
        try:
            return {"ok": True, "value": fn(*args)}
        except Exception as exc:
            return failure(exc)

    def rpc(method, **kw):
        return llm.collective_rpc(method, kwargs=kw or None)[0]

    out: dict = {"runner": llm.llm_engine.vllm_config.model_config.runner_type,
                 "client_pid": os.getpid(), "worker_pid": rpc("graphtrace_test_pid")}
    out["holder"] = rpc("graphtrace_test_inject")
    rpc("graphtrace_capture", label="prefill")
    out["baseline"] = attempt(embed)
    for step, kernel, i in STEPS:
        rpc("graphtrace_test_mode", mode=kernel)
        before = rpc("graphtrace_guard_status")["checks"]
        s = {"sync": attempt(SYNCS["verl"], llm, folders[i])}
        s["after_sync"] = rpc("graphtrace_guard_status")
        s["embed"] = attempt(embed)
        s["encode"] = attempt(encode)
        s["after_embed"] = rpc("graphtrace_guard_status")
        s["checks"] = s["after_embed"]["checks"] - before
        s["holder_is_captured"] = rpc("graphtrace_test_holder_is_captured")
        out[step] = s
    engine_core = getattr(llm.llm_engine, "engine_core", None)
    if hasattr(engine_core, "shutdown"):
        engine_core.shutdown()
    return out


def main() -> None:
    model_dir, changed_dir, client = sys.argv[1:4]
    folders = [model_dir, changed_dir]
    if client == "async":
        out = asyncio.run(run_async(model_dir, folders))
    else:
        out = run_llm(model_dir, folders)
    out["client"] = client
    print("GRAPHTRACE_RESULT " + json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
