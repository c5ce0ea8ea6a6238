"""Rules of lineage (graphtrace/lineage/) and freshness (graphtrace/verdict.py) that a
planted bug got past (issue 42): each test here failed with one such bug planted and passes
without it. Public API only (`gt.trace`, `gt.capture`, `t.diff()`, `t.guard().check()`, a
guard loaded from JSON), every scenario checked in diff and guard (`assert_agree`)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import graphtrace as gt
from tests.test_differential import assert_agree

N = 4


def _param(*shape) -> nn.Parameter:
    return nn.Parameter(torch.rand(*shape), requires_grad=False)


def _trace(model, process, *, graphs=1, x=None):
    """`process(model)` inside the trace (lineage records it), then `graphs` captures of
    the model's forward; returns the trace and the graphs (kept alive by the caller)."""
    x = torch.rand(2, model.width) if x is None else x
    keep = []
    with torch.no_grad(), gt.trace(model, strict=True) as t:
        process(model)
        for i in range(graphs):
            with gt.capture(f"g{i}") as g:
                model(x)
            keep.append(g)
    return t, keep


def _rows(frame, holder: str):
    """The rows (edges of a report, or a guard's problem rows) whose owners are `holder`."""
    return frame[frame["owners"].astype(str) == holder]


def _judged(t, guards, holder: str, tmp_path=None):
    """(diff's verdicts, impacts, derived_from) of `holder`'s edges, after checking that
    every guard agrees with the diff."""
    report = t.diff()
    assert_agree(t, guards, report)
    rows = _rows(report.edges, holder)
    assert len(rows), f"no edge owned by {holder}"
    return (set(rows["verdict"].astype(str)), set(rows["impact"].astype(str)),
            set(rows["derived_from"].astype(str)))


# -- partial writes from several sources (lineage: only a full overwrite replaces sources) ---

class Concat(nn.Module):
    """A buffer filled by two partial writes, each from its own parameter (a fused QKV-style
    table): `cat[:4] = a * 2`, `cat[4:] = b * 2`."""

    width = 2 * N

    def __init__(self):
        super().__init__()
        self.a, self.b = _param(N), _param(N)
        self.cat = torch.empty(2 * N)

    def process(self):
        self.cat[:N].copy_(self.a * 2)
        self.cat[N:].copy_(self.b * 2)

    def forward(self, x):
        return x * self.cat


def test_two_partial_writes_keep_both_sources(tmp_path):
    m = Concat()
    t, keep = _trace(m, Concat.process)
    guard = t.guard()
    loaded = gt.load_guard(guard.to_json(tmp_path / "g.json"), m)
    assert _judged(t, [guard, loaded], "cat")[::2] == ({"stable"}, {"a; b"})
    with torch.no_grad():
        m.a.add_(1.0)  # the first half's source changes; nothing re-processes
    verdicts, impacts, sources = _judged(t, [guard, loaded], "cat")
    assert (verdicts, impacts, sources) == ({"unrefreshed"}, {"unknown"}, {"a; b"})
    rows = guard.check()
    assert list(rows["owners"]) == ["cat"] and list(rows["derived_from"]) == ["a; b"]
    assert list(rows["verdict"]) == ["unrefreshed"]
    del keep


# -- mixed sources in unrefreshed_impact: latent only when every changed source was rebound
# to equal bytes; one changed in place leaves no old value: unknown -------------------------

class Product(nn.Module):
    """A cache derived from two parameters (`table = a * b`), made in the process step."""

    width = N

    def __init__(self):
        super().__init__()
        self.a, self.b = _param(N), _param(N)
        self.table = None

    def process(self):
        self.table = self.a * self.b

    def forward(self, x):
        return x * self.table


@pytest.mark.parametrize("order", ["a-in-place", "b-in-place"])
def test_one_source_rebound_to_equal_bytes_and_one_changed_in_place_is_unknown(order, tmp_path):
    m = Product()
    t, keep = _trace(m, Product.process)
    guard = t.guard()
    loaded = gt.load_guard(guard.to_json(tmp_path / "g.json"), m)
    rebound, in_place = ("b", "a") if order == "a-in-place" else ("a", "b")
    old = getattr(m, rebound)
    keep.append(old)  # its old storage stays alive: its bytes can be compared
    setattr(m, rebound, nn.Parameter(old.detach().clone(), requires_grad=False))
    with torch.no_grad():
        getattr(m, in_place).add_(1.0)  # after the trace: only its version counter moves
    assert _judged(t, [guard, loaded], "table") == ({"unrefreshed"}, {"unknown"}, {"a; b"})
    assert list(guard.check()["impact"]) == ["unknown"]
    del keep


