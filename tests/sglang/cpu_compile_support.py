"""Test support for SGLang's compiled CPU engine (tests/sglang/test_compiled_cpu.py), loaded in
every SGLang process as a plugin of its own (entry point ``graphtrace_test_cpu_compile``,
written by that test module). Off unless its switches are set when the engine starts:

- ``GRAPHTRACE_TEST_CPU_OPS=1``: the STAND-IN for sgl-kernel's two CPU attention ops
  (analysis/repro/sglang_cpu_standin/common_ops.py: plain torch, not SGLang's kernels) is
  imported, unless the installed sgl_kernel provides them. SGLang's CPU graph runner needs the
  intel_amx attention backend, which calls them; the registry has no CPU build of sgl-kernel.
- ``GRAPHTRACE_TEST_FREEZING=0``: the control; Inductor freezing is turned off right after
  SGLang's ``set_torch_compile_config()`` turned it on (cpu_graph_runner.py).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

OPS_ENV = "GRAPHTRACE_TEST_CPU_OPS"
FREEZING_ENV = "GRAPHTRACE_TEST_FREEZING"
STANDIN = Path(__file__).resolve().parents[2] / "analysis" / "repro" / "sglang_cpu_standin"
CONFIG = "sglang.srt.model_executor.cpu_graph_runner.set_torch_compile_config"


def register() -> None:
    if os.environ.get(OPS_ENV) == "1":
        _load_standin()
    if os.environ.get(FREEZING_ENV) == "0":
        from sglang.srt.plugins.hook_registry import HookRegistry, HookType

        HookRegistry.register(CONFIG, _freezing_off, HookType.AFTER)


def _load_standin() -> None:
    import torch

    if hasattr(torch.ops.sgl_kernel, "decode_attention_cpu"):
        return  # a real CPU build of sgl-kernel
    if str(STANDIN) not in sys.path:
        sys.path.insert(0, str(STANDIN))
    import common_ops  # noqa: F401  (importing it registers the ops)


def _freezing_off(result, *args, **kwargs):
    import torch._inductor.config as inductor_config

    inductor_config.freezing = False
    return result
