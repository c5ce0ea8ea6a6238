#!/usr/bin/env python3
"""GPU check (issue 8): graphtrace on real CUDA graphs, and what the dispatcher misses.

One script, every check in one run of a few minutes on one GPU:

  env                 versions, and probes for what this torch offers (CUDAGraph keep_graph /
                      raw_cuda_graph, DebugMode's Triton launch hook, driver entry points)
  coverage-synthetic  graphtrace.coverage's arithmetic on synthetic kernel nodes, and the
                      kernel-node decoder on a fake parameter block (no CUDA needed)
  demo-emulated       every demo variant on emulated graphs, model on the CPU (the reference)
  stale-read-emulated the stale-read check below on emulated graphs (its CPU rehearsal)
  demo-cuda           every demo variant on real torch.cuda.graph captures: reload, diff,
                      flip test on real replay (graphtrace.demo.runner.run_scenario)
  stale-read          per variant, real replay against eager after a reload: the unfixed
                      graphs compute with the capture-time permutation (old model) while
                      eager uses the new one; flipping the live permutation in place changes
                      every eager output and no replayed one
  demo-emulated-cuda  every variant on emulated graphs with the model on the GPU
  coverage-eager      kernel nodes of real captured graphs (CUDAGraph(keep_graph=True),
                      raw_cuda_graph(), libcuda through ctypes): every pointer-sized kernel
                      argument that falls inside known memory, and whether graphtrace
                      attributed it; eager models: the method's baseline
  coverage-compiled   the same for torch.compile'd models (Inductor's Triton kernels launch
                      without the dispatcher), with DebugMode's Triton hook as a second
                      source; then a reload that rebinds the permutation, diffed and replayed
  compile-cpu         torch.compile on the CPU (Inductor's C++ kernels): what the recorder
                      sees of compiled code, without kernel nodes

After the checks, the verdicts of the three demo runs are compared (counts, owner paths,
owned edges): emulated (cpu) vs real CUDA graphs vs emulated (cuda); and the stale-read
figures of emulated replay vs real replay.

Each check runs in its own Python process with a timeout, so a hang, a crash or an
exception loses that check only; its lines so far are kept. CPU-only checks run in
`--jobs` lanes beside the GPU checks (one lane, one after another). The results block is printed
at the end and written to OUT/gpu_check.txt (+ gpu_check.json, gpu_check.log and
gpu_coverage_*.csv).

  python analysis/gpu_check.py                 # CUDA machine: everything, OUT=analysis/results
  python analysis/gpu_check.py --dry           # no CUDA: what runs on a CPU, GPU checks skipped
  python analysis/gpu_check.py --out DIR       # where the results go (--dry writes only with --out)
  python analysis/gpu_check.py --only demo-cuda,stale-read
  python analysis/gpu_check.py --inline        # no child processes (debugging; no hard timeouts)

Exit status: 0 when no check failed (skipped and "unavailable" probes are not failures),
1 otherwise, 2 on bad options.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import functools
import json
import os
import platform
import signal
import struct
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # run from a bare checkout: graphtrace need not be installed
    sys.path.insert(0, str(REPO))

from graphtrace import coverage as cov  # noqa: E402  (torch-free)

STALE_LIKE = ("stale", "dangling", "diverged")
SKIP_NO_CUDA = "skipped: no CUDA"
DEFAULT_BATCH_SIZES = "1,2,4,8"


# ======================================================================================
# child-side context: lines, figures, tables; saved after every line
# ======================================================================================

class Ctx:
    """What one check reports. Saved to JSON after every change, so a timeout or a crash
    keeps what was said before it."""

    def __init__(self, name: str, args: argparse.Namespace, json_path: str | None = None,
                 table_dir: str | None = None, echo: bool = True):
        self.name = name
        self.args = args
        self.json_path = json_path
        self.table_dir = Path(table_dir) if table_dir else None
        self.echo = echo
        self.lines: list[str] = []
        self.figures: dict[str, Any] = {}
        self.problems: list[str] = []
        self.errors: list[str] = []
        self.tables: dict[str, str] = {}
        self.t0 = time.perf_counter()

    # -- reporting -----------------------------------------------------------------------
    def error(self, exc: BaseException) -> None:
        """A check's exception: kept with the last lines of its traceback, never re-raised."""
        self.errors.append(f"{type(exc).__name__}: {exc}")
        self.line(f"ERROR: {type(exc).__name__}: {exc}")
        for ln in traceback.format_exc().rstrip().splitlines()[-15:]:
            self.line(f"    {ln}")

    def line(self, text: str = "") -> None:
        for part in str(text).splitlines() or [""]:
            self.lines.append(part)
            if self.echo:
                print(f"[{self.name}] {part}", flush=True)
        self.save()

    def figure(self, key: str, value: Any) -> None:
        self.figures[key] = _jsonable(value)
        self.save()

    def fail(self, text: str) -> None:
        """An expectation not met: the check fails (and the run exits 1)."""
        self.problems.append(text)
        self.line(f"FAIL: {text}")

    def expect(self, cond: bool, text: str) -> bool:
        if not cond:
            self.fail(text)
        return bool(cond)

    def unavailable(self, what: str, exc: BaseException | str) -> None:
        """Something this torch/driver does not offer: reported with its error, not a failure."""
        msg = exc if isinstance(exc, str) else f"{type(exc).__name__}: {exc}"
        self.figures.setdefault("unavailable", {})[what] = msg
        self.line(f"unavailable: {what}: {msg}")

    def table(self, name: str, frame) -> None:
        if self.table_dir is None or frame is None:
            return
        self.table_dir.mkdir(parents=True, exist_ok=True)
        path = self.table_dir / f"{name}.csv"
        frame.to_csv(path, index=False)
        self.tables[name] = str(path)
        self.save()

    @contextlib.contextmanager
    def step(self, label: str):
        """One guarded part of a check: an exception is printed and recorded, the rest runs."""
        t = time.perf_counter()
        try:
            yield
        except Exception as exc:  # noqa: BLE001 - report everything
            tb = traceback.format_exc()
            self.errors.append(f"{label}: {type(exc).__name__}: {exc}")
            self.line(f"ERROR in {label}: {type(exc).__name__}: {exc}")
            for ln in tb.rstrip().splitlines()[-12:]:
                self.line(f"    {ln}")
        finally:
            self.figures.setdefault("step_seconds", {})[label] = round(time.perf_counter() - t, 2)

    # -- persistence ---------------------------------------------------------------------
    def result(self) -> dict:
        status = "ok"
        if self.problems:
            status = "FAIL"
        elif self.errors:
            status = "error"
        return {"status": status, "seconds": round(time.perf_counter() - self.t0, 1),
                "lines": self.lines, "figures": self.figures, "problems": self.problems,
                "errors": self.errors, "tables": self.tables}

    def save(self) -> None:
        if not self.json_path:
            return
        tmp = self.json_path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(self.result(), f, default=str)
        os.replace(tmp, self.json_path)


def _jsonable(v):
    try:
        json.dumps(v)
        return v
    except TypeError:
        if isinstance(v, dict):
            return {str(k): _jsonable(x) for k, x in v.items()}
        if isinstance(v, (list, tuple, set)):
            return [_jsonable(x) for x in v]
        if hasattr(v, "item"):
            try:
                return v.item()
            except Exception:
                pass
        return str(v)


# ======================================================================================
# env
# ======================================================================================

def check_env(ctx: Ctx) -> None:
    import numpy
    import pandas

    ctx.line(f"python {platform.python_version()} on {platform.machine()}, numpy "
             f"{numpy.__version__}, pandas {pandas.__version__}")
    import torch

    import graphtrace

    cuda = bool(torch.cuda.is_available())
    ctx.figure("torch", torch.__version__)
    ctx.figure("cuda_available", cuda)
    ctx.figure("graphtrace", graphtrace.__version__)
    ctx.line(f"torch {torch.__version__} (CUDA build {torch.version.cuda}), graphtrace "
             f"{graphtrace.__version__}, CUDA available: {cuda}")
    if cuda:
        props = torch.cuda.get_device_properties(0)
        ctx.figure("device", props.name)
        ctx.line(f"device: {props.name}, {props.multi_processor_count} SMs, "
                 f"{props.total_memory / 2**30:.0f} GiB, capability {props.major}.{props.minor}")
    try:
        import triton

        ctx.figure("triton", triton.__version__)
        ctx.line(f"triton {triton.__version__}")
    except Exception as exc:  # noqa: BLE001
        ctx.unavailable("triton", exc)

    from graphtrace import native

    try:  # built here once (~20 s) so that the checks after this one record with it
        module = native.load(required=True)
        ctx.figure("recorder", "native")
        ctx.line(f"graphtrace recorder: native ({module.__file__})")
    except native.NativeUnavailable as exc:
        ctx.figure("recorder", "python")
        ctx.line(f"graphtrace recorder: pure Python ({exc})")
    probes = probe_torch_features()
    ctx.figure("probes", probes)
    for key, (ok, detail) in probes.items():
        ctx.line(f"probe {key}: {'yes' if ok else 'no'}{' - ' + detail if detail else ''}")
    if cuda:
        with ctx.step("libcuda"):
            drv = CudaDriver()
            ctx.figure("driver_version", drv.version)
            ctx.line(f"libcuda {drv.path}: driver API {drv.version_text}; entry points: " +
                     ", ".join(f"{k} {'yes' if v else 'NO'}" for k, v in drv.available.items()))


def probe_torch_features() -> dict[str, tuple[bool, str]]:
    """What this torch offers for coverage beyond the dispatcher (each probe never raises)."""
    import inspect

    import torch

    out: dict[str, tuple[bool, str]] = {}

    def probe(key, fn):
        try:
            res = fn()
            out[key] = (bool(res[0]), str(res[1])) if isinstance(res, tuple) else (bool(res), "")
        except Exception as exc:  # noqa: BLE001
            out[key] = (False, f"{type(exc).__name__}: {exc}")

    def keep_graph():
        sig = inspect.signature(torch.cuda.CUDAGraph.__new__)
        has = "keep_graph" in sig.parameters
        return has and hasattr(torch.cuda.CUDAGraph, "raw_cuda_graph"), f"CUDAGraph.__new__{sig}"

    def debug_mode():
        from torch.utils import _debug_mode as dm

        cls = dm.DebugMode
        has = hasattr(cls, "record_triton_kernel")
        where = getattr(dm, "__file__", "?")
        return has, f"{cls.__module__}.DebugMode.record_triton_kernel {'present' if has else 'MISSING'} ({where})"

    def inductor_calls_hook():
        from torch._inductor.runtime import triton_heuristics as th

        src = inspect.getsource(th)
        return "record_triton_kernel" in src, "torch._inductor.runtime.triton_heuristics " + (
            "calls DebugMode.record_triton_kernel" if "record_triton_kernel" in src else
            "does not call record_triton_kernel")

    def dynamo_mode_rule():
        import torch._dynamo.config as dc

        inline = getattr(dc, "inline_torch_dispatch_torch_compile", None)
        has_ici = hasattr(torch.utils._python_dispatch.TorchDispatchMode, "ignore_compile_internals")
        return has_ici, (f"TorchDispatchMode.ignore_compile_internals "
                         f"{'exists' if has_ici else 'missing'}; "
                         f"dynamo inline_torch_dispatch_torch_compile={inline}")

    def graph_data():
        return hasattr(torch.cuda.CUDAGraph, "get_graph_data"), "CUDAGraph.get_graph_data"

    probe("cudagraph_keep_graph", keep_graph)
    probe("debugmode_triton_hook", debug_mode)
    probe("inductor_calls_hook", inductor_calls_hook)
    probe("dynamo_dispatch_mode_rule", dynamo_mode_rule)
    probe("cudagraph_get_graph_data", graph_data)
    return out


