"""Owners, the reload diff and its verdicts, through the public API."""

from __future__ import annotations

import dataclasses
import functools
import gc

import pytest
import torch

import graphtrace as gt


@dataclasses.dataclass
class Config:
    bias: torch.Tensor


class Kernel:
    """A plain object hanging off a module, as vLLM's quant_method.kernel does."""

    def __init__(self, n: int, seed: int):
        g = torch.Generator().manual_seed(seed)
        self.fn = functools.partial(torch.mul, other=torch.rand(n, generator=g))
        shift = torch.rand(n, generator=g)
        self.lam = lambda x: x + shift
        self.tables = {"gate": torch.rand(n, generator=g)}


class Layer(torch.nn.Module):
    def __init__(self, n: int = 8, seed: int = 0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.weight = torch.nn.Parameter(torch.rand(n, n, generator=g))
        self.register_buffer("scale", torch.rand(n, generator=g))
        self.kernel = Kernel(n, seed)
        self.config = Config(torch.rand(n, generator=g))

    def forward(self, x):
        x = x @ self.weight.t()              # the parameter, read through a view
        x = x * self.scale                   # a buffer
        x = self.kernel.fn(x)                # a tensor bound in a partial
        x = self.kernel.lam(x)               # a tensor in a lambda's closure
        x = x * self.kernel.tables["gate"]   # a tensor in a dict on a sub-object
        return x + self.config.bias          # a tensor in a dataclass


class Model(torch.nn.Module):
    def __init__(self, seed: int = 0):
        super().__init__()
        self.layers = torch.nn.ModuleList([Layer(seed=seed), Layer(seed=seed + 1)])

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def reload(model: Model, seed: int) -> None:
    """What an engine's reload does: copy into registered tensors, rebuild everything else."""
    fresh = Model(seed)
    with torch.no_grad():
        for (name, p), q in zip(model.named_parameters(), fresh.parameters()):
            p.copy_(q)
        for (name, b), c in zip(model.named_buffers(), fresh.buffers()):
            b.copy_(c)
    for layer, new in zip(model.layers, fresh.layers):
        layer.kernel = new.kernel
        layer.config = new.config


def traced(model, x):
    with gt.trace(model, strict=True) as t:
        with gt.capture("bs2") as g:
            y = model(x)
    return t, g, y


def verdicts_by_owner(report):
    rows = report.edges[report.edges.n_owners > 0]
    return dict(zip(rows.owners, rows.verdict))


EXPECTED_OWNERS = {
    "weight": "stable",
    "scale": "stable",
    "kernel.fn.keywords['other']": "stale",
    "kernel.lam.__closure__['shift']": "stale",
    "kernel.tables['gate']": "stale",
    "config.bias": "stale",
}


def test_every_holder_kind_gets_its_exact_verdict_and_path():
    model = Model(0)
    x = torch.rand(2, 8)
    t, g, y = traced(model, x)
    reload(model, seed=10)
    report = t.diff()
    expected = {f"layers.{i}.{path}": v for i in (0, 1) for path, v in EXPECTED_OWNERS.items()}
    assert verdicts_by_owner(report) == expected
    kinds = dict(zip(report.owners.path, report.owners.kind))
    assert kinds["layers.0.weight"] == "parameter" and kinds["layers.1.scale"] == "buffer"
    assert kinds["layers.0.config.bias"] == "attribute"
    # the input is external, every intermediate was first written inside the graph
    unowned = report.edges[report.edges.verdict == "unowned"]
    assert set(unowned[unowned.data_ptr == x.data_ptr()].origin) == {"external"}
    assert (unowned.origin == "internal").sum() == len(unowned) - 1
    # new weights: what the graph reads from the old tensors differs now
    stale = report.stale
    assert len(stale) == 8 and set(stale.impact) == {"manifest"}
    assert set(stale.verdict) == {"stale"}
    # moved owners report where they point now
    moved = report.owners[report.owners.status == "moved"]
    assert (moved.live_data_ptr.notna()).all()
    # stale edges are marked in the graph
    marked = [(u, v) for u, v, d in report.graph.edges(data=True) if d.get("stale")]
    assert len(marked) == 8
    del g, y


def test_stale_read_is_real_on_replay():
    model = Model(0)
    x = torch.rand(2, 8)
    t, g, y = traced(model, x)
    reload(model, seed=10)
    g.replay()
    eager = model(x)
    assert not torch.allclose(y, eager)  # the graph reads the old partial, closure, dict, config
    fixed_model = Model(0)
    t2, g2, y2 = traced(fixed_model, x)
    with torch.no_grad():
        for p, q in zip(fixed_model.parameters(), Model(10).parameters()):
            p.copy_(q)
    g2.replay()
    assert torch.allclose(y2, fixed_model(x))


def test_same_weights_reload_is_latent():
    model = Model(0)
    t, g, y = traced(model, torch.rand(2, 8))
    reload(model, seed=0)  # identical values, rebuilt holders
    report = t.diff()
    assert len(report.stale) == 8
    assert set(report.stale.impact) == {"latent"}


def test_freed_storage_is_dangling_even_when_its_address_is_reused():
    model = Model(0)
    x = torch.rand(2, 8)
    t, g, y = traced(model, x)
    old = model.layers[0].config.bias
    old_ptr, n = old.data_ptr(), old.numel()
    del g, y, old
    model.layers[0].config.bias = None
    gc.collect()
    reuse = None
    for _ in range(200):  # the allocator usually hands the freed address out again
        candidate = torch.rand(n)
        if candidate.data_ptr() == old_ptr:
            reuse = candidate
            break
    model.layers[0].config.bias = reuse if reuse is not None else torch.rand(n)
    report = t.diff()
    edge = report.edges[report.edges.owners == "layers.0.config.bias"].iloc[0]
    assert edge.verdict == "dangling"
    assert edge.impact == "unknown"
    if reuse is not None:  # same address, new storage: still not the captured one
        assert edge.live_data_ptr == edge.data_ptr


def test_two_holders_one_moved_is_diverged():
    model = Model(0)
    layer = model.layers[0]
    layer.kernel.alias = functools.partial(torch.mul, other=layer.scale)  # a registered buffer
    t, g, y = traced(model, torch.rand(2, 8))
    with torch.no_grad():
        layer.scale.copy_(torch.rand(8))             # reload keeps the registered storage
    layer.kernel.alias = functools.partial(torch.mul, other=layer.scale.clone())  # holder moves
    report = t.diff()
    edge = report.edges[report.edges.owners.str.contains("layers.0.scale")].iloc[0]
    assert edge.owners == "layers.0.kernel.alias.keywords['other']; layers.0.scale"
    assert edge.verdict == "diverged"
    assert (edge.owner_kinds, edge.n_owners) == ("attribute;buffer", 2)
    # where the graph should read now: the moved holder's tensor, not the one still held
    assert edge.live_data_ptr == layer.kernel.alias.keywords["other"].data_ptr()
    statuses = report.owners.set_index("path").status
    assert statuses["layers.0.scale"] == "holds"
    assert statuses["layers.0.kernel.alias.keywords['other']"] == "moved"
    del g, y


def test_owner_path_that_no_longer_resolves_is_orphaned():
    model = Model(0)
    t, g, y = traced(model, torch.rand(2, 8))
    del model.layers[1].kernel.tables["gate"]
    report = t.diff()
    edge = report.edges[report.edges.owners == "layers.1.kernel.tables['gate']"].iloc[0]
    assert edge.verdict == "orphaned"
    assert report.owners.set_index("path").status["layers.1.kernel.tables['gate']"] == "orphaned"
    del g, y


def test_tied_weights_keep_all_names():
    emb = torch.nn.Embedding(8, 4)
    head = torch.nn.Linear(4, 8, bias=False)
    head.weight = emb.weight
    model = torch.nn.ModuleDict({"emb": emb, "head": head})
    with gt.trace(model, strict=True) as t:
        with gt.capture() as g:
            head(emb(torch.tensor([1, 2])))
    report = t.diff()
    edge = report.edges[report.edges.n_owners > 0].iloc[0]
    assert edge.owners == "emb.weight; head.weight" and edge.verdict == "stable"
    del g


def test_watch_after_capture_and_several_models():
    a, b = Model(0), Model(1)
    x = torch.rand(2, 8)
    with gt.trace(strict=True) as t:
        with gt.capture() as g:
            b(a(x))
    t.watch(a, name="policy").watch(b, name="ref")
    reload(a, seed=5)
    report = t.diff()
    stale = report.owners[report.owners.status == "moved"]
    assert set(stale.model) == {"policy"} and len(stale) == 8
    assert set(report.meta["models"]) == {"policy", "ref"}
    del g


def test_diff_without_captures_or_models_says_so():
    with gt.trace(Model(0)) as t:
        pass
    with pytest.raises(ValueError, match="recorded no capture"):
        t.diff()
    with gt.trace() as t:
        with gt.capture():
            torch.rand(2) * 2
    with pytest.raises(ValueError, match="no model is watched"):
        t.diff()


def test_assert_no_stale_fails_with_a_readable_message():
    model = Model(0)
    t, g, y = traced(model, torch.rand(2, 8))
    gt.assert_no_stale(t.diff())  # nothing moved yet
    reload(model, seed=3)
    with pytest.raises(AssertionError) as info:
        gt.assert_no_stale(t.diff())
    assert "layers.0.kernel.lam.__closure__['shift']" in str(info.value)
    del g, y


def test_accesses_and_report_round_trip(tmp_path):
    model = Model(0)
    t, g, y = traced(model, torch.rand(2, 8))
    reload(model, seed=3)
    report = t.diff()
    report.to_csv(tmp_path / "r")
    back = gt.load_report(tmp_path / "r")
    import pandas as pd

    for name in ("edges", "owners", "storages"):
        pd.testing.assert_frame_equal(getattr(back, name).reset_index(drop=True),
                                      getattr(report, name).reset_index(drop=True),
                                      check_dtype=False, check_categorical=False)
    assert back.summary().equals(report.summary())
    del g, y


def test_owner_walk_limits_are_reported_as_blind_spots():
    class Node:
        def __init__(self, child):
            self.child = child

    model = Model(0)
    chain = torch.rand(8)
    for _ in range(30):  # deeper than the walk goes
        chain = Node(chain)
    model.deep = chain
    t, g, y = traced(model, torch.rand(2, 8))
    report = t.diff()
    assert any("not walked" in text for text in report.blind_spots)
    del g, y


def test_graphml_can_be_left_out_and_the_graph_still_loads(tmp_path):
    import json

    model = Model(0)
    t, g, y = traced(model, torch.rand(2, 8))
    reload(model, seed=3)
    report = t.diff()
    report.to_csv(tmp_path / "r", graphml=False)
    manifest = json.loads((tmp_path / "r" / "manifest.json").read_text())
    assert not (tmp_path / "r" / "graph.graphml").exists()
    assert "graphml=True" in manifest["graphml_skipped"]
    back = gt.load_report(tmp_path / "r")
    assert sorted(back.graph.edges(keys=True)) == sorted(report.graph.edges(keys=True))
    report.to_csv(tmp_path / "r")  # small: GraphML by default
    assert (tmp_path / "r" / "graph.graphml").exists()
    del g, y


def test_edge_lists_distinct_ops_and_args_in_first_seen_order():
    model = torch.nn.Linear(4, 4)
    x = torch.rand(2, 4)
    with gt.trace(model, strict=True) as t:
        with gt.capture() as g:
            y = x * 2
            y = y + x   # x read again, by another op
            y = y * x   # and by the first op again: listed once
    edge = t.diff().edges.set_index("data_ptr").loc[x.data_ptr()]
    assert edge["ops"] == "aten::mul.Tensor;aten::add.Tensor"
    assert edge["args"] == "self;other"
    del g, y


def test_edge_ops_agree_with_the_accesses_for_shared_and_long_op_runs():
    """Edges read through the same op sequence share one joined text, and a storage read by
    many distinct ops (too many to pack per run) is joined the long way: both must list each
    edge's distinct ops in the order its accesses first show them."""
    model = torch.nn.Linear(4, 4)
    xs = [torch.rand(2, 4) for _ in range(6)]
    many = [torch.sin, torch.cos, torch.exp, torch.abs, torch.neg, torch.sigmoid, torch.tanh,
            torch.relu, torch.sqrt, torch.square, torch.floor, torch.ceil, torch.round,
            torch.trunc, torch.sign, torch.erf]
    with gt.trace(model, strict=True) as t:
        with gt.capture() as g:
            ys = [x * 2 + x for x in xs[:3]]          # the same sequence: mul, add
            ys += [x + 1 for x in xs[3:5]]            # another one
            ys += [f(xs[5]) for f in many]            # one storage, 16 distinct ops
    report = t.diff()
    acc = t.accesses  # every access, in order: an edge lists its writing ops too
    for sid, edge in report.edges.set_index("storage_id").iterrows():
        seen = acc[acc["storage_id"] == sid]["op"].astype(str).tolist()
        assert edge["ops"] == ";".join(dict.fromkeys(seen)), sid
    long_edge = report.edges.set_index("data_ptr").loc[xs[5].data_ptr()]
    assert long_edge["ops"].count(";") == len(many) - 1
    del g, ys


def _recorded_without_a_trace(model, x, native_module):
    """Records and a capture-time owner snapshot made by the lower layers' public API alone:
    a Recorder, one capture recorded by a RecordingMode, an OwnerSnapshot matched to it."""
    from graphtrace.owners import OwnerSnapshot
    from graphtrace.recorder import Recorder, RecordingMode

    recorder = Recorder(strict=True, native=native_module)
    capture = recorder.new_capture("bs2", "emulated")
    mode = RecordingMode(recorder, capture)
    with mode, torch.no_grad():
        y = model(x)
    mode.finish()
    snapshot = OwnerSnapshot()
    assert snapshot.update({"": model}, recorder.storages) == []  # nothing cut by the walk
    return recorder, snapshot, y


@pytest.mark.parametrize("use_native", [False, True], ids=["python", "native"])
def test_diff_runs_on_records_and_a_snapshot_without_a_trace(use_native):
    from graphtrace import native
    from graphtrace.diff import diff

    model, x = Model(0), torch.rand(2, 8)
    recorder, snapshot, y = _recorded_without_a_trace(
        model, x, native.load(required=True) if use_native else None)
    kept = [(layer.kernel, layer.config) for layer in model.layers]  # old tensors stay alive
    reload(model, seed=10)
    report = diff(recorder, snapshot, {"": model}, ["a note"])
    expected = {f"layers.{i}.{path}": v for i in (0, 1) for path, v in EXPECTED_OWNERS.items()}
    assert verdicts_by_owner(report) == expected
    assert set(report.stale.impact) == {"manifest"}
    assert report.blind_spots == ["a note"] and report.meta["models"] == [""]
    assert report.meta["blind_spots"] == [{"kind": "other", "text": "a note", "holder": "", "op": "",
                                           "model": "", "graph": ""}]
    assert [g["label"] for g in report.meta["graphs"]] == ["bs2"]
    # the same edges as gt.trace + t.diff() give for the same model and reload
    model2 = Model(0)
    t, g, y2 = traced(model2, x)
    reload(model2, seed=10)
    cols = ["graph", "storage_id", "access", "ops", "args", "owners", "verdict", "impact", "origin"]
    assert report.edges[cols].astype(str).equals(t.diff().edges[cols].astype(str))
    del kept, g, y, y2


def test_diff_without_a_trace_refuses_empty_input():
    from graphtrace.diff import diff
    from graphtrace.owners import OwnerSnapshot
    from graphtrace.recorder import Recorder

    model = Model(0)
    recorder, snapshot, y = _recorded_without_a_trace(model, torch.rand(2, 8), None)
    with pytest.raises(ValueError, match="recorded no capture"):
        diff(Recorder(), OwnerSnapshot(), {"": model})
    with pytest.raises(ValueError, match="no model is watched"):
        diff(recorder, snapshot, {})


def test_owner_snapshot_matches_storages_to_their_capture_time_owners():
    from graphtrace.owners import OwnerSnapshot
    from graphtrace.recorder import StorageTable

    model = Model(0)
    table = StorageTable()
    weight = table.lookup(model.layers[0].weight.untyped_storage())
    other = table.lookup(torch.rand(3).untyped_storage())
    snapshot = OwnerSnapshot()
    snapshot.update({"m": model}, table)
    assert snapshot.owners == {weight: {("m", "layers.0.weight", "parameter")}}
    # a model watched later: refresh walks it and matches every storage again
    gate = table.lookup(model.layers[1].kernel.tables["gate"].untyped_storage())
    snapshot.update({"m": model}, table)  # only storages registered since the last update
    assert gate in snapshot.owners and other not in snapshot.owners
    snapshot.refresh({"m": model, "n": model}, table)
    assert ("n", "layers.0.weight", "parameter") in snapshot.owners[weight]
    assert ("m", "layers.0.weight", "parameter") in snapshot.owners[weight]  # owners accumulate


def test_a_new_storage_at_the_freed_captured_address_is_dangling():
    """The storage-identity rule, deterministically: the captured storage and its successor
    are both made with torch.frombuffer over one buffer, so the new one sits at the very
    address of the freed one. diff must tell them apart by storage (dangling, equal
    pointers), never by address (which would read stable)."""
    import gc as _gc

    import torch as _torch

    import graphtrace as _gt

    class Scaled(_torch.nn.Module):
        def __init__(self, scale: _torch.Tensor):
            super().__init__()
            self.holder = type("Holder", (), {})()  # a plain object: not registered
            self.holder.scale = scale

        def forward(self, x):
            return x * self.holder.scale

    buffer = bytearray(8 * 4)  # outlives both tensors: the address stays the same
    captured = _torch.frombuffer(buffer, dtype=_torch.float32)
    captured.fill_(2.0)
    old_ptr = captured.data_ptr()
    model = Scaled(captured)
    with _gt.trace(model, strict=True) as t:
        with _gt.capture("g") as g:
            y = model(_torch.ones(8))
    del g, y, captured
    model.holder.scale = None
    _gc.collect()
    fresh = _torch.frombuffer(buffer, dtype=_torch.float32)
    assert fresh.data_ptr() == old_ptr  # guaranteed: the same bytes
    model.holder.scale = fresh
    report = t.diff()
    edge = report.edges[report.edges.owners == "holder.scale"]
    assert len(edge) == 1
    edge = edge.iloc[0]
    assert edge.verdict == "dangling"
    assert edge.live_data_ptr == edge.data_ptr == old_ptr
    assert not report.storages.set_index("storage_id").at[edge.storage_id, "alive"]
    owner = report.owners[report.owners.path == "holder.scale"].iloc[0]
    assert owner.status == "moved" and owner.live_data_ptr == old_ptr


class _ReboundPerm(torch.nn.Module):
    """A kernel whose weight processing rebinds a partial-held permutation each run."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(4, 4))
        self.process()

    def process(self):
        perm = torch.argsort(torch.randn(4))
        self.fn = functools.partial(torch.index_select, dim=1, index=perm)

    def forward(self, x):
        return self.fn(x) @ self.w


def test_a_capture_after_a_reload_inside_the_trace_finds_the_new_holders():
    """The owner walk is cached between captures; a reload between two captures must not
    leave the second capture's reads of the rebound tensors without owners."""
    model = _ReboundPerm()
    with gt.trace(model) as t:
        with gt.capture("before") as g1:
            model(torch.randn(2, 4))
        model.process()  # a reload between two captures
        with gt.capture("after") as g2:
            model(torch.randn(2, 4))
        model.process()
    perm_edges = t.diff().edges.query("owners == \"fn.keywords['index']\"")
    assert sorted(perm_edges["graph"].astype(str)) == ["after", "before"]
    assert set(perm_edges["verdict"].astype(str)) == {"stale"}
    del g1, g2
