"""A vLLM worker extension for the check-before-serve tests (``worker_extension_cls=
"serve_ext.ServeTestExtension"``, tests/vllm on sys.path), and the RL clients' weight-sync
sequences it serves (Note [check before serve] in graphtrace/vllm/serve.py).

The stale holder: ``qkv_proj.injected_scale`` of layer 0 (a tensor the layer derives when its
weights are processed, read by its forward, ones so outputs do not change). It is derived
again where each client path processes weights: vLLM's ``process_weights_after_loading``
(PWAL: ``reload_weights``, verl) and the loader of layer 0's ``input_layernorm.weight`` (TRL,
OpenRLHF: they call ``load_weights`` only).

vLLM 0.32 on CPU prepacks every plain linear layer's weight in PWAL and replaces the
registered ``weight`` with an empty tensor (``dispatch_cpu_unquantized_gemm(layer,
remove_weight=True)``), so a bare ``load_weights`` of a ``*_proj.weight`` fails there
("Attempted to load weight (torch.Size([128, 256])) into parameter (torch.Size([0]))"): the
syncs below send the tensors a CPU engine can take (norms, embeddings, lm_head). ``graphtrace_test_mode("copy")`` (the correct kernel) writes the
new values into the tensor the graphs captured; ``"rebind"`` (the bug) binds a new tensor.

TRL's own code runs; the other frameworks' sequences are replayed as they run them (read from
their sources; see docs/vllm.md, "RL frameworks: check before serve"):

* TRL 1.16.0 colocate, its real code (installed in the vLLM venv):
  ``trl/generation/vllm_generation.py``, ``VLLMGeneration.sync_weights`` with ``mode ==
  "colocate"``: per parameter of the trainer's model
  ``llm.llm_engine.model_executor.driver_worker.model_runner.model.load_weights(
  [(name, param)])``, then ``llm.reset_prefix_cache()``: `trl_sync` (`trl_generation`).
* OpenRLHF 0.11.2 (``openrlhf/trainer/ray/vllm_worker_wrap.py``, ``WorkerWrap.update_weight``): per
  parameter ``collective_rpc("update_weight", ...)``, each loading one tensor with
  ``self.model_runner.model.load_weights(weights=[(name, weight)])``: `update_weight`.
* verl 0.9.1 (``verl/workers/rollout/vllm_rollout/utils.py``,
  ``vLLMColocateWorkerExtension.update_weights_from_ipc``): ``model.load_weights(bucket)`` per
  received bucket (``_update_weights``), then ``process_weights_after_loading(model,
  model_config, self.device)`` once, imported at the call
  (``vllm.model_executor.model_loader.utils``): `update_weights_from_ipc`.
"""

from __future__ import annotations

import torch

HOLDER = "model.layers.0.self_attn.qkv_proj.injected_scale"


def failure(exc: BaseException) -> dict:
    """An exception as the *_run.py scripts report it: its type and message, the problems'
    owners (`StaleGraphError`), what it hides or was raised from, and its traceback's tail."""
    import traceback

    problems = getattr(exc, "problems", None)
    return {"ok": False, "type": type(exc).__name__, "message": str(exc)[:3000],
            "owners": sorted(set(problems["owners"])) if problems is not None else None,
            "context": type(exc.__context__).__name__ if exc.__context__ else None,
            "cause": type(exc.__cause__).__name__ if exc.__cause__ else None,
            "traceback": "".join(traceback.format_exception(exc))[-3000:]}
_FIRST: dict[int, torch.Tensor] = {}  # the tensor the graphs captured, per layer


def _layer(worker):
    return worker.model_runner.get_model().model.layers[0].self_attn.qkv_proj


def _ones(layer) -> torch.Tensor:
    return torch.ones(layer.output_size_per_partition, dtype=layer.weight.dtype)


def _derive(layer) -> None:
    """What the layer's weight processing does with its derived tensor."""
    if getattr(layer, "graphtrace_test_mode", "copy") == "rebind":
        layer.injected_scale = _ones(layer)  # the bug: a new tensor
    else:  # the fix: the captured tensor, new values written into it
        layer.injected_scale = _FIRST[id(layer)]
        layer.injected_scale.copy_(_ones(layer))


def _apply_scale(module, args, output):
    out = output[0] if isinstance(output, tuple) else output
    out.mul_(module.injected_scale)  # in place: the output is unchanged (ones)