# ======================================================================================
# the demo: emulated and real CUDA graphs (reusing graphtrace.demo.runner)
# ======================================================================================

def _batch_sizes(args) -> list[int]:
    return [int(s) for s in str(args.batch_sizes).split(",") if s.strip()]


def scenario_summary(res) -> dict:
    """What `compare_demo` compares, from a runner.ScenarioResult."""
    edges = res.report.edges if res.report is not None else None
    owned, all_counts = [], {}
    if edges is not None:
        v = edges["verdict"].astype(str)
        all_counts = {k: int(n) for k, n in v.value_counts().items()}
        sub = edges[v != "unowned"]
        owned = sorted({(str(g), str(o), str(vv), str(i) if str(i) not in ("nan", "<NA>") else "")
                        for g, o, vv, i in zip(sub["graph"], sub["owners"], sub["verdict"],
                                               sub["impact"])})
    return {
        "variant": res.variant, "scenario": res.scenario, "device": res.device,
        "backend": res.backend, "counts": dict(res.counts), "impact": dict(res.impact),
        "perm_edges": res.perm_edges, "perm_flagged": res.perm_flagged,
        "perm_verdicts": dict(res.perm_verdicts), "flagged_owners": list(res.flagged_owners),
        "rows": res.rows, "replay_eq_eager": res.replay_eq_eager,
        "replay_eq_before": res.replay_eq_before, "flip_changed": res.flip_changed,
        "n_errors": res.n_errors, "verdict_counts": all_counts,
        "owned_edges": [list(t) for t in owned],
    }


def summary_line(label: str, s: dict) -> str:
    c = s["counts"]
    flip = "-" if s["flip_changed"] is None else f"{s['flip_changed']}/{s['rows']}"
    return (f"{label} {s['variant']} {s['scenario']}: stale={c['stale']} "
            f"dangling={c['dangling']} diverged={c['diverged']} "
            f"perm_flagged={s['perm_flagged']}/{s['perm_edges']} flip={flip} "
            f"replay_eq_eager={s['replay_eq_eager']}/{s['rows']} expected={s.get('expected', '?')}")


@contextlib.contextmanager
def _emulated_capture_on_any_device():
    """Make runner._capture record emulated graphs (graphtrace.capture) whatever the model's
    device: the model stays on the GPU, the graphs are graphtrace's emulated ones."""
    from graphtrace.demo import runner

    original = runner._capture

    def emulated(model, batch_sizes, device, torch, gt):
        return original(model, batch_sizes, torch.device("cpu"), torch, gt)

    runner._capture = emulated
    try:
        yield
    finally:
        runner._capture = original


def _run_demo(ctx: Ctx, device: str, label: str, emulate: bool) -> None:
    from graphtrace.demo import runner
    from graphtrace.demo.kernels import VARIANTS

    sizes = _batch_sizes(ctx.args)
    variants = [v for v in VARIANTS if not ctx.args.variant or v in ctx.args.variant]
    ctx.line(f"{label}: {len(variants)} variants x (new-weights, same-weights), "
             f"{ctx.args.layers} layers, batch sizes {sizes}, reload {ctx.args.backend}, "
             f"device {device}, {'emulated graphs' if emulate else 'real CUDA graphs'}")
    scenarios: dict[str, dict] = {}
    for variant in variants:
        with ctx.step(f"{variant}"):
            results = {}
            for scenario in ("new-weights", "same-weights"):
                guard = _emulated_capture_on_any_device() if emulate else contextlib.nullcontext()
                with guard:
                    results[scenario] = runner.run_scenario(
                        variant, scenario, device=device, batch_sizes=sizes, seed=0,
                        backend=ctx.args.backend, n_layers=ctx.args.layers, out=None)
            ok, verdict = runner.check(results["new-weights"], results["same-weights"])
            for scenario, res in results.items():
                s = scenario_summary(res)
                s["expected"] = "ok" if ok else "UNEXPECTED"
                scenarios[f"{variant}/{scenario}"] = s
                ctx.line(summary_line(label, s))
                if res.n_errors:
                    ctx.fail(f"{variant} {scenario}: graphtrace recorded {res.n_errors} internal "
                             f"errors: {res.report.errors[:1]}")
            ctx.line(f"  {variant}: {verdict}")
            owners = results["new-weights"].flagged_owners
            for pattern, n in runner._owner_patterns(owners):
                ctx.line(f"  {variant} flagged owner: {pattern} ({n} layers)")
            ctx.expect(ok, f"{label} {variant}: {verdict}")
            ctx.figure("scenarios", scenarios)
    ctx.figure("scenarios", scenarios)


def check_demo_emulated(ctx: Ctx) -> None:
    _run_demo(ctx, "cpu", "emulated[cpu]", emulate=True)


def check_demo_emulated_cuda(ctx: Ctx) -> None:
    _run_demo(ctx, "cuda", "emulated[cuda]", emulate=True)


def check_demo_cuda(ctx: Ctx) -> None:
    _run_demo(ctx, "cuda", "cuda-graphs", emulate=False)


# -- verdict comparison (pure; run by the parent) ----------------------------------------

HARD_KEYS = ("counts", "impact", "perm_edges", "perm_flagged", "perm_verdicts",
             "flagged_owners", "owned_edges", "expected")
SOFT_KEYS = ("flip_changed", "replay_eq_eager", "replay_eq_before", "verdict_counts")


def compare_demo(ref: dict, other: dict, ref_name: str, other_name: str
                 ) -> tuple[bool | None, list[str]]:
    """Compare two demo runs' scenario summaries (`scenario_summary` dicts by key).

    Hard keys (verdict counts, impact, perm reads, flagged owner paths, owned edges, the
    demo's own expectation) must agree; soft keys (replay agreement, flip test, counts of
    every verdict including unowned intermediates) are reported when they differ. Returns
    (all hard keys equal, or None when nothing was comparable; lines).
    """
    lines = []
    keys = sorted(set(ref) & set(other))
    missing = sorted(set(ref) ^ set(other))
    if not keys:
        return None, [f"verdicts equal [{ref_name} vs {other_name}]: nothing to compare"]
    all_ok = True
    for key in keys:
        a, b = ref[key], other[key]
        diffs = []
        for k in HARD_KEYS:
            if _norm(a.get(k)) != _norm(b.get(k)):
                diffs.append(_describe_diff(k, a.get(k), b.get(k), ref_name, other_name))
        soft = [k for k in SOFT_KEYS if _norm(a.get(k)) != _norm(b.get(k))]
        variant, scenario = key.split("/", 1)
        c = a["counts"]
        if diffs:
            all_ok = False
            lines.append(f"verdicts equal [{ref_name} vs {other_name}] {variant} {scenario}: NO")
            lines.extend(f"    {d}" for d in diffs)
        else:
            lines.append(f"verdicts equal [{ref_name} vs {other_name}] {variant} {scenario}: yes "
                         f"(stale={c['stale']} dangling={c['dangling']} diverged={c['diverged']}, "
                         f"{len(a.get('owned_edges', []))} owned edges, "
                         f"{len(a.get('flagged_owners', []))} flagged owner paths)")
        for k in soft:
            lines.append(f"    note: {k} differs: {ref_name} {a.get(k)} vs {other_name} {b.get(k)}")
    for key in missing:
        side = ref_name if key in ref else other_name
        lines.append(f"verdicts equal [{ref_name} vs {other_name}] {key}: only in {side}")
    return all_ok, lines


STALE_READ_KEYS = ("rows", "replay_eq_eager_before_reload", "stale_like_edges",
                   "replay_eq_eager_new", "replay_eq_eager_capture_perm",
                   "flip_eager_changed", "flip_replay_changed")


def compare_stale_read(ref: dict, other: dict, ref_name: str, other_name: str
                       ) -> tuple[bool | None, list[str]]:
    """Do emulated and real replay agree, per variant, on the stale-read figures?"""
    keys = sorted(set(ref) & set(other))
    if not keys:
        return None, [f"replay agrees [{ref_name} vs {other_name}]: nothing to compare"]
    ok_all, lines = True, []
    for v in keys:
        diffs = [f"{k}: {ref[v].get(k)} vs {other[v].get(k)}" for k in STALE_READ_KEYS
                 if ref[v].get(k) != other[v].get(k)]
        ok_all &= not diffs
        lines.append(f"replay agrees [{ref_name} vs {other_name}] {v}: " +
                     ("yes" if not diffs else "NO: " + "; ".join(diffs)))
    return ok_all, lines


def _norm(v):
    if isinstance(v, dict):
        return {str(k): _norm(x) for k, x in sorted(v.items()) if not (isinstance(x, int) and x == 0)}
    if isinstance(v, (list, tuple)):
        return sorted((_norm(x) for x in v), key=repr)
    return v


def _describe_diff(k, a, b, an, bn) -> str:
    if isinstance(a, list) and isinstance(b, list):
        sa = {json.dumps(x) if not isinstance(x, str) else x for x in a}
        sb = {json.dumps(x) if not isinstance(x, str) else x for x in b}
        only_a, only_b = sorted(sa - sb)[:5], sorted(sb - sa)[:5]
        return f"{k}: only in {an}: {only_a}; only in {bn}: {only_b}"
    return f"{k}: {an} {a} vs {bn} {b}"


# ======================================================================================
# stale read on real replay
# ======================================================================================

def _rows_equal(a, b, exact: bool) -> int:
    import torch

    if exact:
        return int((a == b).all(dim=-1).sum())
    return int(torch.isclose(a, b, rtol=1e-4, atol=1e-5).all(dim=-1).sum())


