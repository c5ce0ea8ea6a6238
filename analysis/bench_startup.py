"""Engine startup with tracing against without: vLLM's `LLM(...)` on the tiny fp32 Llama.

Three ways to start the same engine, each in a fresh Python process, run alternately (round
robin, the order rotating each round) so that a change in the machine's load falls on all
three alike:

* off: plain vLLM (the graphtrace plugin is installed but `GRAPHTRACE_VLLM` is unset);
* plugin: `GRAPHTRACE_VLLM=guard` (the worker plugin in guard mode: trace, owners, engine guard);
* trace_llm: `with graphtrace.vllm.trace_llm(guard="raise"): LLM(...)` in the process.

The time is the `LLM(...)` call as the child measures it (imports excluded: each child imports
vllm before starting the clock), then one short `generate` to show the engine serves. Printed:
median, min and max per way, and each way's median over off's, for three clocks: the wall
time of `LLM(...)`, the CPU time (user + sys, all threads) the child's process spent in it
(`time.process_time`), and the whole child's CPU time as its parent sees it
(`resource.getrusage(RUSAGE_CHILDREN)` around each run: imports and the generate included).
CPU time varies less than wall time on a shared machine. Goal (issue 26): at most 1.02x.

graphtrace's bytecode is compiled once before the runs (`compileall`), as installing a wheel
does: an editable install has none, and where `PYTHONDONTWRITEBYTECODE` is set (this project's
machines set it) Python would compile every graphtrace module from source again in every traced
child (~45 ms of a ~6 s startup), a cost no installed copy pays. vLLM's own modules were
compiled when pip installed them.

Every child runs with GRAPHTRACE_CLOCK=1 (Note [self clock] in graphtrace/clock.py): each
traced startup also accounts graphtrace's own time directly, section by section (exclusive
wall and CPU seconds of each graphtrace entry point that ran), printed per way as the median
over runs and as a fraction of that run's startup. Needs vLLM (`.venv-vllm`):

    PYTHONPATH=. .venv-vllm/bin/python analysis/bench_startup.py [--runs 5] [--out analysis/results/bench_startup.txt]
"""

from __future__ import annotations

import argparse
import compileall
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from _common import show

ROOT = Path(__file__).resolve().parent.parent
WAYS = ("off", "plugin", "trace_llm")

CHILD = r"""
import json, os, sys, time
from graphtrace import clock
from graphtrace.vllm import tiny
tiny.set_engine_env(sys.argv[2])
import vllm  # imported before the clock starts
way, model_dir = sys.argv[1], sys.argv[3]
t0, c0 = time.perf_counter(), time.process_time()
if way == "trace_llm":
    with clock.section("import graphtrace.vllm.adapter"):
        from graphtrace.vllm import trace_llm
    vt = trace_llm(guard="raise")
    vt.__enter__()
llm = vllm.LLM(**tiny.engine_kwargs(model_dir))
elapsed, cpu = time.perf_counter() - t0, time.process_time() - c0
own = clock.CLOCK.report() if clock.CLOCK is not None else None
out = llm.generate([{"prompt_token_ids": [1, 2, 3]}],
                   vllm.SamplingParams(max_tokens=2, temperature=0.0), use_tqdm=False)
print("GRAPHTRACE_STARTUP " + json.dumps({"way": way, "s": elapsed, "cpu": cpu, "own": own,
                                          "tokens": list(out[0].outputs[0].token_ids)}))
os._exit(0)
"""


