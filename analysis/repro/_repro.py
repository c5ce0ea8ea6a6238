"""What both reproductions need around vLLM's own code: an offline environment set before vLLM
is imported, a line naming the CPU (vLLM picks its CPU kernels by it), and a model loaded the
way vLLM's CPU model runner loads one. vLLM's code only; no graphtrace."""

from __future__ import annotations

import os
import platform
import tempfile
from pathlib import Path

for _k, _v in {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1",
               "DO_NOT_TRACK": "1", "VLLM_LOGGING_LEVEL": "WARNING",
               "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}.items():
    os.environ.setdefault(_k, _v)
os.environ.setdefault("VLLM_CACHE_ROOT", tempfile.mkdtemp(prefix="vllm-cache-"))


def cpu_line() -> str:
    """The CPU's model name and the ISA flags vLLM's CPU paths depend on."""
    name, flags = platform.processor() or platform.machine(), []
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name") and name == (platform.processor() or platform.machine()):
                name = line.split(":", 1)[1].strip()
            if line.startswith("flags") and not flags:
                flags = line.split(":", 1)[1].split()
    except OSError:
        pass
    want = ("avx2", "avx512f", "avx512_bf16", "amx_tile", "amx_int8", "amx_bf16")
    return f"{name} ({' '.join(f for f in want if f in flags) or 'ISA unknown'})"


def build_model(d: Path):
    """(vllm_config, model) of the checkpoint folder `d`, loaded by vLLM's model loader in one
    process, as vLLM's CPU model runner does it."""
    from vllm.config import set_current_vllm_config
    from vllm.distributed import ensure_model_parallel_initialized, init_distributed_environment
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.model_loader import get_model_loader
    from vllm.platforms import current_platform

    args = EngineArgs(model=str(d), dtype="bfloat16", max_model_len=128, enforce_eager=True,
                      skip_tokenizer_init=True, load_format="safetensors",
                      max_num_batched_tokens=128, max_num_seqs=4)
    vllm_config = args.create_engine_config()
    if current_platform.is_cpu():
        # what vLLM's CPU model runner does first (v1/worker/cpu_model_runner.py:26)
        from vllm.v1.worker.cpu_model_runner import _set_torch_accelerator_to_noop
        _set_torch_accelerator_to_noop()
    with set_current_vllm_config(vllm_config):
        init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                     distributed_init_method=f"file://{d}/dist_init")
        ensure_model_parallel_initialized(1, 1)
        model = get_model_loader(vllm_config.load_config).load_model(
            vllm_config=vllm_config, model_config=vllm_config.model_config)
    return vllm_config, model


def print_versions() -> None:
    """What a maintainer reads first: vLLM, torch and Python versions, the platform, the CPU."""
    import torch
    import vllm
    from vllm.platforms import current_platform

    print(f"vLLM {vllm.__version__}, torch {torch.__version__}, Python {platform.python_version()}")
    print(f"platform: {type(current_platform).__name__}; CPU: {cpu_line()}")


def run(main) -> None:
    """Exit with main()'s status; 2 and the traceback when the script itself fails (which is
    not a verdict on the bug)."""
    import sys
    import traceback

    try:
        status = main()
    except Exception:
        traceback.print_exc()
        print("SCRIPT FAILED (not a verdict on the bug)")
        status = 2
    sys.exit(status)


def decoder_skeleton(dense, vocab: int, hidden: int, layers: int) -> dict:
    """The tensors of a Llama-style checkpoint that neither bug is about (embeddings, head,
    norms), bfloat16; `dense(*shape)` makes a random matrix."""
    import torch

    ones = lambda: torch.ones(hidden, dtype=torch.bfloat16)  # noqa: E731
    sd = {"model.embed_tokens.weight": dense(vocab, hidden), "lm_head.weight": dense(vocab, hidden),
          "model.norm.weight": ones()}
    for i in range(layers):
        sd[f"model.layers.{i}.input_layernorm.weight"] = ones()
        sd[f"model.layers.{i}.post_attention_layernorm.weight"] = ones()
    return sd
