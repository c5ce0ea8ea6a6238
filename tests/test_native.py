"""The native writer: same records as the Python writer, and a clear story when it can't build."""

from __future__ import annotations

import functools
import inspect
import os
import subprocess
import sys
import time
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.testing._internal.two_tensor import TwoTensor

import graphtrace as gt
from graphtrace import native
from graphtrace._compat import calls_op_directly
from graphtrace.demo import ops


class Workload(torch.nn.Module):
    """Every argument shape the writers handle differently: lists with None, kwargs, out=,
    in-place, views, conditional aliases, tuple and Tensor[] returns, a tensor subclass (the
    native writer hands that op to the Python one), custom ops with a partial."""

    def __init__(self):
        super().__init__()
        self.norm = torch.nn.LayerNorm(8)
        self.proj = torch.nn.Linear(8, 8)
        self.perm = torch.tensor([3, 1, 2, 0], dtype=torch.int32)
        self.act_perm = functools.partial(ops.permute_cols, perm=self.perm)
        self.b = torch.randint(-8, 8, (4, 3), dtype=torch.int8)
        self.scales = torch.rand(2, 3)
        self.index = torch.nn.Parameter(torch.tensor([1, 0]), requires_grad=False)
        self.out = torch.empty(2, 8)

    def forward(self, x):
        h = self.proj(self.norm(x))                       # tuple return (native_layer_norm)
        h = h.t().contiguous().t()                        # views and a copy
        a, b = h.unbind(0)                                # Tensor[] return
        c = torch.cat([a, b, a])                          # Tensor[] argument
        g = c.view(3, 8)[:, torch.tensor([0, 2, 4, 6])]   # index with [None, idx]
        torch.mm(x, self.proj.weight, out=self.out)       # out= write (kwarg)
        self.out.add_(1)                                  # in-place write
        y = self.act_perm(x[:, :4].contiguous())          # custom op + partial
        z = ops.machete_mm(y, self.b, 0, None, self.scales, None, 2, None, None, None)
        twin = TwoTensor(z, z * 2) * 3                    # subclass: the Python writer's op
        s = torch.index_select(h, 0, self.index)          # a Parameter as an argument
        d = g.to(torch.float64).sum() + h.to(torch.float32).sum()  # aten::to copies, then not
        e = torch._foreach_add([a, b], 1.0)               # Tensor[] fresh outputs
        return d + s.sum() + twin.a.sum() + e[1].sum()


def _record(native_flag: bool, model: Workload, x: torch.Tensor):
    with gt.trace(model, strict=True, native=native_flag) as t, torch.no_grad():
        with gt.capture("g", emulate=False):
            model(x)
    assert t.recorder.backend == ("native" if native_flag else "python")
    return t


def test_native_and_python_writers_record_the_same_rows():
    torch.manual_seed(0)
    model, x = Workload(), torch.randn(2, 8)
    py = _record(False, model, x).accesses
    nat = _record(True, model, x).accesses
    assert len(py) > 80 and {"read", "write", "view", "factory"} <= set(py.access.astype(str))
    assert "graphtrace::machete_mm" in set(py.op.astype(str))
    assert py[py.op.astype(str).str.startswith("aten::_foreach_add")].access.astype(str).tolist() \
        == ["read", "read", "factory", "factory"]
    # intermediates land at other addresses each run: compare everything else exactly
    cols = [c for c in py.columns if c != "data_ptr"]
    assert py[cols].astype(str).equals(nat[cols].astype(str))
    # storages that outlive the runs (parameters, attributes, inputs) have the same addresses
    external = {x.data_ptr(), model.perm.data_ptr(), model.proj.weight.data_ptr(),
                model.index.data_ptr(), model.out.data_ptr()}
    assert set(py.data_ptr) & external == external
    assert set(py.data_ptr) & external == set(nat.data_ptr) & external


