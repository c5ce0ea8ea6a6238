"""A tiny fused-MoE layer shared by the MoE cases, named like vLLM's.

`layers.<i>.mlp.gate.weight` routes tokens (top-2 of `E` experts); `layers.<i>.mlp.experts`
is the `FusedMoE` layer: `w13_weight` (E, 2I, H) and `w2_weight` (E, H, I), created by its
`quant_method.create_weights`, processed by `quant_method.process_weights_after_loading`
and run by `quant_method.apply`. Two custom ops carry the real kernels' tensor arguments
(CUTLASS FP8 MoE's strides, FlashInfer's SwiGLU constants), with small reference bodies, so
the recorder sees every tensor the real kernel reads.

`run_case` is what every MoE case runs: load, capture, reload (in place or layerwise),
diff, flip; each case's fix is one switch of its quant method, on for the "fixed" variant.
`refit_case` is the whole case of a method that rebinds the expert weights on a refit.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..ops import NAMESPACE
from .harness import CaseModel, capture_reload_diff, make_param, reload_inplace, reload_layerwise
from .spec import Case, Outcome, buggy_and_fixed

__all__ = ["EXPERTS", "dense_moe", "silu_and_mul", "FusedMoEMethodBase", "UnquantizedMoEMethod",
           "FusedMoE", "MoEBlock", "Layer", "MoEModel", "negate_live_w13", "run_case",
           "refit_case"]

E, H, I, TOPK = 4, 16, 8, 2
EXPERTS = "layers.*.mlp.experts"  # the owner pattern of every layer's FusedMoE

_lib = torch.library.Library(NAMESPACE, "FRAGMENT")
_lib.define(
    "cutlass_moe_fp8(Tensor a, Tensor w1_q, Tensor w2_q, Tensor w1_scale, Tensor w2_scale, "
    "Tensor topk_weights, Tensor topk_ids, Tensor ab_strides1, Tensor ab_strides2, "
    "Tensor c_strides1, Tensor c_strides2) -> Tensor")
_lib.define(
    "flashinfer_cutlass_fused_moe(Tensor input, Tensor token_selected_experts, "
    "Tensor token_final_scales, Tensor fc1_expert_weights, Tensor fc2_expert_weights, "
    "Tensor? swiglu_alpha, Tensor? swiglu_beta, Tensor? swiglu_limit) -> Tensor")


def dense_moe(x, w13, w2, topk_weights, topk_ids, act) -> torch.Tensor:
    """Reference MoE: sum over the chosen experts of weight * w2[e] @ act(w13[e] @ x)."""
    out = torch.zeros(x.shape[0], w2.shape[1], dtype=x.dtype)
    for e in range(w13.shape[0]):
        gate = ((topk_ids == e).to(x.dtype) * topk_weights).sum(-1, keepdim=True)
        h = x @ w13[e].to(x.dtype).T
        out = out + gate * (act(e, h) @ w2[e].to(x.dtype).T)
    return out


def silu_and_mul(e, h):
    g, u = h.chunk(2, dim=-1)
    return F.silu(g) * u


def _cutlass_moe_fp8(a, w1_q, w2_q, w1_scale, w2_scale, topk_weights, topk_ids,
                     ab_strides1, ab_strides2, c_strides1, c_strides2):
    k, n = w1_q.shape[2], w1_q.shape[1]
    if not (bool((ab_strides1 == k).all()) and bool((c_strides1 == n).all())
            and bool((ab_strides2 == w2_q.shape[2]).all())
            and bool((c_strides2 == w2_q.shape[1]).all())):
        raise RuntimeError("cutlass_moe_fp8: stride tensors do not match the weights")
    w1 = w1_q.to(a.dtype) * w1_scale.view(-1, 1, 1)
    w2 = w2_q.to(a.dtype) * w2_scale.view(-1, 1, 1)
    return dense_moe(a, w1, w2, topk_weights, topk_ids, silu_and_mul)


def _flashinfer_cutlass_fused_moe(input, token_selected_experts, token_final_scales,
                                  fc1_expert_weights, fc2_expert_weights, swiglu_alpha,
                                  swiglu_beta, swiglu_limit):
    def swiglu_oai(e, h):  # gpt-oss SwiGLU: clamp, gate * sigmoid(alpha * gate) * (up + beta)
        g, u = h.chunk(2, dim=-1)
        g = g.clamp(max=swiglu_limit[e])
        u = u.clamp(min=-swiglu_limit[e], max=swiglu_limit[e])
        return g * torch.sigmoid(swiglu_alpha[e] * g) * (u + swiglu_beta[e])

    return dense_moe(input, fc1_expert_weights, fc2_expert_weights, token_final_scales,
                     token_selected_experts, swiglu_oai)


def _meta(a, *rest):
    return a.new_empty(a.shape)


for _key in ("CPU", "CUDA"):
    _lib.impl("cutlass_moe_fp8", _cutlass_moe_fp8, _key)
    _lib.impl("flashinfer_cutlass_fused_moe", _flashinfer_cutlass_fused_moe, _key)
_lib.impl("cutlass_moe_fp8", _meta, "Meta")
_lib.impl("flashinfer_cutlass_fused_moe", _meta, "Meta")

cutlass_moe_fp8 = torch.ops.graphtrace.cutlass_moe_fp8
flashinfer_cutlass_fused_moe = torch.ops.graphtrace.flashinfer_cutlass_fused_moe


class FusedMoEMethodBase:
    """What the cases' quant methods share: `create_weights` makes the checkpoint-format
    `w13_weight` (E, 2I, H) and `w2_weight` (E, H, I) in `weight_dtype`."""

    weight_dtype = torch.float32

    def create_weights(self, layer):
        layer.w13_weight = make_param((E, 2 * I, H), self.weight_dtype)
        layer.w2_weight = make_param((E, H, I), self.weight_dtype)


class UnquantizedMoEMethod(FusedMoEMethodBase):
    """vLLM's `UnquantizedFusedMoEMethod.apply`: the experts (SiLU-and-mul) on the live
    `w13_weight` / `w2_weight`. The unquantized cases differ in its process-weights step."""

    def apply(self, layer, x, topk_weights, topk_ids):
        return dense_moe(x, layer.w13_weight, layer.w2_weight, topk_weights, topk_ids,
                         silu_and_mul)


class FusedMoE(torch.nn.Module):
    """vLLM's `FusedMoE` layer: weights created and used by its `quant_method`."""

    def __init__(self, quant_method):
        super().__init__()
        self.quant_method = quant_method
        quant_method.create_weights(self)

    def forward(self, x, topk_weights, topk_ids):
        return self.quant_method.apply(self, x, topk_weights, topk_ids)


