"""`graphtrace demo --case NAME` / `--case all` / `--list-cases`: run cases, print tables."""

from __future__ import annotations

import sys
import time

__all__ = ["list_cases", "run"]


def list_cases() -> str:
    from . import CASES

    lines = ["cases (graphtrace demo --case NAME, or --case all):"]
    for c in CASES.values():
        lines.append(f"  {c.name:<30} {c.reference}")
        lines.append(f"  {'':<30} rebound: {c.rebound}")
        lines.append(f"  {'':<30} variants: " + ", ".join(
            f"{v.name} ({v.kind})" for v in c.variants))
    return "\n".join(lines)


def run(args) -> int:
    """0 when every case's found verdicts match what it states, 1 otherwise, 2 on bad input."""
    from . import CASES, select
    from .spec import format_case, run_case, summary_line

    if getattr(args, "list_cases", False):
        print(list_cases())
        return 0
    try:
        cases = select(list(args.case))
    except KeyError as e:
        print(f"graphtrace demo: {e.args[0]}", file=sys.stderr)
        return 2
    backend = getattr(args, "backend", "auto") or "auto"
    if backend != "auto":
        from ..reload import resolve_backend

        try:
            resolve_backend(backend)
        except (RuntimeError, ValueError) as e:
            print(f"graphtrace demo: {e}", file=sys.stderr)
            return 2
    quiet = bool(getattr(args, "quiet", False))
    t0 = time.perf_counter()
    results = []
    for case in cases:
        res = run_case(case, backend)
        results.append((case, res))
        if not quiet:
            print(format_case(case, res), flush=True)
            print()
    print(f"graphtrace demo: {len(cases)} case(s) of {len(CASES)}, "
          f"{time.perf_counter() - t0:.1f} s")
    for case, res in results:
        print("  " + summary_line(case, res))
    bad = [case.name for case, res in results if not all(r.ok for r in res)]
    if bad:
        print(f"MISMATCH in {len(bad)} case(s): {', '.join(bad)}")
        return 1
    print("every case as expected: buggy variants found, fixed variants and controls clean")
    return 0
