"""What graphtrace relies on in each SGLang release, in one table.

Every SGLang name the adapter uses (graphtrace/sglang/plugin.py, session.py, compiled.py) is
a `Target` of a `Release` row here, read by role (``rel.target("load_model")``), never
spelled out in the adapter. A row also holds the release's facts the adapter reads: whether
SGLang loads plugins at all (``plugins``: ``sglang.srt.plugins``, its ``load_plugins()`` and
``HookRegistry``), which update entry points begin and end an update, the attributes the
adapter reads on SGLang's objects. The contract (graphtrace/sglang/contract.py;
tests/sglang/test_contract.py, ``make test-sglang-contract``) checks each row against the
release's own package.

Note [a target gone at plugin load]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
SGLang's ``HookRegistry.apply_hooks`` logs a traceback for a target it cannot resolve and
goes on: the engine would serve with that hook missing and nothing in graphtrace's output
saying so. So ``register()`` resolves every hook target of the row first
(``plugin.unguarded_targets``): one it cannot find is not registered, the log says which
(module, class, attribute), and the scheduler's trace carries a blind spot naming it, so the
report says what is not guarded (fail open: the engine keeps serving).
``GRAPHTRACE_STRICT=1`` raises instead, naming the targets. An installed release not in the
table is run with the newest row, and said so in the log and the blind spot.
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["Target", "Release", "RELEASES", "SUPPORTED", "release", "installed_version",
           "running", "UPDATER_METHODS"]


@dataclass(frozen=True)
class Target:
    """One SGLang name graphtrace uses: ``module`` and ``qualname`` (``Class.attr`` or a module
    function); ``hook``: how the adapter uses it (``around`` / ``before``: an SGLang
    ``HookRegistry`` hook; ``call``: called or read directly); ``call``: the (args, kwargs)
    the adapter's use passes after the instance, checked against the signature."""
    module: str
    qualname: str
    hook: str = "call"
    call: tuple[tuple, dict] | None = ((), {})

    @property
    def target(self) -> str:
        """``module:qualname`` (the contract's and the error's name)."""
        return f"{self.module}:{self.qualname}"

    @property
    def dotted(self) -> str:
        """``module.qualname``: the path SGLang's ``HookRegistry.register`` takes."""
        return f"{self.module}.{self.qualname}"

    @property
    def method(self) -> bool:
        return "." in self.qualname


@dataclass(frozen=True)
class Release:
    """One SGLang release's facts (module docs). ``targets``: role -> `Target`;
    ``attrs``: ``module:Class`` -> the attributes the adapter reads on its instances (set in
    SGLang's code, read with ``ast``); ``plugins``: SGLang loads ``sglang.srt.plugins``
    entry points (without it graphtrace never runs inside the engine)."""
    version: str
    targets: dict[str, Target]
    plugins: bool
    update_begins: tuple[str, ...]
    complete_updates: tuple[str, ...]
    attrs: dict[str, tuple[str, ...]] = field(default_factory=dict)
    abort_kwargs: dict = field(default_factory=dict)  # passed to Req.set_finish_with_abort
    runs_here: str = ""
    notes: tuple[str, ...] = ()

    def target(self, role: str) -> Target | None:
        """The target of ``role``; None where this release has none (the adapter does
        without: e.g. no ``model_context`` before 0.5.23)."""
        return self.targets.get(role)

    def hooks(self) -> dict[str, Target]:
        """The roles registered as SGLang hooks."""
        return {r: t for r, t in self.targets.items() if t.hook != "call"}


# SGLang's weight-update entry points (SchedulerWeightUpdaterManager): which begin an update,
# and which end one (checked when they return: `ServingCore.complete`). A session's tensor,
# distributed and IPC loads are inside begin .. end; a load outside a session is checked
# before the next request is served.
UPDATER_METHODS = ("begin_weight_update", "update_weights_from_tensor",
                   "update_weights_from_distributed", "update_weights_from_ipc",
                   "update_weights_from_disk", "release_memory_occupation",
                   "end_weight_update", "resume_memory_occupation")
