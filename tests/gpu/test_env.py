"""Versions, the device, and what this torch and driver offer for reading graphs."""

from __future__ import annotations

import platform

import pytest


@pytest.mark.gpu_timeout(180)
def test_env(checks, notes):
    import numpy
    import pandas
    import torch

    import graphtrace
    from graphtrace import native
    from graphtrace.cuda_nodes import CudaDriver

    notes.line(f"python {platform.python_version()} on {platform.machine()}, numpy "
               f"{numpy.__version__}, pandas {pandas.__version__}")
    notes.line(f"torch {torch.__version__} (CUDA build {torch.version.cuda}), graphtrace "
               f"{graphtrace.__version__}")
    props = torch.cuda.get_device_properties(0)
    notes.figure("device", props.name)
    notes.line(f"device: {props.name}, {props.multi_processor_count} SMs, "
               f"{props.total_memory / 2**30:.0f} GiB, capability {props.major}.{props.minor}")
    try:
        import triton

        notes.line(f"triton {triton.__version__}")
    except Exception as exc:  # noqa: BLE001
        notes.unavailable("triton", exc)
    try:  # built here once (~20 s) so that the tests after this one record with it
        module = native.load(required=True)
        notes.line(f"graphtrace recorder: native ({module.__file__})")
    except native.NativeUnavailable as exc:
        notes.line(f"graphtrace recorder: pure Python ({exc})")
    probes = checks.probe_torch_features()
    notes.figure("probes", probes)
    for key, (ok, detail) in probes.items():
        notes.line(f"probe {key}: {'yes' if ok else 'no'}{' - ' + detail if detail else ''}")
    drv = CudaDriver()
    notes.figure("driver_version", drv.version)
    notes.line(f"libcuda {drv.path}: driver API {drv.version_text}; entry points: " +
               ", ".join(f"{k} {'yes' if v else 'NO'}" for k, v in drv.available.items()))
    assert torch.cuda.is_available()
