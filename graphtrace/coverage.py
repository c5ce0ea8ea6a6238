"""Coverage beyond the dispatcher: do graphtrace's records account for every pointer a
captured CUDA graph's kernels were given?

graphtrace records what the dispatcher sees. Kernels that launch without it (Inductor's
Triton kernels, C++ kernels of compiled CPU code, library internals such as cuBLAS's
workspace) read memory the recorder never hears of. A captured CUDA graph holds the
ground truth: each kernel node keeps the argument values it was launched with. This module
is the torch-free half of that comparison (numpy + pandas only; `graphtrace.cuda_nodes`
reads the kernel nodes on a GPU), in steps: `param_words` / `scan_words`, `pointer_frame`,
`locate`, `classify` (a tier per word: `TIERS`), `kernel_coverage` / `graph_coverage`.

This is the one meaning of *coverage* in graphtrace (the `coverage` columns, the GPU check's
figures). How many of a graph's edges, or of a compiled region's inputs, have a capture-time
owner is *ownership* (`graphtrace.explore.ownership_by_graph`,
`graphtrace.compiled.region_ownership`).
"""

from __future__ import annotations

import re
import struct
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Sequence

import numpy as np
import pandas as pd

__all__ = [
    "KernelNode", "POINTER_COLUMNS", "TIERS", "ATTRIBUTED_TIERS", "param_words", "scan_words",
    "pointer_frame", "node_frame", "locate", "classify", "kernel_coverage", "graph_coverage",
    "CoverageResult", "triton_arg_access", "short_kernel_name", "format_coverage",
]

POINTER_COLUMNS = ["node", "kernel", "param", "offset", "value", "scanned"]

#: tiers in priority order: a word is put in the first tier whose ranges contain it
TIERS = (
    "seen",          # a live storage graphtrace recorded in this graph (read/write/factory)
    "seen-freed",    # the address range of a storage recorded in this graph, freed since
    "seen-other",    # a live storage graphtrace recorded, but only in other graphs
    "owned",         # a live storage a watched model owns that graphtrace did not record here
    "allocator",     # other memory the caller knows (e.g. the caching allocator's segments)
)
ATTRIBUTED_TIERS = ("seen", "seen-freed")
_U64 = np.uint64


# --------------------------------------------------------------------------------------
# raw parameter bytes -> pointer-sized words
# --------------------------------------------------------------------------------------

def scan_words(buf: bytes, base_offset: int = 0) -> list[tuple[int, int]]:
    """Every 8-byte aligned little-endian word of `buf`: [(offset, value)].

    The conservative reading of a parameter buffer whose layout is unknown (a by-value
    struct, or a whole buffer when per-parameter sizes are not available): each aligned
    word is a candidate pointer; words that point nowhere known are dropped later.
    """
    n = len(buf) // 8
    if n == 0:
        return []
    values = struct.unpack_from(f"<{n}Q", buf, 0)
    return [(base_offset + 8 * i, int(v)) for i, v in enumerate(values)]


def param_words(params: Iterable[tuple[int, bytes]]) -> list[tuple[int, int, int, bool]]:
    """Pointer-sized words of a kernel's parameters: [(param, offset, value, scanned)].

    `params` holds each parameter's index and raw bytes (its size is `len(bytes)`):
    an 8-byte parameter is one word (a pointer or a 64-bit scalar); a larger one (a struct
    passed by value, e.g. ATen's `Array<char*, N>` or cuBLAS's parameter block) is scanned
    word by word (`scanned=True`); a smaller one (int32, float, bool) cannot hold a device
    pointer and is skipped. Offsets are relative to the parameter's start.
    """
    out: list[tuple[int, int, int, bool]] = []
    for index, blob in params:
        blob = bytes(blob)
        if len(blob) == 8:
            out.append((int(index), 0, struct.unpack("<Q", blob)[0], False))
        elif len(blob) > 8:
            out.extend((int(index), off, v, True) for off, v in scan_words(blob))
    return out


