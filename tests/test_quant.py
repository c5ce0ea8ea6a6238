"""Weights in real quantization libraries (issue 25): tensor subclasses.

torchao's quantized weights are wrapper tensor subclasses (`Int8Tensor`, `Float8Tensor`,
`Int4OpaqueTensor`) whose own storage is a placeholder; the graphs read the tensors inside
them. Before the owner walk descended through `__tensor_flatten__` a re-quantize reported
0 stale edges. Diff/guard agreement on these updates: tests/test_differential.py
(`torchao-*` scenarios).
"""

from __future__ import annotations

import gc

import pytest
import torch
from torch import nn
from torch.testing._internal.two_tensor import TwoTensor

import graphtrace as gt
from graphtrace.guard import describe
from graphtrace.owners import resolve_path, walk_owners
from tests.test_differential import (
    LoraLike,
    assert_agree,
    copy_torchao,
    inner_names,
    quantized,
    requantize_torchao,
)

pytest.importorskip("torchao", reason="torchao is not installed (pip install -e .[dev])")


def _capture(model, x, compiled=False):
    forward = torch.compile(model, backend="inductor") if compiled else model
    keep = []
    with torch.no_grad(), gt.trace(model, strict=True) as t:
        with gt.capture("g") as g:
            forward(x)
        keep.append(g)
    return t, keep


def _problems(report) -> dict[str, str]:
    e = report.edges
    bad = e[e["verdict"].astype(str).isin(gt.STALE_VERDICTS)]
    return {o: str(v) for o, v in zip(bad["owners"].astype(str), bad["verdict"].astype(str))}


# -- the owner walk --------------------------------------------------------------------------

def test_walk_owns_the_inner_tensors_of_a_torchao_weight_and_resolve_path_reaches_them():
    m = quantized("int8")
    found = {p: (k, t) for p, k, t in walk_owners(m)}
    w = m[0].weight
    assert type(w).__name__ == "Int8Tensor"
    for name in inner_names(w):
        kind, tensor = found[f"0.weight.{name}"]
        assert kind == "parameter"  # the registered weight's data
        assert tensor is getattr(w, name)
        assert resolve_path(m, f"0.weight.{name}") is tensor


def test_walk_descends_through_nested_subclasses():
    inner = TwoTensor(torch.rand(4), torch.rand(4))
    holder = nn.Module()
    holder.pair = TwoTensor(inner, inner * 2)  # an attribute, a subclass of subclasses
    paths = {p: t for p, _, t in walk_owners(holder)}
    assert {"pair", "pair.a", "pair.b", "pair.a.a", "pair.a.b", "pair.b.a", "pair.b.b"} \
        <= set(paths)
    assert paths["pair.a.b"] is inner.b
    assert resolve_path(holder, "pair.b.a") is paths["pair.b.a"]


class Unflattenable(torch.Tensor):
    """Dispatches its own ops on a tensor it holds, but cannot be flattened."""

    @staticmethod
    def __new__(cls, elem):
        return torch.Tensor._make_wrapper_subclass(cls, elem.shape, dtype=elem.dtype)

    def __init__(self, elem):
        self.elem = elem

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        unwrap = torch.utils._pytree.tree_map_only
        return func(*unwrap(Unflattenable, lambda x: x.elem, args),
                    **unwrap(Unflattenable, lambda x: x.elem, kwargs or {}))


def test_a_subclass_that_cannot_be_flattened_is_a_blind_spot_naming_its_path():
    lin = nn.Linear(4, 4)
    del lin.weight
    lin.weight = Unflattenable(torch.rand(4, 4))
    t, keep = _capture(lin, torch.rand(2, 4))
    spots = [b for b in t.diff().meta["blind_spots"] if b["kind"] == "tensor subclass"]
    assert [b["holder"] for b in spots] == ["weight"]
    assert "Unflattenable" in spots[0]["text"]
    lin.weight = Unflattenable(torch.rand(4, 4))  # rebinding it is still seen
    assert set(_problems(t.diff()).values()) <= {"stale", "dangling"}
    assert "weight" in _problems(t.diff())


def test_a_plain_model_gets_no_subclass_blind_spot():
    lin = nn.Linear(4, 4)
    t, keep = _capture(lin, torch.rand(2, 4))
    assert not [b for b in t.diff().meta["blind_spots"] if b["kind"] == "tensor subclass"]


# -- the reproduction: re-quantize a transformers model ------------------------------

