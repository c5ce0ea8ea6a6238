"""diff and guard against each other: one verdict engine, so on every reload scenario
`guard.check()` (live, and loaded from its JSON manifest before the update) and `t.diff()` give
the same (graph, storage, verdict) problems and the same impact where both give one.

Each scenario also states what it must find (`problems`: the verdicts among the problem
edges; `impacts`: the impacts of the stale-like ones), so the two cannot agree on nothing.
New scenario tests elsewhere go through `assert_agree` too.
"""

from __future__ import annotations

import dataclasses
import gc
import types
from typing import Callable

import numpy as np
import pytest
import torch
from torch import nn

import graphtrace as gt
from graphtrace.vocab import GUARD_PROBLEMS
from tests.test_blindspots import Packed as Transposed  # weight (4, 3), packed = weight.t()
from tests.test_blindspots import QuantizedPacked as Packed  # weight (3, 4), packed params
from tests.test_diff import Model

X = torch.rand(2, 8, generator=torch.Generator().manual_seed(3))


def assert_agree(t, guards, report=None) -> tuple[set, dict]:
    """diff's problem edges == every guard's check; impacts equal where both give one.
    Returns (the problem set, {(graph, storage): impact} of the diff)."""
    report = report if report is not None else t.diff()
    e = report.edges
    bad = e[e["verdict"].astype(str).isin(GUARD_PROBLEMS)]
    expected = set(zip(bad["graph_id"].tolist(), bad["storage_id"].tolist(),
                       bad["verdict"].astype(str)))
    impacts = {(g, s): str(i) for g, s, i in zip(bad["graph_id"], bad["storage_id"],
                                                 bad["impact"].astype(object))
               if isinstance(i, str)}
    spots = {(b["kind"], b["holder"]) for b in report.meta["blind_spots"]}
    for guard in guards:
        p = guard.check()
        blind = p[p["blind_spot"] != ""]  # blind spots the update may have invalidated
        assert set(zip(blind["blind_spot"], blind["owners"])) <= spots, \
            f"{guard!r}: blind spots the diff does not name: {blind[['blind_spot', 'owners']]}"
        p = p[p["blind_spot"] == ""]
        got = set(zip(p["graph_id"].tolist(), p["storage_id"].tolist(), p["verdict"]))
        assert got == expected, f"{guard!r}: guard {sorted(got)} != diff {sorted(expected)}"
        for g, s, i in zip(p["graph_id"], p["storage_id"], p["impact"].astype(object)):
            if isinstance(i, str) and i != "unknown" and impacts.get((g, s), "unknown") != "unknown":
                assert i == impacts[(g, s)], f"impact of graph {g} storage {s}: guard {i}, " \
                                             f"diff {impacts[(g, s)]}"
    return expected, impacts


# -- models beyond tests.test_diff.Model (a parameter read through .t(), a buffer, a partial,
# a closure, a dict and a dataclass holder in each of two layers) ---------------------------

class ListHolder(nn.Module):
    def __init__(self):
        super().__init__()
        self.table = [torch.rand(8), torch.rand(8)]

    def forward(self, x):
        return x * self.table[0] + self.table[1]


class Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(16, 8)
        self.head = nn.Linear(8, 16, bias=False)
        self.head.weight = self.embed.weight  # tied, as language models do

    def forward(self, x):
        return self.head(torch.relu(x))


class WeightNormed(nn.Module):
    def __init__(self):
        super().__init__()
        import warnings
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            self.fc = torch.nn.utils.weight_norm(nn.Linear(8, 8))

    def forward(self, x):
        return self.fc(x)


@dataclasses.dataclass
class Settings:
    scale: torch.Tensor


