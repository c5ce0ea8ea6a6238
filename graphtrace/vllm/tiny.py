"""Tiny local checkpoints that a real vLLM can load on CPU, made without any hub access.

* :func:`make_tiny_llama` writes a float32 Llama of `TINY_LLAMA`'s size, random weights.
* :func:`make_tiny_gptq` writes a float16 Llama whose linear layers are 4-bit GPTQ
  (`_pack_gptq`), which vLLM 0.32 on CPU runs with ``CPUWNA16LinearKernel``.
* :func:`checkpoint_weights` yields ``(name, tensor)`` pairs in checkpoint format for
  ``collective_rpc("reload_weights", kwargs={"weights_iterator": ...})``, optionally changed.
* :func:`engine_kwargs` / :func:`engine_env`: the ``LLM(...)`` settings that work on this CPU.

Optionally a byte-level BPE tokenizer is trained locally with the ``tokenizers`` library
(``tokenizer=True``); by default none is written and engines use
``skip_tokenizer_init=True`` with ``prompt_token_ids``.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

__all__ = [
    "TINY_LLAMA",
    "make_tiny_llama",
    "make_tiny_gptq",
    "checkpoint_weights",
    "perturbed",
    "write_changed_checkpoint",
    "engine_kwargs",
    "engine_env",
    "set_engine_env",
    "PROMPTS",
]

TINY_LLAMA = dict(
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=512,
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)

#: Prompts as token ids (no tokenizer needed).
PROMPTS: list[list[int]] = [
    [1, 17, 45, 300, 12, 99, 7],
    [1, 400, 401, 402, 3, 5],
    [1, 8, 8, 8, 250],
]

_TOKENIZER_TEXT = [
    "the quick brown fox jumps over the lazy dog",
    "graphs read raw addresses captured at startup",
    "weights are reloaded many times an hour",
    "a stale read gives silently wrong output",
    "hello world, hello vllm, hello graphtrace",
]


def _llama_config(dtype: torch.dtype, **overrides):
    from transformers import LlamaConfig

    kw = dict(TINY_LLAMA)
    kw.update(overrides)
    cfg = LlamaConfig(**kw)
    cfg.architectures = ["LlamaForCausalLM"]
    cfg.dtype = dtype  # transformers 5 spelling (`torch_dtype` is deprecated there)
    return cfg


def _write_tokenizer(folder: Path, vocab_size: int) -> None:
    """Train a byte-level BPE tokenizer on a few local lines and save it beside the model."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<pad>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_TOKENIZER_TEXT * 4, trainer=trainer)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": "<s>",
                "eos_token": "</s>",
                "pad_token": "<pad>",
                "model_max_length": TINY_LLAMA["max_position_embeddings"],
            },
            indent=1,
        )
    )
    (folder / "special_tokens_map.json").write_text(
        json.dumps({"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>"})
    )


def make_tiny_llama(folder: str | os.PathLike, *, seed: int = 0, tokenizer: bool = False,
                    dtype: torch.dtype = torch.float32) -> Path:
    """Write a tiny random Llama checkpoint (safetensors) into ``folder``; returns the path."""
    from transformers import LlamaForCausalLM

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    cfg = _llama_config(dtype)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg).to(dtype)
    model.save_pretrained(str(folder), safe_serialization=True)
    if tokenizer:
        _write_tokenizer(folder, cfg.vocab_size)
    return folder


# ----------------------------------------------------------------------------------- GPTQ

