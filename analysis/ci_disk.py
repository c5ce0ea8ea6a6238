"""The disk CI (`.ci/run`) fills from a fresh clone: each environment the Makefile builds,
the pip cache and torch's extension cache, measured with ``du -s`` (issue #41: CI from a fresh
clone under 40 GB of disk in all).

Each environment's path is the Makefile's default under the checkout measured, or the one
given with ``NAME=PATH`` (where it was built elsewhere, e.g. with ``make NEXT_VENV=...``)::

    python analysis/ci_disk.py [--root DIR] [venv-torch-next=/work/envs/x ...]

Prints one line per path (MiB, or "missing": then the sum leaves it out and says so) and the
sum against the 40 GB bound; written to analysis/results/ci_disk.txt.
"""

from __future__ import annotations

import argparse
import subprocess
from pathlib import Path

from _common import ROOT, revision, write_results

BOUND_GB = 40
# what `.ci/run` builds (Makefile variables' defaults) and the caches it fills
PATHS = {
    "venv": ".venv",                         # make test, lint (torch 2.13 CPU)
    "venv-vllm": ".venv-vllm",               # make test-vllm, test-vllm-contract
    "venv-sglang": ".venv-sglang",           # make test-sglang, test-torch-2.14
    "venv-torch-next": ".venv-torch-next",   # make test-torch-next (torch 2.15 CUDA build)
    "venv-torch-2.11": ".venv-torch-2.11",   # make test-torch-oldest (the GPU image's set)
    "vllm-contract": ".vllm-contract",       # make test-vllm-contract (0.33, 0.34 packages)
    "pip-cache": "~/.cache/pip",
    "torch-extensions": "~/.cache/torch_extensions",  # graphtrace's native recorder builds
}


def mib(path: Path) -> int | None:
    if not path.exists():
        return None
    out = subprocess.run(["du", "-s", "--block-size=1M", str(path)], capture_output=True,
                         text=True, check=True).stdout
    return int(out.split()[0])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", type=Path, default=ROOT, help="the checkout (default: this)")
    parser.add_argument("where", nargs="*", help="NAME=PATH: an environment built elsewhere")
    args = parser.parse_args()
    paths = {name: (args.root / p if not p.startswith("~") else Path(p).expanduser())
             for name, p in PATHS.items()}
    for item in args.where:
        name, _, path = item.partition("=")
        if name not in paths:
            parser.error(f"unknown name {name!r} (names: {', '.join(PATHS)})")
        paths[name] = Path(path)
    lines = [f"# ci_disk at {revision()}: du -s --block-size=1M per path"]
    total, missing = 0, []
    for name, path in paths.items():
        size = mib(path)
        if size is None:
            missing.append(name)
        total += size or 0
        lines.append(f"{name:18s} {'missing' if size is None else f'{size:6d} MiB'}  {path}")
    gb = total * 2**20 / 1e9
    lines.append(f"sum {total} MiB = {gb:.1f} GB of the {BOUND_GB} GB bound ({gb / BOUND_GB:.0%})"
                 + (f"; not measured (missing): {', '.join(missing)}" if missing else ""))
    text = "\n".join(lines) + "\n"
    print(text, end="")
    write_results(ROOT / "analysis" / "results" / "ci_disk.txt", text)


if __name__ == "__main__":
    main()
