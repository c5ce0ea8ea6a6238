"""Issue 14: what Inductor-compiled code reads is recorded (Note [Compiled regions] in
graphtrace/compiled.py), through the public API, on CPU.

Every test compiles for real (Inductor's C++ backend); models are tiny and each compiled
model is built once per module.
"""

from __future__ import annotations

import functools
import types

import pytest
import torch

import graphtrace as gt
from graphtrace.compiled import pair_triton_args, source_to_path
from graphtrace.demo import reload as demo_reload
from graphtrace.demo.model import DemoModel

pytestmark = pytest.mark.slow


class SmallNet(torch.nn.Module):
    """Embedding -> LayerNorm -> Linear: 5 parameters, each read by a fused kernel."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(16, 8)
        self.norm = torch.nn.LayerNorm(8)
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x):
        return self.lin(self.norm(self.emb(x)))


class BreakingDemo(DemoModel):
    """The demo model with a graph break after its first layer (fullgraph=False)."""

    def forward(self, x):
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i == 0:
                torch._dynamo.graph_break()
        return x


def small_net(seed: int = 0) -> SmallNet:
    torch.manual_seed(seed)
    return SmallNet().eval()


TOKENS = torch.tensor([[1, 2, 3, 5]])


def run_traced(model, fn, x, *, label="c", **trace_kwargs):
    """(report, emulated graph, output) of one capture of fn(x), model watched."""
    with torch.no_grad():
        with gt.trace(model, strict=True, **trace_kwargs) as t:
            with gt.capture(label) as g:
                out = fn(x)
        return t.diff(), g, out


def owned_read(report) -> set[str]:
    """Owner paths of every parameter or buffer storage the captures read."""
    e = report.edges
    kinds = e["owner_kinds"].astype(str)
    rows = e[kinds.str.contains("parameter|buffer") & (e["access"].astype(str) != "write")]
    return set(rows["owners"].astype(str))


def registered(model) -> set[str]:
    return {n for n, _ in model.named_parameters()} | {n for n, _ in model.named_buffers()}


def owned_reads_eager_and_compiled(model, fn_eager, fn_compiled, x) -> tuple[set, set, object]:
    eager, _, _ = run_traced(model, fn_eager, x)
    compiled, _, _ = run_traced(model, fn_compiled, x)
    return owned_read(eager), owned_read(compiled), compiled


# --------------------------------------------------------------------------- owned reads, eager = compiled

@pytest.mark.parametrize("backend", ["inductor", "aot_eager"])
def test_small_net_compiled_reads_every_parameter_eager_reads(backend, writer):
    m = small_net()
    c = torch.compile(m, backend=backend)
    with torch.no_grad():
        c(TOKENS)  # compiled before the trace opens
    eager, compiled, report = owned_reads_eager_and_compiled(m, m, c, TOKENS)
    assert eager == registered(m)
    assert compiled == eager  # every owned read eager makes
    assert set(report.edges["verdict"].astype(str)) <= {"stable", "unowned"}
    if backend == "inductor":
        (row,) = report.meta["compiled"]
        assert row["region"].startswith("compiled::") and row["calls"] == 1
        assert (row["tensor_inputs"], row["owned_inputs"]) == (6, 5)  # 5 weights + tokens
        ops = set(report.accesses["op"].astype(str))
        assert row["region"] in ops
    else:  # aot_eager runs aten ops under the dispatcher: no compiled region to record
        assert "compiled" not in report.meta
    assert not report.errors


@functools.lru_cache(maxsize=None)
def demo(variant: str, breaking: bool = False, n_layers: int = 2):
    cls = BreakingDemo if breaking else DemoModel
    m = cls(variant, n_layers=n_layers, seed=0, reload_backend="builtin")
    return m, torch.compile(m, backend="inductor", fullgraph=not breaking)


def test_demo_model_compiled_reads_every_parameter_eager_reads():
    m, c = demo("fixed")
    x = m.make_input(2)
    eager, compiled, report = owned_reads_eager_and_compiled(m, m, c, x)
    assert eager and compiled == eager
    assert {p for p in eager if "input_layernorm" in p} == {
        f"layers.{i}.input_layernorm.weight" for i in range(2)}  # read only by fused code


def test_transformers_llama_compiled_reads_every_parameter_and_buffer_eager_reads(tiny_llama):
    m = tiny_llama()
    ids = torch.randint(0, 64, (1, 8))
    c = torch.compile(m, backend="inductor")
    with torch.no_grad():
        c(ids)
    eager, compiled, report = owned_reads_eager_and_compiled(m, lambda i: m(i).logits, lambda i: c(i).logits, ids)
    assert compiled == eager  # every owned read eager makes
    assert "model.embed_tokens.weight" in compiled
    assert {f"model.layers.{i}.input_layernorm.weight" for i in range(2)} <= compiled
    assert any("inv_freq" in p for p in compiled)  # the rotary buffer
    assert not report.errors


# --------------------------------------------------------------------------- the act-order bug

@pytest.mark.parametrize("breaking", [False, True], ids=["fullgraph", "graph-break"])
@pytest.mark.parametrize("variant", ["unfixed-partial", "fixed"])
def test_partial_held_perm_inside_compiled_code(variant, breaking):
    m, c = demo(variant, breaking)
    x = m.make_input(2)
    with torch.no_grad():
        c(x)
        with gt.trace(m, strict=True) as t:
            with gt.capture("decode") as graph:  # kept: it holds what it captured, as a CUDA
                c(x)                              # graph's artifacts would (stale, not dangling)
        demo_reload.reload(m, m.make_checkpoint(1, act_order_seed=5), backend="builtin")
    report = t.diff()
    del graph
    stale = report.stale
    compiled_ops = report.edges["ops"].astype(str).str.contains("compiled::")
    assert compiled_ops.any()
    if variant == "fixed":
        assert stale.empty
    else:
        paths = set(stale["owners"].astype(str))
        assert paths == {f"layers.{i}.mlp.down_proj.quant_method.kernel.act_perm.keywords['perm']"
                         for i in range(2)}
        assert set(stale["verdict"].astype(str)) == {"stale"}
    # put the model back for the other parametrisations (same checkpoint as construction)
    with torch.no_grad():
        demo_reload.reload(m, m.make_checkpoint(0), backend="builtin")


# --------------------------------------------------------------------------- emulated replay

def test_replay_of_a_compiled_capture_follows_copy_reloads_and_ignores_rebinding():
    m = small_net()
    c = torch.compile(m, backend="inductor")
    with torch.no_grad():
        c(TOKENS)
        report, g, out = run_traced(m, c, TOKENS)
        old = out.clone()
        assert any(op.startswith("compiled::") for op in map(str, report.accesses["op"].unique()))
        # copy reload: new values into the captured storages
        new = small_net(seed=1)
        for p, q in zip(m.parameters(), new.parameters()):
            p.copy_(q)
        g.replay()
        assert torch.allclose(out, m(TOKENS), atol=1e-6)
        assert not torch.allclose(out, old)
        # rebinding reload: the model's names point at new tensors, the graph at the old ones
        seen = out.clone()
        for name, q in small_net(seed=2).named_parameters():
            mod, attr = name.rsplit(".", 1)
            setattr(m.get_submodule(mod), attr, torch.nn.Parameter(q.detach().clone()))
        g.replay()
        assert torch.equal(out, seen)
        assert not torch.allclose(out, m(TOKENS))


# --------------------------------------------------------------------------- never recompile

def counting_inductor(counter: list):
    from torch._inductor.compile_fx import compile_fx

    def backend(gm, example_inputs):
        counter.append(gm)
        return compile_fx(gm, example_inputs)
    return backend


@pytest.mark.parametrize("modules", ["forward", "hooks", "off"])
def test_tracing_a_compiled_model_compiles_nothing_again(modules):
    m = small_net()
    frames: list = []
    c = torch.compile(m, backend=counting_inductor(frames))
    with torch.no_grad():
        c(TOKENS)
        untraced = len(frames)
        report, _, _ = run_traced(m, c, TOKENS, modules=modules)
        c(TOKENS)
    assert len(frames) == untraced == 1
    assert "compiled" in report.meta  # and yet the region was recorded
    for name, module in m.named_modules():  # left as found
        assert "forward" not in module.__dict__, name
        assert not module._forward_hooks and not module._forward_pre_hooks, name


def test_first_compile_inside_the_capture_records_the_run_not_the_compilation():
    frames: list = []
    warm_model = small_net()
    warm = torch.compile(warm_model, backend=counting_inductor(frames))
    with torch.no_grad():
        warm(TOKENS)
    warm_report, _, _ = run_traced(warm_model, warm, TOKENS)
    n_untraced = len(frames)

    cold_model = small_net()
    cold = torch.compile(cold_model, backend=counting_inductor(frames))
    cold_report, g, out = run_traced(cold_model, cold, TOKENS)  # compiles in here
    assert len(frames) - n_untraced == n_untraced  # compiled as often as untraced
    # the same reads and writes as a capture of the warm model: no compile-time work (AOT's
    # first-call check mode may add views, which are no reads)
    def shape(report):
        a = report.accesses
        a = a[a["access"].astype(str) != "view"]
        ops = a["op"].astype(str).str.replace(r"^compiled::.*", "compiled", regex=True)
        return sorted(zip(ops, a["access"].astype(str), a["dtype"].astype(str),
                          a["shape"].astype(str)))
    assert shape(cold_report) == shape(warm_report)
    assert owned_read(cold_report) == registered(cold_model)
    (row,) = cold_report.meta["compiled"]
    assert row["names"] == "dynamo"  # compiled while the trace was open: Dynamo's sources
    args = set(cold_report.accesses["arg"].astype(str))
    assert "L['self']._modules['lin']._parameters['weight']" in args
    with torch.no_grad():
        before = out.clone()
        g.replay()
    assert torch.equal(out, before)


# --------------------------------------------------------------------------- fail open

def test_a_failing_compiled_record_is_counted_and_named_not_raised(monkeypatch):
    from graphtrace import compiled as gc

    m = small_net()
    c = torch.compile(m, backend="inductor")
    with torch.no_grad():
        expected = c(TOKENS)

    def broken(*args, **kwargs):
        raise RuntimeError("boom")

    monkeypatch.setattr(gc.CompiledPatch, "_record", broken)
    with torch.no_grad():
        with gt.trace(m) as t:
            with gt.capture("c"):
                out = c(TOKENS)
        report = t.diff()
    assert torch.equal(out, expected)  # the engine's output is untouched
    assert report.meta["n_errors"] == 1 and "boom" in report.errors[0]["message"]
    assert any(s.startswith("compiled: region") and "'c'" in s for s in report.blind_spots)
    with torch.no_grad():  # strict: raised
        with pytest.raises(RuntimeError, match="boom"):
            with gt.trace(m, strict=True):
                with gt.capture("c"):
                    c(TOKENS)


def test_the_boundary_is_wrapped_only_while_a_trace_is_open():
    from torch._inductor.output_code import CompiledFxGraph

    before = CompiledFxGraph.__dict__["__call__"]
    with gt.trace():
        assert CompiledFxGraph.__dict__["__call__"] is not before
    assert CompiledFxGraph.__dict__["__call__"] is before


def test_a_compiled_call_releases_its_dead_buffers_when_it_returns(monkeypatch):
    """Note [weak handles and the sweep]: the graph's intermediate buffers (here the first
    Linear's output, an extern addmm's `out=`) are released right after the region call, not
    32 to 64 registrations later; live storages (the output) keep theirs."""
    monkeypatch.setenv("GRAPHTRACE_NATIVE", "1")
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 8))
    c = torch.compile(m.eval(), backend="inductor")
    x = torch.randn(4, 8)
    with torch.no_grad():
        c(x)
        with gt.trace(m, strict=True) as t:
            with gt.capture("c", emulate=False):
                storages = t.recorder.storages
                first = len(storages)
                out = c(x)
                rows = [(storages.handles[s], storages.alive(s))
                        for s in range(first, len(storages))]
    assert t.recorder.backend == "native"
    dead = [handle for handle, alive in rows if not alive]
    assert dead and all(handle == 0 for handle in dead)
    kept = [handle for handle, alive in rows if alive]  # x, the weights, the output
    assert len(kept) >= 2 and all(handle != 0 for handle in kept)
    assert out.shape == (4, 8)


class FrozenNet(SmallNet):
    """Its own forward code: Dynamo's cached graphs of SmallNet (compiled without freezing)
    would otherwise serve this model too."""

    def forward(self, x):
        return self.lin(self.norm(self.emb(x)))


def test_freezing_constants_are_recorded_with_their_names_and_folded_ones_named():
    import torch._inductor.config as inductor_config

    torch.manual_seed(0)
    m = FrozenNet().eval()
    with inductor_config.patch(freezing=True):
        c = torch.compile(m, backend="inductor")
        with torch.no_grad():
            c(TOKENS)
        report, _, _ = run_traced(m, c, TOKENS)
    (row,) = report.meta["compiled"]
    assert row["constants"] >= 1 and row["owned_constants"] >= 1
    a = report.accesses
    const = a[a["arg"].astype(str).str.startswith("constant:")]
    assert len(const)
    e = report.edges
    assert "emb.weight" in set(e[e["args"].astype(str).str.contains("constant:")]["owners"]
                               .astype(str))
    # what freezing folded or prepacked is named, never silently dropped
    assert any("freezing" in s for s in report.blind_spots)


# --------------------------------------------------------------------------- mutated inputs

class CountingNet(torch.nn.Module):
    """A registered buffer the forward mutates in place, then reads."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.rand(4))
        self.register_buffer("buf", torch.zeros(4))

    def forward(self, x):
        self.buf.add_(1)
        return x * self.w + self.buf


