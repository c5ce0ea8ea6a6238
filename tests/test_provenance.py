"""Provenance: where the captured storage and its replacement were made, and the fix that fits."""

from __future__ import annotations

import gc
import inspect
import threading

import pytest
import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode_stack

import graphtrace as gt
from graphtrace.demo import kernels
from graphtrace.demo import reload as demo_reload
from graphtrace.demo.runner import _perm_edges, run_scenario
from graphtrace.fixes import fix_text
from graphtrace.provenance import ProvenanceMode
from graphtrace.sites import Frame, format_site, parse_site, suggest_fix
from graphtrace.vocab import BEFORE_TRACE, FIXES, NOT_RECORDED


def _line_of(fn, needle: str) -> tuple[str, int]:
    """(file, line) of the first code line (not a comment) of `fn` containing `needle`."""
    lines, first = inspect.getsourcelines(fn)
    for i, text in enumerate(lines):
        if needle in text.split("#")[0]:
            return inspect.getsourcefile(fn), first + i
    raise AssertionError(f"{needle!r} not in {fn.__qualname__}")


ARGSORT = _line_of(kernels.MPLinearKernelBase._perm_from_g_idx, "argsort")
RELOAD_FILE = inspect.getsourcefile(demo_reload)


def _scenario(variant):
    return run_scenario(variant, "new-weights", device="cpu", batch_sizes=[1, 2], seed=0,
                        backend="builtin", n_layers=2, strict=True)


@pytest.fixture(scope="module", params=["unfixed-partial", "unfixed-lambda", "rejected-fix"])
def perm_edges(request):
    res = _scenario(request.param)
    return request.param, _perm_edges(res.report.edges)


def test_perm_sites_are_the_argsort_line_at_load_and_during_the_reload(perm_edges):
    variant, edges = perm_edges
    assert len(edges) == 4  # 2 layers x 2 graphs
    for row in edges.itertuples():
        made, now = parse_site(row.created_at), parse_site(row.live_created_at)
        # the nearest user frame of both is the argsort line of the process-weights code
        assert (made.frames[0].file, made.frames[0].line) == ARGSORT, row.created_at
        assert (now.frames[0].file, now.frames[0].line) == ARGSORT, row.live_created_at
        assert made.frames[1].function == now.frames[1].function == \
            "process_weights_after_loading"
        # the replacement was made during the reload, the captured one at the first load
        assert any(f.file == RELOAD_FILE for f in now.frames), row.live_created_at
        assert not any(f.file == RELOAD_FILE for f in made.frames), row.created_at
        assert made.op == now.op == "aten::_to_copy"  # argsort(...).to(torch.int32)
        assert row.fix == FIXES["read-through-layer"]
        assert row.verdict == ("diverged" if variant == "rejected-fix" else "stale")


def test_fixed_kernel_has_sites_and_no_fix():
    edges = _scenario("fixed").report.edges
    perm = _perm_edges(edges)
    assert set(perm["verdict"].astype(str)) == {"stable"}
    for row in perm.itertuples():
        assert parse_site(row.created_at).frames[0][:2] == ARGSORT
        assert row.live_created_at == "" and row.fix == ""
    unowned = edges[edges["n_owners"] == 0]
    assert set(unowned["created_at"].astype(str)) == {""}


def test_marlin_plain_attributes_get_register_or_copy():
    edges = _scenario("marlin").report.edges
    stale = edges[edges["verdict"].astype(str) == "stale"]
    assert len(stale) and set(stale["fix"].astype(str)) == {fix_text("register-or-copy", "pytorch")}
    workspace = stale[stale["owners"].astype(str).str.endswith("kernel.workspace")]
    zeros = _line_of(kernels.MarlinStyleKernel.process_weights_after_loading, "torch.zeros")
    for text in list(workspace["created_at"]) + list(workspace["live_created_at"]):
        assert parse_site(text).frames[0][:2] == zeros


class _Layer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(4), requires_grad=False)
        self.plain = torch.ones(4) * 2

    def forward(self, x):
        return x * self.w + self.plain