class ConfigHolder(nn.Module):
    """A config object shared by two layers (the same holder reached by two paths)."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)
        self.a.settings = self.b.settings = Settings(torch.rand(8))

    def forward(self, x):
        return self.b(self.a(x) * self.a.settings.scale) * self.b.settings.scale


# -- updates --------------------------------------------------------------------------------

def _new(model: nn.Module, seed: int = 11, same: bool = False) -> dict[str, torch.Tensor]:
    """New values for every registered tensor (the same values with `same`)."""
    g = torch.Generator().manual_seed(seed)
    return {k: (v.detach().clone() if same else torch.rand(v.shape, generator=g).to(v.dtype))
            for k, v in model.state_dict().items()}


def copy_in_place(same=False):
    def update(m, keep):
        with torch.no_grad():
            for k, v in _new(m, same=same).items():
                m.state_dict()[k].copy_(v)
    return update


def assign(same=False):
    def update(m, keep):
        m.load_state_dict(_new(m, same=same), assign=True)
    return update


def data_swap(m, keep):
    for p in m.parameters():
        p.data = torch.rand_like(p)


def swap_tensors(m, keep):
    layer = m.layers[0]
    torch.utils.swap_tensors(layer.weight, nn.Parameter(torch.rand_like(layer.weight)))


def rebind(*holders: str, freed: bool = False):
    """Rebuild the named holders of tests.test_diff.Model's layers with new tensors."""
    def update(m, keep):
        fresh = Model(21)
        for layer, new in zip(m.layers, fresh.layers):
            for h in holders:
                if h == "fn":
                    layer.kernel.fn = new.kernel.fn
                elif h == "lam":
                    layer.kernel.lam = new.kernel.lam
                elif h == "gate":
                    layer.kernel.tables["gate"] = new.kernel.tables["gate"]
                elif h == "config":
                    layer.config = new.config
                elif h == "weight":
                    layer.weight = new.weight
                elif h == "scale":
                    layer.scale = new.scale
        if freed:  # capture artifacts dropped: the old tensors die
            keep.clear()
            gc.collect()
    return update


def cut_walk(m, keep):
    """After the trace, before the guards: a captured holder rebound (so the owner snapshot
    walks the model again) and a tensor held deeper than the owner walk goes (max_depth
    12): that walk is cut short, which diff and guard must both see (issue 40)."""
    rebind("fn")(m, keep)
    box = types.SimpleNamespace(t=torch.rand(8))
    for _ in range(14):
        box = types.SimpleNamespace(inner=box)
    m.layers[0].deep = box


def diverge(m, keep):
    m.layers[0].kernel.tables["gate"] = torch.rand(8)  # the alias keeps the captured one


def alias_gate(m):
    m.layers[0].gate_alias = m.layers[0].kernel.tables["gate"]
    return m


def orphan_config(m, keep):
    del m.layers[1].config


def orphan_key(m, keep):
    del m.layers[0].kernel.tables["gate"]


def restore(m, keep):
    old = m.layers[0].kernel.tables["gate"]
    m.layers[0].kernel.tables["gate"] = torch.rand(8)
    m.layers[0].kernel.tables["gate"] = old  # rebound, then put back


def same_storage(m, keep):
    old = m.layers[0].kernel.tables["gate"]
    m.layers[0].kernel.tables["gate"] = old.view(2, 4).view(-1)  # a new tensor, same storage


def replace_layer(m, keep):
    m.layers[1] = Model(31).layers[1]


def to_dtype(dtype, same=True):
    def update(m, keep):
        m.to(dtype)  # new storages for every parameter; the graphs keep the old ones
        if not same:
            with torch.no_grad():
                for v in m.state_dict().values():
                    v.add_(1)
    return update


def pad(m, keep):
    w = m.layers[0].weight
    padded = torch.zeros(8, 16)
    padded[:, :8] = w.detach()
    w.data = padded  # same Parameter object, new storage of another shape (vLLM #46009)


def to_meta(m, keep):
    m.layers[0].weight = nn.Parameter(torch.empty(8, 8, device="meta"))  # a failed reload


def list_rebind(m, keep):
    m.table[0] = torch.rand(8)


def list_copy(m, keep):
    with torch.no_grad():
        m.table[0].copy_(torch.rand(8))


def untie(m, keep):
    m.head.weight = nn.Parameter(m.embed.weight.detach().clone())


def retie(m, keep):
    w = nn.Parameter(torch.rand_like(m.embed.weight))
    m.embed.weight = w
    m.head.weight = w


def weight_norm_update(rebind_v=False):
    def update(m, keep):
        with torch.no_grad():
            if rebind_v:
                m.fc.weight_v = nn.Parameter(m.fc.weight_v * 2)
            else:
                m.fc.weight_v.mul_(2)
                m.fc.weight_g.add_(1)
        m(X)  # an eager forward recomputes `weight` into a new attribute tensor
    return update


def shared_config(m, keep):
    m.a.settings = m.b.settings = Settings(torch.rand(8))


def shared_config_one(m, keep):
    m.a.settings = Settings(torch.rand(8))  # b's path still reaches the captured tensor


def copy_not_rebuilt(rebuild: bool):
    """New weight values copied in place; the packed copy rebuilt (a new storage) or not."""
    def update(m, keep):
        copy_in_place()(m, keep)
        if rebuild:
            m.process()
    return update


def requantize(m, keep):
    with torch.no_grad():
        m.weight.copy_(torch.randn(3, 4))
    m.process()  # a new packed object: the graphs keep reading the old one


def requantize_freed(m, keep):
    requantize(m, keep)
    keep.clear()
    gc.collect()


