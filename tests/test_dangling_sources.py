"""Dangling sources (issue 24, Note [dangling sources] in graphtrace/lineage/handles.py): a handle an
op made from given storages (an int pointer held in a tensor, as vLLM's oneDNN handler holds
one) whose source was freed while the model keeps that value elsewhere is `dangling`, with
the freed source named: with a graph (the edge's verdict, in `t.diff()` and `guard.check()`)
and without one (`t.findings()`, `report.findings`).

The stand-in op keeps what vLLM's `_C::create_onednn_scaled_mm_handler` keeps: a copy of the
weight (prepacked) and a *pointer* to the weight scale; here the pointer is a weak reference,
and a forward through a handle whose scale is gone returns NaN (what reading freed memory
gives is whatever the allocator put there)."""

from __future__ import annotations

import weakref

import pytest
import torch
from torch import nn

import graphtrace as gt
from graphtrace.vocab import FINDING_FIELDS

_lib = torch.library.Library("gt_handles", "DEF")
_lib.define("make_handle(Tensor w, Tensor s) -> int")
_lib.define("use_handle(Tensor x, Tensor h) -> Tensor")
_REGISTRY: dict[int, tuple] = {}


def _make_handle(w, s):
    key = 0x7F0000000000 + len(_REGISTRY) * 64  # looks like a pointer; unique per handle
    _REGISTRY[key] = (w.detach().clone(), weakref.ref(s))  # copies w, points at s
    return key


def _use_handle(x, h):
    w, s = _REGISTRY[int(h.item())]
    scale = s()
    if scale is None:  # the pointer reaches freed memory
        return torch.full((x.shape[0], w.shape[0]), float("nan"))
    return (x @ w.t()) * scale.reshape(1, -1)


_lib.impl("make_handle", _make_handle, "CPU")
_lib.impl("use_handle", _use_handle, "CPU")
# as vLLM registers its handler factories (a C++ function given to `def`): a composite
# kernel, which the dispatch mode never sees (Note [handle mode]); its own library, dropped
# after this module so that later tests run without a handle mode
# (made when this module's tests run, not when pytest collects it: a registered composite
# handle op puts a handle mode in every later trace of the process)
_composite = None
FACTORIES = {"cpu": torch.ops.gt_handles.make_handle, "composite": None}


def _composite_factory():
    global _composite
    if _composite is None:
        _composite = torch.library.Library("gt_handles_composite", "DEF")
        _composite.define("make_handle(Tensor w, Tensor s) -> int")
        _composite.impl("make_handle", _make_handle, "CompositeImplicitAutograd")
    return torch.ops.gt_handles_composite.make_handle


def teardown_module():
    global _composite
    _composite = None  # its finalizer removes the op
    import gc

    gc.collect()


class Handler:
    """vLLM's CPUDNNLGEMMHandler: the pointer, in a tensor so that it is not inlined."""

    factory = FACTORIES["cpu"]

    def __init__(self, weight, scale):
        self.handler_tensor = torch.tensor(type(self).factory(weight, scale), dtype=torch.int64)


