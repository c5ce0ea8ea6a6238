"""Rules of lineage (graphtrace/lineage.py) and freshness (graphtrace/verdict.py) that a
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
