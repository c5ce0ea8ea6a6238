#!/usr/bin/env python3
"""GPU check (issue 8): run the GPU tests (`pytest -m cuda tests/gpu`) and write a readable
results file.

The checks are pytest tests under tests/gpu (see tests/gpu/conftest.py): env info, every
demo variant on real CUDA graphs with verdicts equal to the emulated reference, the stale
read on real replay, and pointer-argument coverage of real graphs' kernel nodes (eager and
torch.compile'd; graphtrace.cuda_nodes reads them). Before them, a preflight imports every
module the checks use and builds the native recorder with this machine's compiler (the
Python writer where that fails, said in the results). Then one pytest process runs the checks
inside what is left of the overall time limit, and OUT/gpu_check_TAG.txt is written: the
environment, each test's outcome and time, and the lines (key figures) it printed; plus
gpu_check_TAG.json (the same, machine-readable), gpu_check_TAG.log (pytest's output) and
gpu_coverage_{kernels,pointers}_TAG.csv. TAG names the GPU, its driver, torch and CUDA
(`results_tag`), so results from different machines never overwrite each other.

  python analysis/gpu_check.py               # CUDA machine: OUT=analysis/results
  python analysis/gpu_check.py --dry         # any machine: imports and builds, GPU tests skip
  python analysis/gpu_check.py --out DIR     # where the results go (--dry writes only with --out)
  python analysis/gpu_check.py -k stale_read # pytest's -k, passed through

It needs only what the lent GPU image has (python3 with torch, triton, transformers, pandas,
networkx, numpy, pytest; a C++ compiler) and the checkout: no install, no network (the exact
command for that machine is in docs/gpu.md).

Exit status: 0 when pytest ran to the end and no test failed (skips are not failures),
1 otherwise, 2 on bad options.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import pkgutil
import platform
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TESTS = REPO / "tests" / "gpu"
DEFAULT_TIMEOUT_S = 450.0  # the whole run, preflight included: under the lent machine's 8 min
NATIVE_BUILD_TIMEOUT_S = 240.0


def cuda_available() -> bool:
    try:
        import torch

        return bool(torch.cuda.is_available())
    except Exception:  # noqa: BLE001
        return False


def env_lines(cuda: bool) -> list[str]:
    """What the results file says about this machine before any test runs."""
    lines = [f"python {platform.python_version()} on {platform.machine()} ({platform.system()})"]
    try:
        import torch

        lines.append(f"torch {torch.__version__} (CUDA build {torch.version.cuda}); "
                     f"CUDA available: {cuda}")
        if cuda:
            lines.append(f"device: {torch.cuda.get_device_name(0)}")
    except Exception as exc:  # noqa: BLE001
        lines.append(f"torch: not importable ({type(exc).__name__}: {exc})")
    return lines


def driver_version() -> str | None:
    """The NVIDIA driver's version (nvidia-smi), or None where there is none."""
    try:
        proc = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    lines = proc.stdout.strip().splitlines()
    return lines[0].strip() if proc.returncode == 0 and lines else None


def results_tag(cuda: bool) -> str:
    """GPU, driver, torch and CUDA in one file-name-safe word (letters, digits, '.', '_', '-':
    the lent machine's tool brings back no other names)."""
    gpu, driver, torch_version, cuda_version = "no-GPU", "none", "none", "none"
    try:
        import torch

        torch_version, cuda_version = torch.__version__, torch.version.cuda or "cpu"
        if cuda:
            gpu, driver = torch.cuda.get_device_name(0), driver_version() or "unknown"
    except Exception:  # noqa: BLE001 - torch missing: the tag says so
        pass
    raw = f"{gpu}_driver-{driver}_torch-{torch_version}_cuda-{cuda_version}"
    return re.sub(r"[^A-Za-z0-9._-]+", "-", raw)


def check_modules() -> list[str]:
    """Every module the GPU checks import: graphtrace's (vLLM's adapter aside: the checks do
    not use it, and it needs vLLM) and tests/gpu's own."""
    import graphtrace

    names = [m.name for m in pkgutil.walk_packages(graphtrace.__path__, "graphtrace.")
             if not m.name.startswith("graphtrace.vllm") and not m.name.endswith("__main__")]
    names += ["tests.gpu.checks", "tests.gpu.conftest"]
    names += [f"tests.gpu.{p.stem}" for p in sorted(TESTS.glob("test_*.py"))]
    return names


