"""Lines of graphtrace/*.py per module at two commits, and how much of the difference is new
capability (issue 40: "the package does not grow"; docs/internals.md, "Package size").

New capability is counted two ways: whole folders that are new capabilities (the SGLang
adapter), and the net lines that named capability commits added to the rest of the package
(``git show --numstat``, outside those folders). A commit's lines may have been reworded since,
so the second figure is the size each capability had when it landed.

    python analysis/package_size.py [BEFORE] [AFTER]      (default: c66e59b HEAD)
"""

from __future__ import annotations

import argparse
import subprocess

from _common import ROOT

FOLDERS = {"graphtrace/sglang/": "issue 41: the SGLang adapter"}
COMMITS = {
    "a3b2229": "issue 41: owner walk cuts at non-literal dict keys (SGLang's plans)",
    "52cdcf2": "issue 41: owner walk of SGLang's engine objects",
    "3b46ffd": "issue 41: tensor-parallel rank agreement (c10d classes not opaque)",
    "d6277c0": "serving core: a recapture that cannot help fails closed",
    "1b0e76a": "Trace.declare_state: engine state no weight derives",
    "c581841": "issue 36: a storage re-laid under another view is stale",
    "849da4f": "issue 40 item 1: the guard checks packed copies not rebuilt",
    "943a3dd": "issue 36: vLLM 0.34 direct reload fix texts",
    "058b768": "vLLM worker guard accepts 'packed copy not rebuilt'",
    "1a61e23": "SGLang release table and contract (graphtrace/targets.py shared with vLLM's)",
}
# lines a capability commit added that a later simplification removed (issue 40's shrink), found
# with `git blame -w -M -C` at the simplification's parent: the capability is counted smaller by
# them, so that they do not also shrink the rest. (capability commit, lines, by, what)
SIMPLIFIED = [
    ("1a61e23", -2, "f36f74a", "vllm/contract.py's forwarding aliases of graphtrace/targets.py"),
    ("d6277c0", -6, "f4a480b", "serving.py: its module docstring repeating docs/internals.md, docstrings said twice"),
    ("058b768", -2, "f4a480b", "vllm/serve.py: docstrings said twice"),
    ("1b0e76a", -7, "b9736f6", "tracing/session.py, lineage/graph.py: docstrings said twice"),
    ("849da4f", -2, "b9736f6", "guard/build.py: docstrings said twice"),
    ("c581841", -3, "b9736f6", "verdict.py: module docstring listing what each function's own docstring says"),
    ("849da4f", -2, "4d96353", "guard: the weak handle taken at attach written once (blind.handle_at)"),
    ("849da4f", -3, "8c5a2ae", "guard/build.py: @gc_paused() instead of a forwarding wrapper"),
]
# not capability, named to explain the rest of the difference (counted the same way)
EXPLAINED = {
    "ea48b3f": "issue 40 item 3: lineage.py split, its detectors as plug-ins",
    "f032e60": "issue 40 item 3: lineage plug-ins see the graph through a Protocol",
    "8724bb6": "issue 40 item 3: tracing.py split into tracing/",
    "2814a3e": "issue 40 item 3: guard.py split into guard/",
    "4f68100": "issue 40: owner_paths.py split from owners.py",
    "14093d8": "issue 39 (overhead): one frame per module call",
    "25141be": "issue 39 (overhead): _call_impl's fast-path pieces",
    "87552a8": "issue 39 (overhead): no owner walk at trace exit",
    "efebe29": "issue 39 (overhead): exact-view skip in the guard's slow path",
    "9e1e0e8": "issue 39 (overhead): the module call holds its bound class forward",
}


def git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=ROOT, text=True, capture_output=True,
                          check=True).stdout


def module_lines(commit: str) -> dict[str, int]:
    """Lines of every graphtrace/**.py at `commit`."""
    files = [f for f in git("ls-tree", "-r", "--name-only", commit, "graphtrace").split()
             if f.endswith(".py")]
    return {f: len(git("show", f"{commit}:{f}").splitlines()) for f in files}


def in_folder(path: str) -> bool:
    return any(path.startswith(folder) for folder in FOLDERS)


def commit_net(commit: str) -> int:
    """Net .py lines `commit` added to graphtrace/ outside the capability folders."""
    net = 0
    for row in git("show", "--numstat", "--no-renames", "--format=", commit, "--",
                   "graphtrace").splitlines():
        added, deleted, path = row.split("\t")
        if path.endswith(".py") and not in_folder(path):
            net += int(added) - int(deleted)
    return net


def main(before: str = "c66e59b", after: str = "HEAD") -> None:
    old, new = module_lines(before), module_lines(after)
    names = (before, after)
    print(f"graphtrace/*.py lines at {before} and {after} ({git('rev-parse', '--short', after).strip()})")
    print(f"{'module':<58}{names[0]:>9}{names[1]:>9}{'change':>8}")
    for path in sorted(old.keys() | new.keys()):
        a, b = old.get(path, 0), new.get(path, 0)
        print(f"{path:<58}{a:>9}{b:>9}{b - a:>+8}")
    total_old, total_new = sum(old.values()), sum(new.values())
    print(f"{'total':<58}{total_old:>9}{total_new:>9}{total_new - total_old:>+8}")

    print("\nnew capability in the difference")
    capability = 0
    for folder, why in FOLDERS.items():
        lines = sum(n for p, n in new.items() if p.startswith(folder))
        lines -= sum(n for p, n in old.items() if p.startswith(folder))
        capability += lines
        print(f"  {folder:<22}{lines:>+6}  {why}")
    for commit, why in COMMITS.items():
        lines = commit_net(commit)
        capability += lines
        print(f"  commit {commit:<15}{lines:>+6}  {why}")
        for removed, by, what in (row[1:] for row in SIMPLIFIED if row[0] == commit):
            capability += removed
            print(f"    {'since removed':<20}{removed:>+6}  {by}: {what}")
    rest = total_new - capability
    print(f"  {'all capability':<22}{capability:>+6}")
    print("\nnot capability: the splits and the overhead work (for the record)")
    for commit, why in EXPLAINED.items():
        print(f"  commit {commit:<15}{commit_net(commit):>+6}  {why}")
    print(f"\nthe package without that capability: {rest} lines "
          f"({rest - total_old:+d} against {total_old} at {before})")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("before", nargs="?", default="c66e59b", help="commit (default c66e59b)")
    parser.add_argument("after", nargs="?", default="HEAD", help="commit (default HEAD)")
    args = parser.parse_args()
    for commit in (args.before, args.after, *COMMITS, *EXPLAINED,
                   *(by for _, _, by, _ in SIMPLIFIED)):
        try:
            git("rev-parse", "--verify", "--quiet", f"{commit}^{{commit}}")
        except subprocess.CalledProcessError:
            parser.error(f"{commit!r} is not a commit of this repository (a shallow clone? "
                         "`git fetch --unshallow` first)")
    main(args.before, args.after)