def check_stale_read(ctx: Ctx, device: str = "cuda") -> None:
    """Replay vs eager per variant, after a reload and after an in-place act-order flip.

    On CUDA the graphs are real (torch.cuda.graph); on the CPU (stale-read-emulated, the
    dry run's rehearsal of the same expectations) they are graphtrace's emulated graphs."""
    import torch

    import graphtrace as gt
    from graphtrace.demo import runner
    from graphtrace.demo.kernels import VARIANTS
    from graphtrace.demo.model import DemoModel
    from graphtrace.demo.reload import reload

    what = "real replay" if device == "cuda" else "emulated replay"
    device = torch.device(device)
    sizes = _batch_sizes(ctx.args)
    stale_variants = {"unfixed-partial", "unfixed-lambda", "rejected-fix", "marlin"}
    figures = {}
    variants = [v for v in VARIANTS if not ctx.args.variant or v in ctx.args.variant]
    for variant in variants:
        with ctx.step(variant), torch.no_grad():
            model = DemoModel(variant, n_layers=ctx.args.layers, seed=0, device=device,
                              reload_backend=ctx.args.backend)
            with gt.trace(model) as tr:
                captured = runner._capture(model, sizes, device, torch, gt)
            rows = sum(c.batch_size for c in captured)
            replay0 = [c.run() for c in captured]
            eager0 = [model(c.x) for c in captured]
            sane = sum(_rows_equal(r, e, False) for r, e in zip(replay0, eager0))

            def live_perms(model=model):
                return {n: l.quant_method.kernel.live_perm(l) for n, l in model.quant_layers()}

            capture_perms = {n: p.clone() for n, p in live_perms().items() if p is not None}
            used = reload(model, model.make_checkpoint(1, 2), backend=ctx.args.backend)
            report = tr.diff()
            stale_edges = int(report.edges["verdict"].astype(str).isin(STALE_LIKE).sum())

            replay1 = [c.run() for c in captured]
            eager1 = [model(c.x) for c in captured]
            eq_new = sum(_rows_equal(r, e, False) for r, e in zip(replay1, eager1))
            eq_new_exact = sum(_rows_equal(r, e, True) for r, e in zip(replay1, eager1))
            eq_before = sum(_rows_equal(r, b, False) for r, b in zip(replay1, replay0))
            # eager with the capture-time permutation written into the live one
            live = {n: p for n, p in live_perms().items() if p is not None}
            saved = {n: p.clone() for n, p in live.items()}
            for n, p in live.items():
                if n in capture_perms and capture_perms[n].shape == p.shape:
                    p.copy_(capture_perms[n])
            eager_old = [model(c.x) for c in captured]
            for n, p in live.items():
                p.copy_(saved[n])
            eq_oldperm = sum(_rows_equal(r, e, False) for r, e in zip(replay1, eager_old))
            eq_oldperm_exact = sum(_rows_equal(r, e, True) for r, e in zip(replay1, eager_old))
            # an act-order change in place: flip the permutation an eager forward reads now
            for p in live.values():
                p.copy_(p.flip(0))
            replay2 = [c.run() for c in captured]
            eager2 = [model(c.x) for c in captured]
            for p in live.values():
                p.copy_(p.flip(0))
            eager_changed = rows - sum(_rows_equal(a, b, True) for a, b in zip(eager2, eager1))
            replay_changed = rows - sum(_rows_equal(a, b, True) for a, b in zip(replay2, replay1))
            max_err = max(float((r - e).abs().max()) for r, e in zip(replay1, eager1))
            fig = dict(rows=rows, replay_eq_eager_before_reload=sane, stale_like_edges=stale_edges,
                       replay_eq_eager_new=eq_new, replay_eq_eager_new_exact=eq_new_exact,
                       replay_eq_replay_before=eq_before, replay_eq_eager_capture_perm=eq_oldperm,
                       replay_eq_eager_capture_perm_exact=eq_oldperm_exact,
                       flip_eager_changed=eager_changed, flip_replay_changed=replay_changed,
                       max_abs_replay_minus_eager=max_err, reload=used)
            figures[variant] = fig
            ctx.figure("variants", figures)
            ctx.line(f"{variant}: before reload replay==eager {sane}/{rows}; after reload "
                     f"(new weights + new act order, {used}) replay==eager(new) {eq_new}/{rows} "
                     f"[exact {eq_new_exact}], replay==eager(new weights, capture-time perm) "
                     f"{eq_oldperm}/{rows} [exact {eq_oldperm_exact}], max |replay-eager| "
                     f"{max_err:.3g}; stale-like edges {stale_edges}")
            ctx.line(f"{variant}: act order flipped in place: eager rows changed "
                     f"{eager_changed}/{rows}, replayed rows changed {replay_changed}/{rows}")
            ctx.expect(sane == rows, f"{variant}: replay != eager before any reload ({sane}/{rows})")
            ctx.expect(eager_changed == rows, f"{variant}: flip changed {eager_changed}/{rows} eager rows")
            if variant in stale_variants:
                ok = replay_changed == 0 and stale_edges > 0
                if variant != "rejected-fix":  # its registered storage is refreshed in place
                    ok = ok and eq_new == 0 and eq_oldperm == rows
                ctx.expect(ok, f"{variant}: expected a stale read on {what}")
                if ok and variant == "rejected-fix":
                    ctx.line(f"  -> STALE READ on {what}: the graphs read the registered perm "
                             "(refreshed by the reload) while eager reads act_perm's detached "
                             "copy; an in-place update of that copy never reaches the graphs")
                elif ok:
                    ctx.line(f"  -> STALE READ on {what}: the graphs compute with the "
                             "capture-time permutation while eager follows the live one")
            else:
                ok = replay_changed == rows and eq_new == rows and stale_edges == 0
                ctx.expect(ok, f"{variant}: expected replay to follow the live model")
                if ok:
                    ctx.line(f"  -> CLEAN: {what} follows every update, as eager does")
            del captured, model, tr, report
            if device.type == "cuda":
                torch.cuda.synchronize()


# ======================================================================================
# CUDA graph kernel nodes through libcuda (ctypes)
# ======================================================================================

# CUgraphNodeType
NODE_TYPES = {0: "kernel", 1: "memcpy", 2: "memset", 3: "host", 4: "graph", 5: "empty",
              6: "wait_event", 7: "event_record", 8: "ext_semas_signal", 9: "ext_semas_wait",
              10: "mem_alloc", 11: "mem_free", 12: "batch_mem_op", 13: "conditional"}
CU_LAUNCH_PARAM_END, CU_LAUNCH_PARAM_BUFFER_POINTER, CU_LAUNCH_PARAM_BUFFER_SIZE = 0, 1, 2
MAX_PARAMS = 4096
FALLBACK_SPAN = 4096  # bytes scanned at most from the first parameter when sizes are unknown
SCAN_TAIL = 32       # bytes read from the last parameter's start when its size is unknown


def decode_kernel_node_params(buf: bytes) -> dict:
    """CUDA_KERNEL_NODE_PARAMS(_v2) as libcuda fills it (x86-64 layout):
    func @0, gridDim @8, blockDim @20, sharedMemBytes @32, kernelParams @40, extra @48,
    kern @56 and ctx @64 (v2 only)."""
    func, = struct.unpack_from("<Q", buf, 0)
    grid = struct.unpack_from("<3I", buf, 8)
    block = struct.unpack_from("<3I", buf, 20)
    shmem, = struct.unpack_from("<I", buf, 32)
    kparams, extra, kern, ctxp = struct.unpack_from("<4Q", buf, 40)
    return {"func": func, "grid": grid, "block": block, "shared_mem": shmem,
            "kernel_params": kparams, "extra": extra, "kern": kern, "ctx": ctxp}


def decode_memcpy3d(buf: bytes) -> list[int]:
    """Device addresses of a CUDA_MEMCPY3D (source and destination, byte offset applied)."""
    src_x, = struct.unpack_from("<Q", buf, 0)
    src_type, = struct.unpack_from("<I", buf, 32)
    src_dev, = struct.unpack_from("<Q", buf, 48)
    dst_x, = struct.unpack_from("<Q", buf, 88)
    dst_type, = struct.unpack_from("<I", buf, 120)
    dst_dev, = struct.unpack_from("<Q", buf, 136)
    out = []
    for kind, dev, x in ((src_type, src_dev, src_x), (dst_type, dst_dev, dst_x)):
        if kind in (2, 4) and dev:  # CU_MEMORYTYPE_DEVICE, CU_MEMORYTYPE_UNIFIED
            out.append(dev + x)
    return out


def decode_memset(buf: bytes) -> list[int]:
    dst, = struct.unpack_from("<Q", buf, 0)
    return [dst] if dst else []


def parse_extra(read: Callable[[int, int], bytes], extra: int) -> tuple[int, int] | None:
    """The (buffer, size) a launch's `extra` array names (CU_LAUNCH_PARAM_BUFFER_*)."""
    buf = size = None
    for i in range(16):
        key, value = struct.unpack("<QQ", read(extra + 16 * i, 16))
        if key == CU_LAUNCH_PARAM_END:
            break
        if key == CU_LAUNCH_PARAM_BUFFER_POINTER:
            buf = value
        elif key == CU_LAUNCH_PARAM_BUFFER_SIZE and value:
            size, = struct.unpack("<Q", read(value, 8))
    return (buf, size) if buf and size else None


