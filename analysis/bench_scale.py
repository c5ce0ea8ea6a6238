"""Scale of trace + diff + report: 10k, 100k and 1M recorded accesses on a 10k-module model.

Model: a ModuleList of 2,500 blocks (block + LayerNorm + up Linear + down Linear: 10,002
modules with the list and the root; 15,000 parameters). Each block also holds a kernel-like
plain object, as vLLM's quant methods do: `functools.partial(torch.index_select, dim=1,
index=perm)` (an attribute-only owner: a tensor outside the registries) and a dict holding
the down projection's weight (a second, attribute owner of a parameter). A block's forward
dispatches 6 ops and 21 recorded accesses: native_layer_norm, t, addmm, index_select, t, addmm.

Two sources of captures, both diffed through the public `t.diff()`:

- real: `gt.capture(label, emulate=False)` around forwards over windows of blocks (10k and
  100k accesses; real dispatch costs ~20 us per op here, so 1M is left to the synthetic one);
- synthetic: rows appended straight into each `Capture`'s columnar arrays the way
  graphtrace.recorder does it (`_Plan` codes `encoding.pack_code(arg, access)`,
  `StorageTable.lookup` for the storage id, the view interner for `(dtype, shape, stride,
  offset)`, rows `seq, code, encoding.pack_slot(sid, view)`, one op id and one module id
  per op), over real tensors: the model's parameters and perm tensors, and a pool of
  intermediate tensors held alive (up to 50,000 storages in all), so that owners, liveness
  and value checks in diff are real.

Before diffing, a reload: every parameter is copied in place (stable), 1% of the blocks
rebind their perm tensor to a new one with new values (stale: the old perm is kept alive
by this script, as capture artifacts would; manifest), and another 1% rebind it and drop the
old one (dangling).

Printed per size: accesses, storages, edges; trace exit (owner snapshot); diff time (min of
the runs at every size, as for the frames below, and the first run alone: it also pays for
growing the heap); time to build same-sized DataFrames alone (the accesses frame from the records, `t.accesses`, plus the
edges/storages/owners frames constructed with pandas from ready numpy columns); diff / frames
alone (goal <= 3x); time per access and growth factor between sizes (linear: per-access time
flat); peak memory of diff: tracemalloc (a separate pass, up to 100k) and the growth of the
process's resident memory sampled while the first diff runs;
`report.to_csv` and `gt.load_report` times.

    python analysis/bench_scale.py            # full run, writes analysis/results/bench_scale.txt
    python analysis/bench_scale.py --quick    # smoke run (seconds), writes nothing unless --out
"""

from __future__ import annotations

import argparse
import functools
import gc
import os
import platform
import shutil
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path

import numpy as np
import pandas as pd
import torch
from torch import nn

import graphtrace as gt
from _common import Results, add_results_options, best_of, rss
from graphtrace.encoding import ACCESS_FIELDS, FACTORY, VIEW, pack_slot
from graphtrace.recorder import _Plan

RESULTS = Path(__file__).resolve().parent / "results" / "bench_scale.txt"
HEADER = "trace + diff + report at scale"
D = 4
ACCESSES_PER_BLOCK = 21
OPS_PER_BLOCK = 6


# --------------------------------------------------------------------------- model

class Kernel:
    """A quant-method-like plain object: tensors outside the module registries."""

    def __init__(self, weight: torch.Tensor, perm: torch.Tensor):
        self.act_perm = functools.partial(torch.index_select, dim=1, index=perm)
        self.scales = {"weight": weight}