# -- torchao (issue 25): quantized weights are wrapper tensor subclasses ---------------------
# (Int8Tensor, Float8Tensor: `qdata`, `scale`, ... through __tensor_flatten__); graphs read the
# inner tensors, owned as `<parameter>.<inner name>` (Note [tensor subclasses], owners.py).

def torchao_config(kind: str):
    """A torchao quantization config that runs on CPU: int8 weight-only, int8 dynamic
    activation + int8 weight, float8 weight-only, int4 weight-only (CPU layout, prototype)."""
    q = pytest.importorskip("torchao.quantization")
    if kind == "int8":
        return q.Int8WeightOnlyConfig()
    if kind == "int8-dynamic":
        return q.Int8DynamicActivationInt8WeightConfig()
    if kind == "float8":
        return q.Float8WeightOnlyConfig()
    if kind == "int4":
        from torchao.prototype.quantization.int4.inference_workflow import (
            PrototypeInt4WeightOnlyConfig,
        )
        return PrototypeInt4WeightOnlyConfig(group_size=32)
    raise ValueError(kind)


def quantized(kind: str, seed: int = 0, width: int = 8) -> nn.Module:
    """Two linears, quantized with torchao's `quantize_` (what a torchao-quantized engine holds)."""
    from torchao.quantization import quantize_
    torch.manual_seed(seed)
    m = nn.Sequential(nn.Linear(width, 2 * width), nn.ReLU(), nn.Linear(2 * width, width)).eval()
    quantize_(m, torchao_config(kind))
    return m


def inner_names(weight: torch.Tensor) -> list[str]:
    return weight.__tensor_flatten__()[0]


def requantize_torchao(kind: str, freed: bool = False):
    """Quantize again from new float weights and bind the new weights (an RL weight sync
    into a torchao-quantized engine): every inner tensor moves."""
    def update(m, keep):
        width = m[0].in_features
        fresh = quantized(kind, seed=5, width=width)
        for i in (0, 2):
            m[i].weight = fresh[i].weight
        if freed:
            keep.clear()
            gc.collect()
    return update


def copy_torchao(kind: str):
    """copy_ the newly quantized inner tensors into the existing ones: clean."""
    def update(m, keep):
        fresh = quantized(kind, seed=5, width=m[0].in_features)
        with torch.no_grad():
            for i in (0, 2):
                for name in inner_names(m[i].weight):
                    getattr(m[i].weight, name).copy_(getattr(fresh[i].weight, name))
    return update


class MLP(nn.Module):
    """Two linears: what Inductor's CPU freezing prepacks into compiled-in constants."""

    def __init__(self):
        super().__init__()
        self.up = nn.Linear(8, 64)
        self.down = nn.Linear(64, 8)

    def forward(self, x):
        return self.down(torch.relu(self.up(x)))


class LoraLike(nn.Module):
    """A LoRA-style layer whose scaling is a Python float in a dict (as peft keeps it)."""

    def __init__(self):
        super().__init__()
        self.base = nn.Linear(8, 8)
        self.lora_a = nn.Linear(8, 2, bias=False)
        self.lora_b = nn.Linear(2, 8, bias=False)
        self.scaling = {"default": 0.37}

    def forward(self, x):
        return self.base(x) + self.lora_b(self.lora_a(x)) * self.scaling["default"]


def swap_lora_scaling(m, keep):
    m.scaling["default"] = 2.0  # a hot-swapped LoRA scaling: the graphs keep the old float


# -- freshness (issue 24): a cache derived from parameters, read by the graphs -------------

def _mamba(rewrite_in_forward=False):
    def build():
        from graphtrace.demo.cases.megatron_6723_a_neg_exp_cache import MambaModel
        m = MambaModel(rewrite_in_forward=rewrite_in_forward)
        m.refit(m.checkpoint(0))
        return m
    return build


def refit(refresh=False):
    def update(m, keep):
        m.refit(m.checkpoint(1))  # in place: identity holds everywhere
        if refresh:
            for layer in m.layers:
                layer.refresh()
    return update


def rebind_source(m, keep):
    m.layers[0].A_log = nn.Parameter(torch.rand(8), requires_grad=False)


def rebind_source_same_values(m, keep):
    """A same-weights reload that binds new tensors, the old A_log kept alive by a holder: the
    cache is unrefreshed, but its sources' values are unchanged (impact latent)."""
    keep.append(m.layers[0].A_log)
    m.layers[0].A_log = nn.Parameter(m.layers[0].A_log.detach().clone(), requires_grad=False)


