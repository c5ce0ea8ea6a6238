"""The case library (issue 15): every buggy variant found with the verdict and owner path its
case states, every fixed variant and negative control clean; mismatches fail loudly."""

from __future__ import annotations

import dataclasses
import gc
from pathlib import Path

import pytest

from graphtrace.demo import runner
from graphtrace.demo.cases import CASES, Expect, get, select, spec
from graphtrace.vocab import STALE_VERDICTS

ALL = [(c.name, v.name) for c in CASES.values() for v in c.variants]


@pytest.fixture(scope="module")
def results():
    gc.disable()  # a freed storage must read as freed without the collector's help
    try:
        return {(c.name, r.variant.name): r for c in CASES.values()
                for r in spec.run_case(c, "builtin")}
    finally:
        gc.enable()


@pytest.mark.parametrize("case,variant", ALL)
def test_every_variant_as_its_case_states(results, case, variant):
    r = results[(case, variant)]
    assert not r.error, r.error
    bad = [f for f in r.findings if not f.ok]
    assert not bad, bad
    stale = r.outcome.report.stale
    found = r.outcome.report.findings
    for f in r.variant.finds:  # each stated finding is in the report
        assert any(f.matches(k, h) for k, h in zip(found["kind"], found["holder"])), f
    if r.variant.kind == "buggy" and r.variant.finds and not any(
            e.verdict in STALE_VERDICTS for e in r.variant.expect):
        assert len(stale) == 0  # a finding, not a stale read (a non-idempotent step)
    elif r.variant.kind == "buggy":
        assert len(stale), "a buggy variant must have stale-like edges"
        expected = {e.verdict for e in r.variant.expect if e.verdict in STALE_VERDICTS}
        assert set(stale["verdict"].astype(str)) == expected
        for e in r.variant.expect:  # each stated owner pattern is on a flagged edge
            if e.verdict in STALE_VERDICTS:
                assert any(e.matches(p) for s in stale["owners"].astype(str)
                           for p in s.split("; ")), e.pattern
    else:
        assert len(stale) == 0
    assert r.outcome.report.errors == [] or len(r.outcome.report.errors) == 0


def test_case_library_has_the_issue_cases():
    refs = " ".join(c.reference for c in CASES.values())
    for ref in ("#48539", "#48438", "#48251", "#41670", "#40390", "#46009", "#50521",
                "#6265", "#27140", "Megatron-LM #6723", "ROCm ATOM #2028", "TRL colocate",
                "SGLang #26194"):
        assert ref in refs
    kinds = {v.kind for c in CASES.values() for v in c.variants}
    assert kinds == {"buggy", "fixed", "control"}
    assert "dangling" in {e.verdict for c in CASES.values() for v in c.variants
                          for e in v.expect}
    assert "unrefreshed" in {e.verdict for c in CASES.values() for v in c.variants
                             for e in v.expect}
    finds = {f.kind for c in CASES.values() for v in c.variants for f in v.finds}
    assert {"non-idempotent step", "carried-over state"} <= finds


def _wrong(case_name: str, variant_name: str, verdict: str):
    case = get(case_name)
    variants = tuple(
        dataclasses.replace(v, expect=(Expect(v.expect[0].pattern, verdict),) + v.expect[1:])
        if v.name == variant_name else v for v in case.variants)
    return dataclasses.replace(case, name=case_name + "-wrong", variants=variants)


def test_a_wrong_expectation_is_a_mismatch():
    case = _wrong("vllm-40390-moe-shuffle", "buggy", "diverged")  # it is stale
    results = spec.run_case(case, "builtin")
    by = {r.variant.name: r for r in results}
    assert not by["buggy"].ok and by["fixed"].ok
    bad = [f for f in by["buggy"].findings if not f.ok]
    assert bad[0].expected == "diverged" and bad[0].found.startswith("stale")
    assert "MISMATCH" in spec.format_case(case, results)


def test_an_unexpected_stale_edge_and_a_wrong_flip_are_mismatches():
    case = get("vllm-46009-moe-padding")
    buggy = case.variant("buggy")
    partial = dataclasses.replace(buggy, expect=buggy.expect[:1], flip="follows")
    r = spec.check(partial, case.run("buggy"))
    by = {f.what: f for f in r}
    assert not by["anything else stale-like"].ok
    assert "w2_weight" in by["anything else stale-like"].found
    assert not [f for f in r if f.what.startswith("flip")][0].ok


def test_cli_exit_status_on_a_mismatch(monkeypatch, capsys):
    wrong = _wrong("sglang-6265-deepseek-w-kc", "buggy", "dangling")
    monkeypatch.setitem(CASES, wrong.name, wrong)
    assert runner.main(["--case", wrong.name, "--out", ""]) == 1
    assert "MISMATCH" in capsys.readouterr().out


def test_cli_case_all_list_and_unknown(capsys):
    assert runner.main(["--case", "control-same-storage", "--case",
                        "sglang-27140-mamba-state", "--quiet"]) == 0
    out = capsys.readouterr().out
    assert "control-same-storage" in out and "every case as expected" in out
    assert runner.main(["--list-cases"]) == 0
    listing = capsys.readouterr().out
    assert all(name in listing for name in CASES)
    assert runner.main(["--case", "no-such-case"]) == 2
    err = capsys.readouterr().err
    assert "unknown case 'no-such-case'" in err and "vllm-48539-machete-act-perm" in err
    assert [c.name for c in select(["all"])] == list(CASES)


def test_bad_case_data_is_refused():
    with pytest.raises(ValueError, match="unknown verdict"):
        Expect("x", "stail")
    with pytest.raises(ValueError, match="must expect a stale-like"):
        spec.Variant("v", "buggy", "", (Expect("x", "stable"),))
    with pytest.raises(ValueError, match="must be clean"):
        spec.Variant("v", "control", "", (Expect("x", "stale"),))


def test_docs_list_the_cases():
    """docs/cases.md holds the generated table, one row per case of the library."""
    text = (Path(__file__).resolve().parents[1] / "docs" / "cases.md").read_text()
    table = spec.markdown_table(CASES.values())
    assert table in text
    assert [line.split("|")[1].strip().strip("`") for line in table.splitlines()[2:]] == list(CASES)
