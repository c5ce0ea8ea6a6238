"""Two plug-ins of the lineage graph that name process steps unsafe to repeat: writes of a
registered tensor from its own value (`NonIdempotent`, Note [non-idempotent steps]) and reads
of state carried over from an earlier load cycle (`CarriedOver`, Note [carried-over state]).
"""

from __future__ import annotations

from typing import Mapping

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from graphtrace._schema import op_info

__all__ = ["NonIdempotent", "CarriedOver", "MAX_SELF_UPDATES"]

# Note [non-idempotent steps]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# A process step that updates a registered parameter or buffer in place from its own value
# (`scale.mul_(2)`, `w.div_(s)`, `torch.mul(w, s, out=w)`) gives a different result each
# time it runs on the same loaded weights: a second sync without a reload first compounds
# it (ROCm ATOM #2028: a scale normalised in place each sync, 2^N after N syncs). Identity
# checks and a same-weights reload run once cannot see it. While a trace is open, outside
# capture regions, lineage notes every write whose new value reads the storage it writes --
# an in-place op other than the pure overwrites (`copy_`, `fill_`, `zero_`, `index_put_`,
# the random fills, ...: `_SELF_FREE`) or an `out=` buffer that is also an input -- when
# that storage is a registered parameter or buffer of a watched model (the walk of their
# registered tensors that lineage keeps: taken once, again after each capture and when an
# unknown `nn.Parameter` is written), as one record per (storage, op, call site) with the
# number of times it ran (provenance gives the site: the user code's file and line). An
# optimizer's step is training, not a process step: lineage is told by torch.optim's global
# step hooks and notes nothing inside one. A forward run outside a capture region that
# updates a registered buffer in place (a step counter) is noted too: it is just as
# non-idempotent. The records are findings (`Trace.findings()`, `report.findings`, kind
# `non-idempotent step`), not a verdict: the graph's edges are judged as before.

# Note [carried-over state]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~
# State a process step keeps between weight updates outside the parameters and buffers (a
# dict of permutation indices computed from the weights' shapes: SGLang #26194) is read
# again by the next update's process step. If the memory under it changed with no torch op
# in between -- the memory saver released and re-mapped the weights region while the engine
# was paused -- the step combines the new weights with garbage, writes the result into the
# registered weights, and every later check passes (the weights were rewritten after their
# sources; identity holds). Two rules were possible: (b) fingerprint such state when it is
# written and compare at its next read (it sees the corruption itself, but reads values on
# the dispatch path: a device sync per small storage, and a baseline per temporary, since
# which storages become carried state is known only later), or (a), taken here: name the
# *pattern*, from clocks alone, whether or not the memory was released this time. Cost: a
# dict lookup per read and per written storage once a model is watched; the check itself
# runs only after some registered tensor was loaded twice, and then only on reads whose
# clock lies between the first load and the latest reload.
#
# Load cycles: a write into a registered parameter or buffer whose sources include no
# registered tensor (its values come from outside the model: a checkpoint) is a *load* of
# it; a load after the storage was read (by any op lineage records) begins a new load
# cycle of it, while loads with no read between them (the shards of a fused weight) are
# one. The finding: an op outside capture regions and optimizer steps reads a storage C
# that (1) is not registered and not derived from a registered tensor (freshness judges
# those: Note [freshness] in graphtrace/verdict.py), (2) lineage saw written after the
# first load and (3) before the start of the current load cycle of a registered tensor R
# that the same op's other inputs were made from (R in its sources), R being in its second
# cycle or later. One record per (C, op, call site), with the count, a weak handle to C
# and R: a `carried-over state` finding (`Trace.findings()`, `report.findings`) naming C's
# owner paths (any kind: `layers.0.quant_method._cache_permute_indices[...]`, a
# `torch.Size` key read as its tuple), the op, its line and R's path. Not a verdict: the
# graph reads the weights, which are where their owners point.
#
# What it cannot tell: whether the memory was actually released (a cache kept on the host,
# SGLang PR #39468's fix, is reported all the same: the pattern, not the corruption); state
# made before the first load, or by a factory op alone (`torch.arange` with nothing
# after it: no lineage node); a cache shared by several layers under layerwise loading
# (one layer's cycle begins after another's cache was rebuilt in the same update: a
# finding for a cache that is in fact fresh); an eager forward outside capture regions
# after a reload that reads shape-derived state made before it (a lazily built table) is
# reported too, as the same risk.

MAX_SELF_UPDATES = 4096  # distinct (storage, op, line) records kept


class NonIdempotent:
    """Note [non-idempotent steps]: one record per registered storage, op and call site that
    updated the storage from its own value, with the times it ran."""

    def __init__(self):
        # (address, op, site) -> [StorageWeakRef, times seen]
        self.self_updates: dict[tuple, list] = {}
        self._missed: set = set()  # Parameters not found by a fresh walk of the models

    def written(self, graph, func, op, written: list, reads: dict) -> None:
        """Note each storage `func` wrote from its own value (hook: Note [lineage plug-ins])."""
        for t, is_out in written:
            try:
                s = t.untyped_storage()
            except Exception:
                continue
            if (op.self_reads and not is_out) or s._cdata in reads:
                self._self_update(graph, func, t, s)

    def _self_update(self, graph, func, t: torch.Tensor,
                     s: torch.UntypedStorage) -> None:
        """An op wrote the storage `s` (through `t`) from its own value: keep a record when
        `s` is a registered parameter or buffer of a watched model."""
        a = s._cdata
        registered = graph.registered_tensors(False)
        entries = registered.get(a)
        if entries is None or entries[0][3].expired():
            if type(t) is not torch.nn.Parameter or a in self._missed:
                return  # `.data` of a parameter the last walk saw is found above
            registered = graph.registered_tensors(True)
            entries = registered.get(a)
            if entries is None:
                self._missed.add(a)
                return
        name = op_info(func).name
        site = graph.site() if graph.site is not None else None
        key = (a, name, site(func) if site is not None else "")
        record = self.self_updates.get(key)
        if record is not None and not record[0].expired():
            record[1] += 1
        elif len(self.self_updates) < MAX_SELF_UPDATES:
            self.self_updates[key] = [entries[0][3], 1]

    def findings(self, graph, models: Mapping[str, torch.nn.Module]) -> list[dict]:
        """Its records as `Lineage.findings` rows (Note [non-idempotent steps])."""
        rows = []
        registered = None
        for (a, op, site), (ref, n) in self.self_updates.items():
            if ref.expired():
                continue
            if registered is None:
                registered = graph.registered_tensors(True)
            entries = registered.get(a, ())
            paths = sorted((f"{m}:" if m else "") + p for m, p, _k, _r in entries)
            if not paths:
                continue
            rows.append({"kind": "non-idempotent step", "holder": "; ".join(paths), "op": op,
                         "source": "", "source_kind": entries[0][2], "site": site, "n": n})
        return rows


