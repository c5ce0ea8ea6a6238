"""vLLM 0.34's in-place refill helpers and its direct reload, through vLLM's own functions.

0.34 refills tensors derived from the weights in place (``refill_derived``,
``FusedMoEExperts.keep_constants``) and can reload weights into their old storages
(``VLLM_RELOAD_MODE=direct``: ``begin_direct_reload`` views each re-laid-out parameter back to
its checkpoint layout, the loaders write, ``finish_direct_reload`` re-runs
``process_weights_after_loading``). A refilled tensor must come out fresh and one left alone
unrefreshed; a parameter that post-load processing leaves in another view of its storage than
at capture is stale, judged by the view the graph reads (Note [re-laid views] in
graphtrace/verdict.py). No engine runs on this CPU with 0.34 (a CUDA build): the layers are
plain ``nn.Module``s, their post-load processing a real ``QuantizeMethodBase`` calling vLLM's
``replace_parameter``, loaded by vLLM's ``default_weight_loader``; the experts object is a
small class using the real ``FusedMoEExperts.keep_constants`` (a real experts class needs
a device and a MoE config). Runs under ``make test-vllm-contract`` (0.34) and skips on
releases without these functions (the release table's ``fix_api``: 0.32 and 0.33).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn

import graphtrace as gt
from tests.test_differential import assert_agree

pytestmark = pytest.mark.vllm


@pytest.fixture(autouse=True)
def _release_has_them():
    from graphtrace.vllm import releases

    rel = releases.release()
    if not (rel.fix_api["refill_derived"] and rel.fix_api["direct_reload"]):
        pytest.skip(f"vLLM {rel.version} has no refill_derived / direct reload (0.34+)")


def _judged(t, guard, model, holder: str, tmp_path):
    """(verdicts, report) of `holder`'s edges, `guard` and one loaded from its JSON agreeing
    with the diff."""
    loaded = gt.load_guard(guard.to_json(tmp_path / "guard.json"), model)
    report = t.diff()
    assert_agree(t, [guard, loaded], report)
    rows = report.edges[report.edges["owners"].astype(str) == holder]
    assert len(rows), f"no edge owned by {holder}"
    return set(rows["verdict"].astype(str)), report


# -- refill_derived / keep_constants: the in-place fix pattern ----------------------------

def _experts_class():
    from vllm.model_executor.layers.fused_moe.modular_kernel import FusedMoEExperts

    class Experts:
        """An experts object as post-load processing builds one each run: its constants
        are new tensors; 0.34's keep_constants points them at tensors kept on the layer."""

        kept_constants = ("alpha",)
        keep_constants = FusedMoEExperts.keep_constants  # vLLM's own

        def __init__(self, layer):
            self.alpha = layer.weight.sum(0) * 2

    return Experts


class Derived(nn.Module):
    """A weight and three tensors derived from it by post-load processing: `scale`
    refilled with refill_derived, `experts.alpha` kept with keep_constants (unless
    `keep` is False), `left` computed once and left alone."""

    def __init__(self, keep: bool = True):
        super().__init__()
        self.weight = nn.Parameter(torch.rand(4, 4), requires_grad=False)
        self.keep = keep
        self.experts_cls = _experts_class()

    def process(self):
        from vllm.model_executor.utils import refill_derived

        refill_derived(self, "scale", self.weight.abs().amax(1) + 1)
        if not hasattr(self, "left"):
            self.left = self.weight.abs().amax(1) + 1
        self.experts = self.experts_cls(self)
        if self.keep:
            self.experts.keep_constants(self)

    def forward(self, x):
        return (x @ self.weight) * self.scale * self.left + self.experts.alpha


def _traced(model, x):
    """The trace, the emulated graph and its output tensor (rewritten by each replay)."""
    with torch.no_grad(), gt.trace(model, strict=True) as t:
        model.process()
        with gt.capture("decode") as g:
            out = model(x)
    return t, g, out


def test_refill_derived_and_keep_constants_come_out_fresh(tmp_path):
    m, x = Derived(), torch.rand(2, 4)
    t, g, out = _traced(m, x)
    guard = t.guard()
    with torch.no_grad():
        m.weight.copy_(torch.rand(4, 4))  # the loader writes in place
        m.process()                        # post-load processing runs again
    assert _judged(t, guard, m, "scale", tmp_path)[0] == {"stable"}
    verdicts, report = _judged(t, guard, m, "_experts_alpha; experts.alpha", tmp_path)
    assert verdicts == {"stable"}
    left = report.edges[report.edges["owners"].astype(str) == "left"]
    assert set(left["verdict"].astype(str)) == {"unrefreshed"}
    assert "refill_derived" in left["fix"].iloc[0]  # the fix names 0.34's pattern
    with torch.no_grad():
        w = m.weight
        right = (x @ w) * (w.abs().amax(1) + 1) ** 2 + w.sum(0) * 2  # from the new weight
        g.replay()
        assert not torch.allclose(out, right)  # the replay reads the old `left` ...
        m.left.copy_(w.abs().amax(1) + 1)
        g.replay()
        assert torch.allclose(out, right)  # ... and nothing else old