class HandleLinear(nn.Module):
    def __init__(self, n=4, k=8, seed=0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.weight = nn.Parameter(torch.randn(n, k, generator=g), requires_grad=False)
        self.weight_scale = nn.Parameter(torch.rand(n, 1, generator=g) + 0.5,
                                         requires_grad=False)
        self.handler = None

    def process_weights_after_loading(self):
        """As vLLM's CPU int8 kernel: build the handle, then release the prepacked weight."""
        self.handler = Handler(self.weight, self.weight_scale)
        self.weight = None

    def forward(self, x):
        return torch.ops.gt_handles.use_handle(x, self.handler.handler_tensor)


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = HandleLinear()

    def forward(self, x):
        return self.proj(x)


def layerwise_reload(model, keep=None):
    """vLLM's layerwise reload, as it treats this layer: the new values go into temporaries
    registered on the layer, the layer is processed, the values are copied back into the
    original parameter, which is registered again, and the temporaries are dropped (`keep`:
    a list that keeps them, the repro's control)."""
    layer = model.proj
    original = layer.weight_scale
    g = torch.Generator().manual_seed(1)
    layer.weight = nn.Parameter(torch.randn(4, 8, generator=g), requires_grad=False)
    layer.weight_scale = nn.Parameter(original.detach().clone(), requires_grad=False)
    layer.process_weights_after_loading()
    with torch.no_grad():
        original.copy_(layer.weight_scale)
    if keep is not None:
        keep.append(layer.weight_scale)
    layer.weight_scale = original


X = torch.rand(2, 8, generator=torch.Generator().manual_seed(2))


@pytest.fixture(params=sorted(FACTORIES), autouse=True)
def factory(request, monkeypatch):
    """Each test with a handle op the dispatch mode sees and with one only the handle mode
    sees."""
    monkeypatch.setattr(Handler, "factory", FACTORIES[request.param]
                        if request.param == "cpu" else _composite_factory())
    return request.param


def _loaded():
    model = Model()
    model.proj.process_weights_after_loading()
    return model


def test_a_handle_whose_source_the_reload_freed_is_a_finding_without_a_graph():
    model = _loaded()
    with torch.no_grad(), gt.trace(model, strict=True) as t:
        assert t.findings().empty
        layerwise_reload(model)
        out = model(X)
    assert torch.isnan(out).all()  # the stand-in's pointer reaches a freed scale
    f = t.findings()
    assert list(f.columns) == list(FINDING_FIELDS)
    rows = {r.source: r for r in f.itertuples()}
    assert set(rows) == {"proj.weight_scale", "proj.weight"}
    scale, weight = rows["proj.weight_scale"], rows["proj.weight"]
    assert scale.kind == "dangling source" and scale.source_kind == "parameter"
    assert scale.holder == "proj.handler.handler_tensor"
    assert scale.op in ("gt_handles::make_handle", "gt_handles_composite::make_handle")
    # the weight was prepacked and set to None on purpose: listed, not dangling
    assert weight.kind == "released source"


def test_keeping_the_source_alive_is_clean():
    model, keep = _loaded(), []
    with torch.no_grad(), gt.trace(model, strict=True) as t:
        layerwise_reload(model, keep=keep)
        out = model(X)
    assert torch.isfinite(out).all()
    f = t.findings()
    assert set(f["kind"]) == {"released source"}  # only the consumed weight
    keep.clear()  # the temporary goes now: the same handle dangles
    assert set(t.findings()["kind"]) == {"released source", "dangling source"}


def test_a_captured_handle_with_a_freed_source_is_dangling_in_diff_and_guard(tmp_path):
    model = _loaded()
    with torch.no_grad(), gt.trace(model, strict=True) as t:
        layerwise_reload(model)
        with gt.capture("decode"):
            model(X)
    report = t.diff()
    e = report.edges[report.edges["owners"] == "proj.handler.handler_tensor"]
    assert list(e["verdict"].astype(str)) == ["dangling"]
    assert e["derived_from"].astype(str).iloc[0] == "proj.weight; proj.weight_scale (freed)"
    assert e["impact"].astype(str).iloc[0] == "unknown"
    assert set(report.findings["kind"]) == {"dangling source", "released source"}
    rows = t.guard().check()
    assert list(rows["verdict"]) == ["dangling"]
    assert list(rows["derived_from"]) == ["proj.weight; proj.weight_scale (freed)"]
    with pytest.raises(gt.StaleGraphError, match="dangling"):
        t.guard().enforce()
    # the findings survive the round trip through CSV
    loaded = gt.load_report(report.to_csv(tmp_path / "r"))
    assert loaded.findings.equals(report.findings)


def test_a_captured_handle_whose_sources_live_is_stable_and_derived():
    model = Model()
    with torch.no_grad(), gt.trace(model, strict=True) as t:
        model.proj.weight_scale.mul_(1.0)  # something lineage saw write the scale
        model.proj.process_weights_after_loading()
        with gt.capture("decode"):
            model(X)
    report = t.diff()
    e = report.edges[report.edges["owners"] == "proj.handler.handler_tensor"]
    assert list(e["verdict"].astype(str)) == ["stable"]
    assert e["derived_from"].astype(str).iloc[0] == "proj.weight; proj.weight_scale"
    assert t.guard().check().empty
    # the weight was consumed; the scale's in-place update is a non-idempotent step
    assert set(report.findings["kind"]) == {"released source", "non-idempotent step"}


def test_a_handle_is_derived_and_unrefreshed_when_its_source_changes_in_place():
    model = Model()
    with torch.no_grad(), gt.trace(model, strict=True) as t:
        model.proj.process_weights_after_loading()
        with gt.capture("decode"):
            model(X)
        model.proj.weight_scale.mul_(2.0)  # a new scale, and no new handle
    e = t.diff().edges
    e = e[e["owners"] == "proj.handler.handler_tensor"]
    assert list(e["verdict"].astype(str)) == ["unrefreshed"]
    assert list(t.guard().check()["verdict"]) == ["unrefreshed"]


def test_no_lineage_no_findings():
    model = _loaded()
    with torch.no_grad(), gt.trace(model, strict=True, lineage=False) as t:
        layerwise_reload(model)
    assert t.findings().empty


def test_the_lineage_is_in_report_graph_and_the_cli_prints_the_chain(tmp_path, capsys):
    from graphtrace import cli

    model = _loaded()
    with torch.no_grad(), gt.trace(model, strict=True) as t:
        layerwise_reload(model)
        with gt.capture("decode"):
            model(X)
    report = t.diff()
    G = report.graph
    (sid,) = set(report.edges.loc[report.edges["owners"] == "proj.handler.handler_tensor",
                                  "storage_id"])
    lineage = {(u, d["freed"]) for u, v, d in G.in_edges(f"storage:{sid}", data=True)
               if d["relation"] == "derived_from"}
    assert lineage == {("owner::proj.weight", False), ("owner::proj.weight_scale", True)}
    folder = report.to_csv(tmp_path / "r")
    assert cli.main(["report", str(folder), "--width", "200"]) == 0
    out = capsys.readouterr().out
    assert "chain: proj.weight_scale (freed) -> proj.handler.handler_tensor -> decode" in out
    assert "Findings (2)" in out
    assert "dangling source: proj.handler.handler_tensor <- proj.weight_scale" in out


def test_a_pointer_made_where_lineage_cannot_see_is_a_blind_spot_naming_its_holder():
    model = _loaded()  # the handle was made before the trace: no lineage behind it
    with torch.no_grad(), gt.trace(model, strict=True) as t:
        with gt.capture("decode") as g:
            model(X)
    report = t.diff()
    spots = [b for b in report.blind_spot_records if b.kind == "opaque handle"
             and b.holder == "proj.handler.handler_tensor"]
    assert len(spots) == 1 and spots[0].op == "gt_handles::use_handle"
    assert "producer lineage did not see" in spots[0].text
    assert "proj.handler.handler_tensor" in set(report.blind_spot_edges(spots[0])["owners"])
    del g


def test_a_pointer_lineage_saw_made_is_not_a_blind_spot():
    model = Model()
    with torch.no_grad(), gt.trace(model, strict=True) as t:
        model.proj.process_weights_after_loading()
        with gt.capture("decode") as g:
            model(X)
    assert not [b for b in t.diff().blind_spot_records if b.kind == "opaque handle"]
    del g