def test_native_and_python_writers_give_the_same_report():
    torch.manual_seed(0)
    model, x = Workload(), torch.randn(2, 8)
    traces = [_record(flag, model, x) for flag in (False, True)]
    old = model.perm  # kept alive: stale (freed, it would be dangling)
    model.perm = torch.tensor([0, 1, 2, 3], dtype=torch.int32)  # rebind: stale for both
    model.act_perm = functools.partial(ops.permute_cols, perm=model.perm)
    edges = [t.diff().edges for t in traces]
    cols = ["graph", "storage_id", "verdict", "owners", "ops", "args"]
    assert edges[0][cols].astype(str).equals(edges[1][cols].astype(str))
    stale = edges[0][edges[0].verdict.astype(str) == "stale"]
    assert len(stale) == 1 and "act_perm.keywords['perm']" in stale.owners.iloc[0]
    assert stale.data_ptr.iloc[0] == old.data_ptr()


@pytest.fixture
def unbuilt(monkeypatch):
    """A machine where the extension cannot be built (no compiler)."""
    def fail():
        raise RuntimeError("Error building extension\nrecorder.cpp:1: error: no C++ compiler\n"
                           "ninja: build stopped")

    monkeypatch.setattr(native, "_module", None)
    monkeypatch.setattr(native, "_error", None)
    monkeypatch.setattr(native, "_build", fail)


def test_auto_falls_back_to_python_with_a_warning_when_it_cannot_build(unbuilt, monkeypatch):
    monkeypatch.delenv("GRAPHTRACE_NATIVE", raising=False)
    x = torch.randn(3)
    with pytest.warns(RuntimeWarning, match="no C\\+\\+ compiler.*pure-Python recorder"):
        t = gt.trace(strict=True)
    with t:
        with gt.capture():
            x * 2
    assert t.recorder.backend == "python" and len(t.accesses) == 2
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # said once per process, not per trace
        assert gt.trace().recorder.backend == "python"


def test_required_native_fails_with_the_build_error(unbuilt, monkeypatch, capsys):
    with pytest.raises(native.NativeUnavailable, match="required.*error: no C\\+\\+ compiler"):
        gt.trace(native=True)
    monkeypatch.setenv("GRAPHTRACE_NATIVE", "1")
    with pytest.raises(native.NativeUnavailable, match="GRAPHTRACE_NATIVE=1"):
        gt.trace()
    assert native.main([]) == 1 and "no C++ compiler" in capsys.readouterr().err
    monkeypatch.setenv("GRAPHTRACE_NATIVE", "0")
    assert gt.trace().recorder.backend == "python"  # never tries


@pytest.fixture
def fresh_load(monkeypatch):
    """native.load() as in a new process; torch's builder replaced by `builder.calls`."""
    import torch.utils.cpp_extension as cpp

    calls = []

    def fake_builder(name, sources, **kwargs):
        folder = Path(cpp._get_build_directory(name, verbose=False))
        calls.append({"name": name, "lock": (folder / "lock").exists()})
        return native  # any module will do: nothing records with it here

    monkeypatch.setattr(native, "_module", None)
    monkeypatch.setattr(native, "_error", None)
    monkeypatch.setattr(cpp, "load", fake_builder)
    return calls


def test_a_built_extension_is_imported_without_torchs_builder(fresh_load):
    module = native.load(required=True)
    assert fresh_load == [] and hasattr(module, "Writer") and hasattr(module, "Storages")


def test_the_build_folder_is_found_without_importing_torchs_builder(monkeypatch, tmp_path):
    """The guess agrees with the builder's own answer, with and without TORCH_EXTENSIONS_DIR,
    and a process that loads the built extension never imports the builder (setuptools)."""
    from graphtrace import _compat

    name = native._name()
    for env in (None, str(tmp_path)):
        if env is None:
            monkeypatch.delenv("TORCH_EXTENSIONS_DIR", raising=False)
        else:
            monkeypatch.setenv("TORCH_EXTENSIONS_DIR", env)
        assert _compat.extension_build_directory_guess(name) == \
            _compat.extension_build_directory(name), env
    monkeypatch.undo()
    native.load(required=True)  # built here (the suite's extension folder)
    code = ("import sys, graphtrace.native as n; m = n.load(required=True); "
            "print(hasattr(m, 'Writer'), 'torch.utils.cpp_extension' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["True", "False"], out.stdout + out.stderr[-2000:]


def test_a_build_lock_left_by_a_killed_build_is_removed(fresh_load, monkeypatch, tmp_path):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))  # nothing built there yet
    folder = tmp_path / native._name()
    folder.mkdir()
    lock = folder / "lock"
    lock.touch()
    old = time.time() - native.STALE_LOCK_S - 60
    os.utime(lock, (old, old))
    with pytest.warns(RuntimeWarning, match="removing .*lock.*interrupted"):
        native.load(required=True)
    assert fresh_load == [{"name": native._name(), "lock": False}] and not lock.exists()
    # a young lock is a build running in another process: left to torch's builder to wait on
    monkeypatch.setattr(native, "_module", None)
    lock.touch()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        native.load(required=True)
    assert fresh_load[-1] == {"name": native._name(), "lock": True} and lock.exists()