def rebind_source_new_values(m, keep):
    """As above with new values: the old A_log is alive but differs (impact unknown: the
    derived value is not recomputed)."""
    keep.append(m.layers[0].A_log)
    m.layers[0].A_log = nn.Parameter(m.layers[0].A_log.detach() + 1, requires_grad=False)


def refit_and_drop_cache(m, keep):
    m.refit(m.checkpoint(1))
    m.layers[1]._A_neg_exp_cache = -torch.exp(m.layers[1].A_log)  # rebuilt, not in place


# -- dangling sources (issue 24): a handle made inside the trace from a registered scale ----

def _handle_model():
    from tests.test_dangling_sources import Model as HandleModel

    m = HandleModel()
    m.proj.process_weights_after_loading()
    return m


def process_again(m):
    """A process step inside the trace: the handle is made from the registered scale."""
    m.proj.weight = nn.Parameter(torch.rand(4, 8), requires_grad=False)
    m.proj.process_weights_after_loading()


def rebind_scale(m, keep):
    """A reload that binds a new scale parameter and does not make the handle again: the
    handle's pointer reaches the freed old scale."""
    m.proj.weight_scale = nn.Parameter(m.proj.weight_scale.detach() * 2, requires_grad=False)


def scale_in_place(m, keep):
    m.proj.weight_scale.mul_(2.0)


# -- the RL load_weights case (graphtrace.demo.cases.rl_load_weights_no_process) -----------

def _rl(in_place=False):
    def build():
        from graphtrace.demo.cases.rl_load_weights_no_process import RLModel
        return RLModel(in_place=in_place)
    return build


def rl_first_load(m):
    """The engine's first load and process step, inside the trace."""
    m.load(m.checkpoint(0))


def rl_sync(process=False):
    def update(m, keep):
        with torch.no_grad():  # new weights into the live parameters (copy_, in place)
            for name, new in m.checkpoint(1).items():
                m.get_parameter(name).copy_(new)
            if process:
                m.process_weights_after_loading()
    return update


# -- SGLang #26194 (graphtrace.demo.cases.sglang_26194_permute_index_cache): a findings case --

def _sglang(clear=False):
    def build():
        from graphtrace.demo.cases.sglang_26194_permute_index_cache import MoEModel
        return MoEModel(clear_each_cycle=clear)
    return build


def sglang_update(m, keep):
    """The memory saver's pause and resume, then load and process again (no verdict: the
    carried-over indices are a finding, tests/test_carried_state.py)."""
    from graphtrace.demo.cases.sglang_26194_permute_index_cache import pause_resume

    pause_resume(m)
    m.load(m.checkpoint(1))


@dataclasses.dataclass
class Scenario:
    build: Callable[[], nn.Module]
    update: Callable
    problems: set                 # verdicts among diff's problem edges
    impacts: set = dataclasses.field(default_factory=set)  # impacts of stale-like edges
    compiled: bool = False
    needs: str = ""
    warmup: bool = False          # an eager forward inside the trace before the captures
    setup: Callable | None = None  # a process step inside the trace before the captures
    freezing: bool = False        # compiled with Inductor's freezing (parameters folded in)
    some_impacts: bool = False    # `impacts` must be among the impacts found, not all of them
    before_guard: Callable | None = None  # a change after the trace, before the guards
    copies: tuple = ()            # (copy, source) paths told to the trace (t.watch_copy)
    width: int = 0                # the input width (default: 4 for Packed, else 8)


