"""Emulated graphs: `EmulatedGraph`, a replayable record of a capture region, and its Python
keeper (`_PyKeeper`; the native one is graphtrace/csrc/recorder.cpp's). Note [Emulated graphs
keep storages]."""

from __future__ import annotations

import sys

import torch

from graphtrace._compat import SCRATCH, disable_current_modes, storage_use_count
from graphtrace._schema import map_tensors
from graphtrace.encoding import REPLAY_FRESH
from graphtrace.recorder import Capture
from graphtrace.scalars import floats_in

__all__ = ["EmulatedGraph"]


class _PyKeeper:
    """The kept ops and aliases of an emulated graph, in Python: the reference for the native
    Keeper (Note [native keep] in graphtrace/csrc/recorder.cpp), used without the native
    recorder. Note [Emulated graphs keep storages]."""

    __slots__ = ("ops", "floats", "_aliases", "_seen", "_made", "_scratch")

    def __init__(self):
        self.ops: list = []       # (func, args, kwargs, out, replay flags) per kept op
        self.floats: dict = {}    # each float the kept ops take -> the first op taking it
        self._aliases: dict = {}  # view key -> alias, so one view read twice is one alias
        self._seen: set = set()   # storages pinned so far
        self._made: set = set()   # storages first seen as an op's output: made in the region
        # (nbytes, device, [(alias, offset, shape, stride), ...]) per scratch storage
        self._scratch: list = []

    def pin(self, t: torch.Tensor, making: bool) -> torch.Tensor:
        """A plain alias of the storage, offset, size and stride a plain tensor or parameter
        `t` has now (`t` itself where an alias cannot carry what it is)."""
        if (t.layout != torch.strided or t.is_quantized or t.is_conj() or t.is_neg()
                or t.is_nested):
            return t  # what an alias cannot carry (a quantizer, a lazy flag, nested parts)
        try:
            storage = t.untyped_storage()
        except Exception:  # no storage (a functional wrapper): nothing to pin
            return t
        cdata = storage._cdata
        key = (cdata, t.dtype, t.shape, t.stride(), t.storage_offset())
        alias = self._aliases.get(key)
        if alias is None:
            if cdata not in self._seen:
                self._seen.add(cdata)
                if making:
                    self._made.add(cdata)
            if t.is_inference():  # its detach() would be one too: not writable outside
                alias = torch.empty(0, dtype=t.dtype, device=t.device).set_(
                    storage, t.storage_offset(), t.shape, t.stride())
            else:  # a new TensorImpl on the same storage and view: blind to `t.data = ...`
                alias = t.detach()
            self._aliases[key] = alias
        return alias

    def seal(self, release: bool) -> None:
        made, aliases = self._made, self._aliases
        self._made, self._seen, self._aliases = set(), set(), {}
        if not release or not made:
            return
        groups: dict[int, list] = {}  # storage made in the region -> its aliases
        for key, alias in aliases.items():
            if key[0] in made:
                groups.setdefault(key[0], []).append(alias)
        with torch.no_grad(), disable_current_modes():
            for cdata, pinned in groups.items():
                storage = pinned[0].untyped_storage()
                # our aliases and `storage` hold it; anything more is a holder outside the
                # graph, as is a holder of `storage` itself (the storage's one Python object:
                # `storage`, getrefcount's argument and the storage's own reference to it)
                if storage_use_count(cdata) > len(pinned) + 1 or sys.getrefcount(storage) > 3:
                    continue
                lent = [(a, a.storage_offset(), a.shape, a.stride()) for a in pinned]
                self._scratch.append((storage.nbytes(), storage.device, lent))
                for alias in pinned:
                    alias.set_()

    def lend(self) -> None:
        for nbytes, device, lent in self._scratch:
            fresh = torch.UntypedStorage(nbytes, device=device)
            for alias, offset, shape, stride in lent:
                alias.set_(fresh, offset, shape, stride)

    def reclaim(self) -> None:
        for _, _, lent in self._scratch:
            for alias, *_ in lent:
                alias.set_()


def _keep_slow(keeper, func, args, kwargs, out, replay_flags) -> None:
    """Keep one recorded op by the tensor walker (graphtrace._schema.map_tensors), pinning
    through `keeper`: the Python keeper's path, and the native one's for arguments its own
    walk does not cover (Note [native keep])."""
    if not replay_flags:  # 0: a pure view, which a graph bakes in and never re-runs
        return
    if torch.is_inference_mode_enabled():  # aliases must be normal tensors: one exit per op
        with torch.inference_mode(False):
            _keep_walk(keeper, func, args, kwargs, out, replay_flags)
    else:
        _keep_walk(keeper, func, args, kwargs, out, replay_flags)


def _keep_walk(keeper, func, args, kwargs, out, replay_flags) -> None:
    pin = keeper.pin

    def pin_input(t: torch.Tensor) -> torch.Tensor:
        return pin(t, False) if type(t) in _PLAIN else t  # a subclass's parts: kept whole

    def pin_output(t: torch.Tensor) -> torch.Tensor:
        return pin(t, True) if type(t) in _PLAIN else t

    found: list = []
    for a in args:
        floats_in(a, found)
    if kwargs:
        for a in kwargs.values():
            floats_in(a, found)
    floats = keeper.floats
    for v in found:
        if v == v:  # NaN matches nothing
            floats.setdefault(v, func)
    args = tuple([map_tensors(pin_input, a) for a in args])
    kwargs = {k: map_tensors(pin_input, v) for k, v in kwargs.items()} if kwargs else {}
    keeper.ops.append((func, args, kwargs, map_tensors(pin_output, out), replay_flags))


