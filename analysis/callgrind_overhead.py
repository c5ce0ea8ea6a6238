"""Capture overhead counted in instructions (valgrind's callgrind), not timed.

Issue 39's overhead goals compare graphtrace's added cost per capture with the no-op
`TorchDispatchMode`'s on a LayerNorm/GELU workload (`bench_overhead.py --workload script`'s:
40 blocks of Linear(64)+GELU+LayerNorm, batch 4, ten forwards per capture). Timed, on this
project's shared 2-core machine, those ratios move by more than the gaps being judged; the
instructions a capture executes do not depend on the load. So this script runs the workload
once under `valgrind --tool=callgrind --instr-atstart=no`: everything outside the measured
regions (imports, model building, a warm-up round of every recorder) runs uninstrumented,
and each region is bracketed by callgrind's client requests (start instrumentation and zero
the counters; dump them under the region's name and stop), issued from a few lines of C
built here with the system compiler and called through ctypes. Each dump's total is the
instructions (Ir) of its region; the ratios are the benchmarks':

    added(X) = Ir(X) - Ir(no mode);  ratio = added(X) / added(no-op TorchDispatchMode)

Regions, per recorder, one per capture (the first capture of a trace is counted apart: it
walks the model for owners): the baseline forward, the no-op mode, a capture inside an open
trace (`emulate=False` / `True`, module attribution by forward wrappers, and with
`modules="off"`), and the short script (trace entered, one capture, trace closed) phase by
phase. Instructions are not time (cache misses, branch mispredictions and memory stalls
are not in them), but they are repeatable: they show what graphtrace's own code runs.

    python analysis/callgrind_overhead.py [--out analysis/results/callgrind_overhead.txt]
    python analysis/callgrind_overhead.py --quick     # tiny workload, prints only (tests)

Needs `valgrind` on PATH and a C compiler (`cc`) with valgrind's headers (Debian:
`valgrind`, which ships <valgrind/callgrind.h>).
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results" / "callgrind_overhead.txt"

MARKER_C = r"""
#include <valgrind/callgrind.h>
void gt_region_start(void) { CALLGRIND_START_INSTRUMENTATION; CALLGRIND_ZERO_STATS; }
void gt_region_stop(const char* name) {
  CALLGRIND_DUMP_STATS_AT(name);
  CALLGRIND_STOP_INSTRUMENTATION;
}
"""

# goals of issues 27 and 39: a capture inside an open trace, as a multiple of the no-op mode's
GOALS = {False: 1.0, True: 1.5}


def build_marker(folder: Path) -> Path:
    """The region markers (MARKER_C) as a shared library in `folder`."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise SystemExit("callgrind_overhead: no C compiler (cc) on PATH")
    src, lib = folder / "marker.c", folder / "marker.so"
    src.write_text(MARKER_C)
    subprocess.run([cc, "-O1", "-shared", "-fPIC", "-o", str(lib), str(src)], check=True)
    return lib


# --------------------------------------------------------------------------- the child

def child(args) -> int:
    """Runs under callgrind: every recorder warmed up uninstrumented, then its regions."""
    import torch
    from bench_overhead import LnGelu, NoOpMode

    import graphtrace as gt

    marker = ctypes.CDLL(args.marker)
    marker.gt_region_stop.argtypes = [ctypes.c_char_p]
    torch.manual_seed(0)
    torch.set_num_threads(1)
    torch.set_grad_enabled(False)
    model = LnGelu(args.blocks, 64, forwards=args.forwards).eval()
    inputs = [torch.randn(4, 64) for _ in range(args.captures)]

    def region(name: str, fn):
        gc.collect()
        marker.gt_region_start()
        out = fn()
        marker.gt_region_stop(name.encode())
        return out

    def plain(x):
        return model(x)

    def noop(x):
        with NoOpMode():
            return model(x)

    def open_trace(emulate: bool, modules: str, measure: bool) -> int:
        trace = gt.trace(model, modules=modules)
        trace.__enter__()
        try:
            for k, x in enumerate(inputs):
                def one(x=x, k=k):
                    with gt.capture(f"cap{k}", emulate=emulate) as g:
                        model(x)
                    return g
                g = region(f"trace emulate={emulate} modules={modules} capture {k}", one) \
                    if measure else one()
                del g
        finally:
            trace.__exit__(None, None, None)
        return trace.captures[-1].n_ops

    def script(emulate: bool, measure: bool) -> None:
        def run(name, fn):
            return region(f"script emulate={emulate} {name}", fn) if measure else fn()
        trace = gt.trace(model)
        run("enter", trace.__enter__)

        def one():
            with gt.capture("script", emulate=emulate) as g:
                model(inputs[0])
            return g
        g = run("capture", one)
        run("exit", lambda: trace.__exit__(None, None, None))
        del g

    n_ops = 0
    for measure in (False, True):  # a warm-up round of everything first, uninstrumented
        for k, x in enumerate(inputs):
            region(f"baseline capture {k}", lambda x=x: plain(x)) if measure else plain(x)
            region(f"noop capture {k}", lambda x=x: noop(x)) if measure else noop(x)
        for emulate in (False, True):
            for modules in ("forward", "off"):
                n_ops = open_trace(emulate, modules, measure)
            script(emulate, measure)
    print(f"ops per capture: {n_ops}", flush=True)
    return 0


# --------------------------------------------------------------------------- the parent

def read_dumps(folder: Path) -> dict[str, int]:
    """{region name: instructions} from callgrind's dump files in `folder`."""
    counts: dict[str, int] = {}
    for f in sorted(folder.glob("callgrind.out.*")):
        text = f.read_text(errors="replace")
        name = re.search(r"^desc: Trigger: Client Request: (.*)$", text, re.M)
        total = re.search(r"^(?:summary|totals): (\d+)", text, re.M)
        if name and total:
            counts[name.group(1).strip()] = int(total.group(1))
    return counts