def test_bad_native_settings_are_clear(monkeypatch):
    monkeypatch.setenv("GRAPHTRACE_NATIVE", "sometimes")
    with pytest.raises(ValueError, match="GRAPHTRACE_NATIVE='sometimes': use auto, 1 or 0"):
        gt.trace()
    with pytest.raises(TypeError, match="native must be True, False or None"):
        gt.trace(native="yes")


def test_native_table_holds_weak_handles_only():
    x = torch.randn(1000)
    with gt.trace(strict=True, native=True) as t:
        with gt.capture("g", emulate=False):
            y = x * 2
    table = t.recorder.storages
    sids = [table.find(v.untyped_storage()._cdata) for v in (x, y)]
    assert None not in sids and all(table.alive(s) for s in sids)
    del y
    assert table.alive(sids[0]) and not table.alive(sids[1])  # freed: the trace kept nothing
    assert table.upgrade(sids[1]) is None and table.upgrade(sids[0]).data_ptr() == x.data_ptr()
    assert len(table.handles) == len(table.data_ptrs) == len(table.devices) == 2


def test_dead_intermediates_are_released_and_their_addresses_are_new_storages():
    """The native table releases the handles of storages that died (so their StorageImpls are
    freed, as untraced); an address that comes back is a new storage, never the old one."""
    x = torch.randn(64)
    keep = []
    with gt.trace(strict=True, native=True) as t:
        with gt.capture("g", emulate=False):
            for i in range(600):
                y = x + i          # dies at the next iteration: its address is free again
                if i % 100 == 0:
                    keep.append(y)
    table = t.recorder.storages
    factory = t.accesses[t.accesses.access == "factory"]
    assert len(factory) == 600 and factory.storage_id.nunique() == 600
    assert table.native_table.released() >= 500
    handles = np.frombuffer(table.handles, dtype=np.int64)
    alive = table.alive_mask()
    assert not alive[handles == 0].any()                # released reads freed
    kept = [table.find(k.untyped_storage()._cdata) for k in keep]
    assert None not in kept and all(alive[kept]) and all(handles[kept] != 0)
    assert table.upgrade(kept[0]).data_ptr() == keep[0].data_ptr()
    dead = int(np.flatnonzero(handles == 0)[0])
    assert table.upgrade(dead) is None and not table.alive(dead)
    # the same verdicts either way: the Python table keeps every handle and sweeps nothing
    with gt.trace(strict=True, native=False) as tp:
        with gt.capture("g", emulate=False):
            for i in range(600):
                y = x + i
    assert tp.recorder.storages.alive_mask().sum() == 2  # x and the last y
    assert alive.sum() == 2 + len(keep)


def test_sweeping_can_be_turned_off_for_measurement():
    x = torch.randn(64)
    t = gt.trace(strict=True, native=True)
    t.recorder.storages.native_table.set_sweeping(False)
    with t:
        with gt.capture("g", emulate=False):
            for i in range(300):
                y = x + i
    table = t.recorder.storages
    assert table.native_table.released() == 0 and 0 not in table.handles
    live = {table.find(s.untyped_storage()._cdata) for s in (x, y)}  # x and the last y
    assert set(np.flatnonzero(table.alive_mask())) == live and len(set(t.accesses.storage_id)) == 301