class TrainBatchNorm(torch.nn.Module):
    """BatchNorm in train mode: its running stats are read and updated in place."""

    def __init__(self):
        super().__init__()
        self.bn = torch.nn.BatchNorm1d(4)

    def forward(self, x):
        return self.bn(x)


MUTATED = {
    "add_": (CountingNet, {"buf"}, {"w"}),
    "batchnorm": (TrainBatchNorm, {"bn.running_mean", "bn.running_var",
                                   "bn.num_batches_tracked"}, {"bn.weight", "bn.bias"}),
}


@pytest.mark.parametrize("case", sorted(MUTATED))
def test_an_input_the_compiled_region_mutates_is_recorded_as_written(case, writer):
    """Inductor keeps an inference graph's input mutations inside the compiled code
    (`mutated_input_idxs`): no aten op shows the write, only the region's own op can. A
    mutated buffer is read and written by the region (`read+write`), the others read."""
    cls, mutated, read_only = MUTATED[case]
    torch.manual_seed(0)
    m = cls()
    c = torch.compile(m, backend="inductor", fullgraph=True)
    x = torch.rand(3, 4)
    with torch.no_grad():
        c(x)  # compiled before the trace opens
        with gt.trace(m, strict=True) as t:
            with gt.capture("c") as g:
                c(x)
    report = t.diff()
    e = report.edges.set_index(report.edges["owners"].astype(str))
    for owner in mutated | read_only:
        assert str(e.loc[owner, "ops"]).startswith("compiled::"), e.loc[owner]
    access = {o: str(e.loc[o, "access"]) for o in mutated | read_only}
    assert access == {**{o: "read+write" for o in mutated}, **{o: "read" for o in read_only}}
    # the region reads what it mutates: no "recomputed by each replay"
    assert {str(e.loc[o, "origin"]) for o in mutated} == {"external"}
    assert not report.errors
    before = {o: m.get_buffer(o).clone() for o in mutated}
    with torch.no_grad():
        g.replay()  # the replay mutates the captured buffers again, as a CUDA graph would
    assert any(not torch.equal(m.get_buffer(o), before[o]) for o in mutated)
    # a rebinding load of the buffers: the graph keeps mutating (and reading) the old ones
    for o in mutated:
        mod, _, name = o.rpartition(".")
        setattr(m.get_submodule(mod) if mod else m, name, m.get_buffer(o).clone())
    e = t.diff().edges.set_index("owners")
    assert {str(e.loc[o, "verdict"]) for o in mutated} == {"stale"}
    assert {str(e.loc[o, "verdict"]) for o in read_only} == {"stable"}
    del g


