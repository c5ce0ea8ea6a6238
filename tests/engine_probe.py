"""The engine test folders' gate (tests/vllm, tests/sglang): each test there is marked with
its engine's marker, and a session fixture skips them where the engine is not usable, or
fails them when the CI job that installs the engine says it must be there
(``GRAPHTRACE_REQUIRE_<ENGINE>=1``): a missing engine must not pass as skipped there."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Callable

import pytest


class EngineGate:
    """``name``: the engine as the messages say it; ``marker``: its pytest marker's name;
    ``require_env``: the variable that turns a skip into a failure; ``folder``: the test
    folder whose items get the marker; ``probe``: None when the engine is usable, else why
    not (asked once, when the conftest is imported)."""

    def __init__(self, name: str, marker: str, require_env: str, folder: Path,
                 probe: Callable[[], str | None]):
        self.name, self.marker, self.require_env = name, marker, require_env
        self.folder = Path(folder).resolve()
        self.require = os.environ.get(require_env) == "1"
        self.why_not = probe()

    def mark(self, items) -> None:
        """``pytest_collection_modifyitems``: the folder's tests get the engine's marker."""
        mark = getattr(pytest.mark, self.marker)
        for item in items:
            if self.folder in Path(str(item.fspath)).resolve().parents:
                item.add_marker(mark)

    def need(self) -> None:
        """The session fixture's body: nothing when usable; else fail (required) or skip."""
        if self.why_not is None:
            return
        if self.require:
            pytest.fail(f"{self.require_env}=1 but {self.name} is not usable: {self.why_not}",
                        pytrace=False)
        pytest.skip(f"{self.name} is not usable here ({self.why_not})")


def planted_copy(original, name: str, tmp_path: Path, monkeypatch,
                 renames: tuple[tuple[str, str], ...]) -> str:
    """A copy of the engine module ``original``'s source with ``renames`` applied (each must
    occur), loaded as ``name`` (a sibling, so its relative imports resolve in the engine);
    the contract tests plant a renamed hook target in it. Returns ``name``."""
    import importlib.util
    import sys

    source = Path(original.__file__).read_text()
    for old, new in renames:
        assert old in source, old
        source = source.replace(old, new, 1)
    path = tmp_path / f"planted{len(renames)}.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, name, module)
    spec.loader.exec_module(module)
    return name