@dataclass
class KernelNode:
    """One kernel node of a captured graph and its pointer-sized argument words.

    `values` are the words; `params`/`offsets`/`scanned` (optional, same length) say where
    each came from. `param_words` output can be passed as `words` instead.
    """

    name: str
    values: Sequence[int] = ()
    node: int | None = None
    params: Sequence[int] | None = None
    offsets: Sequence[int] | None = None
    scanned: Sequence[bool] | bool = False
    kind: str = "kernel"

    @classmethod
    def from_words(cls, name: str, words: Sequence[tuple[int, int, int, bool]], node=None,
                   kind: str = "kernel") -> "KernelNode":
        return cls(name, [w[2] for w in words], node, [w[0] for w in words],
                   [w[1] for w in words], [bool(w[3]) for w in words], kind)


def _node_rows(i: int, n: Any):
    if isinstance(n, KernelNode):
        node = i if n.node is None else n.node
        vals = list(n.values)
        params = list(n.params) if n.params is not None else list(range(len(vals)))
        offsets = list(n.offsets) if n.offsets is not None else [0] * len(vals)
        scanned = ([bool(n.scanned)] * len(vals) if isinstance(n.scanned, (bool, np.bool_))
                   else [bool(s) for s in n.scanned])
        name = n.name
    elif isinstance(n, Mapping):
        return _node_rows(i, KernelNode(str(n.get("name", n.get("kernel", ""))),
                                        n.get("values", ()), n.get("node"), n.get("params"),
                                        n.get("offsets"), n.get("scanned", False)))
    else:  # (name, values)
        name, vals = n[0], list(n[1])
        node, params, offsets, scanned = i, list(range(len(vals))), [0] * len(vals), [False] * len(vals)
    if not (len(params) == len(offsets) == len(scanned) == len(vals)):
        raise ValueError(f"kernel node {name!r}: values, params, offsets and scanned differ in length")
    return [(node, name, p, o, int(v), s) for v, p, o, s in zip(vals, params, offsets, scanned)]


def node_frame(nodes: Iterable[Any]) -> pd.DataFrame:
    """One row per kernel node (`node`, `kernel`), including nodes without any word."""
    rows = []
    for i, n in enumerate(nodes):
        if isinstance(n, KernelNode):
            rows.append((i if n.node is None else n.node, n.name))
        elif isinstance(n, Mapping):
            node = n.get("node")
            rows.append((i if node is None else node, str(n.get("name", n.get("kernel", "")))))
        else:
            rows.append((i, n[0]))
    return pd.DataFrame(rows, columns=["node", "kernel"]).astype({"node": np.int64})


def pointer_frame(nodes: Iterable[Any]) -> pd.DataFrame:
    """One row per (kernel node, pointer-sized word): `POINTER_COLUMNS`.

    `nodes`: `KernelNode`s, dicts with `name`/`values` (and optional `node`, `params`,
    `offsets`, `scanned`), or `(name, values)` pairs. Values are unsigned 64-bit.
    """
    rows = []
    for i, n in enumerate(nodes):
        rows.extend(_node_rows(i, n))
    frame = pd.DataFrame(rows, columns=POINTER_COLUMNS)
    frame["node"] = frame["node"].astype(np.int64)
    frame["param"] = frame["param"].astype(np.int64)
    frame["offset"] = frame["offset"].astype(np.int64)
    frame["value"] = _u64([int(v) & 0xFFFFFFFFFFFFFFFF for v in frame["value"]])
    frame["scanned"] = frame["scanned"].astype(bool)
    frame["kernel"] = frame["kernel"].astype(object)
    return frame


# --------------------------------------------------------------------------------------
# interval search
# --------------------------------------------------------------------------------------

def _u64(values) -> np.ndarray:
    """Addresses as uint64 without passing through float64 (numpy's pick for a list mixing
    small ints and ints past 2**63)."""
    if isinstance(values, pd.Series):
        values = values.to_numpy()
    if isinstance(values, np.ndarray) and values.dtype.kind in "iu":
        if values.dtype.kind == "i" and values.size and values.min() < 0:
            raise ValueError("addresses must be non-negative")
        return values.astype(_U64, copy=False)
    if isinstance(values, np.ndarray) and values.dtype.kind not in "O":
        raise TypeError(f"addresses must be integers, got an array of {values.dtype}")
    items = [int(v) for v in (values.ravel() if isinstance(values, np.ndarray) else values)]
    if any(v < 0 or v > 0xFFFFFFFFFFFFFFFF for v in items):
        raise ValueError("addresses must be unsigned 64-bit integers")
    return np.array(items, dtype=object).astype(_U64) if items else np.empty(0, _U64)