def test_experts_rebuilt_without_keep_constants_is_stale_and_the_fix_names_it(tmp_path):
    m, x = Derived(keep=False), torch.rand(2, 4)
    t, g, out = _traced(m, x)
    guard = t.guard()
    with torch.no_grad():
        m.weight.copy_(torch.rand(4, 4))
        m.process()  # a new experts object: its alpha is a new tensor
    verdicts, report = _judged(t, guard, m, "experts.alpha", tmp_path)
    assert verdicts == {"stale"}
    fix = report.edges[report.edges["owners"].astype(str) == "experts.alpha"]["fix"].iloc[0]
    assert "keep_constants" in fix and "refill_derived" in fix, fix


# -- direct reload: a parameter re-laid in its own storage (Note [re-laid views]) ----------

def _relay_method(once: bool):
    from vllm.model_executor.layers.quantization.base_config import QuantizeMethodBase
    from vllm.model_executor.utils import replace_parameter

    class Transpose(QuantizeMethodBase):
        """Post-load processing that lays the checkpoint weight (out, in) out as (in, out),
        in its own storage (replace_parameter under direct reload). `once`: with a one-shot
        guard of its own, which a reload's finish does not clear (the bug)."""

        def create_weights(self, layer, *args, **kwargs):
            pass

        def apply(self, layer, *args, **kwargs):
            raise NotImplementedError

        def process_weights_after_loading(self, layer):
            if once and getattr(layer, "_laid_out", False):
                return
            replace_parameter(layer, "weight", layer.weight.t().contiguous())
            layer._laid_out = True

    return Transpose()


class Linear(nn.Module):
    def __init__(self, once: bool):
        super().__init__()
        self.weight = nn.Parameter(torch.rand(8, 4), requires_grad=False)  # checkpoint layout
        self.quant_method = _relay_method(once)

    def forward(self, x):
        return x @ self.weight  # the runtime layout (4, 8)


_CONFIG = SimpleNamespace(word_embeddings_untied_by_checkpoint=False, quantization=None)


def _direct_reload(model, new):
    from vllm.model_executor.model_loader.reload.direct import (
        begin_direct_reload,
        finish_direct_reload,
    )
    from vllm.model_executor.model_loader.weight_utils import default_weight_loader

    begin_direct_reload(model)
    default_weight_loader(model.layer.weight, new)
    finish_direct_reload(model, _CONFIG, torch.device("cpu"))


@pytest.mark.parametrize("once", [False, True],
                         ids=["laid-out-as-captured", "left-in-checkpoint-view"])
def test_direct_reload_is_judged_by_the_view_the_graph_reads(once, monkeypatch, tmp_path):
    from vllm.model_executor.model_loader.reload.direct import direct_reload_enabled
    from vllm.model_executor.model_loader.utils import process_weights_after_loading

    monkeypatch.setenv("VLLM_RELOAD_MODE", "direct")
    assert direct_reload_enabled()
    model = nn.Sequential()
    model.add_module("layer", Linear(once))
    process_weights_after_loading(model, _CONFIG, torch.device("cpu"))  # cold start
    storage = model.layer.weight.untyped_storage()._cdata
    assert tuple(model.layer.weight.shape) == (4, 8)
    x = torch.rand(2, 4)
    with torch.no_grad(), gt.trace(model, strict=True) as t:
        with gt.capture("decode") as g:
            out = model(x)
    guard = t.guard()
    new = torch.rand(8, 4)
    _direct_reload(model, new)
    assert model.layer.weight.untyped_storage()._cdata == storage  # addresses kept
    with torch.no_grad():
        g.replay()
    verdicts, report = _judged(t, guard, model, "layer.weight", tmp_path)
    notes = [b["text"] for b in report.meta["blind_spots"] if "re-laid" in b["text"]]
    if not once:  # laid out again as at capture: the graph reads the new weights right
        assert torch.allclose(out, x @ new.t())
        assert verdicts == {"stable"} and not notes
        assert guard.check().empty
        return
    # left in the checkpoint view (8, 4) of the same storage: the graph reads checkpoint
    # bytes through its runtime view (4, 8)
    assert tuple(model.layer.weight.shape) == (8, 4)
    assert not torch.allclose(out, x @ new.t())
    assert verdicts == {"stale"}
    assert set(report.stale["impact"].astype(str)) == {"manifest"}
    assert notes and "the graph reads float32 (4, 8) stride (8, 1) offset 0" in notes[0] \
        and "the owner now holds float32 (8, 4) stride (4, 1) offset 0" in notes[0], notes
    problems = guard.check()
    assert "the owner now holds float32 (8, 4)" in problems["note"].iloc[0]
    with pytest.raises(gt.StaleGraphError, match="re-laid in the captured storage"):
        guard.enforce()
