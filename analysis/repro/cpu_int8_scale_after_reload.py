"""vLLM CPU W8A8 int8 linear reads its weight scale from freed memory after a weight reload.

Standalone reproduction for the vLLM maintainers (uses vLLM and its dependencies only).

What it does
  1. writes a tiny Llama checkpoint to a temp dir in compressed-tensors W8A8 int8 format
     (int8 per-channel weights with `weight_scale`, dynamic per-token int8 activations), one
     safetensors file;
  2. builds the model with vLLM's own loader (`get_model_loader(load_config).load_model`), as
     the engine's model runner does: every linear layer gets `CPUInt8ScaledMMLinearKernel`;
  3. runs one linear layer's forward (its real `quant_method.apply`) on a fixed input;
  4. reloads the same checkpoint from disk with vLLM's `reload_weights(...,
     is_checkpoint_format=True)` (model_loader/reload/inplace.py), the function behind
     `LLM.collective_rpc("reload_weights")`, and runs the forward again;
  5. allocates 4000 tensors of the weight scale's size filled with 1e30 (they take memory the
     allocator has free, the freed scale's included), and runs the forward again.
Expected: the three outputs are identical (same checkpoint). The bug: on the oneDNN path,
`process_weights_for_onednn` builds the handler with `ops.create_onednn_scaled_mm(weight,
weight_scale, ...)` (kernels/linear/scaled_mm/cpu.py:136), and the handler keeps a pointer to
that weight scale instead of a copy. During a layerwise reload that scale is the reload's
temporary parameter; afterwards vLLM copies the values into the original parameter and drops
the temporary (reload/layerwise.py:_copy_and_restore_kernel_tensors), so the new handler points
at freed memory, and whatever is allocated there next changes the layer's output.

Which CPU path: on x86 with AMX, symmetric activations and suitable shapes vLLM takes the
sgl-kernels int8 GEMM instead (`check_cpu_sgl_kernel`, cpu.py:50-57), which this script does
not exercise; it prints the path taken, and says NOT APPLICABLE when it is not oneDNN. With
`--asymmetric` the checkpoint has asymmetric activations, which take oneDNN on every CPU.

Steps 4-5 are then repeated as a control, with this script keeping a reference to the weight
scale the new handler is built from (a wrapper around `ops.create_onednn_scaled_mm` that only
stores its argument): the output stays right while that tensor lives and goes wrong once the
reference is dropped, which ties the error to that tensor's lifetime.

Exit status 0 whether or not the bug reproduces (see the final line); 2 if the script fails.
Run: python cpu_int8_scale_after_reload.py [--asymmetric]   (about 40-80 s on 2 CPU cores)
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import torch

from _repro import (  # sets the offline environment before vLLM loads
    build_model,
    decoder_skeleton,
    print_versions,
    run,
)

HIDDEN, INTER, LAYERS, VOCAB = 256, 512, 1, 256


ASYMMETRIC = "--asymmetric" in sys.argv[1:]


def write_checkpoint(d: Path) -> None:
    from safetensors.torch import save_file

    int8 = {"num_bits": 8, "type": "int", "symmetric": True}
    cfg = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "hidden_size": HIDDEN, "intermediate_size": INTER, "num_hidden_layers": LAYERS,
        "num_attention_heads": 4, "num_key_value_heads": 4, "head_dim": 64,
        "vocab_size": VOCAB, "max_position_embeddings": 128, "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
        "hidden_act": "silu",
        "quantization_config": {
            "quant_method": "compressed-tensors", "format": "int-quantized",
            "config_groups": {"group_0": {
                "targets": ["Linear"],
                "weights": dict(int8, strategy="channel", dynamic=False),
                "input_activations": dict(int8, strategy="token", dynamic=True,
                                          symmetric=not ASYMMETRIC)}},
            "ignore": ["lm_head"]},
    }
    (d / "config.json").write_text(json.dumps(cfg, indent=1))
    g = torch.Generator().manual_seed(0)

    def dense(*shape):
        return (torch.randn(*shape, generator=g) * 0.05).to(torch.bfloat16)

    def int8_linear(key, n, k):
        sd[key + ".weight"] = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
        sd[key + ".weight_scale"] = (torch.rand(n, 1, generator=g) * 1e-3 + 1e-3).to(torch.bfloat16)

    sd = decoder_skeleton(dense, VOCAB, HIDDEN, LAYERS)
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        for m in ("q", "k", "v", "o"):
            int8_linear(p + f"self_attn.{m}_proj", HIDDEN, HIDDEN)
        int8_linear(p + "mlp.gate_proj", INTER, HIDDEN)
        int8_linear(p + "mlp.up_proj", INTER, HIDDEN)
        int8_linear(p + "mlp.down_proj", HIDDEN, INTER)
    save_file(sd, str(d / "model.safetensors"), metadata={"format": "pt"})


def main() -> int:
    from vllm.model_executor.model_loader.reload.inplace import reload_weights

    print_versions()
    d = Path(tempfile.mkdtemp(prefix="llama-w8a8-"))
    write_checkpoint(d)
    print(f"checkpoint: tiny Llama, compressed-tensors W8A8 int8 (per-channel weight scales, "
          f"dynamic per-token {'asymmetric' if ASYMMETRIC else 'symmetric'} activations), bfloat16, "
          f"one safetensors file ({d})")
    vllm_config, model = build_model(d)

    layer = model.model.layers[0].mlp.down_proj           # N=256 out, K=512 in
    kernel = layer.scheme.kernel
    path = getattr(kernel.linear_method, "__name__", str(kernel.linear_method))
    print(f"layer: model.layers.0.mlp.down_proj, {type(layer.scheme).__name__} -> "
          f"{type(kernel).__name__}, path {path}")
    if path != "_apply_weights_onednn":
        print("\nNOT APPLICABLE: vLLM took the sgl-kernels int8 path on this CPU "
              "(check_cpu_sgl_kernel, kernels/linear/scaled_mm/cpu.py:50-57); the bug is in "
              "the oneDNN path; rerun with --asymmetric (asymmetric activations always take "
              "oneDNN)\nNOT REPRODUCED")
        return 0

    x = (torch.randn(4, INTER, generator=torch.Generator().manual_seed(1)) * 4).to(torch.bfloat16)

    def forward() -> torch.Tensor:
        with torch.no_grad():
            return layer.quant_method.apply(layer, x).float().clone()

    out0 = forward()
    scale = layer.weight_scale
    nbytes = scale.numel() * scale.element_size()
    print(f"weight_scale {tuple(scale.shape)} {scale.dtype}, data_ptr {scale.data_ptr():#x}")

    def churn() -> torch.Tensor:
        """The forward while 4000 tensors of the scale's size, full of 1e30, are alive
        (they take memory the allocator has free)."""
        filler = [torch.full((nbytes // 4,), 1e30, dtype=torch.float32) for _ in range(4000)]
        out = forward()
        del filler
        return out

    def line(what: str, out: torch.Tensor) -> str:
        diff = (out - out0).abs().nan_to_num(float("inf")).max().item()
        return (f"  {what:<44} max |diff| {diff:<10.4g} max |output| "
                f"{out.abs().max().item():<10.4g} non-finite {int((~out.isfinite()).sum())}")

    rows = [line("before the reload (reference)", out0),
            line(f"before the reload, 4000 x {nbytes} B of 1e30 live", churn())]

    # 1) vLLM's in-place reload from the same checkpoint on disk, as shipped
    reload_weights(vllm_config, model, weights_iterator=None, weights_path=None,
                   is_checkpoint_format=True)
    rows += [line("after reload_weights", forward()),
             line(f"after it, 4000 x {nbytes} B of 1e30 live", churn())]

    # 2) the control: the same reload, but this script keeps a reference to the weight scale
    #    each new oneDNN handler is built from (observation and keep-alive only)
    import vllm.model_executor.kernels.linear.scaled_mm.cpu as cpu_kernels
    shipped, kept = cpu_kernels.ops.create_onednn_scaled_mm, []

    def keep_scale(weight, weight_scales, *args, **kwargs):
        kept.append(weight_scales)
        return shipped(weight, weight_scales, *args, **kwargs)

    cpu_kernels.ops.create_onednn_scaled_mm = keep_scale
    try:
        reload_weights(vllm_config, model, weights_iterator=None, weights_path=None,
                       is_checkpoint_format=True)
    finally:
        cpu_kernels.ops.create_onednn_scaled_mm = shipped
    mine = [t for t in kept if t.shape == scale.shape]
    built_from = ", ".join(f"{t.data_ptr():#x}" for t in mine[-1:])
    rows += [line("reload again, its handler's scale kept alive", forward()),
             line(f"... and 4000 x {nbytes} B of 1e30 live", churn())]
    kept.clear()
    mine.clear()
    rows += [line("... then that scale released (as vLLM does)", forward()),
             line(f"... and 4000 x {nbytes} B of 1e30 live", churn())]
    print(f"the layer's weight_scale stays at {layer.weight_scale.data_ptr():#x} across reloads "
          f"(vLLM copies the new values into it); the handler of the second reload was built "
          f"from a weight_scale at {built_from} (the reload's temporary)")
    print("expected: the same output at every step (same checkpoint, same input)")
    print("got:")
    print("\n".join(rows))
    bad = [r for r in rows if "max |diff| 0 " not in r]
    reproduced = bool(bad)
    print("\nBUG REPRODUCED" if reproduced else "\nNOT REPRODUCED")
    return 0


if __name__ == "__main__":
    run(main)