SCENARIOS: dict[str, Scenario] = {
    "copy": Scenario(Model, copy_in_place(), set()),
    "copy-same-values": Scenario(Model, copy_in_place(same=True), set()),
    "assign": Scenario(Model, assign(), {"stale"}, {"manifest"}),
    "assign-same-values": Scenario(Model, assign(same=True), {"stale"}, {"latent"}),
    "data-swap": Scenario(Model, data_swap, {"stale"}, {"manifest"}),
    "swap-tensors": Scenario(Model, swap_tensors, {"stale"}, {"manifest"}),
    "partial": Scenario(Model, rebind("fn"), {"stale"}, {"manifest"}),
    "closure": Scenario(Model, rebind("lam"), {"stale"}, {"manifest"}),
    "dict": Scenario(Model, rebind("gate"), {"stale"}, {"manifest"}),
    "dataclass": Scenario(Model, rebind("config"), {"stale"}, {"manifest"}),
    "parameter-replaced": Scenario(Model, rebind("weight"), {"stale"}, {"manifest"}),
    "buffer-replaced": Scenario(Model, rebind("scale"), {"stale"}, {"manifest"}),
    "all-holders": Scenario(Model, rebind("fn", "lam", "gate", "config"), {"stale"},
                            {"manifest"}),
    "freed": Scenario(Model, rebind("fn", "gate", freed=True), {"dangling"}, {"unknown"}),
    "diverged": Scenario(lambda: alias_gate(Model()), diverge, {"diverged"}, {"manifest"}),
    "walk-cut-before-guard": Scenario(Model, lambda m, keep: None, {"stale"}, {"manifest"},
                                      before_guard=cut_walk),
    # a packed copy of a weight (Note [derived copies]): the diff names a copy not rebuilt
    # after its source changed, and the guard fails closed on it
    "packed-copy-not-rebuilt": Scenario(Transposed, copy_not_rebuilt(False), {"unrefreshed"},
                                        {"unknown"}, copies=(("packed", "weight"),), width=3),
    "packed-copy-rebuilt": Scenario(Transposed, copy_not_rebuilt(True), {"stale"},
                                    {"manifest"}, copies=(("packed", "weight"),), width=3),
    "orphaned-attribute": Scenario(Model, orphan_config, {"orphaned"}),
    "orphaned-key": Scenario(Model, orphan_key, {"orphaned"}),
    "rebound-and-restored": Scenario(Model, restore, set()),
    "new-tensor-same-storage": Scenario(Model, same_storage, set()),
    "layer-replaced": Scenario(Model, replace_layer, {"stale"}, {"manifest"}),
    "dtype-move-same-values": Scenario(Model, to_dtype(torch.float64), {"stale"}, {"latent"}),
    "dtype-move-new-values": Scenario(Model, to_dtype(torch.float64, same=False), {"stale"},
                                      {"manifest"}),
    "shape-change": Scenario(Model, pad, {"stale"}, {"manifest"}),
    "meta-after-failed-reload": Scenario(Model, to_meta, {"stale"}, {"unknown"}),
    "list-rebound": Scenario(ListHolder, list_rebind, {"stale"}, {"manifest"}),
    "list-copied": Scenario(ListHolder, list_copy, set()),
    "tied-untied": Scenario(Tied, untie, {"diverged"}, {"latent"}),
    "tied-both-rebound": Scenario(Tied, retie, {"stale"}, {"manifest"}),
    "write-before-read": Scenario(WeightNormed, weight_norm_update(), set()),
    "write-before-read-source-rebound": Scenario(WeightNormed, weight_norm_update(rebind_v=True),
                                                 {"stale"}, {"manifest"}),
    "shared-holder-rebound": Scenario(ConfigHolder, shared_config, {"stale"}, {"manifest"}),
    "shared-holder-one-path": Scenario(ConfigHolder, shared_config_one, {"diverged"},
                                       {"manifest"}),
    "opaque-requantized": Scenario(Packed, requantize, {"stale"}, {"unknown"}, needs="fbgemm"),
    "opaque-requantized-freed": Scenario(Packed, requantize_freed, {"dangling"}, {"unknown"},
                                         needs="fbgemm"),
    "opaque-unchanged": Scenario(Packed, lambda m, keep: None, set(), needs="fbgemm"),
    "compiled-rebind": Scenario(Model, rebind("gate", "config"), {"stale"}, {"manifest"},
                                compiled=True),
    "compiled-copy": Scenario(Model, copy_in_place(), set(), compiled=True),
    "torchao-int8-requantized": Scenario(lambda: quantized("int8"), requantize_torchao("int8"),
                                         {"stale"}, {"manifest"}, needs="torchao"),
    "torchao-int8-requantized-freed": Scenario(lambda: quantized("int8"),
                                               requantize_torchao("int8", freed=True),
                                               {"dangling"}, {"unknown"}, needs="torchao"),
    "torchao-int8-copied": Scenario(lambda: quantized("int8"), copy_torchao("int8"), set(),
                                    needs="torchao"),
    "torchao-int8-dynamic-requantized": Scenario(lambda: quantized("int8-dynamic"),
                                                 requantize_torchao("int8-dynamic"), {"stale"},
                                                 {"manifest"}, needs="torchao"),
    "torchao-float8-requantized": Scenario(lambda: quantized("float8"),
                                           requantize_torchao("float8"), {"stale"},
                                           {"manifest"}, needs="torchao"),
    "torchao-int8-compiled-requantized": Scenario(lambda: quantized("int8"),
                                                  requantize_torchao("int8"), {"stale"},
                                                  # a region compiled in the trace also reads
                                                  # zero_point (all zeros: latent); one reused
                                                  # from Dynamo's cache may not
                                                  {"manifest"}, compiled=True,
                                                  needs="torchao", some_impacts=True),
    "torchao-int8-compiled-copied": Scenario(lambda: quantized("int8"), copy_torchao("int8"),
                                             set(), compiled=True, needs="torchao"),
    # Inductor freezing: the prepacked weights are compiled-in constants no model owns; lineage
    # ties them to the parameters they were packed from (Note [frozen constants], compiled.py)
    "frozen-copy": Scenario(MLP, copy_in_place(), {"unrefreshed"}, {"unknown"}, compiled=True,
                            freezing=True),
    "frozen-unchanged": Scenario(MLP, lambda m, keep: None, set(), compiled=True,
                                 freezing=True),
    # a float baked into the graphs (Note [baked scalars]): no edge moves; diff and guard
    # both name the holder (assert_agree: the guard's blind rows are among diff's records)
    "baked-scalar-changed": Scenario(LoraLike, swap_lora_scaling, set()),
    "derived-cache-refit": Scenario(_mamba(), refit(), {"unrefreshed"}, {"unknown"},
                                    warmup=True),
    "derived-cache-recomputed": Scenario(_mamba(), refit(refresh=True), set(), warmup=True),
    "derived-cache-graph-rewrites": Scenario(_mamba(True), refit(), set(), warmup=True),
    "derived-source-rebound": Scenario(_mamba(), rebind_source, {"unrefreshed"}, {"unknown"},
                                       warmup=True),
    "derived-source-rebound-same-values": Scenario(_mamba(), rebind_source_same_values,
                                                   {"unrefreshed"}, {"latent"}, warmup=True),
    "derived-source-rebound-new-values": Scenario(_mamba(), rebind_source_new_values,
                                                  {"unrefreshed"}, {"unknown"}, warmup=True),
    "derived-cache-refit-one-rebuilt": Scenario(_mamba(), refit_and_drop_cache,
                                                {"unrefreshed", "stale"},
                                                {"unknown", "manifest"}, warmup=True),
    "derived-cache-compiled-refit": Scenario(_mamba(), refit(), {"unrefreshed"}, {"unknown"},
                                             compiled=True, warmup=True),
    "rl-load-weights-only": Scenario(_rl(), rl_sync(), {"unrefreshed"}, {"unknown"},
                                     setup=rl_first_load),
    "rl-load-weights-only-compiled": Scenario(_rl(), rl_sync(), {"unrefreshed"}, {"unknown"},
                                              setup=rl_first_load, compiled=True),
    "rl-reprocess-rebind": Scenario(_rl(), rl_sync(process=True), {"stale"}, {"manifest"},
                                    setup=rl_first_load),
    "rl-reprocess-in-place": Scenario(_rl(in_place=True), rl_sync(process=True), set(),
                                      setup=rl_first_load),
    "rl-reprocess-in-place-compiled": Scenario(_rl(in_place=True), rl_sync(process=True),
                                               set(), setup=rl_first_load, compiled=True),
    "sglang-permute-cache-reused": Scenario(_sglang(), sglang_update, set(), setup=rl_first_load),
    "sglang-permute-cache-reused-compiled": Scenario(_sglang(), sglang_update, set(),
                                                     setup=rl_first_load, compiled=True),
    "handle-source-freed": Scenario(_handle_model, rebind_scale, {"dangling"}, {"unknown"},
                                    setup=process_again),
    "handle-source-in-place": Scenario(_handle_model, scale_in_place, {"unrefreshed"},
                                       {"unknown"}, setup=process_again),
    "handle-unchanged": Scenario(_handle_model, lambda m, keep: None, set(),
                                 setup=process_again),
}