def report(counts: dict[str, int], n_ops: int, captures: int, say) -> None:
    """The tables and ratio lines from the regions' counts."""
    def per_capture(prefix: str, first: int = 0) -> float:
        ks = range(first, captures)
        return sum(counts[f"{prefix} capture {k}"] for k in ks) / max(len(ks), 1)

    base, noop = per_capture("baseline"), per_capture("noop")
    floor = noop - base
    say(f"no mode: {base / 1e6:.2f}M instructions per capture; no-op TorchDispatchMode adds "
        f"{floor / 1e6:.2f}M ({floor / max(n_ops, 1):,.0f} per op)")
    say()
    say("| capture inside an open trace | first capture: added / no-op | later captures: "
        "added / no-op | all captures: added / no-op | added per op |")
    say("|---|---|---|---|---|")
    ratios = {}
    for emulate in (False, True):
        for modules in ("forward", "off"):
            prefix = f"trace emulate={emulate} modules={modules}"
            first = counts[f"{prefix} capture 0"] - base
            later = per_capture(prefix, 1) - base if captures > 1 else float("nan")
            every = per_capture(prefix) - base
            ratios[(emulate, modules)] = every / floor
            say(f"| emulate={emulate}, modules={modules!r} | {first / floor:.3f}x | "
                f"{later / floor:.3f}x | {every / floor:.3f}x | {every / max(n_ops, 1):,.0f} |")
    say()
    for emulate in (False, True):
        enter, capture, exit_ = (counts[f"script emulate={emulate} {p}"]
                                 for p in ("enter", "capture", "exit"))
        whole = enter + capture + exit_ - base
        say(f"script (trace entered, one capture, trace closed), emulate={emulate}: "
            f"{whole / floor:.3f}x the no-op mode's added instructions; trace enter "
            f"{enter / 1e6:.2f}M ({enter / floor:.3f}x), the capture {(capture - base) / floor:.3f}x, "
            f"trace exit {exit_ / 1e6:.2f}M ({exit_ / floor:.3f}x)")
    say()
    for emulate in (False, True):  # judged as bench_overhead.py does: every capture of a trace
        r = ratios[(emulate, "forward")]
        say(f"goal: a capture inside an open trace, emulate={emulate}, added instructions "
            f"<= {GOALS[emulate]}x the no-op mode's (all {captures} captures of the trace, as "
            f"bench_overhead.py times them): {r:.3f}x -> "
            f"{'met' if r <= GOALS[emulate] else 'NOT met'}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="tiny workload (tests): prints only")
    ap.add_argument("--blocks", type=int, default=None, help="Linear+GELU+LayerNorm blocks (40)")
    ap.add_argument("--forwards", type=int, default=None, help="forwards per capture (10)")
    ap.add_argument("--captures", type=int, default=None, help="captures per trace (8, as "
                    "bench_overhead.py --workload script --captures 8)")
    ap.add_argument("--out", type=Path, default=None,
                    help=f"also write the results here (default {RESULTS}; --quick: nowhere)")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--marker", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    args.blocks = args.blocks or (2 if args.quick else 40)
    args.forwards = args.forwards or (1 if args.quick else 10)
    args.captures = args.captures or (2 if args.quick else 8)
    if args.child:
        return child(args)

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from _common import Results, revision

    valgrind = shutil.which("valgrind")
    if valgrind is None:
        print("callgrind_overhead: valgrind is not on PATH (apt-get install valgrind)",
              file=sys.stderr)
        return 2
    version = subprocess.run([valgrind, "--version"], capture_output=True, text=True).stdout
    out_path = args.out if args.out is not None else (None if args.quick else RESULTS)
    results = Results()
    say = results.say
    with tempfile.TemporaryDirectory(prefix="gt-callgrind-") as tmp:
        folder = Path(tmp)
        marker = build_marker(folder)
        env = dict(os.environ, PYTHONHASHSEED="0", OMP_NUM_THREADS="1")
        cmd = [valgrind, "--tool=callgrind", "--instr-atstart=no",
               f"--callgrind-out-file={folder}/callgrind.out.%p", sys.executable,
               str(Path(__file__).resolve()), "--child", "--marker", str(marker),
               "--blocks", str(args.blocks), "--forwards", str(args.forwards),
               "--captures", str(args.captures)]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            print(proc.stdout[-3000:], proc.stderr[-3000:], sep="\n", file=sys.stderr)
            return 1
        found = re.search(r"ops per capture: (\d+)", proc.stdout)
        n_ops = int(found.group(1)) if found else 0
        counts = read_dumps(folder)
    import torch

    import graphtrace as gt

    say(f"# graphtrace capture overhead in instructions (analysis/callgrind_overhead.py"
        f"{' --quick' if args.quick else ''})")
    say(f"graphtrace {gt.__version__} at {revision()}; torch {torch.__version__}, Python "
        f"{platform.python_version()}, {platform.machine()}; {version.strip()} "
        f"(callgrind, instructions executed: Ir), torch threads 1, PYTHONHASHSEED=0; load "
        f"average {os.getloadavg()[0]:.1f} (counts do not depend on it)")
    say(f"workload: {args.blocks} blocks of Linear(64)+GELU+LayerNorm, batch 4, "
        f"{args.forwards} forwards per capture, {args.captures} captures per trace, "
        f"{n_ops:,} ops per capture; every recorder warmed up once, uninstrumented, first; "
        f"ratio = (Ir(recorder) - Ir(no mode)) / (Ir(no-op mode) - Ir(no mode)) per capture")
    say()
    report(counts, n_ops, args.captures, say)
    results.write(out_path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
