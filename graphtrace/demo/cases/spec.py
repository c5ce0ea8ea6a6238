"""What a case states, how it is checked, and the tables it prints.

A case (one module under `graphtrace.demo.cases`) is a small reproduction of a published
stale-read bug: a tiny model following the real code's holder pattern, a buggy and a fixed
variant, and, stated as data, what graphtrace must find for each variant:

* `Expect(pattern, verdict)`: every edge whose owners include a path matching `pattern`
  (`*` matches anything, everything else literally) has exactly `verdict`, and there is at
  least one such edge;
* nothing else is stale-like (`vocab.STALE_VERDICTS`): a stale-like edge no stale-like
  expectation covers is a mismatch, so a fixed variant or a negative control passes only
  when the report is clean;
* `Finds(kind, pattern)`: the report's findings (`report.findings`: lineage's dangling
  sources and non-idempotent steps) hold one of `kind` whose holder matches `pattern`; a
  finding of a reported kind (`FOUND_KINDS`) no `Finds` covers is a mismatch, so controls
  must be free of them too;
* `flip`: after the reload, the live tensor the eager model now reads is perturbed in
  place and the captured graphs replayed: "frozen" means no replayed row changes (the graph
  reads a storage the engine no longer updates), "follows" means every row changes.

`check` compares a variant's `Outcome` (the report and the flip test) with its expectations
and returns one `Finding` per line of the table `format_case` prints.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Callable, Iterable

from graphtrace.vocab import FINDING_KINDS, STALE_VERDICTS, VERDICTS

__all__ = [
    "KINDS", "FLIPS", "RELOADS", "FOUND_KINDS", "Expect", "Finds", "Variant", "buggy_and_fixed", "control", "Case",
    "Outcome", "Finding", "VariantResult", "check", "run_variant", "run_case", "format_case",
    "summary_line", "markdown_table"
]

KINDS = ("buggy", "fixed", "control")
# findings a case must state when it has them (a `released source` is information only)
FOUND_KINDS = ("dangling source", "non-idempotent step", "carried-over state")
FLIPS = ("frozen", "follows")
RELOADS = {
    "vllm-layerwise": "vLLM's layerwise reload (restore, load, process, copy back into the "
                      "kernel tensors); vLLM's own code when installed",
    "vllm-inplace": "load_weights into the live parameters, then process_weights_after_loading "
                    "again (vLLM's DefaultModelLoader.load_weights; the RL frameworks' refit)",
    "sglang-update": "SGLang update_weights: load_weights into the live parameters, then "
                     "post_load_weights",
    "memory-saver": "a memory-saver pause/resume of the engine's state buffers (no weights)",
    "inplace-refit": "an RL refit that copies every parameter into the live ones in place, "
                     "with no process step after it (Megatron-LM)",
    "load-weights-only": "an RL client's model.load_weights(...) into the live parameters, "
                         "with no process_weights_after_loading after it (TRL's colocate sync)",
    "sync-process": "a weight sync that loads into the live parameters and runs the process "
                    "step again, several times (ROCm ATOM)",
    "memory-saver-update": "colocated RL: pause the engine (the memory saver releases the "
                           "weights region; it comes back zeroed, written by no torch op), "
                           "resume, load_weights into the live parameters, process again",
    "vllm-layerwise+attention": "vLLM's layerwise reload, then the attention layers' "
                                "process_weights_after_loading on the live layer (deferred)",
}


@dataclass(frozen=True)
class Expect:
    """Edges with an owner path matching `pattern` must all have `verdict`."""

    pattern: str
    verdict: str

    def __post_init__(self):
        if self.verdict not in VERDICTS:
            raise ValueError(f"Expect({self.pattern!r}): unknown verdict {self.verdict!r} "
                             f"(verdicts are {', '.join(VERDICTS)})")

    def matches(self, path: str) -> bool:
        return _glob(self.pattern).fullmatch(path) is not None


@dataclass(frozen=True)
class Finds:
    """The report's findings hold one of `kind` whose holder matches `pattern`."""

    kind: str
    pattern: str

    def __post_init__(self):
        if self.kind not in FINDING_KINDS:
            raise ValueError(f"Finds({self.kind!r}): unknown finding kind (kinds are "
                             f"{', '.join(FINDING_KINDS)})")

    def matches(self, kind: str, holder: str) -> bool:
        return kind == self.kind and any(_glob(self.pattern).fullmatch(p) is not None
                                         for p in holder.split("; "))


