"""The guard (`t.guard()`, `check`, `enforce`, JSON manifest) through the public API: every
verdict agrees with `t.diff()` on the same trace, and nothing is kept alive."""

from __future__ import annotations

import gc
import json
import weakref

import pytest
import torch
from torch.multiprocessing.reductions import StorageWeakRef

import graphtrace as gt
from graphtrace.vocab import GUARD_COLUMNS, GUARD_PROBLEMS
from tests.test_diff import Model, reload  # the diff's model and reload: every holder kind

X = torch.rand(2, 8, generator=torch.Generator().manual_seed(5))


def capture_two(model, emulate: bool = True):
    """Two graphs (a decode and a prefill shape), as an engine would capture."""
    with gt.trace(model, strict=True) as t:
        with gt.capture("decode", emulate=emulate) as g1:
            model(X)
        with gt.capture("prefill", emulate=emulate) as g2:
            model(torch.rand(4, 8))
    return t, [g1, g2]


def clean(model, graphs):
    """A correct reload: new values copied into the registered tensors only."""
    fresh = Model(7)
    with torch.no_grad():
        for p, q in zip(model.parameters(), fresh.parameters()):
            p.copy_(q)


def stale(model, graphs):
    reload(model, seed=10)  # holders rebuilt; the graphs keep the old tensors alive


def dangling(model, graphs):
    reload(model, seed=10)
    graphs.clear()  # capture artifacts dropped: the old tensors die
    gc.collect()


def diverged(model, graphs):
    # layers.0.gate_alias (diverged_setup, before capture) keeps the captured tensor; the
    # update rebinds the other owner
    model.layers[0].kernel.tables["gate"] = torch.rand(8)


def orphaned(model, graphs):
    del model.layers[1].config  # the path layers.1.config.bias no longer resolves


def diverged_setup(model):
    layer = model.layers[0]
    layer.gate_alias = layer.kernel.tables["gate"]


SCENARIOS = {"clean": clean, "stale": stale, "dangling": dangling, "diverged": diverged,
             "orphaned": orphaned}
EXPECTED = {"clean": set(), "stale": {"stale"}, "dangling": {"dangling"},
            "diverged": {"diverged"}, "orphaned": {"orphaned"}}


def run(name: str):
    model = Model(0)
    if name == "diverged":
        diverged_setup(model)
    t, graphs = capture_two(model)
    guard = t.guard()
    SCENARIOS[name](model, graphs)
    return model, t, graphs, guard


def diff_problems(report) -> set:
    e = report.edges
    e = e[e["verdict"].astype(str).isin(GUARD_PROBLEMS)]
    return set(zip(e["graph_id"], e["graph"].astype(str), e["storage_id"],
                   e["owners"].astype(str), e["verdict"].astype(str)))


def guard_problems(frame) -> set:
    return set(zip(frame["graph_id"], frame["graph"], frame["storage_id"], frame["owners"],
                   frame["verdict"]))


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_check_agrees_with_diff(name):
    model, t, graphs, guard = run(name)
    problems = guard.check()
    assert list(problems.columns) == GUARD_COLUMNS
    assert set(problems["verdict"]) == EXPECTED[name]
    assert guard_problems(problems) == diff_problems(t.diff())
    if name != "clean":
        # every problem storage is reported for both graphs that read it
        assert set(problems["graph"]) == {"decode", "prefill"}
        assert (problems["identity"] == "storage").all()


def test_clean_reload_passes_and_enforce_returns():
    model, t, graphs, guard = run("clean")
    assert guard.check().empty
    guard.enforce()  # no raise
    assert t.diff().stale.empty
    assert len(guard) > 0 and guard.identity == {"storage": len(guard), "data_ptr": 0}


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_native_fast_path_answers_as_the_full_walk(name, monkeypatch):
    """A guard made from a trace with the native module asks C++ first whether any owner path
    moved (owners.PathSet.moved); only then does it judge every owner in Python. Both must
    give the same problems, and a clean check must not judge owners one by one (its one
    Python pass compares the owners' views: Note [re-laid views] in graphtrace/verdict.py)."""
    import graphtrace.guard.check as guard_module
    from graphtrace import native

    if native.load() is None:
        pytest.skip("the native module does not build here")
    model, t, graphs, guard = run(name)
    fast = guard.check()
    guard._native = None  # the full walk only
    slow = guard.check()
    assert guard_problems(fast) == guard_problems(slow)
    if name == "clean":
        guard._native = native.load()

        def no_walk(*args, **kwargs):
            raise AssertionError("a clean check judged every owner in Python")
        monkeypatch.setattr(guard_module, "owner_status", no_walk)
        assert guard.check().empty


