"""A placeholder ``sgl_kernel`` that only satisfies SGLang's imports on a CPU (issue #41).

The registry's ``sglang-kernel`` builds need ``libcuda.so.1``, and it has no CPU build (SGLang's
CPU kernels are built from source for Xeons with AMX). SGLang 0.5.23 imports names from
``sgl_kernel`` at module level on every device, so without a CUDA driver the engine fails at
import. This package stands first on the path in .venv-sglang (Makefile) instead: every
attribute of the package is a function that raises if called; it has no submodules (SGLang
imports those in ``try``/``except ImportError`` and falls back, e.g. ``get_scalar_types``). A call is also appended to ``$GRAPHTRACE_SGL_KERNEL_LOG`` (when set), so that a
test can show none was called in another process (tests/sglang/test_placeholder.py).
Nothing here computes anything: the engine on CPU with ``attention_backend="torch_native"``
runs SGLang's pure-torch paths, and a path that would need a kernel fails loudly.
"""

from __future__ import annotations

import os
import sys
import types

PLACEHOLDER = True
LOG_ENV = "GRAPHTRACE_SGL_KERNEL_LOG"


class PlaceholderCalled(RuntimeError):
    """A function of the placeholder sgl_kernel was called: the real kernel is missing."""


def _placeholder(qualname: str):
    def call(*args, **kwargs):
        path = os.environ.get(LOG_ENV)
        if path:
            with open(path, "a") as f:
                f.write(f"{os.getpid()} {qualname}\n")
        raise PlaceholderCalled(f"{qualname} is a placeholder: sgl_kernel has no CPU build here "
                                "(requirements/sglang-placeholder)")
    call.__name__ = qualname.rsplit(".", 1)[-1]
    call.__qualname__ = qualname
    return call


class _Module(types.ModuleType):
    """A module whose every missing public attribute is a raising function."""

    def __getattr__(self, name: str):
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        fn = _placeholder(f"{self.__name__}.{name}")
        setattr(self, name, fn)
        return fn


sys.modules[__name__].__class__ = _Module
