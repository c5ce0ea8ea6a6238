"""Reproduction kernels: a W4A16 act-order linear layer, as vLLM's Machete kernel had it.

The layout follows vLLM's mixed-precision linear kernels (`MPLinearKernel` subclasses)
before vLLM 0.32 removed GPTQ act-order:

* a *linear method* (`WNA16ActOrderLinearMethod`, the `quant_method` of a layer) creates
  the checkpoint-format parameters at construction, each with a `weight_loader`, and owns
  a *kernel* (`quant_method.kernel`);
* the kernel's `process_weights_after_loading(layer)` (PWAL) turns the checkpoint format
  into the runtime format, and `apply_weights(layer, x)` runs the forward.

Checkpoint format (GPTQ, 4-bit symmetric, `uint4b8`: value = (q - 8) * scale):

| parameter | shape | dtype |
|---|---|---|
| `qweight` | (K // 8, N): eight 4-bit values per int32, packed along K | int32 |
| `scales` | (K // group, N) | activation dtype |
| `g_idx` | (K,): the group of each input row (act-order: a shuffled assignment) | int32 |

Runtime format (after PWAL): `qweight` becomes (K, N) int8 holding q - 8 with its rows
permuted by `perm = argsort(g_idx)`, so that rows of one group are contiguous and
`x[:, perm] @ W[perm]` equals the unpermuted product `x @ W`. The activation permutation
is what the variants below disagree about:

| variant | where `perm` lives after PWAL | what the forward reads |
|---|---|---|
| `unfixed-partial` | `kernel.act_perm = partial(permute_cols, perm=perm)` | the partial's keyword |
| `unfixed-lambda` | `kernel.act_perm = lambda x: x[:, perm]` | the lambda's closure cell |
| `rejected-fix` | registered `layer.g_idx_sort_indices` (prefer_copy) *and* bound into `act_perm` at PWAL time | the partial's keyword |
| `fixed` | registered `layer.g_idx_sort_indices` (prefer_copy), `kernel.use_permute_cols` bool | the layer's parameter, looked up at apply time |
| `marlin` | plain attribute `layer.g_idx_sort_indices`, plus `kernel.workspace` | both, passed to `gptq_marlin_gemm` |

Only what the forward reads through registered tensors survives vLLM's reload
(`graphtrace.demo.reload`). `fixed` is the merged fix of the seed report; `rejected-fix` is
its first iteration, which the live probe rejected; `marlin` mirrors vLLM's Marlin kernel
before its own act-order fix.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from . import ops

__all__ = [
    "UINT4B8", "PACK_FACTOR", "pack_int4_rows", "unpack_int4_rows", "weight_loader",
    "replace_parameter", "LayerConfig", "WNA16ActOrderLinearMethod", "MPLinearKernelBase",
    "MacheteUnfixedKernel", "MacheteUnfixedPartialKernel", "MacheteUnfixedLambdaKernel",
    "MacheteRejectedFixKernel", "MacheteFixedKernel", "MarlinStyleKernel", "VARIANTS",
    "dequantize_reference"
]

# vLLM's ScalarType ids are opaque ints; the reference ops ignore them.
UINT4B8 = 0x4B8
PACK_FACTOR = 8  # int4 values per int32


# --------------------------------------------------------------------------------------
# helpers: packing, loaders, replace_parameter
# --------------------------------------------------------------------------------------

def pack_int4_rows(q: torch.Tensor) -> torch.Tensor:
    """Pack (K, N) values in [0, 16) into (K // 8, N) int32, eight rows per int32 (GPTQ)."""
    k, n = q.shape
    if k % PACK_FACTOR:
        raise ValueError(f"K={k} is not a multiple of {PACK_FACTOR}")
    q = q.to(torch.int64).reshape(k // PACK_FACTOR, PACK_FACTOR, n)
    shifts = (torch.arange(PACK_FACTOR, device=q.device) * 4).view(1, PACK_FACTOR, 1)
    packed = (q << shifts).sum(dim=1)
    packed = torch.where(packed >= 2**31, packed - 2**32, packed)
    return packed.to(torch.int32)


def unpack_int4_rows(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of `pack_int4_rows`: (K // 8, N) int32 -> (K, N) int32 in [0, 16)."""
    kp, n = packed.shape
    shifts = (torch.arange(PACK_FACTOR, device=packed.device, dtype=torch.int32) * 4)
    vals = (packed.unsqueeze(1) >> shifts.view(1, PACK_FACTOR, 1)) & 0xF
    return vals.reshape(kp * PACK_FACTOR, n)


def weight_loader(param: torch.Tensor, loaded_weight: torch.Tensor) -> None:
    """Copy a checkpoint tensor into its parameter (vLLM's default loader semantics).

    The first argument must be called `param`: vLLM's layerwise reload rebinds it by name
    when it replays buffered loads onto the materialised layer. The copy goes through
    `copy_`, which is what vLLM's reload counts to know when a layer is fully loaded.
    """
    if param.shape != loaded_weight.shape:
        raise ValueError(
            f"attempted to load weight {tuple(loaded_weight.shape)} into parameter "
            f"{tuple(param.shape)}")
    param.data.copy_(loaded_weight)


def replace_parameter(layer: torch.nn.Module, name: str, new: torch.Tensor | None,
                      prefer_copy: bool = False) -> None:
    """Replace `layer.<name>` during PWAL, with vLLM's `replace_parameter` semantics.

    (`vllm/model_executor/utils.py` in vLLM 0.32; reimplemented, not copied.)

    * `prefer_copy` and an existing parameter of the same shape, dtype and device: copy the
      values into the existing parameter in place (its storage, hence every address a
      captured graph holds, is kept) and carry `new`'s custom attributes over.
    * otherwise: register a fresh `Parameter(new, requires_grad=False)` under `name`,
      carrying `new`'s custom attributes except `weight_loader`, which is taken from the
      parameter it replaces (if any).
    """
    if new is None:
        setattr(layer, name, None)
        return
    old = getattr(layer, name, None)
    attrs = {k: v for k, v in new.__dict__.items() if k not in ("weight_loader", "_weight_loader")}
    data = new.data if isinstance(new, torch.nn.Parameter) else new
    if (prefer_copy and old is not None and old.shape == data.shape
            and old.dtype == data.dtype and old.device == data.device):
        with torch.no_grad():
            old.copy_(data)
        for k, v in attrs.items():
            setattr(old, k, v)
        return
    param = torch.nn.Parameter(data, requires_grad=False)
    for k, v in attrs.items():
        setattr(param, k, v)
    if old is not None and hasattr(old, "weight_loader"):
        param.weight_loader = old.weight_loader
    setattr(layer, name, param)


# --------------------------------------------------------------------------------------
# kernel configuration and the linear method
# --------------------------------------------------------------------------------------

@dataclass
class LayerConfig:
    """What vLLM's `MPLinearLayerConfig` says about one layer (the subset used here)."""

    in_features: int  # K
    out_features: int  # N
    group_size: int
    act_type: torch.dtype = torch.float32
    weight_type: int = UINT4B8
    has_g_idx: bool = True

    def __post_init__(self):
        if self.in_features % self.group_size or self.in_features % PACK_FACTOR:
            raise ValueError(
                f"in_features={self.in_features} must be a multiple of group_size="
                f"{self.group_size} and of {PACK_FACTOR}")


class WNA16ActOrderLinearMethod:
    """The layer's `quant_method`: creates checkpoint-format weights, owns the kernel (a plain
    class: `graphtrace.demo.reload` registers it with vLLM's `QuantizeMethodBase`)."""

    def __init__(self, kernel_cls: type[MPLinearKernelBase], config: LayerConfig):
        self.kernel_cls = kernel_cls
        self.config = config
        self.kernel: MPLinearKernelBase | None = None

    def create_weights(self, layer: torch.nn.Module, device=None) -> None:
        c = self.config
        k, n, g = c.in_features, c.out_features, c.group_size

        def make(shape, dtype):
            p = torch.nn.Parameter(torch.empty(shape, dtype=dtype, device=device),
                                   requires_grad=False)
            p.weight_loader = weight_loader
            return p

        layer.register_parameter("qweight", make((k // PACK_FACTOR, n), torch.int32))
        layer.register_parameter("scales", make((k // g, n), c.act_type))
        layer.register_parameter("g_idx", make((k,), torch.int32))
        self.kernel = self.kernel_cls(c, w_q_param_name="qweight", w_s_param_name="scales",
                                      w_gidx_param_name="g_idx")

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        self.kernel.process_weights_after_loading(layer)

    def apply(self, layer: torch.nn.Module, x: torch.Tensor, bias=None) -> torch.Tensor:
        return self.kernel.apply_weights(layer, x, bias)


# --------------------------------------------------------------------------------------
# kernels
# --------------------------------------------------------------------------------------

class MPLinearKernelBase:
    """Shared machinery of the mixed-precision kernels (vLLM's `MPLinearKernel`)."""

    name = "base"
    #: "partial" (`functools.partial(permute_cols, perm=...)`), "lambda" (`x[:, perm]`),
    #: or "auto" (vLLM's rule: permute_cols for fp16/bf16 activations when K % 8 == 0).
    act_perm_form = "auto"
    #: does the kernel keep the permutation registered on the layer (`g_idx_sort_indices`)?
    registers_perm = False

    def __init__(self, c: LayerConfig, w_q_param_name: str, w_s_param_name: str,
                 w_gidx_param_name: str | None = None):
        self.config = c
        self.w_q_name = w_q_param_name
        self.w_s_name = w_s_param_name
        self.w_gidx_name = w_gidx_param_name

    # -- helpers ------------------------------------------------------------------------
    def _use_permute_cols(self) -> bool:
        if self.act_perm_form == "partial":
            return True
        if self.act_perm_form == "lambda":
            return False
        c = self.config
        return c.act_type in (torch.float16, torch.bfloat16) and c.in_features % 8 == 0

    def _transform_param(self, layer, name, fn) -> None:
        """vLLM's `_transform_param`: re-register `fn(param)` as a plain Parameter."""
        if name is not None and getattr(layer, name, None) is not None:
            new = fn(getattr(layer, name))
            replace_parameter(layer, name, torch.nn.Parameter(new.data, requires_grad=False))

    def _perm_from_g_idx(self, layer) -> torch.Tensor:
        # vLLM: torch.argsort(g_idx).to(torch.int). A stable sort keeps runs reproducible
        # (any ordering that sorts the groups is correct).
        return torch.argsort(getattr(layer, self.w_gidx_name), stable=True).to(torch.int32)

    def _repack_weight(self, layer, perm: torch.Tensor | None) -> None:
        """GPTQ-packed int32 (K//8, N) -> (K, N) int8 holding q - 8, rows permuted by perm.

        The stand-in for `machete_prepack_B` / `gptq_marlin_repack`: a new runtime-format
        tensor re-registered under the same name (PWAL does this on every load).
        """
        def transform(x):
            w = unpack_int4_rows(x.data)
            if perm is not None:
                w = w[perm.long(), :]
            return (w - 8).to(torch.int8).contiguous()

        self._transform_param(layer, self.w_q_name, transform)

    def _transform_scales(self, layer) -> None:
        self._transform_param(layer, self.w_s_name, lambda x: x.data.contiguous())

    def _machete_apply(self, layer, x: torch.Tensor, bias, permute) -> torch.Tensor:
        """The Machete forward, its activations permuted by `permute(x_2d)` (act-order)."""
        c = self.config
        x_2d = x.reshape(-1, x.shape[-1])
        if c.has_g_idx:
            x_2d = permute(x_2d)
        out = ops.machete_mm(x_2d, getattr(layer, self.w_q_name), c.weight_type, None,
                             getattr(layer, self.w_s_name), None, c.group_size,
                             None, None, None)
        if bias is not None:
            out = out + bias
        return out.reshape(*x.shape[:-1], c.out_features)

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        """The Machete kernels' PWAL: sort by `g_idx` (kept as `_keep_perm` says), repack the
        weight with the permuted rows, re-register the scales."""
        perm = None
        if self.config.has_g_idx:
            perm = self._perm_from_g_idx(layer)
            self._keep_perm(layer, perm)
        self._repack_weight(layer, perm)
        self._transform_scales(layer)

    def _keep_perm(self, layer, perm: torch.Tensor) -> None:
        """Where a kernel keeps the act-order permutation for its forward: the variants differ
        only here."""
        raise NotImplementedError

    def _bind_act_perm(self, perm: torch.Tensor) -> None:
        """`self.act_perm`: a `partial(permute_cols, perm=perm)` or a lambda closing over perm."""
        if self._use_permute_cols():
            self.act_perm = functools.partial(ops.permute_cols, perm=perm)
        else:
            self.act_perm = lambda x: x[:, perm]

    def apply_weights(self, layer, x, bias=None) -> torch.Tensor:
        raise NotImplementedError

    # -- introspection used by the demo runner and tests ---------------------------------
    def live_perm(self, layer) -> torch.Tensor | None:
        """The permutation tensor an eager forward would read right now."""
        return _perm_in_callable(getattr(self, "act_perm", None))

    def registered_perm(self, layer) -> torch.Tensor | None:
        """`layer.g_idx_sort_indices` when it is a registered parameter or buffer."""
        name = "g_idx_sort_indices"
        return layer._parameters.get(name) if name in layer._parameters else layer._buffers.get(name)


def _perm_in_callable(fn) -> torch.Tensor | None:
    """The tensor a `partial(..., perm=...)` or a closure holds (the seed probe's census)."""
    if fn is None:
        return None
    kw = getattr(fn, "keywords", None)
    if kw and isinstance(kw.get("perm"), torch.Tensor):
        return kw["perm"]
    for cell in getattr(fn, "__closure__", None) or ():
        try:
            v = cell.cell_contents
        except ValueError:  # empty cell
            continue
        if isinstance(v, torch.Tensor):
            return v
    return None


class MacheteUnfixedKernel(MPLinearKernelBase):
    """vLLM's `MacheteLinearKernel` before the fix: perm bound into `self.act_perm`."""

    name = "unfixed"

    def _keep_perm(self, layer, perm):
        self._bind_act_perm(perm)

    def apply_weights(self, layer, x, bias=None):
        return self._machete_apply(layer, x, bias, lambda x_2d: self.act_perm(x_2d))


class MacheteUnfixedPartialKernel(MacheteUnfixedKernel):
    name = "unfixed-partial"
    act_perm_form = "partial"


class MacheteUnfixedLambdaKernel(MacheteUnfixedKernel):
    name = "unfixed-lambda"
    act_perm_form = "lambda"


class MacheteRejectedFixKernel(MacheteUnfixedKernel):
    """The seed's first fix: perm registered (prefer_copy), but bound into act_perm at PWAL.

    During a reload PWAL runs on the restored construction-time tensor set, so the
    parameter it registers is a transient one; the reload then copies its values into the
    parameter registered before the reload and puts that one back. `act_perm` keeps the
    transient tensor: registered owner and callable disagree (`diverged`).
    """

    name = "rejected-fix"
    act_perm_form = "partial"
    registers_perm = True

    def _keep_perm(self, layer, perm):
        replace_parameter(layer, "g_idx_sort_indices", perm, prefer_copy=True)
        self._bind_act_perm(layer.g_idx_sort_indices)


class MacheteFixedKernel(MPLinearKernelBase):
    """The merged fix: perm registered (prefer_copy) and resolved through the layer at
    apply time; only a bool (`use_permute_cols`) is kept from PWAL."""

    name = "fixed"
    act_perm_form = "partial"
    registers_perm = True

    def _keep_perm(self, layer, perm):
        replace_parameter(layer, "g_idx_sort_indices", perm, prefer_copy=True)
        self.use_permute_cols = self._use_permute_cols()

    def apply_weights(self, layer, x, bias=None):
        def permute(x_2d):  # through the layer, at apply time
            perm = layer.g_idx_sort_indices
            return ops.permute_cols(x_2d, perm) if self.use_permute_cols else x_2d[:, perm]

        return self._machete_apply(layer, x, bias, permute)

    def live_perm(self, layer):
        return layer.g_idx_sort_indices


class MarlinStyleKernel(MPLinearKernelBase):
    """vLLM's `MarlinLinearKernel` act-order path before its fix.

    PWAL allocates `self.workspace` (Marlin's zeroed lock buffer) and sets
    `layer.g_idx_sort_indices` as a plain tensor attribute (not registered); `g_idx` is
    re-registered sorted. The forward passes all of them to `gptq_marlin_gemm`, which
    permutes the activations itself.
    """

    name = "marlin"
    workspace_size = 64

    def process_weights_after_loading(self, layer):
        c = self.config
        device = getattr(layer, self.w_q_name).device
        n_ws = self.workspace_size
        if device.type == "cuda":
            n_ws = torch.cuda.get_device_properties(device).multi_processor_count
        self.workspace = torch.zeros(n_ws, dtype=torch.int32, device=device)
        perm = None
        if c.has_g_idx:
            g_idx = getattr(layer, self.w_gidx_name)
            perm = torch.argsort(g_idx, stable=True).to(torch.int32)
            sorted_g_idx = g_idx[perm.long()].contiguous()
            self._transform_param(layer, self.w_gidx_name, lambda _: sorted_g_idx)
            layer.g_idx_sort_indices = perm  # plain attribute: nn.Module does not register it
        else:
            empty = torch.empty(0, dtype=torch.int32, device=device)
            setattr(layer, self.w_gidx_name, torch.nn.Parameter(empty, requires_grad=False))
            layer.g_idx_sort_indices = empty
        self._repack_weight(layer, perm)
        self._transform_scales(layer)

    def apply_weights(self, layer, x, bias=None):
        c = self.config
        x_2d = x.reshape(-1, x.shape[-1])
        out = ops.gptq_marlin_gemm(
            x_2d, None, getattr(layer, self.w_q_name), bias, getattr(layer, self.w_s_name),
            None, None, getattr(layer, self.w_gidx_name), layer.g_idx_sort_indices,
            self.live_workspace(layer), c.weight_type, x_2d.shape[0], c.out_features,
            c.in_features, True, False, False, False)
        return out.reshape(*x.shape[:-1], c.out_features)

    def live_workspace(self, layer) -> torch.Tensor:
        """The workspace the forward passes to `gptq_marlin_gemm` (here: the kernel's own)."""
        return self.workspace

    def live_perm(self, layer):
        return layer.__dict__.get("g_idx_sort_indices")


#: variant name -> kernel class (the `--variant` choices of `graphtrace demo`)
KERNELS: dict[str, type[MPLinearKernelBase]] = {
    "unfixed-partial": MacheteUnfixedPartialKernel,
    "unfixed-lambda": MacheteUnfixedLambdaKernel,
    "rejected-fix": MacheteRejectedFixKernel,
    "fixed": MacheteFixedKernel,
    "marlin": MarlinStyleKernel,
}
VARIANTS = tuple(KERNELS)


def dequantize_reference(qweight_packed: torch.Tensor, scales: torch.Tensor,
                         g_idx: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    """The unpermuted dequantised (K, N) weight of a checkpoint-format layer."""
    q = unpack_int4_rows(qweight_packed).to(dtype) - 8
    return q * scales.to(dtype).index_select(0, g_idx.long())