def _run(name: str, tmp_path):
    sc = SCENARIOS[name]
    if sc.needs == "fbgemm" and "fbgemm" not in torch.backends.quantized.supported_engines:
        pytest.skip("no fbgemm quantized engine")
    if sc.needs == "torchao":
        pytest.importorskip("torchao", reason="torchao is not installed (pip install -e .[dev])")
    torch.manual_seed(0)
    model = sc.build().eval()
    forward = torch.compile(model, backend="inductor") if sc.compiled else model
    width = sc.width or (4 if isinstance(model, Packed) else 8)
    keep = []
    frozen = torch._inductor.config.patch(freezing=sc.freezing)
    with torch.no_grad(), frozen, gt.trace(model, strict=True) as t:
        for copy, source in sc.copies:
            t.watch_copy(copy, source)
        if sc.setup is not None:
            sc.setup(model)
        if sc.warmup:  # eager, as a process step is (lineage does not see inside compiled code)
            model(torch.rand(2, width))
        for label, batch in (("decode", torch.rand(2, width)), ("prefill", torch.rand(4, width))):
            with gt.capture(label) as g:
                forward(batch)
            keep.append(g)
    if sc.before_guard is not None:
        sc.before_guard(model, keep)
    guard = t.guard()
    path = guard.to_json(tmp_path / "guard.json")
    loaded = gt.load_guard(path, model)  # loaded and attached before the update
    # a guard checked before the update too, as an engine checks it in steady state: its
    # checks after a clean one take the fast paths (Note [guard freshness fast path])
    steady = t.guard()
    steady.check()
    steady.check()
    with torch.no_grad() if name != "write-before-read" else torch.enable_grad():
        sc.update(model, keep)
    return sc, (model, keep), t, [guard, loaded, steady]


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_guard_and_diff_agree(name, tmp_path):
    sc, alive, t, guards = _run(name, tmp_path)  # the model and graphs kept alive
    report = t.diff()
    problems, impacts = assert_agree(t, guards, report)
    assert {v for _, _, v in problems} == sc.problems
    stale_like = {i for (g, s), i in impacts.items()}
    assert sc.impacts <= stale_like <= sc.impacts | ({"latent"} if sc.some_impacts else set())
    if name in ("dtype-move-same-values", "assign-same-values"):
        kinds = [b.kind for b in report.blind_spot_records] if hasattr(
            report, "blind_spot_records") else [b["kind"] for b in report.meta["blind_spots"]]
        notes = [b["text"] for b in report.meta["blind_spots"] if b["kind"] == "dtype/shape change"]
        assert not any("shape" in n.split(":")[1] for n in notes), notes
        if name == "dtype-move-same-values":
            assert notes and all("dtype float32 -> float64" in n for n in notes)
            assert "dtype/shape change" in kinds
        else:
            assert notes == []


