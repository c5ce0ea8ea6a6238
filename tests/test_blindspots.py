"""Blind spots as records (kind, holder, op, text), packed copies a reload forgot to rebuild,
and pausing provenance: all through the public API."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

import graphtrace as gt
from graphtrace.provenance import ProvenanceMode
from graphtrace.vocab import BLIND_SPOT_FIELDS, BLIND_SPOT_KINDS, NOT_RECORDED

DATA = Path(__file__).parent / "data" / "reload_report"


class Packed(nn.Module):
    """A layer that reads a derived copy of its registered weight (a "packed" layout),
    rebuilt only by `process()` -- what a reload that skips process-weights forgets."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(4, 3), requires_grad=False)
        self.process()

    def process(self):
        self.packed = self.weight.detach().t().contiguous()

    def forward(self, x):
        return x @ self.packed


def _captured(model, copy="packed", source="weight"):
    with gt.trace(model, strict=True) as t:
        t.watch_copy(copy, source)
        with gt.capture("g"):
            model(torch.ones(2, 3) if isinstance(model, Packed) else torch.ones(2, 4))
    return t


# -- records --------------------------------------------------------------------------------
def test_records_reach_the_report_its_files_and_match_edges(tmp_path):
    model = Packed()
    with gt.trace(model, strict=True) as t:
        kept = t.add_blind_spot("the packed copy is read by a GEMM", kind="packed copy",
                                holder="packed", op="aten::mm")
        assert t.add_blind_spot("the packed copy is read by a GEMM") is kept  # same text: once
        t.add_blind_spot("a plain sentence")
        with gt.capture("g"):
            model(torch.ones(2, 3))
    report = t.diff()
    assert report.blind_spots == ["the packed copy is read by a GEMM", "a plain sentence"]
    first, plain = report.blind_spot_records
    assert isinstance(first, gt.BlindSpot)
    assert (first.kind, first.holder, first.op) == ("packed copy", "packed", "aten::mm")
    assert plain.kind == "other" and plain.holder == ""
    frame = report.blind_spots_frame
    assert list(frame.columns) == [*BLIND_SPOT_FIELDS, "n_edges"]
    assert frame["n_edges"].tolist() == [len(report.edges[report.edges.ops.str.contains("mm")]), 0]
    edges = report.blind_spot_edges(0)
    assert len(edges) == 3 and "packed" in set(edges.owners)  # every edge an mm reads
    assert report.blind_spot_edges(1).empty
    with pytest.raises(IndexError, match="no blind spot 5"):
        report.blind_spot_edges(5)
    report.to_csv(tmp_path / "r")
    back = gt.load_report(tmp_path / "r")
    assert back.blind_spot_records == report.blind_spot_records
    meta = json.loads((tmp_path / "r" / "manifest.json").read_text())["meta"]
    assert meta["blind_spots"][0]["kind"] == "packed copy"


def test_holder_only_record_matches_the_holders_edges():
    model = Packed()
    with gt.trace(model, strict=True) as t:
        t.add_blind_spot("about the weight", kind="packed copy", holder="weight")
        with gt.capture("g"):
            model(torch.ones(2, 3))
    report = t.diff()
    # the weight is read only while building nothing in the graph: no edge owns it
    assert report.blind_spots_frame["n_edges"].tolist() == [0]


def test_bad_records_are_refused():
    with pytest.raises(ValueError, match="unknown blind spot kind 'nope'"):
        gt.BlindSpot("nope", "text")
    with pytest.raises(TypeError, match="BlindSpot.holder must be a str"):
        gt.BlindSpot("other", "text", holder=3)
    with gt.trace() as t, pytest.raises(ValueError, match="unknown blind spot kind"):
        t.add_blind_spot("x", kind="invisible")
    assert "opaque handle" in BLIND_SPOT_KINDS and "packed copy not rebuilt" in BLIND_SPOT_KINDS