class CarriedOver:
    """Note [carried-over state]: load cycles of the registered tensors, and one record per
    unregistered storage, op and call site that read state carried over from an earlier
    cycle into a process step."""

    def __init__(self):
        # registered address -> [clock its load cycle began, load cycles, read since?]; the
        # first load's clock; the latest start of a second or later load cycle (0: none, the
        # check is off); (address, op, site) -> [ref, n, source address]
        self.loads: dict[int, list] = {}
        self.first_load = 0
        self.reload_clock = 0
        self.carried: dict[tuple, list] = {}

    def read(self, graph, func, reads: dict, sources: dict) -> None:
        """`func` read `reads` (whose sources, with theirs, are `sources`): a read ends a
        load cycle; and is one of them carried-over state?"""
        loads = self.loads
        if loads:
            for a in reads:
                entry = loads.get(a)
                if entry is not None:
                    entry[2] = True
            if self.reload_clock and graph.optimizer_steps == 0:
                self._carried_over(graph, func, reads, sources)

    def wrote(self, graph, s: torch.UntypedStorage, a: int, sources: dict) -> None:
        """The graph wrote the storage `s` at address `a` from `sources` (for an op): a load
        when `s` is a registered parameter or buffer and no source is one (its values come
        from outside the model). A load after a read of `s` begins a new load cycle of `s`."""
        if graph.models is None:
            return
        registered = graph.registered_tensors(False)
        entries = registered.get(a)
        if entries is None or entries[0][3].expired():
            return
        for b in sources:
            if b in registered:
                return  # made from the model's own tensors: a process step, not a load
        clock = graph.clock
        entry = self.loads.get(a)
        if entry is None:
            self.loads[a] = [clock, 1, False]
            if not self.first_load:
                self.first_load = clock
        elif entry[2]:  # read since its last load: a new cycle (shards of one load are not)
            entry[0], entry[1], entry[2] = clock, entry[1] + 1, False
            if clock > self.reload_clock:
                self.reload_clock = clock

    def _carried_over(self, graph, func, reads: dict, sources: dict) -> None:
        """An op read `reads` (with `sources`, theirs): is one of them unregistered state,
        made from no registered tensor during an earlier load cycle, read together with a
        registered tensor whose load cycle began after it was written?"""
        nodes = graph.nodes
        lo, hi = self.first_load, self.reload_clock
        registered = None
        for a in reads:
            node = nodes.get(a)
            if node is None or not lo < node[1] < hi:
                continue  # not written by lineage after the first load and before a reload
            if registered is None:
                registered = graph.registered_tensors(False)
            if a in registered or (node[2] and not registered.keys().isdisjoint(node[2])):
                continue  # registered, or derived from the weights (freshness judges those)
            c = node[1]
            for b in sources:
                entry = self.loads.get(b)
                if entry is not None and entry[1] > 1 and entry[0] > c and b != a:
                    self._note_carried(graph, func, a, reads[a], b)
                    break

    def _note_carried(self, graph, func, a: int, storage: torch.UntypedStorage,
                      source: int) -> None:
        site = graph.site() if graph.site is not None else None
        key = (a, op_info(func).name, site(func) if site is not None else "")
        record = self.carried.get(key)
        if record is not None and not record[0].expired():
            record[1] += 1
        elif len(self.carried) < MAX_SELF_UPDATES:
            self.carried[key] = [StorageWeakRef(storage), 1, source]

    def findings(self, graph, models: Mapping[str, torch.nn.Module]) -> list[dict]:
        """Its records of live storages as `Lineage.findings` rows (Note [carried-over state])."""
        live = {key: r for key, r in self.carried.items() if not r[0].expired()}
        if not live:
            return []
        holders = graph.holders({key[0] for key in live}, models)
        registered = graph.registered_tensors(True)
        rows = []
        for (a, op, site), (_ref, n, b) in sorted(live.items(), key=lambda kv: kv[0][1:]):
            entries = registered.get(b, ())
            rows.append({"kind": "carried-over state",
                         "holder": "; ".join(sorted(holders.get(a, []))) or "(no owner path)",
                         "op": op,
                         "source": "; ".join(sorted((f"{m}:" if m else "") + p
                                                    for m, p, _k, _r in entries)),
                         "source_kind": entries[0][2] if entries else "",
                         "site": site, "n": n})
        return rows

    def forget(self, a: int) -> None:
        """The storage at address `a` died (the graph's sweep)."""
        self.loads.pop(a, None)

    def release(self) -> None:
        self.loads, self.carried = {}, {}
