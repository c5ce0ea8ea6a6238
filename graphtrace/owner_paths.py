"""Reading owner paths back: the path grammar of graphtrace.owners (in its docstring),
resolved on a live model. `walk_owners` spells every path that reaches a tensor; after a
reload the diff and the guard follow the same paths again.
"""

from __future__ import annotations

import ast
import collections
import functools
import types
from typing import Iterable, Mapping, Sequence

import torch
from torch import nn

from graphtrace.opaque import storage_of
from graphtrace.verdict import View, same_view

__all__ = ["PathSet", "resolve_path", "resolve_value", "none_moved"]


@functools.lru_cache(maxsize=65536)
def _parse(path: str) -> tuple[tuple[bool, object], ...]:
    """Split a path into (is_key, name_or_key) steps."""
    steps: list[tuple[bool, object]] = []
    i, n = 0, len(path)
    expect_name = True
    while i < n:
        c = path[i]
        if c == "[":
            j = path.find("]", i + 1)
            while True:
                if j < 0:
                    raise ValueError(f"unbalanced '[' in owner path {path!r}")
                key = _literal(path[i + 1:j])
                if key is not _MISSING:
                    break
                try:
                    key = ast.literal_eval(path[i + 1:j])
                    break
                except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
                    j = path.find("]", j + 1)  # that "]" was inside a string key
            steps.append((True, key))
            i, expect_name = j + 1, False
            continue
        if c == ".":
            i += 1
        elif not expect_name:
            raise ValueError(f"expected '.' or '[' at {i} in owner path {path!r}")
        j = i
        while j < n and path[j] not in ".[":
            j += 1
        if j == i:
            raise ValueError(f"empty name at {i} in owner path {path!r}")
        steps.append((False, path[i:j]))
        i, expect_name = j, False
    if not steps:
        raise ValueError("empty owner path")
    return tuple(steps)


def _literal(text: str) -> object:
    """The key `ast.literal_eval(text)` reads for the literals `_key_repr` writes most (an
    int, a quoted string without escapes, True, False, None), without the parser (a few µs
    per call, per key of every path parsed at each capture end); _MISSING for anything else,
    which `ast.literal_eval` then reads."""
    if text.isascii():
        digits = text[1:] if text[:1] == "-" else text
        if digits.isdigit() and (len(digits) == 1 or digits[0] != "0"):
            return int(text)
        if len(text) >= 2 and text[0] == text[-1] == "'" and "'" not in text[1:-1] \
                and "\\" not in text and text.isprintable():
            return text[1:-1]
    return _CONSTANTS.get(text, _MISSING)


_MISSING = object()
_CONSTANTS = {"True": True, "False": False, "None": None}


def _registry_of(module: nn.Module, name: str) -> str | None:
    """Which of `module`'s registries holds `name` (what `_attr` looks in first), if any."""
    d = module.__dict__
    for registry in ("_parameters", "_buffers", "_modules"):
        reg = d.get(registry)
        if reg and name in reg:
            return registry
    return None


def _attr(obj: object, name: str) -> object:
    if isinstance(obj, nn.Module):
        registry = _registry_of(obj, name)
        if registry is not None:
            return obj.__dict__[registry][name]
    if name == "__closure__" and isinstance(obj, types.FunctionType):
        # cells by free-variable name, empty cells left out (see the path grammar)
        closure: dict[str, object] = {}
        for var, cell in zip(obj.__code__.co_freevars, obj.__closure__ or ()):
            try:
                closure[var] = cell.cell_contents
            except ValueError:
                pass
        return closure
    d = getattr(obj, "__dict__", None)
    if isinstance(d, dict) and name in d:
        return d[name]
    return getattr(obj, name, _MISSING)


# What an owner path may end at: a tensor or an opaque handle (anything else: orphaned).
_REACHED = (torch.Tensor, torch.ScriptObject)
# What a view is compared on (owner_status's rule: a subclass is judged by storage alone)
_PLAIN = (torch.Tensor, nn.Parameter)


