"""The case sglang-6265-deepseek-w-kc (graphtrace/demo/cases/) in SGLang 0.5.23 itself, on CPU:
a tiny DeepSeek-V2 (MLA, torch_native attention, the placeholder sgl_kernel) under the guard.

SGLang's ``DeepseekWeightLoader.post_load_weights`` (models/deepseek_common/
deepseek_weight_loader.py) splits ``kv_b_proj.weight`` into ``self_attn.w_kc`` / ``w_vc`` after
every load, through ``bind_or_assign`` (copy into the existing tensor: #6265's fix). As
shipped, a session update passes; with the loader binding new tensors instead (#4961's
behaviour, planted by tests/sglang/deepseek_support.py), ``end_weight_update`` answers
``success=False`` naming ``w_kc`` and ``w_vc``.
"""

from __future__ import annotations

import os

import pytest

PROMPT = [[1, 5, 6, 7]]


def _tiny_deepseek(folder):
    import torch
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM

    cfg = DeepseekV2Config(
        vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
        num_hidden_layers=2, first_k_dense_replace=2, n_routed_experts=4, n_shared_experts=1,
        num_experts_per_tok=2, num_attention_heads=2, num_key_value_heads=2, kv_lora_rank=16,
        q_lora_rank=None, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
        max_position_embeddings=256, tie_word_embeddings=False, bos_token_id=1,
        eos_token_id=2, pad_token_id=0,
        # SGLang's CPU rope for DeepSeek is deepseek_yarn only (rotary_embedding/factory.py)
        rope_scaling={"type": "yarn", "rope_type": "yarn", "factor": 1.0,
                      "original_max_position_embeddings": 256, "beta_fast": 32,
                      "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0})
    cfg.architectures = ["DeepseekV2ForCausalLM"]
    for key, value in dict(moe_layer_freq=1, topk_method="greedy", n_group=1, topk_group=1,
                           routed_scaling_factor=1.0, scoring_func="softmax",
                           norm_topk_prob=False).items():
        setattr(cfg, key, value)  # fields SGLang's DeepSeek reads that transformers 5 dropped
    torch.manual_seed(0)
    DeepseekV2ForCausalLM(cfg).float().save_pretrained(folder, safe_serialization=True)
    return folder


@pytest.fixture(scope="module")
def deepseek(work):
    import sglang

    import graphtrace.sglang as gs
    from graphtrace.vllm.tiny import checkpoint_weights, perturbed

    dist = work / "plugins" / "graphtrace_test_deepseek-0.dist-info"
    dist.mkdir(parents=True, exist_ok=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: graphtrace-test-deepseek\n"
                                   "Version: 0\n")
    (dist / "entry_points.txt").write_text(
        "[sglang.srt.plugins]\n"
        "graphtrace_test_deepseek = tests.sglang.deepseek_support:register\n")
    model = _tiny_deepseek(work / "deepseek")
    mode = work / "deepseek-mode"
    mode.write_text("fixed")
    os.environ["GRAPHTRACE_TEST_DEEPSEEK"] = str(mode)
    try:
        with gs.trace_engine(work / "graphtrace-deepseek", guard="raise") as st:
            engine = sglang.Engine(model_path=str(model), device="cpu",
                                   attention_backend="torch_native", disable_cuda_graph=True,
                                   mem_fraction_static=0.05, max_total_tokens=1024,
                                   dtype="float32", random_seed=0, skip_tokenizer_init=True,
                                   skip_server_warmup=True, log_level="error")
    finally:
        os.environ.pop("GRAPHTRACE_TEST_DEEPSEEK", None)

    def update(seed: int, how: str):
        mode.write_text(how)
        assert engine.begin_weight_update()[0]
        assert engine.update_weights_from_tensor(
            named_tensors=list(checkpoint_weights(model, perturbed(seed, 0.05))))[0]
        return tuple(engine.end_weight_update()[:2])

    try:
        engine.generate(input_ids=PROMPT, sampling_params=dict(max_new_tokens=2))
        yield dict(fixed=update(1, "fixed"), assign=update(2, "assign"), checks=st.checks())
    finally:
        engine.shutdown()


def test_as_shipped_the_update_passes(deepseek):
    ok, message = deepseek["fixed"]
    assert ok is True, message
    assert deepseek["checks"][0]["ok"]


def test_binding_new_w_kc_w_vc_is_refused_naming_them(deepseek):
    ok, message = deepseek["assign"]
    assert ok is False
    assert "self_attn.w_kc" in message and "self_attn.w_vc" in message, message
    assert "stale" in message
