"""vLLM #48251: MLA's absorbed `W_UV` / `W_UK_T` reassigned by process-weights, and gpt-oss
attention sinks kept as a detached `.to(torch.float32)` copy.

Real code: `vllm/model_executor/layers/attention/mla_attention.py`,
`MLAAttention.process_weights_after_loading(act_dtype)`: `split_kv_b_proj` dequantizes
`kv_b_proj` (`get_and_maybe_dequant_weights`; a new tensor for the FP8 checkpoints DeepSeek
ships) and, before #48251, stored `self.W_UV = W_UV.transpose(0, 1)` and
`self.W_UK_T = W_UK.permute(1, 2, 0)`: plain attributes remade by every run. The fix (in
vLLM 0.32) is `replace_parameter(self, "W_UV", ..., prefer_copy=True)` (same for `W_UK_T`):
registered once, copied in place afterwards. gpt-oss (`vllm/model_executor/models/gpt_oss.py`,
`OAIAttention.sinks`) hands its `sinks` parameter to the attention backend, which kept
`sinks.to(torch.float32)`: a detached copy remade on every process run; the fix refreshes
that copy in place.

Attention layers are processed last in vLLM's reload (`_finalize_attention_layer`: the
kernel tensors are put back, then `layer.process_weights_after_loading(dtype)` runs on the
live layer). This case runs the layerwise reload for the loaded layers (`kv_b_proj`,
`sinks`), then the attention layers' process step on the live layers, as that step does.
With an unquantized `kv_b_proj` the absorbed weights would be views of its weight, which
the reload keeps: the bug needs the dequantized copy, hence the FP8-style `kv_b_proj` here.
"""

from __future__ import annotations

import torch

from .harness import CaseModel, make_param, replace_parameter
from .spec import Case, buggy_and_fixed

__all__ = [
    "WIDTH", "BATCH_SIZES", "KVBProj", "split_kv_b_proj", "MLAAttention", "SinkAttentionImpl",
    "Attention", "OAIAttention", "Block", "MLAModel", "run", "CASE"
]

N_HEADS, HEAD_DIM, KV_LORA_RANK = 2, 8, 4  # N, P (= V), L
WIDTH = N_HEADS * HEAD_DIM
BATCH_SIZES = (1, 2)


class KVBProj(torch.nn.Module):
    """FP8-style `kv_b_proj`: int8 weight (N*(P+V), L) and a per-output-channel scale."""

    def __init__(self):
        super().__init__()
        self.weight = make_param((N_HEADS * 2 * HEAD_DIM, KV_LORA_RANK), torch.int8)
        self.weight_scale = make_param((N_HEADS * 2 * HEAD_DIM,), torch.float32)


def split_kv_b_proj(kv_b_proj: KVBProj) -> tuple[torch.Tensor, torch.Tensor]:
    """`W_UK` (L, N, P) and `W_UV` (L, N, V), views of one dequantized tensor (vLLM's)."""
    weight = (kv_b_proj.weight.to(torch.float32) * kv_b_proj.weight_scale[:, None]).T
    weight = weight.view(KV_LORA_RANK, N_HEADS, 2 * HEAD_DIM)
    return weight.split([HEAD_DIM, HEAD_DIM], dim=-1)


class MLAAttention(torch.nn.Module):
    def __init__(self, fixed: bool):
        super().__init__()
        self.fixed = fixed
        self.kv_b_proj = KVBProj()

    def process_weights_after_loading(self, act_dtype=torch.float32):
        W_UK, W_UV = split_kv_b_proj(self.kv_b_proj)
        if self.fixed:
            replace_parameter(self, "W_UV", W_UV.transpose(0, 1), prefer_copy=True)
            replace_parameter(self, "W_UK_T", W_UK.permute(1, 2, 0), prefer_copy=True)
        else:
            self.W_UV = W_UV.transpose(0, 1)  # (N, L, V)
            self.W_UK_T = W_UK.permute(1, 2, 0)  # (N, P, L)

    def forward(self, x):  # decode: absorb W_UK into q, W_UV into the output
        q_nope = x.view(x.shape[0], N_HEADS, HEAD_DIM).transpose(0, 1)  # (N, B, P)
        ql_nope = torch.bmm(q_nope, self.W_UK_T)  # (N, B, L): stands in for the latent attn
        out = torch.bmm(ql_nope, self.W_UV)  # (N, B, V)
        return out.transpose(0, 1).reshape(x.shape[0], WIDTH)


class SinkAttentionImpl:
    """The attention backend object: keeps the sinks as fp32."""

    sinks: torch.Tensor | None = None


