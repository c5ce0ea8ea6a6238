"""Opaque handles (`torch.ScriptObject`: packed quantized weights, fbgemm/oneDNN packed params)
as storages: one proxy storage per underlying object, so the recorder, the owner walk and the
diff treat an opaque read like any storage read. See Note [opaque handles].
"""

from __future__ import annotations

import threading
import weakref

import torch

from graphtrace._compat import script_type_name

__all__ = ["stand_in", "is_opaque", "proxy_storage", "storage_of", "type_name"]

# Note [opaque handles]
# ~~~~~~~~~~~~~~~~~~~~~
# An op that takes a ScriptObject (`quantized::linear_dynamic(X, W_prepack)`) reads tensors
# packed inside a C++ object graphtrace cannot look into. What it can see is the object's
# identity: Python hands a fresh ScriptObject wrapper to every dispatch, and `hash()` of any
# wrapper is the address of the one underlying object. Each underlying object gets a proxy:
# a 0-byte UntypedStorage, registered in the storage table like any storage (device shown as
# `opaque` in reports). The proxy lives while some wrapper graphtrace has seen of that object
# lives (the module attribute the owner walk found, the op argument an emulated graph keeps,
# the capture's own arguments until its owners are matched), never longer: the recorder does
# not keep the object alive. A re-quantization binds a new object (a new proxy): the graph's
# edge is then stale (the old object is kept by the graph) or dangling. A value change made
# inside the same object is not seen (impact unknown), and the report's blind spots say so.
# Limit: an object held only by C++ (no Python wrapper alive) loses its proxy meanwhile.

_lock = threading.Lock()
_proxies: dict[int, list] = {}  # hash (underlying address) -> [proxy storage, {id: weakref}]


def is_opaque(x: object) -> bool:
    return isinstance(x, torch.ScriptObject)


def type_name(obj: torch.ScriptObject) -> str:
    """`__torch__.torch.classes.quantized.LinearPackedParamsBase` -> `quantized.LinearPackedParamsBase`."""
    try:
        name = script_type_name(obj)
    except Exception:
        return type(obj).__name__
    return name.removeprefix("__torch__.torch.classes.")


def proxy_storage(obj: torch.ScriptObject) -> torch.UntypedStorage:
    """The proxy storage of the object `obj` wraps (Note [opaque handles])."""
    key = hash(obj)
    with _lock:
        entry = _proxies.get(key)
        if entry is None:
            entry = _proxies[key] = [torch.UntypedStorage(0), {}]
        refs = entry[1]
        if id(obj) not in refs:
            refs[id(obj)] = weakref.ref(obj, _forget(key, id(obj)))
        return entry[0]


def _forget(key: int, ident: int):
    def dead(_ref) -> None:
        with _lock:
            entry = _proxies.get(key)
            if entry is not None:
                entry[1].pop(ident, None)
                if not entry[1]:
                    del _proxies[key]
    return dead


def stand_in(tensor: torch.Tensor) -> torch.Tensor:
    """A 0-element tensor on the proxy storage of `tensor`, a tensor without a storage (an
    mkldnn/MKL-packed weight Inductor's freezing compiled in): what a writer records for it,
    the same storage for as long as `tensor` lives (Note [opaque handles]). Make it with
    dispatch modes off (`set_` is an op)."""
    return torch.empty(0, dtype=torch.uint8).set_(proxy_storage(tensor))


def storage_of(x: object) -> torch.UntypedStorage:
    """A tensor's untyped storage, or an opaque handle's proxy storage."""
    if isinstance(x, torch.ScriptObject):
        return proxy_storage(x)
    return x.untyped_storage()