def test_transformers_llama_requantized_with_torchao_is_stale_on_the_inner_tensors(tiny_llama):
    from torchao.quantization import Int8WeightOnlyConfig, quantize_
    model = tiny_llama()
    quantize_(model, Int8WeightOnlyConfig())
    ids = torch.randint(0, 64, (1, 8))
    t, keep = _capture(model, ids)
    guard = t.guard()
    fresh = tiny_llama(seed=1)
    quantize_(fresh, Int8WeightOnlyConfig())
    linears = [n for n, mod in model.named_modules() if isinstance(mod, nn.Linear)]
    for name in linears:
        model.get_submodule(name).weight = fresh.get_submodule(name).weight
    report = t.diff()
    problems = _problems(report)
    for name in linears:  # every linear's int8 data and scales, by path
        assert problems.get(f"{name}.weight.qdata") == "stale"
        assert problems.get(f"{name}.weight.scale") == "stale"
    assert len(problems) == 2 * len(linears) == 30
    assert_agree(t, [guard], report)
    with pytest.raises(gt.StaleGraphError):
        guard.enforce()


@pytest.mark.parametrize("kind", ["int8", "int8-dynamic", "float8", "int4"])
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_every_cpu_torchao_config_requantized_is_stale_and_copied_is_clean(kind, compiled):
    width = 32 if kind == "int4" else 8  # int4: a group of 32 input features
    x = torch.rand(2, width)
    for update, stale in ((requantize_torchao(kind), True), (copy_torchao(kind), False)):
        m = quantized(kind, width=width)
        t, keep = _capture(m, x, compiled)
        guard = t.guard()
        owned = set(t.diff().owners["path"].astype(str))
        assert {f"0.weight.{n}" for n in inner_names(m[0].weight)} & owned
        update(m, keep)
        report = t.diff()
        problems = _problems(report)
        assert_agree(t, [guard], report)
        if stale:
            assert problems and all(v == "stale" for v in problems.values()), problems
            assert {o.rsplit(".", 1)[0] for o in problems} == {"0.weight", "2.weight"}
        else:
            assert problems == {}


def test_requantized_and_graphs_dropped_is_dangling():
    m = quantized("int8")
    t, keep = _capture(m, torch.rand(2, 8))
    requantize_torchao("int8", freed=True)(m, keep)
    gc.collect()
    problems = _problems(t.diff())
    assert problems and set(problems.values()) == {"dangling"}


# -- the guard fails closed on blind spots (Note [blind spots in the guard]) ----------------

def _unflattenable_linear():
    lin = nn.Linear(4, 4)
    del lin.weight
    lin.weight = Unflattenable(torch.rand(4, 4))
    return lin


def _blind(problems):
    return problems[problems["verdict"] == "unchecked"]


def test_guard_fails_closed_on_a_subclass_written_in_place_unless_accepted(tmp_path):
    lin = _unflattenable_linear()
    t, keep = _capture(lin, torch.rand(2, 4))
    guard = t.guard()
    assert [b.kind for b in guard.blind_spots] == ["tensor subclass"]
    loaded = gt.load_guard(guard.to_json(tmp_path / "g.json"), lin)
    accepting = t.guard(accept=["tensor subclass"])
    for g in (guard, loaded, accepting):
        assert g.check().empty  # nothing happened yet: the holder holds, unwritten
    with torch.no_grad():
        lin.weight.copy_(torch.rand(4, 4))  # new values behind the wrapper: not seen
    for g in (guard, loaded):
        rows = _blind(g.check())
        assert list(rows["blind_spot"]) == ["tensor subclass"]
        assert list(rows["owners"]) == ["weight"] and list(rows["statuses"]) == ["written"]
        with pytest.raises(gt.StaleGraphError, match="tensor subclass"):
            g.enforce()
    assert accepting.check().empty
    accepting.enforce()
    guard.accept = ["tensor subclass"]  # accepted later, on the guard itself
    guard.enforce()


def test_a_blind_spot_without_a_holder_cannot_be_checked_and_fails_every_check(tmp_path):
    m = quantized("int8")
    t, keep = _capture(m, torch.rand(2, 8))
    t.add_blind_spot("an op fetches the KV cache by name inside itself", kind="forward context",
                     op="vllm::unified_attention")
    t.add_blind_spot("only in another graph", kind="forward context", graph="elsewhere")
    guard = t.guard()
    assert [b.text for b in guard.blind_spots] == [
        "an op fetches the KV cache by name inside itself"]
    rows = _blind(guard.check())
    assert list(rows["statuses"]) == [""] and list(rows["graph_id"]) == [-1]
    assert "forward context: an op fetches the KV cache by name inside itself [nothing to " \
        "check it by]" in describe(guard.check())
    loaded = gt.load_guard(guard.to_json(tmp_path / "g.json"), m,
                           accept=["forward context"])
    assert loaded.check().empty
    copy_torchao("int8")(m, keep)  # a clean copy update: the edges agree, the blind spot not
    assert len(_blind(guard.check())) == 1
    assert t.guard(accept=["forward context"]).check().empty


