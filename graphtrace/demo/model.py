"""A tiny model of act-order W4A16 layers, named like a vLLM decoder.

Module tree (``n_layers`` blocks)::

    DemoModel
      layers.<i>.input_layernorm      RMSNorm, parameter `weight` (plain, default loader)
      layers.<i>.mlp.down_proj        ActOrderLinear: `qweight`, `scales`, `g_idx`
                                       .quant_method          WNA16ActOrderLinearMethod
                                       .quant_method.kernel   the variant's kernel

so the owners graphtrace reports read like vLLM's, e.g.
``layers.0.mlp.down_proj.quant_method.kernel.act_perm.keywords['perm']``.

Each block computes ``x + down_proj(silu(norm(x)))`` (the residual is dropped when the
first block changes the width). Construction creates empty checkpoint-format parameters,
as vLLM does; `load_weights` fills them through each parameter's `weight_loader`;
`process_weights_after_loading` runs every layer's PWAL (`DemoModel`'s `seed` does both).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .kernels import (
    KERNELS,
    PACK_FACTOR,
    LayerConfig,
    WNA16ActOrderLinearMethod,
    pack_int4_rows,
    weight_loader,
)

__all__ = [
    "RMSNorm", "ActOrderLinear", "DemoMLP", "DemoDecoderLayer", "make_checkpoint",
    "CaseModel", "DemoModel"
]


class RMSNorm(torch.nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6, dtype=torch.float32, device=None):
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.empty(dim, dtype=dtype, device=device),
                                         requires_grad=False)
        self.weight.weight_loader = weight_loader

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class ActOrderLinear(torch.nn.Module):
    """A linear layer whose weights and forward belong to its `quant_method` (vLLM's
    `LinearBase` pattern)."""

    def __init__(self, variant: str | type, config: LayerConfig, device=None):
        super().__init__()
        self.input_size = config.in_features
        self.output_size = config.out_features
        kernel_cls = variant if isinstance(variant, type) else KERNELS[variant]
        self.quant_method = WNA16ActOrderLinearMethod(kernel_cls, config)
        self.quant_method.create_weights(self, device=device)

    def forward(self, x):
        return self.quant_method.apply(self, x)

    def extra_repr(self):
        return (f"in_features={self.input_size}, out_features={self.output_size}, "
                f"kernel={type(self.quant_method.kernel).__name__}")


class DemoMLP(torch.nn.Module):
    def __init__(self, variant, config, device=None):
        super().__init__()
        self.down_proj = ActOrderLinear(variant, config, device=device)

    def forward(self, x):
        return self.down_proj(F.silu(x))


class DemoDecoderLayer(torch.nn.Module):
    def __init__(self, variant, config, dtype, device=None):
        super().__init__()
        self.input_layernorm = RMSNorm(config.in_features, dtype=dtype, device=device)
        self.mlp = DemoMLP(variant, config, device=device)
        self.residual = config.in_features == config.out_features

    def forward(self, x):
        h = self.mlp(self.input_layernorm(x))
        return x + h if self.residual else h


def make_checkpoint(seed: int = 0, act_order_seed: int | None = None, *, n_layers: int = 4,
                    k: int = 64, n: int = 64, group: int = 16, dtype=torch.float32,
                    device="cpu") -> dict[str, torch.Tensor]:
    """Checkpoint-format weights for `DemoModel` (GPTQ 4-bit act-order, see kernels.py).

    `seed` draws the weights; `act_order_seed` (default: `seed`) draws each layer's act
    order (`g_idx`, a shuffled assignment of rows to groups). Two checkpoints with
    different `act_order_seed`s give different `argsort(g_idx)` permutations.
    """
    if act_order_seed is None:
        act_order_seed = seed
    gen = torch.Generator().manual_seed(int(seed))
    gen_order = torch.Generator().manual_seed(int(act_order_seed) + 7919)
    ckpt: dict[str, torch.Tensor] = {}
    for i in range(n_layers):
        k_i = k if i == 0 else n
        prefix = f"layers.{i}"
        ckpt[f"{prefix}.input_layernorm.weight"] = (
            1.0 + 0.1 * torch.randn(k_i, generator=gen)).to(dtype)
        q = torch.randint(0, 16, (k_i, n), generator=gen, dtype=torch.int32)
        # scales so that one layer maps unit-variance inputs to roughly unit variance
        base = 1.0 / (4.6 * k_i ** 0.5)
        scales = base * (0.5 + torch.rand(k_i // group, n, generator=gen))
        g_idx = (torch.arange(k_i) // group)[torch.randperm(k_i, generator=gen_order)]
        ckpt[f"{prefix}.mlp.down_proj.qweight"] = pack_int4_rows(q)
        ckpt[f"{prefix}.mlp.down_proj.scales"] = scales.to(dtype)
        ckpt[f"{prefix}.mlp.down_proj.g_idx"] = g_idx.to(torch.int32)
    return {name: t.to(device) for name, t in ckpt.items()}


class CaseModel(torch.nn.Module):
    """A root module whose `load_weights` fills parameters through their weight loaders; by
    default its forward runs `self.layers` in order (a decoder's stack)."""

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x

    def load_weights(self, checkpoint: dict[str, torch.Tensor]) -> set[str]:
        """Load every checkpoint tensor through its parameter's `weight_loader`.

        Like a vLLM model's `load_weights`: parameters are looked up afresh (a reload may
        have swapped them), nothing is processed here. Returns the names loaded.
        """
        params = dict(self.named_parameters())
        for name, tensor in checkpoint.items():
            if name not in params:
                raise KeyError(f"checkpoint tensor {name!r} has no parameter in the model")
            param = params[name]
            getattr(param, "weight_loader", weight_loader)(param, tensor)
        return set(checkpoint)

    def process_weights_after_loading(self) -> None:
        """Run every layer's PWAL (vLLM's loader does this after `load_weights`)."""
        for m in self.modules():
            qm = getattr(m, "quant_method", None)
            if qm is not None and hasattr(qm, "process_weights_after_loading"):
                qm.process_weights_after_loading(m)

    def load(self, checkpoint: dict[str, torch.Tensor]) -> None:
        """The engine's first load: load_weights, then process."""
        self.load_weights(checkpoint)
        self.process_weights_after_loading()


class DemoModel(CaseModel):
    """`n_layers` act-order blocks of one kernel `variant` (a name in `kernels.KERNELS`, or
    a kernel class: the case library's variants that the seed demo does not run).

    ``seed=None`` leaves the model as vLLM leaves it after construction (empty
    checkpoint-format parameters); an int loads `make_checkpoint(seed)` and runs PWAL.
    ``reload_backend`` says which reload code will drive `graphtrace.demo.reload.reload`
    ("auto": vLLM's when importable): both record the construction-time tensor set here,
    before anything is loaded, as vLLM's loader does.
    """

    def __init__(self, variant: str | type = "fixed", n_layers: int = 4, k: int = 64, n: int = 64,
                 group: int = 16, seed: int | None = None, *, dtype=torch.float32,
                 device="cpu", reload_backend: str = "auto"):
        super().__init__()
        if not (isinstance(variant, type) or variant in KERNELS):
            raise ValueError(f"unknown variant {variant!r}; choose from {sorted(KERNELS)}")
        if k % PACK_FACTOR or n % PACK_FACTOR:
            raise ValueError("k and n must be multiples of 8")
        self.variant = variant.name if isinstance(variant, type) else variant
        self.config = dict(n_layers=n_layers, k=k, n=n, group=group, dtype=dtype)
        device = torch.device(device)
        self.layers = torch.nn.ModuleList(
            DemoDecoderLayer(variant, LayerConfig(k if i == 0 else n, n, group, act_type=dtype),
                             dtype, device=device)
            for i in range(n_layers))
        from . import reload as _reload

        self.reload_backend = _reload.record_metadata(self, backend=reload_backend)
        if seed is not None:
            self.load_weights(self.make_checkpoint(seed))
            self.process_weights_after_loading()

    @property
    def device(self) -> torch.device:
        return self.layers[0].input_layernorm.weight.device

    @property
    def in_features(self) -> int:
        return self.config["k"]

    def quant_layers(self) -> list[tuple[str, ActOrderLinear]]:
        """(FQN, layer) of every act-order linear layer."""
        return [(name, m) for name, m in self.named_modules() if isinstance(m, ActOrderLinear)]

    def make_checkpoint(self, seed: int = 0, act_order_seed: int | None = None):
        c = self.config
        return make_checkpoint(seed, act_order_seed, n_layers=c["n_layers"], k=c["k"],
                               n=c["n"], group=c["group"], dtype=c["dtype"],
                               device=self.device)

    def make_input(self, batch_size: int, seed: int = 0) -> torch.Tensor:
        gen = torch.Generator().manual_seed(int(seed) * 1000 + batch_size)
        x = torch.randn(batch_size, self.config["k"], generator=gen)
        return x.to(device=self.device, dtype=self.config["dtype"])
