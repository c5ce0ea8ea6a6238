"""Check that the installed SGLang is what graphtrace's release table says it is.

``check()`` compares a row of `graphtrace.sglang.releases` with the SGLang the process
imports and returns one line per broken expectation, each naming its target (empty: the
contract holds). The engine never starts: it imports SGLang's modules, or, given ``root``,
reads their source only, for a release whose modules cannot import here (``make
test-sglang-contract``: each release's package, its ``.so`` files deleted, ahead of the
installed environment). `check_targets` is also what the plugin runs at load (Note [a target
gone at plugin load] in releases.py).
"""

from __future__ import annotations

from graphtrace import targets
from graphtrace.sglang.releases import Release, Target, installed_version, release

__all__ = ["check", "check_targets", "check_attrs", "resolve_target", "source_root"]


def check(rel: Release | None = None, root=None) -> list[str]:
    """Every broken expectation of ``rel`` (None: the installed SGLang's row). ``root``: read
    SGLang's source under this folder instead of importing its modules (`source_root`)."""
    rel = rel or release()
    return _check_version(rel) + _check_plugins(rel, root) + check_targets(rel.targets, root) \
        + check_attrs(rel, root)


def source_root():
    """The folder that holds the importable ``sglang`` package."""
    from pathlib import Path

    import sglang

    return Path(sglang.__file__).parent.parent


def _check_version(rel: Release) -> list[str]:
    got = installed_version().split("+")[0]
    return [] if got == rel.version else [f"sglang: installed {got}, the row is for "
                                          f"{rel.version}"]


def _check_plugins(rel: Release, root=None) -> list[str]:
    found = resolve_target(Target("sglang.srt.plugins", "load_plugins"), root)[0] is not None
    return [] if found == rel.plugins else [
        f"sglang.srt.plugins:load_plugins: the {rel.version} row says plugins={rel.plugins}, "
        f"the installed SGLang {'has' if found else 'has no'} plugin loader"]


def resolve_target(target: Target, root=None):
    """(object, problem) for one target (`graphtrace.targets.resolve`; from the source under
    ``root`` when given)."""
    if root is not None:
        return targets.resolve_source(root, target.module, target.qualname)
    return targets.resolve(target.module, target.qualname)


def check_targets(table: dict[str, Target], root=None) -> list[str]:
    """Each target exists and accepts the adapter's call (`Target.call`)."""
    problems = []
    for role, target in table.items():
        obj, problem = resolve_target(target, root)
        if problem:
            problems.append(f"{problem} [{role}]")
            continue
        if target.call is not None:
            args, kwargs = target.call
            problems += [f"{p} [{role}]" for p in targets.check_call(
                target.target, obj, args, kwargs, method=target.method)]
    return problems


def check_attrs(rel: Release, root=None) -> list[str]:
    """Each class sets the attributes the adapter reads on its instances."""
    problems = []
    for path, attrs in rel.attrs.items():
        problems += targets.check_attrs(path, attrs, "read by graphtrace.sglang", root)
    return problems
