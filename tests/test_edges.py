"""The edges of the captures and their origin (graphtrace.edges, Note [write before read]):
storages a graph overwrites before it reads them are internal, and stable whoever owns them."""

from __future__ import annotations

import warnings

import pytest
import torch

import graphtrace as gt

pytestmark = pytest.mark.usefixtures("writer")


def _weight_normed(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # legacy weight_norm is deprecated
        return torch.nn.utils.weight_norm(torch.nn.Linear(4, 4))


def test_legacy_weight_norm_is_internal_not_stale():
    model = _weight_normed()
    x = torch.rand(2, 4)
    with gt.trace(model, strict=True) as t:
        with gt.capture("g") as g:
            out = model(x)
    captured_weight = model.weight
    with torch.no_grad():  # a reload: new values into the registered parameters
        model.weight_v.mul_(2).add_(0.5)
        model.weight_g.add_(1.0)
    eager = model(x)  # the pre-hook rebinds `weight` to a new tensor
    assert model.weight is not captured_weight
    g.replay()
    assert torch.allclose(out, eager), "replay recomputes weight: it must equal eager"
    report = t.diff()
    w = report.edges[report.edges.owners == "weight"]
    assert len(w) == 1
    assert w.verdict.iloc[0] == "stable" and w.origin.iloc[0] == "internal"
    owner = report.owners[report.owners.path == "weight"]
    assert list(owner.status) == ["moved"]  # the owner did move; the graph does not care
    assert report.stale.empty
    # the registered parameters the graph reads are owned and external
    v = report.edges[report.edges.owners == "weight_v"]
    assert list(v.origin) == ["external"] and list(v.verdict) == ["stable"]


class ReadModifyWrite(torch.nn.Module):
    """A cache written first, but not overwritten: `add_` reads what it writes, and a
    `copy_` into half of it leaves the other half read from before."""

    def __init__(self):
        super().__init__()
        self.acc = torch.ones(4)
        self.half = torch.ones(4)

    def forward(self, x):
        self.acc.add_(x)
        self.half[:2].copy_(x[:2])
        return self.acc * self.half


def test_first_writes_that_read_or_do_not_cover_stay_external():
    model = ReadModifyWrite()
    with gt.trace(model, strict=True) as t:
        with gt.capture("g") as g:
            model(torch.rand(4))
    model.acc = torch.ones(4)
    model.half = torch.ones(4)
    e = t.diff().edges.set_index("owners")
    assert e.loc["acc", "origin"] == "external" and e.loc["acc", "verdict"] == "stale"
    assert e.loc["half", "origin"] == "external" and e.loc["half", "verdict"] == "stale"
    assert len(g)


class Overwrite(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.buf = torch.zeros(4)

    def forward(self, x):
        self.buf.copy_(x * 2)   # overwritten whole before it is read
        return self.buf + 1


def test_a_whole_overwrite_before_the_read_is_internal():
    model = Overwrite()
    with gt.trace(model, strict=True) as t:
        with gt.capture("g") as g:
            model(torch.rand(4))
    model.buf = torch.zeros(4)
    e = t.diff().edges.set_index("owners")
    assert e.loc["buf", "origin"] == "internal" and e.loc["buf", "verdict"] == "stable"
    assert len(g)
