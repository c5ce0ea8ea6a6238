"""A STAND-IN for sgl-kernel's CPU extension `common_ops`, for machines where it cannot be had.

The package registry has no CPU build of sgl-kernel (its CPU kernels are built from SGLang's
source for Xeons with AMX), and the CUDA build's `common_ops` needs libcuda.so.1. When that
load fails, `sgl_kernel.load_utils._load_architecture_specific_ops` falls back to a plain
`import common_ops`: with this folder on the path, that import finds this module, and the rest
of sgl_kernel (its Python) imports as shipped. Where sgl_kernel is the placeholder package of
requirements/sglang-placeholder (nothing imports `common_ops`), this module is also an SGLang
plugin (`register`, entry point group `sglang.srt.plugins`): loading it registers the ops in
every process SGLang starts.

What it provides, and nothing more:
  * `sgl_kernel::decode_attention_cpu` and `sgl_kernel::extend_attention_cpu`, the two ops the
    intel_amx attention backend calls (sglang/srt/layers/attention/intel_amx_backend.py), in
    that backend's argument order, computed in plain torch (softmax attention over the KV
    pool; the decode op also writes this step's K/V into the pool, as the kernel does);
  * schema-only definitions of the other ops `CPUGraphRunner` registers fake kernels for
    (`register_fake_ops` in sglang/srt/model_executor/cpu_graph_runner.py needs them to exist);
    calling one raises NotImplementedError, and a tiny float32 Llama calls none of them.

Used by analysis/repro/sglang_cpu_compile_keeps_old_weights.py and by graphtrace's SGLang
tests of the compiled CPU engine. Not SGLang's kernels: numbers match transformers on the tiny
model (the reproduction checks that before it says anything about an update).
"""

import torch

_lib = torch.library.Library("sgl_kernel", "FRAGMENT")
_lib.define(
    "decode_attention_cpu(Tensor query, Tensor(a!) k_cache, Tensor(b!) v_cache, float k_scale, "
    "float v_scale, Tensor(c!) output, Tensor? key, Tensor? value, Tensor loc, "
    "Tensor(d!) attn_logits, Tensor req_to_token, Tensor req_pool_indices, Tensor seq_lens, "
    "float sm_scale, float logit_cap, bool is_cross, int sliding_window, Tensor? encoder_lens, "
    "Tensor? sinks) -> ()")
_lib.define(
    "extend_attention_cpu(Tensor q_extend, Tensor? k_extend, Tensor? v_extend, Tensor(a!) o_extend, "
    "Tensor k_buffer, Tensor v_buffer, float k_scale, float v_scale, Tensor req_to_token, "
    "Tensor req_pool_indices, Tensor seq_lens, Tensor extend_seq_lens, Tensor extend_start_loc, "
    "int? max_len_extend, float sm_scale, float logit_cap, bool is_cross, int sliding_window, "
    "Tensor? encoder_lens, Tensor? sinks, Tensor? tree_mask, bool is_causal) -> ()")

