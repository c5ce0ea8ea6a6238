"""The recorder, capture boundaries and emulated graphs, through the public API."""

from __future__ import annotations

import functools
import gc
import subprocess
import sys
import threading

import pytest
import torch
from torch.multiprocessing.reductions import StorageWeakRef

import graphtrace as gt
from graphtrace.demo import ops

pytestmark = pytest.mark.usefixtures("writer")  # every test on both writers


def rows(trace, **where):
    df = trace.accesses
    for col, val in where.items():
        df = df[df[col].astype(str) == val]
    return df


def test_custom_ops_recorded_with_op_and_argument_names():
    perm = torch.tensor([3, 1, 2, 0], dtype=torch.int32)
    act_perm = functools.partial(ops.permute_cols, perm=perm)
    b = torch.randint(-8, 8, (4, 3), dtype=torch.int8)
    scales = torch.rand(2, 3)
    x = torch.randn(2, 4)
    with gt.trace(strict=True) as t:
        with gt.capture("mm"):
            y = ops.machete_mm(act_perm(x), b, 0, None, scales, None, 2, None, None, None)
    df = t.accesses
    permute = df[df.op == "graphtrace::permute_cols"]
    assert list(permute.arg.astype(str)) == ["A", "perm", "out"]
    assert list(permute.access.astype(str)) == ["read", "read", "factory"]
    perm_row = permute[permute.arg == "perm"].iloc[0]
    assert perm_row.data_ptr == perm.data_ptr() and perm_row["dtype"] == "int32"
    mm = df[df.op == "graphtrace::machete_mm"]
    assert set(mm.arg.astype(str)) == {"A", "B", "group_scales", "out"}
    assert mm[mm.arg == "group_scales"].data_ptr.iloc[0] == scales.data_ptr()
    assert mm[mm.arg == "out"].data_ptr.iloc[0] == y.data_ptr()


def test_in_place_and_out_ops_are_writes_views_alone_are_not_reads():
    a, b, out = torch.randn(3, 3), torch.randn(3, 3), torch.empty(3, 3)
    with gt.trace(strict=True) as t:
        with gt.capture():
            a.add_(1)
            torch.mm(a, b, out=out)
            b.t()
    df = t.accesses
    add = df[df.op == "aten::add_.Tensor"]
    assert list(add.access.astype(str)) == ["write"]
    mm = df[df.op == "aten::mm.out"]
    assert dict(zip(mm.arg.astype(str), mm.access.astype(str))) == {
        "self": "read", "mat2": "read", "out": "write"}
    view = df[df.op == "aten::t"]
    assert set(view.access.astype(str)) == {"view"}
    b_rows = df[(df.data_ptr == b.data_ptr()) & (df.op != "aten::mm.out")]
    assert set(b_rows.access.astype(str)) == {"view"}


def test_offset_view_maps_to_base_storage_with_offset():
    base = torch.arange(20, dtype=torch.float32)
    view = base[5:15].view(2, 5)
    with gt.trace(strict=True) as t:
        with gt.capture():
            view.sum()
    read = rows(t, op="aten::sum", arg="self").iloc[0]
    base_read = t.accesses[t.accesses.storage_id == read.storage_id]
    assert read["offset"] == 5 and read["shape"] == "(2, 5)" and read["stride"] == "(5, 1)"
    assert read.data_ptr == base.data_ptr() + 5 * 4 == view.data_ptr()
    assert len(base_read) == 1


def test_schema_views_lists_with_none_and_parameters():
    w = torch.nn.Parameter(torch.randn(4, 4))
    index = torch.nn.Parameter(torch.tensor([1.0]), requires_grad=False).long()
    perm = torch.tensor([3, 2, 1, 0])
    x = torch.randn(2, 4)
    with gt.trace(strict=True) as t:
        with gt.capture():
            w[:, :]                                   # aten::alias or slice: view only
            torch.index_select(x, 0, torch.tensor([0]))
            x[:, perm]                                # aten::index with [None, perm]
            w.reshape(16)                             # _unsafe_view / view shares w's storage
            torch.nn.functional.embedding(torch.tensor([0]), w)
    df = t.accesses
    index_rows = df[df.op == "aten::index.Tensor"]
    assert perm.data_ptr() in set(index_rows[index_rows.arg == "indices"].data_ptr)
    w_sid = df[df.data_ptr == w.data_ptr()].storage_id.iloc[0]
    w_rows = df[df.storage_id == w_sid]
    assert set(w_rows[w_rows.op != "aten::embedding"].access.astype(str)) == {"view"}
    assert "read" in set(w_rows[w_rows.op == "aten::embedding"].access.astype(str))
    del index


def test_nested_tensor_lists_are_walked():
    a, b = torch.randn(2), torch.randn(3)
    with gt.trace(strict=True) as t:
        with gt.capture():
            torch.cat([a, b])
    cat = rows(t, op="aten::cat", arg="tensors")
    assert set(cat.data_ptr) == {a.data_ptr(), b.data_ptr()}


