"""The trace session and its emulated graphs, through the public API: replay reads and writes
the captured storages (whatever the model does to its tensors since), nothing is kept alive
that the user dropped (the garbage collector off), and watched models are held weakly."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from torch.multiprocessing.reductions import StorageWeakRef

import graphtrace as gt

pytestmark = pytest.mark.usefixtures("writer")


class Ops(torch.nn.Module):
    """One parameter read by several kinds of op: a view, an out-of-place op, an in-place
    read into a buffer, a list argument."""

    def __init__(self, n: int = 4):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.arange(n * n, dtype=torch.float32).view(n, n))
        self.register_buffer("acc", torch.zeros(n))

    def forward(self, x):
        y = x @ self.weight.t()                      # a view of the parameter, then mm
        y = y + self.weight[0]                       # a slice
        self.acc.copy_(self.weight.sum(0))           # in place into a buffer
        return torch.cat([y, self.weight]).sum(0) + self.acc


# -- emulated graphs keep the captured storages ----------------------------------------------

def test_replay_reads_the_captured_storage_after_data_rebinding():
    model = Ops()
    x = torch.ones(2, 4)
    with gt.trace(model, strict=True):
        with gt.capture("g") as g:
            out = model(x)
    expected = out.clone()
    old_weight = model.weight.detach().clone()
    model.weight.data = torch.full((4, 4), 100.0)   # what .to()/.half()/.float() do
    model.acc.data = torch.full((4,), 7.0)
    g.replay()
    assert torch.equal(out, expected), "replay must read the storages captured, for every op"
    assert torch.equal(model(x), model(x))  # eager reads the new ones
    assert not torch.equal(model(x), expected)
    assert torch.equal(old_weight, old_weight)


def test_replay_after_model_half_float_reads_old_storage():
    model = Ops()
    x = torch.ones(2, 4)
    with gt.trace(model, strict=True):
        with gt.capture("g") as g:
            out = model(x)
    expected = out.clone()
    model.half().float()  # new storages for every parameter and buffer
    with torch.no_grad():
        model.weight.mul_(3)
    g.replay()
    assert torch.equal(out, expected)


class OutKwarg(torch.nn.Module):
    """A tensor passed by keyword (`out=`), then read back."""

    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.full((4,), 2.0))
        self.register_buffer("buf", torch.zeros(4))

    def forward(self, x):
        torch.mul(x, self.weight, out=self.buf)
        return self.buf + 1


def test_replay_writes_the_captured_storage_of_a_keyword_tensor():
    model = OutKwarg()
    x = torch.ones(4)
    with gt.trace(model, strict=True), torch.no_grad():  # out= ops take no grad
        with gt.capture("g") as g:
            out = model(x)
    expected = out.clone()
    captured_buf = model.buf.detach()
    model.weight.data = torch.full((4,), 100.0)
    model.buf.data = torch.zeros(4)
    captured_buf.zero_()
    g.replay()
    assert torch.equal(out, expected), "replay must write the `out=` storage captured, then read it"
    assert torch.equal(captured_buf, torch.full((4,), 2.0))
    assert torch.equal(model.buf, torch.zeros(4)), "the rebound buffer is not the graph's"


def test_capture_under_inference_mode_replays_outside_it():
    model = Ops()
    with torch.inference_mode():
        x = torch.ones(2, 4)
    with gt.trace(model, strict=True):
        with torch.inference_mode(), gt.capture("g") as g:
            out = model(x)
    expected = out.clone()
    g.replay()  # outside inference mode
    assert torch.equal(out, expected)
    with torch.inference_mode():
        g.replay()
    assert torch.equal(out, expected)
    with torch.enable_grad():
        g.replay()
    assert torch.equal(out, expected)


def test_replay_of_a_capture_with_grad_on_keeps_grad_off():
    model = Ops()
    x = torch.ones(2, 4, requires_grad=True)
    with gt.trace(model, strict=True):
        with torch.enable_grad(), gt.capture("g") as g:
            model(x)
    g.replay()
    assert model.weight.grad is None


# -- an emulated graph keeps what a CUDA graph's pool would (Note [Emulated graphs keep storages])

class Chain(torch.nn.Module):
    """x -> x @ w -> relu -> * 2 (+ a cache the module keeps) -> + 1: intermediates the graph
    alone holds, one the module holds, and the region's output."""

    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.rand(4, 4))
        self.seen: list = []  # weak references to the intermediates, as they are made
        self.cache = None

    def forward(self, x):
        h = x @ self.weight
        r = torch.relu(h)
        self.seen += [StorageWeakRef(h.untyped_storage()), StorageWeakRef(r.untyped_storage())]
        self.cache = r * 2
        return self.cache[:, :2] + 1


