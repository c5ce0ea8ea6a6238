"""Lineage and freshness (issue 24): a storage the graphs read that its owners still hold, but
whose sources changed since it was last written, is `unrefreshed`, with `derived_from`; the
same through `t.diff()` and `guard.check()` (live and from JSON). Public API only, plus the
trace's `lineage` counters."""

from __future__ import annotations

import gc
import json
import weakref

import pytest
import torch
from torch import nn

import graphtrace as gt
from graphtrace.demo.cases.megatron_6723_a_neg_exp_cache import D, MambaModel
from graphtrace.guard import describe
from tests.test_differential import assert_agree

X = torch.rand(2, D, generator=torch.Generator().manual_seed(1))


def _capture(model, warmup=True, **trace_kwargs):
    """Warm up (the cache is filled, inside the trace), then capture two graphs."""
    keep = []
    with torch.no_grad(), gt.trace(model, strict=True, **trace_kwargs) as t:
        if warmup:
            model(X)
        for label, batch in (("decode", X[:1]), ("prefill", X)):
            with gt.capture(label) as g:
                model(batch)
            keep.append(g)
    return t, keep


def _model(**kw):
    torch.manual_seed(0)
    m = MambaModel(**kw).eval()
    m.refit(m.checkpoint(0))
    return m


def _verdicts(report, pattern="_A_neg_exp_cache"):
    e = report.edges
    rows = e[e["owners"].astype(str).str.contains(pattern, regex=False)]
    return set(rows["verdict"].astype(str)), set(rows["derived_from"].astype(str))


def test_refit_in_place_leaves_the_cache_unrefreshed_in_diff_and_guard(tmp_path):
    m = _model()
    t, keep = _capture(m)
    guard = t.guard()
    loaded = gt.load_guard(guard.to_json(tmp_path / "g.json"), m)
    assert _verdicts(t.diff()) == ({"stable"}, {"layers.0.A_log", "layers.1.A_log"})
    assert guard.check().empty
    m.refit(m.checkpoint(1))  # every parameter delivered, in place: identity holds
    report = t.diff()
    assert _verdicts(report) == ({"unrefreshed"}, {"layers.0.A_log", "layers.1.A_log"})
    stale = report.stale
    assert set(stale["verdict"].astype(str)) == {"unrefreshed"}
    assert set(stale["impact"].astype(str)) == {"unknown"}
    assert stale["owners"].astype(str).str.endswith("_A_neg_exp_cache").all()
    problems, _ = assert_agree(t, [guard, loaded], report)
    assert {v for *_, v in problems} == {"unrefreshed"}
    rows = guard.check()
    assert set(rows["derived_from"]) == {"layers.0.A_log", "layers.1.A_log"}
    assert "unrefreshed" in describe(rows) and "old value at the right address" in describe(rows)
    with pytest.raises(gt.StaleGraphError, match="unrefreshed"):
        guard.enforce()
    with pytest.raises(AssertionError, match="unrefreshed"):
        gt.assert_no_stale(report)
    del keep