@dataclass(frozen=True)
class Variant:
    """One variant of a case: what the code does, and what graphtrace must report."""

    name: str
    kind: str  # buggy | fixed | control
    summary: str
    expect: tuple[Expect, ...] = ()
    flip: str | None = None  # frozen | follows | None (no flip test)
    finds: tuple[Finds, ...] = ()

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"variant {self.name!r}: kind must be one of {KINDS}")
        if self.flip is not None and self.flip not in FLIPS:
            raise ValueError(f"variant {self.name!r}: flip must be one of {FLIPS} or None")
        if self.kind == "buggy" and not any(e.verdict in STALE_VERDICTS for e in self.expect) \
                and not any(f.kind in FOUND_KINDS for f in self.finds):
            raise ValueError(f"variant {self.name!r}: a buggy variant must expect a "
                             "stale-like verdict or a finding somewhere")
        if self.kind == "fixed" and self.finds:
            raise ValueError(f"variant {self.name!r}: a fixed variant must be clean")
        if self.kind != "buggy" and any(e.verdict in STALE_VERDICTS for e in self.expect):
            raise ValueError(f"variant {self.name!r}: a {self.kind} variant must be clean")


def buggy_and_fixed(buggy: str, fixed: str, expect: dict[str, str],
                    fixed_stable: Iterable[str] | None = None, *, buggy_name: str = "buggy",
                    flip: bool = True) -> tuple[Variant, Variant]:
    """A case's usual two variants, with their summaries `buggy` and `fixed`.

    The buggy variant expects `expect` (owner pattern -> verdict); the fixed one expects each
    pattern of `fixed_stable` (default: those of `expect`) `stable`. With `flip`, the flip
    test leaves the buggy graphs frozen and the fixed ones follow.
    """
    stable = expect if fixed_stable is None else fixed_stable
    return (Variant(buggy_name, "buggy", buggy, tuple(Expect(p, v) for p, v in expect.items()),
                    flip="frozen" if flip else None),
            Variant("fixed", "fixed", fixed, tuple(Expect(p, "stable") for p in stable),
                    flip="follows" if flip else None))


def control(name: str, summary: str, stable: Iterable[str]) -> Variant:
    """A negative control, `summary`: values go wrong in the very storage the graphs read,
    so each pattern of `stable` stays `stable`, nothing is stale-like, and the graphs
    follow the flip test."""
    return Variant(name, "control", summary, tuple(Expect(p, "stable") for p in stable),
                   flip="follows")


@dataclass(frozen=True)
class Case:
    """A published bug: reference, what was rebound and what held it, the fix, variants.

    `run(variant_name, backend)` builds the case's model, captures, reloads and diffs, and
    returns an `Outcome`.
    """

    name: str
    reference: str  # e.g. "vLLM #48539"
    source: str  # the file/class in the real code
    rebound: str  # what was rebound, and what held it
    fix: str
    reload: str  # a key of RELOADS
    variants: tuple[Variant, ...]
    run: Callable[..., "Outcome"] = field(repr=False, compare=False)
    note: str = ""  # e.g. how the verdict differs on CUDA

    def __post_init__(self):
        if self.reload not in RELOADS:
            raise ValueError(f"case {self.name!r}: reload must be one of {sorted(RELOADS)}")
        names = [v.name for v in self.variants]
        if len(set(names)) != len(names):
            raise ValueError(f"case {self.name!r}: duplicate variant names")

    def variant(self, name: str) -> Variant:
        for v in self.variants:
            if v.name == name:
                return v
        raise KeyError(f"case {self.name!r} has no variant {name!r} "
                       f"(variants: {', '.join(v.name for v in self.variants)})")

    @property
    def uses_vllm_reload(self) -> bool:
        return self.reload.startswith("vllm-layerwise")


