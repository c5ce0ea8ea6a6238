"""Run by test_torchao.py in a subprocess (it makes a process group): vLLM 0.32's torchao
quantization method (`TorchAOConfig`, online int8 weight-only) on one `ColumnParallelLinear`,
built, loaded and processed by vLLM's own code (the kernel audit's steps), its apply captured,
then (a) vLLM's layerwise reload with new weights and (b) the weight quantized again and bound
in its place (what a sync that bypasses the layerwise reload does). Prints one JSON line.
"""

from __future__ import annotations

import json

import torch


def main() -> None:
    from torchao.quantization import Int8WeightOnlyConfig
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.linear import ColumnParallelLinear
    from vllm.model_executor.layers.quantization.torchao import (
        TorchAOConfig,
        torchao_quantize_param_data,
    )
    from vllm.model_executor.model_loader.reload import (
        finalize_layerwise_reload,
        initialize_layerwise_reload,
        record_metadata_for_reloading,
    )

    import graphtrace as gt
    from analysis.vllm_kernel_audit import AuditModel, init_single_process_group, load

    init_single_process_group()
    out: dict = {}
    with set_current_vllm_config(VllmConfig()):
        layer = ColumnParallelLinear(64, 32, bias=False, params_dtype=torch.float32,
                                     quant_config=TorchAOConfig(Int8WeightOnlyConfig()),
                                     return_bias=False, prefix="proj")
        model = AuditModel(layer)
        with torch.device("cpu"):
            record_metadata_for_reloading(model)
        load(layer, {"weight": torch.randn(32, 64, generator=torch.Generator().manual_seed(1))})
        layer.quant_method.process_weights_after_loading(layer)
        out["weight_type"] = type(layer.weight).__name__
        x = torch.randn(4, 64, generator=torch.Generator().manual_seed(0))
        with torch.no_grad(), gt.trace(model, strict=True) as t:
            with gt.capture("apply") as graph:
                y = model(x)
        guard = t.guard()
        owned = t.diff().edges
        out["owned"] = sorted(set(owned["owners"].astype(str)) - {""})

        def result(report, g) -> dict:
            e = report.edges
            bad = e[e["verdict"].astype(str).isin(gt.STALE_VERDICTS)]
            graph.replay()
            with torch.no_grad():
                eager = model(x)
            return {"stale": sorted(set(bad["owners"].astype(str))),
                    "verdicts": sorted(set(bad["verdict"].astype(str))),
                    "guard": sorted(set(g.check()["owners"].astype(str))),
                    "replay_is_eager": bool(torch.allclose(y, eager, atol=1e-5))}

        with torch.no_grad():  # (a) vLLM's layerwise reload
            initialize_layerwise_reload(model)
            load(layer, {"weight": torch.randn(32, 64,
                                               generator=torch.Generator().manual_seed(2))})
            finalize_layerwise_reload(model, model_config=None)
        out["layerwise"] = result(t.diff(), guard)
        guard = t.guard()
        with torch.no_grad():  # (b) quantized again, bound in place of the weight
            new = torchao_quantize_param_data(
                torch.nn.Parameter(torch.randn(32, 64), requires_grad=False),
                Int8WeightOnlyConfig())
            layer.weight = torch.nn.Parameter(new, requires_grad=False)
        out["rebound"] = result(t.diff(), guard)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
