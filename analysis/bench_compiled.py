"""What recording compiled regions costs (issue 14): a traced capture of a torch.compile'd
(Inductor, CPU) workload against a no-op TorchDispatchMode on the same workload.

Rows (min of N rounds, each round R calls of the compiled model):
- baseline: the compiled model, nothing around it;
- no-op mode: a TorchDispatchMode that only runs each op (with `ignore_compile_internals`, as
  graphtrace's, so Dynamo keeps the compiled frames); it sees the extern kernels;
- graphtrace: `gt.trace(model)` open, each round one `gt.capture(emulate=False)` region around
  the R calls (records only, as for a real CUDA graph): extern kernels recorded, one
  `compiled::` op per region call with its inputs, the owner match at capture end;
- graphtrace, emulated: the same with a replayable emulated graph, which keeps every call's
  inputs and outputs alive (as capture artifacts do), so the allocator hands out fresh memory.
The ratio is graphtrace's added time over the no-op mode's added time (goal: at most 1.3).
Two ratios are printed: "region" times each side's whole region (the no-op mode's enter and
exit; graphtrace's capture open and close, whose close matches the captured storages to
owners), "calls only" times the R calls inside each side's region (both without its open and
close), and the region's open+close cost is printed per region.

The boundary record's own time per call is measured in rounds of its own (its timer is not in
the ratio rounds). Then the boundary record alone: one compiled region with 500 tensor inputs (a module holding
500 parameters), per call, traced minus no-op mode.

Run: PYTHONPATH=. python analysis/bench_compiled.py [--quick]
Writes analysis/results/bench_compiled.txt.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import graphtrace as gt
from _common import ROOT, revision, write_results
from graphtrace.compiled import CompiledPatch

# CPU time of this thread (kernels run on it: one intra-op thread): on a shared, loaded machine
# wall-clock differences of a few percent drown in other processes' load
CLOCK = time.thread_time


class NoOpMode(TorchDispatchMode):
    @classmethod
    def ignore_compile_internals(cls) -> bool:
        return True

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


class Block(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.up = nn.Linear(d, 4 * d)
        self.down = nn.Linear(4 * d, d)

    def forward(self, x):
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))


class Net(nn.Module):
    def __init__(self, d: int = 64, blocks: int = 4, vocab: int = 256):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(Block(d) for _ in range(blocks))
        self.norm = nn.LayerNorm(d)

    def forward(self, ids):
        x = self.emb(ids)
        for b in self.blocks:
            x = b(x)
        return self.norm(x)


class Wide(nn.Module):
    """One region with `n` parameter inputs: the boundary record's size, not its kernels."""

    def __init__(self, n: int = 500):
        super().__init__()
        self.ws = nn.ParameterList(nn.Parameter(torch.randn(4), requires_grad=False)
                                   for _ in range(n))

    def forward(self, x):
        return x * torch.stack(list(self.ws)).sum(0)