_PLAIN = (torch.Tensor, torch.nn.Parameter)


class EmulatedGraph:
    """A replayable record of a capture region with CUDA graph address semantics.

    See Note [Emulated graphs keep storages]. Like a real graph's capture artifacts, it
    keeps the storages it read from outside and its outputs alive (drop the graph to free
    them), not its intermediates. `native` (graphtrace.native's module, as a trace's
    recorder has it) keeps ops in C++.
    """

    __slots__ = ("label", "capture", "_keeper", "_ops", "__weakref__")

    def __init__(self, label: str, native=None):
        self.label = label
        self.capture: Capture | None = None
        keeper = getattr(native, "Keeper", None) if native is not None else None
        self._keeper = keeper(_keep_slow, SCRATCH) if keeper is not None else _PyKeeper()
        self._ops: list = self._keeper.ops

    @property
    def native_keeper(self):
        """The native Keeper a capture's native Writer keeps ops into, else None."""
        return None if isinstance(self._keeper, _PyKeeper) else self._keeper

    def keep(self, func, args, kwargs, out, replay_flags: int) -> None:
        """Keep one recorded op for replay (`replay_flags` as the writer returned them)."""
        _keep_slow(self._keeper, func, args, kwargs, out, replay_flags)

    def seal(self) -> None:
        """At the end of the capture: let go of its intermediates (Note [Emulated graphs
        keep storages])."""
        self._keeper.seal(SCRATCH)

    def replay(self) -> None:
        """Run the kept ops again. One replay at a time per graph (its scratch aliases are
        pointed at fresh storages for the replay), as a CUDA graph's pool is one."""
        with torch.no_grad(), disable_current_modes():
            keeper = self._keeper
            keeper.lend()
            try:
                for func, args, kwargs, out, replay_flags in self._ops:
                    result = func(*args, **kwargs)
                    if replay_flags & REPLAY_FRESH:
                        _copy_into(out, result)
            finally:
                keeper.reclaim()

    def baked_floats(self) -> dict:
        """Each float the kept ops take as an argument (graphtrace.scalars.floats_in) -> the
        first op taking it: what the graph baked in (Note [baked scalars])."""
        return dict(self._keeper.floats)

    def kept_ops(self) -> list:
        """The ops kept for replay: (func, args, kwargs, out, replay flags) each."""
        return list(self._ops)

    def __len__(self) -> int:
        return len(self._ops)

    def __repr__(self) -> str:
        return f"EmulatedGraph({self.label!r}, ops={len(self._ops)})"


def _copy_into(dst, src) -> None:
    if isinstance(dst, torch.Tensor):
        if dst is not src and isinstance(src, torch.Tensor):
            if dst.untyped_storage()._cdata != src.untyped_storage()._cdata:
                dst.copy_(src)
    elif isinstance(dst, (tuple, list)):
        for d, s in zip(dst, src):
            _copy_into(d, s)


# Note [Emulated graphs keep storages]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# A CUDA graph bakes in addresses: what it reads is fixed at capture, whatever Python does
# to the tensor objects afterwards (`param.data = ...`, `model.to()/.half()/.float()` rebind
# a tensor's storage in place of the object). So an emulated graph keeps no tensor object
# of the capture: `keep` replaces each plain tensor argument and output by an alias made at
# capture time, pinned to the storage, offset, size and stride the op saw (requires_grad
# off): `t.detach()`, a new TensorImpl on t's storage and view that `t.data = ...` does not
# touch (it shares t's version counter, so a replay's writes count as writes). Aliases are
# made outside inference mode: a capture under `torch.inference_mode()` replays anywhere. An
# inference tensor's detach() is an inference tensor again (not writable in place outside
# inference mode), so its alias is `empty(0).set_(storage, offset, size, stride)`, a normal
# tensor. What an alias cannot carry is kept as is: quantized tensors (their quantizer),
# conj/neg views, nested tensors and subclasses (their own parts). keep() runs per recorded
# op, so it walks the shapes ops take (tensors, scalars, plain tuples and lists) itself and
# leaves anything else to pytree.
# A graph keeps what a CUDA graph's pool would, not every intermediate: at the region's end
# `seal` looks at each storage first pinned as an op's output (made in the region). When
# nothing but the graph's own aliases holds it (the storage's use count), it is scratch: its
# aliases are emptied in place (size 0 on a 0-byte storage; their storage offset, size and
# stride kept beside them) and the storage is freed. Each replay lends the scratch aliases
# fresh storages at their views and empties them again after it, as a graph's pool lends its
# intermediates memory for the replay; the kept ops themselves never change, and one graph
# replays one at a time. A storage made in the region that something else holds (the
# region's outputs, a cache the model kept) stays pinned, and replay copies fresh results
# into it, as before. The alias map goes at seal. Without storage use counts (a torch that
# lacks `_storage_Use_Count`: graphtrace._compat.SCRATCH) nothing is released.
# The keeping itself is a keeper's: `_PyKeeper` above in Python, and with the native
# recorder its Keeper (Note [native keep] in graphtrace/csrc/recorder.cpp), which the
# capture's native Writer keeps each op into right after recording it.