def test_stale_details_match_the_diff_edges():
    model, t, graphs, guard = run("stale")
    problems = guard.check()
    e = t.diff().edges.set_index(["graph_id", "storage_id"])
    for row in problems.itertuples():
        edge = e.loc[(row.graph_id, row.storage_id)]
        assert row.live_data_ptr == edge["live_data_ptr"]
        assert row.nbytes == edge["nbytes"] and row.owner_kinds == edge["owner_kinds"]
        assert row.dtype == edge["dtype"] and row.shape == edge["shape"]
        assert row.statuses == "moved"
    # the four holder kinds of each layer (partial, closure, dict, dataclass), two graphs each
    assert len(problems) == 16


def test_enforce_raises_a_readable_list():
    model, t, graphs, guard = run("stale")
    with pytest.raises(gt.StaleGraphError) as info:
        guard.enforce()
    err = info.value
    assert isinstance(err, gt.GraphtraceError)
    text = str(err)
    assert text.startswith("8 captured storage(s) read by 2 graph(s) are no longer where")
    lines = text.splitlines()
    for layer in (0, 1):
        for path in ("kernel.fn.keywords['other']", "kernel.lam.__closure__['shift']",
                     "kernel.tables['gate']", "config.bias"):
            line = next(ln for ln in lines if f"owned by layers.{layer}.{path} [" in ln)
            assert line.lstrip().startswith("stale") and line.endswith("read by: decode, prefill")
    assert "(stale: owners moved; the graph reads the old values)" in text
    assert guard_problems(err.problems) == guard_problems(guard.check())


def test_enforce_lists_dangling_and_orphaned_words():
    model, t, graphs, guard = run("dangling")
    with pytest.raises(gt.StaleGraphError, match=r"(?s)dangling.*freed memory"):
        guard.enforce()
    model, t, graphs, guard = run("orphaned")
    with pytest.raises(gt.StaleGraphError, match=r"orphaned +storage \d+ .*owned by "
                                                 r"layers\.1\.config\.bias \[orphaned\]"):
        guard.enforce()


def _warm_up() -> None:
    """The first traced forward in a process makes torch import torch._dynamo, and
    torch.fx.wrap keeps its caller's frame in a cycle (the running forward's frames, so the
    model): torch's, once per process. Take it out before the garbage collector goes off."""
    capture_two(Model(0), emulate=False)
    gc.collect()


def test_guard_keeps_nothing_alive():
    _warm_up()
    was = gc.isenabled()
    gc.disable()
    try:
        model = Model(0)
        t, graphs = capture_two(model, emulate=False)  # no replayable graph holding tensors
        guard = t.guard()
        weight = StorageWeakRef(model.layers[0].weight.untyped_storage())
        holder = StorageWeakRef(model.layers[0].kernel.tables["gate"].untyped_storage())
        closure = weakref.ref(model.layers[1].kernel.lam)
        model_ref = weakref.ref(model)
        del t, graphs, model
        assert model_ref() is None and closure() is None
        assert weight.expired() and holder.expired()
        assert len(guard) > 0
        with pytest.raises(gt.GraphtraceError, match="was freed: call guard.attach"):
            guard.check()
    finally:
        if was:
            gc.enable()


def test_guard_does_not_keep_rebound_storages_alive():
    """After an update the old holder tensors die if nothing but the guard knew them."""
    _warm_up()
    was = gc.isenabled()
    gc.disable()
    try:
        model = Model(0)
        t, graphs = capture_two(model, emulate=False)
        guard = t.guard()
        old = StorageWeakRef(model.layers[0].config.bias.untyped_storage())
        del t, graphs
        reload(model, seed=10)
        assert old.expired()
        problems = guard.check()
        assert set(problems["verdict"]) == {"dangling"}
    finally:
        if was:
            gc.enable()


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_json_round_trip_attached_before_the_update(name, tmp_path):
    model = Model(0)
    if name == "diverged":
        diverged_setup(model)
    t, graphs = capture_two(model)
    live = t.guard()
    path = live.to_json(tmp_path / "guard.json")
    loaded = gt.load_guard(path, model=model)  # attached before the update: weak handles again
    assert loaded.identity == live.identity
    SCENARIOS[name](model, graphs)
    a, b = live.check(), loaded.check()
    assert guard_problems(a) == guard_problems(b) == diff_problems(t.diff())
    assert a.drop(columns=[]).equals(b)


