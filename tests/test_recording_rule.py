"""Note [recording while serving]: provenance and lineage pause while a traced model serves
and record again when an update begins (graphtrace/tracing/rule.py)."""

from __future__ import annotations

import inspect
import pickle

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

import graphtrace as gt
from graphtrace.provenance import ProvenanceMode
from graphtrace.sites import parse_site
from graphtrace.vocab import NOT_RECORDED


class Layer(nn.Module):
    """A weight, a derived tensor kept in a plain attribute (rebuilt after each
    `load_state_dict`, as a process-weights step does) and a log of whether provenance's
    mode ran under each forward."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.rand(4, 4))
        self.scaled = self.weight.detach() * 2
        self.modes: list[bool] = []
        self.register_load_state_dict_post_hook(Layer._process)

    @staticmethod
    def _process(module, incompatible):
        module.recording_in_update = gt.tracing.active_trace().provenance_recording
        module.scaled = module.weight.detach() * 3  # a new tensor: the graph keeps the old

    def forward(self, x):
        self.modes.append(any(isinstance(m, ProvenanceMode)
                              for m in _get_current_dispatch_mode_stack()))
        return x @ self.weight + self.scaled.sum()


X = torch.ones(2, 4)


def _noted(t) -> tuple[int, int]:
    """(storages provenance noted, ops lineage recorded) so far."""
    return t.provenance.table.n_added, t.lineage.n_ops


def _serve(model, t, n: int = 3) -> tuple[int, int]:
    """Run `n` serving forwards; what provenance and lineage noted meanwhile."""
    before = _noted(t)
    with torch.no_grad():
        for _ in range(n):
            model(X) * 2  # makes storages: noted if provenance ran
    after = _noted(t)
    return after[0] - before[0], after[1] - before[1]


def test_a_serving_forward_after_a_capture_records_nothing():
    model = Layer()
    with gt.trace(model, strict=True) as t:
        with torch.no_grad():
            model(X)  # before any graph: loading and warm-up are recorded
            assert t.provenance_recording
            with gt.capture("g"):
                model(X)
        assert t.provenance_recording  # a reload right after capturing is still recorded
        assert _serve(model, t) == (0, 0)
        assert not t.provenance_recording
        assert ProvenanceMode not in map(type, _get_current_dispatch_mode_stack())
    assert model.modes == [True, False, False, False, False]


def test_record_always_records_while_serving():
    model = Layer()
    with gt.trace(model, strict=True, record="always") as t:
        with torch.no_grad(), gt.capture("g"):
            model(X)
        noted, ops = _serve(model, t)
        assert noted > 0 and ops > 0 and t.provenance_recording
    assert model.modes == [False, True, True, True]


def test_load_state_dict_resumes_recording_for_the_reload():
    model = Layer()
    with gt.trace(model, strict=True) as t:
        with torch.no_grad(), gt.capture("g"):
            model(X)
        _serve(model, t)
        assert not t.provenance_recording
        model.load_state_dict({"weight": torch.rand(4, 4)})
        assert model.recording_in_update  # the pre-hook resumed it before the load
        assert t.provenance_recording  # until the model serves again
        _serve(model, t, 1)
        assert not t.provenance_recording
    report = t.diff()
    row = report.stale[report.stale["owners"].astype(str) == "scaled"]
    assert len(row) == 1
    site = parse_site(row["live_created_at"].iloc[0])  # the process step's line, not "not recorded"
    line = inspect.getsourcelines(Layer._process)
    here = [i for i, text in enumerate(line[0]) if "* 3" in text][0] + line[1]
    assert (site.frames[0].line, site.frames[0].function) == (here, "_process")


def test_a_parameter_registered_resumes_recording():
    model = Layer()
    with gt.trace(model, strict=True) as t:
        with torch.no_grad(), gt.capture("g"):
            model(X)
        _serve(model, t)
        assert not t.provenance_recording
        model.weight = nn.Parameter(torch.rand(4, 4))  # a vLLM-style rebuild of a layer
        assert t.provenance_recording
        made = torch.ones(3) * 2  # made during the update: noted
        assert t.provenance.site_of(made) is not None


def test_an_unseen_update_is_not_recorded_unless_wrapped_in_updating():
    model = Layer()
    with gt.trace(model, strict=True) as t:
        with torch.no_grad(), gt.capture("g"):
            model(X)
        _serve(model, t)
        unseen = torch.ones(3) * 2  # `p.data = new` gives no signal: not recorded
        with t.updating():
            assert t.provenance_recording
            seen = torch.ones(3) * 2
            with torch.no_grad():
                model(X)  # a forward inside the update does not pause it
            assert t.provenance_recording
        assert t.provenance.site_of(unseen) is None
        assert t.provenance.site_of(seen) is not None
        assert t.provenance_recording  # until the model serves again
        _serve(model, t, 1)
        assert not t.provenance_recording
    with pytest.raises(gt.GraphtraceError, match="trace open"):
        with t.updating():
            pass


def test_steering_by_hand_takes_over_from_the_rule():
    model = Layer()
    with gt.trace(model, strict=True) as t:
        with torch.no_grad(), gt.capture("g"):
            model(X)
        t.resume_provenance()
        assert _serve(model, t)[0] > 0 and t.provenance_recording  # forwards no longer pause
        t.pause_provenance()
        model.load_state_dict({"weight": torch.rand(4, 4)})  # nor does an update resume
        assert not model.recording_in_update and not t.provenance_recording
        with t.updating():  # an updating() block records, and restores the hand's pause
            assert t.provenance_recording
        assert not t.provenance_recording
    report = t.diff()
    row = report.stale[report.stale["owners"].astype(str) == "scaled"]
    assert row["live_created_at"].tolist() == [NOT_RECORDED]


def test_the_rule_leaves_nothing_on_the_model():
    model = Layer()
    hooks = (len(model._forward_pre_hooks), len(model._load_state_dict_pre_hooks))
    with gt.trace(model, strict=True):
        with torch.no_grad(), gt.capture("g"):
            model(X)
        copy = pickle.loads(pickle.dumps(model))  # its hooks are inert in a copy
    assert (len(model._forward_pre_hooks), len(model._load_state_dict_pre_hooks)) == hooks
    with torch.no_grad():
        assert torch.equal(copy(X), model(X))


def test_bad_record_value_is_refused():
    with pytest.raises(ValueError, match="record must be one of"):
        gt.trace(record="never")


# --------------------------------------------------------------------------- attribution
# Note [attribution while serving]: module attribution's keepers are off while the model
# serves (no wrapper, no hook on a serving forward's path), on again for captures and updates.

class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self.norm = nn.LayerNorm(4)

    def forward(self, x):
        return self.norm(self.proj(x)).relu()


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.Sequential(Block(), Block())
        self.head = nn.Linear(4, 2)

    def forward(self, x):
        return self.head(self.blocks(x * 2))


NET_MODULES = {"aten::mul.Tensor": ["net:"],
               "aten::addmm": ["blocks.0.proj", "blocks.1.proj", "head"],
               "aten::native_layer_norm": ["blocks.0.norm", "blocks.1.norm"],
               "aten::relu": ["blocks.0", "blocks.1"]}


def _modules_of(t, graph: str) -> dict[str, list[str]]:
    """Per op name, the module of each of its calls in `graph` ("net:" prefix dropped)."""
    df = t.accesses
    df = df[(df.graph.astype(str) == graph) & (df.access.astype(str) == "read")]
    out: dict[str, list[str]] = {}
    for (_, op), module in dict(zip(zip(df.seq, df.op.astype(str)),
                                    df.module.astype(str))).items():
        out.setdefault(op, []).append(module[4:] if module.startswith("net:") and
                                      module != "net:" else module)
    return {op: out.get(op, []) for op in NET_MODULES}


def _keepers(model) -> list[str]:
    """What graphtrace left on the path of a module call: instance forwards and hooks."""
    return [f"{name or 'root'}: {what}" for name, m in model.named_modules()
            for what, on in (("forward", "forward" in m.__dict__),
                             ("pre-hooks", bool(m._forward_pre_hooks)),
                             ("hooks", bool(m._forward_hooks))) if on]


@pytest.mark.parametrize("modules", ["forward", "hooks"])
def test_a_serving_forward_passes_no_keeper_and_captures_are_still_attributed(modules):
    model, x = Net(), torch.randn(3, 4)
    with gt.trace(model, strict=True, name="net", modules=modules) as t:
        with torch.no_grad():
            model(x)
            assert _keepers(model)  # loading and warm-up: attributed, the rule's hook on
            with gt.capture("first", emulate=False):
                model(x)
            model(x)  # serves: the rule pauses
            assert not t.provenance_recording
            assert _keepers(model) == []  # every call on nn.Module's fast path
            with gt.capture("paused", emulate=False):  # a capture while serving
                assert _keepers(model)
                model(x)
            assert _keepers(model) == []
            model.load_state_dict(model.state_dict())  # an update resumes the rule
            assert t.provenance_recording and _keepers(model)
            with gt.capture("updated", emulate=False):
                model(x)
            model(x)
            assert _keepers(model) == []
    for graph in ("first", "paused", "updated"):
        assert _modules_of(t, graph) == NET_MODULES, graph
    assert _keepers(model) == []


def test_a_capture_opened_inside_a_serving_forward_names_the_modules_running():
    """A capture that begins inside forwards begun while attribution was off (an engine
    capturing a new size lazily) names the watched modules already running."""
    class Runner(nn.Module):
        def __init__(self):
            super().__init__()
            self.net = Net()
            self.capture_next = False

        def forward(self, x):
            if not self.capture_next:
                return self.net(x)
            with gt.capture("lazy", emulate=False):
                return self.net(x) + x.sum()

    runner, x = Runner(), torch.randn(3, 4)
    with gt.trace(runner, strict=True, name="run") as t:
        with torch.no_grad():
            with gt.capture("first", emulate=False):
                runner(x)
            runner(x)
            assert _keepers(runner) == []
            runner.capture_next = True
            runner(x)
            assert _keepers(runner) == [] and not gt.recorder.module_stack.stack
    df = t.accesses
    df = df[(df.graph.astype(str) == "lazy") & (df.access.astype(str) == "read")]
    modules = dict(zip(df.op.astype(str), df.module.astype(str)))
    assert modules["aten::sum"] == "run:"  # in the runner's own forward
    assert modules["aten::mul.Tensor"] == "run:net"
    assert set(df[df.op.astype(str) == "aten::addmm"].module.astype(str)) == {
        "run:net.blocks.0.proj", "run:net.blocks.1.proj", "run:net.head"}


def test_a_capture_on_another_thread_keeps_attribution_while_the_model_serves():
    model, other, x = Net(), nn.Linear(4, 4), torch.randn(3, 4)
    opened, served = __import__("threading").Event(), __import__("threading").Event()

    def capture_there():
        with gt.capture("there", emulate=False):
            opened.set()
            served.wait(30)
            other(x)

    with gt.trace(model, strict=True, name="net") as t:
        t.watch(other, name="other")
        with torch.no_grad():
            with gt.capture("first", emulate=False):
                model(x)
            th = __import__("threading").Thread(target=capture_there)
            th.start()
            opened.wait(30)
            model(x)  # serves while the other thread captures
            assert not t.provenance_recording and _keepers(other)
            served.set()
            th.join()
            assert _keepers(other) == [] and _keepers(model) == []
    df = t.accesses
    there = df[(df.graph.astype(str) == "there") & (df.op.astype(str) == "aten::addmm")]
    assert set(there.module.astype(str)) == {"other:"}


def _counting(frames: list):
    def backend(gm, example_inputs):
        frames.append(gm)
        return gm.forward
    return backend


class Outer(nn.Module):
    """An eager model around a compiled part, as vLLM's `support_torch_compile` does."""

    def __init__(self, frames: list):
        super().__init__()
        self.body = Net()
        self.compiled = torch.compile(self.body, backend=_counting(frames))
        self.use_compiled = True
        self.tail = nn.Linear(2, 2)

    def forward(self, x):
        return self.tail((self.compiled if self.use_compiled else self.body)(x))


