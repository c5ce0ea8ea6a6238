"""Module attribution (gt.trace(modules=...)): which watched module each recorded op ran in.

The "forward" keeper (default) and the "hooks" keeper must give the same attribution, leave
every module as they found it, and never change what a module computes: not for a deep copy
or a pickled copy made while traced, not for someone else's forward wrapper, not under
torch.compile.
"""

from __future__ import annotations

import copy
import inspect
import io
import pickle
import threading

import pytest
import torch
from torch import nn

import graphtrace as gt

KEEPERS = ["forward", "hooks"]


pytestmark = pytest.mark.usefixtures("writer")  # every test on both writers


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self.norm = nn.LayerNorm(4)

    def forward(self, x):
        return self.norm(self.proj(x)).relu() + x


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([Block(), Block()])
        self.shared = nn.Linear(4, 4)
        self.head = nn.Linear(4, 2)

    def forward(self, x):
        x = x * 2                          # in the root module itself
        for block in self.blocks:
            x = self.shared(block(x))      # one module called twice
        return self.head(x)


def op_modules(t, op):
    """The module of each `op` call, in order: "" for none, "net:" for the root module, and
    submodules without the "net:" prefix."""
    df = t.accesses
    df = df[(df.op == op) & (df.access == "read")]
    mods = [m for _, m in dict.fromkeys(zip(df.seq, df.module.astype(str)))]
    return [m[4:] if m.startswith("net:") and m != "net:" else m for m in mods]


def capture_once(model, x, modules):
    with gt.trace(model, strict=True, modules=modules, name="net") as t:
        with gt.capture("fwd", emulate=False):
            out = model(x)
    return t, out


@pytest.mark.parametrize("modules", KEEPERS)
def test_ops_are_attributed_to_the_innermost_watched_module(modules):
    model, x = Net(), torch.randn(3, 4)
    t, _ = capture_once(model, x, modules)
    assert op_modules(t, "aten::addmm") == ["blocks.0.proj", "shared", "blocks.1.proj", "shared",
                                            "head"]
    assert op_modules(t, "aten::native_layer_norm") == ["blocks.0.norm", "blocks.1.norm"]
    assert op_modules(t, "aten::relu") == ["blocks.0", "blocks.1"]
    assert op_modules(t, "aten::mul.Tensor") == ["net:"]   # the root module itself


def test_both_keepers_attribute_every_op_alike():
    x = torch.randn(3, 4)
    model = Net()
    per_keeper = {}
    for modules in KEEPERS:
        t, _ = capture_once(model, x, modules)
        per_keeper[modules] = list(zip(t.accesses.op.astype(str), t.accesses.module.astype(str)))
    assert per_keeper["forward"] == per_keeper["hooks"]
    assert len(per_keeper["forward"]) > 20


def test_off_records_the_same_rows_without_modules():
    x = torch.randn(3, 4)
    model = Net()
    on, _ = capture_once(model, x, "forward")
    off, _ = capture_once(model, x, "off")
    assert list(off.accesses.op.astype(str)) == list(on.accesses.op.astype(str))
    assert set(off.accesses.module.astype(str)) == {""}
    assert "" not in set(on.accesses.module.astype(str))


@pytest.mark.parametrize("modules", KEEPERS)
def test_modules_are_left_as_found_and_outputs_unchanged(modules):
    model, x = Net(), torch.randn(3, 4)
    with torch.no_grad():
        expected = model(x)
        t, out = capture_once(model, x, modules)
    assert torch.equal(out, expected)
    for m in model.modules():
        assert "forward" not in m.__dict__ and "_call_impl" not in m.__dict__
        assert not m._forward_hooks and not m._forward_pre_hooks
    assert torch.equal(model(x), expected)


@pytest.mark.parametrize("modules", KEEPERS)
def test_an_exception_inside_a_module_unwinds_the_stack(modules):
    class Boom(nn.Module):
        def forward(self, x):
            raise RuntimeError("boom")

    model = nn.Sequential(nn.Linear(4, 4), nn.Sequential(Boom()))
    tail = nn.Linear(4, 4)
    with gt.trace(model, strict=True, modules=modules, name="net") as t:
        t.watch(tail, name="tail")
        with gt.capture("fwd", emulate=False):
            with pytest.raises(RuntimeError, match="boom"):
                model(torch.randn(1, 4))
            torch.randn(1, 4).exp()           # outside every module again
            tail(torch.randn(1, 4))
    assert op_modules(t, "aten::exp") == [""]
    assert op_modules(t, "aten::addmm") == ["0", "tail:"]


def test_a_deep_copy_made_while_traced_computes_with_its_own_weights():
    model, x = Net(), torch.randn(3, 4)
    with gt.trace(model, strict=True):
        twin = copy.deepcopy(model)
        with torch.no_grad():
            twin.head.weight.add_(1.0)
            assert not torch.equal(twin(x), model(x))
            with gt.capture("twin", emulate=False):
                twin(x)
    with torch.no_grad():
        reference = copy.deepcopy(model)
        reference.head.weight.add_(1.0)
        assert torch.equal(twin(x), reference(x))