def test_emulated_graph_lets_go_of_its_intermediates_and_replays_the_same():
    model = Chain()
    x = torch.rand(3, 4)
    with torch.no_grad(), gt.trace(model, strict=True):
        with gt.capture("g") as g:
            out = model(x)
    assert all(ref.expired() for ref in model.seen), "intermediates only the graph held"
    cache = model.cache
    with torch.no_grad():
        model.weight.mul_(3)  # in place: the graph reads it
        x.add_(1)
        expected = (torch.relu(x @ model.weight) * 2)
    g.replay()
    assert torch.equal(out, expected[:, :2] + 1), "replay computes through fresh scratch"
    assert torch.equal(cache, expected), "a storage the module holds stays the graph's"
    g.replay()  # again: scratch is allocated per replay
    assert torch.equal(out, expected[:, :2] + 1)


def test_emulated_graph_keeps_an_intermediate_something_else_holds():
    model = Chain()
    x = torch.rand(3, 4)
    kept = []
    hook = model.register_forward_hook(lambda m, i, o: kept.append(m.cache))
    with torch.no_grad(), gt.trace(model, strict=True):
        with gt.capture("g") as g:
            out = model(x)
    hook.remove()
    model.cache = None  # only `kept` holds the cache now
    with torch.no_grad():
        model.weight.zero_()
    g.replay()
    assert torch.equal(kept[0], torch.zeros(3, 4)) and torch.equal(out, torch.ones(3, 2))


def test_without_use_counts_an_emulated_graph_keeps_everything(monkeypatch):
    import graphtrace.tracing.emulated as emulated

    monkeypatch.setattr(emulated, "SCRATCH", False)
    model = Chain()
    x = torch.rand(3, 4)
    with torch.no_grad(), gt.trace(model, strict=True):
        with gt.capture("g") as g:
            out = model(x)
    assert not any(ref.expired() for ref in model.seen)
    expected = out.clone()
    g.replay()
    assert torch.equal(out, expected)


# -- no reference cycles hold user tensors ----------------------------------------------------

class Holder(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.rand(4, 4))
        self.table = torch.rand(4)  # a plain attribute: a reload rebinds it

    def forward(self, x):
        return x @ self.weight + self.table


def test_old_storage_dies_with_the_graph_and_reads_dangling(gc_off):
    model = Holder()
    x = torch.rand(2, 4)
    with gt.trace(model, strict=True) as t:
        with gt.capture("g") as g:
            model(x)
    old = StorageWeakRef(model.table.untyped_storage())
    old_tensor = weakref.ref(model.table)
    t.diff()  # a diff in between must not pin anything either
    del g
    model.table = torch.rand(4)
    assert old_tensor() is None, "the old tensor survived: a reference cycle holds it"
    assert old.expired(), "the old storage survived: a reference cycle holds it"
    edges = t.diff().edges
    assert set(edges.loc[edges.owners == "table", "verdict"]) == {"dangling"}


def test_a_closed_trace_and_its_report_do_not_pin_the_model(gc_off):
    model = Holder()
    with gt.trace(model, strict=True) as t:
        with gt.capture("g") as g:
            model(torch.rand(2, 4))
    report = t.diff()
    del g
    ref = weakref.ref(model)
    storage = StorageWeakRef(model.weight.untyped_storage())
    del model
    assert ref() is None, "the trace (or its report) keeps the watched model alive"
    assert storage.expired()
    assert len(report.edges)
    assert t.models == {}


def test_a_dropped_trace_frees_everything(gc_off):
    model = Holder()
    t = gt.trace(model, strict=True)
    with t:
        with gt.capture("g"):
            model(torch.rand(2, 4))
    t_ref = weakref.ref(t)
    del t
    assert t_ref() is None, "a Trace is part of a reference cycle"


# -- models held weakly -------------------------------------------------------------------------