def _checkpoint(folder: str, loadable: bool = True) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors (``loadable``: those a CPU engine's load_weights takes)."""
    from graphtrace.vllm import tiny

    return {n: t for n, t in tiny.checkpoint_weights(folder)
            if not (loadable and n.endswith("_proj.weight"))}


class ServeTestExtension:
    def graphtrace_test_inject(self) -> str:
        """Add the derived holder (before the first capture)."""
        layer = _layer(self)
        method = layer.quant_method
        original = method.process_weights_after_loading

        def process_weights_after_loading(target):
            original(target)
            if target is layer:
                _derive(target)

        method.process_weights_after_loading = process_weights_after_loading
        layer.injected_scale = _ones(layer)
        _FIRST[id(layer)] = layer.injected_scale  # off the model: not a second owner
        layer.register_forward_hook(_apply_scale)
        self.graphtrace_test_loader()
        return HOLDER

    def graphtrace_test_loader(self) -> None:
        """Derive the holder in the qkv weight's loader too (TRL and OpenRLHF run no PWAL);
        again after a reload, which may give the layer new parameters."""
        layer = _layer(self)
        param = self.model_runner.get_model().model.layers[0].input_layernorm.weight
        from vllm.model_executor.model_loader.weight_utils import default_weight_loader

        loader = getattr(param, "weight_loader", None) or default_weight_loader
        if getattr(loader, "graphtrace_test", False):
            return

        def weight_loader(*args, **kwargs):
            out = loader(*args, **kwargs)
            _derive(layer)
            return out

        weight_loader.graphtrace_test = True
        param.weight_loader = weight_loader

    def graphtrace_test_mode(self, mode: str) -> str:
        """``copy`` (the correct kernel) or ``rebind`` (the bug), from now on."""
        _layer(self).graphtrace_test_mode = mode
        self.graphtrace_test_loader()
        return mode

    def graphtrace_test_pid(self) -> int:
        import os

        return os.getpid()

    def graphtrace_test_holder_is_captured(self) -> bool:
        layer = _layer(self)
        return layer.injected_scale is _FIRST[id(layer)]

    # -- vLLM's weight-transfer session (xfer_run.py) ----------------------------------------
    def graphtrace_test_transfer(self) -> dict:
        """The worker's weight-transfer engine and vLLM's record of an open session."""
        engine = self.weight_transfer_engine
        return {"engine": type(engine).__name__ if engine is not None else None,
                "active": self._weight_update_active}

    def graphtrace_test_session_derive(self) -> None:
        """The session's final processing derives the holder again (`_derive`), after vLLM's
        own (``finalize_layerwise_reload``): the rebinding comes at the session's end, as
        verl's comes in its final ``process_weights_after_loading``. (The chunks below carry
        no linear weight, so ``finalize_layerwise_reload`` puts the linear layers' kernel
        tensors back without running their weight processing.)"""
        engine = self.weight_transfer_engine
        if "finish_weight_update" in engine.__dict__:
            return
        finish = engine.finish_weight_update
        layer = _layer(self)

        def finish_weight_update():
            finish()
            _derive(layer)

        engine.finish_weight_update = finish_weight_update

    def graphtrace_test_receive(self, names: list[str], folder: str) -> int:
        """One chunk of a session, the CPU half of ``IPCWeightTransferEngine.receive_weights``
        (vllm/distributed/weight_transfer/ipc_engine.py): its transport rebuilds the trainer's
        tensors from CUDA IPC handles (``torch.cuda.get_device_properties``,
        ``rebuild_cuda_tensor``), which needs a GPU; here they are read from the checkpoint
        ``folder``. What it does with them is this, verbatim: ``self.model.load_weights(weights)``
        under ``disable_mtp_completeness_check()``, on the engine's model."""
        from vllm.model_executor.model_loader.mtp_validation import (
            disable_mtp_completeness_check,
        )

        tensors = _checkpoint(folder)
        weights = [(name, tensors[name]) for name in names]
        with disable_mtp_completeness_check():
            self.weight_transfer_engine.model.load_weights(weights)
        return len(weights)

    # -- the clients' weight sync, worker side ----------------------------------------------
    def update_weight(self, name: str, folder: str) -> int:
        """OpenRLHF's ``WorkerWrap.update_weight``: one tensor per call (here read from the
        checkpoint ``folder`` instead of an NCCL broadcast)."""
        cache = self.__dict__.setdefault("_graphtrace_test_cache", {})
        if folder not in cache:
            cache.clear()
            cache[folder] = _checkpoint(folder)
        weight = cache[folder][name]
        return len(self.model_runner.model.load_weights(weights=[(name, weight)]))

    def update_weights_from_ipc(self, folder: str, bucket_size: int = 4) -> int:
        """verl 0.9's ``update_weights_from_ipc``: ``load_weights`` per bucket, then
        ``process_weights_after_loading`` once."""
        from vllm.model_executor.model_loader import utils

        model = self.model_runner.model
        items = list(_checkpoint(folder).items())
        buckets = [items[i:i + bucket_size] for i in range(0, len(items), bucket_size)]
        for bucket in buckets:
            model.load_weights(bucket)
        device = next(model.parameters()).device
        utils.process_weights_after_loading(model, self.model_runner.model_config, device)
        return len(buckets)


def trainer_model(folder: str) -> torch.nn.Module:
    """The trainer's Hugging Face model with the weights of ``folder``, as TRL holds it
    (``transformers.LlamaForCausalLM``), its ``*_proj`` linear weights left out: a CPU
    engine cannot take them by ``load_weights`` (above), and TRL pushes every parameter of
    ``named_parameters()``."""
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32)
    for name, module in model.named_modules():
        if name.endswith("_proj"):
            del module.weight  # unregistered: named_parameters() no longer yields it
    return model