def param_blobs(read: Callable[[int, int], bytes], kernel_params: int, extra: int,
                param_info: list[tuple[int, int]] | None
                ) -> tuple[list[tuple[int, int, int, bool]], str]:
    """Pointer-sized words of one kernel node's arguments, and how they were read.

    With `param_info` (offset, size per parameter, from cuFuncGetParamInfo): each argument
    is read at its size (`kernelParams[i]` points to its value; with an `extra` buffer, at
    its offset) and split by `coverage.param_words`. Without it, the argument block is
    scanned conservatively: `kernelParams[0]` is taken as the start of the driver's
    contiguous copy, the array is followed while its entries stay inside FALLBACK_SPAN
    bytes of it, and every aligned word up to SCAN_TAIL bytes past the last entry (same
    page) is a candidate.
    """
    if param_info is not None:
        blobs = []
        if kernel_params:
            for i, (_off, size) in enumerate(param_info):
                ptr, = struct.unpack("<Q", read(kernel_params + 8 * i, 8))
                blobs.append((i, read(ptr, size) if ptr and size else b""))
            return cov.param_words(blobs), "param-info"
        if extra:
            found = parse_extra(read, extra)
            if found:
                buf, size = found
                data = read(buf, size)
                blobs = [(i, data[off:off + sz]) for i, (off, sz) in enumerate(param_info)]
                return cov.param_words(blobs), "param-info+extra"
        return [], "no-params"
    if kernel_params:
        entries = []
        for i in range(MAX_PARAMS):
            p, = struct.unpack("<Q", read(kernel_params + 8 * i, 8))
            if p == 0 or (entries and not (entries[0] <= p < entries[0] + FALLBACK_SPAN)):
                break
            entries.append(p)
        if not entries:
            return [], "scan-empty"
        # the last argument's size is unknown: read SCAN_TAIL bytes past its start, but
        # never across a page boundary (an unmapped next page would be a crash)
        last = max(entries)
        end = min(last + SCAN_TAIL, (last // 4096 + 1) * 4096)
        end = max(end, last + 8)
        try:
            data = read(entries[0], end - entries[0])
        except Exception:  # noqa: BLE001 - a reader that can refuse (tests' fake memory)
            data = read(entries[0], last + 8 - entries[0])
        return [(0, off, v, True) for off, v in cov.scan_words(data)], "scan"
    if extra:
        found = parse_extra(read, extra)
        if found:
            buf, size = found
            return [(0, off, v, True) for off, v in cov.scan_words(read(buf, size))], "scan-extra"
    return [], "no-params"


def _read_memory(addr: int, n: int) -> bytes:
    return ctypes.string_at(addr, n)


class CudaDriver:
    """The few libcuda entry points used to read a captured graph (ctypes, no bindings)."""

    def __init__(self, path: str | None = None):
        last = None
        for name in ((path,) if path else ("libcuda.so.1", "libcuda.so")):
            try:
                self.lib = ctypes.CDLL(name)
                self.path = name
                break
            except OSError as exc:
                last = exc
        else:
            raise OSError(f"libcuda not found: {last}")
        c_int, c_void_p, c_size_t, c_char_p = ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p
        P = ctypes.POINTER
        self.available: dict[str, bool] = {}

        def bind(names, argtypes, required=True):
            for n in names:
                fn = getattr(self.lib, n, None)
                if fn is not None:
                    fn.argtypes = argtypes
                    fn.restype = c_int
                    self.available[names[0]] = True
                    return fn
            self.available[names[0]] = False
            if required:
                raise OSError(f"libcuda has none of {names}")
            return None

        self.cuDriverGetVersion = bind(["cuDriverGetVersion"], [P(c_int)])
        self.cuGetErrorName = bind(["cuGetErrorName"], [c_int, P(c_char_p)], required=False)
        self.cuGraphGetNodes = bind(["cuGraphGetNodes"], [c_void_p, P(c_void_p), P(c_size_t)])
        self.cuGraphNodeGetType = bind(["cuGraphNodeGetType"], [c_void_p, P(c_int)])
        self.cuGraphKernelNodeGetParams = bind(
            ["cuGraphKernelNodeGetParams_v2", "cuGraphKernelNodeGetParams"], [c_void_p, c_void_p])
        self.cuFuncGetName = bind(["cuFuncGetName"], [P(c_char_p), c_void_p], required=False)
        self.cuFuncGetParamInfo = bind(["cuFuncGetParamInfo"],
                                       [c_void_p, c_size_t, P(c_size_t), P(c_size_t)], required=False)
        self.cuKernelGetFunction = bind(["cuKernelGetFunction"], [P(c_void_p), c_void_p], required=False)
        self.cuKernelGetName = bind(["cuKernelGetName"], [P(c_char_p), c_void_p], required=False)
        self.cuGraphChildGraphNodeGetGraph = bind(["cuGraphChildGraphNodeGetGraph"],
                                                  [c_void_p, P(c_void_p)], required=False)
        self.cuGraphMemcpyNodeGetParams = bind(["cuGraphMemcpyNodeGetParams"], [c_void_p, c_void_p],
                                               required=False)
        self.cuGraphMemsetNodeGetParams = bind(["cuGraphMemsetNodeGetParams"], [c_void_p, c_void_p],
                                               required=False)
        self.errors: list[str] = []
        v = ctypes.c_int(0)
        self.check(self.cuDriverGetVersion(ctypes.byref(v)), "cuDriverGetVersion")
        self.version = v.value
        self.version_text = f"{v.value // 1000}.{(v.value % 1000) // 10}"

    def error_name(self, rc: int) -> str:
        if self.cuGetErrorName is None:
            return str(rc)
        s = ctypes.c_char_p()
        if self.cuGetErrorName(rc, ctypes.byref(s)) == 0 and s.value:
            return f"{s.value.decode()} ({rc})"
        return str(rc)

    def check(self, rc: int, what: str) -> None:
        if rc != 0:
            raise RuntimeError(f"{what} failed: {self.error_name(rc)}")

    # -- graph walking -------------------------------------------------------------------
    def nodes(self, graph: int) -> list[int]:
        n = ctypes.c_size_t(0)
        self.check(self.cuGraphGetNodes(ctypes.c_void_p(graph), None, ctypes.byref(n)), "cuGraphGetNodes")
        arr = (ctypes.c_void_p * max(n.value, 1))()
        self.check(self.cuGraphGetNodes(ctypes.c_void_p(graph), arr, ctypes.byref(n)), "cuGraphGetNodes")
        return [int(arr[i] or 0) for i in range(n.value)]

    def node_type(self, node: int) -> int:
        t = ctypes.c_int(-1)
        self.check(self.cuGraphNodeGetType(ctypes.c_void_p(node), ctypes.byref(t)), "cuGraphNodeGetType")
        return t.value

    def func_name(self, func: int, kern: int) -> str:
        s = ctypes.c_char_p()
        if func and self.cuFuncGetName is not None:
            if self.cuFuncGetName(ctypes.byref(s), ctypes.c_void_p(func)) == 0 and s.value:
                return s.value.decode(errors="replace")
        if kern and self.cuKernelGetName is not None:
            if self.cuKernelGetName(ctypes.byref(s), ctypes.c_void_p(kern)) == 0 and s.value:
                return s.value.decode(errors="replace")
        return f"function@{func or kern:#x}"

    def param_info(self, func: int) -> list[tuple[int, int]] | None:
        if not func or self.cuFuncGetParamInfo is None:
            return None
        out = []
        off, size = ctypes.c_size_t(0), ctypes.c_size_t(0)
        for i in range(MAX_PARAMS):
            rc = self.cuFuncGetParamInfo(ctypes.c_void_p(func), i, ctypes.byref(off), ctypes.byref(size))
            if rc != 0:
                # CUDA_ERROR_INVALID_VALUE (1) / NOT_FOUND (500) past the last parameter;
                # anything else on the first call: no information for this function
                if i == 0 and rc not in (1, 500):
                    return None
                break
            out.append((off.value, size.value))
        return out

    def read_graph(self, graph: int, read=_read_memory, depth: int = 0) -> tuple[list, dict]:
        """(KernelNode list, counts by node type and by parameter reading method)."""
        if depth == 0:
            self.errors = []
        nodes, counts = [], {}
        for node in self.nodes(graph):
            kind = NODE_TYPES.get(self.node_type(node), "other")
            counts[kind] = counts.get(kind, 0) + 1
            idx = len(nodes)
            if kind == "kernel":
                try:
                    buf = ctypes.create_string_buffer(512)
                    self.check(self.cuGraphKernelNodeGetParams(ctypes.c_void_p(node), buf),
                               "cuGraphKernelNodeGetParams")
                    p = decode_kernel_node_params(buf.raw)
                    func = p["func"]
                    if not func and p["kern"] and self.cuKernelGetFunction is not None:
                        f = ctypes.c_void_p()
                        if self.cuKernelGetFunction(ctypes.byref(f), ctypes.c_void_p(p["kern"])) == 0:
                            func = int(f.value or 0)
                    name = self.func_name(func, p["kern"])
                    info = self.param_info(func)
                    words, method = param_blobs(read, p["kernel_params"], p["extra"], info)
                    if info == [] and p["kernel_params"]:
                        method = "param-info-empty"  # no parameters, says the driver
                except Exception as exc:  # noqa: BLE001 - one unreadable node, not the graph
                    counts["errors"] = counts.get("errors", 0) + 1
                    self.errors.append(f"node {idx}: {type(exc).__name__}: {exc}")
                    continue
                counts[f"params:{method}"] = counts.get(f"params:{method}", 0) + 1
                nodes.append(cov.KernelNode.from_words(name, words, node=idx))
            elif kind == "memcpy" and self.cuGraphMemcpyNodeGetParams is not None:
                buf = ctypes.create_string_buffer(512)
                if self.cuGraphMemcpyNodeGetParams(ctypes.c_void_p(node), buf) == 0:
                    nodes.append(cov.KernelNode("memcpy", decode_memcpy3d(buf.raw), node=idx, kind="memcpy"))
            elif kind == "memset" and self.cuGraphMemsetNodeGetParams is not None:
                buf = ctypes.create_string_buffer(512)
                if self.cuGraphMemsetNodeGetParams(ctypes.c_void_p(node), buf) == 0:
                    nodes.append(cov.KernelNode("memset", decode_memset(buf.raw), node=idx, kind="memset"))
            elif kind == "graph" and self.cuGraphChildGraphNodeGetGraph is not None and depth < 4:
                child = ctypes.c_void_p()
                if self.cuGraphChildGraphNodeGetGraph(ctypes.c_void_p(node), ctypes.byref(child)) == 0:
                    sub, sub_counts = self.read_graph(int(child.value or 0), read, depth + 1)
                    for n in sub:
                        n.node = len(nodes)
                        nodes.append(n)
                    for k, v in sub_counts.items():
                        counts[k] = counts.get(k, 0) + v
        return nodes, counts


# ======================================================================================
# Triton launches through DebugMode's hook
# ======================================================================================

class _NoSyncCall:
    """Returned to Inductor instead of DebugMode's call record: its finalize() would
    synchronize the device, which is illegal while a CUDA graph is being captured."""

    def finalize(self, *args, **kwargs):
        return None

    def __getattr__(self, name):
        return lambda *a, **k: None


def make_launch_recorder():
    """A DebugMode that keeps only Inductor's Triton launches: (kernel, arg, storage range).

    Inductor's launcher calls `get_active_debug_mode().record_triton_kernel(kernel_name,
    kwargs)` for every launch while a DebugMode is on the dispatch mode stack. Raises when
    this torch has no such hook.
    """
    import torch
    from torch.utils._debug_mode import DebugMode

    if not hasattr(DebugMode, "record_triton_kernel"):
        raise RuntimeError(f"torch {torch.__version__}: DebugMode has no record_triton_kernel")

    class TritonLaunchRecorder(DebugMode):
        def __init__(self):
            try:
                super().__init__(record_realtensor=False, record_output=False)
            except TypeError:
                super().__init__()
            self.launches: list[tuple[str, list]] = []

        def record_triton_kernel(self, kernel_name, kwargs):
            rows = []
            for arg, v in dict(kwargs).items():
                if isinstance(v, torch.Tensor):
                    try:
                        st = v.untyped_storage()
                        rows.append((arg, int(st.data_ptr()), int(st.nbytes()), int(v.data_ptr()),
                                     cov.triton_arg_access(arg)))
                    except Exception:  # noqa: BLE001 - a tensor without storage
                        continue
            self.launches.append((str(kernel_name), rows))
            return _NoSyncCall()

        def frame(self):
            import pandas as pd

            recs = [(k, a, p, n, dp, acc or "") for k, rows in self.launches
                    for a, p, n, dp, acc in rows]
            df = pd.DataFrame(recs, columns=["kernel", "arg", "data_ptr", "nbytes", "view_ptr", "access"])
            df["label"] = df["kernel"] + ":" + df["arg"]
            return df

    return TritonLaunchRecorder()


@contextlib.contextmanager
def recording_mode_ignores_compile_internals(enabled: bool = True):
    """Let Dynamo run compiled code while graphtrace's RecordingMode is on the stack.

    Dynamo skips compiled frames (runs them eagerly) while a TorchDispatchMode whose
    `ignore_compile_internals()` is False is active; RecordingMode does not override it.
    This patches the class for the duration of one capture to measure the compiled code.
    """
    from graphtrace.recorder import RecordingMode

    if not enabled:
        yield
        return
    had = "ignore_compile_internals" in RecordingMode.__dict__
    old = RecordingMode.__dict__.get("ignore_compile_internals")
    RecordingMode.ignore_compile_internals = classmethod(lambda cls: True)
    try:
        yield
    finally:
        if had:
            RecordingMode.ignore_compile_internals = old
        else:
            del RecordingMode.ignore_compile_internals


def dispatched_ops(fn, x) -> int:
    """How many ops of one call reach the dispatcher, counted by a DebugMode (which declares
    ignore_compile_internals, so compiled code stays compiled under it). A compiled model
    shows its extern kernels only; one that fell back to eager shows every op."""
    import torch

    try:
        from torch.utils._debug_mode import DebugMode

        with torch.no_grad(), DebugMode() as dm:
            fn(x)
    except Exception:  # noqa: BLE001 - no DebugMode in this torch: no count
        return -1
    names = [type(op).__name__ for op in dm.operators]
    if any("OpCall" in n for n in names):
        return sum(1 for n in names if "OpCall" in n)
    return sum(1 for n in names if "Triton" not in n)


# ======================================================================================
# models for coverage
# ======================================================================================

def make_small_net(device, d: int = 256, h: int = 512, seed: int = 0):
    """Linear -> RMS norm (weight) -> gelu * scale (buffer) -> act_perm (a partial holding
    a permutation, as the seed's kernel did) -> Linear. Compiled, everything between the two
    GEMMs fuses into Triton kernels the dispatcher never sees."""
    import torch
    import torch.nn.functional as F

    class SmallNet(torch.nn.Module):
        def __init__(self):
            super().__init__()
            g = torch.Generator().manual_seed(seed)
            self.fc1 = torch.nn.Linear(d, h)
            self.norm_weight = torch.nn.Parameter(1 + 0.1 * torch.randn(h, generator=g))
            self.register_buffer("scale", 0.5 + torch.rand(h, generator=g))
            self.fc2 = torch.nn.Linear(h, d)
            self.set_perm(torch.randperm(h, generator=g))
            self.requires_grad_(False)
            self.to(device)
            self.set_perm(self.act_perm.keywords["index"].to(device))

        def set_perm(self, perm):
            """What PWAL does on every (re)load: a new tensor bound into a partial."""
            self.act_perm = functools.partial(torch.index_select, dim=1, index=perm)

        def forward(self, x):
            y = self.fc1(x)
            y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + 1e-6) * self.norm_weight
            y = F.gelu(y) * self.scale
            return self.fc2(self.act_perm(y))

    return SmallNet()


def _owned_frame(model):
    """Storages the model owns now: data_ptr, nbytes, label (owner paths), via graphtrace."""
    import pandas as pd

    from graphtrace.owners import walk_owners

    by_ptr: dict[int, list] = {}
    for path, kind, t in walk_owners(model):
        try:
            st = t.untyped_storage()
            key = (int(st.data_ptr()), int(st.nbytes()))
        except Exception:  # noqa: BLE001
            continue
        if key[0] and key[1]:
            by_ptr.setdefault(key, []).append(path)
    rows = [(p, n, "; ".join(sorted(set(paths)))) for (p, n), paths in by_ptr.items()]
    return pd.DataFrame(rows, columns=["data_ptr", "nbytes", "label"])


def _allocator_frame():
    import pandas as pd
    import torch

    rows = []
    for seg in torch.cuda.memory_snapshot():
        rows.append((int(seg["address"]), int(seg["total_size"]),
                     f"allocator segment (pool {seg.get('segment_pool_id', '?')}, "
                     f"{seg.get('segment_type', '?')})"))
    return pd.DataFrame(rows, columns=["data_ptr", "nbytes", "label"])


def _cuda_capture_keep(fn, x, label: str, recorder=None):
    """Capture fn(x) into a CUDAGraph(keep_graph=True) (warm-up on a side stream first)."""
    import torch

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            fn(x)
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph(keep_graph=True)
    graph.graphtrace_label = label
    with torch.cuda.graph(graph):
        if recorder is not None:
            with recorder:
                y = fn(x)
        else:
            y = fn(x)
    graph.instantiate()
    return graph, y


def _emulated_capture_keep(fn, x, label: str, recorder=None):
    """CPU stand-in for `_cuda_capture_keep` (tests rehearse `_measure` with it): an
    emulated graph (graphtrace.capture); `raw_cuda_graph()` returns 0."""
    import graphtrace as gt

    for _ in range(2):
        fn(x)
    with gt.capture(label) as g:
        if recorder is not None:
            with recorder:
                y = fn(x)
        else:
            y = fn(x)

    class _Graph:
        replay = g.replay

        @staticmethod
        def raw_cuda_graph():
            return 0

    return _Graph(), y


def _sync(t) -> None:
    import torch

    if getattr(t, "is_cuda", False):
        torch.cuda.synchronize()


def _graph_id(trace, label: str) -> int | None:
    ids = [c.graph_id for c in trace.captures if c.label == label]
    return ids[-1] if ids else None


def _measure(ctx: Ctx, key: str, *, model, fn, x, driver, compiled: bool, patch: bool,
             use_hook: bool, rebind: Callable | None, eager_fn=None,
             capture_fn: Callable = _cuda_capture_keep, memory_fn: Callable | None = None) -> dict:
    """Capture fn(x) in a traced CUDA graph, read its kernel nodes, compute coverage; then
    rebind (a reload), diff, and compare real replay with eager. (`capture_fn`,
    `memory_fn`: CPU stand-ins in the tests.)"""
    import torch

    import graphtrace as gt
    from graphtrace.owners import walk_owners

    fig: dict[str, Any] = {"compiled": compiled, "patched_mode": patch}
    recorder = None
    if use_hook:
        try:
            recorder = make_launch_recorder()
        except Exception as exc:  # noqa: BLE001
            ctx.unavailable(f"{key}: DebugMode Triton hook", exc)
    keep = []  # capture-time tensors, kept alive as capture artifacts would
    with torch.no_grad():
        with gt.trace() as tr, recording_mode_ignores_compile_internals(patch):
            graph, y = capture_fn(fn, x, key, recorder)
        tr.watch(model)  # after the capture: no module attribution around compiled code
        gid = _graph_id(tr, key)
        owned = _owned_frame(model)
        keep.extend(t for _, _, t in walk_owners(model))
        memory = (memory_fn or _allocator_frame)()
        nodes, counts = driver.read_graph(graph.raw_cuda_graph())
        fig["node_counts"] = counts
        for err in getattr(driver, "errors", [])[:5]:
            ctx.line(f"{key}: kernel node not read: {err}")
        hook = recorder.frame() if recorder is not None else None
        fig["triton_launches_hooked"] = len(recorder.launches) if recorder is not None else None
        fig["triton_kernel_nodes"] = sum(1 for n in nodes if "triton" in n.name)
        acc = tr.accesses
        fig["ops_recorded"] = int(acc[acc["graph_id"] == gid]["seq"].nunique()) if gid is not None else 0
        fig["op_names"] = sorted(set(acc[acc["graph_id"] == gid]["op"].astype(str))) if gid is not None else []
        before_report = tr.diff()
        res = cov.graph_coverage(nodes, before_report.storages, before_report.accesses, gid,
                                 owned=owned, memory=memory, hook=hook)
        t = res.totals
        fig["coverage"] = {k: t[k] for k in ("kernels", "pointers", "attributed", "coverage",
                                             "attributed_with_hook", "coverage_with_hook", "owned",
                                             "owned_attributed", "owned_coverage", "unseen_owners",
                                             "seen_freed")}
        ctx.table(f"gpu_coverage_kernels_{key}", res.per_kernel.assign(case=key))
        ctx.table(f"gpu_coverage_pointers_{key}", res.pointers.assign(case=key).astype({"value": str, "range_start": str}))
        graph.replay()
        _sync(y)
        replay_before = y.clone()
        rows = int(replay_before.shape[0])
        fig["rows"] = rows
        fig["replay_eq_eager_before_rebind"] = _rows_equal(replay_before, (eager_fn or fn)(x), False)
        if rebind is not None:
            rebind()
            report = tr.diff()
            edges = report.edges
            stale = edges[edges["verdict"].astype(str).isin(STALE_LIKE)]
            fig["stale_like_edges"] = int(len(stale))
            fig["stale_owners"] = sorted({o for s in stale["owners"].astype(str) for o in s.split("; ") if o})
            graph.replay()
            _sync(y)
            replay_after = y.clone()
            eager_after = (eager_fn or fn)(x)
            fig["replay_eq_eager_after_rebind"] = _rows_equal(replay_after, eager_after, False)
            fig["replay_changed_by_rebind"] = rows - _rows_equal(replay_after, replay_before, True)
        del graph
    ctx.line(f"{key}: {len(nodes)} graph nodes {counts}; Triton kernel nodes "
             f"{fig['triton_kernel_nodes']}; dispatcher ops recorded {fig['ops_recorded']}"
             + (f"; Triton launches seen by the DebugMode hook {fig['triton_launches_hooked']}"
                if recorder is not None else ""))
    for ln in cov.format_coverage(res.per_kernel, res.total, indent="  ", max_rows=25):
        ctx.line(f"{key}{ln}" if ln.startswith("  total") else ln)
    for note in res.notes:
        ctx.line(f"  note: {note}")
    ctx.line(f"{key}: replay==eager before the rebind {fig['replay_eq_eager_before_rebind']}/{rows}")
    if rebind is not None:
        ctx.line(f"{key}: after the rebind: stale-like edges {fig['stale_like_edges']} "
                 f"{fig['stale_owners'][:4]}; replay==eager {fig['replay_eq_eager_after_rebind']}"
                 f"/{fig['rows']}; replayed rows changed {fig['replay_changed_by_rebind']}/{fig['rows']}")
    return fig


def check_coverage_eager(ctx: Ctx) -> None:
    """Kernel-node coverage of eager models' real graphs: the method's baseline."""
    import torch

    from graphtrace.demo.model import DemoModel

    driver = CudaDriver()
    ctx.line(f"libcuda driver API {driver.version_text}; cuFuncGetParamInfo "
             f"{'available: arguments read at their sizes' if driver.cuFuncGetParamInfo else 'MISSING: argument blocks scanned conservatively (8-byte words)'}")
    figures = {}
    with ctx.step("small-net eager"):
        torch.manual_seed(0)
        model = make_small_net("cuda")
        x = torch.randn(8, 256, device="cuda")
        old = model.act_perm.keywords["index"]
        new = torch.randperm(old.numel(), device="cuda")

        def rebind():
            model.set_perm(new)

        figures["small-net-eager"] = f = _measure(
            ctx, "small-net-eager", model=model, fn=model, x=x, driver=driver, compiled=False,
            patch=False, use_hook=False, rebind=rebind)
        c = f["coverage"]
        ctx.expect(c["owned"] > 0 and c["owned_attributed"] == c["owned"],
                   f"small-net-eager: model-owned pointers attributed {c['owned_attributed']}/{c['owned']}")
        ctx.expect(any("act_perm" in o for o in f["stale_owners"]),
                   "small-net-eager: the rebound act_perm was not flagged")
        ctx.figure("cases", figures)
    with ctx.step("demo-model eager"):
        model = DemoModel("unfixed-partial", n_layers=ctx.args.layers, seed=0, device="cuda",
                          reload_backend=ctx.args.backend)
        x = model.make_input(4)
        from graphtrace.demo.reload import reload

        def rebind():
            reload(model, model.make_checkpoint(1, 2), backend=ctx.args.backend)

        figures["demo-unfixed-partial-eager"] = f = _measure(
            ctx, "demo-unfixed-partial-eager", model=model, fn=model, x=x, driver=driver,
            compiled=False, patch=False, use_hook=False, rebind=rebind)
        c = f["coverage"]
        ctx.expect(c["owned"] > 0 and c["owned_attributed"] == c["owned"],
                   f"demo eager: model-owned pointers attributed {c['owned_attributed']}/{c['owned']}")
        ctx.figure("cases", figures)


def _compile(model, ctx: Ctx):
    import torch

    return torch.compile(model, dynamic=False)


def check_coverage_compiled(ctx: Ctx) -> None:
    """torch.compile'd models in real graphs: what the dispatcher misses, what the hook adds."""
    import torch

    from graphtrace.demo.model import DemoModel
    from graphtrace.demo.reload import reload

    driver = CudaDriver()
    probes = probe_torch_features()
    ctx.line("DebugMode Triton hook: " + ("present" if probes["debugmode_triton_hook"][0] else
                                          "MISSING") + f" ({probes['debugmode_triton_hook'][1]})")
    figures = {}

    def small_case(key: str, patch: bool):
        torch._dynamo.reset()  # a frame Dynamo once skipped stays skipped
        torch.manual_seed(0)
        model = make_small_net("cuda")
        compiled = _compile(model, ctx)
        x = torch.randn(8, 256, device="cuda")
        t = time.perf_counter()
        with torch.no_grad():
            compiled(x)
            compiled(x)
        torch.cuda.synchronize()
        ctx.line(f"{key}: compiled and warmed up in {time.perf_counter() - t:.1f} s; "
                 f"{dispatched_ops(compiled, x)} ops reach the dispatcher per call "
                 f"(eager {dispatched_ops(model, x)})")
        new = torch.randperm(512, device="cuda")

        def rebind():
            model.set_perm(new)

        f = _measure(ctx, key, model=model, fn=compiled, x=x, driver=driver, compiled=True,
                     patch=patch, use_hook=True, rebind=rebind, eager_fn=model)
        f["ops_per_call_after"] = dispatched_ops(compiled, x)
        f["ops_per_call_eager"] = dispatched_ops(model, x)
        figures[key] = f
        ctx.figure("cases", figures)
        return f

    with ctx.step("small-net compiled, RecordingMode.ignore_compile_internals"):
        f = small_case("small-net-compiled", patch=True)
        c = f["coverage"]
        ctx.expect(f["triton_kernel_nodes"] > 0, "small-net-compiled: no Triton kernel in the graph")
        ctx.line(f"small-net-compiled: model-owned pointers attributed by the dispatcher "
                 f"{c['owned_attributed']}/{c['owned']}; unseen owners: {c['unseen_owners'] or '-'}")
        if f.get("triton_launches_hooked") is not None:
            ctx.line(f"small-net-compiled: with the DebugMode hook: {c['attributed_with_hook']}/"
                     f"{c['pointers']} pointers attributed")
        blind = f["stale_like_edges"] == 0 and f["replay_eq_eager_after_rebind"] < f["rows"]
        ctx.line(f"small-net-compiled: after rebinding act_perm: stale-like edges "
                 f"{f['stale_like_edges']}, replay==eager {f['replay_eq_eager_after_rebind']}/{f['rows']}"
                 f" -> {'a stale read graphtrace does NOT flag (blind spot)' if blind else 'see figures'}")
    with ctx.step("small-net compiled, graphtrace as is"):
        f = small_case("small-net-compiled-asis", patch=False)
        ran = "compiled code" if f["triton_kernel_nodes"] else "EAGERLY (Dynamo skipped the frame)"
        f["ran"] = ran
        ctx.line(f"small-net-compiled-asis: under graphtrace's RecordingMode the compiled model "
                 f"ran {ran}; afterwards, outside any trace, {f['ops_per_call_after']} ops reach "
                 f"the dispatcher per call (eager {f['ops_per_call_eager']})")
        ctx.figure("cases", figures)
    with ctx.step("demo model compiled (unfixed-lambda)"):
        torch._dynamo.reset()
        model = DemoModel("unfixed-lambda", n_layers=ctx.args.layers, seed=0, device="cuda",
                          reload_backend=ctx.args.backend)
        compiled = _compile(model, ctx)
        x = model.make_input(4)
        t = time.perf_counter()
        with torch.no_grad():
            compiled(x)
            compiled(x)
        torch.cuda.synchronize()
        ctx.line(f"demo-unfixed-lambda-compiled: compiled and warmed up in "
                 f"{time.perf_counter() - t:.1f} s")

        def rebind():
            reload(model, model.make_checkpoint(1, 2), backend=ctx.args.backend)

        f = _measure(ctx, "demo-unfixed-lambda-compiled", model=model, fn=compiled, x=x,
                     driver=driver, compiled=True, patch=True, use_hook=True, rebind=rebind,
                     eager_fn=model)
        figures["demo-unfixed-lambda-compiled"] = f
        ctx.figure("cases", figures)
        perm_flagged = [o for o in f["stale_owners"] if "act_perm" in o]
        ctx.line(f"demo-unfixed-lambda-compiled: act_perm reads flagged after the reload: "
                 f"{len(perm_flagged)}; replay==eager {f['replay_eq_eager_after_rebind']}/{f['rows']}")


# ======================================================================================
# compile on the CPU: what the recorder sees of compiled code (no kernel nodes)
# ======================================================================================

def check_compile_cpu(ctx: Ctx) -> None:
    import torch

    import graphtrace as gt
    from graphtrace.demo.model import DemoModel
    from graphtrace.demo.reload import reload

    torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))
    figures = {}

    def run(key, make, x_of, rebind_of, modes=("eager", "compiled-patched", "compiled-asis")):
        out = {}
        for mode in modes:
            model = make()
            x = x_of(model)
            fn = model
            if mode != "eager":
                torch._dynamo.reset()  # a frame Dynamo once skipped stays skipped
                fn = torch.compile(model, dynamic=False)
                t = time.perf_counter()
                with torch.no_grad():
                    fn(x)
                    fn(x)
                ctx.line(f"{key} {mode}: compiled in {time.perf_counter() - t:.1f} s; "
                         f"{dispatched_ops(fn, x)} ops reach the dispatcher per call "
                         f"(eager: {dispatched_ops(model, x)})")
            with torch.no_grad(), gt.trace() as tr, \
                    recording_mode_ignores_compile_internals(mode == "compiled-patched"):
                with gt.capture(key):
                    fn(x)
            if mode == "compiled-asis":
                after = dispatched_ops(fn, x)
                out_after = f"{after} ops per call after the traced call, outside any trace"
                ctx.line(f"{key} {mode}: {out_after}")
            tr.watch(model)
            acc = tr.accesses
            rep0 = tr.diff()
            owned_seen = sorted({o for s in rep0.edges["owners"].astype(str) for o in s.split("; ") if o})
            rebind_of(model)()
            rep = tr.diff()
            stale = rep.edges[rep.edges["verdict"].astype(str).isin(STALE_LIKE)]
            stale_owners = sorted({o for s in stale["owners"].astype(str) for o in s.split("; ") if o})
            out[mode] = {"ops": int(acc["seq"].nunique()),
                         "op_names": sorted(set(acc["op"].astype(str))),
                         "owned_seen": owned_seen, "stale_owners": stale_owners}
            if mode == "compiled-asis":
                out[mode]["ops_per_call_after"] = after
            ctx.line(f"{key} {mode}: {out[mode]['ops']} ops recorded "
                     f"({', '.join(out[mode]['op_names'][:6])}{'...' if len(out[mode]['op_names']) > 6 else ''}); "
                     f"owned storages seen {len(owned_seen)}; stale-like owners after the reload "
                     f"{len(stale_owners)}")
        eager_owned = set(out["eager"]["owned_seen"])
        for mode in out:
            if mode == "eager":
                continue
            missing = sorted(eager_owned - set(out[mode]["owned_seen"]))
            out[mode]["owned_missing_vs_eager"] = missing
            lost = sorted(set(out["eager"]["stale_owners"]) - set(out[mode]["stale_owners"]))
            out[mode]["stale_missed_vs_eager"] = lost
            ctx.line(f"{key} {mode}: owned storages the eager capture records but this one "
                     f"does not: {len(missing)} {missing[:4]}{'...' if len(missing) > 4 else ''}; "
                     f"stale owners missed: {len(lost)} {lost[:3]}")
        asis, eager = out.get("compiled-asis"), out["eager"]
        ctx.expect(any("act_perm" in o for o in eager["stale_owners"]),
                   f"{key}: the eager capture did not flag the rebound act_perm")
        if asis is not None:
            fell_back = asis["ops"] == eager["ops"] and asis["op_names"] == eager["op_names"]
            asis["fell_back_to_eager"] = fell_back
            ctx.line(f"{key}: with graphtrace's RecordingMode as is, the compiled model "
                     f"{'ran EAGERLY (Dynamo skips compiled frames under a non-infra dispatch mode)' if fell_back else 'ran compiled code'}"
                     f"; afterwards, outside any trace, {asis['ops_per_call_after']} ops reach "
                     f"the dispatcher per call (eager {eager['ops']})")
        figures[key] = out
        ctx.figure("cases", figures)

    with ctx.step("small-net"):
        def rebind_small(model):
            new = torch.randperm(512)
            return lambda: model.set_perm(new)

        run("small-net-cpu", lambda: make_small_net("cpu"),
            lambda m: torch.randn(8, 256, generator=torch.Generator().manual_seed(1)), rebind_small)
    with ctx.step("demo unfixed-lambda"):
        def make_demo():
            return DemoModel("unfixed-lambda", n_layers=2, seed=0, reload_backend=ctx.args.backend)

        def rebind_demo(model):
            return lambda: reload(model, model.make_checkpoint(1, 2), backend=ctx.args.backend)

        run("demo-unfixed-lambda-cpu", make_demo, lambda m: m.make_input(4), rebind_demo,
            modes=("eager", "compiled-patched"))