class MoEBlock(torch.nn.Module):
    def __init__(self, quant_method):
        super().__init__()
        self.gate = torch.nn.Module()
        self.gate.weight = make_param((E, H))
        self.experts = FusedMoE(quant_method)

    def forward(self, x):
        logits = x @ self.gate.weight.T
        topk_weights, topk_ids = torch.topk(torch.softmax(logits, dim=-1), TOPK, dim=-1)
        return x + self.experts(x, topk_weights, topk_ids)


class Layer(torch.nn.Module):
    def __init__(self, quant_method):
        super().__init__()
        self.mlp = MoEBlock(quant_method)

    def forward(self, x):
        return self.mlp(x)


class MoEModel(CaseModel):
    """`n_layers` MoE blocks, one quant method instance per layer (`make_method()`)."""

    def __init__(self, make_method, n_layers: int = 2, backend: str | None = "auto"):
        super().__init__()
        self.layers = torch.nn.ModuleList(Layer(make_method()) for _ in range(n_layers))
        # the checkpoint's tensors: the construction-time parameters, before any processing
        self.checkpoint_params = {n: (tuple(p.shape), p.dtype)
                                  for n, p in self.named_parameters()}
        self.reload_backend = None
        if backend is not None:  # the layerwise reload records the construction-time set
            from ..reload import record_metadata

            self.reload_backend = record_metadata(self, backend=backend)

    def experts(self) -> list[FusedMoE]:
        return [layer.mlp.experts for layer in self.layers]

    def checkpoint(self, seed: int) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(seed)
        ckpt = {}
        for name, (shape, dtype) in self.checkpoint_params.items():
            if dtype.is_floating_point and dtype.itemsize == 1:  # fp8
                t = torch.randn(shape, generator=g) * 2
            elif name.endswith("scale"):
                t = 0.05 + 0.05 * torch.rand(shape, generator=g)
            elif name.endswith("gate.weight"):
                t = torch.randn(shape, generator=g)
            else:
                t = torch.randn(shape, generator=g) / H ** 0.5
            ckpt[name] = t.to(dtype)
        return ckpt

    @staticmethod
    def inputs(batch_sizes=(1, 2), seed: int = 3):
        g = torch.Generator().manual_seed(seed)
        return [(f"bs{b}", torch.randn(b, H, generator=g)) for b in batch_sizes]


def negate_live_w13(model: MoEModel) -> str:
    """The flip test of the unquantized cases: the live `w13_weight`, negated in place."""
    for experts in model.experts():
        experts.w13_weight.neg_()
    return "the live w13_weight, negated in place"


def run_case(make_method, variant: str, reload: str, perturb, backend: str = "auto") -> Outcome:
    """One variant of a MoE case: layers of `make_method(variant == "fixed")`, reloaded by
    `reload` ("vllm-inplace" or "vllm-layerwise", a key of `spec.RELOADS`)."""
    fixed = variant == "fixed"
    if reload == "vllm-inplace":
        model = MoEModel(lambda: make_method(fixed), backend=None)

        def do_reload(m):
            return reload_inplace(m, m.checkpoint(1))
    elif reload == "vllm-layerwise":
        model = MoEModel(lambda: make_method(fixed), backend=backend)

        def do_reload(m):
            return reload_layerwise(m, m.checkpoint(1), backend=backend)
    else:
        raise ValueError(f"MoE cases reload 'vllm-inplace' or 'vllm-layerwise', not {reload!r}")
    model.load(model.checkpoint(0))
    return capture_reload_diff(model, model.inputs(), do_reload, perturb)


def refit_case(make_method, *, buggy: str, fixed: str, **about) -> Case:
    """The case of an unquantized MoE method whose process step gives `w13_weight` and
    `w2_weight` new storages on an in-place refit (`about`: the `Case` fields that tell which
    bug)."""
    def run(variant: str, backend: str = "auto") -> Outcome:
        return run_case(make_method, variant, "vllm-inplace", negate_live_w13)

    rebound = {f"{EXPERTS}.w13_weight": "stale", f"{EXPERTS}.w2_weight": "stale"}
    return Case(reload="vllm-inplace", variants=buggy_and_fixed(buggy, fixed, rebound), run=run,
                **about)