def test_an_owner_walk_cut_short_fails_every_guard_closed(tmp_path):
    """The owner walk the guard's making runs is cut short: diff names the `walk cut`, and
    every guard (from the trace, loaded from JSON, checked before) fails closed on it."""
    sc, alive, t, guards = _run("walk-cut-before-guard", tmp_path)
    cuts = [b for b in t.diff().meta["blind_spots"] if b["kind"] == "walk cut"]
    assert cuts and "max_depth" in cuts[0]["text"]
    for guard in guards:
        rows = guard.check()
        assert "walk cut" in set(rows["blind_spot"]), guard
        with pytest.raises(gt.StaleGraphError, match="max_depth"):
            guard.enforce()


@pytest.mark.parametrize("rebuild", [False, True])
def test_a_packed_copy_not_rebuilt_fails_every_guard_closed(rebuild, tmp_path):
    """A weight refreshed in place while the packed copy made from it is not rebuilt: the
    diff names the copy (`packed copy not rebuilt`), and every guard (from the trace, loaded
    from JSON, checked before) fails closed on it, unless that kind is accepted; a rebuilt
    copy is a stale edge and no such record in either."""
    name = "packed-copy-rebuilt" if rebuild else "packed-copy-not-rebuilt"
    sc, alive, t, guards = _run(name, tmp_path)
    found = [b for b in t.diff().meta["blind_spots"] if b["kind"] == "packed copy not rebuilt"]
    assert [b["holder"] for b in found] == ([] if rebuild else ["packed"])
    for guard in guards:
        rows = guard.check()
        spots = rows[rows["blind_spot"] == "packed copy not rebuilt"]
        assert list(spots["owners"]) == ([] if rebuild else ["packed"]), guard
        if not rebuild:
            assert "values changed" in spots["note"].iloc[0]
            with pytest.raises(gt.StaleGraphError, match="packed copy not rebuilt"):
                guard.enforce()
            guard.accept = ["packed copy not rebuilt"]
            assert "packed copy not rebuilt" not in set(guard.check()["blind_spot"])


def test_diff_and_guard_take_impact_and_live_pointer_from_one_implementation(monkeypatch,
                                                                             tmp_path):
    """The per-storage facts have one implementation: with the verdict engine's
    `edge_impact` and `stage.live_pointer` replaced, the diff and every guard (from the
    trace, from JSON, checked before) answer with the replacements."""
    from graphtrace import stage
    from graphtrace import verdict as engine

    sc, alive, t, guards = _run("assign", tmp_path)
    real, asked = engine.edge_impact, []

    def flipped(verdict, *args):  # manifest reads as latent
        asked.append(verdict)
        impact, note = real(verdict, *args)
        return ("latent" if impact == "manifest" else impact), note

    monkeypatch.setattr(engine, "edge_impact", flipped)
    monkeypatch.setattr(stage, "live_pointer", lambda ptrs, known, moved, starts: np.full(
        len(starts), -1))  # no live pointer known
    e = t.diff().edges
    stale = e[e["verdict"] == "stale"]
    assert len(stale) and set(stale["impact"].astype(str)) == {"latent"}
    assert stale["live_data_ptr"].isna().all()
    for guard in guards:
        asked.clear()
        p = guard.check()
        assert len(p) and set(p["impact"]) == {"latent"}, guard
        assert p["live_data_ptr"].isna().all() and set(asked) == {"stale"}, guard