def test_every_changed_source_rebound_to_equal_bytes_is_latent(tmp_path):
    """The control of the test above: both sources rebound to equal bytes (a same-weights
    reload that binds new tensors) is latent."""
    m = Product()
    t, keep = _trace(m, Product.process)
    guard = t.guard()
    for name in ("a", "b"):
        old = getattr(m, name)
        keep.append(old)
        setattr(m, name, nn.Parameter(old.detach().clone(), requires_grad=False))
    assert _judged(t, [guard], "table") == ({"unrefreshed"}, {"latent"}, {"a; b"})
    assert list(guard.check()["impact"]) == ["latent"]
    del keep


# -- lineage's recording rules, each through a process step run inside the trace ------------

class Steps(nn.Module):
    """Three parameters and a table the graph reads, filled by the `process` step a test
    gives (so each test states the ops lineage sees)."""

    width = N

    def __init__(self, process):
        super().__init__()
        self.a, self.b, self.c = _param(N), _param(N), _param(N)
        self.table = torch.zeros(N)
        self.step = process

    def forward(self, x):
        return x * self.table


def _steps(process, tmp_path, **kw):
    m = Steps(process)
    t, keep = _trace(m, lambda m: m.step(m), **kw)
    guard = t.guard()
    loaded = gt.load_guard(guard.to_json(tmp_path / "g.json"), m)
    return m, t, keep, [guard, loaded]


def test_a_full_overwrite_replaces_the_sources(tmp_path):
    """table.copy_(a * 2), then table.copy_(b * 2) (the whole storage): only b is a source,
    and a later change of a leaves the table fresh."""
    def process(m):
        m.table.copy_(m.a * 2)
        m.table.copy_(m.b * 2)

    m, t, keep, guards = _steps(process, tmp_path)
    assert _judged(t, guards, "table")[::2] == ({"stable"}, {"b"})
    with torch.no_grad():
        m.a.add_(1.0)
    assert _judged(t, guards, "table")[::2] == ({"stable"}, {"b"})
    with torch.no_grad():
        m.b.add_(1.0)
    assert _judged(t, guards, "table")[::2] == ({"unrefreshed"}, {"b"})


def test_a_source_written_between_two_partial_writes_keeps_its_oldest_clock(tmp_path):
    """table[:2] from a, then a rewritten, then table[2:] from the new a: the first half
    still holds a value of the old a, so the table is unrefreshed at capture."""
    def process(m):
        m.table[:2].copy_(m.a[:2] * 2)
        m.a.copy_(torch.rand(N))  # a load of a, after the first half was made from it
        m.table[2:].copy_(m.a[2:] * 2)

    m, t, keep, guards = _steps(process, tmp_path)
    assert _judged(t, guards, "table") == ({"unrefreshed"}, {"unknown"}, {"a"})


def test_an_op_reading_a_source_directly_and_through_an_older_value_keeps_the_oldest(tmp_path):
    """`old = a * 2`, then a rewritten, then `table = old + a`: the table reads a value of the
    old a (through `old`), so it is unrefreshed at capture, whichever read comes first."""
    def process(m):
        old = m.a * 2
        m.a.copy_(torch.rand(N))
        m.table.copy_(old + m.a)

    m, t, keep, guards = _steps(process, tmp_path)
    assert _judged(t, guards, "table") == ({"unrefreshed"}, {"unknown"}, {"a"})


def test_derived_from_names_the_registered_roots_not_an_attribute_in_between(tmp_path):
    """`inv = 1 / b` kept as a plain attribute, `table = a * inv`: the table is derived from
    a and b; the attribute is a step, not a source (rebinding it changes no source)."""
    def process(m):
        m.inv = 1.0 / m.b
        m.table.copy_(m.a * m.inv)

    m, t, keep, guards = _steps(process, tmp_path)
    assert _judged(t, guards, "table")[::2] == ({"stable"}, {"a; b"})
    keep.append(m.inv)
    m.inv = torch.ones(N)  # another tensor at the attribute: not a source of the table
    assert _judged(t, guards, "table")[::2] == ({"stable"}, {"a; b"})


def _lineage_spots(report) -> list:
    return [b for b in report.meta["blind_spots"] if b["kind"] == "lineage"]