def test_a_model_pickled_while_traced_loads_as_a_plain_model():
    model, x = Net(), torch.randn(3, 4)
    with gt.trace(model, strict=True):
        buf = io.BytesIO()
        torch.save(model, buf)
        blob = pickle.dumps(model)
    buf.seek(0)
    for loaded in (torch.load(buf, weights_only=False), pickle.loads(blob)):
        with torch.no_grad():
            assert torch.equal(loaded(x), model(x))


def test_signatures_read_the_same_while_traced():
    model = Net()
    outside = {n: inspect.signature(m.forward) for n, m in model.named_modules()}
    with gt.trace(model, strict=True):
        assert "forward" in model.blocks[0].__dict__
        inside = {n: inspect.signature(m.forward) for n, m in model.named_modules()}
    assert inside == outside and str(inside["blocks.0"]) == "(x)"


def test_someone_elses_forward_wrapper_is_kept_and_still_attributed():
    model = Net()
    calls = []
    original = model.head.forward

    def theirs(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    model.head.forward = theirs
    t, _ = capture_once(model, torch.randn(3, 4), "forward")
    assert calls == [1]
    assert op_modules(t, "aten::addmm")[-1] == "head"
    assert model.head.__dict__["forward"] is theirs
    assert not model.head._forward_hooks and not model.head._forward_pre_hooks


@pytest.mark.parametrize("hook", ["module", "global"])
def test_ops_in_hooks_stay_with_the_caller_and_forward_ops_with_the_module(hook):
    """A module call with hooks (registered while traced) goes through torch's `_call_impl`
    (Note [one frame per module call]): what a hook computes is the caller's, what forward
    computes is the module's, as for a call without hooks."""
    model, x = Net(), torch.randn(3, 4)

    def triple(module, args):
        if module is model.head:
            return (args[0] * 3,)
        return None

    with gt.trace(model, strict=True, name="net") as t:
        register = (model.head.register_forward_pre_hook if hook == "module"
                     else torch.nn.modules.module.register_module_forward_pre_hook)
        handle = register(triple)
        try:
            with gt.capture("fwd", emulate=False):
                model(x)
        finally:
            handle.remove()
    assert op_modules(t, "aten::mul.Tensor") == ["net:", "net:"]  # the root's, the hook's
    assert op_modules(t, "aten::addmm")[-1] == "head"


def test_a_traced_module_call_runs_no_more_python_calls_than_an_untraced_one(writer):
    """Note [one frame per module call]: the Python attribution of a module call takes the
    place of torch's `_call_impl` frame instead of adding a frame of its own (beside the Dynamo
    check, `torch.compiler.is_dynamo_compiling`, which is not counted); the native one (Note
    [native module call]) runs no Python frame at all, so each module call runs one fewer."""
    import sys

    from graphtrace._compat import MODULE_CALL_CODE

    model, x = Net(), torch.randn(3, 4)
    dynamo_check = torch.compiler.is_dynamo_compiling.__code__

    def python_calls() -> tuple[int, int]:
        n = impls = 0

        def count(frame, event, arg):
            nonlocal n, impls
            n += event == "call" and frame.f_code is not dynamo_check
            impls += event == "call" and frame.f_code is MODULE_CALL_CODE

        sys.setprofile(count)
        try:
            model(x)
        finally:
            sys.setprofile(None)
        return n, impls

    with torch.no_grad():
        untraced, module_calls = python_calls()
        with gt.trace(model, strict=True, provenance=False) as t:  # no mode: module calls only
            traced, impls = python_calls()
    assert module_calls == len(list(model.modules()))
    if writer == "native":
        assert t.native is not None
        assert (traced, impls) == (untraced - module_calls, 0)
    else:
        assert traced == untraced


def test_someone_elses_call_impl_is_kept_and_still_attributed():
    model = Net()
    calls = []
    original = model.head._call_impl

    def theirs(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    model.head.__dict__["_call_impl"] = theirs
    t, _ = capture_once(model, torch.randn(3, 4), "forward")
    assert calls == [1]
    assert op_modules(t, "aten::addmm")[-1] == "head"
    assert model.head.__dict__["_call_impl"] is theirs
    assert "forward" not in model.head.__dict__


def test_torch_compile_fullgraph_of_a_watched_model():
    model, x = Net(), torch.randn(3, 4)
    torch._dynamo.reset()
    with gt.trace(model, strict=True):
        compiled = torch.compile(model, fullgraph=True, backend="eager")
        with torch.no_grad():
            assert torch.allclose(compiled(x), model(x))
    torch._dynamo.reset()


def test_each_thread_keeps_its_own_module_stack():
    left, right = nn.Linear(4, 4), nn.Linear(4, 4)
    barrier = threading.Barrier(2)

    def work(name, module):
        with gt.capture(name, emulate=False):
            for _ in range(20):
                barrier.wait()
                module(torch.randn(1, 4))

    with gt.trace(strict=True) as t:
        t.watch(left, name="left")
        t.watch(right, name="right")
        threads = [threading.Thread(target=work, args=a) for a in (("l", left), ("r", right))]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
    df = t.accesses
    for graph, owner in (("l", "left:"), ("r", "right:")):
        mine = df[(df.graph == graph) & (df.op == "aten::addmm")]
        assert len(mine) > 0 and set(mine.module.astype(str)) == {owner}


def test_bad_modules_setting_is_a_clear_error():
    with pytest.raises(ValueError, match="modules must be one of 'forward', 'hooks', 'off'"):
        gt.trace(nn.Linear(2, 2), modules="fast")


@pytest.mark.parametrize("value, expected", [("", "forward"), ("hooks", "hooks"), (" OFF ", "off"),
                                             ("fast", "forward")])
def test_vllm_plugin_reads_its_modules_setting_and_fails_open(monkeypatch, caplog, value, expected):
    from graphtrace.vllm import plugin

    monkeypatch.setenv("GRAPHTRACE_MODULES", value)
    with caplog.at_level("WARNING", logger="graphtrace.vllm"):
        assert plugin.modules_setting() == expected
    assert ("not one of" in caplog.text) == (value == "fast")



def test_an_owner_walk_inside_a_trace_steps_over_the_module_keepers():
    """The forward wrappers and `_call_impl` overrides a trace puts on each module reach
    nothing of the user's: the owner walk steps over them, so inside the trace it finds the
    same owners within the same `max_items` as outside (and walks no more objects)."""
    import warnings

    from graphtrace.owners import walk_owners

    model = Net()
    model.head.scale = [torch.ones(2)]  # an attribute holder: the walk enters the list

    def walk(max_items: int) -> tuple[list[str], list[str]]:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", RuntimeWarning)
            paths = [path for path, _, _ in walk_owners(model, max_items=max_items)]
        return paths, [str(w.message) for w in caught]

    least = next(n for n in range(1, 100) if not walk(n)[1])  # the least budget, untraced
    assert walk(least - 1)[1]  # one less is cut: the budget is tight
    outside = walk(least)
    with gt.trace(model, strict=True, provenance=False):
        assert "_call_impl" in model.head.__dict__ and "forward" in model.head.__dict__
        inside = walk(least)
    assert inside == outside
    assert "head.scale[0]" in inside[0]


class Scaled(nn.Module):
    def forward(self, x):
        return x * 2


def test_a_class_forward_replaced_while_traced_is_the_one_called(monkeypatch):
    """A module's one-frame call holds its class forward bound (Note [one frame per module
    call]): once someone replaces the class's forward, the call runs the new one, as untraced,
    and its ops stay with the module."""
    model, x = nn.Sequential(Scaled()), torch.ones(2)  # a submodule: the root has serve hooks
    with gt.trace(model, strict=True, name="net") as t:
        monkeypatch.setattr(Scaled, "forward", lambda self, x: x + 5)
        with gt.capture("fwd", emulate=False):
            out = model(x)
    assert torch.equal(out, torch.full((2,), 6.0))
    assert op_modules(t, "aten::add.Tensor") == ["0"]
    assert model(x).tolist() == [6.0, 6.0]


def test_torch_jit_trace_of_a_watched_model_traces_the_same_code():
    """Under JIT tracing a module call leaves the one-frame path (Python or native) for the
    class's `_call_impl`, which traces through `_slow_forward`: the same scripted code."""
    model, x = Net(), torch.randn(3, 4)
    with torch.no_grad():
        plain = torch.jit.trace(model, x).code
        with gt.trace(model, strict=True, provenance=False):
            traced = torch.jit.trace(model, x)
            assert gt.recorder.module_stack.stack == []
        assert traced.code == plain
        assert torch.allclose(traced(x), model(x))


def test_seed_finds_the_running_module_calls_whichever_call_runs_them(writer):
    """`ModuleAttribution.seed()` (a capture opened inside forwards) finds each running module
    call, whether it runs a `_call_impl` frame (Python `call`) or none (Note [native module
    call]): from an empty stack it puts back exactly what the calls had pushed."""
    from graphtrace import native
    from graphtrace.attribution import ModuleAttribution
    from graphtrace.recorder import module_stack

    seen = []

    class Inner(nn.Module):
        def forward(self, x):
            pushed = module_stack.stack[:]
            module_stack.stack[:] = []
            try:
                seen.append((pushed, attribution.seed()))
            finally:
                module_stack.stack[:] = pushed
            return x + 1

    class Outer(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = Inner()

        def forward(self, x):
            return self.inner(x) * 2

    model, ids = Outer(), {}
    attribution = ModuleAttribution("forward")
    attribution.native = native.resolve(None)
    assert (attribution.native is not None) == (writer == "native")
    attribution.install(model, lambda name: ids.setdefault(name, len(ids)))
    try:
        model(torch.ones(2))
    finally:
        attribution.uninstall()
    assert seen == [([ids[""], ids["inner"]], [ids[""], ids["inner"]])]