def trl_generation(llm, folder: str):
    """TRL 1.16.0's own ``VLLMGeneration`` (``trl/generation/vllm_generation.py``), colocate
    mode, owning ``llm``. Its ``__init__`` would build the ``LLM`` itself (``_init_vllm``: TRL's
    GPU settings, ``distributed_executor_backend="external_launcher"``, no worker extension
    for the injected holder); the object is made without it, holding what ``sync_weights``
    reads: ``model``, ``accelerator`` (a real ``accelerate.Accelerator`` on CPU), ``_dist``
    (TRL's ``DistributedBackend``), ``mode``, ``enable_sleep_mode``, ``llm``."""
    from accelerate import Accelerator
    from trl.distributed import DistributedBackend
    from trl.generation.vllm_generation import VLLMGeneration

    gen = llm.__dict__.get("_graphtrace_test_trl")
    if gen is None:
        gen = VLLMGeneration.__new__(VLLMGeneration)
        gen.accelerator = Accelerator(cpu=True)
        gen._dist = DistributedBackend(gen.accelerator)
        gen.mode = "colocate"
        gen.enable_sleep_mode = False
        gen.llm = llm
        llm.__dict__["_graphtrace_test_trl"] = gen
    gen.model = trainer_model(folder)  # a training step changed the trainer's weights
    return gen


def trl_sync(llm, folder: str) -> int:
    """TRL's real colocate sync: ``VLLMGeneration.sync_weights()`` (its
    ``_iter_named_params``, one ``load_weights([(name, param)])`` per parameter on
    ``llm.llm_engine.model_executor.driver_worker.model_runner.model``, then
    ``llm.reset_prefix_cache()``)."""
    gen = trl_generation(llm, folder)
    gen.sync_weights()
    return sum(1 for _ in gen.model.named_parameters())


def openrlhf_sync(llm, folder: str) -> int:
    """OpenRLHF: one ``collective_rpc("update_weight")`` per tensor."""
    names = list(_checkpoint(folder))
    for name in names:
        llm.collective_rpc("update_weight", kwargs={"name": name, "folder": folder})
    return len(names)


def verl_sync(llm, folder: str) -> int:
    """verl: one ``collective_rpc("update_weights_from_ipc")``: buckets, then PWAL once."""
    return llm.collective_rpc("update_weights_from_ipc", kwargs={"folder": folder})[0]


def inplace_sync(llm, folder: str) -> int:
    """A client's own sync in one process, through no hooked entry point: each loadable tensor
    written in place into the worker model's parameter (``p.copy_``, under no_grad), then its
    own weight processing derives the holder again (`_derive`: a new tensor under "rebind").
    Only the parameters' version counters see it (Note [in-place writes] in
    graphtrace/serving.py)."""
    worker = llm.llm_engine.model_executor.driver_worker
    params = dict(worker.model_runner.model.named_parameters())
    n = 0
    with torch.no_grad():
        for name, tensor in _checkpoint(folder).items():
            if name in params:
                params[name].copy_(tensor)
                n += 1
    _derive(_layer(worker))
    return n


def reload_sync(llm, folder: str) -> int:
    """vLLM's own ``reload_weights`` (a whole update: checked when it returns)."""
    llm.collective_rpc("reload_weights", kwargs={"weights_path": folder})
    return 1


async def openrlhf_async_sync(engine, folder: str) -> int:
    """OpenRLHF's sequence against an ``AsyncLLM`` (its async vLLM engine): one
    ``await engine.collective_rpc("update_weight")`` per tensor."""
    names = list(_checkpoint(folder))
    for name in names:
        await engine.collective_rpc("update_weight", kwargs={"name": name, "folder": folder})
    return len(names)


async def verl_async_sync(engine, folder: str) -> int:
    """verl's async rollout (an ``AsyncLLM``): one ``collective_rpc("update_weights_from_ipc")``."""
    return (await engine.collective_rpc("update_weights_from_ipc",
                                        kwargs={"folder": folder}))[0]


ASYNC_SYNCS = {"openrlhf": openrlhf_async_sync, "verl": verl_async_sync}

SYNCS = {"trl": trl_sync, "openrlhf": openrlhf_sync, "verl": verl_sync, "inplace": inplace_sync,
         "reload": reload_sync}
