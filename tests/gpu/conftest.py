"""GPU checks as pytest tests (`pytest -m cuda tests/gpu`; analysis/gpu_check.py runs them
and writes analysis/results/gpu_check.txt).

Every test here is marked `cuda` and skipped, with one reason, where CUDA is not available
(or GRAPHTRACE_GPU_DRY=1, the script's --dry). Each runs under a per-test time limit
(`@pytest.mark.gpu_timeout(seconds)`, default DEFAULT_TIMEOUT_S). The `notes` fixture
collects what a test prints (its key figures); with GPU_CHECK_RESULTS=path, a JSON file of
every test's outcome, lines and figures is rewritten after each test, so a crash keeps what
ran before it.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
DEFAULT_TIMEOUT_S = 300.0


from tests.gpu import checks as checks_module


def cuda_skip_reason() -> str | None:
    """Why the GPU checks cannot run here (None: they can)."""
    if os.environ.get("GRAPHTRACE_GPU_DRY") == "1":
        return "needs CUDA: dry run (GRAPHTRACE_GPU_DRY=1)"
    try:
        import torch
    except Exception as exc:  # noqa: BLE001
        return f"needs CUDA: torch cannot be imported ({type(exc).__name__})"
    if not torch.cuda.is_available():
        return "needs CUDA: torch.cuda.is_available() is False"
    return None


def _here(item) -> bool:
    return HERE in Path(str(item.fspath)).resolve().parents


def pytest_collection_modifyitems(config, items):
    # env first: it builds the native recorder once, and its lines head the results file
    items.sort(key=lambda item: not (_here(item) and item.name == "test_env"))
    reason = cuda_skip_reason()
    for item in items:
        if not _here(item):
            continue
        item.add_marker(pytest.mark.cuda)
        if reason is not None:
            item.add_marker(pytest.mark.skip(reason=reason))


@pytest.fixture(autouse=True)
def _time_limit(request):
    marker = request.node.get_closest_marker("gpu_timeout")
    seconds = float(marker.args[0]) if marker else DEFAULT_TIMEOUT_S
    with checks_module.time_limit(seconds, request.node.nodeid):
        yield


@pytest.fixture(scope="session")
def checks():
    """tests/gpu/checks.py: the checks' shared functions."""
    return checks_module


@pytest.fixture
def notes(request):
    """Lines and figures of this test, kept for the results file (printed too)."""
    tables = os.environ.get("GPU_CHECK_TABLES")
    n = checks_module.Notes(request.node.name, table_dir=tables)
    yield n
    request.node.user_properties.append(("gpu_notes", {"lines": n.lines, "figures": n.figures}))


@pytest.fixture(scope="session")
def device():
    import torch

    return torch.device("cuda")


# -- results file (read by analysis/gpu_check.py) ---------------------------------------

_results: list[dict] = []


def pytest_runtest_logreport(report):
    path = os.environ.get("GPU_CHECK_RESULTS")
    if not path:
        return
    if report.when == "call" or (report.when == "setup" and report.outcome != "passed") or \
            (report.when == "teardown" and report.outcome == "failed"):
        entry = {"nodeid": report.nodeid, "when": report.when, "outcome": report.outcome,
                 "seconds": round(report.duration, 2), "message": ""}
        if report.skipped and isinstance(report.longrepr, tuple):
            entry["message"] = str(report.longrepr[2]).removeprefix("Skipped: ")
        elif report.failed:
            entry["message"] = report.longreprtext[-3000:]
        _results.append(entry)
    if report.when == "teardown":
        for name, value in report.user_properties:
            if name == "gpu_notes":
                for entry in _results:
                    if entry["nodeid"] == report.nodeid:
                        entry.update(value)
        tmp = path + ".tmp"
        with open(tmp, "w") as f:
            json.dump({"updated": time.strftime("%Y-%m-%d %H:%M:%S"), "tests": _results}, f,
                      default=str)
        os.replace(tmp, path)
