"""A planted derived tensor in SGLang's real linear method (tests only), loaded in the
scheduler process as an SGLang plugin (entry point ``graphtrace_test_plant``, made by
tests/sglang/conftest.py) when ``GRAPHTRACE_TEST_PLANT`` names a mode file.

SGLang's ``UnquantizedLinearMethod`` gets what many quantization methods have: a tensor
derived from the weight in ``process_weights_after_loading`` (here its transpose, kept on
the layer as ``weight_t``) that ``apply`` computes with instead of the weight. What the
post-load step does to it at each later update is read from the mode file:

- ``refresh``: copied in place from the new weight into the tensor made at the first load
  (correct: the storage a captured graph reads is updated, and the layer holds it again);
- ``rebind``: computed anew and rebound (the bug class: the captured graph keeps the old one);
- ``keep``: not recomputed (the derived value is stale, though nothing moved).

``<mode>@<rank>`` applies ``mode`` on that tensor-parallel rank only, ``refresh`` on the
others (tests/sglang/test_tensor_parallel.py: a stale holder on one rank).

One more stand-in, for the CPU host only: SGLang 0.5.23's ``release_memory_occupation`` ends
with ``torch.get_device_module().synchronize()``, which on a CUDA build of torch is
``torch.cuda.synchronize`` and raises without an NVIDIA driver (the scheduler dies). Where
CUDA is not available that one call is made a no-op (there is nothing to synchronize on a
CPU), so that SGLang's own release/resume path runs here.
"""

from __future__ import annotations

import os
import weakref

ENV = "GRAPHTRACE_TEST_PLANT"
_FIRST: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # layer -> its first weight_t


def _mode() -> str:
    path = os.environ.get(ENV)
    try:
        mode = open(path).read().strip() if path else "refresh"
    except OSError:
        return "refresh"
    mode, _, rank = mode.partition("@")
    if rank:
        from graphtrace.sglang.session import tp_rank

        return mode if tp_rank() == int(rank) else "refresh"
    return mode


def register() -> None:
    if not os.environ.get(ENV):
        return
    import torch
    import torch.nn.functional as F

    if not torch.cuda.is_available():
        torch.cuda.synchronize = lambda device=None: None
    from sglang.srt.layers.quantization.unquant import UnquantizedLinearMethod

    original = UnquantizedLinearMethod.process_weights_after_loading

    def process_weights_after_loading(self, layer):
        original(self, layer)
        derived = layer.weight.detach().t().contiguous()
        first = _FIRST.get(layer)
        mode = _mode()
        if first is None:
            layer.weight_t = _FIRST[layer] = derived
        elif mode == "rebind":
            layer.weight_t = derived
        elif mode == "refresh":
            first.copy_(derived)
            layer.weight_t = first
        # "keep": nothing

    def apply(self, layer, x, bias=None):
        held = getattr(layer, "weight_t", None)
        if held is None:
            return F.linear(x, layer.weight, bias)
        out = x @ held
        return out + bias if bias is not None else out

    UnquantizedLinearMethod.process_weights_after_loading = process_weights_after_loading
    UnquantizedLinearMethod.apply = apply