def test_traceable_subclass_is_flattened():
    from torch.testing._internal.two_tensor import TwoTensor

    a, b = torch.randn(3), torch.randn(3)
    tt = TwoTensor(a, b)
    with gt.trace(strict=True) as t:
        with gt.capture():
            tt * 2
    mul = rows(t, arg="self")
    assert {a.data_ptr(), b.data_ptr()} <= set(mul.data_ptr)


def test_module_attribution_names_innermost_watched_module():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(),
                                torch.nn.Sequential(torch.nn.Linear(4, 2)))
    with gt.trace(model, strict=True) as t:
        with gt.capture():
            model(torch.randn(1, 4))
    df = t.accesses
    assert set(df[df.op == "aten::addmm"].module.astype(str)) == {"0", "2.0"}
    assert set(df[df.op == "aten::relu"].module.astype(str)) == {"1"}


def test_traced_storages_are_freed_after_del():
    x = torch.randn(8)
    with gt.trace(strict=True) as t:
        with gt.capture() as g:
            y = x * 3
    refs = [StorageWeakRef(x.untyped_storage()), StorageWeakRef(y.untyped_storage())]
    del x, y
    gc.collect()
    assert not refs[0].expired()  # the emulated graph, like a real one, keeps its tensors alive
    del g
    gc.collect()
    assert all(r.expired() for r in refs)
    assert len(t.accesses) == 2  # the records survive the tensors they describe