def test_diff_of_a_dropped_model_names_it():
    model, other = Holder(), Holder()
    with gt.trace(strict=True) as t:
        t.watch(model, name="policy")
        t.watch(other, name="ref")
        with gt.capture("g"):
            model(torch.rand(2, 4))
            other(torch.rand(2, 4))
    assert set(t.models) == {"policy", "ref"}
    del model
    gc.collect()
    assert set(t.models) == {"ref"}
    with pytest.raises(gt.GraphtraceError, match="'policy'.*garbage-collected"):
        t.diff()


class Pair(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)

    def forward(self, x):
        return self.b(self.a(x))


def _owners_and_verdicts(report) -> list[tuple[str, str]]:
    e = report.edges
    e = e[e.owners.astype(str).str.contains("weight")]
    return sorted(zip(e.owners.astype(str), e.verdict.astype(str)))


def test_a_diff_after_the_trace_block_reads_the_capture_time_owners():
    """Note [owners at trace exit]: closing the trace adds no owners, so an update made
    inside the block (two captured weights swapped) reads the same before and after it."""
    reports = []
    for inside in (True, False):
        model = Pair()
        with torch.no_grad(), gt.trace(model, strict=True) as t:
            with gt.capture("g"):
                model(torch.rand(2, 4))
            model.a.weight, model.b.weight = model.b.weight, model.a.weight
            if inside:
                reports.append(t.diff())
        if not inside:
            reports.append(t.diff())
    expected = [("a.weight", "stale"), ("b.weight", "stale")]
    assert _owners_and_verdicts(reports[0]) == _owners_and_verdicts(reports[1]) == expected


@pytest.mark.parametrize("provenance", [True, False])
def test_a_short_script_walks_its_model_once_for_owners(monkeypatch, provenance):
    """Trace entered, one capture, trace closed: the capture's owner walk is the one walk for
    owners (provenance's census at entry is the other, when it is on); none at exit."""
    from graphtrace import owners

    walked = []
    real = owners.walk_owners

    def counting(model, *args, **kwargs):
        walked.append(type(model).__name__)
        return real(model, *args, **kwargs)

    monkeypatch.setattr(owners, "walk_owners", counting)
    model = Pair()
    with gt.trace(model, strict=True, provenance=provenance) as t:
        with gt.capture("g"):
            model(torch.rand(2, 4))
    assert walked == ["Pair"] * (2 if provenance else 1)
    assert set(t.diff().edges.owners.astype(str)) >= {"a.weight", "b.weight", "a.bias"}


def test_a_new_model_may_take_the_name_of_a_dropped_one():
    t = gt.trace(strict=True)
    t.watch(Holder(), name="m")
    gc.collect()
    model = Holder()
    t.watch(model, name="m")
    with t:
        with gt.capture("g"):
            model(torch.rand(2, 4))
    assert t.models == {"m": model}
    assert set(t.diff().edges.verdict) >= {"stable"}


# -- models_changed: owners of later captures from a fresh walk ------------------------------

class _LateHolder(torch.nn.Module):
    """A module whose update creates a tensor holder (a plain attribute) that later graphs read."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.cache = None

    def forward(self, x):
        y = self.lin(x)
        return y if self.cache is None else y + self.cache


@pytest.mark.parametrize("announced", [True, False])
def test_a_holder_an_update_creates_owns_what_later_graphs_read_once_models_changed(announced):
    """The owner walk is cached between captures and redone only when a matched path moved; a
    holder that did not exist at the walk is found only after `Trace.models_changed()` (what
    the serving core calls after each update)."""
    model, x = _LateHolder(), torch.ones(2, 4)
    with torch.no_grad(), gt.trace(model, strict=True) as t:
        with gt.capture("g1") as g1:
            model(x)
        model.cache = torch.ones(4)
        if announced:
            t.models_changed()
        with gt.capture("g2") as g2:  # held: the old holder's storage stays alive (stale)
            model(x)
    paths = set(t.diff().owners["path"])
    assert {"lin.weight", "lin.bias"} <= paths
    assert ("cache" in paths) is announced
    # the next update rebinds that holder: diff and guard both see it only where it is owned
    guard = t.guard()
    model.cache = torch.full((4,), 2.0)
    edges = t.diff().edges
    stale = set(edges.loc[edges["verdict"].astype(str) == "stale", "owners"].astype(str))
    problems = guard.check()
    assert stale == ({"cache"} if announced else set())
    assert set(zip(problems["owners"], problems["verdict"])) == {(o, "stale") for o in stale}
    del g1, g2  # held until the checks