# ======================================================================================
# coverage arithmetic on synthetic data (no CUDA)
# ======================================================================================

class FakeMemory:
    """A sparse byte-addressable memory for exercising the kernel-node decoder on a CPU."""

    def __init__(self):
        self.blocks: dict[int, bytes] = {}

    def put(self, addr: int, data: bytes) -> int:
        self.blocks[addr] = bytes(data)
        return addr

    def read(self, addr: int, n: int) -> bytes:
        for base, data in self.blocks.items():
            if base <= addr and addr + n <= base + len(data):
                return data[addr - base: addr - base + n]
        raise MemoryError(f"read of {n} bytes at {addr:#x} outside fake memory")


def synthetic_kernel_node(mem: FakeMemory, args: list[tuple[str, int]], base: int = 0x10000,
                          array_at: int = 0x20000, struct_at: int = 0x30000) -> tuple[bytes, list]:
    """Lay out a kernel's arguments as the driver keeps them (contiguous, naturally aligned,
    `kernelParams[i]` pointing at each) and a CUDA_KERNEL_NODE_PARAMS_v2 naming them.
    args: (ctype, value) with ctype in {"ptr", "i32", "struct2"} (struct2: two pointers)."""
    blob, offsets, info = b"", [], []
    for kind, value in args:
        size = {"ptr": 8, "i32": 4, "struct2": 16}[kind]
        align = 8 if kind != "i32" else 4
        blob += b"\0" * (-len(blob) % align)
        offsets.append(len(blob))
        info.append((len(blob), size))
        if kind == "ptr":
            blob += struct.pack("<Q", value)
        elif kind == "i32":
            blob += struct.pack("<i", value)
        else:
            blob += struct.pack("<QQ", value[0], value[1])
    blob += b"\0" * (-len(blob) % 8)
    mem.put(base, blob)
    mem.put(array_at, b"".join(struct.pack("<Q", base + o) for o in offsets) + b"\0" * 8)
    params = struct.pack("<Q3I3II", 0xF00D, 1, 1, 1, 128, 1, 1, 0) + b"\0" * 4
    params += struct.pack("<4Q", array_at, 0, 0, 0)
    return params, info