# --------------------------------------------------------------------------- helpers

def test_pair_triton_args_pairs_tensors_with_signature_names():
    a, b, out = torch.zeros(2), torch.ones(2), torch.empty(2)
    sig = {"in_ptr0": "*fp32", "in_ptr1": "*fp32", "out_ptr0": "*fp32", "xnumel": "i32",
           "XBLOCK": "constexpr"}
    pairs = pair_triton_args(sig, (a, b, out, 2), mutated=["out_ptr0"])
    assert [(n, w) for n, _, w in pairs] == [("in_ptr0", False), ("in_ptr1", False),
                                             ("out_ptr0", True)]
    assert pairs[0][1] is a and pairs[2][1] is out
    # a list signature, and more arguments than names
    assert [n for n, _, _ in pair_triton_args(["x"], (a, b))] == ["x", "arg1"]
    assert pair_triton_args({}, (1, 2.0, None)) == []


@pytest.mark.parametrize("source,expected", [
    ("L['self']._modules['layers']._modules['0']._parameters['weight']",
     ("layers.0.weight", "parameter")),
    ("L['self']._modules['rotary']._buffers['inv_freq']", ("rotary.inv_freq", "buffer")),
    ("L['self'].kernel.keywords['perm']", ("kernel.keywords['perm']", "attribute")),
    ("L['self']._modules['mlp'].act_perm.__closure__", ("mlp.act_perm.__closure__", "attribute")),
    ("L['x']", None), ("G['w']", None), (None, None), ("L['self']", None),
])
def test_source_to_path(source, expected):
    assert source_to_path(source) == expected