def _pack_gptq(w: torch.Tensor, group_size: int, bits: int = 4):
    """Quantize a float weight [out, in] to symmetric GPTQ (uint4b8) tensors.

    Returns qweight [in/8, out] int32 (packed along the input dim, low nibble first),
    qzeros [in/group, out/8] int32 (GPTQ v1 stores zero-1, i.e. 7 for symmetric 4 bit),
    scales [in/group, out] float16 and g_idx [in] int32 (i // group_size; no act-order).
    """
    out_f, in_f = w.shape
    pack = 32 // bits
    maxq = 2**bits - 1
    zero = 2 ** (bits - 1)
    wt = w.t().float()  # [in, out]
    groups = wt.reshape(in_f // group_size, group_size, out_f)
    scale = groups.abs().amax(dim=1).clamp(min=1e-6) / (zero - 0.5)  # [G, out]
    q = torch.clamp(torch.round(groups / scale[:, None, :]) + zero, 0, maxq).to(torch.int64)
    q = q.reshape(in_f, out_f)
    qweight = torch.zeros(in_f // pack, out_f, dtype=torch.int64)
    for j in range(pack):
        qweight |= q[j::pack] << (bits * j)
    qweight = qweight.to(torch.uint32).view(torch.int32)
    zeros_val = zero - 1
    zword = 0
    for j in range(pack):
        zword |= zeros_val << (bits * j)
    zword = ((zword + 2**31) % 2**32) - 2**31
    qzeros = torch.full((in_f // group_size, out_f // pack), zword, dtype=torch.int32)
    g_idx = (torch.arange(in_f, dtype=torch.int32) // group_size).to(torch.int32)
    return qweight.contiguous(), qzeros, scale.to(torch.float16).contiguous(), g_idx


_LINEAR_SUFFIXES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def gptq_state_dict(float_state: dict[str, torch.Tensor], group_size: int = 32
                    ) -> dict[str, torch.Tensor]:
    """Turn a float Llama state dict into a GPTQ 4-bit one (linear layers quantized,
    embeddings/norms/lm_head kept in float16)."""
    out: dict[str, torch.Tensor] = {}
    for name, t in float_state.items():
        mod, _, leaf = name.rpartition(".")
        if leaf == "weight" and mod.rsplit(".", 1)[-1] in _LINEAR_SUFFIXES:
            qweight, qzeros, scales, g_idx = _pack_gptq(t, group_size)
            out[f"{mod}.qweight"] = qweight
            out[f"{mod}.qzeros"] = qzeros
            out[f"{mod}.scales"] = scales
            out[f"{mod}.g_idx"] = g_idx
        else:
            out[name] = t.to(torch.float16).contiguous()
    return out


def make_tiny_gptq(folder: str | os.PathLike, *, seed: int = 0, group_size: int = 32,
                   tokenizer: bool = False) -> Path:
    """Write a tiny 4-bit GPTQ (float16, desc_act False, sym) Llama checkpoint into ``folder``."""
    from safetensors.torch import save_file
    from transformers import LlamaForCausalLM

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    cfg = _llama_config(torch.float16)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(_llama_config(torch.float32))
    sd = {k: v.detach() for k, v in model.state_dict().items()}
    q = gptq_state_dict(sd, group_size)
    save_file(q, str(folder / "model.safetensors"), metadata={"format": "pt"})
    qcfg = {
        "bits": 4,
        "group_size": group_size,
        "desc_act": False,
        "sym": True,
        "true_sequential": True,
        "lm_head": False,
        "quant_method": "gptq",
        "checkpoint_format": "gptq",
        "damp_percent": 0.01,
    }
    cfg_dict = cfg.to_dict()
    cfg_dict["quantization_config"] = qcfg
    (folder / "config.json").write_text(json.dumps(cfg_dict, indent=1, default=str))
    (folder / "quantize_config.json").write_text(json.dumps(qcfg, indent=1))
    if tokenizer:
        _write_tokenizer(folder, cfg.vocab_size)
    return folder


# ------------------------------------------------------------------------ weights for reload

def checkpoint_weights(folder: str | os.PathLike,
                       transform: Callable[[str, torch.Tensor], torch.Tensor] | None = None,
                       ) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(name, tensor)`` from the safetensors files in ``folder`` (checkpoint format),
    each passed through ``transform(name, tensor)`` when given."""
    from safetensors.torch import load_file

    for f in sorted(Path(folder).glob("*.safetensors")):
        for name, t in load_file(str(f)).items():
            yield name, (transform(name, t) if transform is not None else t)


def write_changed_checkpoint(src: str | os.PathLike, dst: str | os.PathLike,
                             transform: Callable[[str, torch.Tensor], torch.Tensor] | None = None
                             ) -> Path:
    """Copy the checkpoint folder ``src`` to ``dst`` with every tensor passed through
    ``transform`` (default :func:`perturbed`): for ``reload_weights(weights_path=dst)``, which
    also works across processes (a weights iterator passed through ``collective_rpc`` does not
    survive the engine core's msgpack serialization in vLLM 0.32)."""
    import shutil

    from safetensors.torch import load_file, save_file

    src, dst = Path(src), Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    transform = transform or perturbed()
    for f in sorted(src.iterdir()):
        if f.suffix == ".safetensors":
            tensors = {n: transform(n, t).contiguous() for n, t in load_file(str(f)).items()}
            save_file(tensors, str(dst / f.name), metadata={"format": "pt"})
        elif f.is_file():
            shutil.copy2(f, dst / f.name)
    return dst


def perturbed(seed: int = 1, scale: float = 1.0) -> Callable[[str, torch.Tensor], torch.Tensor]:
    """A ``transform`` for :func:`checkpoint_weights` that changes every floating tensor
    (adds noise of ``scale`` times its std) and every packed int32 GPTQ ``qweight`` (a new
    random nibble pattern); index tensors (``g_idx``, ``qzeros``) are kept."""
    gen = torch.Generator().manual_seed(seed)

    def fn(name: str, t: torch.Tensor) -> torch.Tensor:
        if t.is_floating_point():
            std = float(t.float().std()) if t.numel() > 1 else 1.0
            noise = torch.randn(t.shape, generator=gen) * (std or 1.0) * scale
            return (t.float() + noise).to(t.dtype)
        if name.endswith(".qweight"):
            r = torch.randint(-(2**31), 2**31 - 1, t.shape, generator=gen, dtype=torch.int64)
            return r.to(torch.int32)
        return t

    return fn


# ---------------------------------------------------------------------------- engine settings

def engine_env(cache_root: str | None = None, multiprocessing: bool = False) -> dict[str, str]:
    """Environment a CPU vLLM engine needs here (offline hubs, private cache)."""
    if cache_root is None:
        cache_root = tempfile.mkdtemp(prefix="vllm-cache-")
    return {
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "VLLM_CACHE_ROOT": str(cache_root),
        "VLLM_ENABLE_V1_MULTIPROCESSING": "1" if multiprocessing else "0",
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
    }


def set_engine_env(cache_root: str | None = None, multiprocessing: bool = False) -> dict[str, str]:
    """Apply :func:`engine_env` to ``os.environ`` (before importing vllm); returns it."""
    env = engine_env(cache_root, multiprocessing)
    os.environ.update(env)
    return env


def engine_kwargs(model_dir: str | os.PathLike, *, dtype: str = "float32",
                  tokenizer: bool = False, **overrides) -> dict:
    """``LLM(**engine_kwargs(dir))``: the small-footprint settings measured to work on CPU."""
    kw = dict(
        model=str(model_dir),
        dtype=dtype,
        max_model_len=128,
        enforce_eager=True,
        max_num_seqs=4,
        max_num_batched_tokens=128,
        kv_cache_memory_bytes=64 << 20,
        skip_tokenizer_init=not tokenizer,
        seed=0,
    )
    kw.update(overrides)
    return kw