def check_coverage_synthetic(ctx: Ctx) -> None:
    import pandas as pd

    with ctx.step("decoder"):
        mem = FakeMemory()
        W, X, OUT, TMP = 0x7F0000000000, 0x7F0000100000, 0x7F0000200000, 0x7F0000300000
        raw, info = synthetic_kernel_node(mem, [("ptr", W), ("i32", 64), ("struct2", (X, OUT)),
                                                ("ptr", 12345)])
        p = decode_kernel_node_params(raw)
        words, method = param_blobs(mem.read, p["kernel_params"], p["extra"], info)
        ctx.expect([w[2] for w in words] == [W, X, OUT, 12345] and method == "param-info",
                   f"decoder with param info read {words} via {method}")
        words2, method2 = param_blobs(mem.read, p["kernel_params"], p["extra"], None)
        vals2 = [w[2] for w in words2]
        ctx.expect(method2 == "scan" and all(v in vals2 for v in (W, X, OUT, 12345)),
                   f"conservative scan read {vals2} via {method2}")
        ctx.line(f"kernel-node decoder: with cuFuncGetParamInfo sizes {len(words)} words "
                 f"({method}); conservative scan {len(words2)} words ({method2}): ok")
    with ctx.step("coverage arithmetic"):
        storages = pd.DataFrame({"storage_id": [0, 1, 2], "data_ptr": [W, X, OUT],
                                 "nbytes": [4096, 1024, 1024], "device": ["cuda:0"] * 3,
                                 "alive": [True, True, True], "first_access": ["read"] * 3})
        accesses = pd.DataFrame({"graph_id": [0, 0], "storage_id": [0, 2],
                                 "access": ["read", "write"], "graph": ["g", "g"]})
        owned = pd.DataFrame({"data_ptr": [W, TMP], "nbytes": [4096, 256],
                              "label": ["fc.weight", "act_perm.keywords['index']"]})
        hook = pd.DataFrame({"data_ptr": [TMP, X], "nbytes": [256, 1024], "label": ["t:in_ptr1", "t:in_ptr0"]})
        nodes = [cov.KernelNode.from_words("gemm", words), cov.KernelNode("triton_poi_fused_0", [X + 8, TMP, OUT])]
        res = cov.graph_coverage(nodes, storages, accesses, 0, owned=owned, hook=hook)
        t = res.totals
        got = (t["pointers"], t["attributed"], t["attributed_with_hook"], t["owned"], t["owned_attributed"])
        ctx.expect(got == (6, 3, 6, 2, 1), f"synthetic coverage (pointers, attributed, +hook, owned, "
                                          f"owned attributed) = {got}, expected (6, 3, 6, 2, 1)")
        for ln in cov.format_coverage(res.per_kernel, res.total):
            ctx.line(ln)
        ctx.figure("synthetic_totals", {k: t[k] for k in ("pointers", "attributed", "coverage",
                                                          "attributed_with_hook", "owned",
                                                          "owned_attributed", "unseen_owners")})


