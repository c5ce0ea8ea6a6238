"""The stale read on real replay: after a reload the unfixed graphs compute with the
capture-time permutation while eager uses the new one; flipping the live permutation in
place changes every eager row and no replayed one. Real replay agrees with emulated replay."""

from __future__ import annotations

import pytest

from graphtrace.demo.kernels import VARIANTS


@pytest.mark.gpu_timeout(120)
@pytest.mark.parametrize("variant", VARIANTS)
def test_stale_read_on_real_replay(checks, notes, variant):
    real = checks.stale_read_figures(notes, variant, "cuda")
    notes.figure("real", real)
    assert checks.stale_read_problems(variant, real) == []
    emulated = checks.stale_read_figures(checks.Notes(echo=False), variant, "cpu")
    notes.figure("emulated", emulated)
    equal, lines = checks.compare_stale_read({variant: emulated}, {variant: real},
                                             "emulated replay", "real replay")
    for ln in lines:
        notes.line(ln)
    assert equal is True, lines
