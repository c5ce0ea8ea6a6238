"""vLLM #48438: Marlin's `workspace` on the kernel object and unregistered `g_idx_sort_indices`.

Real code: `vllm/model_executor/layers/quantization/kernels/mixed_precision/marlin.py`,
`MarlinLinearKernel.process_weights_after_loading` (before #48438) allocated
`self.workspace = marlin_make_workspace_new(device)` on the kernel object and set
`layer.g_idx_sort_indices` as a plain tensor attribute (`nn.Module` does not register a
plain tensor), both made fresh on every process-weights run; `apply_weights` passed both to
`gptq_marlin_gemm` (`workspace`, `perm_or_none`). vLLM's layerwise reload refreshes only
registered parameters and buffers, so both holders move while graphs read the old tensors.
The sorted `g_idx` itself is re-registered (`_transform_param`), so its read is `stable`.

The fix (#48438, a storage-preserving helper applied at eight sites) keeps both tensors in
storages registered on the layer and refreshed in place (`replace_parameter(...,
prefer_copy=True)`): variant `fixed` (a kernel class of this module; the seed demo runs
only the buggy `marlin` variant).

The workspace is zeroed on every run, so its stale read is `latent` (same values, old
storage); the sort indices change with the act order (`manifest`).
"""

from __future__ import annotations

from ..kernels import MarlinStyleKernel, replace_parameter
from .spec import Case, buggy_and_fixed

__all__ = [
    "LAYER", "BATCH_SIZES", "N_LAYERS", "MarlinFixedKernel", "VARIANT_KERNELS", "run", "CASE"
]

LAYER = "layers.*.mlp.down_proj"
BATCH_SIZES = (1, 2)
N_LAYERS = 2


class MarlinFixedKernel(MarlinStyleKernel):
    """#48438's fix: workspace and sort indices registered on the layer (prefer_copy),
    read through the layer at apply time."""

    name = "marlin-fixed"
    registers_perm = True

    def process_weights_after_loading(self, layer):
        super().process_weights_after_loading(layer)
        replace_parameter(layer, "workspace", self.__dict__.pop("workspace"), prefer_copy=True)
        perm = layer.__dict__.pop("g_idx_sort_indices")
        replace_parameter(layer, "g_idx_sort_indices", perm, prefer_copy=True)

    def live_workspace(self, layer):
        return layer.workspace

    def live_perm(self, layer):
        return layer.g_idx_sort_indices


VARIANT_KERNELS = {"marlin": "marlin", "fixed": MarlinFixedKernel}


def run(variant: str, backend: str = "auto"):
    from ..model import DemoModel
    from .harness import capture_reload_diff, reload_layerwise
    from .vllm_48539_machete_act_perm import flip_live_perm

    model = DemoModel(VARIANT_KERNELS[variant], n_layers=N_LAYERS, seed=0,
                      reload_backend=backend)
    return capture_reload_diff(
        model, [(f"bs{b}", model.make_input(b)) for b in BATCH_SIZES],
        lambda m: reload_layerwise(m, m.make_checkpoint(1, 2), backend=backend),
        perturb=flip_live_perm)


CASE = Case(
    name="vllm-48438-marlin",
    reference="vLLM #48438",
    source="vllm/model_executor/layers/quantization/kernels/mixed_precision/marlin.py: "
           "MarlinLinearKernel",
    rebound="`workspace` (an attribute of the kernel object) and `g_idx_sort_indices` (a plain, "
            "unregistered tensor attribute of the layer), both remade by every PWAL",
    fix="storage-preserving helper: register both on the layer, copy in place on reload",
    reload="vllm-layerwise",
    variants=buggy_and_fixed(
        "workspace on the kernel, sort indices a plain attribute",
        "both registered on the layer (prefer_copy)",
        {f"{LAYER}.quant_method.kernel.workspace": "stale",
         f"{LAYER}.g_idx_sort_indices": "stale",
         f"{LAYER}.g_idx": "stable"},
        [f"{LAYER}.workspace", f"{LAYER}.g_idx_sort_indices", f"{LAYER}.g_idx"],
        buggy_name="marlin"),
    run=run,
)