def test_emulated_replay_reads_captured_storage_not_rebound_attribute():
    class Holder(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.scale = torch.full((4,), 2.0)  # a plain attribute, not a buffer

        def forward(self, x):
            return x * self.scale

    model = Holder()
    x = torch.ones(4)
    with gt.trace(model, strict=True):
        with gt.capture("g") as g:
            y = model(x)
    assert torch.equal(y, torch.full((4,), 2.0))
    x.fill_(3.0)                      # mutate a captured input in place: replay sees it
    g.replay()
    assert torch.equal(y, torch.full((4,), 6.0))
    model.scale = torch.full((4,), 10.0)  # rebind: eager sees it, the graph does not
    g.replay()
    assert torch.equal(y, torch.full((4,), 6.0))
    assert torch.equal(model(x), torch.full((4,), 30.0))


def test_replay_chains_intermediates_and_in_place_ops():
    w = torch.randn(4, 4)
    x = torch.randn(2, 4)
    with gt.trace(strict=True):
        with gt.capture() as g:
            h = x @ w
            h.relu_()
            out = h[:, :2] + 1
    x.copy_(torch.randn(2, 4))
    g.replay()
    assert torch.allclose(out, (x @ w).relu()[:, :2] + 1)


def test_nothing_recorded_outside_capture_and_graph_ids_are_distinct():
    x = torch.randn(4)
    with gt.trace(strict=True) as t:
        x + 1
        with gt.capture("a"):
            x + 2
        x + 3
        with gt.capture("b"):
            x + 4
        with gt.capture():
            x + 5
    df = t.accesses
    assert list(df.groupby("graph_id", observed=True).size()) == [2, 2, 2]
    assert [c.label for c in t.captures] == ["a", "b", "graph2"]
    assert sorted(df.graph_id.unique()) == [0, 1, 2]


def test_two_threads_capturing_at_once_do_not_mix():
    barrier = threading.Barrier(2)
    tensors = {"left": torch.randn(4), "right": torch.randn(4)}

    def work(name):
        with gt.capture(name):
            barrier.wait()
            for _ in range(50):
                tensors[name] * 2
            barrier.wait()

    with gt.trace(strict=True) as t:
        threads = [threading.Thread(target=work, args=(n,)) for n in tensors]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
    df = t.accesses
    for name, tensor in tensors.items():
        mine = df[df.graph == name]
        reads = mine[mine.access == "read"]
        assert len(mine) == 100 and set(reads.data_ptr) == {tensor.data_ptr()}


def test_bad_input_gets_clear_errors():
    with pytest.raises(gt.GraphtraceError, match="inside `with graphtrace.trace"):
        with gt.capture("x"):
            pass
    with gt.trace():
        with pytest.raises(gt.GraphtraceError, match="does not nest"):
            with gt.trace():
                pass
        with pytest.raises(gt.GraphtraceError, match="do not nest"):
            with gt.capture("a"):
                with gt.capture("b"):
                    pass
    with pytest.raises(TypeError, match="nn.Module"):
        gt.trace(object())
    with pytest.raises(TypeError, match="nn.Module"):
        gt.trace().watch("model")
    with pytest.raises(TypeError, match="label"):
        gt.capture(3)


def test_fail_open_counts_errors_and_strict_raises(monkeypatch):
    import graphtrace.recorder as recorder

    def broken(func):
        raise RuntimeError("boom")

    monkeypatch.setattr(recorder, "op_info", broken)  # every op fails to plan
    x = torch.randn(3)
    with gt.trace() as t:
        with gt.capture():
            y = x + 1  # the traced program keeps running
    assert torch.equal(y, x + 1)
    assert t.recorder.n_errors == 1 and "boom" in t.errors[0]["message"]
    assert "Traceback" in t.errors[0]["traceback"]
    with pytest.raises(RuntimeError, match="boom"):
        with gt.trace(strict=True):
            with gt.capture():
                x + 1


def test_cuda_graph_capture_api_is_wrapped_only_while_tracing(monkeypatch):
    """The wrap path (torch without public capture hooks; tests/test_tracing_cuda.py tests
    both paths: Note [CUDA graph capture hooks])."""
    from torch.cuda.graphs import CUDAGraph

    from graphtrace.tracing import cudagraphs

    monkeypatch.setattr(cudagraphs, "CAPTURE_HOOKS", None)
    begin, end = CUDAGraph.capture_begin, CUDAGraph.capture_end
    with gt.trace():
        assert CUDAGraph.capture_begin is not begin and CUDAGraph.capture_end is not end
    assert CUDAGraph.capture_begin is begin and CUDAGraph.capture_end is end


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_real_cuda_graph_is_recorded():
    x = torch.randn(8, device="cuda")
    with gt.trace(strict=True) as t:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            y = x * 2
    assert [c.kind for c in t.captures] == ["cuda"]
    assert x.data_ptr() in set(t.accesses.data_ptr)
    del y


def test_import_without_torch():
    code = ("import sys; sys.modules['torch'] = None\n"
            "import graphtrace as gt\n"
            "print(gt.__version__)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == gt.__version__


def test_conditional_alias_is_a_read_when_the_op_copies():
    """`aten::to.dtype(Tensor(a) self)` aliases only when nothing changes; a copy reads self."""
    ids = torch.tensor([1, 2, 3], dtype=torch.int32)
    same = torch.randn(3)
    with gt.trace(strict=True) as t:
        with gt.capture():
            with torch.inference_mode():
                torch.ops.aten.to.dtype(ids, torch.int64)    # converts: a read of ids
                torch.ops.aten.to.dtype(same, torch.float32)  # returns self: a view
    df = t.accesses
    assert set(df[df.data_ptr == ids.data_ptr()].access.astype(str)) == {"read"}
    assert set(df[df.data_ptr == same.data_ptr()].access.astype(str)) == {"view"}


@pytest.mark.slow
def test_tracing_does_not_decompile_a_compiled_model():
    """Dynamo skips compiled frames under a dispatch mode that does not ignore compile
    internals, and keeps skipping them: the traced engine would run eager afterwards."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        @classmethod
        def ignore_compile_internals(cls):
            return True

        def __init__(self):
            super().__init__()
            self.n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.n += 1
            return func(*args, **(kwargs or {}))

    def ops(fn, x):
        with Count() as c:
            fn(x)
        return c.n

    torch._dynamo.reset()
    model = torch.nn.Sequential(torch.nn.LayerNorm(8), torch.nn.GELU(), torch.nn.Linear(8, 8))
    compiled = torch.compile(model)
    x = torch.randn(2, 8)
    compiled(x)
    eager_ops, compiled_ops = ops(model, x), ops(compiled, x)
    assert compiled_ops < eager_ops  # fused kernels bypass the dispatcher
    with gt.trace(model, strict=True):
        with gt.capture():
            compiled(x)
    assert ops(compiled, x) == compiled_ops
    torch._dynamo.reset()


def test_registered_since_answers_what_the_table_holds_now():
    """`StorageTable.registered_since` serves the owner snapshot, provenance and lineage one
    read of the table per capture end; a storage registered or released since is in the next
    answer, never a stale one."""
    from graphtrace import native as native_mod
    from graphtrace.recorder import StorageTable

    native = native_mod.resolve(None)
    table = StorageTable(native)
    kept = [torch.rand(3), torch.rand(3)]
    table.lookup(kept[0].untyped_storage())
    first = table.registered_since(0)
    again = table.registered_since(0)
    assert (first.first, first.end) == (again.first, again.end) == (0, 1)
    assert first.handle_set == again.handle_set == {kept[0].untyped_storage()._cdata}
    table.lookup(kept[1].untyped_storage())  # registered since: the next answer has it
    grown = table.registered_since(0)
    assert grown.end == 2
    assert grown.handle_set == {t.untyped_storage()._cdata for t in kept}
    assert set(grown.handles) == grown.handle_set
    assert dict(grown.matching({kept[1].untyped_storage()._cdata: "x"})) == {
        1: kept[1].untyped_storage()._cdata}
    assert table.registered_since(1).handle_set == {kept[1].untyped_storage()._cdata}
    if table.native_table is not None:  # a released handle reads 0 in the next answer
        dead = torch.rand(3)
        table.lookup(dead.untyped_storage())
        assert len(table.registered_since(2).handle_set - {0}) == 1
        del dead
        gc.collect()
        table.sweep(2)
        assert table.registered_since(2).handle_set == {0}
    table.release()