@dataclass
class Outcome:
    """What one variant's run produced."""

    report: object  # graphtrace Report
    backend: str  # which reload code ran ("vllm", "builtin", or the case's own)
    rows: int = 0  # replayed output rows (0 when the graphs are not replayable)
    flip_changed: int | None = None  # rows changed by the flip test
    flip_target: str = ""
    replay_eq_eager: int | None = None


@dataclass(frozen=True)
class Finding:
    """One line of a case's table: expected vs found."""

    what: str
    expected: str
    found: str
    ok: bool


@dataclass
class VariantResult:
    case: str
    variant: Variant
    outcome: Outcome | None
    findings: list[Finding]
    error: str = ""

    @property
    def ok(self) -> bool:
        return not self.error and all(f.ok for f in self.findings)


_GLOBS: dict[str, re.Pattern] = {}


def _glob(pattern: str) -> re.Pattern:
    """`*` matches any run of characters; everything else (dots, brackets) literally."""
    rx = _GLOBS.get(pattern)
    if rx is None:
        rx = _GLOBS[pattern] = re.compile(".*".join(re.escape(p) for p in pattern.split("*")))
    return rx


def _owner_lists(edges) -> list[list[str]]:
    return [[p for p in str(s).split("; ") if p] for s in edges["owners"].astype(str)]


def check(variant: Variant, outcome: Outcome) -> list[Finding]:
    """Compare a variant's outcome with what it states."""
    edges = outcome.report.edges
    owners = _owner_lists(edges)
    verdicts = [str(v) for v in edges["verdict"].astype(str)]
    findings = []
    covered = [False] * len(edges)
    for exp in variant.expect:
        hit = [i for i, paths in enumerate(owners) if any(exp.matches(p) for p in paths)]
        found = sorted({verdicts[i] for i in hit})
        findings.append(Finding(exp.pattern, exp.verdict,
                                ", ".join(f"{v} ({sum(verdicts[i] == v for i in hit)})"
                                          for v in found) or "no edge",
                                found == [exp.verdict]))
        if exp.verdict in STALE_VERDICTS:
            for i in hit:
                covered[i] = True
    others = [i for i, v in enumerate(verdicts) if v in STALE_VERDICTS and not covered[i]]
    other_paths = sorted({p for i in others for p in owners[i]} or
                         ({"(unowned)"} if others else set()))
    findings.append(Finding("anything else stale-like", "none",
                            f"{len(others)} edges: " + ", ".join(other_paths[:3])
                            + (" ..." if len(other_paths) > 3 else "") if others else "none",
                            not others))
    found = getattr(outcome.report, "findings", None)
    kinds = [] if found is None else found["kind"].tolist()
    holders = [] if found is None else found["holder"].tolist()
    hit_found = [False] * len(kinds)
    for exp in variant.finds:
        hit = [i for i, (k, h) in enumerate(zip(kinds, holders)) if exp.matches(k, h)]
        for i in hit:
            hit_found[i] = True
        findings.append(Finding(f"finding: {exp.kind} on {exp.pattern}", "found",
                                f"{len(hit)} found" if hit else "none", bool(hit)))
    extra = sorted({f"{kinds[i]} on {holders[i]}" for i in range(len(kinds))
                    if kinds[i] in FOUND_KINDS and not hit_found[i]})
    findings.append(Finding("any other finding", "none",
                            ", ".join(extra[:3]) + (" ..." if len(extra) > 3 else "")
                            if extra else "none", not extra))
    if variant.flip is not None:
        rows = outcome.rows
        want = 0 if variant.flip == "frozen" else rows
        got = outcome.flip_changed
        findings.append(Finding(f"flip test: rows changed ({variant.flip})", f"{want}/{rows}",
                                "not run" if got is None else f"{got}/{rows}",
                                got is not None and rows > 0 and got == want))
    return findings


