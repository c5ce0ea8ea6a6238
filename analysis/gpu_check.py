#!/usr/bin/env python3
"""GPU check (issue 8): run the GPU tests (`pytest -m cuda tests/gpu`) and write a readable
results file.

The checks are pytest tests under tests/gpu (see tests/gpu/conftest.py): env info, every
demo variant on real CUDA graphs with verdicts equal to the emulated reference, the stale
read on real replay, and pointer-argument coverage of real graphs' kernel nodes (eager and
torch.compile'd; graphtrace.cuda_nodes reads them). This script runs them in one pytest
process with an overall timeout, then writes OUT/gpu_check.txt: the environment, each test's
outcome and time, and the lines (key figures) it printed; plus gpu_check.json (the same,
machine-readable), gpu_check.log (pytest's output) and gpu_coverage_{kernels,pointers}.csv.

  python analysis/gpu_check.py               # CUDA machine: OUT=analysis/results
  python analysis/gpu_check.py --dry         # any machine: every GPU test skips (the plumbing)
  python analysis/gpu_check.py --out DIR     # where the results go (--dry writes only with --out)
  python analysis/gpu_check.py -k stale_read # pytest's -k, passed through

Exit status: 0 when pytest ran to the end and no test failed (skips are not failures),
1 otherwise, 2 on bad options.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TESTS = REPO / "tests" / "gpu"


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


def short_name(nodeid: str) -> str:
    """tests/gpu/test_demo_cuda.py::test_x[v] -> test_demo_cuda::test_x[v]."""
    path, _, rest = nodeid.partition("::")
    return f"{Path(path).stem}::{rest}" if rest else nodeid


def format_block(meta: dict, tests: list[dict]) -> list[str]:
    """The results file: a header, env, one block per test, a summary line."""
    lines = [f"== graphtrace GPU check ({meta['mode']}) ==",
             f"started {meta['started']}; pytest exit status {meta['pytest_rc']}"]
    lines += [f"env: {ln}" for ln in meta.get("env", [])]
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
    passed = (counts["failed"] == 0 and not meta.get("incomplete")
              and meta["pytest_rc"] in (0, 5) and (tests or meta["pytest_rc"] == 0))
    lines.append(f"== summary: {counts['passed']} passed, {counts['skipped']} skipped, "
                 f"{counts['failed']} failed; RESULT: {'PASS' if passed else 'FAIL'} ==")
    return lines


def run_pytest(args, workdir: Path) -> tuple[int, list[dict], str, str | None]:
    """(pytest's exit status, test results, its output, why it did not finish or None)."""
    results = workdir / "results.json"
    env = dict(os.environ, GPU_CHECK_RESULTS=str(results),
               GPU_CHECK_TABLES=str(workdir / "tables"), PYTHONUNBUFFERED="1",
               PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep))
    if args.dry:
        env["GRAPHTRACE_GPU_DRY"] = "1"
    cmd = [sys.executable, "-m", "pytest", "-m", "cuda", str(TESTS), "-rA", "-p", "no:cacheprovider",
           "-o", "console_output_style=classic"]
    if args.k:
        cmd += ["-k", args.k]
    incomplete = None
    try:
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True,
                              errors="replace", timeout=args.timeout)
        rc, output = proc.returncode, proc.stdout + proc.stderr
        if rc < 0:
            incomplete = f"pytest crashed (signal {-rc})"
    except subprocess.TimeoutExpired as exc:
        rc = 124
        output = (exc.stdout or b"").decode(errors="replace") if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        incomplete = f"timeout after {args.timeout:.0f} s"
    try:
        tests = json.loads(results.read_text())["tests"]
    except Exception:  # noqa: BLE001 - nothing written: pytest failed before any test
        tests = []
        if incomplete is None and rc not in (0, 5):
            incomplete = f"pytest exited {rc} without results"
    return rc, tests, output, incomplete


def merge_tables(folder: Path, out: Path) -> None:
    """Per-case coverage tables into two CSVs (kernels, pointers)."""
    if not folder.exists():
        return
    import pandas as pd

    for kind in ("kernels", "pointers"):
        parts = [pd.read_csv(p) for p in sorted(folder.glob(f"gpu_coverage_{kind}_*.csv"))]
        if parts:
            pd.concat(parts, ignore_index=True).to_csv(out / f"gpu_coverage_{kind}.csv", index=False)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="gpu_check.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dry", action="store_true",
                   help="skip every GPU test (GRAPHTRACE_GPU_DRY=1): checks the plumbing anywhere")
    p.add_argument("--out", metavar="DIR", default=None,
                   help="results folder (default: analysis/results on a CUDA run; none with --dry)")
    p.add_argument("-k", metavar="EXPR", default="", help="pytest -k expression")
    p.add_argument("--timeout", type=float, default=900.0, metavar="S",
                   help="seconds for the whole pytest run (default 900; each test has its own "
                        "limit besides, see tests/gpu/conftest.py)")
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
    rc, tests, output, incomplete = run_pytest(args, workdir)
    meta.update(pytest_rc=rc, seconds=round(time.perf_counter() - t0, 1))
    if incomplete:
        meta["incomplete"] = incomplete
        meta["tail"] = output.rstrip().splitlines()[-15:]
    block = format_block(meta, tests)
    block.append(f"total time {meta['seconds']:.1f} s")
    print("\n".join(block), flush=True)
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        (out / "gpu_check.txt").write_text("\n".join(block) + "\n")
        (out / "gpu_check.json").write_text(json.dumps({"meta": meta, "tests": tests}, indent=1,
                                                       default=str))
        (out / "gpu_check.log").write_text(output)
        merge_tables(workdir / "tables", out)
        print(f"results written to {out}/gpu_check.txt (+ .json, .log, gpu_coverage_*.csv)", flush=True)
    return 0 if block[-2].endswith("RESULT: PASS ==") else 1


if __name__ == "__main__":
    raise SystemExit(main())
