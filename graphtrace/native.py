"""The native recorder: graphtrace/csrc/recorder.cpp, built with torch's own extension builder.

The per-op path in Python costs about two no-op dispatch modes; in C++ it costs less than one:
the recording mode's `__torch_dispatch__` itself is a C function there (Note [native dispatch]
in csrc/recorder.cpp), and so are a watched module's call (Note [native module call]) and the
capture-end check that owner paths still reach the storages they reached (`paths_moved`). The
extension is compiled once per (source, torch build, Python) into torch's extension cache
(`TORCH_EXTENSIONS_DIR`, default ~/.cache/torch_extensions) and loaded from there.

`GRAPHTRACE_NATIVE` chooses, for traces that don't say (`gt.trace(native=...)`):
  auto (default)  use it, building it on first use; fall back to Python with a warning if it
                  cannot be built (no compiler): recording stays correct, only slower;
  1               require it: a trace fails with the build error instead of falling back;
  0               never: the pure-Python recorder.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import sys
import threading
import time
import warnings
from pathlib import Path
from types import ModuleType

__all__ = [
    "SOURCE", "ENV", "STALE_LOCK_S", "NativeUnavailable", "mode", "load", "resolve", "main",
    "configure_dispatch",
]

SOURCE = Path(__file__).resolve().parent / "csrc" / "recorder.cpp"
ENV = "GRAPHTRACE_NATIVE"
# torch's builder holds a `lock` file in the build folder while it runs ninja, and waits
# forever for one left by a process killed meanwhile. A build takes ~20 s: older is stale.
STALE_LOCK_S = 300

_lock = threading.Lock()
_module: ModuleType | None = None
_error: str | None = None


class NativeUnavailable(RuntimeError):
    """The native recorder was required but could not be built or loaded."""


def mode() -> str:
    """`auto`, `on` or `off`, from GRAPHTRACE_NATIVE."""
    value = os.environ.get(ENV, "auto").strip().lower()
    if value in ("", "auto"):
        return "auto"
    if value in ("1", "on", "true", "yes", "require"):
        return "on"
    if value in ("0", "off", "false", "no"):
        return "off"
    raise ValueError(f"{ENV}={value!r}: use auto, 1 or 0")


def _name() -> str:
    """The extension's name, unique per source text and torch build (so never a stale .so)."""
    import torch

    digest = hashlib.sha256(SOURCE.read_bytes())
    digest.update(f"{torch.__version__} {torch.version.git_version}".encode())
    return f"graphtrace_recorder_{digest.hexdigest()[:12]}"


def _import(name: str, path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _clear_stale_lock(folder: Path) -> None:
    lock = folder / "lock"
    try:
        age = time.time() - lock.stat().st_mtime
    except FileNotFoundError:
        return
    if age > STALE_LOCK_S:
        warnings.warn(f"graphtrace: removing {lock}, left {age / 60:.0f} min ago by a build that "
                      "was interrupted (torch's builder would wait for it forever)",
                      RuntimeWarning, stacklevel=4)
        lock.unlink(missing_ok=True)


def _build() -> ModuleType:
    import torch  # noqa: F401  (the extension links against it: import it first)

    from graphtrace._compat import extension_build_directory, extension_build_directory_guess

    name = _name()
    # A built file is current (`_name`): import it without torch's builder, which takes the
    # folder's lock and runs ninja every time. Look first where the builder would have put it
    # (`extension_build_directory_guess`: the builder's import costs every traced process).
    built = Path(extension_build_directory_guess(name)) / f"{name}.so"
    if not built.exists():  # not there: a torch whose builder puts it elsewhere, or unbuilt
        built = Path(extension_build_directory(name)) / f"{name}.so"
    if built.exists():
        try:
            return _import(name, built)
        except ImportError:
            pass  # a partial or foreign file: build it again
    from torch.utils.cpp_extension import load

    folder = Path(extension_build_directory(name))
    _clear_stale_lock(folder)
    print(f"graphtrace: building the native recorder (once per torch build; ~20 s) "
          f"from {SOURCE}", file=sys.stderr, flush=True)
    return load(name=name, sources=[str(SOURCE)], extra_cflags=["-O2"], verbose=False)


def configure_dispatch(module: ModuleType) -> ModuleType:
    """Tell the loaded extension whether it may call an OpOverload's `_op` itself (as this
    torch's OpOverload.__call__ does; `calls_op_directly`, asked now). Done at load."""
    from graphtrace._compat import OpOverload, calls_op_directly

    setter = getattr(module, "configure", None)
    if setter is not None:
        setter(OpOverload if calls_op_directly(OpOverload) else None)
    return module


def _gist(exc: BaseException) -> str:
    """A build error's gist: its first compiler error, else its last line."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    errors = [line for line in lines if "error:" in line]
    return f"{type(exc).__name__}: {(errors or lines or [''])[0 if errors else -1]}"


def load(required: bool = False) -> ModuleType | None:
    """The native module, or None when it cannot be built (raises NativeUnavailable if required)."""
    global _module, _error
    with _lock:
        if _module is None and _error is None:
            try:
                _module = configure_dispatch(_build())
            except Exception as exc:  # no compiler, no headers, a failed build: say why
                _error = _gist(exc)
                if not required:
                    warnings.warn(f"graphtrace: native recorder unavailable ({_error}); using the "
                                  f"pure-Python recorder (same records, slower). Set {ENV}=0 to "
                                  "silence this.", RuntimeWarning, stacklevel=3)
    if _module is None and required:
        raise NativeUnavailable(f"graphtrace: the native recorder is required ({ENV}=1 or "
                                f"native=True) but could not be built: {_error}")
    return _module


def resolve(native: bool | None) -> ModuleType | None:
    """The module a trace should use: `native` if given, else GRAPHTRACE_NATIVE."""
    if native is None:
        choice = mode()
        if choice == "off":
            return None
        return load(required=choice == "on")
    return load(required=True) if native else None


def main(argv: list[str] | None = None) -> int:
    """`python -m graphtrace.native`: build (if needed) and load the extension, say where."""
    try:
        module = load(required=True)
    except NativeUnavailable as exc:
        print(exc, file=sys.stderr)
        return 1
    print(f"graphtrace native recorder: {module.__file__}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
