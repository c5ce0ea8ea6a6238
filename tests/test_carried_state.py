"""Carried-over state (issue 24, SGLang #26194; Note [carried-over state] in
graphtrace/lineage/steps.py): a process step that reads unregistered state made from no weight
during an earlier load cycle, together with weights loaded since, is a `carried-over state`
finding naming the holder, the op, the line and the weight; state rebuilt each cycle, shards
of one load, state derived from weights, capture regions and lineage off are not."""

from __future__ import annotations

import ctypes
import inspect

import pytest
import torch
from torch import nn

import graphtrace as gt
from graphtrace.demo.cases.sglang_26194_permute_index_cache import (
    H,
    MoEModel,
    pause_resume,
)


def _line(fn, text: str) -> int:
    lines, start = inspect.getsourcelines(fn)
    return start + next(i for i, line in enumerate(lines) if text in line)


class Method:
    """A process step that shuffles the weight's rows with indices memoized by shape."""

    def __init__(self, clear: bool = False, cache: dict | None = None):
        self.clear = clear
        self.cache = {} if cache is None else cache  # a shared dict: one cache for all layers

    def process(self, layer):
        if self.clear:
            self.cache.clear()
        key = tuple(layer.weight.shape)
        if key not in self.cache:
            self.cache[key] = torch.arange(key[0]).flip(0)
        layer.weight.data.copy_(layer.weight[self.cache[key]])  # reads the cached indices


class Layer(nn.Module):
    def __init__(self, method: Method):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(4, 4), requires_grad=False)
        self.method = method

    def forward(self, x):
        return x @ self.weight.t()


def _load(layer, seed):
    layer.weight.copy_(torch.rand(4, 4, generator=torch.Generator().manual_seed(seed)))


def test_a_cache_reused_after_a_reload_is_one_finding_per_entry_op_and_line():
    layer = Layer(Method())
    with torch.no_grad(), gt.trace(layer, strict=True) as t:
        for seed in (1, 2, 3):  # three load cycles: the cache of the first is read by two
            _load(layer, seed)
            layer.method.process(layer)
    f = t.findings()
    assert len(f) == 1, f
    r = f.iloc[0]
    assert (r.kind, r.holder, r.op, r.source, r.source_kind, r.n) == (
        "carried-over state", "method.cache[(4, 4)]", "aten::index.Tensor", "weight",
        "parameter", "2")
    assert f"test_carried_state.py:{_line(Method.process, 'reads the cached')}" in r.site


def test_a_cache_cleared_each_cycle_and_one_load_cycle_are_clean():
    for layer, cycles in ((Layer(Method(clear=True)), 3), (Layer(Method()), 1)):
        with torch.no_grad(), gt.trace(layer, strict=True) as t:
            for seed in range(cycles):
                _load(layer, seed)
                layer.method.process(layer)
                layer.method.process(layer)  # reused within the cycle: fine
        assert t.findings().empty, t.findings()


def test_shards_of_one_load_are_one_cycle():
    """Layer-wise loading with a cache shared by two layers: the second layer's weight is
    loaded in two shards after the first layer built the cache. One load cycle: no finding."""
    shared: dict = {}
    model = nn.Sequential(Layer(Method(cache=shared)), Layer(Method(cache=shared)))
    with torch.no_grad(), gt.trace(model, strict=True) as t:
        _load(model[0], 1)
        model[0].method.process(model[0])          # builds the cache
        w = model[1].weight
        w[:2].copy_(torch.rand(2, 4))              # shard 1
        w[2:].copy_(torch.rand(2, 4))              # shard 2: the same load cycle
        model[1].method.process(model[1])          # reuses it
    assert t.findings().empty, t.findings()


def test_state_derived_from_a_weight_is_left_to_freshness():
    layer = Layer(Method())
    with torch.no_grad(), gt.trace(layer, strict=True) as t:
        for seed in (1, 2):
            _load(layer, seed)
            if seed == 1:
                layer.norm = layer.weight.abs().amax()  # derived, kept, not rebuilt
            layer.weight.data.copy_(layer.weight / layer.norm)
    assert t.findings().empty, t.findings()


def test_reads_inside_a_capture_region_and_lineage_off_note_nothing():
    layer = Layer(Method())
    with torch.no_grad(), gt.trace(layer, strict=True) as t:
        for seed in (1, 2):
            _load(layer, seed)
            with gt.capture("g", emulate=False):
                layer.method.process(layer)
    assert t.findings().empty
    layer = Layer(Method())
    with torch.no_grad(), gt.trace(layer, strict=True, lineage=False) as t:
        for seed in (1, 2):
            _load(layer, seed)
            layer.method.process(layer)
    assert t.findings().empty


def test_the_memory_saver_emulation_moves_no_version_counter():
    idx = torch.arange(8).flip(0)
    before = idx._version
    storage = idx.untyped_storage()
    ctypes.memset(storage.data_ptr(), 0, storage.nbytes())
    assert idx._version == before and not idx.any()


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("clear", [False, True], ids=["buggy", "fixed"])
def test_the_sglang_case_model_under_captured_graphs(compiled, clear):
    """SGLang #26194: the buggy method shuffles the new weights with zeroed indices and is
    found; PR #33016's fix is clean; no edge is stale-like either way; diff and the trace's
    findings agree; the captured forward eager or compiled."""
    model = MoEModel(clear_each_cycle=clear).eval()
    forward = torch.compile(model, backend="inductor") if compiled else model
    new = model.checkpoint(1)
    keep = []
    with torch.no_grad(), gt.trace(model, strict=True) as t:
        model.load(model.checkpoint(0))
        for b in (1, 2):
            with gt.capture(f"bs{b}") as g:
                forward(torch.rand(b, H))
            keep.append(g)
        guard = t.guard()
        pause_resume(model)
        model.load(new)
    want = model.expected(new)
    right = all(torch.equal(p, want[n]) for n, p in model.named_parameters())
    report = t.diff()
    assert set(report.edges["verdict"].astype(str)) <= {"stable", "unowned"}
    assert guard.check().empty
    f = report.findings
    assert f.equals(t.findings())
    if clear:
        assert right and f.empty, f
    else:
        assert not right
        assert set(f["kind"]) == {"carried-over state"}
        assert set(f["holder"]) == {
            f"layers.{i}.quant_method._cache_permute_indices[{k!r}]"
            for i in (0, 1) for k in (("w3_w1", (8, 8)), ("w2", (8, 4)))}
        assert set(f["source"]) == {f"layers.{i}.{w}" for i in (0, 1)
                                    for w in ("w13_weight", "w2_weight")}
