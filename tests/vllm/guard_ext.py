"""A vLLM worker extension for the guard tests (``worker_extension_cls="guard_ext.GuardTestExtension"``,
with tests/vllm on PYTHONPATH): methods the client reaches through ``collective_rpc`` by name.

``graphtrace_test_inject`` adds what the published bugs of this class have: a tensor that the
layer's ``process_weights_after_loading`` (PWAL) derives and keeps as a plain attribute, read
by the forward. The layerwise reload runs PWAL again. At first it writes the new values into
the tensor it made before (the correct kernel: a clean reload); after
``graphtrace_test_rebind`` it binds a new tensor instead (the bug: a captured graph keeps
reading the old one). The values are ones, so outputs do not change: the guard must see the
identity, not the values. Inject before the first capture (the trace walks owners then).
"""

from __future__ import annotations

import torch

_FIRST: dict[int, torch.Tensor] = {}  # the holder the graphs captured, per layer

def _layer(worker):
    return worker.model_runner.get_model().model.layers[0].self_attn.qkv_proj


class GuardTestExtension:
    def graphtrace_test_inject(self) -> str:
        layer = _layer(self)
        method = layer.quant_method
        original = method.process_weights_after_loading

        def process_weights_after_loading(target):
            original(target)
            if target is not layer:
                return
            if getattr(target, "graphtrace_test_rebinds", False):
                target.injected_scale = _ones(target)  # the bug: a new tensor
            else:  # the fix: the captured storage, new values written into it
                target.injected_scale = _FIRST[id(target)]
                target.injected_scale.copy_(_ones(target))

        method.process_weights_after_loading = process_weights_after_loading
        layer.injected_scale = _ones(layer)
        _FIRST[id(layer)] = layer.injected_scale  # off the model: not a second owner
        layer.register_forward_hook(_apply_scale)
        return "model.layers.0.self_attn.qkv_proj.injected_scale"

    def graphtrace_test_rebind(self, on: bool = True) -> bool:
        """From now on PWAL rebinds the injected holder (the bug), or (``on=False``) writes
        into the captured one again (the fix)."""
        _layer(self).graphtrace_test_rebinds = on
        return on

    def graphtrace_test_load_norm(self) -> int:
        """A bare ``model.load_weights`` (what RL frameworks call through collective_rpc)."""
        model = self.model_runner.get_model()
        weight = model.model.norm.weight
        return len(model.load_weights([("model.norm.weight", weight.detach().clone())]))


def _ones(layer) -> torch.Tensor:
    params = dict(layer.named_parameters())
    dtype = params["scales"].dtype if "scales" in params else torch.float32
    return torch.ones(layer.output_size_per_partition, dtype=dtype)


def _apply_scale(module, args, output):
    out = output[0] if isinstance(output, tuple) else output
    out.mul_(module.injected_scale)  # in place: the output is unchanged (ones)