# ======================================================================================
# registry and the parent
# ======================================================================================

@dataclass
class Check:
    name: str
    fn: Callable[[Ctx], None]
    needs_cuda: bool
    timeout: int
    what: str
    opt_in_dry: bool = False  # CPU-only, but slow: in --dry only with --cpu-compile


CHECKS = [
    Check("env", check_env, False, 120, "versions and feature probes"),
    Check("coverage-synthetic", check_coverage_synthetic, False, 60, "coverage arithmetic, decoder"),
    Check("demo-emulated", check_demo_emulated, False, 240, "demo variants, emulated graphs, CPU"),
    Check("stale-read-emulated", functools.partial(check_stale_read, device="cpu"), False, 180,
          "emulated replay vs eager after reload/flip (CPU rehearsal of stale-read)"),
    Check("demo-cuda", check_demo_cuda, True, 300, "demo variants, real CUDA graphs"),
    Check("stale-read", check_stale_read, True, 180, "real replay vs eager after reload/flip"),
    Check("demo-emulated-cuda", check_demo_emulated_cuda, True, 240, "demo variants, emulated, GPU"),
    Check("coverage-eager", check_coverage_eager, True, 180, "kernel nodes of eager graphs"),
    Check("coverage-compiled", check_coverage_compiled, True, 420, "kernel nodes of compiled graphs"),
    Check("compile-cpu", check_compile_cpu, False, 300, "torch.compile on CPU, dispatcher view",
          opt_in_dry=True),
]


def _selftest_sleep(ctx: Ctx) -> None:
    ctx.line("before the hang")
    time.sleep(600)


def _selftest_crash(ctx: Ctx) -> None:
    ctx.line("before the crash")
    os.kill(os.getpid(), signal.SIGSEGV)


def _selftest_raise(ctx: Ctx) -> None:
    with ctx.step("first part"):
        raise ValueError("planted")
    ctx.line("second part still ran")


if os.environ.get("GPU_CHECK_SELFTEST") == "1":  # tests/test_gpu_check.py: harness checks
    CHECKS += [Check("selftest-sleep", _selftest_sleep, False, 3, "a check that hangs"),
               Check("selftest-crash", _selftest_crash, False, 60, "a check that segfaults"),
               Check("selftest-raise", _selftest_raise, False, 60, "a check that raises")]
BY_NAME = {c.name: c for c in CHECKS}
COMPARISONS = [("demo-emulated", "demo-cuda", "emulated[cpu]", "cuda-graphs"),
               ("demo-emulated", "demo-emulated-cuda", "emulated[cpu]", "emulated[cuda]")]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="gpu_check.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dry", action="store_true",
                   help="run only what needs no CUDA; GPU checks print 'skipped: no CUDA'")
    p.add_argument("--out", metavar="DIR", default=None,
                   help="results folder (default: analysis/results on a CUDA run; none with --dry)")
    p.add_argument("--only", metavar="NAMES", default="",
                   help="comma-separated checks to run: " + ", ".join(BY_NAME))
    p.add_argument("--cpu-compile", action="store_true",
                   help="with --dry, also run compile-cpu (Inductor on the CPU, ~1 min cold)")
    p.add_argument("--budget", type=float, default=540.0, metavar="S",
                   help="seconds for the whole run; a check gets at most what is left (default 540)")
    p.add_argument("--jobs", type=int, default=2, metavar="N",
                   help="CPU-only checks run in N lanes beside the GPU checks (default 2; 1: "
                        "everything one after another)")
    p.add_argument("--inline", action="store_true",
                   help="run checks in this process (no crash isolation; timeouts by SIGALRM)")
    p.add_argument("--backend", default="builtin", choices=("builtin", "vllm", "auto"),
                   help="demo reload code (default builtin: the GPU machine has no vLLM)")
    p.add_argument("--batch-sizes", default=DEFAULT_BATCH_SIZES, help="demo batch sizes")
    p.add_argument("--layers", type=int, default=4, help="demo layers")
    p.add_argument("--variant", action="append", default=None, help="demo variant (repeatable)")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--child-json", default=None, help=argparse.SUPPRESS)
    p.add_argument("--child-tables", default=None, help=argparse.SUPPRESS)
    return p


