"""Every public annotation resolves (issue 23, part 7).

`from __future__ import annotations` keeps annotations as strings, so a name used in one
but never imported (`Any` in tracing.py once) is found only when something evaluates them:
`typing.get_type_hints`, IDEs, `dataclasses` tooling, documentation generators. This test
evaluates them for every public function, class, method and property of every name in
`graphtrace.__all__` and in each graphtrace module's `__all__` (torch-importing modules
included; a module whose import needs vLLM is skipped when vLLM is missing).
"""

from __future__ import annotations

import importlib
import inspect
import pkgutil
import typing

import pytest

import graphtrace


def _module_names() -> list[str]:
    names = ["graphtrace"]
    for info in pkgutil.walk_packages(graphtrace.__path__, "graphtrace."):
        if not info.name.rsplit(".", 1)[-1] == "__main__":
            names.append(info.name)
    return sorted(names)


MODULES = _module_names()

# Annotations that name a class imported only under `if TYPE_CHECKING:` in a module being
# rewritten now (issue 23, part 1: diff.py and guard.py become one verdict engine). Tolerated
# until then; an entry that resolves fails the test below: remove it.
KNOWN_UNRESOLVED: set[str] = set()


def _import(name: str):
    try:
        return importlib.import_module(name)
    except ImportError as e:  # only vLLM may be missing; anything else is a failure
        if (e.name or "").split(".")[0] == "vllm":
            pytest.skip(f"{name} needs vLLM ({e})")
        raise


def _public(name: str) -> bool:
    return not name.startswith("_") or name in ("__init__", "__call__", "__new__")


def _annotated(obj, where: str):
    """(qualified name, callable or class) for `obj` and, for a class defined in graphtrace,
    each public function, property, classmethod and staticmethod it defines."""
    if inspect.isclass(obj):
        if not obj.__module__.startswith("graphtrace"):
            return  # re-exported from elsewhere: not ours to check
        yield where, obj
        for name, member in vars(obj).items():
            if not _public(name):
                continue
            if isinstance(member, (staticmethod, classmethod)):
                member = member.__func__
            if isinstance(member, property):
                for part, fn in (("fget", member.fget), ("fset", member.fset)):
                    if fn is not None:
                        yield f"{where}.{name}.{part}", fn
            elif inspect.isfunction(member):
                yield f"{where}.{name}", member
    elif inspect.isfunction(obj) and obj.__module__.startswith("graphtrace"):
        yield where, obj


def _targets(module) -> list[tuple[str, object]]:
    out = []
    for name in getattr(module, "__all__", ()):
        obj = getattr(module, name)
        out.extend(_annotated(obj, f"{module.__name__}.{name}"))
    return out


@pytest.mark.parametrize("module_name", MODULES)
def test_type_hints_resolve_on_every_public_name(module_name):
    module = _import(module_name)
    assert hasattr(module, "__all__"), f"{module_name} has no __all__"
    bad, fixed = [], []
    for where, obj in _targets(module):
        qualname = f"{obj.__module__}.{obj.__qualname__}"
        try:
            typing.get_type_hints(obj)
        except Exception as e:  # noqa: BLE001 (NameError, TypeError, ...: all are findings)
            if qualname not in KNOWN_UNRESOLVED:
                bad.append(f"{where}: {type(e).__name__}: {e}")
        else:
            if qualname in KNOWN_UNRESOLVED:
                fixed.append(qualname)
    assert not bad, "typing.get_type_hints fails on:\n" + "\n".join(bad)
    assert not fixed, f"these resolve now: remove them from KNOWN_UNRESOLVED: {fixed}"


def test_the_check_sees_the_public_surface():
    """The walk above reaches the public API (a walk that found nothing would pass)."""
    found = {where for where, _ in _targets(graphtrace)}
    for expected in ("graphtrace.capture", "graphtrace.trace", "graphtrace.Trace.diff",
                     "graphtrace.Report", "graphtrace.load_report"):
        assert expected in found, f"{expected} not checked; found {sorted(found)}"


def test_an_unresolvable_annotation_is_caught():
    """The failure this test exists for: an annotation naming something not imported."""
    namespace: dict = {}
    exec("from __future__ import annotations\n"
         "def f(x: Any) -> None: ...", {"__name__": "graphtrace.fake"}, namespace)
    f = namespace["f"]
    assert [w for w, _ in _annotated(f, "graphtrace.fake.f")] == ["graphtrace.fake.f"]
    with pytest.raises(NameError, match="Any"):
        typing.get_type_hints(f)
