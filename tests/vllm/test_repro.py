"""The standalone reproductions of analysis/repro/ (issue 29, part 3) still reproduce.

Each script uses vLLM's code only; here it runs in a subprocess of the vLLM environment and
its printed verdict is checked. graphtrace's own detection of the same bugs is tested
separately: the dropped loads in tests/vllm/test_kernel_audit.py
(test_reload_dropped_loads_are_reported); the CPU int8 handler's stale `handler_tensor` in
test_finding_is_sourced_and_flagged. The freed *source* of that handler (the weight scale it
points at) is not detected by graphtrace: the audit states it from the C++ source only (issue 24).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPRO = Path(__file__).resolve().parents[2] / "analysis" / "repro"


def _run(script: str, *args: str) -> str:
    proc = subprocess.run([sys.executable, str(REPRO / script), *args], capture_output=True,
                          text=True, timeout=600)
    out = proc.stdout
    assert proc.returncode == 0, out[-4000:] + proc.stderr[-4000:]
    return out


def test_moe_reload_drops_the_last_expert_scale():
    out = _run("moe_reload_drops_loads.py")
    assert out.rstrip().endswith("BUG REPRODUCED"), out[-3000:]
    # keys arrive sorted; the layer's last key arrives after vLLM processed the layer
    assert "keys arrive sorted by name: True" in out
    assert "  model.layers.0.block_sparse_moe.experts.3.w3.weight_scale" in out
    # the late load goes to the processed parameter and the reload raises
    assert "reload_weights: raised ValueError: quant method must be one of" in out
    # with uninitialised memory filled with NaN, the requantisation saw a NaN w3 scale
    assert "[0.004, nan]]" in out
    assert "expert 3: w13: max |diff| inf, NaN 65536/65536" in out
    assert "left on the meta device" in out


def test_cpu_int8_handler_reads_a_freed_scale():
    out = _run("cpu_int8_scale_after_reload.py", "--asymmetric")
    assert out.rstrip().endswith("BUG REPRODUCED"), out[-3000:]
    assert "path _apply_weights_onednn" in out
    rows = {line.split("max |diff|")[0].strip(): line for line in out.splitlines() if "max |diff|" in line}
    # the control: allocations alone, or a kept-alive scale, leave the output unchanged
    assert "max |diff| 0 " in rows["before the reload, 4000 x 1024 B of 1e30 live"]
    assert "max |diff| 0 " in rows["reload again, its handler's scale kept alive"]
