"""Every demo variant on real CUDA graphs (and on emulated graphs with the model on the GPU):
verdicts, flagged owners and owned edges equal to the emulated CPU reference, per variant."""

from __future__ import annotations

import pytest

from graphtrace.demo.kernels import VARIANTS


@pytest.fixture(scope="module")
def emulated_reference(checks):
    """Each variant on emulated graphs, model on the CPU: the reference (computed once)."""
    out = {}
    quiet = checks.Notes(echo=False)
    for variant in VARIANTS:
        scenarios, ok, verdict = checks.demo_variant(quiet, variant, "cpu", "emulated[cpu]", True)
        assert ok, f"emulated[cpu] {variant}: {verdict}"
        out[variant] = scenarios
    return out


def _check_against_reference(checks, notes, variant, reference, label, emulate):
    scenarios, ok, verdict = checks.demo_variant(notes, variant, "cuda", label, emulate)
    notes.figure("scenarios", scenarios)
    errors = {k: s["errors"] for k, s in scenarios.items() if s["n_errors"]}
    assert not errors, f"graphtrace recorded internal errors: {errors}"
    assert ok, f"{label} {variant}: {verdict}"
    equal, lines = checks.compare_demo(reference[variant], scenarios, "emulated[cpu]", label)
    for ln in lines:
        notes.line(ln)
    assert equal is True, "\n".join(lines)


@pytest.mark.gpu_timeout(120)
@pytest.mark.parametrize("variant", VARIANTS)
def test_demo_on_cuda_graphs(checks, notes, emulated_reference, variant):
    """Real torch.cuda.graph captures: reload, diff, flip test on real replay."""
    _check_against_reference(checks, notes, variant, emulated_reference, "cuda-graphs", False)


@pytest.mark.gpu_timeout(120)
@pytest.mark.parametrize("variant", VARIANTS)
def test_demo_emulated_on_gpu(checks, notes, emulated_reference, variant):
    """Emulated graphs with the model on the GPU agree with the CPU reference too."""
    _check_against_reference(checks, notes, variant, emulated_reference, "emulated[cuda]", True)