def test_derived_from_follows_chains_of_ops_and_several_sources():
    class Fused(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Parameter(torch.rand(D), requires_grad=False)
            self.register_buffer("b", torch.rand(D))
            self.c = nn.Parameter(torch.rand(D), requires_grad=False)  # not a source
            self.table = None

        def forward(self, x):
            if self.table is None:  # several ops, temporaries in between, two sources
                t = torch.exp(self.a) * 2
                t = t.add(self.b.sqrt()).neg()
                self.table = torch.empty(D)
                self.table.copy_(t)
            return x * self.table + self.c

    m = Fused()
    t, keep = _capture(m)
    assert _verdicts(t.diff(), "table") == ({"stable"}, {"a; b"})
    with torch.no_grad():
        m.b.mul_(3)  # a buffer source changes in place
    assert _verdicts(t.diff(), "table") == ({"unrefreshed"}, {"a; b"})
    with torch.no_grad():
        m.c.add_(1)  # not a source of the table: no effect on it
    report = t.diff()
    assert _verdicts(report, "c") == ({"stable"}, {""})


@pytest.mark.parametrize("variant", ["recomputed-in-place", "graph-rewrites"])
def test_negative_controls_stay_clean(variant, tmp_path):
    m = _model(rewrite_in_forward=variant == "graph-rewrites")
    t, keep = _capture(m)
    guard = t.guard()
    loaded = gt.load_guard(guard.to_json(tmp_path / "g.json"), m)
    m.refit(m.checkpoint(1))
    if variant == "recomputed-in-place":
        for layer in m.layers:
            layer.refresh()
    report = t.diff()
    assert report.stale.empty
    verdicts, sources = _verdicts(report)
    assert verdicts == {"stable"} and sources == {"layers.0.A_log", "layers.1.A_log"}
    problems, _ = assert_agree(t, [guard, loaded], report)
    assert problems == set()


def test_a_rebound_source_is_a_change_and_a_rebound_cache_is_stale():
    m = _model()
    t, keep = _capture(m)
    guard = t.guard()
    m.layers[0].A_log = nn.Parameter(torch.rand(D), requires_grad=False)  # source rebound
    report = t.diff()
    e = report.edges
    cache0 = e[e["owners"].astype(str) == "layers.0._A_neg_exp_cache"]
    cache1 = e[e["owners"].astype(str) == "layers.1._A_neg_exp_cache"]
    assert set(cache0["verdict"].astype(str)) == {"unrefreshed"}
    assert set(cache1["verdict"].astype(str)) == {"stable"}
    assert_agree(t, [guard], report)
    m.layers[0]._A_neg_exp_cache = torch.zeros(D)  # identity first: the cache itself moved
    assert set(t.diff().edges.loc[cache0.index, "verdict"].astype(str)) == {"stale"}


def test_a_source_changed_before_the_capture_is_already_unrefreshed():
    m = _model()
    keep = []
    with torch.no_grad(), gt.trace(m, strict=True) as t:
        m(X)  # the cache is derived here
        m.refit(m.checkpoint(1))  # ... and its source changes before the capture
        with gt.capture("decode") as g:
            m(X)
        keep.append(g)
    guard = t.guard()
    report = t.diff()
    assert _verdicts(report)[0] == {"unrefreshed"}
    assert_agree(t, [guard], report)


def test_a_write_through_data_is_seen_while_the_trace_records():
    """`param.data.copy_` does not advance the parameter's version counter; lineage (open
    trace) sees the write itself. After the trace it is not seen (Note [freshness])."""
    m = _model()
    keep = []
    with torch.no_grad(), gt.trace(m, strict=True) as t:
        m(X)
        with gt.capture("decode") as g:
            m(X)
        keep.append(g)
        guard = t.guard()  # live: it consults the trace's lineage while that lives
        for p in m.layers[0].parameters():
            p.data.copy_(torch.rand_like(p))  # vLLM's default weight loader
        report = t.diff()
        assert_agree(t, [guard], report)
    e = report.edges
    assert set(e[e["owners"].astype(str) == "layers.0._A_neg_exp_cache"]["verdict"]
               .astype(str)) == {"unrefreshed"}
    assert set(e[e["owners"].astype(str) == "layers.1._A_neg_exp_cache"]["verdict"]
               .astype(str)) == {"stable"}


def test_an_unowned_derived_storage_is_unrefreshed_too(tmp_path):
    store = {}

    class Outside(nn.Module):  # the derived table lives outside the model: no owner
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.rand(D), requires_grad=False)

        def forward(self, x):
            if "t" not in store:
                store["t"] = self.w * 2
            return x * store["t"]

    m = Outside()
    t, keep = _capture(m)
    guard = t.guard()
    loaded = gt.load_guard(guard.to_json(tmp_path / "g.json"), m)
    with torch.no_grad():
        m.w.add_(1)
    report = t.diff()
    e = report.edges
    rows = e[e["derived_from"].astype(str) == "w"]
    assert len(rows) == 2 and set(rows["verdict"].astype(str)) == {"unrefreshed"}
    assert set(rows["owners"].astype(str)) == {""}
    assert_agree(t, [guard, loaded], report)


