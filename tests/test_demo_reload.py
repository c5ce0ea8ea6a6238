"""The demo's reloads: the built-in one, vLLM's real layerwise reload, and their agreement."""

from __future__ import annotations

import pytest
import torch
from torch.multiprocessing.reductions import StorageWeakRef

from graphtrace.demo.kernels import VARIANTS, _perm_in_callable
from graphtrace.demo.model import DemoModel
from graphtrace.demo.reload import reload, resolve_backend


def holders(model) -> dict[str, torch.Tensor]:
    """Every tensor the forward may read: registered ones by name, plus plain attributes."""
    out = {f"param:{n}": p for n, p in model.named_parameters()}
    out.update({f"buffer:{n}": b for n, b in model.named_buffers()})
    for name, layer in model.quant_layers():
        kernel = layer.quant_method.kernel
        perm = _perm_in_callable(getattr(kernel, "act_perm", None))
        if perm is not None:
            out[f"act_perm:{name}"] = perm
        if "g_idx_sort_indices" in layer.__dict__:
            out[f"attr:{name}.g_idx_sort_indices"] = layer.__dict__["g_idx_sort_indices"]
        if getattr(kernel, "workspace", None) is not None:
            out[f"attr:{name}.kernel.workspace"] = kernel.workspace
    return out


def reload_pattern(variant: str, backend: str) -> dict[str, bool]:
    """holder -> did the reload give it a different storage?"""
    model = DemoModel(variant, seed=0, reload_backend=backend)
    before = {k: StorageWeakRef(t.untyped_storage()) for k, t in holders(model).items()}
    assert reload(model, model.make_checkpoint(1, 2)) == backend
    after = holders(model)
    assert after.keys() == before.keys()
    return {k: StorageWeakRef(after[k].untyped_storage()).cdata != ref.cdata
            for k, ref in before.items()}


EXPECTED_MOVED = {
    "unfixed-partial": {"act_perm"},
    "unfixed-lambda": {"act_perm"},
    "rejected-fix": {"act_perm"},
    "fixed": set(),
    "marlin": {"attr"},
}


@pytest.mark.parametrize("variant", VARIANTS)
def test_reload_keeps_registered_storages_and_rebinds_the_rest(variant, reload_backend):
    pattern = reload_pattern(variant, reload_backend)
    moved_kinds = {k.split(":")[0] for k, moved in pattern.items() if moved}
    assert moved_kinds == EXPECTED_MOVED[variant], pattern
    # every registered parameter kept its storage
    assert not any(m for k, m in pattern.items() if k.startswith(("param:", "buffer:")))
    # and each unregistered holder moved in every layer
    for k, m in pattern.items():
        if not k.startswith(("param:", "buffer:")):
            assert m, k


@pytest.mark.vllm
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.usefixtures("vllm_installed")
def test_vllm_and_builtin_reload_move_the_same_storages(variant):
    assert reload_pattern(variant, "vllm") == reload_pattern(variant, "builtin")


@pytest.mark.vllm
@pytest.mark.usefixtures("vllm_installed")
def test_vllm_reload_restores_the_construction_time_set():
    """The seed's accounting test, on vLLM's real code: `g_idx_sort_indices` (registered by
    PWAL) is not counted as loadable, and a layer processes as soon as its last checkpoint
    tensor arrives."""
    from vllm.model_executor.model_loader.reload import initialize_layerwise_reload
    from vllm.model_executor.model_loader.reload.layerwise import (
        finalize_layerwise_reload,
        get_layerwise_info,
    )

    model = DemoModel("fixed", n_layers=2, seed=0, reload_backend="vllm")
    layer0 = model.layers[0].mlp.down_proj
    layer1 = model.layers[1].mlp.down_proj
    kept = layer0.g_idx_sort_indices
    ckpt = model.make_checkpoint(1, 2)
    with torch.no_grad():
        initialize_layerwise_reload(model)
        info = get_layerwise_info(layer0)
        loadable = sum(ckpt[f"layers.0.mlp.down_proj.{n}"].numel()
                       for n in ("qweight", "scales", "g_idx"))
        assert info.load_numel_total == loadable
        assert "g_idx_sort_indices" not in layer0._parameters  # restored set only
        model.load_weights({k: v for k, v in ckpt.items() if k.startswith("layers.0.")})
        # layer 0 processed and its kernel tensors put back; layer 1 still waiting on meta
        assert layer0.g_idx_sort_indices is kept
        assert layer0.qweight.dtype == torch.int8 and not layer0.qweight.is_meta
        assert layer1.qweight.is_meta
        model.load_weights({k: v for k, v in ckpt.items() if k.startswith("layers.1.")})
        finalize_layerwise_reload(model, model_config=None)
    assert not layer1.qweight.is_meta
    fresh = DemoModel("fixed", n_layers=2, reload_backend="builtin")
    fresh.load(model.make_checkpoint(1, 2))
    x = model.make_input(3)
    with torch.no_grad():
        torch.testing.assert_close(model(x), fresh(x), rtol=0, atol=0)


@pytest.mark.vllm
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.usefixtures("vllm_installed")
def test_vllm_reload_eager_equals_fresh_model(variant):
    model = DemoModel(variant, seed=0, reload_backend="vllm")
    reload(model, model.make_checkpoint(1, 2), backend="vllm")
    fresh = DemoModel(variant, reload_backend="builtin")
    fresh.load(model.make_checkpoint(1, 2))
    x = model.make_input(4)
    with torch.no_grad():
        torch.testing.assert_close(model(x), fresh(x), rtol=0, atol=0)


def test_backend_selection():
    assert resolve_backend("builtin") == "builtin"
    with pytest.raises(ValueError):
        resolve_backend("nope")
    model = DemoModel("fixed", n_layers=1, seed=0, reload_backend="builtin")
    assert model.reload_backend == "builtin"
    # auto follows what was recorded at construction
    assert reload(model, model.make_checkpoint(1, 2)) == "builtin"
    with pytest.raises(RuntimeError, match="construction"):
        reload(model, model.make_checkpoint(1, 2), backend="vllm")


def test_builtin_reload_twice_and_unknown_tensor():
    model = DemoModel("rejected-fix", n_layers=2, seed=0, reload_backend="builtin")
    reg = model.layers[0].mlp.down_proj.g_idx_sort_indices
    for s in (1, 2):
        reload(model, model.make_checkpoint(s, s + 10))
        assert model.layers[0].mlp.down_proj.g_idx_sort_indices is reg
    with pytest.raises(KeyError, match="layers.0.nope"):
        reload(model, {"layers.0.nope": torch.zeros(1)})
    # refused before anything was touched: the model still runs
    assert model.layers[0].mlp.down_proj.g_idx_sort_indices is reg
    with torch.no_grad():
        model(model.make_input(2))