def test_exactly_max_sources_is_not_a_cut(monkeypatch, tmp_path):
    from graphtrace.lineage import graph as lineage_mod

    monkeypatch.setattr(lineage_mod, "MAX_SOURCES", 2)
    m, t, keep, guards = _steps(lambda m: torch.mul(m.a, m.b, out=m.table), tmp_path)  # a, b
    report = t.diff()
    assert report.meta["provenance"]["lineage"]["truncated"] == 0
    assert _lineage_spots(report) == []
    assert _judged(t, guards, "table")[::2] == ({"stable"}, {"a; b"})


def test_a_cut_keeps_the_oldest_sources_and_is_a_blind_spot(monkeypatch, tmp_path):
    """Sources over the cap: the oldest are kept (the parameters, never written, before the
    temporaries made from them), and the diff names the cut."""
    from graphtrace.lineage import graph as lineage_mod

    monkeypatch.setattr(lineage_mod, "MAX_SOURCES", 2)

    def process(m):
        m.table.copy_((m.a * 2) + (m.b * 3))  # 4 sources: a, a * 2, b, b * 3

    m, t, keep, guards = _steps(process, tmp_path)
    report = t.diff()
    assert report.meta["provenance"]["lineage"]["truncated"] >= 1
    assert len(_lineage_spots(report)) == 1
    assert _judged(t, guards, "table")[::2] == ({"stable"}, {"a; b"})


def test_a_rewrite_seen_while_the_trace_records_is_judged_by_its_new_record(tmp_path):
    """After the capture, still inside the trace: a changes in place, and the table is
    recomputed through `.data` (its owner's version counter does not move; lineage sees the
    write): fresh. Then a changes again and nothing recomputes: unrefreshed."""
    m = Steps(lambda m: m.table.copy_(m.a * 2))
    keep = []
    with torch.no_grad(), gt.trace(m, strict=True) as t:
        m.step(m)
        with gt.capture("g") as g:
            m(torch.rand(2, N))
        keep.append(g)
        guard = t.guard()  # live: it asks the trace's lineage
        m.a.add_(1.0)
        m.table.data.copy_(m.a * 2)  # recomputed, the owner's version counter unmoved
        assert _judged(t, [guard], "table")[::2] == ({"stable"}, {"a"})
        m.a.add_(1.0)
        assert _judged(t, [guard], "table")[::2] == ({"unrefreshed"}, {"a"})


def test_a_source_rewritten_before_the_capture_is_unrefreshed_in_a_guard_from_json(tmp_path):
    """The `stale` baseline travels in the manifest: a guard loaded from JSON (no lineage,
    no weak handles) still finds a table made from a's old value."""
    def process(m):
        m.table.copy_(m.a * 2)
        m.a.copy_(torch.rand(N))  # rewritten after the table was made from it

    m, t, keep, guards = _steps(process, tmp_path)
    assert _judged(t, guards, "table")[::2] == ({"unrefreshed"}, {"a"})
    assert list(guards[1].check()["verdict"]) == ["unrefreshed"]


# -- impact of an unrefreshed storage with several changed sources ---------------------------

def test_one_source_rebound_to_new_values_and_one_to_equal_bytes_is_unknown(tmp_path):
    m = Product()
    t, keep = _trace(m, Product.process)
    guard = t.guard()
    for name, delta in (("a", 1.0), ("b", 0.0)):
        old = getattr(m, name)
        keep.append(old)
        setattr(m, name, nn.Parameter(old.detach() + delta, requires_grad=False))
    assert _judged(t, [guard], "table") == ({"unrefreshed"}, {"unknown"}, {"a; b"})
    assert list(guard.check()["impact"]) == ["unknown"]


def test_a_source_written_through_data_while_recording_leaves_no_old_value(tmp_path):
    """a written through `.data` inside the trace (lineage sees it; no version counter moves)
    and b rebound to equal bytes: no old value of a is left to compare, unknown."""
    m = Product()
    keep = []
    with torch.no_grad(), gt.trace(m, strict=True) as t:
        m.process()
        with gt.capture("g") as g:
            m(torch.rand(2, N))
        keep.append(g)
        guard = t.guard()
        m.a.data.copy_(torch.rand(N))
        keep.append(m.b)
        m.b = nn.Parameter(m.b.detach().clone(), requires_grad=False)
        assert _judged(t, [guard], "table") == ({"unrefreshed"}, {"unknown"}, {"a; b"})
        assert list(guard.check()["impact"]) == ["unknown"]
