"""Fix texts chosen by the stack a trace observed (graphtrace.fixes, Note [fix texts]; issue
42, issue 36 item 4): a plain transformers model's report names no vLLM API, in `t.diff()`
and in `graphtrace report DIR`; each vLLM release row is chosen for its releases; an unknown
stack or release gets the neutral text; an older saved report still loads, neutral."""

from __future__ import annotations

import sys
import types

import pytest
import torch
from torch import nn

import graphtrace as gt
from graphtrace.fixes import FIX_TEXTS, LEGACY_TEXTS, Stack, detect_stack, fix_text
from graphtrace.vocab import FIX_KINDS, FIXES

VLLM_WORDS = ("replace_parameter", "prefer_copy", "process_weights_after_loading", "vllm",
              "refill_derived", "keep_constants", "VLLM_RELOAD_MODE")
SGLANG_WORDS = ("sglang", "update_weights_from")


def _named(text: str, words) -> list[str]:
    return [w for w in words if w.lower() in text.lower()]


def _reloaded_with_assign(traced_llama):
    model, t, keep = traced_llama
    new = {k: torch.rand_like(v) for k, v in model.state_dict().items()}
    model.load_state_dict(new, assign=True)  # new tensors under the old names
    return model, t, keep


def test_a_transformers_llama_reloaded_with_assign_names_no_vllm_api(tmp_path, capsys,
                                                                    traced_llama):
    import transformers

    from graphtrace.cli import main

    model, t, keep = _reloaded_with_assign(traced_llama)
    report = t.diff()
    assert report.meta["stack"] == {"name": "transformers",
                                    "release": transformers.__version__,
                                    "source": "model classes"}
    stale = report.stale
    assert len(stale) and set(stale["verdict"].astype(str)) == {"stale"}
    fixes = set(stale["fix"].astype(str))
    assert fixes == {fix_text("copy-in-place", "transformers")}
    text = fixes.pop()
    assert "load_state_dict" in text and "assign=True" in text and "swap_tensors" in text
    assert _named(text, VLLM_WORDS + SGLANG_WORDS) == []
    folder = tmp_path / "out"
    report.to_csv(folder)
    saved = gt.load_report(folder).meta["stack"]  # kept when saved
    assert Stack.from_json(saved) == detect_stack([model]) == Stack(**report.meta["stack"])
    assert Stack.from_json(None) is None and Stack.from_json({"name": "jax"}) is None
    main(["report", str(folder)])
    out = capsys.readouterr().out
    assert "load_state_dict" in out and "fix:" in out
    assert _named(out, VLLM_WORDS + SGLANG_WORDS) == []
    del keep


def test_a_plain_pytorch_model_gets_the_pytorch_texts():
    lin = nn.Linear(4, 4)
    assert detect_stack([lin]) == Stack("pytorch", torch.__version__, "none")
    assert fix_text("copy-in-place", detect_stack([lin])) == \
        fix_text("copy-in-place", "transformers")


@pytest.mark.parametrize("row", range(len(FIX_TEXTS)))
def test_each_row_is_chosen_for_its_releases(row):
    r = FIX_TEXTS[row]
    lo = r.since or (0, 1)
    inside = [lo, (lo[0], lo[1], 7)]
    if r.until is not None:
        inside.append((r.until[0], r.until[1] - 1, 3) if r.until[1] else lo)
    for stack in r.stacks:
        for release in inside:
            text = ".".join(map(str, release)) + "+cpu"
            assert fix_text(r.kind, Stack(stack, text)) == r.text, (stack, text)
    if r.until is not None:  # the next row's range, not this one's
        above = ".".join(map(str, r.until))
        assert fix_text(r.kind, Stack(r.stacks[0], above)) != r.text


@pytest.mark.parametrize("release,has,lacks", [
    ("0.32.0", ["prefer_copy=True"], ["refill_derived"]),
    ("0.33.0", ["replace_parameter(layer, name, new)"], ["prefer_copy", "refill_derived"]),
    ("0.33.1", ["replace_parameter(layer, name, new)"], ["prefer_copy"]),
    ("0.34.0", ["VLLM_RELOAD_MODE=direct"], ["prefer_copy"]),
    ("0.35.2", ["VLLM_RELOAD_MODE=direct"], ["prefer_copy"]),
])
def test_vllm_copy_in_place_by_release(release, has, lacks):
    text = fix_text("copy-in-place", Stack("vllm", release))
    assert all(w in text for w in has) and not any(w in text for w in lacks), text


def test_vllm_derived_tensors_by_release():
    assert "refill_derived" in fix_text("recompute-in-place", Stack("vllm", "0.34.0"))
    assert "keep_constants" in fix_text("recompute-in-place", Stack("vllm", "0.34.0"))
    assert "refill_derived" in fix_text("register-or-copy", Stack("vllm", "0.34.0"))
    older = fix_text("recompute-in-place", Stack("vllm", "0.33.0"))
    assert "refill_derived" not in older and "process_weights_after_loading" in older
    assert fix_text("register-or-copy", Stack("vllm", "0.33.0")) == FIXES["register-or-copy"]