def locate(values, starts, sizes) -> np.ndarray:
    """For each value, the index (into `starts`/`sizes`) of a range holding it, else -1.

    Ranges are `[start, start + size)`; zero-size ranges hold nothing. Disjoint ranges take
    one `searchsorted`; where ranges overlap, the containing range with the largest start
    (the innermost) wins, found by a second, brute-force pass over the few values left.
    """
    v = _u64(values).ravel()
    s_all = _u64(starts).ravel()
    z_all = _u64(sizes).ravel()
    if len(s_all) != len(z_all):
        raise ValueError("starts and sizes differ in length")
    out = np.full(len(v), -1, dtype=np.int64)
    keep = np.flatnonzero(z_all > 0)
    if len(v) == 0 or len(keep) == 0:
        return out
    order = keep[np.argsort(s_all[keep], kind="stable")]
    s = s_all[order]
    e = s + z_all[order]
    pos = np.searchsorted(s, v, side="right").astype(np.int64) - 1
    has = pos >= 0
    p = np.where(has, pos, 0)
    inside = has & (v < e[p])
    out[inside] = order[p[inside]]
    # a value past its nearest range's end may still sit inside an earlier, longer range
    reach = np.maximum.accumulate(e)
    suspect = np.flatnonzero(has & ~inside & (v < reach[p]))
    for i in suspect.tolist():
        cand = np.flatnonzero((s <= v[i]) & (v[i] < e))
        if len(cand):
            out[i] = order[cand[np.argmax(s[cand])]]
    return out


# --------------------------------------------------------------------------------------
# classification and coverage
# --------------------------------------------------------------------------------------

def _ranges(frame: pd.DataFrame | None, label_col: str | None = None):
    if frame is None or len(frame) == 0:
        return np.empty(0, _U64), np.empty(0, _U64), None, None
    starts = _u64(frame["data_ptr"].to_numpy())
    sizes = _u64(frame["nbytes"].to_numpy())
    sid = frame["storage_id"].to_numpy() if "storage_id" in frame.columns else None
    col = label_col if label_col and label_col in frame.columns else (
        "label" if "label" in frame.columns else None)
    labels = frame[col].astype(str).to_numpy() if col else None
    return starts, sizes, sid, labels


def classify(pointers: pd.DataFrame, tiers: Sequence[tuple[str, pd.DataFrame | None]],
             *, hook: pd.DataFrame | None = None, owned: pd.DataFrame | None = None) -> pd.DataFrame:
    """Add `tier`, `storage_id`, `label`, `range_start`, `hooked`, `owned`, `owner` columns.

    `tiers`: (name, frame) in priority order; each frame has `data_ptr`, `nbytes`, and
    optionally `storage_id` and `label`. A word goes to the first tier with a range that
    holds it; `tier` is "none" when no range does (a scalar, or memory nobody told us of).
    `hook`: ranges a launch hook saw (`hooked`: the word lies in one). `owned`: the watched
    models' storages with a `label` (owner path): `owned` says the word lies in one
    (whichever tier it got), `owner` names it.
    """
    out = pointers.copy()
    n = len(out)
    values = _u64(out["value"].to_numpy()) if n else np.empty(0, _U64)
    tier = np.full(n, "none", dtype=object)
    sid = np.full(n, -1, dtype=np.int64)
    label = np.full(n, "", dtype=object)
    start = np.zeros(n, dtype=_U64)
    todo = np.ones(n, dtype=bool)
    for name, frame in tiers:
        if not todo.any():
            break
        starts, sizes, ids, labels = _ranges(frame)
        if len(starts) == 0:
            continue
        idx_todo = np.flatnonzero(todo)
        hit = locate(values[idx_todo], starts, sizes)
        found = hit >= 0
        rows, where = idx_todo[found], hit[found]
        tier[rows] = name
        if ids is not None:
            sid[rows] = ids[where]
        if labels is not None:
            label[rows] = labels[where]
        start[rows] = starts[where]
        todo[rows] = False
    out["tier"] = tier
    out["storage_id"] = sid
    out["label"] = label
    out["range_start"] = start
    if hook is not None and len(hook):
        hs, hz, _, _ = _ranges(hook)
        out["hooked"] = locate(values, hs, hz) >= 0
    else:
        out["hooked"] = np.zeros(n, dtype=bool)
    if owned is not None and len(owned):
        os_, oz, _, olab = _ranges(owned)
        where = locate(values, os_, oz)
        out["owned"] = where >= 0
        out["owner"] = np.where(where >= 0, olab[np.maximum(where, 0)] if olab is not None else "",
                                "") if n else np.empty(0, dtype=object)
    else:
        out["owned"] = np.zeros(n, dtype=bool)
        out["owner"] = np.full(n, "", dtype=object)
    return out