def test_the_extension_packs_records_with_encoding_py_constants():
    from graphtrace import encoding

    module = native.load(required=True)
    values = {name: getattr(module, name, None) for name in encoding.NATIVE_CONSTANTS}
    assert values == {name: getattr(encoding, name) for name in encoding.NATIVE_CONSTANTS}
    # and a row it writes unpacks with encoding's helpers to what the op did
    x = torch.randn(4)
    with gt.trace(strict=True, native=True) as t:
        with gt.capture("g", emulate=False):
            x.add_(1)
    cap = t.recorder.captures[0]
    rows = np.frombuffer(cap.accesses, dtype=np.int64).reshape(-1, encoding.ACCESS_FIELDS)
    assert [encoding.code_access(int(c)) for c in rows[:, 1]] == [encoding.WRITE]
    sid = encoding.slot_storage(int(rows[0, 2]))
    assert sid == t.recorder.storages.find(x.untyped_storage()._cdata)


@pytest.mark.parametrize("use_native", [False, True], ids=["python", "native"])
def test_both_writers_follow_the_writer_protocol(use_native):
    from graphtrace.recorder import PyWriter, Recorder, RecordingMode, Writer

    recorder = Recorder(strict=True, native=native.load(required=True) if use_native else None)
    assert (recorder.storages.native_table is not None) == use_native
    mode = RecordingMode(recorder, recorder.new_capture("g", "emulated"))
    assert isinstance(mode.writer, Writer)
    assert isinstance(mode.writer, PyWriter) != use_native
    with mode:
        torch.randn(3) * 2
    assert len(mode.capture.ops) == (0 if use_native else 2)  # the native one buffers
    mode.finish()
    assert len(mode.capture.ops) == 2


@pytest.mark.parametrize("emulate", [False, True])
def test_a_recording_error_fails_open_in_either_dispatch_path(monkeypatch, emulate):
    """With nothing to keep the native writer records from C (Note [native dispatch]); with an
    emulated graph the Python path does. Both count an error and raise it in strict mode."""
    import graphtrace.recorder as recorder

    def broken(func):
        raise RuntimeError("no plan")

    monkeypatch.setattr(recorder, "op_info", broken)
    x = torch.randn(3)
    with gt.trace(native=True) as t:
        with gt.capture("g", emulate=emulate):
            y = x * 2
    assert torch.equal(y, x * 2)
    assert t.recorder.n_errors == 1 and "no plan" in t.errors[0]["message"]
    assert "aten.mul" in t.errors[0]["where"]
    with pytest.raises(RuntimeError, match="no plan"):
        with gt.trace(native=True, strict=True):
            with gt.capture("g", emulate=emulate):
                x * 2


@pytest.mark.parametrize("emulate", [False, True])
def test_an_ops_own_error_reaches_the_caller_unchanged(emulate):
    m = torch.nn.Linear(2, 2)
    with gt.trace(m, native=True, strict=True) as t, torch.no_grad():
        with gt.capture("g", emulate=emulate):
            with pytest.raises(RuntimeError, match="size of tensor a"):
                torch.randn(3) + torch.randn(4)
            m(torch.ones(1, 2))  # the capture goes on recording
    assert t.recorder.n_errors == 0
    report = t.diff()
    assert not report.accesses["op"].astype(str).str.startswith("aten::add.").any()
    assert (report.accesses["op"].astype(str) == "aten::addmm").any()
    assert {"weight", "bias"} <= set(report.edges["owners"].explode())


def _mul_rows(native_flag: bool):
    """One op called again and again at the same argument position: the same tensor, the
    same tensor after in-place metadata and storage changes, then fresh tensors at the freed
    storages' addresses (the native writer's per-argument memo must tell each apart)."""
    x = torch.randn(4, 4)
    m = torch.nn.Linear(2, 2)
    with gt.trace(m, native=native_flag, strict=True) as t:
        with gt.capture("g", emulate=False):
            for _ in range(3):
                torch.mul(x, 2)
            x.t_()                                     # same TensorImpl and storage, new strides
            torch.mul(x, 2)
            x.set_(torch.randn(16).untyped_storage(), 0, (4, 4), (4, 1))  # a new storage
            torch.mul(x, 2)
            x.as_strided_((2, 2), (1, 2), 3)           # new view of the same storage
            torch.mul(x, 2)
            for _ in range(100):  # each freed and its handle released at once (as a compiled
                torch.mul(torch.randn(4, 4), 2)  # region's return does): addresses come back
                t.recorder.storages.sweep(0)
    rows = t.diff().accesses
    return rows[(rows["op"].astype(str) == "aten::mul.Tensor") & (rows["arg"] == "self")]


