"""Lazy package exports (PEP 562): a package names what it offers without importing it.

`graphtrace` uses this so that importing it does not import torch (reports can be read
without it), and `graphtrace.vllm` so that importing it does not import vLLM. Torch-free.
"""

from __future__ import annotations

import importlib
from typing import Any, Callable

__all__ = ["lazy_exports"]


def lazy_exports(package: str, namespace: dict[str, Any],
                 exports: dict[str, str]) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """The `__getattr__` and `__dir__` of `package`, whose globals are `namespace`.

    `exports` maps each lazy name to the module defining it; the first read of a name
    imports that module and caches the value in `namespace`.
    """

    def __getattr__(name: str) -> Any:
        module = exports.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        namespace[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted(set(namespace) | set(exports))

    return __getattr__, __dir__