def run_child(way: str, model_dir: str, cache: str) -> dict:
    env = dict(os.environ)
    env.pop("GRAPHTRACE_VLLM", None)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    env["GRAPHTRACE_CLOCK"] = "1"  # every way alike; off has nothing of graphtrace to time
    if way == "plugin":
        env["GRAPHTRACE_VLLM"] = "guard"
        env["GRAPHTRACE_VLLM_DIR"] = os.path.join(cache, "graphtrace-vllm")
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    proc = subprocess.run([sys.executable, "-c", CHILD, way, cache, model_dir], env=env,
                          capture_output=True, text=True, timeout=600)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("GRAPHTRACE_STARTUP ")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"{way}: rc={proc.returncode}\n{proc.stderr[-3000:]}")
    out = json.loads(lines[-1].split(" ", 1)[1])
    out["child_cpu"] = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=5, help="runs per way (default 5)")
    ap.add_argument("--out", type=Path, default=None, help="also write the table here")
    args = ap.parse_args(argv)
    if args.runs < 1:
        ap.error("--runs must be at least 1")
    from graphtrace.vllm import tiny

    # as a wheel install does (see the module's docstring); pyc files are checked against
    # their source's mtime, so an edited module is compiled again
    compiled = compileall.compile_dir(str(ROOT / "graphtrace"), quiet=1)
    load = os.getloadavg()[0]
    runs: dict[str, list[dict]] = {w: [] for w in WAYS}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = str(tiny.make_tiny_llama(Path(tmp) / "tiny", seed=0))
        cache = str(Path(tmp) / "cache")
        run_child("off", model_dir, cache)  # warms vLLM's compile cache and the OS page cache
        for r in range(args.runs):
            order = WAYS[r % 3:] + WAYS[:r % 3]
            for way in order:
                res = run_child(way, model_dir, cache)
                runs[way].append(res)
                own = res["own"]["wall_s"] if res.get("own") else 0.0
                print(f"round {r + 1}/{args.runs} {way}: {res['s']:.2f} s wall, {res['cpu']:.2f} s "
                      f"CPU, graphtrace's own {own:.3f} s", flush=True)
    load_end = os.getloadavg()[0]
    lines = ["# engine startup with and without graphtrace (analysis/bench_startup.py)",
             f"# python {platform.python_version()}, {os.cpu_count()} CPUs, load average "
             f"{load:.1f} at start, {load_end:.1f} at end (a shared machine); tiny fp32 Llama, "
             f"vLLM's LLM(...) in a fresh process per run, {args.runs} runs per way, alternating",
             f"# graphtrace's bytecode compiled before the runs, as a wheel install has it "
             f"({'ok' if compiled else 'FAILED'}; PYTHONDONTWRITEBYTECODE="
             f"{os.environ.get('PYTHONDONTWRITEBYTECODE', '')!r} here)"]
    medians = {}
    for key, title in (("s", "wall time of LLM(...)"),
                       ("cpu", "CPU time of LLM(...) (the child's user + sys, all threads)"),
                       ("child_cpu", "CPU time of the whole child (getrusage; imports and "
                                     "the generate included)")):
        base = statistics.median(r[key] for r in runs["off"])
        lines += ["", f"## {title}", "",
                  "| way | median s | min s | max s | median / off |", "|---|---|---|---|---|"]
        for way in WAYS:
            t = [r[key] for r in runs[way]]
            medians[key, way] = statistics.median(t) / base
            lines.append(f"| {way} | {statistics.median(t):.2f} | {min(t):.2f} | {max(t):.2f} | "
                         f"{medians[key, way]:.3f}x |")
    lines += ["", "## graphtrace's own time in each traced startup (Note [self clock])", "",
              "| way | own wall s: median (min-max) | % of the startup's wall | "
              "own CPU s: median (min-max) | % of the startup's CPU |", "|---|---|---|---|---|"]
    for way in WAYS[1:]:
        own_w = [r["own"]["wall_s"] for r in runs[way]]
        own_c = [r["own"]["cpu_s"] for r in runs[way]]
        pw = statistics.median(r["own"]["wall_s"] / r["s"] for r in runs[way])
        pc = statistics.median(r["own"]["cpu_s"] / r["cpu"] for r in runs[way])
        lines.append(f"| {way} | {statistics.median(own_w):.3f} ({min(own_w):.3f}-"
                     f"{max(own_w):.3f}) | {100 * pw:.1f}% | {statistics.median(own_c):.3f} "
                     f"({min(own_c):.3f}-{max(own_c):.3f}) | {100 * pc:.1f}% |")
    names = sorted({n for w in WAYS[1:] for r in runs[w] for n in r["own"]["sections"]})

    def med(way, name, field):
        return statistics.median(r["own"]["sections"].get(name, {}).get(field, 0)
                                 for r in runs[way])

    names.sort(key=lambda n: -max(med(w, n, "wall_s") for w in WAYS[1:]))
    lines += ["", "## breakdown: exclusive seconds per section, median over runs", "",
              "| section | " + " | ".join(f"{w} wall s | {w} CPU s | {w} calls" for w in WAYS[1:])
              + " |", "|---|" + "---|---|---|" * len(WAYS[1:])]
    for name in names:
        lines.append(f"| {name} | " + " | ".join(
            f"{med(w, name, 'wall_s'):.4f} | {med(w, name, 'cpu_s'):.4f} | "
            f"{med(w, name, 'calls'):.0f}" for w in WAYS[1:]) + " |")
    tokens = {w: tuple(r["tokens"]) for w in WAYS for r in runs[w][-1:]}
    worst = max(medians["s", w] for w in WAYS[1:])
    worst_cpu = max(medians["cpu", w] for w in WAYS[1:])
    lines += ["", f"same tokens from every way: {'yes' if len(set(tokens.values())) == 1 else 'NO'}",
              f"goal (issue 26: at most 1.02x off's median): wall {'met' if worst <= 1.02 else 'NOT met'}"
              f" ({worst:.3f}x), CPU {'met' if worst_cpu <= 1.02 else 'NOT met'} ({worst_cpu:.3f}x)"]
    show(lines, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
