"""`graphtrace.vllm.serve`: the update state machine of check before serve (Note [check before
serve]) on a small model, through the real hooks (`hooks.wrap_model_updates`), no vLLM needed.
The engine-level behaviour is tested with a real vLLM in tests/vllm/test_check_before_serve.py.
"""

from __future__ import annotations

import functools

import pytest
import torch
from torch import nn

import graphtrace as gt
from graphtrace.vllm import hooks
from graphtrace.vllm.serve import DRAIN, ServeGuard, before_step, drain_step


class Kernel(nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(4, 4), requires_grad=False)
        self.scale = functools.partial(torch.mul, other=torch.ones(4))  # a derived holder

    def forward(self, x):
        return self.scale(x @ self.weight)

    def load_weights(self, weights):
        """vLLM's contract: copy each (name, tensor) into the registered tensor; a buggy
        kernel re-derives its holder as a new tensor."""
        params = dict(self.named_parameters())
        for name, tensor in weights:
            params[name].data.copy_(tensor)
        if getattr(self, "rebinds", False):
            self.scale = functools.partial(torch.mul, other=torch.ones(4))
        return {n for n, _ in weights}


class Engine:  # what a ServeGuard reads of its VllmTrace
    def __init__(self, trace):
        self.trace, self.worker, self.graphs = trace, None, []


class Core:  # what the pre-step test reads of vLLM's EngineCore
    def __init__(self, requests=True, batch_queue=None, finished=False):
        self.requests = requests
        self.finished = finished  # finished requests the next schedule() hands the workers
        self.batch_queue = batch_queue
        self.scheduler = self

    def has_unfinished_requests(self):
        return self.requests

    def has_requests(self):
        return self.requests or self.finished


@pytest.fixture
def guarded():
    model = Kernel()
    with torch.no_grad(), gt.trace(model) as t:
        with gt.capture("decode") as graph:
            model(torch.ones(2, 4))
    engine = Engine(t)
    sg = ServeGuard(engine, "raise")
    hooks.wrap_model_updates(model)
    hooks.add_listener("before_update", sg.before_update)
    hooks.add_listener("after_update", sg.after_update)
    yield model, sg, engine, graph
    sg.close()
    hooks.uninstall()


def _sync(model):
    for name, p in model.named_parameters():  # one call per tensor, as TRL and OpenRLHF
        model.load_weights([(name, p.detach() + 1)])


def test_a_clean_update_is_checked_once_before_the_next_forward(guarded):
    model, sg, _, _ = guarded
    _sync(model)
    _sync(model)
    assert sg.dirty and sg.checks == 0  # nothing checked inside the client's loop
    assert before_step(Core()) is None  # passes: the step goes on
    assert sg.checks == 1 and not sg.dirty and sg.last["updates"] == ["load_weights"]
    assert before_step(Core()) is None and sg.checks == 1  # clean: no check per step


def test_a_stale_update_stays_refused_until_a_correct_one_passes(guarded):
    model, sg, _, _ = guarded
    captured = model.scale  # the test's own reference to the holder the graph read
    model.rebinds = True
    _sync(model)
    with pytest.raises(gt.StaleGraphError, match=r"owned by scale\.keywords\['other'\] \[moved\]"):
        sg.check("before_forward")
    assert sg.dirty  # only a passing check clears it
    with pytest.raises(gt.StaleGraphError):
        sg.check("graphtrace_check")
    assert [e["ok"] for e in sg.history] == [False, False]
    # a fix that points the holder back at the captured tensor: the engine may serve again
    model.rebinds = False
    model.scale = captured
    _sync(model)
    assert sg.check("before_forward")["ok"] and not sg.dirty


def test_warn_serves_and_clears(guarded, caplog):
    model, sg, _, _ = guarded
    sg._action = "warn"
    model.rebinds = True
    _sync(model)
    entry = sg.check("before_forward")
    assert not entry["ok"] and not sg.dirty
    assert "graphtrace guard" in caplog.text


def test_nothing_captured_nothing_to_check():
    model = Kernel()
    with gt.trace(model) as t:
        sg = ServeGuard(Engine(t), "raise")
        sg.mark("load_weights")
        assert not sg.dirty and sg.check("before_forward") == {"ok": True, "checked": False}
        sg.close()


def test_in_flight_batches_are_drained_before_the_check(guarded):
    model, sg, _, _ = guarded
    _sync(model)
    core = Core(batch_queue=["batch in flight"])
    assert before_step(core) is DRAIN and sg.dirty  # not checked while a batch runs
    seen = []
    drain_step(core, lambda c: seen.append(c.scheduler.has_requests()))
    assert seen == [False] and core.has_requests()  # scheduled nothing; restored after


def test_a_bad_action_is_refused():
    with pytest.raises(ValueError, match="not one of raise, warn, recapture"):
        ServeGuard(Engine(None), "ignore")