def run_variant(case: Case, variant: Variant, backend: str = "auto") -> VariantResult:
    """Run one variant and check it; an exception is a failed variant, with its message."""
    try:
        outcome = case.run(variant.name, backend)
    except Exception as e:  # reported as a mismatch with the reason, never a bare traceback
        return VariantResult(case.name, variant, None, [],
                             error=f"{type(e).__name__}: {e}")
    return VariantResult(case.name, variant, outcome, check(variant, outcome))


def run_case(case: Case, backend: str = "auto") -> list[VariantResult]:
    return [run_variant(case, v, backend) for v in case.variants]


def format_case(case: Case, results: list[VariantResult], width: int = 100) -> str:
    """The table a case prints: per variant, expected vs found, then the verdict line."""
    lines = [f"── {case.name} ── {case.reference}: {case.source}",
             f"  rebound: {case.rebound}",
             f"  fix:     {case.fix}",
             f"  reload:  {RELOADS[case.reload]}"]
    rows = []
    for r in results:
        head = f"{r.variant.name} ({r.variant.kind})"
        if r.error:
            rows.append((head, "run", "ok", r.error, "MISMATCH"))
            continue
        for i, f in enumerate(r.findings):
            rows.append((head if i == 0 else "", f.what, f.expected, f.found,
                         "ok" if f.ok else "MISMATCH"))
    w = [max(len(h), *(len(row[i]) for row in rows)) for i, h in
         enumerate(("variant", "owner path pattern / check", "expected", "found", "result"))]
    w[1] = min(w[1], 64)
    fmt = "  {:<%d}  {:<%d}  {:<%d}  {:<%d}  {}" % tuple(w[:4])

    def clip(s, n):
        return s if len(s) <= n else "..." + s[-(n - 3):]

    lines.append(fmt.format("variant", "owner path pattern / check", "expected", "found",
                            "result"))
    for row in rows:
        lines.append(fmt.format(row[0], clip(row[1], w[1]), *row[2:]))
    backends = sorted({r.outcome.backend for r in results if r.outcome is not None})
    ok = all(r.ok for r in results)
    lines.append(f"  reload code used: {', '.join(backends) or '-'}")
    if case.note:
        lines.append(f"  note: {case.note}")
    lines.append(f"  → {'as expected' if ok else 'MISMATCH'}: " + "; ".join(
        f"{r.variant.name} {'ok' if r.ok else 'MISMATCH'}" for r in results))
    return "\n".join(lines)


def summary_line(case: Case, results: list[VariantResult]) -> str:
    found = []
    for r in results:
        if r.outcome is None:
            found.append(f"{r.variant.name}: error")
            continue
        stale = r.outcome.report.stale
        counts = stale["verdict"].astype(str).value_counts()
        kinds = getattr(r.outcome.report, "findings", None)
        kinds = [] if kinds is None else [k for k in kinds["kind"] if k in FOUND_KINDS]
        found.append(f"{r.variant.name}: " + (", ".join(
            [f"{counts[v]} {v}" for v in STALE_VERDICTS if v in counts]
            + [f"{kinds.count(k)} {k}" for k in FOUND_KINDS if k in kinds]) or "clean"))
    ok = all(r.ok for r in results)
    return f"{case.name:<34} {'ok' if ok else 'MISMATCH':<8} " + "; ".join(found)


def markdown_table(cases) -> str:
    """The table of cases in docs/cases.md, generated from the case modules' data."""
    lines = ["| case | reference | what is rebound, what held it | variants: expected |",
             "|---|---|---|---|"]
    for c in cases:
        parts = []
        for v in c.variants:
            stale = sorted({e.verdict for e in v.expect if e.verdict in STALE_VERDICTS})
            stale += sorted({f.kind for f in v.finds})
            parts.append(f"`{v.name}` ({v.kind}): " + (" / ".join(stale) if stale else "clean"))
        lines.append(f"| `{c.name}` | {c.reference} | {c.rebound} | {'; '.join(parts)} |")
    return "\n".join(lines)
