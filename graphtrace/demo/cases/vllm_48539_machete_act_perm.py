"""vLLM #48539 (RFC #48312's seed): Machete's act-order permutation held in `kernel.act_perm`.

Real code: `vllm/model_executor/layers/quantization/kernels/mixed_precision/machete.py`,
`MacheteLinearKernel.process_weights_after_loading` (vLLM before 0.32 removed GPTQ
act-order) stored `self.act_perm = partial(ops.permute_cols, perm=perm)` (fp16/bf16) or
`lambda x: x[:, perm]`, with `perm = torch.argsort(g_idx)` made fresh on every
process-weights run. vLLM's layerwise reload copies new values only into the parameters and
buffers registered before the reload, so after it the kernel's partial/closure holds a new
`perm` while captured graphs read the capture-time one.

The variants are the seed demo's kernels (`graphtrace.demo.kernels`, whose docstring and
`MacheteRejectedFixKernel` say what each keeps; also run by `graphtrace demo`).
"""

from __future__ import annotations

from .spec import Case, Expect, Variant

__all__ = ["KERNEL", "BATCH_SIZES", "N_LAYERS", "run", "flip_live_perm", "CASE"]

KERNEL = "layers.*.mlp.down_proj.quant_method.kernel"
BATCH_SIZES = (1, 2)
N_LAYERS = 2


def run(variant: str, backend: str = "auto"):
    from ..model import DemoModel
    from .harness import capture_reload_diff, reload_layerwise

    model = DemoModel(variant, n_layers=N_LAYERS, seed=0, reload_backend=backend)
    return capture_reload_diff(
        model, [(f"bs{b}", model.make_input(b)) for b in BATCH_SIZES],
        lambda m: reload_layerwise(m, m.make_checkpoint(1, 2), backend=backend),
        perturb=flip_live_perm)


def flip_live_perm(model) -> str:
    for _, layer in model.quant_layers():
        perm = layer.quant_method.kernel.live_perm(layer)
        perm.copy_(perm.flip(0))
    return "the permutation an eager forward reads, reversed in place"


CASE = Case(
    name="vllm-48539-machete-act-perm",
    reference="vLLM #48539 (RFC #48312)",
    source="vllm/model_executor/layers/quantization/kernels/mixed_precision/machete.py: "
           "MacheteLinearKernel",
    rebound="`perm = argsort(g_idx)`, held by `kernel.act_perm` (a `partial` keyword or a "
            "lambda closure)",
    fix="register `g_idx_sort_indices` (prefer_copy) and read it through the layer at apply",
    reload="vllm-layerwise",
    variants=(
        Variant("unfixed-partial", "buggy", "act_perm = partial(permute_cols, perm=perm)",
                (Expect(f"{KERNEL}.act_perm.keywords['perm']", "stale"),), flip="frozen"),
        Variant("unfixed-lambda", "buggy", "act_perm = lambda x: x[:, perm]",
                (Expect(f"{KERNEL}.act_perm.__closure__['perm']", "stale"),), flip="frozen"),
        Variant("rejected-fix", "buggy",
                "perm registered (prefer_copy) but also bound into act_perm at PWAL",
                (Expect(f"{KERNEL}.act_perm.keywords['perm']", "diverged"),
                 Expect("layers.*.mlp.down_proj.g_idx_sort_indices", "diverged")),
                flip="frozen"),
        Variant("fixed", "fixed", "registered g_idx_sort_indices read at apply time",
                (Expect("layers.*.mlp.down_proj.g_idx_sort_indices", "stable"),
                 Expect("layers.*.mlp.down_proj.qweight", "stable")), flip="follows"),
    ),
    run=run,
)