def test_old_folders_with_plain_strings_load_and_bad_records_fail(tmp_path):
    old = gt.load_report(DATA)  # written before records: meta holds strings
    assert [b.kind for b in old.blind_spot_records] == ["other"]
    assert old.blind_spots == [old.blind_spot_records[0].text]
    assert old.blind_spots_frame["n_edges"].tolist() == [0]
    for bad, match in [({"kind": "nope", "text": "x"}, "unknown blind spot kind"),
                       ({"kind": "other", "text": 3}, "BlindSpot.text must be a str"),
                       ({"kind": "other", "text": "x", "extra": 1}, "unknown blind spot field")]:
        folder = tmp_path / "bad"
        shutil.rmtree(folder, ignore_errors=True)
        shutil.copytree(DATA, folder)
        manifest = json.loads((folder / "manifest.json").read_text())
        manifest["meta"]["blind_spots"] = [bad]
        (folder / "manifest.json").write_text(json.dumps(manifest))
        with pytest.raises(gt.ReportError, match=r"meta.blind_spots\[0\]: " + match):
            gt.load_report(folder)


def test_diff_gives_kinds_to_its_own_blind_spots():
    model = Packed()
    t = _captured(model)
    old = model.packed  # alive, as a CUDA graph's capture keeps it
    model.packed = old.double()  # the holder moves to another dtype
    report = t.diff()
    kinds = {b.kind: b for b in report.blind_spot_records}
    note = kinds["dtype/shape change"]
    assert note.holder == "packed" and "float32 -> float64" in note.text
    assert len(report.blind_spot_edges(note)) == 1


# -- packed copies not rebuilt ---------------------------------------------------------------
def _not_rebuilt(report):
    return [b for b in report.blind_spot_records if b.kind == "packed copy not rebuilt"]


def test_copy_not_rebuilt_after_new_values_is_its_own_finding():
    model = Packed()
    t = _captured(model)
    with torch.no_grad():
        model.weight.copy_(torch.randn(4, 3))  # refreshed in place, the copy is not rebuilt
    report = t.diff()
    (spot,) = _not_rebuilt(report)
    assert spot.holder == "packed" and "weight" in spot.text and "values changed" in spot.text
    # watch_copy also declares lineage: the verdict says it too (issue 24)
    assert list(report.stale["verdict"].astype(str)) == ["unrefreshed"]
    assert list(report.stale["derived_from"].astype(str)) == ["weight"]
    edges = report.blind_spot_edges(spot)
    assert set(edges.owners) == {"packed"}


def test_a_source_left_on_the_meta_device_is_fingerprinted_without_values():
    """vLLM's layerwise reload leaves layers on meta tensors when a weight-transfer chunk
    fails (tests/vllm/test_check_before_serve.py): the diff (strict) still runs, and the
    graph's reads of the replaced tensors are stale."""
    model = Packed()
    t = _captured(model)
    model.weight = nn.Parameter(torch.empty(4, 3, device="meta"), requires_grad=False)
    model.packed = torch.empty(3, 4, device="meta")  # rebuilt: fingerprinted again
    report = t.diff()
    assert "packed" in set(report.stale["owners"].astype(str))


def test_copy_not_rebuilt_after_same_values_is_latent():
    model = Packed()
    t = _captured(model)
    with torch.no_grad():
        model.weight.copy_(model.weight.clone())  # same values, version counter moves
    (spot,) = _not_rebuilt(t.diff())
    assert "latent" in spot.text


@pytest.mark.parametrize("how", ["rebuilt", "untouched"])
def test_rebuilt_or_unchanged_copy_says_nothing(how):
    model = Packed()
    t = _captured(model)
    if how == "rebuilt":
        with torch.no_grad():
            model.weight.copy_(torch.randn(4, 3))
        model.process()
    report = t.diff()
    assert _not_rebuilt(report) == []
    if how == "rebuilt":
        assert set(report.stale.owners) == {"packed"}  # the rebuilt copy is a stale edge