class FakeAutotuner:
    """Shaped like Inductor's CachingAutotuner as the launch hook reads it (CUDA-only code
    exercised on CPU): `fn.__name__`, `triton_meta["signature"]`, `mutated_arg_names`."""

    def __init__(self):
        self.fn = types.SimpleNamespace(__name__="triton_poi_fused_add_0")
        self.triton_meta = {"signature": {"in_ptr0": "*fp32", "in_ptr1": "*fp32",
                                          "out_ptr0": "*fp32", "xnumel": "i32"}}
        self.mutated_arg_names = ["out_ptr0"]

    def run(self, *args, stream, benchmark_run=False, **kwargs):
        """A Triton launch: no op reaches the dispatcher."""


@pytest.mark.usefixtures("writer")
def test_triton_launches_are_recorded_with_kernel_argument_names():
    from graphtrace.compiled import CompiledPatch

    m = small_net()
    a, out = m.lin.weight, torch.empty(8, 8)
    b = torch.ones(8, 8)
    with torch.no_grad(), gt.trace(m, strict=True) as t:
        patch = CompiledPatch(t)
        patch._wrap(FakeAutotuner, "run", patch._make_triton_run)  # what install() does on CUDA
        try:
            with gt.capture("c"):
                FakeAutotuner().run(a, b, out, 64, stream=0)
                FakeAutotuner().run(a, b, out, 64, stream=0, benchmark_run=True)  # autotuning
            FakeAutotuner().run(a, b, out, 64, stream=0)  # outside any capture: not recorded
        finally:
            patch.uninstall()
        assert "run" in FakeAutotuner.__dict__ and FakeAutotuner.run.__name__ == "run"
        report = t.diff()
    acc = report.accesses
    rows = acc[acc["op"].astype(str) == "triton::triton_poi_fused_add_0"]
    assert list(zip(rows["arg"].astype(str), rows["access"].astype(str))) == [
        ("in_ptr0", "read"), ("in_ptr1", "read"), ("out_ptr0", "write")]
    e = report.edges
    assert e[e["owners"].astype(str) == "lin.weight"]["args"].astype(str).tolist() == ["in_ptr0"]
    assert patch.n_triton == 1


