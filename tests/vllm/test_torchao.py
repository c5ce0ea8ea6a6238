"""vLLM 0.32's torchao quantization method (`TorchAOConfig`) on CPU (issue 25).

Its weights are torchao wrapper tensor subclasses (`Int8Tensor`): graphtrace owns their inner
tensors (`proj.weight.qdata`, `proj.weight.scale`). vLLM's layerwise reload refreshes them in
place (clean: stable, the replay computes with the new weights), while a weight quantized again
and bound in its place is stale on the inner tensors, in the diff and the guard alike. The run
is a subprocess (tests/vllm/torchao_run.py): it makes a process group.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.vllm

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]


def test_vllm_torchao_method_inner_tensors_owned_reload_clean_rebind_stale():
    pytest.importorskip("torchao", reason="torchao is not installed in the vLLM venv")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), env_path()]))
    proc = subprocess.run([sys.executable, str(HERE / "torchao_run.py")], env=env,
                          capture_output=True, text=True, timeout=480, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["weight_type"] == "Int8Tensor"
    assert {"proj.weight.qdata", "proj.weight.scale"} <= set(out["owned"])
    layerwise = out["layerwise"]
    assert layerwise == {"stale": [], "verdicts": [], "guard": [], "replay_is_eager": True}
    rebound = out["rebound"]
    assert {"proj.weight.qdata", "proj.weight.scale"} <= set(rebound["stale"])
    assert rebound["verdicts"] == ["stale"] and rebound["guard"] == rebound["stale"]
    assert rebound["replay_is_eager"] is False


def env_path() -> str:
    return os.environ.get("PYTHONPATH", "")
