"""Merge the per-rank report folders the worker plugin writes (torch-free).

``<dir>/<tag>/rank0/``, ``rank1/``, ... each hold one report. :func:`merge_reports` reads
them (``graphtrace.load_report``) and returns one :class:`graphtrace.Report`:

- ``graph_id`` and ``storage_id`` are offset per rank so they stay unique;
- every frame gets an int column ``rank``;
- graph labels become ``rank<R>/<label>`` and owner models ``rank<R>`` (``rank<R>.runner``
  for the runner view), so owner nodes of different ranks do not merge in ``report.graph``;
- ``meta``: ``graphs`` re-numbered, ``errors`` tagged with their rank, ``blind_spots``
  de-duplicated (tensor-parallel ranks report the same sites), ``ranks`` lists each rank's
  folder and ``vllm`` meta.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Iterable

import pandas as pd

__all__ = ["rank_folders", "merge_reports"]

_RANK_RE = re.compile(r"^rank(\d+)(?:-.*)?$")


def rank_folders(folder: str | Path) -> list[tuple[int, Path]]:
    """``(rank, path)`` of every ``rank<R>[-suffix]/manifest.json`` under ``folder``."""
    out = []
    for child in sorted(Path(folder).iterdir()):
        m = _RANK_RE.match(child.name)
        if m and (child / "manifest.json").is_file():
            out.append((int(m.group(1)), child))
    out.sort(key=lambda rp: (rp[0], rp[1].name))
    return out


def merge_reports(folder: str | Path | Iterable[str | Path], out: str | Path | None = None):
    """One Report from per-rank folders (a parent folder, or an iterable of rank folders).
    Writes it to ``out`` when given."""
    from graphtrace.report import Report, load_report

    if isinstance(folder, (str, Path)):
        ranks = rank_folders(folder)
        if not ranks:
            raise FileNotFoundError(f"no rank<R>/manifest.json under {folder}")
    else:
        ranks = []
        for i, p in enumerate(folder):
            p = Path(p)
            m = _RANK_RE.match(p.name)
            ranks.append((int(m.group(1)) if m else i, p))

    frames: dict[str, list[pd.DataFrame]] = {"accesses": [], "storages": [], "owners": [],
                                             "edges": []}
    meta: dict = {"graphs": [], "errors": [], "blind_spots": [], "models": [], "ranks": []}
    g_off = s_off = 0
    for rank, path in ranks:
        rep = load_report(path)
        tag = f"rank{rank}"

        def relabel(s: pd.Series) -> pd.Series:
            return (tag + "/" + s.astype(str)).astype(object)

        def remodel(model: str) -> str:
            return tag if model == "" else f"{tag}.{model}"

        a = rep.accesses.copy()
        a["graph_id"] += g_off
        a["storage_id"] += s_off
        a["graph"] = relabel(a["graph"])
        st = rep.storages.copy()
        st["storage_id"] += s_off
        ow = rep.owners.copy()
        ow["storage_id"] += s_off
        ow["model"] = ow["model"].astype(str).map(remodel).astype(object)
        ed = rep.edges.copy()
        ed["graph_id"] += g_off
        ed["storage_id"] += s_off
        ed["graph"] = relabel(ed["graph"])
        for name, df in (("accesses", a), ("storages", st), ("owners", ow), ("edges", ed)):
            df["rank"] = rank
            frames[name].append(df)
        m = rep.meta
        graph_ids = [g.get("graph_id", 0) for g in m.get("graphs", [])]
        for g in m.get("graphs", []):
            g = dict(g)
            g["graph_id"] = int(g.get("graph_id", 0)) + g_off
            g["label"] = f"{tag}/{g.get('label', '')}"
            g["rank"] = rank
            meta["graphs"].append(g)
        for e in m.get("errors", []):
            meta["errors"].append({**e, "rank": rank})
        for b in m.get("blind_spots", []):
            if b not in meta["blind_spots"]:
                meta["blind_spots"].append(b)
        meta["models"].extend(map(remodel, m.get("models", [])))
        meta["ranks"].append({"rank": rank, "folder": str(path), "vllm": m.get("vllm", {})})
        for key in ("graphtrace_version", "torch_version", "stack"):
            meta.setdefault(key, m.get(key))
        n_graphs = max([len(rep.meta.get("graphs", []))]
                       + [int(x) + 1 for x in graph_ids]
                       + ([int(rep.accesses["graph_id"].max()) + 1] if len(rep.accesses) else []))
        g_off += n_graphs
        s_off += int(rep.storages["storage_id"].max()) + 1 if len(rep.storages) else 0
    meta["n_errors"] = len(meta["errors"])
    merged = {name: pd.concat(dfs, ignore_index=True) if dfs else None
              for name, dfs in frames.items()}
    report = Report(**merged, meta=meta)
    if out is not None:
        report.to_csv(out)
    return report