_BEGINS = ("begin_weight_update", "update_weights_from_tensor",
           "update_weights_from_distributed", "update_weights_from_ipc",
           "update_weights_from_disk", "release_memory_occupation")
_COMPLETES = ("end_weight_update", "update_weights_from_disk", "resume_memory_occupation")

_RUNNER = "sglang.srt.model_executor.model_runner"
_UPDATER = "sglang.srt.managers.scheduler_components.weight_updater"
_RUNNERS = "sglang.srt.model_executor.runner"


def _targets_0523() -> dict[str, Target]:
    out = {
        "hook_registry": Target("sglang.srt.plugins.hook_registry", "HookRegistry.register",
                                call=(("target", "hook", "type"), {})),
        "load_model": Target(_RUNNER, "ModelRunner.load_model", "around"),
        "init_cuda_graphs": Target(_RUNNER, "ModelRunner.init_cuda_graphs", "around"),
        "enqueue": Target("sglang.srt.managers.scheduler", "Scheduler._add_request_to_queue",
                          "before", (("req",), {})),
        "scheduler": Target("sglang.srt.managers.scheduler", "Scheduler", call=None),
        "abort": Target("sglang.srt.managers.schedule_batch", "Req.set_finish_with_abort",
                        call=(("message",), {"err_type": "StaleGraphError"})),
        "cpu_graph_capture": Target("sglang.srt.model_executor.cpu_graph_runner",
                                    "CPUGraphRunner.capture_one_batch_size", "around",
                                    ((1, "forward"), {})),
        "dummy_run": Target(f"{_RUNNERS}.base_runner", "BaseRunner._dummy_run",
                            call=((1,), {"buffers": None})),
        "model_context": Target(f"{_RUNNERS}.base_runner", "BaseRunner.model_context"),
        "autotune_buffers": Target(f"{_RUNNERS}.eager_runner", "EagerRunner._autotune_buffers"),
        "tp_group": Target("sglang.srt.distributed.parallel_state", "get_tp_group"),
        "parallel": Target("sglang.srt.runtime_context", "get_parallel"),
    }
    out.update({f"update:{m}": Target(_UPDATER, f"SchedulerWeightUpdaterManager.{m}", "around",
                                      (("recv_req",), {}))
                for m in UPDATER_METHODS})
    return out


_ATTRS_0523 = {
    f"{_RUNNER}:ModelRunner": ("model", "eager_runner", "decode_cuda_graph_runner",
                               "attn_backend", "token_to_kv_pool"),
    "sglang.srt.model_executor.cpu_graph_runner:CPUGraphRunner": ("model_runner",),
    "sglang.srt.distributed.parallel_state:GroupCoordinator": ("rank_in_group", "world_size"),
}

def _targets_0515() -> dict[str, Target]:
    """0.5.15.post1 (slime's newest patched release): no weight-update session
    (``begin_weight_update`` / ``end_weight_update``), no ``BaseRunner.model_context``,
    ``Req.set_finish_with_abort(error_msg)`` without ``err_type``."""
    out = {r: t for r, t in _targets_0523().items()
           if r not in ("update:begin_weight_update", "update:end_weight_update",
                        "model_context")}
    out["abort"] = Target("sglang.srt.managers.schedule_batch", "Req.set_finish_with_abort",
                          call=(("message",), {}))
    return out


def _targets_057() -> dict[str, Target]:
    """0.5.7 (AReaL's pin): what exists at the same names. It has no ``sglang.srt.plugins``
    (no plugin loader, no ``HookRegistry``): graphtrace cannot run inside it at all."""
    keep = ("load_model", "enqueue", "scheduler", "cpu_graph_capture", "tp_group")
    out = {r: t for r, t in _targets_0523().items() if r in keep}
    out["abort"] = Target("sglang.srt.managers.schedule_batch", "Req.set_finish_with_abort",
                          call=(("message",), {}))
    out.update({f"update:{m}": Target("sglang.srt.managers.scheduler_update_weights_mixin",
                                      f"SchedulerUpdateWeightsMixin.{m}", "around",
                                      (("recv_req",), {}))
                for m in UPDATER_METHODS if m not in ("begin_weight_update",
                                                      "end_weight_update")})
    return out


