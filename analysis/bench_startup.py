"""Engine startup with tracing against without: vLLM's `LLM(...)` on the tiny fp32 Llama.

Three ways to start the same engine, each in a fresh Python process, run alternately (round
robin, the order rotating each round) so that a change in the machine's load falls on all
three alike:

* off: plain vLLM (the graphtrace plugin is installed but `GRAPHTRACE_VLLM` is unset);
* plugin: `GRAPHTRACE_VLLM=guard` (the worker plugin in guard mode: trace, owners, engine guard);
* trace_llm: `with graphtrace.vllm.trace_llm(guard="raise"): LLM(...)` in the process.

The time is the `LLM(...)` call as the child measures it (imports excluded: each child imports
vllm before starting the clock), then one short `generate` to show the engine serves. Printed:
median, min and max per way, and each way's median over off's. Goal (issue 26): at most 1.02x.
Needs vLLM (`.venv-vllm`):

    PYTHONPATH=. .venv-vllm/bin/python analysis/bench_startup.py [--runs 5] [--out analysis/results/bench_startup.txt]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from _common import write_results

ROOT = Path(__file__).resolve().parent.parent
WAYS = ("off", "plugin", "trace_llm")

CHILD = r"""
import json, os, sys, time
from graphtrace.vllm import tiny
tiny.set_engine_env(sys.argv[2])
import vllm  # imported before the clock starts
way, model_dir = sys.argv[1], sys.argv[3]
t0 = time.perf_counter()
if way == "trace_llm":
    from graphtrace.vllm import trace_llm
    vt = trace_llm(guard="raise")
    vt.__enter__()
llm = vllm.LLM(**tiny.engine_kwargs(model_dir))
elapsed = time.perf_counter() - t0
out = llm.generate([{"prompt_token_ids": [1, 2, 3]}],
                   vllm.SamplingParams(max_tokens=2, temperature=0.0), use_tqdm=False)
print("GRAPHTRACE_STARTUP " + json.dumps({"way": way, "s": elapsed,
                                          "tokens": list(out[0].outputs[0].token_ids)}))
os._exit(0)
"""


def run_child(way: str, model_dir: str, cache: str) -> dict:
    env = dict(os.environ)
    env.pop("GRAPHTRACE_VLLM", None)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    if way == "plugin":
        env["GRAPHTRACE_VLLM"] = "guard"
        env["GRAPHTRACE_VLLM_DIR"] = os.path.join(cache, "graphtrace-vllm")
    proc = subprocess.run([sys.executable, "-c", CHILD, way, cache, model_dir], env=env,
                          capture_output=True, text=True, timeout=600)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("GRAPHTRACE_STARTUP ")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"{way}: rc={proc.returncode}\n{proc.stderr[-3000:]}")
    return json.loads(lines[-1].split(" ", 1)[1])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=5, help="runs per way (default 5)")
    ap.add_argument("--out", type=Path, default=None, help="also write the table here")
    args = ap.parse_args(argv)
    if args.runs < 1:
        ap.error("--runs must be at least 1")
    from graphtrace.vllm import tiny

    load = os.getloadavg()[0]
    times: dict[str, list[float]] = {w: [] for w in WAYS}
    tokens = {}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = str(tiny.make_tiny_llama(Path(tmp) / "tiny", seed=0))
        cache = str(Path(tmp) / "cache")
        run_child("off", model_dir, cache)  # warms vLLM's compile cache and the OS page cache
        for r in range(args.runs):
            order = WAYS[r % 3:] + WAYS[:r % 3]
            for way in order:
                res = run_child(way, model_dir, cache)
                times[way].append(res["s"])
                tokens[way] = res["tokens"]
                print(f"round {r + 1}/{args.runs} {way}: {res['s']:.2f} s", flush=True)
    base = statistics.median(times["off"])
    lines = ["# engine startup with and without graphtrace (analysis/bench_startup.py)",
             f"# python {platform.python_version()}, {os.cpu_count()} CPUs, load average at "
             f"start {load:.1f} (a shared machine); tiny fp32 Llama, vLLM's LLM(...) in a fresh "
             f"process per run, {args.runs} runs per way, alternating",
             "", "| way | median s | min s | max s | median / off |", "|---|---|---|---|---|"]
    for way in WAYS:
        t = times[way]
        lines.append(f"| {way} | {statistics.median(t):.2f} | {min(t):.2f} | {max(t):.2f} | "
                     f"{statistics.median(t) / base:.3f}x |")
    worst = max(statistics.median(times[w]) / base for w in WAYS[1:])
    lines += ["", f"same tokens from every way: {'yes' if len(set(map(tuple, tokens.values()))) == 1 else 'NO'}",
              f"goal (issue 26: at most 1.02x off's median): {'met' if worst <= 1.02 else 'NOT met'}"
              f" ({worst:.3f}x)"]
    text = "\n".join(lines)
    print(text)
    if args.out:
        write_results(args.out, text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
