"""Note [recording while serving]: provenance and lineage pause while a traced model serves
and record again when an update begins (graphtrace/tracing.py)."""

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
