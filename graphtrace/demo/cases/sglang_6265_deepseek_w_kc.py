"""SGLang #4961 / #6265: DeepSeek's absorbed `w_kc` / `w_vc` recreated by `post_load_weights`.

Real code: `python/sglang/srt/models/deepseek_v2.py`: `DeepseekV2AttentionMLA` holds
`self.w_kc` / `self.w_vc` (plain attributes, `None` at construction);
`DeepseekV2ForCausalLM.post_load_weights` splits `self_attn.kv_b_proj.weight` into them
(`w_kc, w_vc = w.unflatten(0, (-1, qk_nope_head_dim + v_head_dim)).split(...)`) and assigns
`self_attn.w_kc = w_kc.transpose(1, 2).contiguous().transpose(1, 2)`,
`self_attn.w_vc = w_vc.contiguous().transpose(1, 2)`: new tensors on every call. SGLang's
weight updates (`update_weights_from_tensor` / `_from_distributed`) call `load_weights`,
which copies into the live parameters and then runs `post_load_weights` again, so the
captured graphs kept the old `w_kc` / `w_vc` (#4961 reported it; #6265 merged the fix:
`copy_` into the existing tensors when they exist).
"""

from __future__ import annotations

import torch

from .harness import CaseModel, make_param
from .spec import Case, buggy_and_fixed

__all__ = [
    "WIDTH", "BATCH_SIZES", "DeepseekV2AttentionMLA", "DeepseekLayer",
    "DeepseekV2ForCausalLM", "update_weights", "run", "CASE"
]

N_HEADS, HEAD_DIM, KV_LORA_RANK = 2, 8, 4
WIDTH = N_HEADS * HEAD_DIM
BATCH_SIZES = (1, 2)


class DeepseekV2AttentionMLA(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.kv_b_proj = torch.nn.Module()
        self.kv_b_proj.weight = make_param((N_HEADS * 2 * HEAD_DIM, KV_LORA_RANK))
        self.w_kc = None
        self.w_vc = None

    def forward(self, x):  # absorbed decode: q @ w_kc, then @ w_vc
        q = x.view(x.shape[0], N_HEADS, HEAD_DIM).transpose(0, 1)  # (N, B, P)
        latent = torch.bmm(q, self.w_kc)  # (N, B, L)
        out = torch.bmm(latent, self.w_vc)  # (N, B, V)
        return out.transpose(0, 1).reshape(x.shape[0], WIDTH)


class DeepseekLayer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.self_attn = DeepseekV2AttentionMLA()

    def forward(self, x):
        return x + self.self_attn(x)


class DeepseekV2ForCausalLM(CaseModel):
    def __init__(self, copy_on_update: bool, n_layers: int = 2):
        super().__init__()
        self.copy_on_update = copy_on_update
        self.layers = torch.nn.ModuleList(DeepseekLayer() for _ in range(n_layers))

    def load_weights(self, weights):
        loaded = super().load_weights(weights)
        self.post_load_weights()  # SGLang: at the end of every load_weights
        return loaded

    def post_load_weights(self):
        for layer in self.layers:
            attn = layer.self_attn
            w = attn.kv_b_proj.weight
            w_kc, w_vc = w.unflatten(0, (-1, 2 * HEAD_DIM)).split([HEAD_DIM, HEAD_DIM], dim=1)
            w_kc = w_kc.transpose(1, 2).contiguous().transpose(1, 2)  # (N, P, L)
            w_vc = w_vc.contiguous().transpose(1, 2)  # (N, L, V)
            if self.copy_on_update and attn.w_kc is not None:
                attn.w_kc.copy_(w_kc)  # #6265
                attn.w_vc.copy_(w_vc)
            else:
                attn.w_kc = w_kc
                attn.w_vc = w_vc

    def checkpoint(self, seed):
        g = torch.Generator().manual_seed(seed)
        return {f"layers.{i}.self_attn.kv_b_proj.weight":
                torch.randn(N_HEADS * 2 * HEAD_DIM, KV_LORA_RANK, generator=g) / 2
                for i in range(len(self.layers))}


def update_weights(model: DeepseekV2ForCausalLM, weights) -> str:
    """SGLang's `update_weights_from_tensor`: `load_weights` (+ `post_load_weights`)."""
    with torch.no_grad():
        model.load_weights(weights)
    return "sglang-update"


def run(variant: str, backend: str = "auto"):
    from .harness import capture_reload_diff

    model = DeepseekV2ForCausalLM(copy_on_update=variant == "fixed")
    with torch.no_grad():
        model.load_weights(model.checkpoint(0))
    g = torch.Generator().manual_seed(5)
    inputs = [(f"bs{b}", torch.randn(b, WIDTH, generator=g)) for b in BATCH_SIZES]

    def perturb(m):
        for layer in m.layers:
            layer.self_attn.w_kc.add_(1.0)
            layer.self_attn.w_vc.add_(1.0)
        return "the live w_kc / w_vc, +1 in place"

    return capture_reload_diff(model, inputs, lambda m: update_weights(m, m.checkpoint(1)),
                               perturb)


CASE = Case(
    name="sglang-6265-deepseek-w-kc",
    reference="SGLang #4961 → #6265",
    source="python/sglang/srt/models/deepseek_v2.py: DeepseekV2ForCausalLM.post_load_weights",
    rebound="`self_attn.w_kc` / `w_vc` (plain attributes) recreated by every "
            "`post_load_weights`",
    fix="`copy_` into the existing `w_kc` / `w_vc`",
    reload="sglang-update",
    variants=buggy_and_fixed(
        "w_kc / w_vc reassigned on every post_load_weights",
        "copied into the existing tensors (#6265)",
        {"layers.*.self_attn.w_kc": "stale", "layers.*.self_attn.w_vc": "stale"}),
    run=run,
)
