"""vLLM layerwise reload drops an FP8 MoE layer's last checkpoint loads.

Standalone reproduction for the vLLM maintainers (uses vLLM and its dependencies only).

What it does
  1. writes a tiny Mixtral checkpoint to a temp dir: FP8 (e4m3) per-tensor expert weights with
     per-tensor `weight_scale` and static `input_scale` (quantization_config
     {"quant_method": "fp8", "activation_scheme": "static"}), attention and router unquantized
     (`ignored_layers`), one safetensors file;
  2. builds the model with vLLM's own loader (`get_model_loader(load_config).load_model`), as
     the engine's model runner does, and records each expert's effective weights;
  3. reloads the same checkpoint from disk with vLLM's `reload_weights(...,
     is_checkpoint_format=True)` (model_loader/reload/inplace.py), the function behind
     `LLM.collective_rpc("reload_weights")`, and compares.
Expected: reload_weights returns and every expert's weights are identical (same checkpoint).
The bug: the layerwise reload counts the per-expert `input_scale` twice (w1 and w3 write one
element, fused_moe/routed_experts.py:804-838, :633; counted at reload/layerwise.py:186-187), so
`load_numel >= load_numel_total` (:217) holds before the layer's last load arrives and the
layer is processed early. `safe_open().keys()` yields keys sorted, so the late key is the last
expert's `w3.weight_scale`: its element keeps the memory `torch.empty_strided` returned, and
`process_fp8_weight_tensor_strategy_moe` requantises that expert's w3 with it. The late load
itself is not dropped quietly: `RoutedExperts.load_weights` looks the parameter up at call
time, gets the processed parameter (unwrapped loader, no `quant_method` attribute) and raises,
so reload_weights fails with the layers after the first left unloaded (meta tensors).

The run is done twice: once as shipped (the dropped element holds whatever the allocator
returned), once with PyTorch's `torch.utils.deterministic.fill_uninitialized_memory` (on with
`torch.use_deterministic_algorithms(True, warn_only=True)`), which fills memory from
`torch.empty*` with NaN, so an element no load wrote is visible.

CPU note: vLLM 0.32 has no FP8 MoE kernel for a CPU without AMX (the oracle returns
Fp8MoeBackend.NONE and `convert_to_fp8_moe_kernel_format` raises, oracle/fp8.py:706). On such a
CPU this script replaces only `Fp8MoEMethod._setup_kernel` (the last step of
process_weights_after_loading, after the requantisation this bug corrupts) by one that keeps
the weights in the checkpoint layout (what the Triton backend does) and builds no kernel. With
a backend (CUDA, AMX CPU) nothing is replaced. No forward is run; "effective weights" are the
processed FP8 weights times their scales, and each expert's output is computed from them in
plain torch.

Exit status 0 whether or not the bug reproduces (see the final line); 2 if the script fails.
Run: python moe_reload_drops_loads.py   (about 30 s on 2 CPU cores)
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import torch

from _repro import (  # sets the offline environment before vLLM loads
    build_model,
    decoder_skeleton,
    print_versions,
    run,
)

E, HIDDEN, INTER, LAYERS = 4, 128, 256, 2      # experts, hidden size, expert intermediate size
FP8 = torch.float8_e4m3fn


def write_checkpoint(d: Path) -> None:
    from safetensors.torch import save_file

    cfg = {
        "architectures": ["MixtralForCausalLM"], "model_type": "mixtral",
        "hidden_size": HIDDEN, "intermediate_size": INTER, "num_hidden_layers": LAYERS,
        "num_attention_heads": 2, "num_key_value_heads": 2, "head_dim": 64,
        "num_local_experts": E, "num_experts_per_tok": 2, "vocab_size": 256,
        "max_position_embeddings": 128, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
        "sliding_window": None, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
        "hidden_act": "silu",
        "quantization_config": {
            "quant_method": "fp8", "activation_scheme": "static",
            "ignored_layers": [f"model.layers.{i}.{m}" for i in range(LAYERS)
                               for m in ("self_attn.q_proj", "self_attn.k_proj",
                                         "self_attn.v_proj", "self_attn.o_proj",
                                         "block_sparse_moe.gate")] + ["lm_head"]},
    }
    (d / "config.json").write_text(json.dumps(cfg, indent=1))
    g = torch.Generator().manual_seed(0)

    def rnd(*shape):
        return (torch.randn(*shape, generator=g) * 0.05).to(torch.bfloat16)

    sd = decoder_skeleton(rnd, 256, HIDDEN, LAYERS)
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        for m in ("q", "k", "v", "o"):
            sd[p + f"self_attn.{m}_proj.weight"] = rnd(HIDDEN, HIDDEN)
        sd[p + "block_sparse_moe.gate.weight"] = rnd(E, HIDDEN)
        for e in range(E):
            for w, shape in (("w1", (INTER, HIDDEN)), ("w2", (HIDDEN, INTER)),
                             ("w3", (INTER, HIDDEN))):
                q = p + f"block_sparse_moe.experts.{e}.{w}."
                # FP8 values and distinct per-tensor scales (w1 and w3 differ, so the
                # requantisation to one w13 scale per expert has work to do)
                sd[q + "weight"] = (torch.randn(*shape, generator=g) * 64).clamp(-448, 448).to(FP8)
                sd[q + "weight_scale"] = torch.tensor(0.001 * (1 + e) * (1.5 if w == "w3" else 1.0))
                sd[q + "input_scale"] = torch.tensor(0.02)
    save_file(sd, str(d / "model.safetensors"), metadata={"format": "pt"})


def moe_layers(model):
    from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts
    return [(n, m) for n, m in model.named_modules() if isinstance(m, RoutedExperts)]


def effective(layer) -> dict[str, torch.Tensor]:
    """Per expert: the processed FP8 weights times their scales (what the kernel multiplies)."""
    w13 = layer.w13_weight.float()
    s13 = layer.w13_weight_scale.float().reshape(w13.shape[0], -1)[:, :1]
    w2 = layer.w2_weight.float()
    s2 = layer.w2_weight_scale.float().reshape(w2.shape[0], -1)[:, :1]
    return {"w13": w13 * s13[:, :, None], "w2": w2 * s2[:, :, None],
            "w13_weight_scale": layer.w13_weight_scale.detach().float().clone(),
            "w13_input_scale": layer.w13_input_scale.detach().float().clone().reshape(-1)}


def expert_out(eff, e: int, x: torch.Tensor) -> torch.Tensor:
    w13 = eff["w13"][e]
    gate, up = w13[:INTER], w13[INTER:]
    return (torch.nn.functional.silu(x @ gate.T) * (x @ up.T)) @ eff["w2"][e].T


def snapshot(model):
    """None for a layer whose tensors are on the meta device (left unloaded)."""
    return {n: (None if m.w13_weight.is_meta else effective(m)) for n, m in moe_layers(model)}


class DropWatch:
    """Wraps the weights iterator (observes only): records the keys of each MoE layer in the
    order they arrive, and those that arrive after vLLM's layerwise reload has already
    processed the layer (its `info.can_load()` false, layerwise.py:156)."""

    def __init__(self, model, it):
        from vllm.model_executor.model_loader.reload.layerwise import get_layerwise_info
        self.layers = {n: get_layerwise_info(m) for n, m in moe_layers(model)}
        self.it, self.late, self.order, self.last, self.error = it, [], {}, None, None

    def __iter__(self):
        for name, t in self.it:
            for lname, info in self.layers.items():
                if name.startswith(ckpt_prefix(lname)):
                    self.order.setdefault(lname, []).append(name)
                    if not info.can_load():
                        self.late.append(name)
            self.last = name
            yield name, t


def ckpt_prefix(lname: str) -> str:
    """model.layers.0.block_sparse_moe.experts.routed_experts -> ...block_sparse_moe.experts."""
    return lname[:lname.index(".experts") + len(".experts")] + "."


SPY: list = []


def spy_requant() -> None:
    """Observation only: records the scales `process_fp8_weight_tensor_strategy_moe` gets."""
    from vllm.model_executor.layers.quantization import fp8 as fp8_mod
    shipped = fp8_mod.process_fp8_weight_tensor_strategy_moe

    def spied(weight, weight_scales, *args, **kwargs):
        SPY.append(weight_scales.detach().float().clone())
        return shipped(weight, weight_scales, *args, **kwargs)

    fp8_mod.process_fp8_weight_tensor_strategy_moe = spied


def patch_no_backend() -> str:
    """Only on a platform where vLLM has no FP8 MoE backend (see the docstring)."""
    from vllm.model_executor.layers.fused_moe.oracle.fp8 import Fp8MoeBackend
    from vllm.model_executor.layers.quantization import fp8 as fp8_mod
    from vllm.model_executor.utils import replace_parameter

    shipped = fp8_mod.Fp8MoEMethod._setup_kernel

    def setup_kernel(self, layer, w13, w2, w13_scale, w2_scale, w13_input_scale, w2_input_scale):
        if self.fp8_backend != Fp8MoeBackend.NONE:
            return shipped(self, layer, w13, w2, w13_scale, w2_scale, w13_input_scale,
                           w2_input_scale)
        replace_parameter(layer, "w13_weight", w13)
        replace_parameter(layer, "w2_weight", w2)
        replace_parameter(layer, f"w13_{self.weight_scale_name}", w13_scale)
        replace_parameter(layer, f"w2_{self.weight_scale_name}", w2_scale)

    fp8_mod.Fp8MoEMethod._setup_kernel = setup_kernel
    return "Fp8MoEMethod._setup_kernel keeps the checkpoint layout when the backend is NONE"


def patch_static_fp8_quant() -> str | None:
    """vLLM's AVX2 CPU build registers `_C::static_scaled_fp8_quant` with an empty schema (no
    kernel), so `ops.scaled_fp8_quant(x, scale)` cannot run there. Only then, the static
    per-tensor case is computed in torch as the CUDA kernel defines it:
    fp8(clamp(x / scale, -448, 448))."""
    import vllm._custom_ops as ops

    schema = str(torch.ops._C.static_scaled_fp8_quant.default._schema)
    if "Tensor" in schema:
        return None
    shipped = ops.scaled_fp8_quant

    def scaled_fp8_quant(input, scale=None, *args, **kwargs):
        if scale is None or scale.numel() != 1 or args or kwargs:
            return shipped(input, scale, *args, **kwargs)
        fmax = torch.finfo(FP8).max
        out = (input.float() / scale.float()).clamp(-fmax, fmax).to(FP8)
        return out, scale

    ops.scaled_fp8_quant = scaled_fp8_quant
    return (f"`_C::static_scaled_fp8_quant` has no kernel in this build ({schema}): "
            "`ops.scaled_fp8_quant(x, scale)` computed in torch as fp8(clamp(x / scale))")


def reload(vllm_config, model, poison: bool):
    from vllm.model_executor.model_loader import get_model_loader
    from vllm.model_executor.model_loader.reload.inplace import reload_weights

    # the iterator reload_weights builds itself when given none (reload/inplace.py:82),
    # wrapped to watch which loads vLLM drops
    it = get_model_loader(vllm_config.load_config).get_all_weights(
        vllm_config.model_config, model)
    watch = DropWatch(model, it)
    if poison:
        torch.use_deterministic_algorithms(True, warn_only=True)
        torch.utils.deterministic.fill_uninitialized_memory = True
    try:
        reload_weights(vllm_config, model, weights_iterator=watch, weights_path=None,
                       is_checkpoint_format=True)
    except Exception as exc:  # noqa: BLE001 (the outcome is reported)
        import traceback
        tb = traceback.extract_tb(exc.__traceback__)[-1]
        watch.error = (f"{type(exc).__name__}: {exc} at "
                       f"{tb.filename.split('site-packages/')[-1]}:{tb.lineno}")
    finally:
        torch.use_deterministic_algorithms(False)
    return watch


def compare(before, after, x) -> list[str]:
    bad = []
    for lname in before:
        b, a = before[lname], after[lname]
        if a is None:
            bad.append(f"{lname}: left on the meta device (no data) by the failed reload")
            continue
        for e in range(E):
            parts = []
            for key in ("w13", "w2"):
                if not torch.equal(torch.nan_to_num(b[key][e], 7.0), torch.nan_to_num(a[key][e], 7.0)):
                    n = int(a[key][e].isnan().sum())
                    err = (a[key][e] - b[key][e]).abs().nan_to_num(float("inf")).max().item()
                    parts.append(f"{key}: max |diff| {err:.3g}, NaN {n}/{a[key][e].numel()}")
            if parts:
                yb, ya = expert_out(b, e, x), expert_out(a, e, x)
                oerr = (ya - yb).abs().nan_to_num(float("inf")).max().item()
                parts.append(f"expert output max |diff| {oerr:.3g} (|output| <= "
                             f"{yb.abs().max().item():.3g})")
                bad.append(f"{lname} expert {e}: " + "; ".join(parts))
    return bad


def main() -> int:

    print_versions()
    d = Path(tempfile.mkdtemp(prefix="moe-fp8-"))
    write_checkpoint(d)
    print(f"checkpoint: tiny Mixtral, {LAYERS} layers x {E} experts, FP8 e4m3 per-tensor "
          f"weights, static input scales, one safetensors file ({d})")

    from vllm.model_executor.layers.fused_moe.oracle.fp8 import Fp8MoeBackend
    note = patch_no_backend()
    note_quant = patch_static_fp8_quant()
    spy_requant()
    vllm_config, model = build_model(d)
    layers = moe_layers(model)
    backends = {type(m.quant_method).__name__ + ": " + m.quant_method.fp8_backend.value
                for _, m in layers}
    print(f"MoE method and backend: {', '.join(sorted(backends))}")
    if any(m.quant_method.fp8_backend == Fp8MoeBackend.NONE for _, m in layers):
        print(f"  (no FP8 MoE kernel on this platform: {note})")
    if note_quant:
        print(f"  (stand-in: {note_quant})")
    x = torch.randn(3, HIDDEN, generator=torch.Generator().manual_seed(1))
    before = snapshot(model)

    reproduced = False
    for poison in (False, True):
        if poison:      # a fresh model: the first reload may have left this one half loaded
            model = build_model_fresh(vllm_config)
            layers = moe_layers(model)
            before = snapshot(model)
        title = ("reload_weights from disk, as shipped" if not poison else
                 "the same, with torch.empty* memory filled with NaN "
                 "(torch.utils.deterministic.fill_uninitialized_memory)")
        print(f"\n== {title}")
        SPY.clear()
        watch = reload(vllm_config, model, poison)
        lname0 = layers[0][0]
        keys = watch.order.get(lname0, [])
        print(f"{ckpt_prefix(lname0)}* keys arrive sorted by name: {keys == sorted(keys)} "
              f"({len(keys)} keys, last: {keys[-1][len(ckpt_prefix(lname0)):] if keys else '?'})")
        print(f"loads that arrived after vLLM had processed their MoE layer: {len(watch.late)}")
        for k in watch.late:
            print(f"  {k}")
        print("reload_weights: " + (f"raised {watch.error}" if watch.error else "returned"))
        for i, sc in enumerate(SPY):
            print(f"scales process_fp8_weight_tensor_strategy_moe got in the reload (layer {i}), "
                  f"[expert][w1, w3]: {[[float(f'{v:.4g}') for v in r] for r in sc.tolist()]}")
        after = snapshot(model)
        for lname, _ in layers:
            a = after[lname]
            print(f"{lname}.w13_weight_scale: before "
                  f"{[float(f'{v:.4g}') for v in before[lname]['w13_weight_scale'].reshape(-1).tolist()]}, after "
                  + ("meta (no data)" if a is None else
                     f"{[float(f'{v:.4g}') for v in a['w13_weight_scale'].reshape(-1).tolist()]}"))
        bad = compare(before, after, x)
        print("expected: reload_weights returns and every expert's effective weights are "
              "identical before and after (same checkpoint)")
        print(f"got: {len(bad)} difference(s)" + (":" if bad else ""))
        for line in bad:
            print(f"  {line}")
        reproduced |= bool(bad) or bool(watch.late) or bool(watch.error)
    print("\nBUG REPRODUCED" if reproduced else "\nNOT REPRODUCED")
    return 0


def build_model_fresh(vllm_config):
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader import get_model_loader
    # the first model's attention layers are registered by name in the config
    vllm_config.compilation_config.static_forward_context.clear()
    with set_current_vllm_config(vllm_config):
        return get_model_loader(vllm_config.load_config).load_model(
            vllm_config=vllm_config, model_config=vllm_config.model_config)


if __name__ == "__main__":
    run(main)