class Block(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.up = nn.Linear(d, d)
        self.down = nn.Linear(d, d)
        self.kernel = Kernel(self.down.weight, torch.randperm(d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(self.kernel.act_perm(self.up(self.norm(x))))


class Model(nn.Module):
    def __init__(self, blocks: int, d: int = D):
        super().__init__()
        self.layers = nn.ModuleList(Block(d) for _ in range(blocks))

    def forward(self, x: torch.Tensor, start: int = 0, count: int | None = None) -> torch.Tensor:
        n = len(self.layers)
        for i in range(start, start + (n if count is None else count)):
            x = self.layers[i % n](x)
        return x


# --------------------------------------------------------------------------- sources

def _windows(n_accesses: int, blocks: int, per_graph: int):
    """(graph index, first block, block count) covering n_accesses block by block."""
    total = max(1, round(n_accesses / ACCESSES_PER_BLOCK))
    g, done = 0, 0
    while done < total:
        count = min(per_graph, total - done)
        yield g, (g * per_graph) % blocks, count
        g += 1
        done += count


def real_captures(t, model: Model, n_accesses: int, per_graph: int) -> None:
    blocks = len(model.layers)
    for g, start, count in _windows(n_accesses, blocks, per_graph):
        x = torch.randn(1 + g % 8, D)
        with gt.capture(f"real{g}", emulate=False):
            model(x, start, count)


class Synthetic:
    """Appends recorder-shaped rows to new captures of a trace, over real tensors."""

    def __init__(self, t, model: Model, pool_size: int):
        self.t = t
        self.model = model
        rec = t.recorder
        names = rec.names
        aten = torch.ops.aten
        self.ln = _Plan(aten.native_layer_norm.default, names)
        self.tr = _Plan(aten.t.default, names)
        self.mm = _Plan(aten.addmm.default, names)
        self.sel = _Plan(aten.index_select.default, names)
        # intermediates per batch size 1..8 (graph g runs batch 1 + g % 8, as the real source
        # does): (b, D) activations and (b, 1) LayerNorm mean/rstd, each tensor its own
        # storage, kept alive here and reused cyclically across graphs
        per_b = max(1, pool_size // 8)
        self.pool = {b: ([torch.empty(b, D) for _ in range(per_b * 2 // 3)],
                         [torch.empty(b, 1) for _ in range(per_b - per_b * 2 // 3)])
                     for b in range(1, 9)}
        self.cursor = {b: [0, 0] for b in range(1, 9)}
        self.inputs = {b: torch.empty(b, D) for b in range(1, 9)}

    def _take(self, b: int, kind: int) -> torch.Tensor:
        pool, cur = self.pool[b][kind], self.cursor[b]
        t = pool[cur[kind] % len(pool)]
        cur[kind] += 1
        return t

    def _slot(self, t: torch.Tensor, view: tuple | None = None) -> int:
        rec = self.t.recorder
        sid = rec.storages.lookup(t.untyped_storage())
        key = view if view is not None else (t.dtype, t.shape, t.stride(), t.storage_offset())
        return pack_slot(sid, rec.views(key))

    def _block_slots(self, j: int) -> np.ndarray:
        """Storage/view slots of block j's owned tensors, in row order."""
        b = self.model.layers[j]
        perm = b.kernel.act_perm.keywords["index"]
        wt = lambda w: (w.dtype, torch.Size((w.shape[1], w.shape[0])), (1, w.shape[1]), 0)  # noqa: E731
        return np.array([
            self._slot(b.norm.weight), self._slot(b.norm.bias),
            self._slot(b.up.weight), self._slot(b.up.weight, wt(b.up.weight)), self._slot(b.up.bias),
            self._slot(perm),
            self._slot(b.down.weight), self._slot(b.down.weight, wt(b.down.weight)),
            self._slot(b.down.bias),
        ], dtype=np.int64)

    def fill(self, n_accesses: int, per_graph: int) -> None:
        rec = self.t.recorder
        blocks = len(self.model.layers)
        ln, tr, mm, sel = self.ln, self.tr, self.mm, self.sel
        out0, out1, out2 = (r | FACTORY for r in ln.returns)
        tr_out = tr.returns[0] | VIEW
        mm_out = mm.returns[0] | FACTORY
        sel_out = sel.returns[0] | FACTORY
        # (seq within the block, code, role) per row; roles 0..8 = owned slots
        # (_block_slots order), 9..14 = intermediates (ln out, mean, rstd, h, h2, out), 15 = x_in
        template = [
            (0, ln.positional[0], 15), (0, ln.positional[2], 0), (0, ln.positional[3], 1),
            (0, out0, 9), (0, out1, 10), (0, out2, 11),
            (1, tr.positional[0], 2), (1, tr_out, 3),
            (2, mm.positional[0], 4), (2, mm.positional[1], 9), (2, mm.positional[2], 3),
            (2, mm_out, 12),
            (3, sel.positional[0], 12), (3, sel.positional[2], 5), (3, sel_out, 13),
            (4, tr.positional[0], 6), (4, tr_out, 7),
            (5, mm.positional[0], 8), (5, mm.positional[1], 13), (5, mm.positional[2], 7),
            (5, mm_out, 14),
        ]
        assert len(template) == ACCESSES_PER_BLOCK
        t_seq = np.array([r[0] for r in template], dtype=np.int64)
        t_code = np.array([r[1] for r in template], dtype=np.int64)
        t_role = np.array([r[2] for r in template], dtype=np.int64)
        op_ids = np.array([ln.op_id, tr.op_id, mm.op_id, sel.op_id, tr.op_id, mm.op_id], dtype=np.int32)
        owned_cache: dict[int, np.ndarray] = {}
        mod_cache: dict[int, np.ndarray] = {}
        for g, start, count in _windows(n_accesses, blocks, per_graph):
            cap = rec.new_capture(f"synthetic{g}", "cuda")
            js = [(start + k) % blocks for k in range(count)]
            owned = np.stack([owned_cache[j] if j in owned_cache
                              else owned_cache.setdefault(j, self._block_slots(j)) for j in js])
            b = 1 + g % 8
            inter = np.empty((count, 6), dtype=np.int64)
            for k in range(count):
                for r, kind in enumerate((0, 1, 1, 0, 0, 0)):  # ln out, mean, rstd, h, h2, out
                    inter[k, r] = self._slot(self._take(b, kind))
            x_in = np.empty(count, dtype=np.int64)
            x_in[0] = self._slot(self.inputs[b])
            x_in[1:] = inter[:-1, 5]
            roles = np.concatenate([owned, inter, x_in[:, None]], axis=1)  # (count, 16)
            seq = (np.arange(count, dtype=np.int64)[:, None] * OPS_PER_BLOCK + t_seq[None, :])
            rows = np.stack([seq, np.broadcast_to(t_code, seq.shape), roles[:, t_role]], axis=-1)
            cap.accesses.frombytes(np.ascontiguousarray(rows, dtype=np.int64).tobytes())
            cap.ops.frombytes(np.tile(op_ids, count).tobytes())
            mods = []
            for j in js:
                m = mod_cache.get(j)
                if m is None:  # the module each op runs in, as the trace's hooks report it
                    norm, up, block, down = (rec.names(f"layers.{j}{name}")
                                             for name in (".norm", ".up", "", ".down"))
                    m = mod_cache[j] = np.array([norm, up, up, block, down, down], dtype=np.int32)
                mods.append(m)
            cap.op_modules.frombytes(np.concatenate(mods).tobytes())
            assert len(cap.accesses) == ACCESS_FIELDS * ACCESSES_PER_BLOCK * count


def reload(model: Model, keep: list, fraction: float = 0.01) -> tuple[int, int]:
    """Copy into every parameter; rebind perm in 2*fraction of the blocks (half kept alive)."""
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    n = len(model.layers)
    step = max(1, int(1 / fraction))
    stale = dangling = 0
    for i in range(0, n, step):
        for j, hold in ((i, True), (i + step // 2, False)):
            if j >= n:
                continue
            k = model.layers[j].kernel
            old = k.act_perm.keywords["index"]
            k.act_perm = functools.partial(torch.index_select, dim=1, index=old.flip(0).clone())
            if hold:
                keep.append(old)
                stale += 1
            else:
                dangling += 1
            del old
    return stale, dangling


# --------------------------------------------------------------------------- measuring

def frames_alone(report) -> callable:
    """A function building the report's edges/storages/owners frames from ready columns."""
    cols = {}
    for name in ("edges", "storages", "owners"):
        df = getattr(report, name)
        cols[name] = {c: (df[c].astype(object).to_numpy()
                          if isinstance(df[c].dtype, pd.CategoricalDtype)
                          or df[c].dtype == object or pd.api.types.is_string_dtype(df[c].dtype)
                          else df[c].to_numpy())
                      for c in df.columns}

    def build():
        return [pd.DataFrame(c) for c in cols.values()]

    return build


class RssPeak:
    """Peak growth of the process's resident memory while the block runs (sampled every 5 ms)."""

    def __enter__(self):
        import threading

        self.start = self.peak = rss()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self):
        while not self._stop.wait(0.005):
            self.peak = max(self.peak, rss())

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, rss())
        self.growth = self.peak - self.start


def run_size(source: str, n: int, blocks: int, pool: int, per_graph: int, repeat: int,
             tmp: Path, tracemalloc_max: int) -> dict:
    torch.manual_seed(0)
    model = Model(blocks)
    n_modules = sum(1 for _ in model.named_modules())
    gc.collect()
    gc.freeze()  # what exists now (torch, the model) is not walked by every collection
    keep: list = []
    t = gt.trace(model)
    t0 = time.perf_counter()
    t.__enter__()
    enter = time.perf_counter() - t0
    t0 = time.perf_counter()
    synth = None
    if source == "real":
        with torch.no_grad():
            real_captures(t, model, n, per_graph)
    else:
        synth = Synthetic(t, model, pool)
        synth.fill(n, per_graph)
    fill = time.perf_counter() - t0
    t0 = time.perf_counter()
    t.__exit__(None, None, None)
    exit_ = time.perf_counter() - t0
    stale, dangling = reload(model, keep)

    gc.collect()
    with RssPeak() as rss_peak:
        t0 = time.perf_counter()
        report = t.diff()
        t_diff = t_first = time.perf_counter() - t0
    rss_delta = rss_peak.growth / 2**20
    if repeat > 1:
        t_more, report = best_of(t.diff, repeat - 1)
        t_diff = min(t_diff, t_more)
    t_acc, acc = best_of(lambda t=t: t.accesses, repeat)  # t is deleted below
    build = frames_alone(report)
    t_rest, _ = best_of(build, repeat)
    del acc

    peak = None
    if n <= tracemalloc_max:
        gc.collect()
        tracemalloc.start()
        tracemalloc.reset_peak()
        base = tracemalloc.get_traced_memory()[0]
        r2 = t.diff()
        peak = tracemalloc.get_traced_memory()[1] - base
        tracemalloc.stop()
        del r2

    out = tmp / f"{source}_{n}"
    t0 = time.perf_counter()
    report.to_csv(out)
    t_csv = time.perf_counter() - t0
    size = sum(f.stat().st_size for f in out.iterdir())
    graphml = out / "graph.graphml"  # left out by default above GRAPHML_MAX_EDGES edges
    graphml_bytes = graphml.stat().st_size if graphml.exists() else None
    plain = tmp / f"{source}_{n}_frames"  # the four CSVs alone, written as to_csv writes them
    plain.mkdir()
    t0 = time.perf_counter()
    for name in ("accesses", "storages", "owners", "edges"):
        getattr(report, name).to_csv(plain / f"{name}.csv", index=False, lineterminator="\n")
    t_frames_csv = time.perf_counter() - t0
    shutil.rmtree(plain, ignore_errors=True)
    t0 = time.perf_counter()
    back = gt.load_report(out)
    t_load = time.perf_counter() - t0
    ok = len(back.accesses) == len(report.accesses) and len(back.edges) == len(report.edges)
    shutil.rmtree(out, ignore_errors=True)

    counts = report.edges["verdict"].astype(object).value_counts().to_dict()
    res = {
        "source": source, "n": n, "modules": n_modules,
        "accesses": len(report.accesses), "storages": len(report.storages),
        "edges": len(report.edges), "owners": len(report.owners), "graphs": len(t.captures),
        "enter": enter, "fill": fill, "exit": exit_, "diff": t_diff, "diff_first": t_first,
        "accesses_frame": t_acc,
        "other_frames": t_rest, "peak": peak, "rss_delta": rss_delta,
        "csv": t_csv, "frames_csv": t_frames_csv, "graphml_bytes": graphml_bytes,
        "load": t_load, "csv_bytes": size, "roundtrip": ok, "verdicts": counts,
        "stale_expected": stale, "dangling_expected": dangling,
        "stale_seen": counts.get("stale", 0), "dangling_seen": counts.get("dangling", 0),
        "errors": t.recorder.n_errors,
    }
    del report, back, t, synth, model, keep
    gc.unfreeze()
    gc.collect()
    return res


def warm_up_and_check() -> str:
    """Warm up (the first dispatch mode imports torch._dynamo: seconds, part of no size), and
    check that the synthetic rows are what the recorder writes for the same forward."""
    frames = []
    for source in ("real", "synthetic"):
        model = Model(4)
        with gt.trace(model) as t:
            if source == "real":
                x = torch.randn(1, D)
                with gt.capture("g0", emulate=False):
                    model(x, 0, 3)
            else:
                Synthetic(t, model, 32).fill(3 * ACCESSES_PER_BLOCK, 3)
        t.diff()
        frames.append(t.accesses[["seq", "op", "module", "arg", "access", "dtype", "shape",
                                  "stride"]].astype(str))
    real, synth = frames
    if not (len(real) == len(synth) and real.equals(synth)):
        raise SystemExit("synthetic rows differ from a real capture of the same blocks:\n"
                         f"{real.compare(synth) if len(real) == len(synth) else (len(real), len(synth))}")
    return (f"synthetic rows checked against a real capture of 3 blocks: the same {len(real)} rows "
            f"(seq, op, module, arg, access, dtype, shape, stride)")


# --------------------------------------------------------------------------- main

def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_results_options(ap, RESULTS)
    ap.add_argument("--source", choices=("both", "real", "synthetic"), default="both")
    ap.add_argument("--sizes", default=None,
                    help="comma-separated access counts (default 10000,100000,1000000; "
                         "quick 2000,20000)")
    ap.add_argument("--real-max", type=int, default=None,
                    help="largest size captured by real dispatch (default 100000; quick 20000)")
    ap.add_argument("--blocks", type=int, default=None, help="model blocks (default 2500 = 10,002 modules)")
    ap.add_argument("--storages", type=int, default=None, help="storage budget (default 50000)")
    ap.add_argument("--repeat", type=int, default=None, help="min of N for diff and frames (default 5)")
    ap.add_argument("--tracemalloc-max", type=int, default=100_000,
                    help="measure diff's peak Python memory with tracemalloc (a second diff) up to "
                         "this size (default 100000); RSS growth is printed for every size")
    args = ap.parse_args(argv)
    sizes = [int(s) for s in (args.sizes or ("500,2000" if args.quick
                                             else "10000,100000,1000000")).split(",")]
    real_max = args.real_max if args.real_max is not None else (500 if args.quick else 100000)
    blocks = args.blocks or (50 if args.quick else 2500)
    storages = args.storages or (2000 if args.quick else 50000)
    # min of 5: the first diffs of a size vary most (a heap still growing, the RSS sampler
    # beside the first one); the frames get the same number of tries
    repeat = args.repeat or (1 if args.quick else 5)
    out_path = args.out if args.out is not None else (None if args.quick else RESULTS)
    per_graph = 500 if not args.quick else 25
    # owned storages: 6 parameters + 1 perm per block; the rest of the budget is intermediates
    pool = max(storages // 5, storages - 7 * blocks)
    torch.set_num_threads(1)

    results_file = Results()
    say = results_file.say

    results_file.heading(
        f"graphtrace {HEADER}", "analysis/bench_scale.py", args.quick, f"torch {torch.__version__}",
        f"pandas {pd.__version__}", f"numpy {np.__version__}",
        f"Python {platform.python_version()}", f"{os.cpu_count()} CPUs")
    say(f"model: {blocks} blocks = {4 * blocks + 2:,} modules, {6 * blocks:,} parameters, "
        f"{blocks:,} attribute-only perm tensors; {ACCESSES_PER_BLOCK} accesses and "
        f"{OPS_PER_BLOCK} ops per block forward, {per_graph} blocks per graph; synthetic "
        f"intermediates pool {pool:,} (storage budget {storages:,}); reload: parameters "
        f"copied in place, perm rebound in 1% of blocks kept alive (stale) and 1% dropped "
        f"(dangling); times are min of {repeat} (CSV write/read: one)")
    say()

    say(warm_up_and_check())
    say()
    tmp = Path(tempfile.mkdtemp(prefix="graphtrace-bench-scale-"))
    results = []
    try:
        for source in ("real", "synthetic"):
            if args.source not in ("both", source):
                continue
            for n in sizes:
                if source == "real" and n > real_max:
                    continue
                r = run_size(source, n, blocks, pool, per_graph, repeat, tmp,
                             args.tracemalloc_max)
                results.append(r)
                print(f"  ... {source} {n:,}: diff {r['diff']:.2f} s", flush=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    say(f"## {HEADER}")
    say(f"{'source':<10}{'accesses':>10}{'storages':>9}{'edges':>9}{'graphs':>7}"
        f"{'exit s':>7}{'diff s':>8}{'(1st)':>7}{'frames s':>9}{'diff/frames':>12}{'diff/acc':>9}"
        f"{'µs/access':>10}{'growth':>7}{'peak MiB':>9}{'rss+ MiB':>9}{'csv s':>7}{'(frames)':>9}"
        f"{'load s':>7}{'files MiB':>10}")
    prev = {}
    for r in results:
        frames = r["accesses_frame"] + r["other_frames"]
        growth = ""
        p = prev.get(r["source"])
        if p is not None:
            growth = f"{r['diff'] / p['diff']:.1f}x"
        prev[r["source"]] = r
        peak = "n/a" if r["peak"] is None else f"{r['peak'] / 2**20:.0f}"
        say(f"{r['source']:<10}{r['accesses']:>10,}{r['storages']:>9,}{r['edges']:>9,}{r['graphs']:>7}"
            f"{r['exit']:>7.2f}{r['diff']:>8.2f}{r['diff_first']:>7.2f}{frames:>9.2f}"
            f"{r['diff'] / frames:>11.1f}x"
            f"{r['diff'] / r['accesses_frame']:>8.1f}x{r['diff'] / r['accesses'] * 1e6:>10.2f}"
            f"{growth:>7}{peak:>9}{r['rss_delta']:>9.0f}{r['csv']:>7.1f}{r['frames_csv']:>9.1f}"
            f"{r['load']:>7.1f}{r['csv_bytes'] / 2**20:>10.1f}")
    say()
    say("columns: exit = trace exit (owner snapshot of the model, matching storages); diff = "
        "t.diff(), min of the runs, (1st) = the first of them, on a heap not yet grown to its "
        "size (page faults); frames = same-sized DataFrames alone (t.accesses + edges/storages/owners "
        "built by pandas from ready columns); diff/acc = diff / t.accesses alone; growth = "
        "diff time / previous size's (10x accesses each step: linear is ~10x); peak = "
        "tracemalloc peak during a second diff (Python + numpy heap); rss+ = peak growth of the "
        "process's resident memory during the first diff (sampled every 5 ms); csv = report.to_csv (4 CSVs + GraphML + manifest), (frames) = the same four "
        "CSVs written alone, the rest is mostly GraphML; load = gt.load_report; files = folder size")
    for r in results:
        v = ", ".join(f"{k} {n:,}" for k, n in sorted(r["verdicts"].items()))
        say(f"{r['source']} {r['accesses']:,}: owners {r['owners']:,}; verdicts: {v}; "
            f"the reload made {r['stale_expected']} perm storages stale and {r['dangling_expected']} "
            f"dangling; "
            f"round trip {'ok' if r['roundtrip'] else 'MISMATCH'}; recorder errors {r['errors']}; "
            + (f"GraphML {r['graphml_bytes'] / 2**20:.1f} MiB of {r['csv_bytes'] / 2**20:.1f}; "
               if r["graphml_bytes"] is not None else "GraphML skipped (to_csv default above "
               "200,000 edges); ") +
            f"fill {r['fill']:.2f} s; trace enter {r['enter']:.2f} s")
    syn = [r for r in results if r["source"] == "synthetic"]
    if syn:
        ratios = ", ".join(f"{r['accesses']:,}: {r['diff'] / (r['accesses_frame'] + r['other_frames']):.1f}x"
                           for r in syn)
        big = syn[-1]
        worst = big["diff"] / (big["accesses_frame"] + big["other_frames"])
        first = big["diff_first"] / (big["accesses_frame"] + big["other_frames"])
        say(f"goal: diff <= 3x the same-sized frames alone, at the largest size: {worst:.1f}x -> "
            f"{'met' if worst <= 3 else 'NOT met'} (first diff alone: {first:.1f}x; all sizes: "
            f"{ratios}; small sizes are dominated by fixed costs such as walking the model's "
            f"owners again)")
        if len(syn) > 1:
            per = [r["diff"] / r["accesses"] for r in syn]
            steps = [b["diff"] / a["diff"] for a, b in zip(syn, syn[1:])]
            grow = [b["accesses"] / a["accesses"] for a, b in zip(syn, syn[1:])]
            linear = all(s <= 1.25 * g for s, g in zip(steps, grow))
            say(f"goal: linear growth: diff grows {', '.join(f'{s:.1f}x' for s in steps)} for "
                f"{', '.join(f'{g:.0f}x' for g in grow)} the accesses; µs per access "
                f"{' -> '.join(f'{p * 1e6:.2f}' for p in per)} -> "
                f"{'met (at most linear)' if linear else 'NOT met (super-linear)'}")

    results_file.write(out_path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