def rounds(model, compiled, x, calls: int, repeat: int, emulate: bool = False):
    """Best-of-`repeat` seconds for `calls` calls: untraced, under the no-op mode, and inside a
    graphtrace capture; the three interleaved round by round, so that the load of a shared
    machine drifts through all of them alike (a new trace per round; only its second capture
    region is timed: the first walks the model for owners, once per trace). Returns them and
    the last round's report."""
    def base():
        for _ in range(calls):
            compiled(x)

    def noop():
        with NoOpMode():
            t = CLOCK()
            for _ in range(calls):
                compiled(x)
            inner[0] = min(inner[0], CLOCK() - t)

    best = [float("inf")] * 3
    inner = [float("inf")] * 2  # the calls alone, inside each side's region
    report = None
    with torch.no_grad():
        base()  # compile and warm
        for _ in range(repeat):
            for i, fn in enumerate((base, noop)):
                t0 = CLOCK()
                fn()
                best[i] = min(best[i], CLOCK() - t0)
            with gt.trace(model) as t:
                with gt.capture("warm", emulate=emulate):  # the trace's owner walk: once
                    compiled(x)                             # per trace, not per capture
                t0 = CLOCK()
                with gt.capture("round", emulate=emulate):
                    t1 = CLOCK()
                    for _ in range(calls):
                        compiled(x)
                    inner[1] = min(inner[1], CLOCK() - t1)
                best[2] = min(best[2], CLOCK() - t0)
            report = t
        report = report.diff()
    rounds.inner = inner  # (no-op mode, graphtrace): the calls only
    return best[0], best[1], best[2], report


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer rounds (smoke test)")
    ap.add_argument("--out", default=str(ROOT / "analysis" / "results" / "bench_compiled.txt"))
    args = ap.parse_args(argv)
    repeat, calls = (3, 5) if args.quick else (15, 20)
    torch.manual_seed(0)
    torch.set_num_threads(1)
    lines: list[str] = []

    def say(line: str = "") -> None:
        print(line, flush=True)
        lines.append(line)

    say(f"# bench_compiled at {revision()}, torch {torch.__version__}, "
        f"{torch.get_num_threads()} intra-op thread, thread CPU time, best of {repeat} "
        f"interleaved rounds of {calls} calls")
    model = Net().eval()
    ids = torch.randint(0, 256, (2, 16))
    spent: list[float] = []
    record = CompiledPatch._record

    def timed(self, *a, **k):  # the boundary record alone (the kernels' time is noise here)
        t = CLOCK()
        try:
            return record(self, *a, **k)
        finally:
            spent.append(CLOCK() - t)

    t0 = time.perf_counter()
    compiled = torch.compile(model, backend="inductor")
    t_base, t_noop, t_traced, report = rounds(model, compiled, ids, calls, repeat)
    say(f"compile+warm {time.perf_counter() - t0:.1f} s")
    in_noop, in_traced = (t - t_base for t in rounds.inner)
    inner = rounds.inner
    CompiledPatch._record = timed  # the boundary record alone, in rounds of its own: the
    rounds(model, compiled, ids, calls, max(3, repeat // 3))  # timer is left out of the ratio
    CompiledPatch._record = record
    per = 1e6 / calls
    add_noop, add_traced = t_noop - t_base, t_traced - t_base
    say(f"baseline      {t_base * per:9.1f} us/call")
    say(f"no-op mode    {t_noop * per:9.1f} us/call  (+{add_noop * per:.1f})")
    say(f"graphtrace    {t_traced * per:9.1f} us/call  (+{add_traced * per:.1f})")
    ratio = add_traced / add_noop if add_noop > 0 else float("inf")
    say(f"added-cost ratio graphtrace / no-op mode: {ratio:.2f} (goal <= 1.3)")
    say(f"calls only (each side's region open/close left out): no-op mode "
        f"+{in_noop * per:.1f} us/call, graphtrace +{in_traced * per:.1f}; ratio "
        f"{in_traced / in_noop if in_noop > 0 else float('inf'):.2f}; graphtrace's capture "
        f"open+close {(t_traced - inner[1]) * 1e6:.0f} us per region "
        f"(the no-op mode's enter+exit {(t_noop - inner[0]) * 1e6:.0f} us)")
    spent.sort()
    ops = report.accesses.groupby("op", observed=True)["seq"].nunique()
    externs = ", ".join(f"{op} x{n // calls}" for op, n in ops.items()
                        if not op.startswith("compiled::"))
    say(f"  of which the boundary record (the region's one op): median "
        f"{spent[len(spent) // 2] * 1e6:.1f} us/call; the rest: the boundary wrapper and the "
        f"record of the extern kernels the graph calls ({externs} per call), which both "
        f"modes dispatch")
    _, _, t_emulated, _ = rounds(model, compiled, ids, calls, repeat, emulate=True)
    say(f"graphtrace, emulated graph {t_emulated * per:9.1f} us/call  "
        f"(+{(t_emulated - t_base) * per:.1f}: keeping each call's tensors)")
    row = report.meta["compiled"][-1]
    say(f"region {row['region']}: {row['owned_inputs']}/{row['tensor_inputs']} tensor inputs "
        f"owned, {row['calls']} calls in the last round")

    wide = Wide(500).eval()
    x = torch.randn(4)
    t0 = time.perf_counter()
    cw = torch.compile(wide, backend="inductor")
    wb, wn, wt, wreport = rounds(wide, cw, x, calls, repeat)
    say(f"500-input region: compile+warm {time.perf_counter() - t0:.1f} s")
    spent.clear()
    CompiledPatch._record = timed
    rounds(wide, cw, x, calls, repeat)
    CompiledPatch._record = record
    say(f"  baseline {wb * per:.1f} us/call, no-op mode {wn * per:.1f}, graphtrace {wt * per:.1f}"
        " (the fused kernel's time varies more than the record costs)")
    spent.sort()
    med = spent[len(spent) // 2]
    say(f"  boundary record per call: median {med * 1e6:.1f} us, min {spent[0] * 1e6:.1f} us "
        f"over {len(spent)} calls ({med * 1e9 / 500:.0f} ns per input)")
    wrow = wreport.meta["compiled"][-1]
    say(f"  {wrow['owned_inputs']}/{wrow['tensor_inputs']} tensor inputs owned")
    if not args.quick:
        write_results(__import__("pathlib").Path(args.out), "\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