class Attention(torch.nn.Module):
    """vLLM's `Attention` layer (no weights of its own here); `impl` is the backend."""

    def __init__(self):
        super().__init__()
        self.impl = SinkAttentionImpl()

    def forward(self, out):  # (B, N, V): the sink's share of the softmax, per head
        return out * torch.sigmoid(-self.impl.sinks)[None, :, None]


class OAIAttention(torch.nn.Module):
    """gpt-oss attention: `sinks` is a checkpoint parameter (bf16), handed to `attn`."""

    def __init__(self, fixed: bool):
        super().__init__()
        self.fixed = fixed
        self.sinks = make_param((N_HEADS,), torch.bfloat16)
        self.attn = Attention()

    def process_weights_after_loading(self, act_dtype=torch.float32):
        impl = self.attn.impl
        if self.fixed and impl.sinks is not None:
            impl.sinks.copy_(self.sinks)  # refreshed in place
        else:
            impl.sinks = self.sinks.to(torch.float32)  # a detached copy, remade every run

    def forward(self, x):
        return self.attn(x.view(x.shape[0], N_HEADS, HEAD_DIM)).reshape(x.shape[0], WIDTH)


class Block(torch.nn.Module):
    def __init__(self, fixed):
        super().__init__()
        self.self_attn = MLAAttention(fixed)
        self.sink_attn = OAIAttention(fixed)

    def forward(self, x):
        return x + self.sink_attn(self.self_attn(x))


class MLAModel(CaseModel):
    def __init__(self, fixed: bool, n_layers: int = 2, backend: str = "auto"):
        super().__init__()
        self.layers = torch.nn.ModuleList(Block(fixed) for _ in range(n_layers))
        from ..reload import record_metadata

        self.reload_backend = record_metadata(self, backend=backend)

    def attention_layers(self):
        return [m for m in self.modules() if isinstance(m, (MLAAttention, OAIAttention))]

    def process_weights_after_loading(self):
        for m in self.attention_layers():
            m.process_weights_after_loading(torch.float32)

    def checkpoint(self, seed: int) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(seed)
        ckpt = {}
        for i in range(len(self.layers)):
            p = f"layers.{i}"
            ckpt[f"{p}.self_attn.kv_b_proj.weight"] = torch.randint(
                -100, 100, (N_HEADS * 2 * HEAD_DIM, KV_LORA_RANK), generator=g).to(torch.int8)
            ckpt[f"{p}.self_attn.kv_b_proj.weight_scale"] = 0.01 + 0.01 * torch.rand(
                N_HEADS * 2 * HEAD_DIM, generator=g)
            ckpt[f"{p}.sink_attn.sinks"] = torch.randn(N_HEADS, generator=g).to(torch.bfloat16)
        return ckpt


def run(variant: str, backend: str = "auto"):
    from .harness import capture_reload_diff, reload_layerwise

    model = MLAModel(fixed=variant == "fixed", backend=backend)
    model.load(model.checkpoint(0))
    g = torch.Generator().manual_seed(5)
    inputs = [(f"bs{b}", torch.randn(b, WIDTH, generator=g)) for b in BATCH_SIZES]

    def reload(m):
        used = reload_layerwise(m, m.checkpoint(1), backend=backend)
        with torch.no_grad():
            m.process_weights_after_loading()  # the deferred attention step, on live layers
        return used

    def perturb(m):
        for layer in m.layers:
            layer.self_attn.W_UV.add_(1.0)
            layer.sink_attn.attn.impl.sinks.add_(1.0)
        return "live W_UV and fp32 sinks, +1 in place"

    return capture_reload_diff(model, inputs, reload, perturb)


CASE = Case(
    name="vllm-48251-mla-sinks",
    reference="vLLM #48251",
    source="vllm/model_executor/layers/attention/mla_attention.py: MLAAttention; "
           "vllm/model_executor/models/gpt_oss.py: OAIAttention.sinks",
    rebound="MLA `W_UV` / `W_UK_T` reassigned as plain attributes by process-weights; "
            "gpt-oss sinks kept by the backend as a `.to(float32)` copy",
    fix="`replace_parameter(..., prefer_copy=True)` for W_UV / W_UK_T; refresh the fp32 "
        "sinks in place",
    reload="vllm-layerwise+attention",
    variants=buggy_and_fixed(
        "W_UV/W_UK_T plain attributes; sinks .to(float32) each run",
        "registered with prefer_copy; sinks refreshed in place",
        {"layers.*.self_attn.W_UV": "stale",
         "layers.*.self_attn.W_UK_T": "stale",
         "layers.*.sink_attn.attn.impl.sinks": "stale"}),
    run=run,
)