_KV_MIXIN = "sglang.srt.model_executor.model_runner_kv_cache_mixin:ModelRunnerKVCacheMixin"
_ATTRS_0515 = {
    f"{_RUNNER}:ModelRunner": ("model", "eager_runner", "decode_cuda_graph_runner",
                               "attn_backend"),
    _KV_MIXIN: ("token_to_kv_pool",),
    **{k: v for k, v in _ATTRS_0523.items() if not k.startswith(f"{_RUNNER}:")},
}
# without a session, tensor / distributed / IPC loads are checked before the next request
_COMPLETES_0515 = ("update_weights_from_disk", "resume_memory_occupation")
_BEGINS_0515 = tuple(m for m in _BEGINS if m != "begin_weight_update")

RELEASES: dict[str, Release] = {
    "0.5.23": Release(
        "0.5.23", _targets_0523(), plugins=True, update_begins=_BEGINS,
        complete_updates=_COMPLETES, attrs=_ATTRS_0523,
        abort_kwargs={"err_type": "StaleGraphError"},
        runs_here="the real engine on CPU (.venv-sglang): every test in tests/sglang/"),
    "0.5.15.post1": Release(
        "0.5.15.post1", _targets_0515(), plugins=True, update_begins=_BEGINS_0515,
        complete_updates=_COMPLETES_0515, attrs=_ATTRS_0515,
        runs_here="its Python package read as source (make test-sglang-contract); no engine",
        notes=("its modules do not import over 0.5.23's environment (transformers there "
               "already registers 'qwen3_asr'), so the contract reads their source",)),
    "0.5.7": Release(
        "0.5.7", _targets_057(), plugins=False, update_begins=(), complete_updates=(),
        attrs={f"{_RUNNER}:ModelRunner": ("model", "attn_backend")},
        runs_here="its Python package read as source (make test-sglang-contract); no engine",
        notes=("no sglang.srt.plugins: SGLang never loads graphtrace's entry point",
               "no ModelRunner.init_cuda_graphs, runner/ package, runtime_context, "
               "scheduler_components/ (the updates are SchedulerUpdateWeightsMixin's)")),
}
SUPPORTED = tuple(v for v, r in RELEASES.items() if r.plugins)  # graphtrace runs inside these


def installed_version() -> str:
    """The installed SGLang's version (``sglang.version.__version__``, read without
    importing SGLang's package root)."""
    from importlib import import_module

    return import_module("sglang.version").__version__


def release(version: str | None = None) -> Release:
    """The row for ``version`` (None: the installed SGLang's). Raises ``LookupError`` naming
    the releases in the table for any other."""
    version = version or installed_version()
    key = version.split("+")[0]
    if key not in RELEASES:
        raise LookupError(f"SGLang {version} is not a supported release (supported: "
                          f"{', '.join(RELEASES)}; docs/sglang.md, 'Supported versions')")
    return RELEASES[key]


def running() -> tuple[Release, str | None]:
    """(row, note) for the SGLang this process runs: its own row, or the newest supported
    row with a note saying so when the release is not in the table (or SGLang's version
    cannot be read)."""
    try:
        version = installed_version()
        rel = release(version)
        if rel.plugins:
            return rel, None
    except Exception as exc:
        version = f"? ({type(exc).__name__}: {exc})"
    newest = RELEASES[SUPPORTED[0]]
    return newest, (f"SGLang {version} is not a release graphtrace supports (supported: "
                    f"{', '.join(SUPPORTED)}); its targets are taken from the {newest.version} "
                    "row")