def _attend(q, k, v, sm_scale, logit_cap, causal_offset):
    h, hkv = q.shape[1], k.shape[1]
    if hkv != h:
        k = k.repeat_interleave(h // hkv, dim=1)
        v = v.repeat_interleave(h // hkv, dim=1)
    s = torch.einsum("qhd,khd->hqk", q.float(), k.float()) * sm_scale
    if logit_cap and logit_cap > 0:
        s = logit_cap * torch.tanh(s / logit_cap)
    if causal_offset is not None:
        qpos = torch.arange(q.shape[0]).unsqueeze(1) + causal_offset
        s = s.masked_fill(torch.arange(k.shape[0]).unsqueeze(0) > qpos, float("-inf"))
    return torch.einsum("hqk,khd->qhd", torch.softmax(s, -1), v.float()).to(q.dtype)

def decode_attention_cpu(query, k_cache, v_cache, k_scale, v_scale, output, key, value, loc,
                         attn_logits, req_to_token, req_pool_indices, seq_lens, sm_scale,
                         logit_cap, is_cross, sliding_window, encoder_lens, sinks):
    if key is not None and value is not None:
        k_cache[loc] = key.view(-1, *k_cache.shape[1:]).to(k_cache.dtype)
        v_cache[loc] = value.view(-1, *v_cache.shape[1:]).to(v_cache.dtype)
    for i in range(seq_lens.shape[0]):
        idx = req_to_token[int(req_pool_indices[i]), : int(seq_lens[i])].long()
        output[i : i + 1] = _attend(query[i : i + 1], k_cache[idx], v_cache[idx],
                                    sm_scale, logit_cap, None)

def extend_attention_cpu(q_extend, k_extend, v_extend, o_extend, k_buffer, v_buffer, k_scale,
                         v_scale, req_to_token, req_pool_indices, seq_lens, extend_seq_lens,
                         extend_start_loc, max_len_extend, sm_scale, logit_cap, is_cross,
                         sliding_window, encoder_lens, sinks, tree_mask, is_causal):
    for i in range(seq_lens.shape[0]):  # this step's K/V are already in k_buffer/v_buffer
        n, e, s = int(seq_lens[i]), int(extend_seq_lens[i]), int(extend_start_loc[i])
        idx = req_to_token[int(req_pool_indices[i]), :n].long()
        o_extend[s : s + e] = _attend(q_extend[s : s + e], k_buffer[idx], v_buffer[idx],
                                      sm_scale, logit_cap, (n - e) if is_causal else None)

_lib.impl("decode_attention_cpu", decode_attention_cpu, "CPU")
_lib.impl("extend_attention_cpu", extend_attention_cpu, "CPU")

_PLACEHOLDERS = """apply_multidimensional_rope_cpu apply_rotary_pos_emb_cpu biased_grouped_topk_cpu
bmm_cpu causal_conv1d_fwd_cpu causal_conv1d_update_cpu chunk_gated_delta_rule_cpu
fp8_per_tensor_scaled_mm_cpu fp8_scaled_mm_cpu fused_add_layernorm_cpu fused_add_rmsnorm_cpu
fused_dual_residual_rmsnorm_cpu fused_experts_cpu fused_gdn_gating_cpu fused_input_proj_cpu
fused_linear_sigmoid_mul fused_moe_router_cpu fused_qk_gemma_rmsnorm_cpu
fused_qk_gemma_rmsnorm_with_gate_cpu fused_qk_rmsnorm_apply_from_stats_cpu fused_qk_rmsnorm_cpu
fused_qk_rmsnorm_sumsq_cpu fused_qkvzba_split_reshape_cat_contiguous_cpu
fused_qkvzba_split_reshape_cat_cpu fused_rmsnorm_gated_cpu
fused_sigmoid_gating_delta_rule_update_cpu fused_sigmoid_mul_cpu gelu_and_mul_cpu
gelu_tanh_and_mul_cpu gemma3_rmsnorm_cpu gemma4_rmsnorm_cpu gemma_fused_add_rmsnorm_cpu
gemma_rmsnorm_cpu grouped_topk_cpu int4_scaled_mm_cpu int8_scaled_mm_cpu
int8_scaled_mm_with_quant l2norm_cpu layernorm_cpu multimodal_rotary_embedding_cpu
mxfp4_scaled_mm_cpu per_token_quant_int8_cpu qkv_proj_with_rope qkv_proj_with_rope_fused_weight
rmsnorm_cpu rotary_embedding_cpu shared_expert_cpu shm_allgather shm_allreduce silu_and_mul_cpu
topk_sigmoid_cpu topk_softmax_cpu weight_packed_linear""".split()
for _name in _PLACEHOLDERS:
    if not hasattr(torch.ops.sgl_kernel, _name):
        _lib.define(f"{_name}(Tensor x) -> ()")


def register() -> None:
    """The `sglang.srt.plugins` entry point: importing this module registered the ops."""