def test_repeated_arguments_get_the_python_writers_ids():
    native_rows, python_rows = _mul_rows(True), _mul_rows(False)
    cols = ["storage_id", "dtype", "shape", "stride", "offset"]
    assert native_rows[cols].astype(str).values.tolist() == \
        python_rows[cols].astype(str).values.tolist()
    sids = native_rows["storage_id"].tolist()
    assert sids[0] == sids[1] == sids[2] == sids[3]    # same storage, transposed view
    assert sids[4] != sids[3] and sids[5] == sids[4]  # set_: a new storage, then a new view
    assert native_rows["stride"].astype(str).tolist()[:6] == [
        "(4, 1)", "(4, 1)", "(4, 1)", "(1, 4)", "(4, 1)", "(1, 2)"]
    assert len(set(sids[6:])) == 100                   # every fresh tensor its own storage


def test_the_native_dispatch_calls_op_directly_only_as_torchs_call_would(monkeypatch):
    """An exact OpOverload runs through `_op` from C only while OpOverload.__call__ is
    `return self._op(*args, **kwargs)` (torch 2.13); a torch whose __call__ does more keeps it
    (2.14: it checks a Python dispatcher first)."""
    from torch._ops import OpOverload

    lib = native.load(required=True)
    native.configure_dispatch(lib)  # as loaded under this torch (idempotent)
    body = [line.strip() for line in inspect.getsource(OpOverload.__call__).splitlines()
            if line.strip() and not line.strip().startswith(("#", "def ", "@"))]
    direct = body == ["return self._op(*args, **kwargs)"]  # read from the source, not bytecode
    assert calls_op_directly(OpOverload) == direct
    version = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2])
    assert direct == {(2, 13): True, (2, 14): False}.get(version, direct), \
        f"torch {torch.__version__}: OpOverload.__call__ changed: {body}"
    calls = []
    original = OpOverload.__call__

    def counted(self, /, *args, **kwargs):
        calls.append(str(self))
        return original(self, *args, **kwargs)

    def run():
        with gt.trace(native=True, strict=True):
            with gt.capture("g", emulate=False):
                return torch.ones(2) * 3

    monkeypatch.setattr(OpOverload, "__call__", counted)
    try:
        # still configured for torch's own __call__: the direct path never calls it
        assert torch.equal(run(), torch.full((2,), 3.0))
        assert (calls == []) if direct else ("aten.mul.Tensor" in calls), calls
        calls.clear()
        assert not calls_op_directly(OpOverload)
        native.configure_dispatch(lib)  # what loading the extension under this torch does
        assert torch.equal(run(), torch.full((2,), 3.0))
        assert "aten.mul.Tensor" in calls
    finally:
        monkeypatch.undo()
        native.configure_dispatch(lib)
    assert calls_op_directly(OpOverload) == direct


class _FloatHolder:
    def __init__(self):
        self.scale = 0.5  # not a module: its attributes are not scalar holders


