"""Find the Machete act_perm stale read (vLLM RFC #48312) end to end, and confirm its fix.

For each kernel variant the demo builds a tiny act-order W4A16 model, loads a checkpoint,
captures a few batch sizes inside graphtrace.trace() (real CUDA graphs on a GPU, emulated
graphs elsewhere), reloads it with new weights AND a new act order (vLLM's real layerwise
reload when vLLM is installed, else a built-in reload that follows the same steps), diffs,
and prints one table per variant:

  act-order layers tracked        layers whose forward permutes activations
  act_perm perms moved / freed    the tensor inside kernel.act_perm (partial keyword or
                                  lambda closure) after the reload: rebound? freed?
  registered perms moved          layer.g_idx_sort_indices, the parameter the fix registers
  plain-attribute tensors moved   Marlin-style sort indices and workspace
  stale / dangling / diverged     stale-like edges of the report (graph, storage read)
  perm reads flagged              stale-like edges among the graphs' reads of a permutation
  replay == eager                 captured graphs replayed after the reload agree with the
                                  live model run eagerly (rows)
  flip test                       reverse the live permutation in place (the one an eager
                                  forward reads now), replay, count rows that changed: 0
                                  means the graphs do not read what the engine now updates

A second column repeats the reload with the SAME checkpoint: replay outputs stay identical
to the pre-reload ones while the same edges are still flagged (impact "latent"), which is
why nothing else catches the bug. On CUDA the capture-time kernel tensors are kept alive
beside each graph, as vLLM's capture artifacts keep them (the seed measured none freed), so
the reads show as stale rather than dangling. Report folders (CSV + GraphML, read them with
`graphtrace report DIR` or graphtrace.load_report) are written under --out.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from graphtrace.vocab import IMPACTS, STALE_VERDICTS

_ALWAYS_COUNTED = ("stale", "dangling", "diverged")  # counted (and shown) in every run

if TYPE_CHECKING:  # the runner imports torch (through .scenario) only when it runs
    from .scenario import Graph, Scenario

__all__ = ["VARIANT_NOTES", "add_arguments", "build_parser", "ScenarioResult",
           "run_scenario", "check", "format_table", "run", "main"]

VARIANT_NOTES = {
    "unfixed-partial": "Machete before the fix: act_perm = partial(permute_cols, perm=perm)",
    "unfixed-lambda": "Machete before the fix: act_perm = lambda x: x[:, perm]",
    "rejected-fix": "first fix: perm registered (prefer_copy) but bound into act_perm at PWAL",
    "fixed": "the fix: registered g_idx_sort_indices read through the layer at apply time",
    "marlin": "Marlin-style: workspace on the kernel, sort indices a plain layer attribute",
}

PERM_ARGS = {"perm", "indices", "perm_or_none"}


# --------------------------------------------------------------------------------------
# command line
# --------------------------------------------------------------------------------------

def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the demo's options to `parser` (`graphtrace demo --help`)."""
    from .kernels import VARIANTS

    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument(
        "--variant", action="append", choices=VARIANTS, metavar="NAME",
        help="kernel variant to run, repeatable (default: all; see the list below)")
    _auto_option(
        parser, "--device", ("cpu", "cuda"),
        "where the model runs: cuda captures real CUDA graphs (torch.cuda.graph), cpu "
        "captures emulated graphs (graphtrace.capture) with CUDA graph address "
        "semantics; auto picks cuda when available")
    parser.add_argument(
        "--out", default="graphtrace-report", metavar="DIR",
        help="report folder; each variant writes DIR/<variant>/new-weights and "
             "DIR/<variant>/same-weights, plus DIR/demo_summary.csv "
             "(default: graphtrace-report/)")
    parser.add_argument(
        "--batch-sizes", default="1,2,4,8", metavar="LIST",
        help="comma-separated batch sizes, one captured graph each (default: 1,2,4,8)")
    parser.add_argument(
        "--seed", type=int, default=0,
        help="seed of the first checkpoint; the reload uses seed+1 for weights and seed+2 "
             "for the act order (default: 0)")
    _auto_option(
        parser, "--backend", ("vllm", "builtin"),
        "reload code: vllm = vLLM's layerwise reload (record_metadata_for_reloading, "
        "initialize_layerwise_reload, finalize_layerwise_reload), builtin = the demo's "
        "own reload with the same steps; auto = vllm when importable")
    parser.add_argument(
        "--layers", type=int, default=4, metavar="N",
        help="act-order layers in the model (default: 4)")
    parser.add_argument(
        "--case", action="append", metavar="NAME",
        help="run a case of the case library instead of the seed's variants (published "
             "stale-read bugs, each with a buggy and a fixed variant), repeatable; 'all' "
             "runs every case; --list-cases names them")
    parser.add_argument(
        "--list-cases", action="store_true", help="list the case library and exit")
    parser.add_argument(
        "--quiet", action="store_true",
        help="no progress lines and no per-variant tables; print the summary and where "
             "the reports are")
    parser.epilog = "variants:\n" + "".join(
        f"  {v:<16} {VARIANT_NOTES[v]}\n" for v in VARIANTS) + (
        "\nexit status: 0 when every variant shows what it should (unfixed: stale perm\n"
        "reads, a flip test that changes nothing; rejected fix: diverged; fix: no stale\n"
        "edges, a flip test that changes every output; Marlin-style: workspace and sort\n"
        "indices flagged), 1 otherwise, 2 on bad options.")


