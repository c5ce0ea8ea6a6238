"""``graphtrace`` command line: ``graphtrace report DIR``, ``graphtrace demo``, ``--version``.

Imports no torch: ``report`` reads a folder with :func:`graphtrace.report.load_report`;
``demo`` imports ``graphtrace.demo.runner`` (which needs torch) only when it runs.

Exit status: 0 success; 1 ``report --fail-on-stale`` found stale-like edges; 2 usage
errors and folders that are not reports (one line on stderr, no traceback).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import textwrap
from typing import Sequence

import pandas as pd

from graphtrace import __version__
from graphtrace.report import Report, ReportError, is_na, load_report
from graphtrace.report.check import owner_labels
from graphtrace.vocab import VERDICTS

__all__ = ["main", "format_report", "build_parser"]

PROG = "graphtrace"
CSV_TABLES = ("stale", "edges", "summary", "ownership")


# --------------------------------------------------------------------------- text report

def _clip(text: str, width: int, *, left: bool = False) -> str:
    """Fit ``text`` in ``width`` characters; ``left`` keeps the tail (paths end usefully)."""
    text = str(text)
    if len(text) <= width:
        return text
    if width <= 3:
        return text[:width]
    return "..." + text[-(width - 3):] if left else text[:width - 3] + "..."


def _table(headers: Sequence[str], rows: Sequence[Sequence[str]], *, width: int,
           right: Sequence[bool], indent: str = "  ", max_col: Sequence[int] | None = None,
           stretch: int | None = None) -> list[str]:
    """Plain aligned columns, at most ``width`` characters a line.

    A cell may hold several lines (continuation lines align under their column).
    ``stretch`` is the column that takes whatever width is left. Cells too wide are
    clipped with "...".
    """
    n = len(headers)
    cells = [[str(c).split("\n") for c in row] for row in rows]
    widths = [len(h) for h in headers]
    for row in cells:
        for i, c in enumerate(row):
            widths[i] = max(widths[i], max(len(x) for x in c))
    if max_col:
        widths = [min(w, m) if m else w for w, m in zip(widths, max_col)]
    if stretch is not None:
        fixed = len(indent) + sum(w for i, w in enumerate(widths) if i != stretch) + 2 * (n - 1)
        widths[stretch] = max(len(headers[stretch]), min(widths[stretch], width - fixed))

    def fmt(parts: Sequence[str]) -> str:
        out = []
        for i, p in enumerate(parts):
            p = _clip(p, widths[i])
            out.append(p.rjust(widths[i]) if right[i] else p.ljust(widths[i]))
        return (indent + "  ".join(out)).rstrip()

    lines = [fmt(headers)]
    for row in cells:
        depth = max(len(c) for c in row)
        for k in range(depth):
            lines.append(fmt([c[k] if k < len(c) else "" for c in row]))
    return [_clip(line, width) for line in lines]


def _severity(verdict: str, impact) -> int:
    if impact == "manifest":
        return 0
    if verdict == "dangling":
        return 1
    if impact == "latent":
        return 2
    return 3


def stale_reads(report: Report) -> pd.DataFrame:
    """Stale-like edges grouped per storage (and verdict/impact), most severe first.

    Columns: ``storage_id``, ``verdict``, ``impact``, ``graphs`` (labels, by graph id),
    ``n_graphs``, ``nbytes``, ``ops``, ``owners`` (list of ``path (kind, status)``),
    ``created_at``, ``live_created_at``, ``fix`` (the edges' provenance columns, first edge),
    ``derived_from`` (lineage's sources of the storage, Note [lineage]).
    Order: manifest impact, then dangling, then latent; then more graphs first.
    """
    stale = report.stale
    owners = owner_labels(report)
    groups: dict[tuple, dict] = {}
    for r in stale.sort_values(["graph_id", "storage_id"], kind="stable").itertuples(index=False):
        impact = None if is_na(r.impact) else str(r.impact)
        key = (int(r.storage_id), str(r.verdict), impact)
        g = groups.setdefault(key, {"storage_id": key[0], "verdict": key[1], "impact": impact,
                                    "graphs": [], "nbytes": int(r.nbytes), "ops": [],
                                    "owners": owners.get(key[0])
                                    or [p for p in str(r.owners).split("; ") if p],
                                    "created_at": str(getattr(r, "created_at", "") or ""),
                                    "live_created_at": str(getattr(r, "live_created_at", "")
                                                           or ""),
                                    "fix": str(getattr(r, "fix", "") or ""),
                                    "derived_from": str(getattr(r, "derived_from", "") or "")})
        if str(r.graph) not in g["graphs"]:
            g["graphs"].append(str(r.graph))
        for op in str(r.ops).split(";"):
            if op and op not in g["ops"]:
                g["ops"].append(op)
    rows = sorted(groups.values(), key=lambda g: (_severity(g["verdict"], g["impact"]),
                                                 -len(g["graphs"]), g["storage_id"]))
    for g in rows:
        g["n_graphs"] = len(g["graphs"])
    cols = ["storage_id", "verdict", "impact", "graphs", "n_graphs", "nbytes", "ops", "owners",
            "created_at", "live_created_at", "fix", "derived_from"]
    return pd.DataFrame(rows, columns=cols)


def format_report(report: Report, *, path: str | None = None, width: int = 100,
                  top: int = 20) -> str:
    """The terminal summary of a report: header, verdict table, stale reads (one row per
    storage, owners one per line), blind spots and errors; every line fits ``width``."""
    meta = {**report.meta, **{k: v for k, v in report.manifest.items() if v is not None}}
    lines: list[str] = []
    lines.append(_clip(f"graphtrace report {path}" if path else "graphtrace report", width))
    made = ", ".join(x for x in (
        f"graphtrace {meta['graphtrace_version']}" if meta.get("graphtrace_version") else "",
        f"torch {meta['torch_version']}" if meta.get("torch_version") else "",
        f"created {meta['created']}" if meta.get("created") else "") if x)
    if made:
        lines.append(_clip("  " + made, width))
    n_graphs = len(report.graphs)
    n_st = report.edges["storage_id"].nunique()
    n_stale = len(report.stale)
    n_err = int(meta.get("n_errors", len(report.errors)) or 0)
    lines.append(_clip(
        f"  {n_graphs} graph{'s' * (n_graphs != 1)}, {len(report.edges)} edges on {n_st} "
        f"storages, {len(report.owners)} owners: {n_stale} stale-like edge"
        f"{'s' * (n_stale != 1)}, {n_err} error{'s' * (n_err != 1)}, "
        f"{len(report.blind_spots)} blind spot{'s' * (len(report.blind_spots) != 1)}", width))

    lines += ["", "Verdicts"]
    s = report.summary()
    headers = ["verdict", *s.columns]
    rows = [[v, *[str(int(x)) for x in row]] for v, row in s.iterrows()]
    total = ["total", str(len(report.edges)), str(n_st),
             str(report.edges["graph_id"].nunique()),
             *[str(int(s[c].sum())) for c in s.columns[3:]]]
    rows.append(total)
    lines += _table(headers, rows, width=width, right=[False] + [True] * len(s.columns))

    lines.append("")
    reads = stale_reads(report)
    if reads.empty:
        lines.append("Stale reads: none. Every captured read of an owned storage still "
                     "resolves to its owners.")
    else:
        shown = reads.head(top)
        lines.append(_clip(f"Stale reads: {n_stale} edges on {len(reads)} storages, most "
                           f"severe first" + (f" (top {top})" if len(reads) > top else ""),
                           width))
        rows = []
        for g in shown.itertuples(index=False):
            graphs = g.graphs[0] + (f" +{len(g.graphs) - 1}" if len(g.graphs) > 1 else "")
            rows.append([g.verdict, g.impact or "", f"s{g.storage_id}", str(g.nbytes), graphs,
                         ", ".join(g.ops)])
        table = _table(["verdict", "impact", "storage", "bytes", "graphs", "ops"], rows,
                       width=width, right=[False, False, True, True, False, False],
                       max_col=[11, 8, 8, 12, 24, 0], stretch=5)
        lines.append(table[0])
        for row_line, g in zip(table[1:], shown.itertuples(index=False)):
            lines.append(row_line)
            for owner in g.owners or ["(no owner)"]:
                if len(owner) + 6 > width and " (" in owner:  # path, then (kind, status)
                    path, _, rest = owner.rpartition(" (")
                    lines.append("      " + _clip(path, width - 6, left=True))
                    lines.append("        (" + rest)
                else:
                    lines.append("      " + _clip(owner, width - 6, left=True))
            if g.derived_from:  # lineage: source parameter -> this storage -> its graphs
                lines.append(_clip(f"      derived from: {g.derived_from}", width))
                if g.verdict in ("unrefreshed", "dangling"):
                    holder = g.owners[0].split(" (")[0] if g.owners else f"s{g.storage_id}"
                    for source in g.derived_from.split("; "):
                        lines.append(_clip(f"      chain: {source} -> {holder} -> "
                                           f"{', '.join(g.graphs)}", width, left=True))
            for label, text in (("made at", g.created_at), ("now from", g.live_created_at)):
                if text:  # the nearest frame: the line to look at first
                    lines.append(_clip(f"      {label}: {text.split(' < ')[0]}", width,
                                       left=True))
            if g.fix:
                wrapped = textwrap.wrap(g.fix, max(width - 11, 20))
                lines += [("      fix: " if i == 0 else " " * 11) + part
                          for i, part in enumerate(wrapped)]
        if len(reads) > top:
            lines.append(f"  ... {len(reads) - top} more storages (--top N, or --csv stale)")

    found = report.findings
    if len(found):  # lineage's findings: dangling sources, non-idempotent steps
        lines += ["", f"Findings ({len(found)})"]
        for r in found.itertuples(index=False):
            what = f"{r.kind}: {r.holder}" + (f" <- {r.source}" if r.source else "")
            lines.append(_clip(f"  - {what} ({r.op}, x{r.n})", width))
            if r.site:
                lines.append(_clip(f"      at {r.site.split(' < ')[0]}", width, left=True))
    lines += ["", "Blind spots" if report.blind_spots else "Blind spots: none reported"]
    for b in report.blind_spots:
        text = b.get("message", b) if isinstance(b, dict) else b
        lines.append(_clip(f"  - {text}", width))
    errors = report.errors
    if errors or n_err:
        lines += ["", f"Errors ({n_err}; the recorder failed open and carried on)"]
        for e in errors[:10]:
            if isinstance(e, dict):
                msg = str(e.get("message", "")).strip().splitlines()
                text = f"{e.get('where', '?')}: {msg[0] if msg else ''}"
            else:
                text = str(e)
            lines.append(_clip(f"  - {text}", width))
        if len(errors) > 10:
            lines.append(f"  ... {len(errors) - 10} more (see manifest.json)")
    return "\n".join(_clip(line, width) for line in lines) + "\n"


def _records(df: pd.DataFrame) -> list[dict]:
    return json.loads(df.to_json(orient="records")) if len(df) else []


def report_json(report: Report, path: str | None = None) -> dict:
    """Everything ``report --json`` prints, as plain JSON data."""
    info = {**report.meta, **{k: v for k, v in report.manifest.items() if v is not None}}
    s = report.summary()
    return {
        "path": path,
        "format_version": info.get("format_version"),
        "graphtrace_version": info.get("graphtrace_version"),
        "torch_version": info.get("torch_version"),
        "created": info.get("created"),
        "graphs": _records(report.graphs),
        "counts": report.counts(),
        "summary": {v: {c: int(s.at[v, c]) for c in s.columns} for v in VERDICTS},
        "n_edges": len(report.edges),
        "n_stale": len(report.stale),
        "stale": _records(report.stale),
        "stale_reads": _records(stale_reads(report)),
        "blind_spots": [b.to_json() for b in report.blind_spot_records],
        "findings": _records(report.findings),
        "errors": report.errors,
    }


# --------------------------------------------------------------------------- commands

def _err(command: str, message: str) -> int:
    print(f"{PROG} {command}: error: {message}", file=sys.stderr)
    return 2


# What a command needs that a plain `pip install graphtrace` lacks: top-level module -> the
# install command to say.
NEEDS = {"torch": "pip install 'graphtrace[torch]'", "vllm": "pip install vllm"}


def _missing(e: BaseException) -> str | None:
    """The extra (torch, vllm) whose absence raised ``e``, if that is what it is."""
    if isinstance(e, ImportError):
        top = (getattr(e, "name", None) or "").split(".")[0]
        if top in NEEDS:
            return top
    return None


def _needs(command: str, module: str) -> int:
    return _err(command, f"this command needs {module}, which is not installed: "
                         f"{NEEDS[module]}")


def _cmd_report(args: argparse.Namespace) -> int:
    try:
        report = load_report(args.dir)
    except ReportError as e:
        return _err("report", str(e))
    except Exception as e:  # a folder we could not read at all: one line, no traceback
        if os.environ.get("GRAPHTRACE_DEBUG"):
            raise
        return _err("report", f"{args.dir}: cannot read report: {type(e).__name__}: {e}")
    try:
        text = _render(report, args)
    except BrokenPipeError:
        raise
    except Exception as e:  # a report that loaded is displayable; if not, still one line
        if os.environ.get("GRAPHTRACE_DEBUG"):
            raise
        return _err("report", f"{args.dir}: cannot display report: "
                              f"{type(e).__name__}: {_one_line(e)}")
    sys.stdout.write(text)
    if args.fail_on_stale and len(report.stale):
        return 1
    return 0


def _one_line(e: BaseException) -> str:
    return str(e).splitlines()[0] if str(e) else ""


def _render(report: Report, args: argparse.Namespace) -> str:
    """What ``report`` prints, in the output mode ``args`` asks for."""
    if args.json:
        return json.dumps(report_json(report, str(args.dir)), indent=2) + "\n"
    if args.csv:
        if args.csv == "stale":
            df = report.stale
        elif args.csv == "edges":
            df = report.edges
        elif args.csv == "summary":
            df = report.summary().reset_index()
        else:
            from graphtrace.explore import ownership_by_graph

            df = ownership_by_graph(report)
        return df.to_csv(index=False, lineterminator="\n")
    return format_report(report, path=str(args.dir), width=args.width, top=args.top)


def _cmd_demo(args: argparse.Namespace, rest: list[str]) -> int:
    try:
        from graphtrace.demo import runner
    except ImportError as e:
        if _missing(e):
            return _needs("demo", _missing(e))
        missing = getattr(e, "name", None) or ""
        if missing.startswith("graphtrace.demo"):
            return _err("demo", "demo not available in this installation "
                                "(graphtrace.demo.runner is missing)")
        return _err("demo", f"demo not available: {e}")
    try:  # the runner imports torch (and vLLM, when asked) as it parses and runs
        parser = argparse.ArgumentParser(prog=f"{PROG} demo",
                                         description=(runner.__doc__ or "").strip() or None)
        runner.add_arguments(parser)
        demo_args = parser.parse_args(rest)
        return int(runner.run(demo_args) or 0)
    except ImportError as e:
        if _missing(e) and not os.environ.get("GRAPHTRACE_DEBUG"):
            return _needs("demo", _missing(e))
        raise


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="Find the tensors CUDA graphs read stale after a weight reload.")
    parser.add_argument("--version", action="version", version=f"{PROG} {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    rp = sub.add_parser("report", help="summarise a report folder (written by Report.to_csv)",
                        description="Summarise a report folder: verdicts, stale reads with "
                                    "their owners, blind spots, errors.")
    rp.add_argument("dir", metavar="DIR", help="report folder (holds manifest.json)")
    fmt = rp.add_mutually_exclusive_group()
    fmt.add_argument("--csv", nargs="?", const="stale", choices=CSV_TABLES, metavar="TABLE",
                     help="print one table as CSV instead: stale (default), edges, summary "
                          "or ownership (per graph: edges with a known owner)")
    fmt.add_argument("--json", action="store_true", help="print a JSON object instead")
    rp.add_argument("--top", type=int, default=20, metavar="N",
                    help="stale storages to list (default 20)")
    rp.add_argument("--width", type=int, default=100, metavar="COLS",
                    help="line width of the text report (default 100)")
    rp.add_argument("--fail-on-stale", action="store_true",
                    help="exit 1 when the report has stale-like edges (stale, dangling, diverged, unrefreshed)")

    sub.add_parser("demo", add_help=False, help="run the reproduction demo (needs torch); "
                                                "'graphtrace demo --help' for its options")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    try:
        args, rest = parser.parse_known_args(list(sys.argv[1:] if argv is None else argv))
        if args.command == "demo":
            return _cmd_demo(args, rest)
        if rest:
            parser.error(f"unrecognized arguments: {' '.join(rest)}")
        if args.command == "report":
            return _cmd_report(args)
        parser.print_help(sys.stderr)
        return 2
    except SystemExit as e:  # argparse: --help, --version, usage errors
        if isinstance(e.code, str):  # SystemExit("message"): say it, as Python itself would
            print(e.code, file=sys.stderr)
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 2)
    except BrokenPipeError:  # `graphtrace report DIR | head`
        try:
            sys.stdout = open(os.devnull, "w")
        except OSError:
            pass
        return 0


if __name__ == "__main__":
    sys.exit(main())
