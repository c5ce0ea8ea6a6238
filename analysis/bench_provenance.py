"""What provenance (Note [provenance] in graphtrace/provenance.py) costs.

1. Capture: the same capture region with provenance on and off, in the same run
   (interleaved, min of N). Provenance is popped off the dispatch stack for the region, so
   the ratio should be 1 within noise.
2. Loading: building and processing the demo model (every storage an op makes is noted with
   its site) with provenance on, against the same inside a trace with provenance off, and
   against no trace at all; the cost per created storage; and provenance with lineage
   (Note [lineage] in graphtrace/lineage/graph.py) against provenance alone.

Run: ``PYTHONPATH=$PWD python analysis/bench_provenance.py [--quick]``; the full run writes
analysis/results/bench_provenance.txt.
"""

from __future__ import annotations

import argparse
import sys

import torch

import graphtrace as gt
from _common import ROOT, best_of, revision, write_results
from graphtrace.demo.model import DemoModel

RESULTS = ROOT / "analysis" / "results" / "bench_provenance.txt"


def _capture_time(model, x, provenance: bool, repeat: int, captures: int) -> float:
    with torch.no_grad(), gt.trace(model, provenance=provenance):
        def run():
            for i in range(captures):
                with gt.capture(f"g{i}", emulate=False):
                    model(x)
        t, _ = best_of(run, repeat)
    return t / captures


def _load(provenance: bool | None, layers: int, lineage: bool = False) -> tuple[float, int]:
    """Seconds to build + load + process the demo model; storages noted (0 without a trace).
    `lineage`: with provenance, record lineage too (Note [lineage]); else provenance alone."""
    def build():
        with torch.no_grad():
            return DemoModel("unfixed-partial", n_layers=layers, seed=0, device="cpu",
                             reload_backend="builtin")
    if provenance is None:
        t, _ = best_of(build, 1)
        return t, 0
    with gt.trace(provenance=provenance, lineage=lineage) as tr:
        t, _ = best_of(build, 1)
        noted = tr.provenance.table.n_added if tr.provenance is not None else 0
    return t, noted


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="few repeats, no results file")
    args = ap.parse_args(argv)
    repeat, rounds = (3, 2) if args.quick else (7, 5)
    layers = 8 if args.quick else 32
    lines: list[str] = []

    def say(text: str = "") -> None:
        print(text, flush=True)
        lines.append(text)

    say(f"graphtrace provenance benchmark, {revision()}, torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads")
    model = DemoModel("unfixed-partial", n_layers=layers, seed=0, device="cpu",
                      reload_backend="builtin")
    x = model.make_input(4)
    on, off = [], []
    for _ in range(rounds):  # interleaved: drift hits both alike
        off.append(_capture_time(model, x, False, repeat, 4))
        on.append(_capture_time(model, x, True, repeat, 4))
    c_on, c_off = min(on), min(off)
    say("")
    say(f"capture ({layers}-layer demo model, one forward per capture, min of "
        f"{rounds}x{repeat}):")
    say(f"  provenance off  {c_off * 1e3:8.2f} ms/capture")
    say(f"  provenance on   {c_on * 1e3:8.2f} ms/capture")
    say(f"  ratio on/off    {c_on / c_off:8.3f}")

    plain, trace_off, trace_on, trace_lineage = [], [], [], []
    noted = 0
    for _ in range(rounds):
        plain.append(_load(None, layers)[0])
        trace_off.append(_load(False, layers)[0])
        t, noted = _load(True, layers)
        trace_on.append(t)
        trace_lineage.append(_load(True, layers, lineage=True)[0])
    t_plain, t_off, t_on = min(plain), min(trace_off), min(trace_on)
    t_lin = min(trace_lineage)
    say("")
    say(f"loading (build, load, process the {layers}-layer demo model, min of {rounds}):")
    say(f"  no trace                 {t_plain * 1e3:8.2f} ms")
    say(f"  trace, provenance off    {t_off * 1e3:8.2f} ms")
    say(f"  trace, provenance on     {t_on * 1e3:8.2f} ms  ({noted} storages noted)")
    say(f"  ratio on/off             {t_on / t_off:8.3f}")
    say(f"  ratio on/no trace        {t_on / t_plain:8.3f}")
    if noted:
        say(f"  per created storage      {(t_on - t_off) / noted * 1e6:8.2f} us "
            "(on minus off, over storages noted)")
    say(f"  provenance + lineage     {t_lin * 1e3:8.2f} ms")
    say(f"  ratio lineage/provenance {t_lin / t_on:8.3f}  (issue 24's goal: at most 1.5)")
    if not args.quick:
        write_results(RESULTS, "\n".join(lines) + "\n")
        print(f"wrote {RESULTS}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