def test_lineage_off_is_identity_only():
    m = _model()
    t, keep = _capture(m, lineage=False)
    assert t.lineage is None
    m.refit(m.checkpoint(1))
    report = t.diff()
    assert _verdicts(report) == ({"stable"}, {""})
    assert report.meta["provenance"]["lineage"] == {"enabled": False}


def test_nothing_is_kept_alive_and_dead_storages_are_released():
    gc.disable()
    try:
        m = _model()
        with torch.no_grad(), gt.trace(m, strict=True) as t:
            a = torch.rand(1000)
            b = a.exp()
            c = b * 2
            refs = [weakref.ref(x) for x in (a, b, c)]
            storages = [x.untyped_storage()._cdata for x in (a, b, c)]
            lineage = t.lineage
            assert all(s in lineage.nodes for s in storages)
            del a, b, c
            assert all(r() is None for r in refs)  # no tensor kept alive
            lineage.sweep()
            assert not any(s in lineage.nodes for s in storages)  # handles released
            assert all(not node[2] or not set(node[2]) & set(storages)
                       for node in lineage.nodes.values())
        mref = weakref.ref(m)
        del m
        assert mref() is None  # the trace and its lineage keep no model alive
        t.lineage.release()
        assert len(t.lineage) == 0
    finally:
        gc.enable()


def test_the_edge_cap_is_a_counted_blind_spot(monkeypatch):
    from graphtrace.lineage import graph as lineage_mod

    monkeypatch.setattr(lineage_mod, "MAX_EDGES", 4)
    m = _model()
    t, keep = _capture(m)
    meta = t.lineage.meta()
    assert meta["ops_skipped"] > 0 and meta["edges"] <= 4 + lineage_mod.MAX_SOURCES
    report = t.diff()
    spots = [b for b in report.meta["blind_spots"] if b["kind"] == "lineage"]
    assert len(spots) == 1 and "ops not recorded" in spots[0]["text"]
    assert report.meta["provenance"]["lineage"]["ops_skipped"] == meta["ops_skipped"]


def test_a_failing_lineage_hook_fails_open(monkeypatch):
    import graphtrace.lineage as lineage_mod

    def broken(self, *a, **k):
        raise RuntimeError("lineage broke")

    monkeypatch.setattr(lineage_mod.Lineage, "record", broken)
    m = _model()
    keep = []
    with torch.no_grad(), gt.trace(m) as t:  # not strict: errors are counted
        y = m(X)  # the program runs as without graphtrace
        with gt.capture("decode") as g:
            m(X)
        keep.append(g)
    assert torch.isfinite(y).all()
    report = t.diff()
    assert any(e["where"] == "lineage" and "lineage broke" in e["message"]
               for e in report.errors)
    assert _verdicts(report) == ({"stable"}, {""})  # identity verdicts still stand


def test_guard_manifest_derived_is_optional_and_checked(tmp_path):
    m = _model()
    t, keep = _capture(m)
    path = t.guard().to_json(tmp_path / "g.json")
    data = json.loads(path.read_text())
    derived = [s for s in data["storages"] if "derived" in s]
    assert derived and all(s["derived"]["sources"][0]["path"].endswith("A_log")
                           for s in derived)
    older = {**data, "storages": [{k: v for k, v in s.items() if k != "derived"}
                                  for s in data["storages"]]}
    (tmp_path / "old.json").write_text(json.dumps(older))
    old = gt.load_guard(tmp_path / "old.json", m)  # an older manifest still loads
    m.refit(m.checkpoint(1))
    assert old.check().empty  # ... and checks identity only
    bad = json.loads(path.read_text())
    next(s for s in bad["storages"] if "derived" in s)["derived"]["sources"] = "A_log"
    (tmp_path / "bad.json").write_text(json.dumps(bad))
    with pytest.raises(gt.GraphtraceError, match=r"storages\[\d+\]\.derived"):
        gt.load_guard(tmp_path / "bad.json")


