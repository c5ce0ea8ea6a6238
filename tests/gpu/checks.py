"""The GPU checks' shared parts (imported by tests/gpu/conftest.py and tests/test_gpu_check.py).

What a check computes lives here as plain functions that return figures; the tests under
tests/gpu assert on them, and tests/test_gpu_check.py rehearses the CPU-runnable ones.
`Notes` collects the lines a check prints and its figures; the conftest hands them to the
results file that analysis/gpu_check.py writes.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import signal
import time
from pathlib import Path
from typing import Any, Callable

from graphtrace import coverage as cov
from graphtrace.vocab import STALE_VERDICTS

BATCH_SIZES = (1, 2, 4, 8)
LAYERS = 4
BACKEND = "builtin"  # the GPU machine has no vLLM: the demo's built-in reload
#: variants whose graphs keep reading the capture-time permutation after a reload
STALE_VARIANTS = ("unfixed-partial", "unfixed-lambda", "rejected-fix", "marlin")


class Notes:
    """What one check reports: lines (printed as they come) and figures (JSON-able)."""

    def __init__(self, name: str = "", table_dir: str | os.PathLike | None = None,
                 echo: bool = True):
        self.name = name
        self.table_dir = Path(table_dir) if table_dir else None
        self.echo = echo
        self.lines: list[str] = []
        self.figures: dict[str, Any] = {}

    def line(self, text: str = "") -> None:
        for part in str(text).splitlines() or [""]:
            self.lines.append(part)
            if self.echo:
                print(part, flush=True)

    def figure(self, key: str, value: Any) -> None:
        self.figures[key] = jsonable(value)

    def unavailable(self, what: str, exc: BaseException | str) -> None:
        """Something this torch/driver does not offer: reported with its error, not a failure."""
        msg = exc if isinstance(exc, str) else f"{type(exc).__name__}: {exc}"
        self.figures.setdefault("unavailable", {})[what] = msg
        self.line(f"unavailable: {what}: {msg}")

    def table(self, name: str, frame) -> None:
        if self.table_dir is None or frame is None:
            return
        self.table_dir.mkdir(parents=True, exist_ok=True)
        frame.to_csv(self.table_dir / f"{name}.csv", index=False)


def jsonable(v):
    try:
        json.dumps(v)
        return v
    except TypeError:
        if isinstance(v, dict):
            return {str(k): jsonable(x) for k, x in v.items()}
        if isinstance(v, (list, tuple, set)):
            return [jsonable(x) for x in v]
        if hasattr(v, "item"):
            try:
                return v.item()
            except Exception:  # noqa: BLE001
                pass
        return str(v)


@contextlib.contextmanager
def time_limit(seconds: float, what: str = "test"):
    """Raise TimeoutError in the main thread after `seconds` (SIGALRM; a hang inside C code
    that never returns to Python is not interrupted: the script's overall timeout is)."""
    if not hasattr(signal, "SIGALRM") or seconds <= 0:
        yield
        return

    def alarm(signum, frame):
        raise TimeoutError(f"{what} ran past its {seconds:g} s limit")

    old = signal.signal(signal.SIGALRM, alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


# ======================================================================================
# env
# ======================================================================================

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
# the demo: emulated and real CUDA graphs (graphtrace.demo.runner)
# ======================================================================================

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
def emulated_capture_on_any_device():
    """Make runner._capture record emulated graphs (graphtrace.capture) whatever the model's
    device: the model stays on the GPU, the graphs are graphtrace's emulated ones."""
    from graphtrace.demo import runner

    original = runner._capture

    def emulated(sc, batch_sizes, device):
        return original(sc, batch_sizes, "cpu")

    runner._capture = emulated
    try:
        yield
    finally:
        runner._capture = original


def demo_variant(notes: Notes, variant: str, device: str, label: str, emulate: bool,
                 *, batch_sizes=BATCH_SIZES, layers: int = LAYERS, backend: str = BACKEND
                 ) -> tuple[dict, bool, str]:
    """One demo variant through both reload scenarios: ({"variant/scenario": summary},
    the demo's own expectation met, its verdict line). `emulate`: graphtrace's emulated
    graphs whatever the device; else real torch.cuda.graph captures on CUDA."""
    from graphtrace.demo import runner

    results = {}
    for scenario in ("new-weights", "same-weights"):
        guard = emulated_capture_on_any_device() if emulate else contextlib.nullcontext()
        with guard:
            results[scenario] = runner.run_scenario(
                variant, scenario, device=device, batch_sizes=list(batch_sizes), seed=0,
                backend=backend, n_layers=layers, out=None)
    ok, verdict = runner.check(results["new-weights"], results["same-weights"])
    scenarios = {}
    for scenario, res in results.items():
        s = scenario_summary(res)
        s["expected"] = "ok" if ok else "UNEXPECTED"
        s["errors"] = [str(e) for e in res.report.errors[:1]] if res.n_errors else []
        scenarios[f"{variant}/{scenario}"] = s
        notes.line(summary_line(label, s))
    notes.line(f"  {variant}: {verdict}")
    for pattern, n in runner._owner_patterns(results["new-weights"].flagged_owners):
        notes.line(f"  {variant} flagged owner: {pattern} ({n} layers)")
    return scenarios, ok, verdict


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
# stale read on replay
# ======================================================================================

def rows_equal(a, b, exact: bool) -> int:
    import torch

    if exact:
        return int((a == b).all(dim=-1).sum())
    return int(torch.isclose(a, b, rtol=1e-4, atol=1e-5).all(dim=-1).sum())


def stale_read_figures(notes: Notes, variant: str, device: str = "cuda", *,
                       batch_sizes=BATCH_SIZES, layers: int = LAYERS,
                       backend: str = BACKEND) -> dict:
    """Replay vs eager for one variant, after a reload and after an in-place act-order flip.

    On CUDA the graphs are real (torch.cuda.graph); on the CPU they are graphtrace's
    emulated graphs (the rehearsal of the same expectations, and the reference).
    `stale_read_problems` says what the figures should be.
    """
    import torch

    from graphtrace.demo import runner
    from graphtrace.demo.model import DemoModel
    from graphtrace.demo.reload import reload
    from graphtrace.demo.scenario import Scenario

    dev = torch.device(device)
    with torch.no_grad():
        model = DemoModel(variant, n_layers=layers, seed=0, device=dev, reload_backend=backend)
        with Scenario(model, strict=False) as sc:
            runner._capture(sc, list(batch_sizes), dev)
        rows = sc.rows
        replay0 = sc.replay()
        eager0 = sc.eager()
        sane = sum(rows_equal(r, e, False) for r, e in zip(replay0, eager0))

        def live_perms():
            return {n: l.quant_method.kernel.live_perm(l) for n, l in model.quant_layers()}

        capture_perms = {n: p.clone() for n, p in live_perms().items() if p is not None}
        used = reload(model, model.make_checkpoint(1, 2), backend=backend)
        report = sc.diff()
        stale_edges = int(report.edges["verdict"].astype(str).isin(STALE_VERDICTS).sum())

        replay1 = sc.replay()
        eager1 = sc.eager()
        eq_new = sum(rows_equal(r, e, False) for r, e in zip(replay1, eager1))
        eq_new_exact = sum(rows_equal(r, e, True) for r, e in zip(replay1, eager1))
        eq_before = sum(rows_equal(r, b, False) for r, b in zip(replay1, replay0))
        # eager with the capture-time permutation written into the live one
        live = {n: p for n, p in live_perms().items() if p is not None}
        saved = {n: p.clone() for n, p in live.items()}
        for n, p in live.items():
            if n in capture_perms and capture_perms[n].shape == p.shape:
                p.copy_(capture_perms[n])
        eager_old = sc.eager()
        for n, p in live.items():
            p.copy_(saved[n])
        eq_oldperm = sum(rows_equal(r, e, False) for r, e in zip(replay1, eager_old))
        eq_oldperm_exact = sum(rows_equal(r, e, True) for r, e in zip(replay1, eager_old))

        # an act-order change in place: flip the permutation an eager forward reads now
        def reverse(_model):  # reversing twice restores it
            for p in live.values():
                p.copy_(p.flip(0))

        flip = sc.flip(reverse, restore=reverse, baseline=replay1, eager=True)
        eager_changed, replay_changed = flip.eager_changed, flip.changed
        max_err = max(float((r - e).abs().max()) for r, e in zip(replay1, eager1))
        del sc, report
        if dev.type == "cuda":
            torch.cuda.synchronize()
    fig = dict(rows=rows, replay_eq_eager_before_reload=sane, stale_like_edges=stale_edges,
               replay_eq_eager_new=eq_new, replay_eq_eager_new_exact=eq_new_exact,
               replay_eq_replay_before=eq_before, replay_eq_eager_capture_perm=eq_oldperm,
               replay_eq_eager_capture_perm_exact=eq_oldperm_exact,
               flip_eager_changed=eager_changed, flip_replay_changed=replay_changed,
               max_abs_replay_minus_eager=max_err, reload=used)
    what = "real replay" if dev.type == "cuda" else "emulated replay"
    notes.line(f"{variant}: before reload replay==eager {sane}/{rows}; after reload "
               f"(new weights + new act order, {used}) replay==eager(new) {eq_new}/{rows} "
               f"[exact {eq_new_exact}], replay==eager(new weights, capture-time perm) "
               f"{eq_oldperm}/{rows} [exact {eq_oldperm_exact}], max |replay-eager| "
               f"{max_err:.3g}; stale-like edges {stale_edges}")
    notes.line(f"{variant}: act order flipped in place: eager rows changed "
               f"{eager_changed}/{rows}, replayed rows changed {replay_changed}/{rows}")
    if not stale_read_problems(variant, fig):
        if variant == "rejected-fix":
            notes.line(f"  -> STALE READ on {what}: the graphs read the registered perm "
                       "(refreshed by the reload) while eager reads act_perm's detached "
                       "copy; an in-place update of that copy never reaches the graphs")
        elif variant in STALE_VARIANTS:
            notes.line(f"  -> STALE READ on {what}: the graphs compute with the "
                       "capture-time permutation while eager follows the live one")
        else:
            notes.line(f"  -> CLEAN: {what} follows every update, as eager does")
    return fig


def stale_read_problems(variant: str, fig: dict) -> list[str]:
    """What is wrong with one variant's stale-read figures ([] when as expected): a stale
    variant's replay keeps the capture-time permutation and is flagged; the fixed one
    follows the live model and is not."""
    rows = fig["rows"]
    out = []
    if fig["replay_eq_eager_before_reload"] != rows:
        out.append(f"replay != eager before any reload ({fig['replay_eq_eager_before_reload']}/{rows})")
    if fig["flip_eager_changed"] != rows:
        out.append(f"flip changed {fig['flip_eager_changed']}/{rows} eager rows")
    if variant in STALE_VARIANTS:
        ok = fig["flip_replay_changed"] == 0 and fig["stale_like_edges"] > 0
        if variant != "rejected-fix":  # its registered storage is refreshed in place
            ok = ok and fig["replay_eq_eager_new"] == 0 and fig["replay_eq_eager_capture_perm"] == rows
        if not ok:
            out.append("expected a stale read")
    elif not (fig["flip_replay_changed"] == rows and fig["replay_eq_eager_new"] == rows
              and fig["stale_like_edges"] == 0):
        out.append("expected replay to follow the live model")
    return out


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
# kernel-node coverage
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


def cuda_capture_keep(fn, x, label: str, recorder=None):
    """Capture fn(x) into a CUDAGraph(keep_graph=True) labelled `label` (warm-up first, by
    graphtrace.capture_cuda_graph); `recorder` (a DebugMode) is on only during the capture."""
    import torch

    import graphtrace as gt

    def call():
        if recorder is not None and torch.cuda.is_current_stream_capturing():
            with recorder:
                return fn(x)
        return fn(x)

    graph, y = gt.capture_cuda_graph(call, label, warmup=2,
                                     graph=torch.cuda.CUDAGraph(keep_graph=True))
    graph.instantiate()
    return graph, y


def emulated_capture_keep(fn, x, label: str, recorder=None):
    """CPU stand-in for `cuda_capture_keep` (tests rehearse `measure` with it): an
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


def measure(notes: "Notes", key: str, *, model, fn, x, driver, compiled: bool, patch: bool,
            use_hook: bool, rebind: Callable | None, eager_fn=None,
            capture_fn: Callable = cuda_capture_keep, memory_fn: Callable | None = None) -> dict:
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
            notes.unavailable(f"{key}: DebugMode Triton hook", exc)
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
            notes.line(f"{key}: kernel node not read: {err}")
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
        notes.table(f"gpu_coverage_kernels_{key}", res.per_kernel.assign(case=key))
        notes.table(f"gpu_coverage_pointers_{key}", res.pointers.assign(case=key).astype({"value": str, "range_start": str}))
        graph.replay()
        _sync(y)
        replay_before = y.clone()
        rows = int(replay_before.shape[0])
        fig["rows"] = rows
        fig["replay_eq_eager_before_rebind"] = rows_equal(replay_before, (eager_fn or fn)(x), False)
        if rebind is not None:
            rebind()
            report = tr.diff()
            edges = report.edges
            stale = edges[edges["verdict"].astype(str).isin(STALE_VERDICTS)]
            fig["stale_like_edges"] = int(len(stale))
            fig["stale_owners"] = sorted({o for s in stale["owners"].astype(str) for o in s.split("; ") if o})
            graph.replay()
            _sync(y)
            replay_after = y.clone()
            eager_after = (eager_fn or fn)(x)
            fig["replay_eq_eager_after_rebind"] = rows_equal(replay_after, eager_after, False)
            fig["replay_changed_by_rebind"] = rows - rows_equal(replay_after, replay_before, True)
        del graph
    notes.line(f"{key}: {len(nodes)} graph nodes {counts}; Triton kernel nodes "
             f"{fig['triton_kernel_nodes']}; dispatcher ops recorded {fig['ops_recorded']}"
             + (f"; Triton launches seen by the DebugMode hook {fig['triton_launches_hooked']}"
                if recorder is not None else ""))
    for ln in cov.format_coverage(res.per_kernel, res.total, indent="  ", max_rows=25):
        notes.line(f"{key}{ln}" if ln.startswith("  total") else ln)
    for note in res.notes:
        notes.line(f"  note: {note}")
    notes.line(f"{key}: replay==eager before the rebind {fig['replay_eq_eager_before_rebind']}/{rows}")
    if rebind is not None:
        notes.line(f"{key}: after the rebind: stale-like edges {fig['stale_like_edges']} "
                 f"{fig['stale_owners'][:4]}; replay==eager {fig['replay_eq_eager_after_rebind']}"
                 f"/{fig['rows']}; replayed rows changed {fig['replay_changed_by_rebind']}/{fig['rows']}")
    return fig


def compile_cpu_cases(notes: "Notes", backend: str = "builtin") -> dict:
    """torch.compile on the CPU (Inductor's C++ kernels): what the recorder sees of compiled
    code, eager vs compiled (RecordingMode patched to keep compiled code) vs as is."""
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
                notes.line(f"{key} {mode}: compiled in {time.perf_counter() - t:.1f} s; "
                         f"{dispatched_ops(fn, x)} ops reach the dispatcher per call "
                         f"(eager: {dispatched_ops(model, x)})")
            with torch.no_grad(), gt.trace() as tr, \
                    recording_mode_ignores_compile_internals(mode == "compiled-patched"):
                with gt.capture(key):
                    fn(x)
            if mode == "compiled-asis":
                after = dispatched_ops(fn, x)
                out_after = f"{after} ops per call after the traced call, outside any trace"
                notes.line(f"{key} {mode}: {out_after}")
            tr.watch(model)
            acc = tr.accesses
            rep0 = tr.diff()
            owned_seen = sorted({o for s in rep0.edges["owners"].astype(str) for o in s.split("; ") if o})
            rebind_of(model)()
            rep = tr.diff()
            stale = rep.edges[rep.edges["verdict"].astype(str).isin(STALE_VERDICTS)]
            stale_owners = sorted({o for s in stale["owners"].astype(str) for o in s.split("; ") if o})
            out[mode] = {"ops": int(acc["seq"].nunique()),
                         "op_names": sorted(set(acc["op"].astype(str))),
                         "owned_seen": owned_seen, "stale_owners": stale_owners}
            if mode == "compiled-asis":
                out[mode]["ops_per_call_after"] = after
            notes.line(f"{key} {mode}: {out[mode]['ops']} ops recorded "
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
            notes.line(f"{key} {mode}: owned storages the eager capture records but this one "
                     f"does not: {len(missing)} {missing[:4]}{'...' if len(missing) > 4 else ''}; "
                     f"stale owners missed: {len(lost)} {lost[:3]}")
        asis, eager = out.get("compiled-asis"), out["eager"]
        if asis is not None:
            fell_back = asis["ops"] == eager["ops"] and asis["op_names"] == eager["op_names"]
            asis["fell_back_to_eager"] = fell_back
            notes.line(f"{key}: with graphtrace's RecordingMode as is, the compiled model "
                     f"{'ran EAGERLY (Dynamo skips compiled frames under a non-infra dispatch mode)' if fell_back else 'ran compiled code'}"
                     f"; afterwards, outside any trace, {asis['ops_per_call_after']} ops reach "
                     f"the dispatcher per call (eager {eager['ops']})")
        figures[key] = out

    if True:  # small-net
        def rebind_small(model):
            new = torch.randperm(512)
            return lambda: model.set_perm(new)

        run("small-net-cpu", lambda: make_small_net("cpu"),
            lambda m: torch.randn(8, 256, generator=torch.Generator().manual_seed(1)), rebind_small)
    if True:  # demo unfixed-lambda
        def make_demo():
            return DemoModel("unfixed-lambda", n_layers=2, seed=0, reload_backend=backend)

        def rebind_demo(model):
            return lambda: reload(model, model.make_checkpoint(1, 2), backend=backend)

        run("demo-unfixed-lambda-cpu", make_demo, lambda m: m.make_input(4), rebind_demo,
            modes=("eager", "compiled-patched"))
    return figures