def _capture_and_rebind(layer, *, inside: bool, provenance=None):
    """Capture, then rebind `w` (a new Parameter) and `plain` (a new tensor); diff."""
    with gt.trace(layer, strict=True, provenance=provenance) as t:
        with gt.capture("g") as g:
            layer(torch.ones(4))
        if inside:
            layer.w = torch.nn.Parameter(torch.full((4,), 3.0), requires_grad=False)
            layer.plain = torch.full((4,), 5.0)
    if not inside:
        layer.w = torch.nn.Parameter(torch.full((4,), 3.0), requires_grad=False)
        layer.plain = torch.full((4,), 5.0)
    return t.diff(), g


def test_built_before_the_trace_says_so_and_never_guesses():
    with torch.no_grad():
        report, g = _capture_and_rebind(_Layer(), inside=False)
    e = report.edges
    owned = e[e["n_owners"] > 0]
    assert set(owned["created_at"].astype(str)) == {BEFORE_TRACE}
    stale = owned[owned["verdict"].astype(str) == "stale"]
    assert len(stale) == 2 and set(stale["live_created_at"].astype(str)) == {NOT_RECORDED}
    fixes = dict(zip(stale["owners"].astype(str), stale["fix"].astype(str)))
    # a plain PyTorch model: the stack's own texts (graphtrace.fixes)
    assert report.meta["stack"]["name"] == "pytorch"
    assert fixes == {"w": fix_text("copy-in-place", "pytorch"),
                     "plain": fix_text("register-or-copy", "pytorch")}


def test_replacements_made_in_the_trace_point_at_this_file():
    with torch.no_grad():
        report, g = _capture_and_rebind(_Layer(), inside=True)
    stale = report.stale
    here = inspect.getsourcefile(_capture_and_rebind)
    full = _line_of(_capture_and_rebind, "torch.full((4,), 3.0)")
    site = parse_site(stale[stale["owners"].astype(str) == "w"]["live_created_at"].iloc[0])
    assert site.op == "aten::full" and site.frames[0] == Frame(here, full[1],
                                                               "_capture_and_rebind")


@pytest.mark.parametrize("how", ["argument", "env"])
def test_provenance_off(how, monkeypatch):
    if how == "env":
        monkeypatch.setenv("GRAPHTRACE_PROVENANCE", "0")
    with torch.no_grad():
        report, g = _capture_and_rebind(_Layer(), inside=True,
                                        provenance=False if how == "argument" else None)
    e = report.edges
    assert set(e["created_at"].astype(str)) == {""} == set(e["live_created_at"].astype(str))
    assert set(report.stale["fix"].astype(str)) == {fix_text("copy-in-place", "pytorch"),
                                                    fix_text("register-or-copy", "pytorch")}
    assert report.meta["provenance"] == {"enabled": False}


def test_bad_switch_is_a_clear_error(monkeypatch):
    with pytest.raises(TypeError, match="provenance must be True, False or None"):
        gt.trace(provenance="yes")
    monkeypatch.setenv("GRAPHTRACE_PROVENANCE", "maybe")
    with pytest.raises(ValueError, match="GRAPHTRACE_PROVENANCE"):
        gt.trace()


def _modes():
    return [type(m) for m in _get_current_dispatch_mode_stack()]