@pytest.mark.parametrize("name", ["clean", "stale", "diverged", "orphaned"])
def test_json_loaded_after_the_update_checks_by_address(name, tmp_path):
    """Attached after the update, only data_ptr + nbytes are known (Note [guard identity]):
    same verdicts where the old storage is alive (kept by the graphs here)."""
    model = Model(0)
    if name == "diverged":
        diverged_setup(model)
    t, graphs = capture_two(model)
    path = t.guard().to_json(tmp_path / "guard.json")
    SCENARIOS[name](model, graphs)
    loaded = gt.load_guard(path, model=model)
    problems = loaded.check()
    assert guard_problems(problems) == diff_problems(t.diff())
    # a storage some owner still holds is adopted at attach (a weak handle from then on);
    # one no owner holds any more is checked by address
    assert set(problems["identity"]) == {"clean": set(), "stale": {"data_ptr"},
                                         "diverged": {"storage"}, "orphaned": {"data_ptr"}}[name]
    assert (loaded.identity["data_ptr"] > 0) == (name in ("stale", "orphaned"))


def test_manifest_json_is_plain_and_documented_fields(tmp_path):
    model = Model(0)
    t, graphs = capture_two(model)
    guard = t.guard()
    data = json.loads(guard.to_json(tmp_path / "g.json").read_text())
    assert data["format"] == "graphtrace.guard" and data["format_version"] == 1
    assert data["models"] == [""]
    assert [g["label"] for g in data["graphs"]] == ["decode", "prefill"]
    by_path = {o["path"]: s for s in data["storages"] for o in s["owners"]}
    w = by_path["layers.0.weight"]
    storage = model.layers[0].weight.untyped_storage()
    assert w["data_ptr"] == storage.data_ptr() and w["nbytes"] == storage.nbytes()
    assert w["dtype"] == "float32" and w["device"] == "cpu" and w["alive"] is True
    assert sorted(w["graphs"]) == [0, 1]
    assert {o["kind"] for s in data["storages"] for o in s["owners"]} == {
        "parameter", "buffer", "attribute"}
    m = guard.manifest
    assert set(m["path"]) == set(by_path) and set(m["graph"]) == {"decode", "prefill"}
    # only owned storages: no intermediate, no input
    assert X.untyped_storage().data_ptr() not in {s["data_ptr"] for s in data["storages"]}