@pytest.mark.parametrize("modules", ["forward", "hooks"])
@pytest.mark.parametrize("compiled_when", ["loading", "serving"])
def test_a_compiled_model_is_not_compiled_again_across_serving_and_capturing(modules,
                                                                              compiled_when):
    torch._dynamo.reset()
    frames: list = []
    x = torch.randn(3, 4)
    with gt.trace(strict=True, modules=modules) as t:
        model = Outer(frames)
        t.watch(model, name="net")
        model.use_compiled = compiled_when == "loading"
        with torch.no_grad():
            model(x)  # compiled here while recording (attribution on), or not yet
            with gt.capture("first", emulate=False):
                model(x)
            model(x)  # serves: attribution off
            assert not t.provenance_recording
            model.use_compiled = True
            model(x)  # compiled while serving, if not yet
            assert len(frames) == 1
            for _ in range(2):
                with gt.capture("again", emulate=False):  # attribution on for it
                    model(x)
                model(x)
                model.load_state_dict(model.state_dict())  # resumes the rule
                assert t.provenance_recording
                model(x)  # serves again
                model(x)
            assert len(frames) == 1
    torch._dynamo.reset()
    df = t.accesses
    tail = df[(df.graph.astype(str) == "again") & (df.op.astype(str) == "aten::addmm")]
    assert "net:tail" in set(tail.module.astype(str))


def test_a_failing_attribution_pause_is_counted_and_serving_goes_on(monkeypatch):
    from graphtrace.attribution import ModuleAttribution

    def broken(self):
        raise RuntimeError("boom")

    monkeypatch.setattr(ModuleAttribution, "pause", broken)
    model, x = Net(), torch.randn(3, 4)
    with torch.no_grad():
        expected = model(x)
        with gt.trace(model, name="net") as t:
            with gt.capture("first", emulate=False):
                model(x)
            assert torch.equal(model(x), expected)
            assert not t.provenance_recording  # provenance paused all the same
        assert t.recorder.n_errors == 1 and "boom" in t.errors[0]["message"]
        with pytest.raises(RuntimeError, match="boom"):
            with gt.trace(model, strict=True):
                with gt.capture("first", emulate=False):
                    model(x)
                model(x)