class _Other(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def test_the_mode_is_off_the_stack_inside_captures_and_gone_after():
    assert ProvenanceMode.ignore_compile_internals()
    with gt.trace(strict=True) as t:
        assert _modes()[-1] is ProvenanceMode
        with gt.capture("g"):
            assert ProvenanceMode not in _modes()  # capture pays nothing for provenance
            inside = torch.ones(3) + 1
        assert _modes()[-1] is ProvenanceMode
        outside = torch.ones(3) + 1
        with _Other():  # another mode above it: paused in place during the capture
            with gt.capture("h"):
                assert t.provenance.mode.paused
                inside2 = torch.ones(3) * 2
            assert not t.provenance.mode.paused
        assert t.provenance.site_of(inside) is None and t.provenance.site_of(inside2) is None
        assert t.provenance.site_of(outside) is not None
    assert ProvenanceMode not in _modes()


def test_other_threads_are_not_recorded():
    made = {}
    with gt.trace(strict=True) as t:
        th = threading.Thread(target=lambda: made.setdefault("t", torch.ones(3) + 1))
        th.start()
        th.join()
        assert t.provenance.site_of(made["t"]) is None


def test_no_storage_is_kept_alive_and_the_table_stays_small():
    was = gc.isenabled()
    gc.disable()
    try:
        with gt.trace(strict=True) as t:
            x = torch.ones(8) + 1
            ref = StorageWeakRef(x.untyped_storage())
            del x
            assert ref.expired()
            for _ in range(5000):  # loading intermediates: swept as they go
                torch.ones(4) * 2
            assert len(t.provenance.table) < 1500
    finally:
        if was:
            gc.enable()


def test_report_files_round_trip_exactly(tmp_path):
    res = _scenario("rejected-fix")
    res.report.to_csv(tmp_path / "r")
    back = gt.load_report(tmp_path / "r")
    for c in ("created_at", "live_created_at", "fix"):
        assert back.edges[c].astype(str).tolist() == res.report.edges[c].astype(str).tolist()


def test_site_text_round_trip_and_errors():
    text = format_site("aten::zeros", [("/a b/k.py", 3, "f"), ("/x.py", 10, "<lambda>")])
    assert text == "aten::zeros at /a b/k.py:3 in f < /x.py:10 in <lambda>"
    site = parse_site(text)
    assert site.op == "aten::zeros" and site.frames[1] == Frame("/x.py", 10, "<lambda>")
    assert str(site) == text
    assert parse_site("") is None and parse_site(BEFORE_TRACE) is None
    with pytest.raises(ValueError, match="not a creation site"):
        parse_site("somewhere")
    with pytest.raises(ValueError, match="not a frame"):
        parse_site("aten::zeros at k.py in f")


def test_suggest_fix_from_holders_and_verdict():
    moved = "moved"
    assert suggest_fix("stale", [("k.act_perm.keywords['perm']", "attribute", moved)]) == \
        "read-through-layer"
    assert suggest_fix("dangling", [("l.cpu_linear.__closure__['h'].t", "attribute", moved)]) \
        == "read-through-layer"
    assert suggest_fix("dangling", [("k.workspace", "attribute", moved)]) == "recapture"
    assert suggest_fix("stale", [("l.w", "parameter", moved)]) == "copy-in-place"
    assert suggest_fix("stale", [("l.s", "attribute", moved)]) == "register-or-copy"
    assert suggest_fix("diverged", [("l.p", "parameter", "holds"),
                                    ("k.f.args[0]", "attribute", moved)]) == "read-through-layer"
    assert suggest_fix("stable", [("l.w", "parameter", "holds")]) == ""


class _Made(torch.nn.Module):
    """Attributes made by ops that return a tuple of views, a named tuple (torch.return_types)
    and a list, and one view of another attribute (a view is not a creation)."""

    def __init__(self):
        super().__init__()
        base = torch.arange(12.0).reshape(3, 4)
        self.base = base
        self.parts = torch.unbind(base.clone(), 0)                    # tuple output
        self.top = torch.max(base.clone(), dim=0).values              # torch.return_types.max
        self.summed = torch._foreach_add([base.clone(), base.clone()], 1.0)  # list output
        self.row = base[1]                                            # a view of base

    def forward(self, x):
        return (x + self.parts[0] + self.top + self.summed[1] + self.row).sum()


def test_sites_of_tensors_made_by_ops_returning_containers():
    with gt.trace() as t, torch.no_grad():
        made = _Made()
        t.watch(made)
        with gt.capture("g", emulate=False):
            made(torch.zeros(4))
    edges = t.diff().edges
    site = {str(o): parse_site(s) for o, s in zip(edges["owners"], edges["created_at"])
            if str(o)}
    expect = {
        "parts[0]; parts[1]; parts[2]": ("aten::clone", "self.parts"),  # unbind's are views
        "top": ("aten::max.dim", "self.top"),
        "summed[1]": ("aten::_foreach_add.Scalar", "self.summed"),
        "base; row": ("aten::arange", "base = torch.arange"),  # row, a view: base's site
    }
    assert set(expect) <= set(site), sorted(site)
    for owners, (op, line) in expect.items():
        assert site[owners].op == op, (owners, site[owners])
        assert (site[owners].frames[0].file, site[owners].frames[0].line) == \
            _line_of(_Made.__init__, line), (owners, site[owners])