def test_bad_input_is_one_clear_error(tmp_path):
    with pytest.raises(gt.GraphtraceError, match="no guard manifest at"):
        gt.load_guard(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(gt.GraphtraceError, match="bad.json: not a readable JSON"):
        gt.load_guard(bad)
    model = Model(0)
    t, graphs = capture_two(model)
    data = t.guard().to_dict()
    data["storages"][0]["nbytes"] = "many"
    bad.write_text(json.dumps(data))
    with pytest.raises(gt.GraphtraceError, match=r"storages\[0\]\['nbytes'\] must be int"):
        gt.load_guard(bad)
    data = t.guard().to_dict()
    data["copies"] = [{"model": "", "copy": "fn"}]  # no source
    bad.write_text(json.dumps(data))
    with pytest.raises(gt.GraphtraceError, match=r"copies\[0\] needs \"model\""):
        gt.load_guard(bad)
    data = t.guard().to_dict()
    data["format"] = "something else"
    bad.write_text(json.dumps(data))
    with pytest.raises(gt.GraphtraceError, match="not a graphtrace guard manifest"):
        gt.load_guard(bad)
    loaded = gt.load_guard(t.guard().to_json(tmp_path / "ok.json"))
    with pytest.raises(gt.GraphtraceError, match="never attached"):
        loaded.check()
    with pytest.raises(gt.GraphtraceError, match="no model named 'x'"):
        loaded.attach(model, name="x")
    with pytest.raises(TypeError):
        loaded.attach("not a model")


def test_guard_and_diff_need_a_capture_and_a_model_and_say_so_alike():
    """The same misuse raises the same error from t.guard() and t.diff(): a GraphtraceError
    that is a ValueError too (what t.diff() raised before)."""
    from graphtrace.errors import NothingToCheck

    with gt.trace(Model(0)) as t:
        pass
    for call in (t.guard, t.diff):
        with pytest.raises(NothingToCheck, match="recorded no capture") as caught:
            call()
        assert isinstance(caught.value, gt.GraphtraceError) and isinstance(caught.value,
                                                                            ValueError)
    with gt.trace() as t:
        with gt.capture("g"):
            Model(0)(X)
    for call in (t.guard, t.diff):
        with pytest.raises(NothingToCheck, match="no model is watched"):
            call()


def test_guard_and_diff_pick_the_live_pointer_with_one_function(monkeypatch):
    """Where a stale storage's graph should read now is decided by one function
    (graphtrace.stage.live_pointer) for the guard and the diff alike (issue 40)."""
    from graphtrace import stage

    model, t, graphs, guard = run("stale")
    calls = []
    real = stage.live_pointer

    def spy(*args):
        calls.append(len(args[0]))
        return real(*args)
    monkeypatch.setattr(stage, "live_pointer", spy)
    problems = guard.check()
    assert calls, "the guard did not ask stage.live_pointer"
    calls.clear()
    edges = t.diff().edges.set_index(["graph_id", "storage_id"])
    assert calls, "the diff did not ask stage.live_pointer"
    for g, sid, live in zip(problems["graph_id"], problems["storage_id"],
                            problems["live_data_ptr"]):
        assert live == edges.loc[(g, sid), "live_data_ptr"]


def test_two_models_by_name():
    a, b = Model(0), Model(1)
    with gt.trace(a, strict=True, name="a") as t:
        t.watch(b, name="b")
        with gt.capture("both") as g:
            b(a(X))
    guard = t.guard()
    assert guard.models == ["a", "b"]
    reload(b, seed=4)
    problems = guard.check()
    assert guard_problems(problems) == diff_problems(t.diff())
    assert len(problems) == 8
    with pytest.raises(gt.GraphtraceError, match="pass name="):
        guard.attach(a)
    del g


def test_opaque_handle_owner_agrees_with_diff():
    """A ScriptObject (quantized packed params) read by a graph is guarded like a tensor:
    stable before, stale once a new packed object is bound in its place."""
    from tests.test_opaque import _quantized, _requantize

    model = _quantized()
    with gt.trace(model, strict=True) as t:
        with gt.capture("g") as g:
            model(torch.rand(2, 4))
    guard = t.guard()
    assert "0._packed_params._packed_params" in set(guard.manifest["path"])
    assert guard.check().empty and t.diff().stale.empty
    _requantize(model, seed=1)
    problems = guard.check()
    assert guard_problems(problems) == diff_problems(t.diff())
    assert set(problems["owners"]) == {"0._packed_params._packed_params"}
    assert set(problems["verdict"]) == {"stale"} and list(problems["live_data_ptr"]) == [0]
    del g


class BigHolders(torch.nn.Module):
    """A parameter and a plain tensor attribute big enough that the CPU allocator hands a
    freed block's address straight back to the next allocation of that size: above glibc's
    largest mmap threshold (32 MiB), each is a mapping of its own, unmapped when freed, and
    the kernel maps the next one of that size into the same gap. (Smaller blocks come from
    the heap, where the address comes back only now and then.)"""

    N = (32 << 20) // 4 + 1024  # floats

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.rand(self.N))
        self.scale = torch.rand(self.N)

    def forward(self, x):
        return x.sum() * self.w * self.scale


def _same_address_again(old_ptr: int, numel: int, tries: int = 4) -> torch.Tensor | None:
    """A new tensor of `numel` floats whose storage lies at `old_ptr` (freed by the caller),
    or None after `tries` allocations (each miss is held, so the next one lands elsewhere)."""
    held = []
    for _ in range(tries):
        t = torch.empty(numel)
        if t.data_ptr() == old_ptr:
            return t
        held.append(t)
    return None