def test_accept_names_bad_kinds_clearly(tmp_path):
    lin = _unflattenable_linear()
    t, keep = _capture(lin, torch.rand(2, 4))
    with pytest.raises(gt.GraphtraceError, match="unknown blind-spot kind.*'opaque'.*kinds: "):
        t.guard(accept=["opaque"])
    with pytest.raises(gt.GraphtraceError, match=r"accept=\['opaque handle'\]"):
        t.guard(accept="opaque handle")
    with pytest.raises(gt.GraphtraceError, match="list of blind-spot kinds"):
        t.guard(accept=3)
    path = t.guard().to_json(tmp_path / "g.json")
    with pytest.raises(gt.GraphtraceError, match="unknown blind-spot kind"):
        gt.load_guard(path, lin, accept=["nope"])
    guard = t.guard()
    with pytest.raises(gt.GraphtraceError, match="unknown blind-spot kind"):
        guard.accept = ["nope"]


def test_manifest_without_blind_spots_still_loads_and_bad_entries_are_named(tmp_path):
    import json
    lin = _unflattenable_linear()
    t, keep = _capture(lin, torch.rand(2, 4))
    data = t.guard().to_dict()
    assert data["blind_spots"][0]["kind"] == "tensor subclass"
    old = {k: v for k, v in data.items() if k != "blind_spots"}
    (tmp_path / "old.json").write_text(json.dumps(old))
    assert gt.load_guard(tmp_path / "old.json", lin).blind_spots == []
    data["blind_spots"][0]["graph_id"] = 99
    (tmp_path / "bad.json").write_text(json.dumps(data))
    with pytest.raises(gt.GraphtraceError, match=r"bad.json: blind_spots\[0\] must be"):
        gt.load_guard(tmp_path / "bad.json", lin)
    data["blind_spots"][0].update(graph_id=-1, kind="no such kind")
    (tmp_path / "bad.json").write_text(json.dumps(data))
    with pytest.raises(gt.GraphtraceError, match=r"blind_spots\[0\]"):
        gt.load_guard(tmp_path / "bad.json", lin)


# -- Inductor freezing: compiled-in constants tied to their source parameters ----------------

def _frozen_capture(model, x, compile_inside=True):
    from torch._inductor import config
    with torch.no_grad(), config.patch(freezing=True):
        forward = torch.compile(model, backend="inductor")
        if not compile_inside:
            forward(x)  # compiled (and its constants folded) before the trace opened
        keep = []
        with gt.trace(model, strict=True) as t:
            with gt.capture("g") as g:
                keep.append(forward(x))  # the graph's output: replay writes into it
            keep.append(g)
    return t, keep


def test_frozen_constants_are_unrefreshed_after_a_copy_reload_with_their_source_paths(tmp_path):
    from tests.test_differential import MLP
    torch.manual_seed(0)
    m = MLP().eval()
    x = torch.rand(4, 8)
    t, keep = _frozen_capture(m, x)
    guard = t.guard(accept=["opaque handle"])  # the extern MKL op's packed argument accepted
    loaded = gt.load_guard(guard.to_json(tmp_path / "g.json"), m, accept=["opaque handle"])
    assert guard.check().empty and t.diff().stale.empty
    with torch.no_grad():
        old = m(x)
        for lin in (m.up, m.down):  # a copy reload: every weight keeps its storage
            lin.weight.copy_(torch.randn_like(lin.weight))
        new = m(x)
    out, graph = keep
    graph.replay()  # as a CUDA graph would: the prepacked constants still hold the old weights
    assert torch.allclose(out, old, atol=1e-4) and not torch.allclose(out, new, atol=1e-2)
    report = t.diff()
    e = report.edges
    frozen = e[e["verdict"].astype(str) == "unrefreshed"]
    assert set(frozen["derived_from"].astype(str)) == {"up.weight", "down.weight"}
    assert all(a.startswith("constant:") for a in frozen["args"].astype(str))
    assert not [b for b in report.meta["blind_spots"] if "no watched model owns" in b["text"]]
    row = report.meta["compiled"][0]
    assert row["derived_constants"] == len(frozen)
    assert_agree(t, [guard, loaded], report)
    for g in (guard, loaded):
        with pytest.raises(gt.StaleGraphError, match="unrefreshed"):
            g.enforce()


