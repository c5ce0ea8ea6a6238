"""Reproduction kernels and tiny model: numerics, PWAL forms, replace_parameter semantics."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F

from graphtrace.demo import ops
from graphtrace.demo.kernels import (
    KERNELS,
    VARIANTS,
    dequantize_reference,
    pack_int4_rows,
    replace_parameter,
    unpack_int4_rows,
    weight_loader,
)
from graphtrace.demo.model import DemoModel, make_checkpoint
from graphtrace.demo.reload import reload


def reference_forward(ckpt, x, n_layers):
    """The model's forward computed from the checkpoint with unpermuted dequantised weights."""
    for i in range(n_layers):
        p = f"layers.{i}"
        w = ckpt[f"{p}.input_layernorm.weight"]
        h = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w
        W = dequantize_reference(ckpt[f"{p}.mlp.down_proj.qweight"],
                                 ckpt[f"{p}.mlp.down_proj.scales"],
                                 ckpt[f"{p}.mlp.down_proj.g_idx"])
        y = F.silu(h) @ W
        x = x + y if y.shape == x.shape else y
    return x


def test_variant_registry_names():
    assert VARIANTS == ("unfixed-partial", "unfixed-lambda", "rejected-fix", "fixed", "marlin")
    assert set(KERNELS) == set(VARIANTS)


def test_pack_unpack_roundtrip():
    gen = torch.Generator().manual_seed(0)
    q = torch.randint(0, 16, (64, 24), generator=gen, dtype=torch.int32)
    packed = pack_int4_rows(q)
    assert packed.shape == (8, 24) and packed.dtype == torch.int32
    assert torch.equal(unpack_int4_rows(packed), q)
    # high nibble set: the packed int32 goes negative and still round-trips
    assert (packed < 0).any()


