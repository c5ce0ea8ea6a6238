"""Run by test_plugin.py in a subprocess: a real vLLM with multiprocessing ON and the
graphtrace plugin enabled through the environment; prints one JSON line with what it saw.

usage: python plugin_run.py MODEL_DIR CHANGED_DIR OUT_DIR
"""

from __future__ import annotations

import json
import os
import sys


def main() -> None:
    model_dir, changed_dir, out_dir = sys.argv[1:4]
    from vllm import LLM, SamplingParams

    from graphtrace.vllm import tiny

    llm = LLM(**tiny.engine_kwargs(model_dir))
    sp = SamplingParams(max_tokens=3, temperature=0.0, detokenize=False, ignore_eos=True)

    def gen():
        outs = llm.generate([{"prompt_token_ids": p} for p in tiny.PROMPTS], sp, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]

    status = llm.collective_rpc("graphtrace_status")
    llm.collective_rpc("graphtrace_capture", kwargs={"label": "decode", "skip": 1})  # arm
    before = gen()
    llm.collective_rpc("graphtrace_capture_dummy", kwargs={"label": "dummy_decode"})
    # A weights iterator does not survive the trip to the engine core process; a path does.
    llm.collective_rpc("reload_weights", kwargs={"weights_path": changed_dir})
    after = gen()
    paths = llm.collective_rpc("graphtrace_write_report", kwargs={"tag": "after_reload"})
    print("GRAPHTRACE_RESULT " + json.dumps({
        "main_pid": os.getpid(), "status": status, "paths": paths,
        "changed": before != after}), flush=True)
    llm.llm_engine.engine_core.shutdown()  # the worker writes <out>/shutdown/rank0 here


if __name__ == "__main__":
    main()
