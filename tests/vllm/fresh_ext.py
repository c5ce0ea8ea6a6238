"""A vLLM worker extension for the freshness-inside-syncs tests (``worker_extension_cls=
"fresh_ext.FreshTestExtension"``, tests/vllm on sys.path; issue 39, item 3).

The holder: ``qkv_proj.quant_method.graphtrace_scale`` of layer 0, a tensor the layer's linear
method keeps, read by the layer's forward (its output scaled in place), and derived from a
weight: ``1 + 1e-3 * mean(input_layernorm.weight)`` (`derive`; close to one, so generation
goes on). Its derivation runs inside a weight loader, in place (`torch.Tensor.copy_` into the
tensor the graph captured): the loader of layer 0's ``input_layernorm.weight`` refreshes it
after loading while ``graphtrace_fresh_mode(True)``, and leaves it alone after
``graphtrace_fresh_mode(False)`` -- an update that loads a new weight and runs no weight
processing, so the graph reads the old value at the same address. (The layer's own weight
is no choice on a CPU engine: vLLM prepacks ``qkv_proj.weight`` and empties it, and a bare
``load_weights`` of it fails; see serve_ext.py.) The holder is made when the test injects
it, after the engine was loaded, while the trace records no lineage: when the graph is
captured it comes from no weight, and what lineage learns of it, it learns inside an update.
"""

from __future__ import annotations

import torch
from serve_ext import ServeTestExtension

HOLDER = "model.layers.0.self_attn.qkv_proj.quant_method.graphtrace_scale"
SOURCE = "model.layers.0.input_layernorm.weight"


def _layers(worker):
    layer = worker.model_runner.get_model().model.layers[0]
    return layer.self_attn.qkv_proj, layer.input_layernorm.weight


def derive(weight: torch.Tensor, out: int) -> torch.Tensor:
    """The holder's value from the weight (what the loader writes into it)."""
    return torch.ones(out, dtype=weight.dtype) * (1 + 1e-3 * weight.mean())


def _scale(module, args, output):
    out = output[0] if isinstance(output, tuple) else output
    out.mul_(module.quant_method.graphtrace_scale)


class FreshTestExtension(ServeTestExtension):
    def graphtrace_fresh_inject(self) -> str:
        """Add the holder and its refreshing loader (before the first capture)."""
        layer, weight = _layers(self)
        method = layer.quant_method
        method.graphtrace_scale = derive(weight, layer.output_size_per_partition)
        method.graphtrace_refresh = True
        layer.register_forward_hook(_scale)
        self._graphtrace_fresh_loader()
        return HOLDER

    def _graphtrace_fresh_loader(self) -> None:
        layer, weight = _layers(self)
        from vllm.model_executor.model_loader.weight_utils import default_weight_loader

        loader = getattr(weight, "weight_loader", None) or default_weight_loader
        if getattr(loader, "graphtrace_fresh", False):
            return
        method = layer.quant_method

        def weight_loader(param, loaded, *args, **kwargs):
            out = loader(param, loaded, *args, **kwargs)
            if method.graphtrace_refresh:  # in place: the tensor the graph captured
                method.graphtrace_scale.copy_(derive(param, method.graphtrace_scale.numel()))
            return out

        weight_loader.graphtrace_fresh = True
        weight.weight_loader = weight_loader

    def graphtrace_fresh_mode(self, refresh: bool) -> bool:
        """Does the loader refresh the holder from now on?"""
        _layers(self)[0].quant_method.graphtrace_refresh = refresh
        return refresh

    def graphtrace_fresh_current(self) -> bool:
        """The independent check: does the holder hold what the weight now gives?"""
        layer, weight = _layers(self)
        scale = layer.quant_method.graphtrace_scale
        with torch.no_grad():
            return bool(torch.equal(scale, derive(weight, scale.numel())))

    def graphtrace_fresh_diff(self) -> list[dict]:
        """This process's trace diffed now: the edges of the holder (verdict, derived_from)."""
        from graphtrace.tracing import active_trace

        edges = active_trace().diff().edges
        rows = edges[edges["owners"].astype(str).str.contains(HOLDER, regex=False)]
        return [{"verdict": str(r["verdict"]), "derived_from": str(r["derived_from"])}
                for _, r in rows.iterrows()]
