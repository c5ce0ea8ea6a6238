"""Trustworthy under odd models (issue #19, part 2): emulated graphs keep storages, graphs that
write before they read, opaque handles, no reference cycles, weakly held models, module
cycles, dtype moves and forgotten derived copies. All through the public API."""

from __future__ import annotations

import gc
import warnings
import weakref

import pytest
import torch
from torch.multiprocessing.reductions import StorageWeakRef

import graphtrace as gt

pytestmark = pytest.mark.usefixtures("writer")


@pytest.fixture
def gc_off():
    """The garbage collector off: what must die must die by reference counting alone."""
    was = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


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


# -- 1. emulated graphs keep the captured storages ------------------------------------------

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


# -- 4. no reference cycles hold user tensors -------------------------------------------------

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


# -- 5. models held weakly --------------------------------------------------------------------

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


# -- 6. module graphs torch can build -----------------------------------------------------------

class Child(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.rand(4))

    def forward(self, x):
        return x * self.weight


class Parent(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.child = Child()
        self.child.parent = self  # registered both ways: a cycle through _modules
        self.bias = torch.nn.Parameter(torch.rand(4))

    def forward(self, x):
        return self.child(x) + self.bias


def test_a_cycle_through_registered_children_is_walked_and_diffed():
    model = Parent()
    with pytest.raises(RecursionError):  # what torch itself does with it
        list(model.named_parameters(remove_duplicate=False))
    with gt.trace(model, strict=True) as t:
        with gt.capture("g") as g:
            model(torch.rand(4))
    from graphtrace.owners import walk_owners

    paths = {p for p, k, _ in walk_owners(model) if k == "parameter"}
    assert paths == {"bias", "child.weight"}  # the way back up is not entered again
    model.child.weight = torch.nn.Parameter(torch.rand(4))  # rebound: the graph reads old
    report = t.diff()
    assert report.meta["n_errors"] == 0
    e = report.edges.set_index("owners")
    assert e.loc["child.weight", "verdict"] == "stale"
    assert e.loc["bias", "verdict"] == "stable"
    assert len(g)


class Hostile(torch.nn.Module):
    """A module whose registries break after the capture (a walk that raises)."""

    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.rand(4))
        self.broken = False

    def forward(self, x):
        return x * self.weight

    def __getattr__(self, name):
        if name == "_modules" and self.__dict__.get("broken"):
            raise RuntimeError("hostile registry")
        return super().__getattr__(name)


def test_a_walk_that_fails_in_diff_is_a_counted_error_not_an_exception():
    model = Hostile()
    with gt.trace(model) as t:
        with gt.capture("g"):
            model(torch.rand(4))
    old = model.weight
    model.weight = torch.nn.Parameter(torch.rand(4))  # rebound: the diff must walk again
    model.broken = True
    model.__dict__["_modules"] = None  # named_modules now raises inside that walk
    del model.__dict__["_modules"]
    report = t.diff()
    assert report.meta["n_errors"] >= 1
    assert any("owner" in e["where"] for e in report.meta["errors"])
    e = report.edges.set_index("owners")
    assert e.loc["weight", "verdict"] == "stale"  # resolved path by path instead
    assert old is not model.weight


def test_a_diff_resolves_only_the_captured_owner_paths():
    """A registry that breaks after the capture, away from every captured owner's path:
    nothing moved, so the diff does not walk the model again (it resolves the paths it
    matched at capture time) and reports no error."""
    model = Hostile()
    with gt.trace(model) as t:
        with gt.capture("g"):
            model(torch.rand(4))
    model.broken = True
    model.__dict__["_modules"] = None
    del model.__dict__["_modules"]
    report = t.diff()
    assert report.meta["n_errors"] == 0
    e = report.edges.set_index("owners")
    assert e.loc["weight", "verdict"] == "stable"


# -- 2. storages a graph writes before it reads -------------------------------------------------

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


# -- 7. impact compares values; dtype and shape changes are named ------------------------------

def test_a_dtype_move_compares_values_and_says_so():
    model = Holder()
    with gt.trace(model, strict=True) as t:
        with gt.capture("g") as g:
            model(torch.rand(2, 4))
    model.double()  # new float64 storages with the same values
    report = t.diff()
    w = report.edges.set_index("owners").loc["weight"]
    assert w.verdict == "stale" and w.impact == "latent"  # same values, another dtype
    notes = [s for s in report.blind_spots if "weight" in s]
    assert notes and "dtype float32 -> float64" in notes[0]
    with torch.no_grad():
        model.weight.add_(1)
    w = t.diff().edges.set_index("owners").loc["weight"]
    assert w.impact == "manifest"
    assert len(g)


def test_a_shape_change_is_manifest_and_named():
    model = Holder()
    with gt.trace(model, strict=True) as t:
        with gt.capture("g") as g:
            model(torch.rand(2, 4))
    model.weight = torch.nn.Parameter(torch.cat([model.weight.detach()] * 2))  # (8, 4)
    report = t.diff()
    w = report.edges.set_index("owners").loc["weight"]
    assert w.verdict == "stale" and w.impact == "manifest"
    assert any("shape (4, 4) -> (8, 4)" in s for s in report.blind_spots)
    assert len(g)


# -- 3. opaque handles (ScriptObject arguments) -------------------------------------------------

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
