"""Packed or derived copies a weight update forgets to rebuild.

Note [derived copies]
~~~~~~~~~~~~~~~~~~~~~
Some kernels read a copy made from a registered weight instead of the weight itself: vLLM's
CPU GEMMs read a oneDNN-packed copy behind a pointer-valued ``handler_tensor`` (the
``packed copy`` blind spot of graphtrace.vllm.blind), a quantized module reads its packed
params, a layer keeps ``weight.t().contiguous()``. A reload that refreshes the weight in
place and does not rebuild the copy leaves every reader -- eager and graph alike -- on the
old values, while the copy's storage still `holds`: no edge moves, so no verdict can say it.

Where graphtrace knows the pairing (`Trace.watch_copy(copy, source)`; the vLLM adapter
registers each ``packed copy`` it finds), it keeps a fingerprint of the source -- its
storage (a weak handle), its version counter and a value hash of at most `SAMPLE` evenly
strided elements (torch.hash_tensor plus a float64 sum; a change confined to elements off the
sample is missed) -- and a weak handle of the copy's storage (a ScriptObject's proxy storage,
Note [opaque handles]), taken when the pair is registered and again whenever the copy is
seen rebuilt (a new storage or object: at the end of each capture and after each diff). The
diff resolves both paths again: a copy whose storage is the one fingerprinted while its
source's storage, version or values changed is a ``packed copy not rebuilt`` blind spot
naming both paths (its holder is the copy's path, so it matches the copy's edges). A
rebuilt copy or an unchanged source says nothing, and the rebuilt copy becomes the
baseline: an engine that rebuilds on its first reload and forgets on its second is found
at the second.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from graphtrace._compat import disable_current_modes, version_counter
from graphtrace.blindspots import BlindSpot
from graphtrace.opaque import storage_of
from graphtrace.owners import resolve_path

__all__ = ["SAMPLE", "CopyPair", "DerivedCopies", "fingerprint"]

SAMPLE = 1 << 16  # elements hashed per source weight at most
# elements per reduction: under ATen's parallel grain (32768), so that each runs on the calling
# thread. One reduction over the whole sample runs in parallel, and on a CPU shared with an
# engine's threads an OpenMP region waits for every thread to get a core (20-200 ms measured
# per reduction at load average 12 on 2 cores, against 0.03 ms on one thread)
_CHUNK = 1 << 14


def fingerprint(tensor: torch.Tensor) -> tuple:
    """(version counter, value hash) of `tensor` (Note [derived copies]). A meta tensor has no
    values (vLLM's layerwise reload leaves layers on meta tensors when a weight-transfer chunk
    fails): its hash is a marker no real tensor's equals."""
    if tensor.is_meta:
        return version_counter(tensor), ("meta", tuple(tensor.shape))
    with disable_current_modes(), torch.no_grad():
        flat = tensor.detach().reshape(-1)
        if flat.numel() > SAMPLE:
            flat = flat[:: -(-flat.numel() // SAMPLE)]
        if flat.is_complex():
            flat = torch.view_as_real(flat).reshape(-1)
        if flat.numel():
            chunks = flat.split(_CHUNK)
            hashes = torch.stack([torch.hash_tensor(c) for c in chunks]).view(torch.int64)
            sums = torch.stack([c.to(torch.float64).sum() for c in chunks])
            values = (tuple(hashes.tolist()), float(sums.sum()))
        else:
            values = ((), 0.0)
    return version_counter(tensor), values


@dataclass
class CopyPair:
    """One known pairing: `copy` (path of the copy or its handle) made from `source`
    (path of the registered weight), both on the watched model `model`."""

    model: str
    copy: str
    source: str
    source_ref: StorageWeakRef | None = None
    source_print: tuple | None = None
    copy_ref: StorageWeakRef | None = None


def _ref(obj) -> StorageWeakRef | None:
    return StorageWeakRef(storage_of(obj)) if obj is not None else None


def _same(ref: StorageWeakRef | None, obj) -> bool:
    """Is `obj`'s storage the one `ref` was taken of (alive, same StorageImpl)?"""
    return (ref is not None and obj is not None and not ref.expired()
            and ref.cdata == storage_of(obj)._cdata)


class DerivedCopies:
    """The pairings a trace knows, their fingerprints, and the check diff and guard run."""

    def __init__(self, fail: Callable[[str, BaseException], None]):
        self.fail = fail
        self.pairs: dict[tuple[str, str], CopyPair] = {}

    def add(self, model: str, copy: str, source: str,
            models: Mapping[str, torch.nn.Module]) -> None:
        pair = self.pairs.setdefault((model, copy), CopyPair(model, copy, source))
        pair.source = source
        if model in models:
            self._fingerprint(pair, models[model])

    def refresh(self, models: Mapping[str, torch.nn.Module]) -> None:
        """Fingerprint again each pair whose copy was rebuilt (or never fingerprinted) since
        its last fingerprint (the end of each capture, and the diff)."""
        for pair in self.pairs.values():
            if pair.model in models:
                try:
                    if pair.source_print is None or not _same(
                            pair.copy_ref, resolve_path(models[pair.model], pair.copy)):
                        self._fingerprint(pair, models[pair.model])
                except Exception as exc:  # fail open: the report says so
                    self.fail("derived copy fingerprint", exc)

    @staticmethod
    def _fingerprint(pair: CopyPair, model: torch.nn.Module) -> None:
        source = resolve_path(model, pair.source)
        copy = resolve_path(model, pair.copy)
        if not isinstance(source, torch.Tensor) or copy is None:
            pair.source_ref = pair.source_print = pair.copy_ref = None
            return
        pair.source_ref, pair.source_print = _ref(source), fingerprint(source)
        pair.copy_ref = _ref(copy)

    def check(self, models: Mapping[str, torch.nn.Module]) -> list[BlindSpot]:
        """A ``packed copy not rebuilt`` record per pair whose copy still holds the
        fingerprinted storage while its source changed."""
        found = []
        for pair in self.pairs.values():
            model = models.get(pair.model)
            if model is None or pair.source_print is None:
                continue
            try:
                source = resolve_path(model, pair.source)
                copy = resolve_path(model, pair.copy)
                if not isinstance(source, torch.Tensor) or not _same(pair.copy_ref, copy):
                    continue  # the copy was rebuilt (or is gone: its edge says so)
                moved = not _same(pair.source_ref, source)
                version, values = fingerprint(source)
                if not moved and values == pair.source_print[1] \
                        and version == pair.source_print[0]:
                    continue
                if values != pair.source_print[1]:
                    what = "its values changed (manifest: readers compute with old weights)"
                else:
                    what = ("it was replaced by a tensor with the same values" if moved else
                            "it was written with the same values")
                    what += " (latent: the next update with new values will be missed)"
                prefix = f"{pair.model}:" if pair.model else ""
                found.append(BlindSpot(
                    "packed copy not rebuilt",
                    f"packed copy not rebuilt: {prefix}{pair.copy} is a copy made from "
                    f"{prefix}{pair.source}; since capture {what}, but the copy is the same "
                    "one, so every reader of the copy (graphs and eager forwards) reads what "
                    "it was built from before. Rebuild the copy after the update (re-run "
                    "process_weights_after_loading for the layer) or copy into it in place",
                    holder=pair.copy, model=pair.model))
            except Exception as exc:  # fail open: a pair that cannot be checked is an error
                self.fail("derived copy check", exc)
        self.refresh(models)  # rebuilt copies: the next check compares against them
        return found