def _auto_option(parser: argparse.ArgumentParser, flag: str, choices: tuple[str, ...],
                 help: str) -> None:
    """An option that is one of `choices` or "auto" (the default: decided when the demo
    runs, by what this machine has)."""
    parser.add_argument(flag, choices=("auto", *choices), default="auto",
                        help=f"{help} (default: auto)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="graphtrace demo", description=__doc__)
    add_arguments(parser)
    return parser


def _batch_sizes(text: str) -> list[int]:
    try:
        sizes = [int(s) for s in str(text).replace(" ", "").split(",") if s]
    except ValueError:
        raise SystemExit(f"graphtrace demo: --batch-sizes must be integers, got {text!r}")
    if not sizes or any(s <= 0 for s in sizes):
        raise SystemExit(f"graphtrace demo: --batch-sizes must be positive, got {text!r}")
    return list(dict.fromkeys(sizes))


# --------------------------------------------------------------------------------------
# one scenario: build, load, capture, reload, diff, replay, flip
# --------------------------------------------------------------------------------------

@dataclass
class ScenarioResult:
    variant: str
    scenario: str  # "new-weights" | "same-weights"
    backend: str
    device: str
    n_layers: int
    census: dict = field(default_factory=dict)  # holder -> (tracked, moved, freed)
    counts: dict = field(default_factory=dict)  # verdict -> edges
    impact: dict = field(default_factory=dict)  # manifest/latent/unknown among stale-like
    perm_edges: int = 0
    perm_flagged: int = 0
    perm_verdicts: dict = field(default_factory=dict)
    flagged_owners: list = field(default_factory=list)
    rows: int = 0
    replay_eq_eager: int = 0
    replay_eq_before: int = 0
    flip_target: str = ""
    flip_changed: int | None = None
    act_order_changed: int = 0
    report_dir: str = ""
    n_errors: int = 0
    timings: dict = field(default_factory=dict)
    report: object = field(default=None, repr=False)  # the graphtrace Report


def _storage_ref(t):
    from torch.multiprocessing.reductions import StorageWeakRef

    return StorageWeakRef(t.untyped_storage())


def _census(model) -> dict:
    """holder -> {layer: tensor} for the tensors the seed's probe follows."""
    from .kernels import _perm_in_callable

    out: dict[str, dict] = {}
    for name, layer in model.quant_layers():
        kernel = layer.quant_method.kernel
        found = {
            "act_perm": _perm_in_callable(getattr(kernel, "act_perm", None)),
            "registered": kernel.registered_perm(layer),
            "sort indices (attr)": layer.__dict__.get("g_idx_sort_indices"),
            "workspace (attr)": getattr(kernel, "workspace", None),
        }
        for holder, t in found.items():
            if t is not None:
                out.setdefault(holder, {})[name] = t
    return out


def _census_moves(before_refs: dict, after: dict) -> dict:
    result = {}
    for holder, refs in before_refs.items():
        moved = freed = 0
        for layer, ref in refs.items():
            live = after.get(holder, {}).get(layer)
            if ref.expired():
                freed += 1
                moved += 1
            elif live is None or _storage_ref(live).cdata != ref.cdata:
                moved += 1
        result[holder] = (len(refs), moved, freed)
    return result


def _capture(sc: Scenario, batch_sizes, device) -> list[Graph]:
    """One graph per batch size (label `bs<N>`) of the scenario's model, emulated or a real
    CUDA graph by device."""
    model = sc.model
    # `keepalive`: vLLM's capture artifacts keep the capture-time kernel tensors (the module
    # docstring; the emulated graph does so on CPU); without it a replay could read reused
    # memory as indices. On CUDA the warm-up runs outside the capture, as vLLM does.
    return sc.capture([(f"bs{bs}", model.make_input(bs)) for bs in batch_sizes],
                      device=device,
                      keepalive=lambda: [t for d in _census(model).values() for t in d.values()])


def _perm_edges(edges):
    args = edges["args"].astype(str).str.split(";")
    return edges[args.map(lambda a: bool(PERM_ARGS.intersection(a)))]


def run_scenario(variant: str, scenario: str, *, device, batch_sizes, seed: int,
                 backend: str, n_layers: int = 4, out: Path | None = None, log=None,
                 strict: bool = False) -> ScenarioResult:
    """Run one variant through one reload scenario and return what the table shows."""
    import torch

    from .model import DemoModel
    from .scenario import Scenario

    log = log or (lambda *_: None)
    device = torch.device(device)
    t0 = time.perf_counter()
    timings = {}
    # The trace is open from the model's construction to the diff, so that the report can
    # say where (and that during the reload) each captured tensor and its replacement were
    # made (Note [provenance] in graphtrace/provenance.py).
    with Scenario(strict=strict) as sc:
        with torch.no_grad():
            model = DemoModel(variant, n_layers=n_layers, seed=seed, device=device,
                              reload_backend=backend)
        sc.watch(model)
        del model
        timings["build"] = time.perf_counter() - t0

        t = time.perf_counter()
        _capture(sc, batch_sizes, device)
        timings["capture"] = time.perf_counter() - t
        return _after_capture(sc, variant, scenario, device=device, seed=seed,
                              backend=backend, n_layers=n_layers, out=out, log=log,
                              timings=timings)


def _after_capture(sc: Scenario, variant, scenario, *, device, seed, backend, n_layers, out,
                   log, timings) -> ScenarioResult:
    import torch

    from .reload import reload
    from .scenario import same_rows

    model = sc.model
    before = sc.replay()
    census_before = _census(model)
    refs = {h: {l: _storage_ref(ten) for l, ten in d.items()} for h, d in census_before.items()}
    perms_before = {l: d.clone() for l, d in census_before.get(
        "act_perm", census_before.get("registered", census_before.get(
            "sort indices (attr)", {}))).items()}
    del census_before

    if scenario == "same-weights":
        ckpt = model.make_checkpoint(seed, seed)
    else:
        ckpt = model.make_checkpoint(seed + 1, seed + 2)
    t = time.perf_counter()
    used = sc.reload(lambda m, ckpt=ckpt: reload(m, ckpt, backend=backend))
    timings["reload"] = time.perf_counter() - t
    del ckpt

    t = time.perf_counter()
    report = sc.diff()
    timings["diff"] = time.perf_counter() - t
    sc.close()

    res = ScenarioResult(variant, scenario, used, str(device), n_layers)
    census_after = _census(model)
    res.census = _census_moves(refs, census_after)
    live_perms = {name: layer.quant_method.kernel.live_perm(layer)
                  for name, layer in model.quant_layers()}
    res.act_order_changed = sum(
        1 for l, p in perms_before.items()
        if live_perms.get(l) is not None and not torch.equal(p, live_perms[l]))

    edges = report.edges
    verdict = edges["verdict"].astype(object)
    # identity's stale-like verdicts always, freshness's only when present: the demo's
    # tables and summary stay as they were on a run without any (issue 24)
    res.counts = {v: int((verdict == v).sum()) for v in STALE_VERDICTS
                  if v in _ALWAYS_COUNTED or (verdict == v).any()}
    stale = edges[verdict.isin(STALE_VERDICTS)]
    imp = stale["impact"].astype(object)
    res.impact = {k: int((imp == k).sum()) for k in IMPACTS}
    perm = _perm_edges(edges)
    res.perm_edges = len(perm)
    pv = perm["verdict"].astype(object)
    res.perm_flagged = int(pv.isin(STALE_VERDICTS).sum())
    res.perm_verdicts = {v: int(n) for v, n in pv.value_counts().items()}
    res.flagged_owners = sorted({o for s in stale["owners"].astype(str) for o in s.split("; ") if o})
    res.n_errors = len(report.errors)
    res.report = report

    t = time.perf_counter()
    after = sc.replay()
    eager = sc.eager()
    res.rows = sc.rows
    res.replay_eq_eager = sum(same_rows(a, e) for a, e in zip(after, eager))
    res.replay_eq_before = sum(same_rows(a, b) for a, b in zip(after, before))

    if scenario == "new-weights":
        targets = [p for p in live_perms.values() if p is not None]
        holders = {h for h, d in census_after.items() if d and h != "workspace (attr)"}
        kernel = model.quant_layers()[0][1].quant_method.kernel
        target_name = ("layer.g_idx_sort_indices (registered)" if kernel.registers_perm
                       and not hasattr(kernel, "act_perm") else
                       "kernel.act_perm's perm" if "act_perm" in holders else
                       "layer.g_idx_sort_indices (plain attribute)")
        res.flip_target = target_name

        def reverse(_model):  # reversing twice restores the permutation
            for p in targets:
                p.copy_(p.flip(0))

        res.flip_changed = sc.flip(reverse, restore=reverse, baseline=after).changed
    timings["replay"] = time.perf_counter() - t

    if out is not None:
        t = time.perf_counter()
        folder = Path(out) / variant / scenario
        report.to_csv(folder)
        res.report_dir = str(folder)
        timings["write"] = time.perf_counter() - t
    res.timings = timings
    log(f"  {variant:<15} {scenario:<12} " + " · ".join(
        f"{k} {v * 1000:.0f} ms" for k, v in timings.items()) + f" · reload: {used}")
    sc.graphs.clear()
    return res


# --------------------------------------------------------------------------------------
# expectations and tables
# --------------------------------------------------------------------------------------

def check(new: ScenarioResult, same: ScenarioResult | None) -> tuple[bool, str]:
    """Does this variant show what the seed report says it should?"""
    v = new.variant
    n = new.n_layers
    stale_like = sum(new.counts.values())
    per_layer_reads = new.perm_edges
    problems = []
    if v.startswith("unfixed"):
        if new.perm_flagged != per_layer_reads or not per_layer_reads:
            problems.append(f"perm reads flagged {new.perm_flagged}/{per_layer_reads}")
        if new.counts["diverged"]:
            problems.append("diverged edges")
        if new.flip_changed:
            problems.append(f"flip changed {new.flip_changed} outputs")
        ok_msg = (f"STALE READ: {n}/{n} act-order layers' graphs keep the capture-time "
                  "permutation; flipping the live one changes nothing")
    elif v == "rejected-fix":
        if new.perm_verdicts.get("diverged", 0) != per_layer_reads or not per_layer_reads:
            problems.append(f"perm reads diverged {new.perm_verdicts.get('diverged', 0)}"
                            f"/{per_layer_reads}")
        if new.flip_changed:
            problems.append(f"flip of act_perm changed {new.flip_changed} outputs")
        ok_msg = ("DIVERGED: the registered perm kept its storage, act_perm holds a "
                  "detached copy; flipping it changes nothing")
    elif v == "fixed":
        if stale_like:
            problems.append(f"{stale_like} stale-like edges")
        if new.flip_changed != new.rows:
            problems.append(f"flip changed {new.flip_changed}/{new.rows} outputs")
        if new.replay_eq_eager != new.rows:
            problems.append(f"replay == eager {new.replay_eq_eager}/{new.rows}")
        ok_msg = ("CLEAN: no stale edges; graphs read the registered perm the reload "
                  "refreshes in place (flip changes every output)")
    elif v == "marlin":
        owners = " ".join(new.flagged_owners)
        if "kernel.workspace" not in owners:
            problems.append("workspace not flagged")
        if "g_idx_sort_indices" not in owners:
            problems.append("sort indices not flagged")
        if new.flip_changed:
            problems.append(f"flip changed {new.flip_changed} outputs")
        ok_msg = "STALE READ: workspace and sort indices (plain attributes) flagged"
    else:  # pragma: no cover - future variants
        ok_msg = "ran"
    if same is not None:
        if same.replay_eq_before != same.rows:
            problems.append(f"same-weights replay changed ({same.replay_eq_before}/{same.rows})")
        if v != "fixed":
            if not sum(same.counts.values()):
                problems.append("same-weights reload flagged nothing")
            if same.impact.get("manifest"):
                problems.append(f"same-weights reload: {same.impact['manifest']} manifest edges")
    if problems:
        return False, "UNEXPECTED: " + "; ".join(problems)
    return True, ok_msg


def _owner_patterns(owners) -> list[tuple[str, int]]:
    """Owner paths with the layer index replaced by `*`, and how many layers each covers."""
    import re

    seen: dict[str, set] = {}
    for path in owners:
        m = re.match(r"^(layers\.)(\d+)(\..*)$", path)
        key, idx = (m.group(1) + "*" + m.group(3), m.group(2)) if m else (path, path)
        seen.setdefault(key, set()).add(idx)
    return [(k, len(v)) for k, v in seen.items()]


def _frac(a, b) -> str:
    return f"{a}/{b}"


def format_table(new: ScenarioResult, same: ScenarioResult | None, verdict: str) -> str:
    rows: list[tuple[str, str, str]] = []

    def add(label, f):
        rows.append((label, f(new), f(same) if same is not None else "-"))

    n = new.n_layers
    add("act-order layers tracked", lambda r: str(r.n_layers))
    add("act order changed by the reload", lambda r: _frac(r.act_order_changed, n))
    labels = {"act_perm": "act_perm perms", "registered": "registered perms",
              "sort indices (attr)": "sort indices (plain attr)",
              "workspace (attr)": "workspaces (kernel attr)"}
    for holder, label in labels.items():
        if holder in new.census:
            add(f"{label} moved / freed",
                lambda r, h=holder: "{1}/{0} / {2}/{0}".format(*r.census.get(h, (0, 0, 0))))
        elif holder in ("act_perm", "registered"):
            add(f"{label} moved", lambda r: "n/a")
    add(f"{' / '.join(_ALWAYS_COUNTED)} edges",
        lambda r: " / ".join(str(r.counts[v]) for v in _ALWAYS_COUNTED))
    for v in STALE_VERDICTS:
        if v not in _ALWAYS_COUNTED and (v in new.counts or (same and v in same.counts)):
            add(f"{v} edges", lambda r, v=v: str(r.counts.get(v, 0)))
    add(f"  impact {' / '.join(IMPACTS)}",
        lambda r: " / ".join(str(r.impact[k]) for k in IMPACTS))
    add("perm reads flagged", lambda r: _frac(r.perm_flagged, r.perm_edges))
    add("replay == eager after reload (rows)", lambda r: _frac(r.replay_eq_eager, r.rows))
    add("replay == replay before reload", lambda r: _frac(r.replay_eq_before, r.rows))
    rows.append(("flip test: replay rows changed", f"{new.flip_changed}/{new.rows}", "-"))
    w0 = max(38, *(len(r[0]) for r in rows))
    w1 = max(len("new weights+act order"), *(len(r[1]) for r in rows))
    head = f"  {'':<{w0}}  {'new weights+act order':>{w1}}  {'same weights':>12}"
    lines = [f"── {new.variant} ── {VARIANT_NOTES.get(new.variant, '')}", head]
    lines += [f"  {a:<{w0}}  {b:>{w1}}  {c:>12}" for a, b, c in rows]
    lines.append(f"  flip target: {new.flip_target}, reversed in place in every layer")
    for pattern, n_layers in _owner_patterns(new.flagged_owners):
        lines.append(f"  flagged: {pattern}  ({n_layers} layer{'s' if n_layers != 1 else ''})")
    lines.append(f"  → {verdict}")
    if new.report_dir:
        lines.append(f"  reports: {new.report_dir}" + (f", {same.report_dir}" if same and
                                                        same.report_dir else ""))
    return "\n".join(lines)


def _summary_rows(results) -> list[dict]:
    rows = []
    for (new, same, ok, verdict) in results:
        for r in (new, same):
            if r is None:
                continue
            rows.append({
                "variant": r.variant, "scenario": r.scenario, "backend": r.backend,
                "device": r.device, "layers": r.n_layers,
                **{f"edges_{v}": r.counts.get(v, 0) for v in STALE_VERDICTS
                   if v in _ALWAYS_COUNTED or v in r.counts},
                **{f"impact_{k}": r.impact[k] for k in IMPACTS},
                "perm_reads": r.perm_edges, "perm_reads_flagged": r.perm_flagged,
                "rows": r.rows, "replay_eq_eager": r.replay_eq_eager,
                "replay_eq_before": r.replay_eq_before,
                "flip_changed": "" if r.flip_changed is None else r.flip_changed,
                "as_expected": ok, "report": r.report_dir,
            })
    return rows


# --------------------------------------------------------------------------------------
# entry point
# --------------------------------------------------------------------------------------

def run(args: argparse.Namespace) -> int:
    """Run the demo (`graphtrace demo`); returns the exit status."""
    import torch

    from .kernels import VARIANTS
    from .reload import resolve_backend

    if getattr(args, "case", None) or getattr(args, "list_cases", False):
        from .cases import command

        return command.run(args)
    quiet = bool(getattr(args, "quiet", False))
    variants = list(dict.fromkeys(getattr(args, "variant", None) or VARIANTS))
    batch_sizes = _batch_sizes(getattr(args, "batch_sizes", "1,2,4,8"))
    seed = int(getattr(args, "seed", 0))
    n_layers = int(getattr(args, "layers", 4))
    out = getattr(args, "out", "graphtrace-report")
    out = Path(out) if out else None
    if out is not None:
        try:
            out.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            print(f"graphtrace demo: cannot write the report folder {str(out)!r}: "
                  f"{e.strerror or e}", file=sys.stderr)
            return 2
    device = getattr(args, "device", "auto")
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        print("graphtrace demo: --device cuda but CUDA is not available", file=sys.stderr)
        return 2
    try:
        backend = resolve_backend(getattr(args, "backend", "auto"))
    except RuntimeError as e:
        print(f"graphtrace demo: {e}", file=sys.stderr)
        return 2

    def log(msg):
        if not quiet:
            print(msg, flush=True)

    t_start = time.perf_counter()
    backend_desc = backend
    if backend == "vllm":
        t = time.perf_counter()
        import vllm
        import vllm.model_executor.model_loader.reload  # noqa: F401

        backend_desc = f"vLLM {vllm.__version__} layerwise reload"
        log(f"loaded vLLM {vllm.__version__}'s reload code in "
            f"{time.perf_counter() - t:.1f} s")
    else:
        backend_desc = "built-in reload (vLLM's steps; vLLM not used)"
    graphs = "real CUDA graphs" if device == "cuda" else "emulated graphs (graphtrace.capture)"
    log(f"graphtrace demo: {len(variants)} variant(s) × (new weights + new act order, same "
        f"weights); {n_layers} layers; batch sizes {','.join(map(str, batch_sizes))}; "
        f"{device}, {graphs}; {backend_desc}")

    results = []
    for i, variant in enumerate(variants, 1):
        log(f"[{i}/{len(variants)}] {variant}")
        new, same = (run_scenario(variant, scenario, device=device, batch_sizes=batch_sizes,
                                  seed=seed, backend=backend, n_layers=n_layers, out=out, log=log)
                     for scenario in ("new-weights", "same-weights"))
        ok, verdict = check(new, same)
        results.append((new, same, ok, verdict))
        if not quiet:
            print(format_table(new, same, verdict), flush=True)

    summary = _summary_rows(results)
    if out is not None:
        import pandas as pd

        out.mkdir(parents=True, exist_ok=True)
        pd.DataFrame(summary).to_csv(out / "demo_summary.csv", index=False)

    elapsed = time.perf_counter() - t_start
    print()
    print(f"graphtrace demo summary ({device}, {graphs}; {backend_desc}):")
    print(f"{'variant':<16} {'stale':>5} {'dangl':>5} {'diverg':>6} {'perm flagged':>12} "
          f"{'flip changed':>12} {'replay=eager':>12}  result")
    for new, same, ok, verdict in results:
        print(f"{new.variant:<16} {new.counts['stale']:>5} {new.counts['dangling']:>5} "
              f"{new.counts['diverged']:>6} {_frac(new.perm_flagged, new.perm_edges):>12} "
              f"{_frac(new.flip_changed, new.rows):>12} "
              f"{_frac(new.replay_eq_eager, new.rows):>12}  "
              f"{'ok' if ok else 'UNEXPECTED'}: {verdict.split(':')[0]}")
    if out is not None:
        print(f"reports written under {out}{os.sep} (one folder per variant and reload; "
              f"read one with: graphtrace report {out / variants[0] / 'new-weights'})")
    n_bad = sum(1 for *_, ok, _ in results if not ok)
    print(f"done in {elapsed:.1f} s" + (f"; {n_bad} variant(s) UNEXPECTED" if n_bad else ""))
    return 0 if n_bad == 0 else 1


def main(argv=None) -> int:
    return run(build_parser().parse_args(argv))


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