def test_constants_folded_before_the_trace_stay_a_blind_spot_and_the_guard_fails_closed():
    from tests.test_differential import MLP
    torch.manual_seed(0)
    m = MLP().eval()
    t, keep = _frozen_capture(m, torch.rand(4, 8), compile_inside=False)
    report = t.diff()
    assert not (report.edges["verdict"].astype(str) == "unrefreshed").any()
    spots = [b for b in report.meta["blind_spots"] if b["kind"] == "compiled"]
    assert spots and "no watched model owns" in spots[0]["text"]
    guard = t.guard(accept=["opaque handle"])
    with torch.no_grad():
        m.up.weight.copy_(torch.randn_like(m.up.weight))
    rows = guard.check()
    assert list(rows["blind_spot"]) == ["compiled"]  # no holder: cannot be checked
    with pytest.raises(gt.StaleGraphError, match="compiled"):
        guard.enforce()



def test_constants_of_a_graph_compiled_in_the_trace_before_its_capture_are_still_tied():
    """SGLang's CPU graph runner: the compiled forward first runs inside the trace but outside
    any capture (it compiles; its extern MKL op reads the packed weight, a tensor without a
    storage, where lineage records), then again inside the capture. Lineage skips the
    storage-less argument (it raised NotImplementedError there), and the constants stay tied."""
    from torch._inductor import config

    from tests.test_differential import MLP
    torch.manual_seed(0)
    m = MLP().eval()
    x = torch.rand(4, 8)
    with torch.no_grad(), config.patch(freezing=True):
        forward = torch.compile(m, backend="inductor")
        keep = []
        with gt.trace(m, strict=True) as t:
            forward(x)  # compiles and runs: outside any capture
            with gt.capture("g") as g:
                keep.append(forward(x))
            keep.append(g)
    guard = t.guard(accept=["opaque handle"])
    assert guard.check().empty
    with torch.no_grad():
        for lin in (m.up, m.down):
            lin.weight.copy_(torch.randn_like(lin.weight))
    e = t.diff().edges
    frozen = e[e["verdict"].astype(str) == "unrefreshed"]
    assert set(frozen["derived_from"].astype(str)) == {"up.weight", "down.weight"}
    # the refusal names the weights each constant derives from
    with pytest.raises(gt.StaleGraphError, match=r"unrefreshed .*derived from (up|down)\.weight"):
        guard.enforce()

# -- Python scalars baked into a graph (Note [baked scalars], graphtrace/scalars.py) ----------

def test_a_hot_swapped_float_scaling_is_a_baked_scalar_in_diff_and_guard(tmp_path):
    m = LoraLike()
    t, keep = _capture(m, torch.rand(2, 8))
    guard = t.guard()
    loaded = gt.load_guard(guard.to_json(tmp_path / "g.json"), m)
    assert t.baked_scalars.records[0][2:] == (0.37, (("", "scaling['default']"),))
    assert guard.check().empty and not [
        b for b in t.diff().meta["blind_spots"] if b["kind"] == "baked scalar"]
    m.scaling["default"] = 2.0  # a LoRA hot-swap: the graph keeps 0.37
    report = t.diff()
    spots = [b for b in report.meta["blind_spots"] if b["kind"] == "baked scalar"]
    assert [b["holder"] for b in spots] == ["scaling['default']"]
    assert "0.37" in spots[0]["text"] and "is now 2.0" in spots[0]["text"]
    assert_agree(t, [guard, loaded], report)
    for g in (guard, loaded):
        rows = _blind(g.check())
        assert list(rows["blind_spot"]) == ["baked scalar"]
        assert list(rows["statuses"]) == ["changed"]
        with pytest.raises(gt.StaleGraphError, match="value changed"):
            g.enforce()


def test_a_float_two_attributes_held_is_called_ambiguous():
    m = LoraLike()
    m.alpha_over_r = 0.37  # the same value under another name
    t, keep = _capture(m, torch.rand(2, 8))
    assert t.baked_scalars.records[0][3] == (("", "alpha_over_r"), ("", "scaling['default']"))
    m.scaling["default"] = 1.5
    text = [b["text"] for b in t.diff().meta["blind_spots"] if b["kind"] == "baked scalar"]
    assert len(text) == 1 and "ambiguous" in text[0] and "alpha_over_r" in text[0]