@pytest.mark.parametrize("holder", ["w", "scale"])
def test_a_new_storage_at_the_freed_address_is_not_the_captured_one(holder):
    """Note [guard identity]: the guard compares storages, not addresses. The owner is rebound
    to a NEW storage that lies at the captured (freed) storage's address, while the guard
    holds its weak handle: the graph reads freed memory (dangling), whatever lies there."""
    model = BigHolders()
    with gt.trace(model, strict=True) as t:
        with gt.capture("g", emulate=False):  # no capture artifact keeps the storage alive
            model(torch.rand(2, 4))
    guard = t.guard()
    assert guard.identity == {"storage": 2, "data_ptr": 0}
    assert guard.check().empty
    old = getattr(model, holder)
    old_ptr, numel, cdata = old.data_ptr(), old.numel(), old.untyped_storage()._cdata
    ref = StorageWeakRef(old.untyped_storage())
    delattr(model, holder)  # the captured storage is freed (the guard holds it weakly)
    del old
    gc.collect()
    assert ref.expired(), "something keeps the captured storage alive"
    new = _same_address_again(old_ptr, numel)
    if new is None:
        pytest.skip(f"the allocator did not hand address {old_ptr:#x} out again (4 tries): "
                    "the address-reuse case cannot be made here")
    assert new.untyped_storage()._cdata != cdata  # another storage, the same address
    new = new.copy_(torch.rand(numel))
    setattr(model, holder, torch.nn.Parameter(new) if holder == "w" else new)
    problems = guard.check()
    assert list(problems["owners"]) == [holder], problems
    assert list(problems["verdict"]) == ["dangling"] and list(problems["statuses"]) == ["moved"]
    assert list(problems["live_data_ptr"]) == [old_ptr]  # the same address, all the same
    assert guard_problems(problems) == diff_problems(t.diff())
    with pytest.raises(gt.StaleGraphError, match=rf"dangling .* owned by {holder} \[moved\]"):
        guard.enforce()


# -- one look per holder (issue 39; Note [one look per holder] in graphtrace/guard/blind.py) ---

class Norms(torch.nn.Module):
    """Three Linear+LayerNorm blocks: each LayerNorm's `eps` is baked into every graph."""

    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8)) for _ in range(3))

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x


def _norm_guard(n_graphs: int = 4):
    model = Norms()
    keep = []
    with gt.trace(model, strict=True) as t:
        for bs in range(1, n_graphs + 1):
            with gt.capture(f"bs{bs}") as g:
                model(torch.rand(bs, 8))
            keep.append(g)
    return model, t, keep, t.guard()


@pytest.mark.parametrize("with_native", [True, False])
def test_a_changed_eps_names_every_graph_after_one_look_per_holder(with_native, monkeypatch):
    """A float held by a module and baked into 4 graphs is 4 records; a check looks at its
    holder once (in C++ when the native module is there: no Python look on a clean check),
    and the rows still name every graph, as the diff does."""
    import pandas as pd

    from graphtrace import native
    from graphtrace.guard import blind as guardspots

    model, t, keep, guard = _norm_guard()
    if with_native and native.load() is None:
        pytest.skip("the native module does not build here")
    if not with_native:
        guard._native = None
    assert len(guard.blind_spots) == 3 * 4  # one record per holder and graph
    looks = []
    resolve = guardspots.resolve_value
    monkeypatch.setattr(guardspots, "resolve_value",
                        lambda m, p: looks.append(p) or resolve(m, p))
    assert guard.check().empty
    assert sorted(looks) == ([] if with_native else [f"blocks.{i}.1.eps" for i in range(3)])
    model.blocks[0][1].eps = float("1e-5")  # an equal float, another object: unchanged
    assert guard.check().empty
    looks.clear()
    model.blocks[1][1].eps = 1e-3
    rows = guard.check()
    assert sorted(looks) == [f"blocks.{i}.1.eps" for i in range(3)]  # once each
    assert sorted(rows["graph"]) == [f"bs{b}" for b in range(1, 5)]
    assert set(rows["owners"]) == {"blocks.1.1.eps"} and set(rows["statuses"]) == {"changed"}
    diff = {(b["graph"], b["holder"]) for b in t.diff().meta["blind_spots"]
            if b["kind"] == "baked scalar"}
    assert diff == set(zip(rows["graph"], rows["owners"]))
    other = guard._native
    guard._native = native.load() if other is None else None
    pd.testing.assert_frame_equal(rows, guard.check())  # the other path, the same rows
    guard.accept = ["baked scalar"]
    assert guard.check().empty
