"""What an emulated graph keeps, with the native Keeper and the Python one (Note [native keep]
in graphtrace/csrc/recorder.cpp, Note [Emulated graphs keep storages] in tracing/emulated.py): the same
ops and baked floats either way, intermediates let go of while the capture still runs, and a
replay equal to eager over many ops, views and in-place writes."""

from __future__ import annotations

import pytest
import torch
from torch.multiprocessing.reductions import StorageWeakRef

import graphtrace as gt


class Deep(torch.nn.Module):
    """Many ops: views, in-place writes into intermediates and a buffer, list arguments,
    floats in arguments, several outputs per op; most intermediates die young."""

    def __init__(self, layers: int = 24, d: int = 8):
        super().__init__()
        self.weights = torch.nn.ParameterList(torch.nn.Parameter(torch.randn(d, d) / d ** 0.5)
                                              for _ in range(layers))
        self.register_buffer("state", torch.zeros(d))
        self.eps = 1e-5
        self.first: list = []  # weak refs to the first layer's intermediates

    def forward(self, x):
        for i, w in enumerate(self.weights):
            h = x @ w.t()
            if i == 0:
                self.first = [StorageWeakRef(h.untyped_storage())]
            h = torch.nn.functional.layer_norm(h, h.shape[-1:], eps=self.eps)
            a, b = h.chunk(2, dim=-1)               # views of one storage
            h = torch.cat([a.relu(), b * 0.5], -1)  # a list argument, a float argument
            h.mul_(1.5).clamp_(-3.0, 3.0)           # in place into an intermediate
            x = x + h.view(x.shape)
        self.state.add_(x.sum(0))                   # in place into a buffer the model keeps
        return x.softmax(-1)


def _capture(model, x, native: bool, **kw):
    with torch.no_grad(), gt.trace(model, strict=True, native=native) as t:
        with gt.capture("g", **kw) as g:
            out = model(x)
            alive_inside = [not ref.expired() for ref in model.first]
    return t, g, out, alive_inside


def _shape_of(value):
    """A kept op's argument as comparable data: tensors by dtype and view, the rest as is."""
    if isinstance(value, torch.Tensor):
        return ("tensor", value.dtype, tuple(value.shape), value.stride(), value.storage_offset())
    if isinstance(value, (list, tuple)):
        return type(value).__name__, tuple(_shape_of(v) for v in value)
    return value


def _ops(graph):
    return [(str(func), _shape_of(args), {k: _shape_of(v) for k, v in kwargs.items()}, flags)
            for func, args, kwargs, _out, flags in graph.kept_ops()]


def test_native_and_python_keepers_keep_the_same_ops_and_floats():
    torch.manual_seed(0)
    model, x = Deep(), torch.randn(3, 8)
    state = model.state.clone()
    _, native, *_ = _capture(model, x, native=True)
    model.state.copy_(state)
    _, python, *_ = _capture(model, x, native=False)
    assert native.native_keeper is not None and python.native_keeper is None
    # compared before replay: scratch aliases are empty between replays, in both keepers
    assert _ops(native) == _ops(python)
    assert native.baked_floats() == python.baked_floats()
    assert {1e-5, 0.5, 1.5, -3.0, 3.0} <= set(native.baked_floats())


@pytest.mark.parametrize("native", [True, False], ids=["native", "python"])
def test_replay_of_many_ops_equals_eager_after_weights_change_in_place(native):
    torch.manual_seed(0)
    model, x = Deep(), torch.randn(3, 8)
    _, g, out, _ = _capture(model, x, native=native)
    for _ in range(2):  # scratch is lent afresh per replay
        with torch.no_grad():
            for w in model.weights:
                w.mul_(-0.9)
            x.add_(0.25)
            state = model.state.clone()
            expected = model(x)  # eager, on the same storages
            after = model.state.clone()
            model.state.copy_(state)
        g.replay()
        assert torch.equal(out, expected)
        assert torch.equal(model.state, after), "the buffer the graph writes in place"


def test_native_keeper_lets_go_of_intermediates_while_the_capture_runs():
    """Only the graph's aliases held the first layer's output: the native keeper frees it
    dozens of ops later, before the capture ends (the Python keeper, at its end)."""
    torch.manual_seed(0)
    model, x = Deep(), torch.randn(3, 8)
    _, g, _, alive_inside = _capture(model, x, native=True)
    assert alive_inside == [False]
    _, g, _, alive_inside = _capture(model, x, native=False)
    assert alive_inside == [True]
    assert all(ref.expired() for ref in model.first), "and gone once the capture ends"


@pytest.mark.parametrize("native", [True, False], ids=["native", "python"])
def test_an_intermediate_held_through_its_storage_object_is_not_released(native):
    """A storage the program still reaches through its UntypedStorage object is held from
    outside: the graph keeps writing it on replay."""
    torch.manual_seed(0)

    class Holds(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.randn(4, 4))
            self.kept = None

        def forward(self, x):
            h = x @ self.weight
            self.kept = h.untyped_storage()  # only the storage object, not the tensor
            for _ in range(80):  # enough new storages for the keeper to look at h's
                x = (x * 1.01).tanh()
            return x + 1

    model, x = Holds(), torch.randn(2, 4)
    with torch.no_grad(), gt.trace(model, strict=True, native=native):
        with gt.capture("g") as g:
            model(x)
    with torch.no_grad():
        model.weight.mul_(2)
        expected = x @ model.weight
    g.replay()
    got = torch.empty(0).set_(model.kept, 0, (2, 4), (4, 1))
    assert torch.equal(got, expected)