def test_opening_a_trace_leaves_inductor_freezing_unimported_until_a_compile(tmp_path):
    """Note [frozen constants]: the constant makers are wrapped at the first compile when
    Inductor's constant folding is not imported yet (an eager engine's startup never needs
    it); a compile inside the trace still sees the constants it folds."""
    import subprocess
    import sys
    from pathlib import Path

    code = r"""
import sys, torch
import graphtrace as gt
from tests.test_differential import MLP
m = MLP().eval()
x = torch.rand(4, 8)
with gt.trace(m, strict=True) as t:
    print("freezing imported at entry:", "torch._inductor.freezing" in sys.modules)
    from torch._inductor import config
    with torch.no_grad(), config.patch(freezing=True):
        forward = torch.compile(m, backend="inductor")
        with gt.capture("g"):
            forward(x)
    import torch._inductor.constant_folding as cf
    print("wrapped while open:", cf.replace_node_with_constant.__name__ == "replace_node_with_constant"
          and cf.replace_node_with_constant.__module__ == "graphtrace.compiled")
with torch.no_grad():
    for lin in (m.up, m.down):
        lin.weight.copy_(torch.randn_like(lin.weight))
e = t.diff().edges
print("unrefreshed from:", sorted(set(e[e["verdict"].astype(str) == "unrefreshed"]["derived_from"].astype(str))))
"""
    root = Path(__file__).resolve().parents[1]
    proc = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "freezing imported at entry: False" in proc.stdout
    assert "wrapped while open: True" in proc.stdout
    assert "unrefreshed from: ['down.weight', 'up.weight']" in proc.stdout