def resolve_path(model: nn.Module, path: str) -> torch.Tensor | None:
    """The tensor that `path` (as `walk_owners` spells it) reaches on `model` now, else None.

    None means the path no longer resolves to a tensor (the diff calls that owner
    orphaned): a missing attribute, key or index, an empty cell, or a non-tensor at the
    end. A path that breaks the grammar raises ValueError; a non-Module model TypeError.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"resolve_path() needs a torch.nn.Module, got {type(model).__qualname__}")
    obj = resolve_value(model, path)
    return obj if isinstance(obj, _REACHED) else None


def _step(obj: object, is_key: bool, step: object) -> object:
    """One step of a path from `obj`; _MISSING where it does not resolve. The one stepping
    function of owner paths (the native `paths_moved` is checked against it:
    tests/test_owners.py)."""
    try:
        if is_key:
            if isinstance(obj, dict):
                return obj[step] if step in obj else _MISSING  # no defaultdict insertions
            if isinstance(obj, (list, tuple, collections.deque)) and type(step) is int:
                return obj[step] if -len(obj) <= step < len(obj) else _MISSING
            return _MISSING
        return _attr(obj, step)
    except Exception:  # a property or __getattr__ that raises: the path is broken
        return _MISSING


def resolve_value(model: nn.Module, path: str) -> object:
    """What `path` reaches on `model` now, whatever it is (a float attribute, for baked
    scalars: graphtrace.scalars); None where it does not resolve."""
    obj: object = model
    for is_key, step in _parse(path):
        obj = _step(obj, is_key, step)
        if obj is _MISSING:
            return None
    return obj


class PathSet:
    """Many owner paths resolved together, each shared prefix followed once: what
    `resolve_path` gives for each path, for less than half the steps on a model's
    parameter names (`layers.3.mlp.up_proj.weight` and `.bias` share five steps)."""

    __slots__ = ("paths", "_nodes", "_leaves", "_registry", "_native_nodes", "_index")

    def __init__(self, paths: Iterable[str] = ()):
        self.paths: list[str] = []
        self._nodes: list[tuple[int, bool, object]] = []  # (parent node or -1, is_key, step)
        self._index: dict[tuple, int] = {}
        self._leaves: list[int] = []
        # per node: the nn.Module registry (`_parameters`, ...) its step was last found in
        self._registry: list[str | None] = []
        # the nodes as native `paths_moved` reads them
        self._native_nodes: list[tuple[int, object, bool]] = []
        self.add(paths)

    def add(self, paths: Iterable[str]) -> None:
        """Append paths after the others, in order, repeats kept (a shared prefix reuses
        the nodes already made): a set that grows is not parsed again."""
        nodes, index = self._nodes, self._index
        for path in paths:
            parent = -1
            for is_key, step in _parse(path):
                key = (parent, is_key, type(step), step)  # [1] and [True] are two steps
                node = index.get(key)
                if node is None:  # a parent always comes before its children
                    node = index[key] = len(nodes)
                    nodes.append((parent, is_key, step))
                    self._registry.append(None)
                    self._native_nodes.append((parent, step, is_key))
                parent = node
            self._leaves.append(parent)
            self.paths.append(path)

    def resolve(self, model: nn.Module) -> list[torch.Tensor | None]:
        """`[resolve_path(model, p) for p in self.paths]`."""
        if not isinstance(model, nn.Module):
            raise TypeError(f"PathSet.resolve() needs a torch.nn.Module, got "
                            f"{type(model).__qualname__}")
        objs: list[object] = []
        append = objs.append
        registry = self._registry
        for i, (parent, is_key, step) in enumerate(self._nodes):
            obj = model if parent < 0 else objs[parent]
            if obj is _MISSING:
                append(_MISSING)
                continue
            reg = registry[i]
            if reg is not None and isinstance(obj, nn.Module):
                # the registry that held the name last time first: a module's `_parameters`,
                # `_buffers` and `_modules` never share a name, so a hit there is `_attr`'s
                found = obj.__dict__.get(reg)
                if found is not None and step in found:
                    append(found[step])
                    continue
            got = _step(obj, is_key, step)
            if not is_key and isinstance(obj, nn.Module):
                registry[i] = _registry_of(obj, step)
            append(got)
        return [o if isinstance(o, _REACHED) else None for o in map(objs.__getitem__, self._leaves)]

    def moved(self, model: nn.Module, expected: Sequence[int], native=None,
              versions: Sequence[int | None] | None = None,
              views: Sequence[View | None] | None = None) -> bool:
        """Does any path now reach a storage other than `expected` (the StorageImpl address
        each reached before), or none? With `versions` (per path a version counter, or None),
        a tensor whose version counter differs counts as moved too; with `views` (per path
        the View it had, or None), a plain tensor or Parameter on that storage under another
        view (`same_view`: Note [re-laid views] in graphtrace/verdict.py). An `expected` that
        is a float is a value: the path must reach a float equal to it. With the native module
        (`graphtrace.native`), the common steps (registries, `__dict__`, getattr, dict keys,
        list indices) are followed in C++, and the paths it leaves undecided here (a view
        not exactly as it was among them: the exact rule is decided here)."""
        undecided: Sequence[int] = range(len(self.paths))
        if native is not None:
            extra: tuple = ()
            if views is not None:
                extra = (None if versions is None else list(versions),
                         views if type(views) is list else list(views))
            elif versions is not None:
                extra = (versions if type(versions) is list else list(versions),)
            got = native.paths_moved(model, nn.Module, nn.Parameter, self._native_nodes,
                                     self._leaves, expected if type(expected) is list
                                     else list(expected), *extra)
            if got is True:
                return True
            undecided = got
        if not undecided:
            return False
        values = [i for i in undecided if type(expected[i]) is float]
        if values:  # a float baseline (a baked scalar's holder): the very float, by value
            if any(type(v := resolve_value(model, self.paths[i])) is not float
                   or v != expected[i] for i in values):
                return True
            undecided = [i for i in undecided if type(expected[i]) is not float]
            if not undecided:
                return False
        if 4 * len(undecided) < len(self.paths):
            tensors = [resolve_path(model, self.paths[i]) for i in undecided]
        else:  # most paths: all together, learning their registry steps
            every = self.resolve(model)
            tensors = [every[i] for i in undecided]
        for i, tensor in zip(undecided, tensors):
            try:
                if tensor is None or storage_of(tensor)._cdata != expected[i]:
                    return True
                if versions is not None and versions[i] is not None \
                        and tensor._version != versions[i]:
                    return True
                if views is not None and views[i] is not None and type(tensor) in _PLAIN \
                        and not same_view(views[i], View.of(tensor)):
                    return True
            except Exception:
                return True
        return False

    def __len__(self) -> int:
        return len(self.paths)


def none_moved(models: Mapping[str, nn.Module], native,
               checks: Iterable[tuple[str, PathSet, Sequence, Sequence | None, Sequence | None]]
               ) -> bool:
    """Does every path still reach its baseline, by the native module? `checks`: per model
    name, a PathSet and its `moved` baselines (expected, versions, views). False on any
    doubt (no native module, a model not given, an error): the caller's slow path decides."""
    if native is None:
        return False
    try:
        return not any(name not in models
                       or paths.moved(models[name], expected, native, versions, views)
                       for name, paths, expected, versions, views in checks)
    except Exception:
        return False
