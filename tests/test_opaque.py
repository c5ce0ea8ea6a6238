"""Opaque handles (graphtrace.opaque, Note [opaque handles]): ScriptObject arguments such as
packed quantized params are owned, read as opaque storages, stale after re-quantization, and
never kept alive by the recorder."""

from __future__ import annotations

import warnings
import weakref

import pytest
import torch

import graphtrace as gt

pytestmark = pytest.mark.usefixtures("writer")


def _quantized(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.ao.quantization is deprecated
        return torch.ao.quantization.quantize_dynamic(
            torch.nn.Sequential(torch.nn.Linear(4, 4)), {torch.nn.Linear}, dtype=torch.qint8)


def _requantize(model: torch.nn.Module, seed: int) -> None:
    fc = model[0]
    w, b = fc.weight(), fc.bias()
    g = torch.Generator().manual_seed(seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        qw = torch.quantize_per_tensor(torch.rand(w.shape, generator=g), 0.01, 0, torch.qint8)
        fc.set_weight_bias(qw, b)  # a new packed object bound in place of the old


def test_packed_params_are_owned_opaque_reads_and_stale_after_requantization():
    model = _quantized()
    x = torch.rand(2, 4)
    with gt.trace(model, strict=True) as t:
        with gt.capture("g") as g:
            out = model(x)
    expected = out.clone()
    report = t.diff()
    path = "0._packed_params._packed_params"
    e = report.edges[report.edges.owners == path]
    assert len(e) == 1, report.edges[["ops", "args", "owners"]]
    assert e.ops.iloc[0] == "quantized::linear_dynamic" and e.args.iloc[0] == "W_prepack"
    assert e.verdict.iloc[0] == "stable"
    sid = int(e.storage_id.iloc[0])
    assert report.storages.loc[sid, "device"] == "opaque"
    assert report.storages.loc[sid, "nbytes"] == 0
    assert any("opaque handle quantized.LinearPackedParamsBase" in s and path in s
               for s in report.blind_spots)

    _requantize(model, seed=1)
    assert not torch.equal(model(x), expected)
    g.replay()  # the graph still reads the old packed weights
    assert torch.equal(out, expected)
    e = t.diff().edges.set_index("owners").loc[path]
    assert e.verdict == "stale" and e.impact == "unknown"


def test_packed_params_are_not_kept_alive_by_the_recorder(gc_off):
    model = _quantized()
    with gt.trace(model, strict=True) as t:
        with gt.capture("g", emulate=False):
            model(torch.rand(2, 4))
    old = weakref.ref(model[0]._packed_params._packed_params)
    _requantize(model, seed=1)
    assert old() is None, "graphtrace keeps the old packed object alive"
    e = t.diff().edges.set_index("owners").loc["0._packed_params._packed_params"]
    assert e.verdict == "dangling"


def test_a_process_group_read_by_all_reduce_is_no_opaque_handle(tmp_path):
    """torch's communicators (``c10d.ProcessGroup``: a tensor-parallel forward's all_reduce)
    pack no tensors: read by a captured graph, they are not an opaque-handle blind spot that
    would fail every guarded update of a tensor-parallel engine (SGLang tp_size=2)."""
    import torch.distributed as dist

    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0,
                            world_size=1)
    try:
        model = torch.nn.Linear(4, 4)
        with gt.trace(model, strict=True) as t:
            with gt.capture("g"):
                out = model(torch.rand(2, 4))
                dist.all_reduce(out)
            guard = t.guard()
        assert not any("c10d" in str(s) for s in t.diff().blind_spots)
        assert len(guard.check()) == 0  # nothing unchecked after no update
    finally:
        dist.destroy_process_group()