def import_problems() -> tuple[int, list[str]]:
    """(modules imported, one line per module that failed to import)."""
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))
    try:
        names = check_modules()
    except Exception as exc:  # noqa: BLE001 - graphtrace itself does not import
        return 0, [f"graphtrace: {type(exc).__name__}: {exc}"]
    problems = []
    for name in names:
        try:
            importlib.import_module(name)
        except Exception as exc:  # noqa: BLE001 - said in the results, the run goes on
            problems.append(f"{name}: {type(exc).__name__}: {exc}")
    return len(names), problems


def build_recorder(timeout: float) -> tuple[bool, str]:
    """Build (or find built) the native recorder with this machine's compiler, in a process
    of its own: (built, what the results file says)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(REPO), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep))
    env.pop("GRAPHTRACE_NATIVE", None)
    t0 = time.perf_counter()
    try:
        proc = subprocess.run([sys.executable, "-m", "graphtrace.native"], cwd=REPO, env=env,
                              capture_output=True, text=True, errors="replace", timeout=timeout)
    except subprocess.TimeoutExpired:
        return False, (f"Python writer: the native recorder's build ran past {timeout:.0f} s "
                       "(GRAPHTRACE_NATIVE=0 for the checks)")
    seconds = time.perf_counter() - t0
    if proc.returncode == 0:
        return True, f"native, built or found in {seconds:.0f} s ({proc.stdout.strip()})"
    why = (proc.stderr.strip().splitlines() or ["no output"])[-1]
    return False, (f"Python writer: the native recorder did not build here ({why}); "
                   "GRAPHTRACE_NATIVE=0 for the checks")


def short_name(nodeid: str) -> str:
    """tests/gpu/test_demo_cuda.py::test_x[v] -> test_demo_cuda::test_x[v]."""
    path, _, rest = nodeid.partition("::")
    return f"{Path(path).stem}::{rest}" if rest else nodeid


def format_block(meta: dict, tests: list[dict]) -> list[str]:
    """The results file: a header, env, one block per test, a summary line."""
    lines = [f"== graphtrace GPU check ({meta['mode']}) ==",
             f"started {meta['started']}; pytest exit status {meta['pytest_rc']}"]
    lines += [f"env: {ln}" for ln in meta.get("env", [])]
    if "recorder" in meta:
        lines.append(f"recorder: {meta['recorder']}")
    problems = meta.get("import_problems", [])
    if "imported" in meta:
        lines.append(f"preflight: {meta['imported']} modules imported, {len(problems)} failed")
        lines += [f"  | {ln}" for ln in problems]
    counts = {"passed": 0, "skipped": 0, "failed": 0}
    for t in tests:
        outcome = t["outcome"]
        key = outcome if outcome in counts else "failed"
        counts[key] += 1
        head = f"[{short_name(t['nodeid'])}] {outcome}"
        if t.get("when") not in (None, "call") and outcome != "skipped":
            head += f" in {t['when']}"
        if outcome == "skipped":
            head += f": {t.get('message', '')}"
        else:
            head += f" ({t.get('seconds', 0):.1f} s)"
        lines.append(head)
        lines += [f"  {ln}" for ln in t.get("lines", [])]
        if outcome == "failed" and t.get("message"):
            lines += [f"  | {ln}" for ln in t["message"].strip().splitlines()[-12:]]
    if meta.get("incomplete"):
        lines.append(f"pytest did not finish: {meta['incomplete']}")
        lines += [f"  | {ln}" for ln in meta.get("tail", [])]
    passed = (counts["failed"] == 0 and not meta.get("incomplete") and not problems
              and meta["pytest_rc"] in (0, 5) and (tests or meta["pytest_rc"] == 0))
    lines.append(f"== summary: {counts['passed']} passed, {counts['skipped']} skipped, "
                 f"{counts['failed']} failed; RESULT: {'PASS' if passed else 'FAIL'} ==")
    return lines


def run_pytest(args, workdir: Path, timeout: float,
               native: bool) -> tuple[int, list[dict], str, str | None]:
    """(pytest's exit status, test results, its output, why it did not finish or None)."""
    results = workdir / "results.json"
    env = dict(os.environ, GPU_CHECK_RESULTS=str(results),
               GPU_CHECK_TABLES=str(workdir / "tables"), PYTHONUNBUFFERED="1",
               PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep))
    if args.dry:
        env["GRAPHTRACE_GPU_DRY"] = "1"
    if not native:
        env["GRAPHTRACE_NATIVE"] = "0"
    # the lent image has pytest plugins installed (xdist, timeout, cov, benchmark, hypothesis):
    # the checks use none, and none may change how they run
    env["PYTEST_DISABLE_PLUGIN_AUTOLOAD"] = "1"
    cmd = [sys.executable, "-m", "pytest", "-m", "cuda", str(TESTS), "-rA", "-p", "no:cacheprovider",
           "-o", "console_output_style=classic"]
    if args.k:
        cmd += ["-k", args.k]
    incomplete = None
    try:
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True,
                              errors="replace", timeout=timeout)
        rc, output = proc.returncode, proc.stdout + proc.stderr
        if rc < 0:
            incomplete = f"pytest crashed (signal {-rc})"
    except subprocess.TimeoutExpired as exc:
        rc = 124
        output = (exc.stdout or b"").decode(errors="replace") if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        incomplete = f"timeout after {timeout:.0f} s"
    try:
        tests = json.loads(results.read_text())["tests"]
    except Exception:  # noqa: BLE001 - nothing written: pytest failed before any test
        tests = []
        if incomplete is None and rc not in (0, 5):
            incomplete = f"pytest exited {rc} without results"
    return rc, tests, output, incomplete


