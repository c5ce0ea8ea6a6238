"""What the analysis scripts share: the checkout measured, min-of-N timing, process memory and
the results file (each line printed as it comes and written once at the end).

The scripts are run by path (``python analysis/bench_scale.py``), so this folder is first on
``sys.path`` and they import this module as ``_common``.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

ROOT = Path(__file__).resolve().parents[1]
T = TypeVar("T")


def revision() -> str:
    """The checkout measured: git commit (+ "dirty" when graphtrace/ has local changes)."""
    try:
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, text=True,
                             capture_output=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "graphtrace"], cwd=ROOT,
                               text=True, capture_output=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return (rev or "unknown") + (" (graphtrace/ modified)" if dirty else "")


def best_of(fn: Callable[[], T], repeat: int) -> tuple[float, T]:
    """The shortest of `repeat` runs of `fn` (wall clock; the machine is shared and noisy) and
    the last run's result."""
    t_best, out = float("inf"), None
    for _ in range(repeat):
        t0 = time.perf_counter()
        out = fn()
        t_best = min(t_best, time.perf_counter() - t0)
    return t_best, out


def rss() -> int:
    """This process's resident memory in bytes (psutil, else Linux's /proc/self/statm)."""
    try:
        import psutil

        return psutil.Process().memory_info().rss
    except ImportError:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def write_results(path: Path, text: str) -> None:
    """Write a results file, making its folder (analysis/results/ by default)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def add_results_options(ap: argparse.ArgumentParser, results: Path) -> None:
    """A benchmark's `--quick` (a smoke run of seconds) and `--out` (its results file:
    `results` unless --quick, which writes none)."""
    ap.add_argument("--quick", action="store_true", help="small smoke run (seconds)")
    ap.add_argument("--out", type=Path, default=None,
                    help=f"also write the table here (default {results.relative_to(ROOT)}; "
                         "with --quick: nowhere)")


def show(lines: list[str], out: Path | str | None) -> None:
    """Print a benchmark's table, and write it to `out` when given (a results file)."""
    text = "\n".join(lines)
    print(text)
    if out:
        write_results(Path(out), text + "\n")


class Results:
    """The lines of a benchmark's output: `say` prints each one as it comes, `write` saves
    them all (nothing when `path` is None, as in a --quick run without --out)."""

    def __init__(self) -> None:
        self.lines: list[str] = []

    def say(self, s: str = "") -> None:
        print(s, flush=True)
        self.lines.append(s)

    def heading(self, title: str, script: str, quick: bool, *measured_with: str) -> None:
        """The first two lines: `# <title> (<script>[ --quick])`, then what measured the
        results: graphtrace's version and checkout, then `measured_with` (torch, Python, ...)."""
        import graphtrace

        self.say(f"# {title} ({script}{' --quick' if quick else ''})")
        self.say(f"graphtrace {graphtrace.__version__} at {revision()}; " + ", ".join(measured_with))

    def write(self, path: Path | None) -> None:
        if path is None:
            return
        write_results(path, "\n".join(self.lines) + "\n")
        print(f"wrote {path}")