def _child_main(args) -> int:
    check = BY_NAME[args.child]
    ctx = Ctx(check.name, args, args.child_json, args.child_tables)
    ctx.save()
    try:
        check.fn(ctx)
    except Exception as exc:  # noqa: BLE001
        ctx.error(exc)
    ctx.save()
    sys.stdout.flush()
    os._exit(0)  # skip interpreter teardown (CUDA/Inductor workers): the JSON is written


def _passthrough(args) -> list[str]:
    out = ["--backend", args.backend, "--batch-sizes", args.batch_sizes, "--layers", str(args.layers)]
    for v in args.variant or ():
        out += ["--variant", v]
    return out


def _run_child(check: Check, args, timeout: float, workdir: Path, log: list[str]) -> dict:
    json_path = workdir / f"{check.name}.json"
    cmd = [sys.executable, "-u", str(Path(__file__).resolve()), "--child", check.name,
           "--child-json", str(json_path), "--child-tables", str(workdir / "tables"),
           *_passthrough(args)]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            errors="replace", env=env, cwd=str(REPO), start_new_session=True)

    def pump():
        for line in proc.stdout:
            line = line.rstrip("\n")
            log.append(line)
            print(line, flush=True)

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    status = None
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        status = f"timeout after {timeout:.0f} s"
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()
    reader.join(timeout=5)
    seconds = round(time.perf_counter() - t0, 1)
    try:
        result = json.loads(json_path.read_text())
    except Exception:  # noqa: BLE001
        result = {"status": "error", "lines": [], "figures": {}, "problems": [], "errors": []}
    if status is None and proc.returncode != 0:
        status = (f"crashed (signal {-proc.returncode})" if proc.returncode < 0
                  else f"exited {proc.returncode}")
        result.setdefault("errors", []).append(status)
    if status is not None:
        result["status"] = status
        tail = [ln for ln in log[-8:]]
        result["lines"] = result.get("lines", []) + [f"{status}; last output:"] + [f"    {t}" for t in tail]
    result["seconds"] = seconds
    return result


def _run_inline(check: Check, args, timeout: float, workdir: Path) -> dict:
    ctx = Ctx(check.name, args, None, str(workdir / "tables"))

    def alarm(signum, frame):
        raise TimeoutError(f"check {check.name} ran past {timeout:.0f} s")

    old = signal.signal(signal.SIGALRM, alarm) if hasattr(signal, "SIGALRM") else None
    if old is not None:
        signal.alarm(max(1, int(timeout)))
    try:
        check.fn(ctx)
    except Exception as exc:  # noqa: BLE001
        ctx.error(exc)
    finally:
        if old is not None:
            signal.alarm(0)
            signal.signal(signal.SIGALRM, old)
    return ctx.result()


def _cuda_available_cheap() -> bool:
    try:
        import torch

        return bool(torch.cuda.is_available())
    except Exception:  # noqa: BLE001
        return False


def format_block(meta: dict, results: dict, comparisons: list[str]) -> list[str]:
    lines = [f"== graphtrace GPU check ({meta['mode']}) ==",
             f"started {meta['started']}; torch {meta.get('torch', '?')}; device "
             f"{meta.get('device', 'none')}; CUDA {'yes' if meta['cuda'] else 'no'}"]
    for name, r in results.items():
        status = r["status"]
        secs = f" ({r['seconds']:.1f} s)" if r.get("seconds") is not None else ""
        lines.append(f"[{name}] {status}{secs}")
        for ln in r.get("lines", []):
            lines.append(f"  {ln}")
    lines.append("[verdicts equal]" + ("" if comparisons else f" {SKIP_NO_CUDA}"
                                       if not meta["cuda"] else " nothing to compare"))
    lines.extend(f"  {ln}" for ln in comparisons)
    counts: dict[str, int] = {}
    for r in results.values():
        key = ("ok" if r["status"] == "ok" else "skipped" if r["status"].startswith("skipped")
               else "failed")
        counts[key] = counts.get(key, 0) + 1
    passed = counts.get("failed", 0) == 0 and meta.get("comparisons_ok", True) is not False
    compared = {True: "equal", False: "DIFFERENT", None: "not run"}[meta.get("comparisons_ok")]
    lines.append(f"== summary: {counts.get('ok', 0)} ok, {counts.get('skipped', 0)} skipped, "
                 f"{counts.get('failed', 0)} failed; verdict comparison: {compared}; "
                 f"RESULT: {'PASS' if passed else 'FAIL'} ==")
    return lines


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.child:
        return _child_main(args)
    only = [s.strip() for s in args.only.split(",") if s.strip()]
    unknown = [s for s in only if s not in BY_NAME]
    if unknown:
        print(f"gpu_check.py: unknown check(s) {unknown}; choose from {list(BY_NAME)}", file=sys.stderr)
        return 2
    t_start = time.perf_counter()
    cuda = False if args.dry else _cuda_available_cheap()
    if not args.dry and not cuda:
        print("gpu_check.py: CUDA is not available here: running as --dry", flush=True)
    mode = "full run, CUDA" if cuda else "dry run, no CUDA"
    out = Path(args.out) if args.out else (REPO / "analysis" / "results" if cuda else None)
    meta = {"mode": mode, "cuda": cuda, "started": time.strftime("%Y-%m-%d %H:%M:%S"),
            "argv": sys.argv[1:], "python": platform.python_version()}
    workdir = Path(tempfile.mkdtemp(prefix="gpu_check_"))
    log: list[str] = []
    results: dict[str, dict] = {}
    print(f"gpu_check: {mode}; budget {args.budget:.0f} s; work files in {workdir}", flush=True)
    todo: list[Check] = []
    for check in CHECKS:
        if only and check.name not in only:
            continue
        if check.needs_cuda and not cuda:
            results[check.name] = {"status": SKIP_NO_CUDA, "lines": [f"{check.what}: {SKIP_NO_CUDA}"],
                                   "figures": {}, "seconds": None}
            continue
        if check.opt_in_dry and not cuda and not args.cpu_compile and check.name not in only:
            results[check.name] = {"status": "skipped: dry run (add --cpu-compile)",
                                   "lines": [f"{check.what}: skipped in a dry run without --cpu-compile"],
                                   "figures": {}, "seconds": None}
            continue
        todo.append(check)

    def run_one(check: Check) -> None:
        left = args.budget - (time.perf_counter() - t_start)
        if left < 15:
            results[check.name] = {"status": "skipped: out of time budget",
                                   "lines": [f"{check.what}: {left:.0f} s left of --budget"],
                                   "figures": {}, "seconds": None}
            return
        timeout = min(check.timeout, left - 5)
        print(f"--- {check.name}: {check.what} (timeout {timeout:.0f} s)", flush=True)
        if args.inline:
            results[check.name] = _run_inline(check, args, timeout, workdir)
        else:
            results[check.name] = _run_child(check, args, timeout, workdir, log)
        print(f"--- {check.name}: {results[check.name]['status']} "
              f"({results[check.name].get('seconds', 0) or 0:.1f} s)", flush=True)

    if args.inline or args.jobs <= 1:
        for check in todo:
            run_one(check)
    else:
        # lanes: the GPU checks one after another in one lane; the CPU-only checks in
        # `--jobs` lanes beside it (they need no device, so they overlap its work)
        lanes = {"gpu": [c for c in todo if c.needs_cuda], "cpu": [c for c in todo if not c.needs_cuda]}
        lock = threading.Lock()

        def worker(queue: list[Check]) -> None:
            while True:
                with lock:
                    if not queue:
                        return
                    check = queue.pop(0)
                run_one(check)

        threads = [threading.Thread(target=worker, args=(lanes["gpu"],))]
        threads += [threading.Thread(target=worker, args=(lanes["cpu"],)) for _ in range(args.jobs)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    results = {c.name: results[c.name] for c in CHECKS if c.name in results}
    env = results.get("env", {}).get("figures", {})
    meta.update({k: env[k] for k in ("torch", "device", "triton", "driver_version") if k in env})

    comparisons: list[str] = []
    verdict_ok: bool | None = None
    for a, b, an, bn in COMPARISONS:
        ra, rb = results.get(a), results.get(b)
        if not ra or not rb:
            continue
        sa, sb = ra.get("figures", {}).get("scenarios"), rb.get("figures", {}).get("scenarios")
        if not sa or not sb:
            if rb.get("status", "").startswith("skipped"):
                continue
            comparisons.append(f"verdicts equal [{an} vs {bn}]: not comparable "
                               f"({a}: {ra.get('status')}, {b}: {rb.get('status')})")
            verdict_ok = False
            continue
        ok, lines = compare_demo(sa, sb, an, bn)
        comparisons.extend(lines)
        if ok is not None:
            verdict_ok = ok if verdict_ok is None else (verdict_ok and ok)
    ra, rb = results.get("stale-read-emulated"), results.get("stale-read")
    fa = (ra or {}).get("figures", {}).get("variants")
    fb = (rb or {}).get("figures", {}).get("variants")
    if fa and fb:
        ok, lines = compare_stale_read(fa, fb, "emulated replay", "real replay")
        comparisons.extend(lines)
        if ok is not None:
            verdict_ok = ok if verdict_ok is None else (verdict_ok and ok)
    meta["comparisons_ok"] = verdict_ok
    meta["seconds"] = round(time.perf_counter() - t_start, 1)
    block = format_block(meta, results, comparisons)
    block.append(f"total time {meta['seconds']:.1f} s")
    print()
    print("\n".join(block), flush=True)
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        (out / "gpu_check.txt").write_text("\n".join(block) + "\n")
        (out / "gpu_check.json").write_text(json.dumps(
            {"meta": meta, "checks": results, "comparisons": comparisons}, indent=1, default=str))
        (out / "gpu_check.log").write_text("\n".join(log) + "\n")
        _merge_tables(workdir / "tables", out)
        print(f"results written to {out}/gpu_check.txt (+ .json, .log, gpu_coverage_*.csv)", flush=True)
    failed = any(not r["status"].startswith(("ok", "skipped")) for r in results.values())
    return 1 if failed or verdict_ok is False else 0


def _merge_tables(folder: Path, out: Path) -> None:
    """All per-case coverage tables into two CSVs (kernels, pointers)."""
    if not folder.exists():
        return
    import pandas as pd

    for kind in ("kernels", "pointers"):
        parts = [pd.read_csv(p) for p in sorted(folder.glob(f"gpu_coverage_{kind}_*.csv"))]
        if parts:
            pd.concat(parts, ignore_index=True).to_csv(out / f"gpu_coverage_{kind}.csv", index=False)


if __name__ == "__main__":
    raise SystemExit(main())
