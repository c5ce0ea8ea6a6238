"""What a trace left open while the model serves costs (outside captures).

An engine opens `gt.trace()` before it loads, captures its graphs, and then serves for hours
with the trace still open (so that a later weight update is recorded). Its forwards outside
captures should cost at most 1.1x a forward with no trace open. Under the default
`record="auto"` provenance and lineage pause once graphs exist and the model serves (Note
[recording while serving] in graphtrace/tracing/rule.py); `record="always"` is the cost without
that rule (every op through provenance's and lineage's dispatch mode).

Per workload, per round, interleaved (the order rotates each round): N forwards with no trace
open, then for each session kind a trace is opened, the model loaded inside it (its weights
made inside the trace, as an engine does), one graph captured, and N forwards timed in this
thread's CPU time (`time.thread_time`: the machine is shared, and other processes' load then
counts less); the minimum over rounds of each is kept. Printed: ms per forward and the ratio
to no trace.

Sessions: default settings (`gt.trace(model)`: provenance + lineage on, record="auto"), the
same after a weight update (`load_state_dict` resumes recording; the first forward pauses it
again), `record="always"` and `provenance=False`.

Workloads: `mlp` (40 blocks of Linear(64) + GELU + LayerNorm, batch 4: the workload of issue
27), `elementwise` (many small ops per block: an RMSNorm written out, SiLU, a gate, a
clamp, a residual) and `identity` (nn.Identity modules, 2.5 per block: 100 at 40 blocks,
so that what a module call costs shows). Beside each ratio: the time added per module call
(module attribution's wrappers cost it while they are on; they are off while the model serves
under `record="auto"`: Note [attribution while serving] in graphtrace/attribution.py;
`provenance=False` turns that rule off, and attribution stays on).

    python analysis/bench_serving.py            # writes analysis/results/bench_serving.txt
    python analysis/bench_serving.py --quick    # smoke run (seconds), writes nothing unless --out
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from pathlib import Path

import torch
from torch import nn

import graphtrace as gt
from _common import Results, add_results_options, revision

RESULTS = Path(__file__).resolve().parent / "results" / "bench_serving.txt"
GOAL = 1.1


class MLP(nn.Module):
    def __init__(self, blocks: int, d: int = 64):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(d, d), nn.GELU(), nn.LayerNorm(d))
                                    for _ in range(blocks))

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x


class Elementwise(nn.Module):
    def __init__(self, blocks: int, d: int = 32):
        super().__init__()
        self.w = nn.ParameterList(nn.Parameter(torch.ones(d)) for _ in range(blocks))
        self.g = nn.ParameterList(nn.Parameter(torch.rand(d)) for _ in range(blocks))

    def forward(self, x):
        for w, g in zip(self.w, self.g):
            h = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w
            h = torch.nn.functional.silu(h) * g
            x = x + h.clamp(-4, 4)
        return x


class Identity(nn.Module):
    def __init__(self, blocks: int, d: int = 4):
        super().__init__()
        self.mods = nn.ModuleList(nn.Identity() for _ in range(blocks * 5 // 2))

    def forward(self, x):
        for m in self.mods:
            x = m(x)
        return x


WORKLOADS = {"mlp": (MLP, 64), "elementwise": (Elementwise, 32), "identity": (Identity, 4)}


def _module_calls(model, x) -> int:
    """Module calls in one forward (a global pre-hook counts them, then goes)."""
    from torch.nn.modules.module import register_module_forward_pre_hook

    calls = []
    handle = register_module_forward_pre_hook(lambda module, args: calls.append(1))
    try:
        with torch.no_grad():
            model(x)
    finally:
        handle.remove()
    return len(calls)


def _timed(model, x, n: int) -> float:
    """Seconds per forward, over `n` forwards (no_grad, as serving runs)."""
    with torch.no_grad():
        t0 = time.thread_time()
        for _ in range(n):
            model(x)
        return (time.thread_time() - t0) / n


def _session(kind: str, make, x, n: int) -> tuple[float, bool]:
    """Open a trace of `kind` (or none), load and capture inside it, time `n` forwards;
    (s/forward, whether provenance was recording while they ran)."""
    if kind == "none":  # the same model made the same way, no trace
        model = make()
        with torch.no_grad():
            model(x)
            model(x)
        return _timed(model, x, n), False
    kwargs = {"default": {}, "after update": {}, "always": {"record": "always"},
              "provenance off": {"provenance": False}}[kind]
    with gt.trace(**kwargs) as t:
        model = make()  # built and loaded inside the trace, as an engine does
        t.watch(model)
        with torch.no_grad():
            model(x)  # warm-up
            with gt.capture("serve"):
                model(x)
        if kind == "after update":
            model.load_state_dict({k: v.clone() for k, v in model.state_dict().items()})
        with torch.no_grad():
            model(x)  # the first forward after the capture (or update)
        recording = t.provenance_recording
        return _timed(model, x, n), recording


def measure(workload: str, blocks: int, rounds: int, n: int, say) -> float:
    cls, d = WORKLOADS[workload]
    torch.manual_seed(0)
    x = torch.randn(4, d)
    kinds = ["none", "default", "after update", "always", "provenance off"]
    times: dict[str, list[float]] = {k: [] for k in kinds}
    recording: dict[str, bool] = {}
    for r in range(rounds):
        order = kinds[r % len(kinds):] + kinds[:r % len(kinds)]
        for kind in order:
            t, rec = _session(kind, lambda: cls(blocks), x, n)
            times[kind].append(t)
            recording[kind] = rec
    med = {k: min(v) for k, v in times.items()}
    calls = _module_calls(cls(blocks), x)
    say(f"## {workload}: {blocks} blocks, batch 4, {n} forwards x {rounds} rounds, {calls} module "
        "calls per forward (CPU time, min over rounds)")
    say(f"{'session':<34} {'ms/forward':>11} {'x no trace':>11} {'+us/call':>9}  "
        "provenance recording")
    for k in kinds:
        rec = "" if k == "none" else ("yes" if recording[k] else "no")
        label = {"none": "no trace open", "default": "gt.trace(model) (defaults)",
                 "after update": "defaults, after a load_state_dict",
                 "always": 'record="always"', "provenance off": "provenance=False"}[k]
        per_call = (med[k] - med["none"]) / calls * 1e6
        say(f"{label:<34} {med[k] * 1e3:>11.3f} {med[k] / med['none']:>10.3f}x "
            f"{per_call:>9.3f}  {rec}")
    ratio = max(med["default"], med["after update"]) / med["none"]
    say(f"goal: defaults <= {GOAL}x no trace: {'met' if ratio <= GOAL else 'NOT met'} "
        f"({ratio:.3f}x)")
    say()
    return ratio


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_results_options(ap, RESULTS)
    ap.add_argument("--workload", choices=("all", *WORKLOADS), default="all")
    ap.add_argument("--blocks", type=int, default=None, help="blocks (default 40)")
    ap.add_argument("--rounds", type=int, default=None, help="rounds (default 9)")
    ap.add_argument("--forwards", type=int, default=None, help="forwards per round (default 100)")
    args = ap.parse_args(argv)
    blocks = args.blocks or (4 if args.quick else 40)
    rounds = args.rounds or (2 if args.quick else 9)
    n = args.forwards or (3 if args.quick else 100)
    torch.set_num_threads(1)
    res = Results()
    say = res.say
    say("# graphtrace: a trace left open while the model serves (analysis/bench_serving.py)")
    say(f"# revision {revision()}; torch {torch.__version__}; python {platform.python_version()}; "
        f"load average {' '.join(f'{v:.2f}' for v in os.getloadavg())}")
    say()
    for w in (WORKLOADS if args.workload == "all" else [args.workload]):
        measure(w, blocks, rounds, n, say)
    out = args.out if args.out is not None else (None if args.quick else RESULTS)
    res.write(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