def test_diff_and_every_guard_take_freshness_from_one_implementation(monkeypatch, tmp_path):
    """Which captured storages are looked at for freshness, whether each is unrefreshed,
    its impact and its dangling sources have one implementation (`verdict.freshness`):
    with it replaced by one that finds every storage it looks at unrefreshed and `latent`,
    an update that left every derived storage fresh reads so in the diff and in every guard
    (from the trace, from JSON, checked before, and the serving core's)."""
    import types

    from graphtrace import verdict as engine
    from graphtrace.serving import ServingCore

    sc, alive, t, guards = _run("rl-reprocess-in-place", tmp_path)
    assert_agree(t, guards)  # fresh: nothing to report
    engine_side = types.SimpleNamespace(trace=t, rank=lambda: 0, recapture=lambda c: False)
    core = ServingCore(engine_side, "warn")
    real, asked = engine.freshness, []

    def all_unrefreshed(storages, resolve, lineage=None, *, sources_unchanged=False):
        found = real(storages, resolve, lineage)  # a full pass, fast path or not
        asked.append(sorted(found.fresh))
        found.unrefreshed.update(dict.fromkeys(found.fresh, "latent"))
        return engine.Freshness(found.unrefreshed, found.freed, [])

    monkeypatch.setattr(engine, "freshness", all_unrefreshed)
    problems, impacts = assert_agree(t, guards)  # the diff and every guard, alike
    assert problems and {v for _, _, v in problems} == {"unrefreshed"}
    assert set(impacts.values()) == {"latent"}
    assert len(asked) >= 1 + len(guards) and all(asked), asked
    try:
        entry = core.check("test", force=True)
        monkeypatch.setattr(engine, "freshness", real)
        clean = core.check("test", force=True)
    finally:
        core.close()
    assert not entry["ok"] and entry["verdicts"] == ["unrefreshed"], entry
    assert clean["ok"], clean


def test_there_are_at_least_thirty_scenarios_and_every_verdict_is_reached():
    assert len(SCENARIOS) >= 30
    reached = set().union(*(s.problems for s in SCENARIOS.values()))
    assert reached == set(GUARD_PROBLEMS)
    assert {"latent", "manifest", "unknown"} <= set().union(*(s.impacts for s in SCENARIOS.values()))


# -- a transformers Llama (tiny config, random init): the most common read, weight.t() -------


def _weights(report):
    e = report.edges
    return e[e["owner_kinds"].astype(str).str.contains("parameter")]


@pytest.mark.slow
def test_llama_same_weights_assign_is_stale_latent_with_no_shape_note(tmp_path, traced_llama):
    model, t, keep = traced_llama
    guard = t.guard()
    sd = {k: v.clone() for k, v in model.state_dict().items()}
    model.load_state_dict(sd, assign=True)
    report = t.diff()
    w = _weights(report)
    assert len(w) >= 2 * 7 + 3  # every linear of both layers, the norms, embedding and head
    assert set(w["verdict"].astype(str)) == {"stale"}
    assert set(w["impact"].astype(str)) == {"latent"}
    assert [b for b in report.meta["blind_spots"] if b["kind"] == "dtype/shape change"] == []
    problems, impacts = assert_agree(t, [guard], report)
    assert set(guard.check()["impact"]) == {"latent"}


@pytest.mark.slow
def test_llama_moved_to_float64_notes_the_dtype_and_no_shape(tmp_path, traced_llama):
    model, t, keep = traced_llama
    guard = t.guard()
    model.to(torch.float64)  # new storages; the graph keeps the old float32 ones alive
    report = t.diff()
    w = _weights(report)
    assert set(w["verdict"].astype(str)) == {"stale"}
    assert set(w["impact"].astype(str)) == {"latent"}
    notes = [b["text"] for b in report.meta["blind_spots"] if b["kind"] == "dtype/shape change"]
    moved = report.stale["storage_id"].nunique()  # the weights and the rotary buffer
    assert moved > w["storage_id"].nunique() - 1 and len(notes) == moved  # one note each
    assert all("dtype float32 -> float64" in n and "shape" not in n.split(":", 1)[1]
               for n in notes), notes
    assert_agree(t, [guard], report)