def test_a_manifest_from_another_process_takes_its_baselines_at_attach(tmp_path):
    m = _model()
    t, keep = _capture(m)
    path = t.guard().to_json(tmp_path / "g.json")
    data = json.loads(path.read_text())
    for s in data["storages"]:
        if "derived" in s:
            s["derived"]["process"] = "another"
            for src in s["derived"]["sources"]:
                src["version"] = 12345  # meaningless here
    (tmp_path / "other.json").write_text(json.dumps(data))
    other = gt.load_guard(tmp_path / "other.json", m)
    assert other.check().empty  # baselines taken at attach: no false alarm
    m.refit(m.checkpoint(1))
    assert set(other.check()["verdict"]) == {"unrefreshed"}


def test_older_report_without_derived_from_loads():
    from pathlib import Path

    report = gt.load_report(Path(__file__).parent / "data" / "reload_report")
    assert "derived_from" in report.edges.columns
    assert set(report.edges["derived_from"].astype(str)) == {""}


def test_the_terminal_report_names_the_sources_and_the_fix():
    from graphtrace.cli import format_report, stale_reads
    from graphtrace.vocab import FIXES

    m = _model()
    t, keep = _capture(m)
    m.refit(m.checkpoint(1))
    report = t.diff()
    reads = stale_reads(report)
    assert list(reads["derived_from"]) == ["layers.0.A_log", "layers.1.A_log"]
    assert set(report.stale["fix"].astype(str)) == {FIXES["recompute-in-place"]}
    lines = format_report(report).splitlines()
    i = lines.index("      layers.0._A_neg_exp_cache (attribute, holds)")
    assert lines[i + 1] == "      derived from: layers.0.A_log"
    assert lines[i - 1].split()[:2] == ["unrefreshed", "unknown"]