class _Floats(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(2, 2)
        self.lin.scale = 0.5
        self.lin.scaling = {"default": 0.5, "b": 2.0, 3: 0.25, ("t", 1): 0.5, None: 0.5,
                            frozenset([1]): 0.5, "n": 7, "nan": float("nan")}
        self.lin.big = {i: 0.5 for i in range(65)}  # too long to be a scalar holder
        self.drop = torch.nn.Dropout(0.25)
        self.norm = torch.nn.LayerNorm(2, eps=1e-5)
        self.holder = _FloatHolder()
        self.empty, self.flag, self.count = {}, True, 3
        setattr(self, "not an identifier", 0.5)
        self.__dict__[7] = 0.5  # a non-str key in a module's __dict__


def test_native_float_holders_give_scalar_owners_python_answer():
    """owners.scalar_owners reads the modules' attributes in C++ with the native module
    (`float_holders`): the same (path, value) pairs as in Python, in the same order, with
    and without `values` (the floats one graph baked in)."""
    from graphtrace.owners import scalar_owners

    mod = native.resolve(True)
    model = _Floats()
    model.seq = torch.nn.Sequential(_Floats())  # nested prefixes
    for values in (None, {0.5}, {0.25: "op", 2.0: "op"}, frozenset({1e-5}), set()):
        python = scalar_owners(model, values)
        assert scalar_owners(model, values, mod) == python
        assert python if values != set() else not python
    assert ("lin.scaling[None]", 0.5) in scalar_owners(model, None, mod)
    assert ("drop.p", 0.25) in scalar_owners(model, None, mod)
    with pytest.raises(TypeError, match="float_holders"):
        mod.float_holders([("", model)], {"x"}, [0.5])  # values: a set, a dict or None
    with pytest.raises(TypeError, match="float_holders"):
        mod.float_holders([model], {"x"}, None)


def test_native_named_modules_lists_what_owners_named_modules_does():
    """The native `named_modules` (the baked-scalar match's module list): same (prefix,
    module) pairs in the same order as graphtrace.owners.named_modules, through a shared
    module (listed under each name), a None child and a cycle of registered children (not
    entered again); a bad `_modules` is an error, not a crash."""
    from graphtrace.owners import named_modules

    mod = native.resolve(True)
    shared = torch.nn.Linear(2, 2)
    model = torch.nn.Sequential(torch.nn.Sequential(shared, torch.nn.ReLU()), shared)
    model.register_module("gone", None)
    a, b = torch.nn.Module(), torch.nn.Module()
    a.child = b
    b.parent = a  # a cycle through registered children
    model.a = a
    model.deep = _Floats()
    for m in (model, a, shared, torch.nn.Module()):
        want = named_modules(m)
        got = mod.named_modules(m)
        assert [p for p, _ in got] == [p for p, _ in want]
        assert all(x is y for (_, x), (_, y) in zip(got, want))
    assert [p for p, _ in mod.named_modules(model)].count("1") == 1  # shared: "0.0" and "1"
    assert "0.0" in [p for p, _ in mod.named_modules(model)]
    broken = torch.nn.Module()
    broken.__dict__["_modules"] = 5
    with pytest.raises((TypeError, AttributeError)):
        mod.named_modules(broken)
    with pytest.raises(AttributeError):
        mod.named_modules(object())


def test_native_table_names_each_storage_device_when_devices_alternate():
    """Storages made on alternating devices in one capture keep each its own device in the
    native table (it remembers the last device looked up), as in the Python table."""
    a, m = torch.randn(8), torch.randn(8, device="meta")
    devices = {}
    for native_writer in (True, False):
        with gt.trace(strict=True, native=native_writer) as t:
            with gt.capture("g", emulate=False):
                outs = [(a if i % 2 == 0 else m) * (i + 1) for i in range(6)]
        table = t.recorder.storages
        devices[native_writer] = [
            table.devices[table.find(v.untyped_storage()._cdata)] for v in (a, m, *outs)]
    want = ["cpu", "meta"] + ["cpu", "meta"] * 3
    assert devices[True] == devices[False] == want


def test_captures_of_one_trace_each_record_only_their_own_rows():
    """The native writer's buffers pass from one capture to the next of a trace (Note [record
    buffers reused] in graphtrace/csrc/recorder.cpp): a small capture after a large one, and
    one with a Python-writer op (a subclass) mid-capture, record exactly the Python writer's rows."""
    torch.manual_seed(0)
    model, x = Workload(), torch.randn(2, 8)
    rows = {}
    for native_flag in (True, False):
        with gt.trace(model, strict=True, native=native_flag) as t, torch.no_grad():
            for label, fn in (("large", lambda: model(x)), ("small", lambda: x * 2),
                              ("large again", lambda: model(x)), ("one", lambda: x + 1)):
                with gt.capture(label, emulate=False):
                    fn()
        acc = t.accesses
        rows[native_flag] = acc[[c for c in acc.columns if c != "data_ptr"]].astype(str)
    small = rows[True][rows[True].graph.astype(str) == "small"]
    assert len(small) == 2 and small.op.astype(str).tolist() == ["aten::mul.Tensor"] * 2
    assert rows[True].equals(rows[False])