def test_an_in_place_write_is_checked_before_the_next_step(guarded):
    """Note [in-place writes]: no hooked entry point runs; the version counters see it."""
    model, sg, _, _ = guarded
    assert before_step(Core()) is None and sg.checks == 0  # the baseline: nothing written
    with torch.no_grad():
        model.weight.copy_(model.weight + 1)  # in place: not itself stale
    assert not sg.dirty  # marked at the step, not at the write
    assert before_step(Core()) is None
    assert sg.checks == 1 and sg.last["ok"] and sg.last["updates"] == ["in-place write"]
    assert before_step(Core()) is None and sg.checks == 1  # one check per write
    # a hooked update that also bumps the counters is checked once, not again by version
    with torch.no_grad():
        model.load_weights([("weight", model.weight + 1)])
        model.weight.add_(1)
    assert before_step(Core()) is None and sg.checks == 2


def test_a_step_that_only_flushes_finished_requests_is_not_checked(guarded):
    """After a refused step, the engine core's busy loop steps again while the finished
    requests wait to be handed to the workers (``has_requests()``); such a step schedules
    nothing and runs no forward: no check (a refused engine would check in a loop)."""
    model, sg, _, _ = guarded
    model.rebinds = True
    _sync(model)
    assert before_step(Core(requests=False, finished=True)) is None
    assert sg.dirty and sg.checks == 0


def test_a_holder_rebound_with_in_place_writes_is_refused(guarded):
    """A client's own function: in-place writes and its own re-derivation of the holder."""
    model, sg, _, _ = guarded
    before_step(Core())
    with torch.no_grad():
        model.weight.mul_(2)
    model.scale = functools.partial(torch.mul, other=torch.ones(4))
    refused = before_step(Core(requests=False))  # no request waits: nothing refused yet
    assert refused is None and sg.dirty and sg.checks == 0
    with pytest.raises(gt.StaleGraphError, match=r"scale\.keywords\['other'\]"):
        sg.check("before_forward")
    info = sg.refusal_info()  # what the client in another process gets (plain data)
    assert "scale.keywords['other']" in info["message"]
    assert info["columns"][:2] == ["graph_id", "graph"]
    owners = info["columns"].index("owners")
    assert [row[owners] for row in info["rows"]] == ["scale.keywords['other']"]


def test_a_parameter_rebound_and_freed_counts_as_a_write(guarded):
    model, sg, _, _ = guarded
    before_step(Core())
    model.weight = nn.Parameter(torch.ones(4, 4), requires_grad=False)  # the old one is freed
    before_step(Core(requests=False))
    assert sg.dirty and sg.updates == ["in-place write"]
    assert sg.refusal_info() is None  # nothing refused yet


@pytest.mark.parametrize("native", [True, False])
def test_in_place_writes_are_seen_with_and_without_the_native_sum(native):
    model = Kernel()
    with torch.no_grad(), gt.trace(model, native=native) as t:
        with gt.capture("decode"):
            model(torch.ones(2, 4))
    engine = Engine(t)  # the guard holds its trace weakly
    sg = ServeGuard(engine, "raise")
    try:
        assert not sg.written_in_place()  # the baseline
        assert sg.status()["watched"] == 1
        assert not sg.written_in_place()
        with torch.no_grad():
            model.weight.add_(1)
        assert sg.written_in_place() and sg.dirty
        assert not sg.written_in_place()  # once per write
    finally:
        sg.close()


def test_a_client_step_that_raises_drops_its_refusal():
    """The client's ``LLMEngine.step`` (wrapped as in vLLM) raised after the in-process engine
    core refused the step: the refusal is dropped, so the client's next call does not raise a
    stale one (seen before the pooling fix: a refused ``llm.embed`` raised vLLM's
    AssertionError, and the next, correct call the old StaleGraphError)."""
    from graphtrace.guard import StaleGraphError, empty_problems

    class LLMEngine:  # vLLM's shape: llm_engine.engine_core (client).engine_core (EngineCore)
        def __init__(self, fail):
            self.fail = fail
            self.engine_core = type("Client", (), {})()
            self.engine_core.engine_core = type("EngineCore", (), {})()

        def step(self):
            refused = StaleGraphError("refused", empty_problems())
            self.engine_core.engine_core.__dict__["_graphtrace_refused"] = refused
            if self.fail:
                raise AssertionError("the output processor failed")
            return []

    hooks._wrap_serve(LLMEngine, "step", "client_step")
    failing = LLMEngine(fail=True)
    with pytest.raises(AssertionError):
        failing.step()
    assert "_graphtrace_refused" not in failing.engine_core.engine_core.__dict__
    with pytest.raises(StaleGraphError):  # a step that returns raises its refusal
        LLMEngine(fail=False).step()