@pytest.mark.parametrize("stack", [Stack("vllm", ""), Stack("vllm", "nightly"),
                                   Stack("vllm", "0.20.0"), Stack("tensorrt", "1.0"), None])
def test_an_unknown_stack_or_release_gets_the_neutral_text(stack):
    for kind in FIX_KINDS:
        assert fix_text(kind, stack) == FIXES[kind]
        assert _named(FIXES[kind], VLLM_WORDS + SGLANG_WORDS) == []
    assert fix_text("", stack) == ""
    with pytest.raises(ValueError, match="unknown fix kind 'copy'"):
        fix_text("copy", stack)


def test_no_text_names_another_stacks_api():
    for r in FIX_TEXTS:
        if "vllm" not in r.stacks:
            assert _named(r.text, VLLM_WORDS) == [], r
        if "sglang" not in r.stacks:
            assert _named(r.text, SGLANG_WORDS) == [], r
        if set(r.stacks) & {"vllm", "sglang"}:
            assert "assign=True" not in r.text and "swap_tensors" not in r.text, r
    assert "update_weights_from_tensor" in fix_text("recompute-in-place", "sglang")
    assert "param.data.copy_" in fix_text("copy-in-place", "sglang")


def test_the_stack_comes_from_model_classes_then_from_the_engine_imported(monkeypatch):
    """A module class from a library's package names that stack (the release from the
    imported package); without one, an engine's model executor imported in this process
    does; else plain PyTorch."""
    vllm_layer = type("RowParallelLinear", (nn.Module,),
                      {"__module__": "vllm.model_executor.layers.linear"})
    model = nn.Sequential(nn.Linear(2, 2), vllm_layer())
    monkeypatch.delitem(sys.modules, "vllm", raising=False)
    assert detect_stack([model]) == Stack("vllm", "", "model classes")
    assert fix_text("copy-in-place", detect_stack([model])) == FIXES["copy-in-place"]
    monkeypatch.setitem(sys.modules, "vllm", types.SimpleNamespace(__version__="0.33.0"))
    assert detect_stack([model]) == Stack("vllm", "0.33.0", "model classes")
    plain = nn.Linear(2, 2)
    assert detect_stack([plain]).name == "pytorch"
    monkeypatch.setitem(sys.modules, "sglang", types.SimpleNamespace(__version__="0.5.6"))
    monkeypatch.setitem(sys.modules, "sglang.srt", types.ModuleType("sglang.srt"))
    assert detect_stack([plain]) == Stack("sglang", "0.5.6", "imported")


def test_an_older_report_without_the_stack_loads_with_the_neutral_text(tmp_path, traced_llama):
    model, t, keep = _reloaded_with_assign(traced_llama)
    report = t.diff()
    edges = report.edges.copy()
    legacy = next(iter(LEGACY_TEXTS))
    edges["fix"] = [legacy if f else "" for f in edges["fix"].astype(str)]
    meta = {k: v for k, v in report.meta.items() if k != "stack"}
    older = gt.Report.from_frames(report.accesses, report.storages, report.owners, edges, meta)
    older.to_csv(tmp_path / "old")
    loaded = gt.load_report(tmp_path / "old")
    fixes = set(loaded.stale["fix"].astype(str))
    assert fixes == {FIXES["copy-in-place"]}
    # a report that records its stack keeps its texts as written
    kept = gt.Report.from_frames(report.accesses, report.storages, report.owners, edges,
                                 report.meta)
    kept.to_csv(tmp_path / "new")
    assert set(gt.load_report(tmp_path / "new").stale["fix"].astype(str)) == {legacy}
    del keep


def test_docs_hold_the_table():
    from pathlib import Path

    from graphtrace.fixes import markdown_table

    docs = (Path(__file__).parent.parent / "docs" / "provenance.md").read_text()
    assert markdown_table() in docs, "docs/provenance.md: paste python -m graphtrace.fixes " \
                                     "--markdown"


# The vLLM rows of the fix table and graphtrace.vllm.releases' `fix_api` facts (checked against
# each release's source by the contract test) are two tables of one fact: they must agree.
FIX_API_WORDS = {"replace_parameter.prefer_copy": ("copy-in-place", "prefer_copy"),
                 "refill_derived": ("recompute-in-place", "refill_derived"),
                 "keep_constants": ("register-or-copy", "keep_constants"),
                 "direct_reload": ("copy-in-place", "VLLM_RELOAD_MODE=direct")}


@pytest.mark.parametrize("fact", sorted(FIX_API_WORDS))
def test_the_vllm_fix_texts_agree_with_each_releases_fix_api(fact):
    from graphtrace.vllm.releases import RELEASES

    kind, word = FIX_API_WORDS[fact]
    for version, row in RELEASES.items():
        text = fix_text(kind, Stack("vllm", f"{version}.0"))
        assert (word in text) == row.fix_api[fact], (version, fact, text)
