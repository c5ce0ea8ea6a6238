"""Reload a `DemoModel` with new weights: through vLLM's real layerwise reload, or a
small built-in one that follows the same steps.

vLLM's layerwise reload (`vllm/model_executor/model_loader/reload/`, vLLM 0.32):

0. at construction, `record_metadata_for_reloading(model)` records every module's
   parameters and buffers as meta tensors (shape, dtype, class, attributes such as the
   `weight_loader`): the *construction-time tensor set*, in checkpoint format;
1. `initialize_layerwise_reload(model)` keeps the currently registered parameters and
   buffers of each module (the *kernel tensors*, runtime format, the storages captured
   CUDA graphs read), then restores the construction-time set on the meta device (tensors
   PWAL registered, such as `g_idx_sort_indices`, are dropped) and wraps each weight loader;
2. the model's `load_weights` calls each parameter's (wrapped) `weight_loader`; a layer's
   loads are buffered until all its checkpoint elements have arrived, then the layer is
   materialised, the buffered loads are replayed into it, and
3. its `quant_method.process_weights_after_loading(layer)` (PWAL) runs;
4. the processed values are copied into the kernel tensors by name, and the kernel tensors
   are registered again in place of whatever PWAL registered;
5. `finalize_layerwise_reload(model, model_config)` processes layers that did not finish
   during loading and resets the bookkeeping.

So a reload keeps the storage of every parameter and buffer registered before it (their
values are refreshed in place) and *rebinds* everything else PWAL creates: kernel
attributes, plain tensor attributes of the layer, tensors held in partials and closures.
That is the seed's bug.

The built-in reload (`backend="builtin"`, used when vLLM is not installed) performs the
same steps model-wide instead of layer by layer (restore all, load all, process all, copy
back all), with the construction-time set recorded by `record_metadata` and
materialised directly on the model's device. The storages kept, refreshed and rebound are
the same; `tests/test_demo_reload.py` checks it against vLLM's.
"""

from __future__ import annotations

import importlib.util
import weakref

import torch

__all__ = ["BACKENDS", "vllm_available", "resolve_backend", "record_metadata", "reload"]

BACKENDS = ("auto", "vllm", "builtin")

# module -> (params, buffers): construction-time tensors as meta tensors with attributes
_CONSTRUCTION: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_VLLM_RECORDED: weakref.WeakSet = weakref.WeakSet()
_REGISTERED_QUANT_METHODS: set[type] = set()


def vllm_available() -> bool:
    """Is vLLM's reload code importable here (without importing it)?"""
    try:
        return importlib.util.find_spec("vllm") is not None
    except (ImportError, ValueError):
        return False


def resolve_backend(backend: str = "auto") -> str:
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, not {backend!r}")
    if backend == "auto":
        return "vllm" if vllm_available() else "builtin"
    if backend == "vllm" and not vllm_available():
        raise RuntimeError("backend='vllm' but vLLM is not installed in this environment")
    return backend


def _to_meta(t: torch.Tensor) -> torch.Tensor:
    m = t.data.to("meta")
    m.__class__ = t.__class__
    m.__dict__ = t.__dict__.copy()
    return m


def _materialize(m: torch.Tensor, device) -> torch.Tensor:
    t = torch.empty_strided(tuple(m.size()), tuple(m.stride()), dtype=m.dtype, device=device)
    t.__class__ = m.__class__
    t.__dict__ = m.__dict__.copy()
    return t


def _register_vllm_quant_methods(model: torch.nn.Module) -> None:
    """Make vLLM's layerwise processing recognise the demo's quant methods.

    vLLM runs PWAL only for `isinstance(quant_method, QuantizeMethodBase)`; the demo's
    linear method is a plain class (so the demo needs no vLLM), registered here as a
    virtual subclass of that ABC.
    """
    from vllm.model_executor.layers.quantization.base_config import QuantizeMethodBase

    for module in model.modules():
        qm = getattr(module, "quant_method", None)
        if qm is not None and type(qm) not in _REGISTERED_QUANT_METHODS:
            QuantizeMethodBase.register(type(qm))
            _REGISTERED_QUANT_METHODS.add(type(qm))


def record_metadata(model: torch.nn.Module, backend: str = "auto") -> str:
    """Record the construction-time tensor set; call right after construction.

    Always records the built-in copy; also calls vLLM's `record_metadata_for_reloading`
    when the resolved backend is "vllm". Returns the resolved backend.
    """
    resolved = resolve_backend(backend)
    for module in model.modules():
        _CONSTRUCTION[module] = (
            {n: _to_meta(p) for n, p in module._parameters.items() if p is not None},
            {n: _to_meta(b) for n, b in module._buffers.items() if b is not None},
        )
    if resolved == "vllm":
        from vllm.model_executor.model_loader.reload import record_metadata_for_reloading

        _register_vllm_quant_methods(model)
        device = next(model.parameters()).device
        # vLLM records the default device to materialise on; its loader constructs
        # models inside a device context, so do the same.
        with torch.device(device):
            record_metadata_for_reloading(model)
        _VLLM_RECORDED.add(model)
    return resolved


