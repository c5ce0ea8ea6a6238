"""Run by test_check_before_serve.py in a subprocess: vLLM 0.32's weight-transfer session
(``LLM.start_weight_update`` .. chunks .. ``finish_weight_update``, each a ``collective_rpc`` to
the real ``Worker`` methods) on the tiny fp32 Llama built with ``weight_transfer_config=
{"backend": "ipc"}`` (the real ``IPCWeightTransferEngine``), guarded by the plugin
(``GRAPHTRACE_VLLM=guard``), the engine core in this process or (``VLLM_ENABLE_V1_
MULTIPROCESSING=1``) in its own. Prints one JSON line.

No weight-transfer backend of vLLM 0.32 moves tensors on CPU (test_check_before_serve.py,
`test_weight_transfer_session`); what runs here: ``init_weight_transfer_engine``,
``start_weight_update`` (``initialize_layerwise_reload``), each chunk's
``model.load_weights`` as ``receive_weights`` calls it (serve_ext `graphtrace_test_receive`),
``finish_weight_update`` (``finalize_layerwise_reload``), and one real ``update_weights``,
which fails where it needs the GPU.

usage: python xfer_run.py MODEL_DIR CHANGED_DIR
"""

from __future__ import annotations

import json
import sys

STEPS = [("clean", "copy", 1), ("stale", "rebind", 0), ("fixed", "copy", 1)]  # folder index


def main() -> None:
    model_dir, changed_dir = sys.argv[1:3]
    folders = [model_dir, changed_dir]
    from serve_ext import _checkpoint, failure
    from vllm import LLM, SamplingParams

    from graphtrace.vllm import tiny

    llm = LLM(**tiny.engine_kwargs(model_dir, worker_extension_cls="serve_ext.ServeTestExtension",
                                   weight_transfer_config={"backend": "ipc"}))
    sp = SamplingParams(max_tokens=3, temperature=0.0, detokenize=False, ignore_eos=True)

    def gen():
        outs = llm.generate([{"prompt_token_ids": p} for p in tiny.PROMPTS], sp, use_tqdm=False)
        if any(o.outputs[0].finish_reason == "error" for o in outs):
            raise RuntimeError("finish_reason error")
        return [list(o.outputs[0].token_ids) for o in outs]

    def attempt(fn, *args):
        try:
            return {"ok": True, "value": fn(*args)}
        except Exception as exc:
            return failure(exc)

    def rpc(method, **kw):
        return llm.collective_rpc(method, kwargs=kw or None)[0]

    def status():
        return rpc("graphtrace_guard_status")

    out: dict = {"transfer": rpc("graphtrace_test_transfer")}
    out["holder"] = rpc("graphtrace_test_inject")
    rpc("graphtrace_test_session_derive")
    rpc("graphtrace_capture", label="decode", skip=1)
    out["baseline"] = gen()
    out["init"] = attempt(llm.init_weight_transfer_engine, {"init_info": {"packed": False}})
    names = list(_checkpoint(model_dir))  # the tensors a CPU engine takes (serve_ext)
    chunks = [names[i:i + 4] for i in range(0, len(names), 4)]
    for step, kernel, i in STEPS:
        rpc("graphtrace_test_mode", mode=kernel)
        before = status()["checks"]
        s = {"start": attempt(llm.start_weight_update), "inside": []}
        for chunk in chunks:
            n = rpc("graphtrace_test_receive", names=chunk, folder=folders[i])
            st = status()
            s["inside"].append({"loaded": n, "checks": st["checks"] - before, "dirty": st["dirty"],
                                "active": rpc("graphtrace_test_transfer")["active"]})
        s["finish"] = attempt(llm.finish_weight_update)
        s["after_finish"] = status()
        s["generate"] = attempt(gen)
        s["after_generate"] = status()
        s["checks"] = s["after_generate"]["checks"] - before
        if step == "stale":  # still refused: dirty until a correct update passes
            s["generate_again"] = attempt(gen)
        s["holder_is_captured"] = rpc("graphtrace_test_holder_is_captured")
        out[step] = s
    # vLLM's own chunk call: on CPU it fails in the IPC engine's transport and vLLM ends its
    # session; a later load_weights is then an update of its own
    chunk = chunks[0]
    tensors = _checkpoint(model_dir)
    info = {"names": chunk, "dtype_names": [str(tensors[n].dtype).split(".")[-1] for n in chunk],
            "shapes": [list(tensors[n].shape) for n in chunk],
            "ipc_handles": [{"no-gpu": []} for _ in chunk]}
    before = status()["checks"]
    r = {"start": attempt(llm.start_weight_update),
         "update": attempt(llm.update_weights, {"update_info": info}),
         "transfer": rpc("graphtrace_test_transfer")}
    r["finish"] = attempt(llm.finish_weight_update)
    r["load"] = attempt(lambda: rpc("update_weight", name="model.norm.weight", folder=changed_dir))
    r["after_load"] = status()
    r["generate"] = attempt(gen)
    r["after_generate"] = status()
    r["checks"] = r["after_generate"]["checks"] - before
    out["aborted"] = r
    print("GRAPHTRACE_RESULT " + json.dumps(out), flush=True)
    engine_core = getattr(llm.llm_engine, "engine_core", None)
    if hasattr(engine_core, "shutdown"):
        engine_core.shutdown()


if __name__ == "__main__":
    main()