PER_KERNEL_COLUMNS = ["node", "kernel", "words", "pointers", "attributed", "coverage",
                      "attributed_with_hook", "coverage_with_hook", "owned", "owned_attributed",
                      "seen_freed", "unseen_owners"]


_COUNTS = ("pointers", "attributed", "attributed_with_hook", "owned", "owned_attributed",
           "seen_freed")  # per kernel and in the total, after `words`


def _ratio(a, b):
    return np.where(np.asarray(b) > 0, np.asarray(a, dtype=float) / np.maximum(np.asarray(b), 1),
                    np.nan)


def kernel_coverage(classified: pd.DataFrame, *, attributed: Sequence[str] = ATTRIBUTED_TIERS,
             dedupe: bool = True, nodes: pd.DataFrame | None = None
             ) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Per-kernel and total coverage of a `classify`-ed pointer frame.

    A *pointer* is a word whose tier is not "none" (it lies in known memory). It is
    *attributed* when its tier is in `attributed` (graphtrace recorded that storage in this
    graph), *attributed with hook* when also, or instead, a launch hook saw its range.
    `dedupe` counts a node's words that point into the same range once (a struct often
    repeats a base pointer). Coverage is attributed / pointers (NaN for a node with none).
    `owned` / `owned_attributed` count pointers into model-owned storages: the reads that
    can go stale. `unseen_owners` names the owned storages a node reads that graphtrace did
    not attribute. `nodes` (columns `node`, `kernel`) lists every node, also those
    without any pointer-sized word (default: the nodes that appear in `classified`).
    """
    df = classified[classified["tier"] != "none"]
    if dedupe and len(df):
        key = np.where(df["storage_id"].to_numpy() >= 0, df["storage_id"].astype(str),
                       "@" + df["range_start"].astype(str) + ":" + df["tier"].astype(str))
        df = df.assign(_key=key).drop_duplicates(["node", "_key"]).drop(columns="_key")
    words = classified.groupby("node", sort=True).agg(kernel=("kernel", "first"),
                                                      words=("value", "size"))
    if nodes is not None and len(nodes):
        index = nodes.drop_duplicates("node").set_index("node")[["kernel"]]
        counts = words["words"].reindex(index.index).fillna(0).astype(np.int64)
        extra = words.loc[~words.index.isin(index.index)]
        words = pd.concat([index.assign(words=counts), extra]).sort_index()
    att = df["tier"].isin(list(attributed))
    df = df.assign(_att=att, _atth=att | df["hooked"].astype(bool),
                   _own=df["owned"].astype(bool), _owna=df["owned"].astype(bool) & att,
                   _freed=df["tier"] == "seen-freed",
                   _unseen=np.where(df["owned"].astype(bool) & ~att, df["owner"].astype(str), ""))
    g = df.groupby("node", sort=True)
    agg = pd.DataFrame({
        "pointers": g.size(),
        "attributed": g["_att"].sum(),
        "attributed_with_hook": g["_atth"].sum(),
        "owned": g["_own"].sum(),
        "owned_attributed": g["_owna"].sum(),
        "seen_freed": g["_freed"].sum(),
        "unseen_owners": g["_unseen"].agg(lambda s: "; ".join(sorted({x for x in s if x}))),
    })
    per = words.join(agg, how="left")
    for c in _COUNTS:
        per[c] = per[c].fillna(0).astype(np.int64)
    per["unseen_owners"] = per["unseen_owners"].fillna("").astype(object)
    per["coverage"] = _ratio(per["attributed"], per["pointers"])
    per["coverage_with_hook"] = _ratio(per["attributed_with_hook"], per["pointers"])
    per = per.reset_index()[PER_KERNEL_COLUMNS] if len(per) else pd.DataFrame(columns=PER_KERNEL_COLUMNS)
    tot = {
        "kernels": int(len(per)),
        "kernels_with_pointers": int((per["pointers"] > 0).sum()) if len(per) else 0,
        "kernels_fully_attributed": int(((per["pointers"] > 0) & (per["attributed"] == per["pointers"])).sum()) if len(per) else 0,
    }
    for c in ("words", *_COUNTS):
        tot[c] = int(per[c].sum()) if len(per) else 0
    tot["coverage"] = float(_ratio(tot["attributed"], tot["pointers"]))
    tot["coverage_with_hook"] = float(_ratio(tot["attributed_with_hook"], tot["pointers"]))
    tot["owned_coverage"] = float(_ratio(tot["owned_attributed"], tot["owned"]))
    by_tier = df["tier"].value_counts()
    for t in TIERS:
        tot[f"tier_{t}"] = int(by_tier.get(t, 0))
    unseen = sorted({x for s in per["unseen_owners"] for x in str(s).split("; ") if x}) if len(per) else []
    tot["unseen_owners"] = "; ".join(unseen)
    return per, pd.DataFrame([tot])


@dataclass
class CoverageResult:
    """What `graph_coverage` found: pointer words, per-kernel and total coverage."""

    pointers: pd.DataFrame
    per_kernel: pd.DataFrame
    total: pd.DataFrame
    graph_id: int | None = None
    notes: list = field(default_factory=list)

    @property
    def totals(self) -> dict:
        return self.total.iloc[0].to_dict() if len(self.total) else {}


def _seen_ids(accesses: pd.DataFrame, graph_id, access_kinds) -> np.ndarray:
    acc = accesses
    if graph_id is not None:
        acc = acc[acc["graph_id"] == graph_id]
    if access_kinds is not None:
        acc = acc[acc["access"].astype(str).isin(list(access_kinds))]
    return np.unique(acc["storage_id"].to_numpy(dtype=np.int64))


def graph_coverage(nodes, storages: pd.DataFrame, accesses: pd.DataFrame, graph_id=None, *,
                   owned: pd.DataFrame | None = None, memory: pd.DataFrame | None = None,
                   hook: pd.DataFrame | None = None,
                   access_kinds: Sequence[str] | None = ("read", "write", "factory"),
                   dedupe: bool = True) -> CoverageResult:
    """Coverage of one captured graph's kernel nodes by a report's records.

    `nodes`: the graph's kernel nodes (see `pointer_frame`). `storages` / `accesses`: the
    report's frames (columns in docs/internals.md); the graph is `graph_id` (None: all
    accesses). `owned`: the watched models' storages (`data_ptr`, `nbytes`, `label` = owner
    path), live now. `memory`: other known memory ranges (`data_ptr`, `nbytes`, `label`),
    e.g. the CUDA caching allocator's segments. `hook`: ranges a Triton-launch hook saw.
    `access_kinds`: which recorded accesses count as attributing a storage (views, which
    read nothing, do not by default).
    """
    nodes = list(nodes)
    ptrs = pointer_frame(nodes)
    seen = _seen_ids(accesses, graph_id, access_kinds)
    st = storages
    in_graph = st["storage_id"].isin(seen)
    alive = st["alive"].astype(bool) if "alive" in st.columns else pd.Series(True, index=st.index)
    live_seen = st[in_graph & alive]
    freed_seen = st[in_graph & ~alive]
    other = st[~in_graph & alive]
    tiers = [("seen", live_seen), ("seen-freed", freed_seen), ("seen-other", other),
             ("owned", owned), ("allocator", memory)]
    classified = classify(ptrs, tiers, hook=hook, owned=owned)
    per, tot = kernel_coverage(classified, dedupe=dedupe, nodes=node_frame(nodes))
    notes = []
    if len(freed_seen):
        notes.append(f"{len(freed_seen)} storages recorded in this graph are freed now; "
                     "words in their old ranges count as attributed (address match only)")
    return CoverageResult(classified, per, tot, graph_id, notes)


# --------------------------------------------------------------------------------------
# names
# --------------------------------------------------------------------------------------

_TRITON_ARG = re.compile(r"^(in_out_ptr|in_ptr|out_ptr)\d+$")


def triton_arg_access(name: str) -> str | None:
    """Inductor's Triton argument naming -> access: in_ptrN read, out_ptrN write,
    in_out_ptrN read+write; anything else (xnumel, ws_ptr, ...) None."""
    m = _TRITON_ARG.match(str(name))
    if not m:
        return None
    return {"in_ptr": "read", "out_ptr": "write", "in_out_ptr": "read+write"}[m.group(1)]


def short_kernel_name(name: str, width: int = 60) -> str:
    """A readable kernel name: demangled names lose template arguments and parameters;
    mangled ones keep their longest identifier; the result is cut to `width`."""
    s = str(name)
    if s.startswith("_Z"):
        # Itanium mangling: identifiers are length-prefixed (`29vectorized_elementwise_kernel`)
        idents, i = [], 2
        for m in re.finditer(r"\d+", s):
            if m.start() < i:
                continue
            n = int(m.group())
            ident = s[m.end(): m.end() + n]
            if len(ident) == n and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", ident or "-"):
                idents.append(ident)
                i = m.end() + n
        idents = [x for x in idents if len(x) > 2]
        if idents:
            s = max(idents, key=len)
    else:
        depth, buf = 0, []
        for ch in s:
            if ch == "<":
                depth += 1
                if depth == 1:
                    buf.append("<…>")
            elif ch == ">":
                depth = max(depth - 1, 0)
            elif depth == 0:
                buf.append(ch)
        s = "".join(buf)
        s = re.sub(r"\(.*\)$", "", s)
        s = s.replace("void ", "").strip()
    return s if len(s) <= width else s[: width - 1] + "…"


def format_coverage(per_kernel: pd.DataFrame, total: pd.DataFrame | Mapping, *, indent: str = "  ",
                    max_rows: int = 40) -> list[str]:
    """Text lines for a results block: one per kernel with pointers, then the total."""
    tot = total.iloc[0].to_dict() if isinstance(total, pd.DataFrame) else dict(total)
    lines = []
    rows = per_kernel[per_kernel["pointers"] > 0] if len(per_kernel) else per_kernel
    for _, r in rows.head(max_rows).iterrows():
        extra = f"  unseen: {r['unseen_owners']}" if r["unseen_owners"] else ""
        lines.append(f"{indent}node {int(r['node']):>3} {short_kernel_name(r['kernel'], 48):<48} "
                     f"attributed {int(r['attributed'])}/{int(r['pointers'])} "
                     f"(+hook {int(r['attributed_with_hook'])}/{int(r['pointers'])}) "
                     f"owned {int(r['owned_attributed'])}/{int(r['owned'])}{extra}")
    if len(rows) > max_rows:
        lines.append(f"{indent}... {len(rows) - max_rows} more kernels")

    def pct(x):
        return "n/a" if x is None or (isinstance(x, float) and np.isnan(x)) else f"{100 * x:.1f}%"

    lines.append(
        f"{indent}total: {tot.get('kernels', 0)} kernel nodes, {tot.get('pointers', 0)} pointers "
        f"into known memory; attributed {tot.get('attributed', 0)} ({pct(tot.get('coverage'))}), "
        f"with hook {tot.get('attributed_with_hook', 0)} ({pct(tot.get('coverage_with_hook'))}); "
        f"model-owned {tot.get('owned_attributed', 0)}/{tot.get('owned', 0)} "
        f"({pct(tot.get('owned_coverage'))})")
    return lines