def merge_tables(folder: Path, out: Path, tag: str) -> None:
    """Per-case coverage tables into two CSVs (kernels, pointers)."""
    if not folder.exists():
        return
    import pandas as pd

    for kind in ("kernels", "pointers"):
        parts = [pd.read_csv(p) for p in sorted(folder.glob(f"gpu_coverage_{kind}_*.csv"))]
        if parts:
            pd.concat(parts, ignore_index=True).to_csv(out / f"gpu_coverage_{kind}_{tag}.csv",
                                                       index=False)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="gpu_check.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dry", action="store_true",
                   help="skip every GPU test (GRAPHTRACE_GPU_DRY=1): checks the plumbing anywhere")
    p.add_argument("--out", metavar="DIR", default=None,
                   help="results folder (default: analysis/results on a CUDA run; none with --dry)")
    p.add_argument("-k", metavar="EXPR", default="", help="pytest -k expression")
    p.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S, metavar="S",
                   help=f"seconds for the whole run, preflight included (default "
                        f"{DEFAULT_TIMEOUT_S:.0f}; each test has its own limit besides, see "
                        "tests/gpu/conftest.py)")
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.timeout <= 0:
        print("gpu_check.py: --timeout must be positive", file=sys.stderr)
        return 2
    cuda = False if args.dry else cuda_available()
    if not args.dry and not cuda:
        print("gpu_check.py: CUDA is not available here: every GPU test will skip", flush=True)
    mode = "full run, CUDA" if cuda else "dry run, no CUDA"
    out = Path(args.out) if args.out else (REPO / "analysis" / "results" if cuda else None)
    meta = {"mode": mode, "cuda": cuda, "started": time.strftime("%Y-%m-%d %H:%M:%S"),
            "argv": sys.argv[1:] if argv is None else list(argv), "env": env_lines(cuda)}
    workdir = Path(tempfile.mkdtemp(prefix="gpu_check_"))
    t0 = time.perf_counter()
    meta["imported"], meta["import_problems"] = import_problems()
    native, meta["recorder"] = build_recorder(min(NATIVE_BUILD_TIMEOUT_S, args.timeout / 2))
    left = max(args.timeout - (time.perf_counter() - t0), 30.0)
    rc, tests, output, incomplete = run_pytest(args, workdir, left, native)
    meta.update(pytest_rc=rc, seconds=round(time.perf_counter() - t0, 1), tag=results_tag(cuda))
    if incomplete:
        meta["incomplete"] = incomplete
        meta["tail"] = output.rstrip().splitlines()[-15:]
    block = format_block(meta, tests)
    block.append(f"total time {meta['seconds']:.1f} s")
    print("\n".join(block), flush=True)
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        stem = f"gpu_check_{meta['tag']}"  # (its dots are no suffix: no with_suffix)
        (out / f"{stem}.txt").write_text("\n".join(block) + "\n")
        (out / f"{stem}.json").write_text(json.dumps({"meta": meta, "tests": tests}, indent=1,
                                                     default=str))
        (out / f"{stem}.log").write_text(output)
        merge_tables(workdir / "tables", out, meta["tag"])
        print(f"results written to {out / stem}.txt (+ .json, .log, gpu_coverage_*.csv)", flush=True)
    return 0 if block[-2].endswith("RESULT: PASS ==") else 1


if __name__ == "__main__":
    raise SystemExit(main())