class QuantizedPacked(nn.Module):
    """A float weight kept registered, and the packed quantized params its forward reads."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(3, 4), requires_grad=False)
        self.q = torch.ao.nn.quantized.dynamic.Linear(4, 3)
        self.process()

    def process(self):
        qw = torch.quantize_per_tensor(self.weight.detach(), 0.05, 0, torch.qint8)
        self.q.set_weight_bias(qw, None)

    def forward(self, x):
        return self.q(x)


@pytest.mark.parametrize("rebuild", [False, True])
def test_packed_script_object_copy(rebuild):
    if "fbgemm" not in torch.backends.quantized.supported_engines:
        pytest.skip("no fbgemm quantized engine")
    model = QuantizedPacked()
    t = _captured(model, copy="q._packed_params._packed_params")
    with torch.no_grad():
        model.weight.copy_(torch.randn(3, 4))
    if rebuild:
        model.process()
    found = _not_rebuilt(t.diff())
    assert len(found) == (0 if rebuild else 1)
    if found:
        assert found[0].holder == "q._packed_params._packed_params"


def test_watch_copy_misuse():
    with gt.trace(Packed()) as t:
        with pytest.raises(gt.GraphtraceError, match="no watched model is named 'other'"):
            t.watch_copy("packed", "weight", model="other")
        with pytest.raises(TypeError, match="copy must be a str"):
            t.watch_copy(3, "weight")


# -- pausing provenance -------------------------------------------------------------------
class Spy(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 3)
        self.stacks: list[list[type]] = []

    def forward(self, x):
        self.stacks.append([type(m) for m in _get_current_dispatch_mode_stack()])
        return self.lin(x)


def test_paused_provenance_is_off_the_dispatch_stack():
    model = Spy()
    with gt.trace(model, strict=True) as t:
        assert t.provenance_recording
        model(torch.ones(1, 3))
        t.pause_provenance()
        t.pause_provenance()  # idempotent
        assert not t.provenance_recording
        model(torch.ones(1, 3))
        made_paused = torch.ones(3, 3) * 2
        model.paused_made = made_paused
        with gt.capture("g"):
            model(torch.ones(1, 3)) + model.paused_made.sum()
        t.resume_provenance()
        assert t.provenance_recording
        model(torch.ones(1, 3))
        with t.provenance_paused():
            model(torch.ones(1, 3))
        model(torch.ones(1, 3))
    on = [ProvenanceMode in s for s in model.stacks]
    assert on == [True, False, False, True, False, True]
    report = t.diff()
    row = report.edges[report.edges.owners == "paused_made"]
    assert row.created_at.tolist() == [NOT_RECORDED]
    assert report.meta["provenance"]["suspends"] == 2


def test_pause_is_a_no_op_without_provenance_and_thread_bound():
    import threading

    with gt.trace(Spy(), provenance=False) as t:
        t.pause_provenance()
        assert not t.provenance_recording
    errors = []
    with gt.trace(Spy()) as t:
        th = threading.Thread(target=lambda: errors.append(_raises(t.pause_provenance)))
        th.start()
        th.join()
    assert errors and "thread that opened the trace" in errors[0]


def _raises(fn) -> str:
    try:
        fn()
    except gt.GraphtraceError as exc:
        return str(exc)
    return ""


def test_copy_rebuilt_on_one_update_and_forgotten_on_the_next():
    model = Packed()
    t = _captured(model)
    with torch.no_grad():
        model.weight.copy_(torch.randn(4, 3))
    model.process()
    assert _not_rebuilt(t.diff()) == []  # rebuilt: the new copy is the baseline now
    with torch.no_grad():
        model.weight.copy_(torch.randn(4, 3))  # forgotten this time
    (spot,) = _not_rebuilt(t.diff())
    assert spot.holder == "packed"
