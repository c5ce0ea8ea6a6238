"""SGLang integration tests: the real SGLang 0.5.23 engine (CPU, torch_native attention, the
placeholder sgl_kernel) on a tiny local Llama; the model runs in SGLang's scheduler process,
where graphtrace's plugin traces it.

Skipped when SGLang cannot be imported or graphtrace's plugin is not installed in the
environment, except with GRAPHTRACE_REQUIRE_SGLANG=1 (make test-sglang): then they fail.

The planted stale holder (tests/sglang/plant.py) is loaded in the scheduler as an SGLang
plugin of its own: its entry point is written here into a folder put on the path of this
process and of the processes SGLang spawns.
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

import pytest

from tests.engine_probe import EngineGate

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
PLACEHOLDER_LOG = "GRAPHTRACE_SGL_KERNEL_LOG"

os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")  # before sglang is imported (the probe)


def _plant_entry_point(work: Path) -> None:
    """The test plugin's entry point, visible here and in SGLang's spawned processes."""
    folder = work / "plugins"
    dist = folder / "graphtrace_test_plant-0.dist-info"
    dist.mkdir(parents=True, exist_ok=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: graphtrace-test-plant\n"
                                   "Version: 0\n")
    (dist / "entry_points.txt").write_text(
        "[sglang.srt.plugins]\ngraphtrace_test_plant = tests.sglang.plant:register\n")
    paths = [str(folder), str(ROOT)]
    sys.path[:0] = [p for p in paths if p not in sys.path]
    os.environ["PYTHONPATH"] = os.pathsep.join(paths + [os.environ.get("PYTHONPATH", "")])


def _probe() -> str | None:
    """None when SGLang's engine imports and graphtrace's plugin is installed; else why not."""
    try:
        import sglang  # noqa: F401

        if os.environ.get("GRAPHTRACE_SGLANG_RELEASE"):
            return None  # make test-sglang-contract: another release's package, read as source
        from sglang.srt.entrypoints.engine import Engine  # noqa: F401
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    from graphtrace.sglang.engine import plugin_installed

    if not plugin_installed():
        return "graphtrace's sglang.srt.plugins entry point is not installed (pip install -e .)"
    return None


GATE = EngineGate("SGLang", "sglang", "GRAPHTRACE_REQUIRE_SGLANG", HERE, _probe)


def pytest_collection_modifyitems(config, items):
    GATE.mark(items)


@pytest.fixture(scope="session", autouse=True)
def _need_sglang():
    GATE.need()


@pytest.fixture(scope="session")
def work(_need_sglang):
    """The tests' folder, and the environment SGLang's processes inherit (set only for
    these tests, restored after: strict graphtrace, offline hubs, the placeholder's log)."""
    folder = Path(tempfile.mkdtemp(prefix="graphtrace-sglang-tests-"))
    saved = {k: os.environ.get(k) for k in (*_ENV, PLACEHOLDER_LOG, "PYTHONPATH", *_SWITCHES)}
    os.environ.update({**_ENV, PLACEHOLDER_LOG: str(folder / "sgl_kernel_calls.log")})
    for key in _SWITCHES:
        os.environ.pop(key, None)  # trace_engine sets them for the engines it starts
    _plant_entry_point(folder)
    yield folder
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


_ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "DO_NOT_TRACK": "1",
        "GRAPHTRACE_STRICT": "1"}
_SWITCHES = ("GRAPHTRACE_SGLANG", "GRAPHTRACE_GUARD", "GRAPHTRACE_SGLANG_DIR")