def reload(model: torch.nn.Module, checkpoint: dict[str, torch.Tensor], *,
           backend: str = "auto") -> str:
    """Reload `model` (a `DemoModel`) from `checkpoint`; returns the backend used.

    "auto" uses vLLM when its metadata was recorded at construction (see
    `DemoModel(reload_backend=...)`), else the built-in reload.
    """
    if backend == "auto":
        backend = "vllm" if model in _VLLM_RECORDED else "builtin"
    elif backend == "vllm" and model not in _VLLM_RECORDED:
        raise RuntimeError(
            "vLLM reload needs vLLM's metadata recorded at construction: build the model "
            "with reload_backend='vllm' (or 'auto' with vLLM installed)")
    elif backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, not {backend!r}")
    _check_names(model, checkpoint)
    with torch.no_grad():
        if backend == "vllm":
            _reload_vllm(model, checkpoint)
        else:
            _reload_builtin(model, checkpoint)
    return backend


def _check_names(model, checkpoint) -> None:
    """Refuse a checkpoint with tensors the model never had, before touching the model."""
    known = set()
    for prefix, module in model.named_modules():
        params, _ = _CONSTRUCTION.get(module, ({}, {}))
        known.update(f"{prefix}.{n}" if prefix else n for n in params)
    unknown = sorted(set(checkpoint) - known)
    if unknown:
        raise KeyError(f"checkpoint tensors with no construction-time parameter: {unknown[:5]}")


def _reload_vllm(model, checkpoint) -> None:
    from vllm.model_executor.model_loader.reload import (
        finalize_layerwise_reload,
        initialize_layerwise_reload,
    )

    _register_vllm_quant_methods(model)
    initialize_layerwise_reload(model)
    model.load_weights(checkpoint)
    # model_config is only read for attention layers, which the demo has none of.
    finalize_layerwise_reload(model, model_config=None)


def _reload_builtin(model, checkpoint) -> None:
    modules = list(model.modules())
    missing = [m for m in modules if m not in _CONSTRUCTION]
    if missing:
        raise RuntimeError("record_metadata(model) was not called at construction")
    device = next(model.parameters()).device

    # 1. keep the kernel tensors (registered now, read by captured graphs) ...
    kernel: dict[torch.nn.Module, tuple[dict, dict, set]] = {}
    for m in modules:
        kernel[m] = (
            {n: p for n, p in m._parameters.items() if p is not None},
            {n: b for n, b in m._buffers.items() if b is not None},
            set(m._non_persistent_buffers_set),
        )
    # ... and restore the construction-time set (materialised, not on meta)
    for m in modules:
        params, buffers = _CONSTRUCTION[m]
        for name in list(m._parameters) + list(m._buffers):
            delattr(m, name)
        for name in list(params) + list(buffers):
            if name in m.__dict__:
                delattr(m, name)
        for name, meta in params.items():
            m.register_parameter(name, _materialize(meta, device))
        for name, meta in buffers.items():
            m.register_buffer(name, _materialize(meta, device),
                              persistent=name not in kernel[m][2])

    # 2. load through the weight loaders
    model.load_weights(checkpoint)
    loaded = {name.rpartition(".")[0] for name in checkpoint}

    for prefix, m in model.named_modules():
        if prefix not in loaded:
            # nothing loaded into this module: put its kernel tensors back unprocessed, as
            # vLLM's finalize_layerwise_processing does (`_place_kernel_tensors`)
            _put_back(m, *kernel[m])
            continue
        # 3. process
        qm = getattr(m, "quant_method", None)
        if qm is not None and hasattr(qm, "process_weights_after_loading"):
            qm.process_weights_after_loading(m)
        # 4. copy processed values into the kernel tensors, put those back
        k_params, k_buffers, non_persistent = kernel[m]
        for name, p in k_params.items():
            p.data.copy_(getattr(m, name))
        for name, b in k_buffers.items():
            if name in m._buffers:
                b.data.copy_(getattr(m, name))
        _put_back(m, k_params, k_buffers, non_persistent)


def _put_back(m: torch.nn.Module, params: dict, buffers: dict, non_persistent: set) -> None:
    """Register the kept kernel tensors on `m` again, in place of whatever it holds now."""
    for name in list(m._parameters) + list(m._buffers):
        delattr(m, name)
    for name, p in params.items():
        m.register_parameter(name, p)
    for name, b in buffers.items():
        m.register_buffer(name, b, persistent=name not in non_persistent)
