"""Where an engine's code is named by graphtrace, checked against the installed engine.

Engine-neutral helpers of the release contracts (graphtrace/vllm/contract.py,
graphtrace/sglang/contract.py): resolve a ``module:qualname`` target to the object it names,
check that a target's signature accepts the call a wrapper makes, and read the attributes a
class sets from its source with ``ast`` (setting them may need a device). Each problem is one
line that starts with the target it is about.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import textwrap

__all__ = ["resolve", "resolve_source", "SourceClass", "check_call", "signature",
           "assigned_attrs", "source_assigned_attrs", "check_attrs"]


def resolve(module: str, qualname: str):
    """(object, problem): the object at ``module:qualname`` or why it is not there. A class's
    attribute is read from the class's own ``__dict__`` (an inherited one is not the target);
    graphtrace's wrappers (``__graphtrace_original__``) are seen through."""
    try:
        obj = importlib.import_module(module)
    except Exception as exc:
        return None, f"{module}: cannot import ({type(exc).__name__}: {exc})"
    for part in qualname.split("."):
        nxt = obj.__dict__.get(part) if inspect.isclass(obj) else getattr(obj, part, None)
        if nxt is None:
            return None, f"{module}:{qualname}: missing ({part!r} not found)"
        obj = nxt
    while getattr(obj, "__graphtrace_original__", None) is not None:  # hooks installed
        obj = obj.__graphtrace_original__
    return obj, None


def signature(fn) -> str:
    """``fn``'s signature as text, ``(?)`` where it has none."""
    try:
        return str(inspect.signature(fn))
    except (TypeError, ValueError):
        return "(?)"


def check_call(target: str, fn, args: tuple, kwargs: dict, method: bool) -> list[str]:
    """``fn`` (at ``target``) accepts graphtrace's call ``(self?, *args, **kwargs)``;
    ``method``: the call passes the instance first."""
    if isinstance(fn, staticmethod | classmethod):
        fn = fn.__func__
    try:
        inspect.signature(fn).bind(*(("self",) if method else ()), *args, **kwargs)
    except (TypeError, ValueError) as exc:
        call = ", ".join([*map(repr, args), *(f"{k}=..." for k in kwargs)])
        return [f"{target}: signature {signature(fn)} does not accept graphtrace's call "
                f"({call}): {exc}"]
    return []


def assigned_attrs(cls) -> set[str]:
    """Names assigned as ``self.<name> = ...`` anywhere in ``cls`` and its bases' source."""
    names: set[str] = set()
    for klass in inspect.getmro(cls):
        if klass is object:
            continue
        try:
            source = textwrap.dedent(inspect.getsource(klass))
        except (OSError, TypeError):
            continue
        names |= _self_attrs(ast.parse(source))
    return names


def check_attrs(path: str, attrs, why: str, root=None) -> list[str]:
    """The class at ``path`` (``module:Class``) sets each of ``attrs`` (`assigned_attrs`;
    read from the source under ``root`` with `resolve_source` when given)."""
    module, qualname = path.split(":")
    if root is None:
        cls, problem = resolve(module, qualname)
    else:
        cls, problem = resolve_source(root, module, qualname)
    if problem:
        return [problem]
    have = assigned_attrs(cls) if root is None else source_assigned_attrs(cls)
    return [f"{path}: sets no attribute {a!r} ({why})" for a in attrs if a not in have]


class SourceClass:
    """What `resolve_source` returns for a class: its name and the ``ast`` node."""

    def __init__(self, name: str, node: ast.ClassDef):
        self.name, self.node = name, node


def resolve_source(root, module: str, qualname: str):
    """(object, problem) as `resolve`, read from the source under ``root`` (the folder that
    holds the top package) without importing it: for a function, a stand-in with the same
    parameters (defaults and annotations dropped: enough for `check_call`); for a class, a
    `SourceClass`. Used where a release's modules cannot import (its compiled parts or newer
    dependencies absent)."""
    from pathlib import Path

    base = Path(root).joinpath(*module.split("."))
    path = base / "__init__.py" if base.is_dir() else base.with_suffix(".py")
    if not path.is_file():
        return None, f"{module}: cannot import (no file {path.relative_to(root)})"
    body = ast.parse(path.read_text(errors="replace")).body
    node = None
    for part in qualname.split("."):
        node = next((n for n in reversed(body) if isinstance(
            n, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef) and n.name == part), None)
        if node is None:
            return None, f"{module}:{qualname}: missing ({part!r} not found)"
        body = node.body if isinstance(node, ast.ClassDef) else []
    if isinstance(node, ast.ClassDef):
        return SourceClass(qualname, node), None
    return _stand_in(node), None


def _stand_in(node):
    args = ast.unparse(_bare(node.args))
    scope: dict = {}
    exec(f"def {node.name}({args}): pass", scope)  # noqa: S102 - parameters only
    return scope[node.name]


def _bare(args: ast.arguments) -> ast.arguments:
    none = ast.Constant(None)
    strip = [*args.posonlyargs, *args.args, *args.kwonlyargs,
             *([args.vararg] if args.vararg else []), *([args.kwarg] if args.kwarg else [])]
    for a in strip:
        a.annotation = None
    args.defaults = [none] * len(args.defaults)
    args.kw_defaults = [None if d is None else none for d in args.kw_defaults]
    return args


def source_assigned_attrs(cls: SourceClass) -> set[str]:
    """`assigned_attrs` of a class read by `resolve_source` (its own body only)."""
    return _self_attrs(cls.node)


def _self_attrs(tree) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(tree):
        targets = (node.targets if isinstance(node, ast.Assign)
                   else [node.target] if isinstance(node, ast.AnnAssign | ast.AugAssign)
                   else [])
        for t in targets:
            for sub in ast.walk(t):
                if (isinstance(sub, ast.Attribute) and isinstance(sub.value, ast.Name)
                        and sub.value.id == "self"):
                    names.add(sub.attr)
    return names
