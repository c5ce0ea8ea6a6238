"""Columnar capture records to pandas, vectorised (names are resolved here, not per op)."""

from __future__ import annotations

import numpy as np
import pandas as pd

from graphtrace.encoding import ACCESS_FIELDS, unpack_rows
from graphtrace.vocab import ACCESS_KINDS, COLUMNS

__all__ = ["view_table", "raw_accesses", "accesses_frame"]

ACCESS_COLUMNS = COLUMNS["accesses"]


def _categorical(codes: np.ndarray, values: list[str]) -> pd.Categorical:
    """values[codes] as a categorical of the used values, sorted, without materialising one
    string per row: one count and one take over the codes."""
    if len(values) == 0:
        return pd.Categorical([], categories=pd.Index([], dtype=object))
    used = np.flatnonzero(np.bincount(codes, minlength=len(values)))
    # hashed, then only the distinct values sorted (a storage's device repeats 50k times)
    inverse, uniq = pd.factorize(np.asarray(values, dtype=object)[used], sort=True)
    # codes as small as pandas keeps them (equal values share one category)
    to_cat = np.zeros(len(values), dtype=np.min_scalar_type(-len(uniq) - 1))
    to_cat[used] = inverse
    return pd.Categorical.from_codes(to_cat[codes], categories=pd.Index(uniq, dtype=object))


def view_table(views: list) -> dict[str, np.ndarray | list]:
    """Per interned view: dtype name, shape/stride text, offset, itemsize, torch dtype."""
    dtypes = [v[0] for v in views]
    return {
        "torch_dtype": dtypes,
        "dtype": [str(d).removeprefix("torch.") for d in dtypes],
        "shape": [str(tuple(v[1])) for v in views],
        "stride": [str(tuple(v[2])) for v in views],
        "offset": np.array([v[3] for v in views], dtype=np.int64),
        "itemsize": np.array([d.itemsize for d in dtypes], dtype=np.int64),
    }


# raw column dtypes: ids of names and views fit int32, accesses int8 (less memory to fill)
_RAW_DTYPES = {"graph_id": np.int64, "seq": np.int64, "op": np.int32, "module": np.int32,
               "arg": np.int32, "access": np.int8, "storage_id": np.int64, "view": np.int32}


def raw_accesses(recorder) -> dict[str, np.ndarray]:
    """All of a Recorder's captures' records as integer columns (graph_id, seq, op, module,
    arg, access, storage_id, view), each filled in place capture by capture: no per-capture
    parts to concatenate."""
    captures = recorder.captures
    sizes = [len(cap.accesses) // ACCESS_FIELDS for cap in captures]
    raw = {n: np.empty(sum(sizes), dtype=d) for n, d in _RAW_DTYPES.items()}
    end = 0
    for cap, size in zip(captures, sizes):
        if not size:
            continue
        start, end = end, end + size
        part = {n: a[start:end] for n, a in raw.items()}
        unpack_rows(cap.accesses, part)
        seq = part["seq"]
        part["graph_id"][:] = cap.graph_id
        part["op"][:] = np.frombuffer(cap.ops, dtype=np.int32)[seq]
        part["module"][:] = np.frombuffer(cap.op_modules, dtype=np.int32)[seq]
    return raw


def accesses_frame(recorder, raw: dict | None = None, views: dict | None = None) -> pd.DataFrame:
    """A Recorder's every access as a DataFrame (`raw`/`views`: already made, to reuse)."""
    raw = raw_accesses(recorder) if raw is None else raw
    views = view_table(recorder.views.items) if views is None else views
    rec = recorder
    names = list(rec.names.items)
    labels = [c.label for c in rec.captures]
    table = rec.storages
    sid = raw["storage_id"]
    v = raw["view"]
    base = np.frombuffer(table.data_ptrs, dtype=np.int64) if len(table.data_ptrs) else np.empty(0, np.int64)
    module_codes = np.where(raw["module"] < 0, len(names), raw["module"])
    empty = len(sid) == 0
    view_bytes = views["offset"] * views["itemsize"]  # per view, so one take per row
    return pd.DataFrame({  # fresh arrays, owned by the frame: no copy
        "graph_id": raw["graph_id"],
        "graph": _categorical(raw["graph_id"], labels),
        "seq": raw["seq"],
        "op": _categorical(raw["op"], names),
        "module": _categorical(module_codes, names + [""]),
        "arg": _categorical(raw["arg"], names),
        "access": _categorical(raw["access"], list(ACCESS_KINDS)),
        "storage_id": sid,
        "data_ptr": sid if empty else base[sid] + view_bytes[v],
        "dtype": _categorical(v, views["dtype"]),
        "shape": _categorical(v, views["shape"]),
        "stride": _categorical(v, views["stride"]),
        "offset": sid if empty else views["offset"][v],
        "device": _categorical(sid, table.devices),
    }, columns=ACCESS_COLUMNS, copy=False)