def test_watch_copy_declares_lineage_for_a_producer_lineage_cannot_see():
    """A copy made before the trace (or by code off the dispatcher): declared with
    t.watch_copy, it is derived from its source, and unrefreshed once the source changes."""
    class Packed(nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = nn.Parameter(torch.rand(D, D), requires_grad=False)
            self.packed = self.weight.detach().t().contiguous()  # made outside any trace

        def forward(self, x):
            return x @ self.packed

    m = Packed()
    with torch.no_grad(), gt.trace(m, strict=True) as t:
        t.watch_copy("packed", "weight")
        with gt.capture("g") as g:
            m(X)
        m.weight.add_(1.0)  # the source changes; the copy is not rebuilt
    e = t.diff().edges
    row = e[e["owners"] == "packed"]
    assert list(row["verdict"].astype(str)) == ["unrefreshed"]
    assert list(row["derived_from"].astype(str)) == ["weight"]
    rows = t.guard().check()  # and the copy not rebuilt, as the diff's blind spot names it
    assert list(zip(rows["verdict"], rows["blind_spot"])) == [
        ("unrefreshed", ""), ("unchecked", "packed copy not rebuilt")]
    del g


def test_the_guard_finds_a_second_update_without_recompute_after_a_clean_one():
    """Note [guard rebaseline] in graphtrace/guard/check.py: after an update that recomputed the
    derived cache in place (clean), a second update that changes its source again and does not
    recompute it is unrefreshed (the baselines moved with the clean check)."""
    model = MambaModel().eval()
    model.refit(model.checkpoint(0))
    x = torch.rand(2, 8)
    with torch.no_grad(), gt.trace(model, strict=True) as t:
        model(x)  # the cache is filled here, in the trace
        with gt.capture("g") as g:
            model(x)
    guard = t.guard()
    model.refit(model.checkpoint(1))
    for layer in model.layers:
        layer.refresh()
    assert guard.check().empty
    assert guard.check().empty  # the same answer again, from the new baselines
    model.refit(model.checkpoint(2))  # no recompute this time
    problems = guard.check()
    assert set(problems["verdict"]) == {"unrefreshed"}, problems
    assert set(problems["derived_from"]) == {"layers.0.A_log", "layers.1.A_log"}
    del g


def test_clean_checks_skip_the_freshness_pass_until_a_source_changes(monkeypatch):
    """Note [guard freshness fast path] in graphtrace/guard/check.py: after a clean check, a check
    asks C++ whether a source path reaches another storage or version counter (and whether
    lineage recorded since) before walking every derived storage in Python; a source changed
    in place, a rebound source and a write lineage records are still found."""
    from graphtrace import native
    from graphtrace import verdict as engine

    if native.load() is None:
        pytest.skip("the native module does not build here")
    model = _model()
    t, keep = _capture(model)
    guard = t.guard()
    assert guard.check().empty
    full_passes = []
    real = engine.freshness_of  # the freshness pass's (verdict.freshness)

    def counted(*args, **kwargs):
        full_passes.append(1)
        return real(*args, **kwargs)
    monkeypatch.setattr(engine, "freshness_of", counted)
    assert guard.check().empty and guard.check().empty
    assert not full_passes, "a clean check after a clean one walked every derived storage"
    model.refit(model.checkpoint(1))  # in place, no recompute: versions move
    assert set(guard.check()["verdict"]) == {"unrefreshed"}
    assert full_passes
    # rebound: a new tensor with the same values at the source's path
    model = _model()
    t, keep = _capture(model)
    guard = t.guard()
    assert guard.check().empty and guard.check().empty
    layer = model.layers[0]
    layer.A_log = nn.Parameter(layer.A_log.detach().clone() + 1)
    problems = guard.check()
    assert set(problems["verdict"]) == {"unrefreshed"}
    assert set(problems["derived_from"]) == {"layers.0.A_log"}
    del keep


class _KeptScale(nn.Module):
    """A linear layer whose method keeps a scale the forward reads; the scale is made from
    no weight, and a weight loader may refresh it in place from `norm` (Note [derived during
    updates] in graphtrace/lineage/graph.py)."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 8)
        self.norm = nn.Parameter(torch.ones(8))
        self.method = type("Method", (), {})()
        self.method.scale = torch.ones(8)

    def forward(self, x):
        return self.proj(x) * self.method.scale

    def load(self, norm: torch.Tensor, refresh: bool) -> None:
        """One update: the norm's loader writes the new weight, and (`refresh`) the scale
        from it, in place."""
        self.norm.copy_(norm)
        if refresh:
            self.method.scale.copy_(1 + 1e-3 * self.norm.mean() * torch.ones(8))


@pytest.mark.parametrize("guard_first", [True, False], ids=["guard-built-before", "guard-after"])
def test_a_storage_first_derived_during_an_update_is_judged_at_the_next(guard_first):
    """A captured storage made from no weight, refreshed in place from a weight during one
    update and left alone by the next, which loads a new weight: `unrefreshed` in diff and
    guard, naming the weight (the guard built before either update, as vLLM's is)."""
    model = _KeptScale().eval()
    x = torch.rand(2, 8)
    with torch.no_grad(), gt.trace(model, strict=True) as t:
        with gt.capture("g") as g:
            model(x)
        guard = t.guard() if guard_first else None
        with t.updating():
            model.load(torch.full((8,), 2.0), refresh=True)
        assert (guard or t.guard()).check().empty
        e = t.diff().edges
        row = e[e["owners"].astype(str) == "method.scale"]
        assert list(row["verdict"]) == ["stable"] and list(row["derived_from"]) == ["norm"]
        with t.updating():
            model.load(torch.full((8,), 3.0), refresh=False)  # a new weight; scale left alone
        problems = (guard or t.guard()).check()
        assert list(problems["verdict"]) == ["unrefreshed"], problems
        assert list(problems["derived_from"]) == ["norm"]
        e = t.diff().edges
        row = e[e["owners"].astype(str) == "method.scale"]
        assert list(row["verdict"]) == ["unrefreshed"] and list(row["derived_from"]) == ["norm"]
        with t.updating():
            model.load(torch.full((8,), 4.0), refresh=True)
        assert (guard or t.guard()).check().empty
    assert t.lineage.late == 1
    del g


def test_a_load_during_an_update_derives_nothing():
    """Weights written from checkpoint tensors (a load) get no `Derived`, and an update that
    touches no captured storage makes no late match."""
    model = _KeptScale().eval()
    x = torch.rand(2, 8)
    with torch.no_grad(), gt.trace(model, strict=True) as t:
        with gt.capture("g") as g:
            model(x)
        with t.updating():
            model.proj.weight.copy_(torch.rand(8, 8))
            model.load(torch.full((8,), 2.0), refresh=False)
        report = t.diff()
        assert set(report.edges["verdict"].astype(str)) == {"stable", "unowned"}  # x, out
        assert set(report.edges["derived_from"].astype(str)) == {""}
        assert t.guard().check().empty
    assert t.lineage.late == 0
    del g


# -- engine state (Note [engine state]) ---------------------------------------------------------

def _state_capture(declare: bool):
    """A 'KV cache' and a derived cache, both written from the weight outside the capture and
    read inside it; the KV cache declared engine state when `declare`."""
    m = torch.nn.Linear(4, 4, bias=False)
    kv, cache, x = torch.zeros(2, 4), torch.zeros(2, 4), torch.randn(2, 4)
    with gt.trace(m, strict=True) as t, torch.no_grad():
        kv.copy_(m(x))                  # what a prefill writes into the KV cache
        cache.copy_(m.weight[:2] * 2)   # a value derived once from the weight
        if declare:
            assert t.declare_state([kv, torch.zeros(1)]) == 1  # lineage knew kv only
        with gt.capture("decode"):
            (m(x) + kv + cache).sum()
    with torch.no_grad():
        m.weight.copy_(torch.randn(4, 4))  # an update in place
    e = t.diff().edges
    verdict = {p: e.loc[e["data_ptr"] == p, "verdict"].astype(str).iloc[0]
               for p in (kv.data_ptr(), cache.data_ptr())}
    return verdict[kv.data_ptr()], verdict[cache.data_ptr()]


def test_declared_engine_state_is_not_unrefreshed_and_a_derived_cache_still_is():
    assert _state_capture(declare=True) == ("unowned", "unrefreshed")
    assert _state_capture(declare=False) == ("unrefreshed", "unrefreshed")  # what it fixes


def test_the_detectors_are_plug_ins_of_the_graph_and_another_gets_the_same_hooks():
    """Note [lineage plug-ins]: the graph's three detectors are plug-ins registered on it (their
    findings in that order), and a plug-in added to a trace's lineage is fed by the same
    `record`: each write outside optimizer steps, each read, each storage written, and its
    findings reach the report."""
    from graphtrace.lineage.handles import DanglingSources
    from graphtrace.lineage.steps import CarriedOver, NonIdempotent

    class Counting:
        def __init__(self):
            self.calls: dict[str, list] = {"written": [], "read": [], "wrote": []}

        def written(self, graph, func, op, written, reads):
            self.calls["written"].append(str(func))

        def read(self, graph, func, reads, sources):
            self.calls["read"].append(str(func))

        def wrote(self, graph, storage, address, sources):
            self.calls["wrote"].append(address)

        def findings(self, graph, models):
            return [{"kind": "non-idempotent step", "holder": "counted", "op": "x",
                     "source": "", "source_kind": "buffer", "site": "",
                     "n": len(self.calls["written"])}]

    m = _model()
    plug = Counting()
    with torch.no_grad(), gt.trace(m, strict=True) as t:
        assert [type(d) for d in t.lineage.detectors] == [DanglingSources, NonIdempotent,
                                                          CarriedOver]
        t.lineage.add(plug)
        m.refit(m.checkpoint(1))  # writes the cache from the weights, in place
        with gt.capture("g") as g:
            m(X)
    assert plug.calls["written"] and plug.calls["read"] and plug.calls["wrote"]
    counted = [f for f in t.diff().meta["findings"] if f["holder"] == "counted"]
    assert counted and counted[0]["n"] == len(plug.calls["written"])
    del g