def test_checkpoint_act_order_is_a_group_shuffle():
    ckpt = make_checkpoint(0, 0, n_layers=2, k=64, n=32, group=16)
    ckpt2 = make_checkpoint(0, 5, n_layers=2, k=64, n=32, group=16)
    for i in range(2):
        g = ckpt[f"layers.{i}.mlp.down_proj.g_idx"]
        assert g.dtype == torch.int32
        assert torch.equal(torch.bincount(g.long()), torch.full((g.numel() // 16,), 16))
        assert not torch.equal(g, torch.arange(g.numel()) // 16)  # act order, not identity
        # a different act_order_seed changes only the act order
        assert not torch.equal(g, ckpt2[f"layers.{i}.mlp.down_proj.g_idx"])
        assert torch.equal(ckpt[f"layers.{i}.mlp.down_proj.qweight"],
                           ckpt2[f"layers.{i}.mlp.down_proj.qweight"])


@pytest.mark.parametrize("variant", VARIANTS)
def test_kernel_matches_unpermuted_dequantised_reference(variant):
    model = DemoModel(variant, n_layers=3, k=64, n=64, group=16, seed=3,
                      reload_backend="builtin")
    ckpt = make_checkpoint(3, n_layers=3, k=64, n=64, group=16)
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(model(x), reference_forward(ckpt, x, 3))
        # and one layer alone, on a 3-d input (the kernels flatten leading dims)
        layer = model.layers[1].mlp.down_proj
        W = dequantize_reference(ckpt["layers.1.mlp.down_proj.qweight"],
                                 ckpt["layers.1.mlp.down_proj.scales"],
                                 ckpt["layers.1.mlp.down_proj.g_idx"])
        x3 = x.reshape(5, 1, 64).expand(5, 2, 64)
        torch.testing.assert_close(layer(x3), x3 @ W)


def test_rectangular_first_layer():
    model = DemoModel("fixed", n_layers=2, k=128, n=64, group=32, seed=1,
                      reload_backend="builtin")
    ckpt = make_checkpoint(1, n_layers=2, k=128, n=64, group=32)
    x = torch.randn(3, 128, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        torch.testing.assert_close(model(x), reference_forward(ckpt, x, 2))


def test_weights_are_pre_permuted_so_the_permuted_product_matches():
    model = DemoModel("unfixed-partial", n_layers=1, seed=0, reload_backend="builtin")
    layer = model.layers[0].mlp.down_proj
    ckpt = make_checkpoint(0, n_layers=1)
    perm = layer.quant_method.kernel.act_perm.keywords["perm"]
    g_idx = ckpt["layers.0.mlp.down_proj.g_idx"]
    assert torch.equal(perm, torch.argsort(g_idx, stable=True).to(torch.int32))
    # runtime weight: rows permuted, groups contiguous
    q = unpack_int4_rows(ckpt["layers.0.mlp.down_proj.qweight"]) - 8
    assert layer.qweight.dtype == torch.int8 and layer.qweight.shape == (64, 64)
    assert torch.equal(layer.qweight.to(torch.int32), q[perm.long()])
    assert torch.equal(g_idx[perm.long()], torch.arange(64, dtype=torch.int32) // 16)


def test_act_perm_forms():
    partial = DemoModel("unfixed-partial", n_layers=1, seed=0, reload_backend="builtin")
    k = partial.layers[0].mlp.down_proj.quant_method.kernel
    assert isinstance(k.act_perm, functools.partial)
    assert k.act_perm.func is ops.permute_cols
    assert k.act_perm.keywords["perm"].dtype == torch.int32

    lam = DemoModel("unfixed-lambda", n_layers=1, seed=0, reload_backend="builtin")
    k = lam.layers[0].mlp.down_proj.quant_method.kernel
    assert k.act_perm.__name__ == "<lambda>"
    cells = [c.cell_contents for c in k.act_perm.__closure__]
    assert any(isinstance(c, torch.Tensor) and c.dtype == torch.int32 for c in cells)
    # neither registers the permutation
    for m in (partial, lam):
        assert not any("g_idx_sort_indices" in n for n, _ in m.named_parameters())


def test_fixed_registers_perm_and_keeps_only_a_bool():
    model = DemoModel("fixed", n_layers=2, seed=0, reload_backend="builtin")
    for _, layer in model.quant_layers():
        kernel = layer.quant_method.kernel
        assert isinstance(layer._parameters["g_idx_sort_indices"], torch.nn.Parameter)
        assert not hasattr(kernel, "act_perm")
        assert isinstance(kernel.use_permute_cols, bool)
        # no tensor anywhere in the kernel's attributes
        assert not any(isinstance(v, torch.Tensor) for v in vars(kernel).values())


def test_rejected_fix_registers_and_binds():
    model = DemoModel("rejected-fix", n_layers=1, seed=0, reload_backend="builtin")
    layer = model.layers[0].mlp.down_proj
    kernel = layer.quant_method.kernel
    registered = layer._parameters["g_idx_sort_indices"]
    bound = kernel.act_perm.keywords["perm"]
    # at initial load both name the same storage
    assert bound.untyped_storage().data_ptr() == registered.untyped_storage().data_ptr()


def test_marlin_keeps_plain_attributes():
    model = DemoModel("marlin", n_layers=1, seed=0, reload_backend="builtin")
    layer = model.layers[0].mlp.down_proj
    kernel = layer.quant_method.kernel
    names = {n for n, _ in layer.named_parameters()} | {n for n, _ in layer.named_buffers()}
    assert "g_idx_sort_indices" not in names
    assert isinstance(layer.__dict__["g_idx_sort_indices"], torch.Tensor)
    assert isinstance(kernel.workspace, torch.Tensor) and not kernel.workspace.any()
    # g_idx is re-registered sorted
    assert torch.equal(layer.g_idx, torch.sort(layer.g_idx).values)


def test_replace_parameter_prefer_copy_keeps_storage():
    layer = torch.nn.Module()
    layer.register_parameter("p", torch.nn.Parameter(torch.zeros(4), requires_grad=False))
    layer.p.weight_loader = weight_loader
    old, ptr = layer.p, layer.p.data_ptr()
    new = torch.arange(4.0)
    new.custom_flag = True
    replace_parameter(layer, "p", new, prefer_copy=True)
    assert layer.p is old and layer.p.data_ptr() == ptr
    assert torch.equal(layer.p, new) and layer.p.custom_flag is True
    assert layer.p.weight_loader is weight_loader


def test_replace_parameter_registers_anew_otherwise():
    layer = torch.nn.Module()
    layer.register_parameter("p", torch.nn.Parameter(torch.zeros(4), requires_grad=False))
    layer.p.weight_loader = weight_loader
    old = layer.p
    # no prefer_copy: a new parameter, sharing the new tensor's storage, keeps the loader
    new = torch.arange(4.0)
    new.weight_loader = "dropped"
    replace_parameter(layer, "p", new)
    assert layer.p is not old and layer.p.data_ptr() == new.data_ptr()
    assert isinstance(layer.p, torch.nn.Parameter) and not layer.p.requires_grad
    assert layer.p.weight_loader is weight_loader
    # prefer_copy but another shape / dtype: registered anew too
    for other in (torch.arange(6.0), torch.arange(4, dtype=torch.int32)):
        before = layer.p
        replace_parameter(layer, "p", other, prefer_copy=True)
        assert layer.p is not before and layer.p.data_ptr() == other.data_ptr()
    # a name that does not exist yet is registered
    replace_parameter(layer, "q", torch.ones(2), prefer_copy=True)
    assert "q" in dict(layer.named_parameters())
    # None sets None
    replace_parameter(layer, "q", None)
    assert layer.q is None


@pytest.mark.parametrize("variant", VARIANTS)
def test_eager_after_reload_equals_fresh_model(variant):
    """The bug lives only in captured graphs: eager forward after a reload with new weights
    and a new act order equals a model built from the new checkpoint."""
    model = DemoModel(variant, seed=0, reload_backend="builtin")
    new = model.make_checkpoint(1, 2)
    assert reload(model, new, backend="builtin") == "builtin"
    fresh = DemoModel(variant, reload_backend="builtin")
    fresh.load(model.make_checkpoint(1, 2))
    x = model.make_input(6)
    with torch.no_grad():
        torch.testing.assert_close(model(x), fresh(x), rtol=0, atol=0)
        torch.testing.assert_close(model(x), reference_forward(new, x, 4))


def test_unknown_variant_and_bad_sizes():
    with pytest.raises(ValueError, match="unknown variant"):
        DemoModel("nope")
    with pytest.raises(ValueError):
        DemoModel("fixed", k=60)
    with pytest.raises(ValueError):
        weight_loader(torch.nn.Parameter(torch.zeros(3), requires_grad=False), torch.zeros(4))
